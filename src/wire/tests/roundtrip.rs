use super::*;

// -- property: random batches round-trip -------------------------------

pub(super) fn random_id(rng: &mut Rng) -> String {
    // ASCII, the separators, multi-byte UTF-8 and the heartbeat prefixes.
    const PIECES: &[&str] = &[
        "a", "b", "z", "0", "9", "-", "_", ":", ",", "é", "€", "😀", "HB", "HB:", "HBC:", "cmpl-",
        "nonce=",
    ];
    let n = match rng.below(10) {
        0 => 0,
        1 => 20 + rng.below(40) as usize, // often too long for the limit
        _ => 1 + rng.below(8) as usize,
    };
    (0..n)
        .map(|_| PIECES[rng.below(PIECES.len() as u64) as usize])
        .collect()
}

#[test]
fn property_heartbeat_batches_roundtrip() {
    let mut rng = Rng::new(0x6b76_6c65_6173_6521);
    for case in 0..3_000 {
        let max_len = 4 + rng.below(80) as usize;
        let n = rng.below(40) as usize;
        let ids: Vec<String> = (0..n).map(|_| random_id(&mut rng)).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let (msgs, stats) = collect_hb(&refs, max_len);

        let encodable: Vec<&str> = refs
            .iter()
            .copied()
            .filter(|id| check_heartbeat_id(id).is_ok() && id.len() <= max_len - 3)
            .collect();
        let decoded: Vec<Vec<&str>> = msgs.iter().map(|m| ids_of(m)).collect();
        let flat: Vec<&str> = decoded.iter().flatten().copied().collect();
        assert_eq!(flat, encodable, "case {case}, max_len {max_len}");
        assert_eq!(stats.messages as usize, msgs.len());
        assert_eq!(stats.entries as usize, encodable.len());
        assert_eq!(stats.skipped as usize, n - encodable.len());
        for (i, m) in msgs.iter().enumerate() {
            assert!(m.len() <= max_len, "case {case}: {} > {max_len}", m.len());
            // Greedy: the next message's first id would not have fit.
            if let Some(next) = decoded.get(i + 1) {
                assert!(
                    m.len() + 1 + next[0].len() > max_len,
                    "case {case}: not packed"
                );
            }
        }
    }
}

#[test]
fn property_compact_batches_roundtrip() {
    let mut rng = Rng::new(42);
    for case in 0..2_000 {
        let max_len = 28 + rng.below(200) as usize;
        let n = rng.below(30) as usize;
        let entries: Vec<CompactEntry> = (0..n)
            .map(|_| CompactEntry {
                slot: rng.next_u64() as u32,
                nonce: Nonce::new(rng.next_u64()).unwrap_or(nonce(1)),
            })
            .collect();
        let (msgs, stats) = collect_compact(&entries, max_len);
        let per = (max_len - 4) / 24;
        assert_eq!(stats.messages as usize, n.div_ceil(per), "case {case}");
        assert_eq!((stats.entries as usize, stats.skipped), (n, 0));
        assert!(msgs.iter().all(|m| m.len() <= max_len));
        let back: Vec<_> = msgs.iter().flat_map(|m| entries_of(m)).collect();
        assert_eq!(back, entries, "case {case}");
    }
}

#[test]
fn property_read_done_roundtrip() {
    let mut rng = Rng::new(7);
    let mut encoded = 0;
    for _ in 0..20_000 {
        let id = random_id(&mut rng);
        let consumers = match rng.below(4) {
            0 => 0,
            1 => u32::MAX,
            _ => rng.below(9) as u32 + 1,
        };
        let n = Nonce::new(rng.next_u64() >> rng.below(64));
        let n = if rng.below(2) == 0 { None } else { n };
        let mut buf = vec![0u8; id.len() + MAX_READ_DONE_SUFFIX_LEN];
        match encode_read_done(&id, consumers, n, &mut buf) {
            Ok(len) => {
                encoded += 1;
                let r = read_done_of(&buf[..len]);
                assert_eq!(
                    (r.request_id, r.consumers, r.nonce),
                    (id.as_str(), consumers, n)
                );
            }
            Err(WireError::EmptyId) => assert!(id.is_empty()),
            Err(WireError::ZeroConsumers) => assert_eq!(consumers, 0),
            Err(WireError::AmbiguousId) => {
                let msg = format!("{id}:");
                assert!(
                    ["HB:", "HBC:", "HBP:"].iter().any(|p| msg.starts_with(p)),
                    "{id}"
                );
            }
            Err(e) => panic!("{id:?}: {e}"),
        }
    }
    assert!(encoded > 10_000);
}

#[test]
fn decode_never_panics_on_random_bytes() {
    // A cheap, always-on cousin of the fuzz target.
    let mut rng = Rng::new(3);
    let alphabet = b"HBCP:,0123456789abcdefABCDEFnonce=@\x7f\xff\xc3\xa9";
    for _ in 0..100_000 {
        let len = rng.below(64) as usize;
        let mut m: Vec<u8> = (0..len)
            .map(|_| alphabet[rng.below(alphabet.len() as u64) as usize])
            .collect();
        let prefix: &[u8] = match rng.below(4) {
            0 => b"HB:",
            1 => b"HBC:",
            2 => b"HBP:",
            _ => b"",
        };
        m.splice(0..0, prefix.iter().copied());
        if let Ok(n) = decode(&m) {
            // Whatever decodes iterates fully.
            match n {
                Notification::Heartbeat(ids) => {
                    // vLLM's P: the body split on ',', empty pieces ignored.
                    let body = core::str::from_utf8(&m[3..]).unwrap();
                    let pieces: Vec<&str> = body.split(',').collect();
                    let want: Vec<&str> =
                        pieces.iter().copied().filter(|p| !p.is_empty()).collect();
                    assert_eq!(ids.len(), want.len(), "{m:?}");
                    assert_eq!(ids.empty_pieces(), pieces.len() - want.len(), "{m:?}");
                    assert_eq!(ids.collect::<Vec<_>>(), want, "{m:?}");
                }
                Notification::CompactHeartbeat(e) => assert!(e.count() >= 1),
                Notification::PackedHeartbeat(e) => assert!(e.count() >= 1),
                Notification::ReadDone(r) => assert!(r.consumers >= 1),
            }
        }
    }
}
