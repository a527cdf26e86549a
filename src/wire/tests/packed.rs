//! The packed heartbeat (`HBP:`, form 5): exact bytes, every error, the
//! six-bit SWAR against a scalar reference, and random round trips.

use super::super::packed::{decode_record, encode_record, fold48, spread48};
use super::*;

fn packed_of(msg: &[u8]) -> Vec<CompactEntry> {
    match decode(msg) {
        Ok(Notification::PackedHeartbeat(e)) => e.collect(),
        other => panic!("not a packed heartbeat: {other:?}"),
    }
}

fn collect_packed(entries: &[CompactEntry], max_len: usize) -> (Vec<Vec<u8>>, EncodeStats) {
    let mut scratch = vec![0u8; max_len];
    let mut out = Vec::new();
    let stats = encode_packed_heartbeats(entries.iter().copied(), max_len, &mut scratch, |m| {
        out.push(m.to_vec())
    })
    .expect("encode");
    (out, stats)
}

/// The record as the module docs define it, digit by digit.
fn scalar_record(slot: u32, nonce: u64) -> [u8; PACKED_RECORD_LEN] {
    let v = u128::from(slot) | (u128::from(nonce) << 32);
    core::array::from_fn(|k| 0x40 | ((v >> (6 * k)) & 0x3f) as u8)
}

#[test]
fn packed_exact_bytes() {
    let e = [
        CompactEntry {
            slot: 7,
            nonce: nonce(0xff),
        },
        CompactEntry {
            slot: u32::MAX,
            nonce: nonce(u64::MAX),
        },
    ];
    let (m, s) = collect_packed(&e, 4 + 32);
    let mut want = b"HBP:G@@@@|O@@@@@@@@@".to_vec();
    want.extend_from_slice(&[0x7f; 16]);
    assert_eq!(m, [want]);
    assert_eq!((s.messages, s.entries, s.skipped), (1, 2, 0));
    assert_eq!(packed_of(&m[0]), e);
    // ASCII, hence UTF-8, and free of the text forms' separators.
    let body = &m[0][4..];
    assert!(body.iter().all(|&c| (0x40..=0x7f).contains(&c)));
    assert!(core::str::from_utf8(&m[0]).is_ok());
}

#[test]
fn packed_record_matches_the_scalar_definition() {
    let mut rng = Rng::new(0x6b17);
    let edge = [
        0,
        1,
        0x3f,
        0x40,
        0xffff,
        0x1_0000,
        u64::from(u32::MAX),
        u64::MAX,
    ];
    for i in 0..20_000u64 {
        let slot = if i < 8 {
            edge[i as usize] as u32
        } else {
            rng.next_u64() as u32
        };
        let raw = if i < 64 {
            edge[(i % 8) as usize]
        } else {
            rng.next_u64() >> rng.below(64)
        };
        let Some(n) = Nonce::new(raw) else { continue };
        let rec = encode_record(CompactEntry { slot, nonce: n });
        assert_eq!(rec, scalar_record(slot, raw), "{slot:#x} {raw:#x}");
        assert_eq!(decode_record(&rec), (slot, raw));
    }
    // The 48-bit fold and spread are inverses on every digit lane.
    for k in 0..8 {
        for d in 0..64u64 {
            let x = d << (6 * k);
            assert_eq!(fold48(spread48(x)), x);
        }
    }
}

#[test]
fn property_packed_batches_roundtrip() {
    let mut rng = Rng::new(43);
    for case in 0..2_000 {
        let max_len = 20 + rng.below(200) as usize;
        let n = rng.below(30) as usize;
        let entries: Vec<CompactEntry> = (0..n)
            .map(|_| CompactEntry {
                slot: rng.next_u64() as u32,
                nonce: Nonce::new(rng.next_u64()).unwrap_or(nonce(1)),
            })
            .collect();
        let (msgs, stats) = collect_packed(&entries, max_len);
        let per = (max_len - 4) / PACKED_RECORD_LEN;
        assert_eq!(stats.messages as usize, n.div_ceil(per), "case {case}");
        assert_eq!((stats.entries as usize, stats.skipped), (n, 0));
        assert!(msgs.iter().all(|m| m.len() <= max_len));
        let back: Vec<_> = msgs.iter().flat_map(|m| packed_of(m)).collect();
        assert_eq!(back, entries, "case {case}");
    }
}

#[test]
fn packed_errors() {
    let good = encode_record(CompactEntry {
        slot: 3,
        nonce: nonce(9),
    });
    let msg = |body: &[u8]| [PACKED_HEARTBEAT_PREFIX, body].concat();
    assert_eq!(decode(b"HBP:"), Err(WireError::NoEntries));
    assert_eq!(decode(&msg(&good[..15])), Err(WireError::Truncated));
    assert_eq!(
        decode(&msg(&[good, good].concat()[..31])),
        Err(WireError::Truncated)
    );
    // Every byte outside 0x40..=0x7f, in every position, fails the message.
    for pos in 0..PACKED_RECORD_LEN {
        for bad in [0x00, 0x2c, 0x3a, 0x3f, 0x80, 0xbf, 0xc0, 0xff] {
            let mut r = good;
            r[pos] = bad;
            assert_eq!(
                decode(&msg(&[good, r].concat())),
                Err(WireError::BadPackedDigit),
                "{pos} {bad:#x}"
            );
        }
    }
    // Nonce 0 in any record, whatever its slot.
    let mut zero = scalar_record(u32::MAX, 0);
    assert_eq!(
        decode(&msg(&[good, zero].concat())),
        Err(WireError::ZeroNonce)
    );
    zero = scalar_record(0, 0);
    assert_eq!(decode(&msg(&zero)), Err(WireError::ZeroNonce));
    // Each single nonce bit is a non-zero nonce (the zero test's mask is exact).
    for bit in 0..64 {
        let r = scalar_record(u32::MAX, 1 << bit);
        assert_eq!(packed_of(&msg(&r))[0].nonce.get(), 1 << bit);
    }
}

#[test]
fn packed_iterator_is_exact() {
    let a = CompactEntry {
        slot: 1,
        nonce: nonce(1),
    };
    let b = CompactEntry {
        slot: 2,
        nonce: nonce(2),
    };
    let (m, _) = collect_packed(&[a, b], 64);
    let Ok(Notification::PackedHeartbeat(mut it)) = decode(&m[0]) else {
        panic!()
    };
    assert_eq!(it.len(), 2);
    assert_eq!(it.next(), Some(a));
    assert_eq!(it.len(), 1);
    assert_eq!(it.as_bytes(), &encode_record(b));
    assert_eq!(it.next(), Some(b));
    assert!(it.is_empty());
    assert_eq!(it.next(), None);
}

#[test]
fn a_read_done_for_an_id_that_looks_packed_is_refused() {
    let mut buf = [0u8; 64];
    for id in ["HBP", "HBP:x"] {
        assert_eq!(
            encode_read_done(id, 1, None, &mut buf),
            Err(WireError::AmbiguousId),
            "{id}"
        );
    }
    assert!(encode_read_done("HBPx", 1, None, &mut buf).is_ok());
}

#[test]
fn packed_encoder_limits() {
    let e = [CompactEntry {
        slot: 1,
        nonce: nonce(1),
    }];
    let mut scratch = [0u8; 64];
    assert_eq!(
        encode_packed_heartbeats(e, 19, &mut scratch, |_| {}),
        Err(WireError::MessageTooSmall)
    );
    assert_eq!(
        encode_packed_heartbeats(e, 65, &mut scratch, |_| {}),
        Err(WireError::BufferTooSmall)
    );
    let (m, _) = collect_packed(&e, 20);
    assert_eq!(m[0].len(), 20);
}
