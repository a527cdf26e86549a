use super::*;

// -- SWAR hex against a scalar reference ------------------------------

fn scalar_hex(bytes: &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for &b in bytes {
        let d = (b as char).to_digit(16)?;
        v = (v << 4) | u64::from(d);
    }
    Some(v)
}

/// The SWAR decoder accepts exactly the words the scalar one does, with the
/// same value.
fn assert_swar_hex_agrees(d: [u8; 8]) {
    let x = u64::from_le_bytes(d);
    let want = scalar_hex(&d);
    assert_eq!(hex8_valid(x), want.is_some(), "{d:?}");
    if let Some(w) = want {
        assert_eq!(u64::from(hex8_value(x)), w, "{d:?}");
    }
}

#[test]
fn swar_hex_decode_matches_scalar_for_every_byte_in_every_lane() {
    let bases: [&[u8; 8]; 4] = [b"00000000", b"ffffffff", b"9aF0c3E1", b"12345678"];
    for base in bases {
        for lane in 0..8 {
            for b in 0..=255u8 {
                let mut d = *base;
                d[lane] = b;
                assert_swar_hex_agrees(d);
            }
        }
    }
}

#[test]
fn swar_hex_decode_random_words() {
    let mut rng = Rng::new(0x1234);
    let alphabet = b"0123456789abcdefABCDEF";
    for _ in 0..200_000 {
        // Mostly valid digits, sometimes anything.
        let mut d = [0u8; 8];
        for b in &mut d {
            *b = if rng.below(8) == 0 {
                rng.next_u64() as u8
            } else {
                alphabet[rng.below(alphabet.len() as u64) as usize]
            };
        }
        assert_swar_hex_agrees(d);
    }
}

#[test]
fn swar_hex_encode_matches_format() {
    let mut rng = Rng::new(99);
    let check = |v: u64| {
        assert_eq!(encode_u64_hex(v), format!("{v:016x}").as_bytes(), "{v:x}");
        let v32 = v as u32;
        assert_eq!(encode_u32_hex(v32), format!("{v32:08x}").as_bytes());
    };
    for v in [
        0,
        1,
        9,
        10,
        15,
        16,
        u64::MAX,
        0x0123_4567_89ab_cdef,
        0xa5a5_a5a5_5a5a_5a5a,
    ] {
        check(v);
    }
    for shift in 0..64 {
        check(1 << shift);
        check(0xf << (shift & !3));
    }
    for _ in 0..100_000 {
        check(rng.next_u64());
    }
}

/// Up to 39 bytes, mostly letters: one in `one_in` a comma, as often any
/// byte at all.
fn id_like_bytes(rng: &mut Rng, one_in: u64) -> Vec<u8> {
    let len = rng.below(40) as usize;
    (0..len)
        .map(|_| match rng.below(one_in) {
            0 => b',',
            1 => rng.next_u64() as u8,
            _ => b'a' + rng.below(26) as u8,
        })
        .collect()
}

#[test]
fn swar_find_comma_matches_position() {
    let mut rng = Rng::new(5);
    for _ in 0..50_000 {
        let b = id_like_bytes(&mut rng, 6);
        assert_eq!(find_comma(&b), b.iter().position(|&c| c == b','), "{b:?}");
    }
    // Every byte value in every lane, and a comma after lanes that borrow.
    for lane in 0..16 {
        for v in 0..=255u8 {
            let mut b = [b'x'; 16];
            b[lane] = v;
            assert_eq!(find_comma(&b), b.iter().position(|&c| c == b','));
            b[15] = b',';
            assert_eq!(find_comma(&b), b.iter().position(|&c| c == b','));
        }
    }
}

#[test]
fn swar_has_comma_matches_contains() {
    let mut rng = Rng::new(6);
    for _ in 0..50_000 {
        let b = id_like_bytes(&mut rng, 30);
        assert_eq!(has_comma(&b), b.contains(&b','), "{b:?}");
    }
    for len in 0..20 {
        for at in 0..len {
            let mut b = vec![b'x'; len];
            assert!(!has_comma(&b));
            b[at] = b',';
            assert!(has_comma(&b), "len {len} at {at}");
        }
    }
}

#[test]
fn decimal_roundtrip() {
    for v in [
        1u32,
        9,
        10,
        99,
        100,
        12345,
        999_999_999,
        1_000_000_000,
        u32::MAX,
    ] {
        let id = "r";
        let mut out = [0u8; 32];
        let n = encode_read_done(id, v, None, &mut out).unwrap();
        assert_eq!(&out[..n], format!("r:{v}").as_bytes());
        assert_eq!(read_done_len(id, v, None), n);
        assert_eq!(parse_consumers(&out[2..n]), Ok(v));
    }
}

// -- The compact body's fast path against a record-by-record reference --

/// `decode_compact`'s verdict, written the slow way: the first bad record
/// names the error (slot before nonce), as the loop behind the fast path does.
fn scalar_compact(body: &[u8]) -> Result<(), WireError> {
    if body.is_empty() {
        return Err(WireError::NoEntries);
    }
    if body.len() % COMPACT_RECORD_LEN != 0 {
        return Err(WireError::Truncated);
    }
    for rec in body.chunks(COMPACT_RECORD_LEN) {
        scalar_hex(&rec[..8]).ok_or(WireError::BadSlot)?;
        let hi = scalar_hex(&rec[8..16]).ok_or(WireError::BadNonce)?;
        let lo = scalar_hex(&rec[16..]).ok_or(WireError::BadNonce)?;
        if hi == 0 && lo == 0 {
            return Err(WireError::ZeroNonce);
        }
    }
    Ok(())
}

#[test]
fn compact_fast_path_agrees_with_the_record_loop_for_every_byte_in_every_position() {
    // Three records, so a bad byte lands in the first, a middle and the last.
    let good = b"0000000700000000000000ffABCDEF0123456789abcdef01FFFFFFFFffffffffffffffff";
    let zero_nonce_last =
        b"000000070000000000000001000000010000000000000002000000030000000000000000";
    for base in [&good[..], &zero_nonce_last[..]] {
        for pos in 0..base.len() {
            for b in 0..=255u8 {
                let mut body = base.to_vec();
                body[pos] = b;
                let want = scalar_compact(&body);
                let got = decode_compact(&body).map(|_| ());
                assert_eq!(got, want, "byte {b:#04x} at {pos}");
            }
        }
    }
}
