//! The wire codec's tests: exact formats, every error, SWAR against scalar
//! references (`swar.rs`), random round trips (`roundtrip.rs`).

use super::decode::*;
use super::encode::*;
use super::hex::*;
use super::*;

mod packed;
mod roundtrip;
mod swar;

/// The crate's seeded generator, as these tests call it.
type Rng = crate::rng::SplitMix64;

fn nonce(v: u64) -> Nonce {
    Nonce::new(v).expect("test nonce is non-zero")
}

fn ids_of(msg: &[u8]) -> Vec<&str> {
    match decode(msg) {
        Ok(Notification::Heartbeat(ids)) => ids.collect(),
        other => panic!("not a heartbeat: {other:?}"),
    }
}

fn entries_of(msg: &[u8]) -> Vec<CompactEntry> {
    match decode(msg) {
        Ok(Notification::CompactHeartbeat(e)) => e.collect(),
        other => panic!("not a compact heartbeat: {other:?}"),
    }
}

fn read_done_of(msg: &[u8]) -> ReadDone<'_> {
    match decode(msg) {
        Ok(Notification::ReadDone(r)) => r,
        other => panic!("not a read-done: {other:?}"),
    }
}

fn collect_hb(ids: &[&str], max_len: usize) -> (Vec<Vec<u8>>, EncodeStats) {
    let mut scratch = vec![0u8; max_len];
    let mut out = Vec::new();
    let stats = encode_heartbeats(ids.iter().copied(), max_len, &mut scratch, |m| {
        out.push(m.to_vec())
    })
    .expect("encode");
    (out, stats)
}

fn collect_compact(entries: &[CompactEntry], max_len: usize) -> (Vec<Vec<u8>>, EncodeStats) {
    let mut scratch = vec![0u8; max_len];
    let mut out = Vec::new();
    let stats = encode_compact_heartbeats(entries.iter().copied(), max_len, &mut scratch, |m| {
        out.push(m.to_vec())
    })
    .expect("encode");
    (out, stats)
}

fn rd(id: &str, consumers: u32, n: Option<Nonce>) -> Vec<u8> {
    let mut buf = vec![0u8; id.len() + MAX_READ_DONE_SUFFIX_LEN];
    let len = encode_read_done(id, consumers, n, &mut buf).expect("encode");
    assert_eq!(len, read_done_len(id, consumers, n));
    buf.truncate(len);
    buf
}

// -- vLLM examples ------------------------------------------------------

#[test]
fn vllm_heartbeat_example() {
    assert_eq!(
        ids_of(b"HB:req-a,req-b,req-unknown"),
        ["req-a", "req-b", "req-unknown"]
    );
    let (msgs, _) = collect_hb(&["req-a", "req-b", "req-unknown"], 1024);
    assert_eq!(msgs, [b"HB:req-a,req-b,req-unknown".to_vec()]);
}

#[test]
fn vllm_read_done_example_splits_at_last_colon() {
    let r = read_done_of(b"cmpl-abc:0:2");
    assert_eq!(
        r,
        ReadDone {
            request_id: "cmpl-abc:0",
            consumers: 2,
            nonce: None
        }
    );
    assert_eq!(rd("cmpl-abc:0", 2, None), b"cmpl-abc:0:2");
}

#[test]
fn read_done_ids_may_contain_colons_and_commas() {
    for id in ["a:b:c", "::x", "x::", "a,b", "1:2:3:4", "é:€:😀", "nonce=1"] {
        for n in [None, Some(nonce(0xdead_beef))] {
            let msg = rd(id, 7, n);
            let r = read_done_of(&msg);
            assert_eq!((r.request_id, r.consumers, r.nonce), (id, 7, n), "{id}");
        }
    }
    // An id ending in what looks like a nonce field is still just an id.
    let r = read_done_of(b"a:nonce=0000000000000001:3");
    assert_eq!(
        (r.request_id, r.consumers, r.nonce),
        ("a:nonce=0000000000000001", 3, None)
    );
}

#[test]
fn read_done_with_nonce() {
    let msg = rd("cmpl-abc:0", 2, Some(nonce(0xff)));
    assert_eq!(msg, b"cmpl-abc:0:2:nonce=00000000000000ff");
    let r = read_done_of(b"cmpl-abc:0:2:nonce=00000000000000FF");
    assert_eq!(r.nonce, Some(nonce(0xff)));
    let r = read_done_of(b"x:1:nonce=FfFfFfFfFfFfFfFf");
    assert_eq!(r.nonce, Some(nonce(u64::MAX)));
    assert_eq!(r.consumers, 1);
}

#[test]
fn consumers_parse() {
    assert_eq!(read_done_of(b"x:4294967295").consumers, u32::MAX);
    assert_eq!(read_done_of(b"x:0002").consumers, 2);
    assert_eq!(rd("x", u32::MAX, None), b"x:4294967295");
}

// -- empty pieces: vLLM's P renews what it holds, ignores the rest -----

fn heartbeat_of(msg: &[u8]) -> HeartbeatIds<'_> {
    match decode(msg) {
        Ok(Notification::Heartbeat(ids)) => ids,
        other => panic!("not a heartbeat: {other:?}"),
    }
}

#[test]
fn heartbeat_with_empty_pieces_keeps_its_ids() {
    // (message, ids, empty pieces), as vLLM's P splits them.
    let cases: [(&[u8], &[&str], usize); 8] = [
        (b"HB:req-a,", &["req-a"], 1),
        (b"HB:,req-a", &["req-a"], 1),
        (b"HB:req-a,,req-b", &["req-a", "req-b"], 1),
        (b"HB:,a,,,b,", &["a", "b"], 4),
        (b"HB:a,b", &["a", "b"], 0),
        (b"HB:a", &["a"], 0),
        (b"HB:,,a", &["a"], 2),
        (b"HB:\xc3\xa9,,\xf0\x9f\x98\x80,", &["é", "😀"], 2),
    ];
    for (msg, ids, empty) in cases {
        let hb = heartbeat_of(msg);
        assert_eq!(hb.empty_pieces(), empty, "{msg:?}");
        assert_eq!(hb.len(), ids.len(), "{msg:?}");
        assert_eq!(hb.clone().collect::<Vec<_>>(), ids, "{msg:?}");
        // empty_pieces describes the message: iteration does not change it.
        let mut it = hb.clone();
        it.next();
        assert_eq!(it.empty_pieces(), empty);
        assert_eq!(it.len(), ids.len() - 1);
    }
    // Equality sees through the separators but not through the empties.
    assert_eq!(heartbeat_of(b"HB:a,b"), heartbeat_of(b"HB:a,b"));
    assert_ne!(heartbeat_of(b"HB:a,,b"), heartbeat_of(b"HB:a,b"));
    assert_eq!(heartbeat_of(b"HB:a,,b"), heartbeat_of(b"HB:,a,b"));
    // Encoders still refuse to write an empty piece.
    let (msgs, stats) = collect_hb(&["a", "", "b"], 64);
    assert_eq!(msgs, [b"HB:a,b".to_vec()]);
    assert_eq!(stats.skipped, 1);
}

#[test]
fn bare_heartbeat_prefix_is_a_heartbeat_with_no_ids() {
    // vLLM's D sends "HB:" for a batch holding only the empty id; its P
    // looks "" up and ignores it. A heartbeat with no ids, one empty piece.
    let hb = heartbeat_of(b"HB:");
    assert!(hb.is_empty());
    assert_eq!(hb.len(), 0);
    assert_eq!(hb.empty_pieces(), 1);
    assert_eq!(hb.clone().next(), None);
    let hb = heartbeat_of(b"HB:,,");
    assert_eq!((hb.len(), hb.empty_pieces()), (0, 3));
    assert_eq!(hb.clone().count(), 0);
}

#[test]
fn other_forms_stay_strict_about_empty_fields() {
    // Compact heartbeats are ours: no records, or a bad one, fails the message.
    assert_eq!(decode(b"HBC:"), Err(WireError::NoEntries));
    let good = "00000007000000000000000f";
    let bad = format!("HBC:{good}{}", "z".repeat(24));
    assert_eq!(decode(bad.as_bytes()), Err(WireError::BadSlot));
    // A read-done names one id: an empty one is refused (vLLM drops it too).
    assert_eq!(decode(b":1"), Err(WireError::EmptyId));
    assert_eq!(
        decode(b":2:nonce=00000000000000ff"),
        Err(WireError::EmptyId)
    );
    // Not UTF-8 anywhere in a heartbeat still fails it whole, as vLLM's decode does.
    assert_eq!(decode(b"HB:a,,\xff"), Err(WireError::NotUtf8));
}

// -- one test per error variant ---------------------------------------

#[test]
fn error_empty() {
    assert_eq!(decode(b""), Err(WireError::Empty));
}

#[test]
fn error_unknown_prefix() {
    assert_eq!(decode(b"hello"), Err(WireError::UnknownPrefix));
    assert_eq!(decode(b"HB"), Err(WireError::UnknownPrefix));
    assert_eq!(decode(b"HBC"), Err(WireError::UnknownPrefix));
}

#[test]
fn error_not_utf8() {
    assert_eq!(decode(b"HB:a,\xff"), Err(WireError::NotUtf8));
    assert_eq!(decode(b"\xc3:1"), Err(WireError::NotUtf8));
    assert_eq!(decode(b"\xff"), Err(WireError::NotUtf8));
}

#[test]
fn error_empty_id() {
    // Only a read-done's empty id is an error (heartbeats skip empty pieces).
    for m in [&b":1"[..], b":1:nonce=0000000000000001"] {
        assert_eq!(decode(m), Err(WireError::EmptyId), "{m:?}");
    }
    let mut buf = [0u8; 64];
    assert_eq!(
        encode_read_done("", 1, None, &mut buf),
        Err(WireError::EmptyId)
    );
    assert_eq!(check_heartbeat_id(""), Err(WireError::EmptyId));
}

#[test]
fn error_id_contains_comma() {
    assert_eq!(check_heartbeat_id("a,b"), Err(WireError::IdContainsComma));
    assert_eq!(check_heartbeat_id("a:b"), Ok(()));
}

#[test]
fn error_bad_consumers() {
    for m in [
        &b"x:"[..],
        b"x:abc",
        b"x:+1",
        b"x: 1",
        b"x:1 ",
        b"x:-1",
        b"x:4294967296",
        b"x:99999999999999999999",
        b"x:1_0",
        b"x:nonce=0000000000000001", // nonce form without a consumer count
        b"x::nonce=0000000000000001",
        b"x:1:NONCE=0000000000000001", // the tag is case-sensitive
    ] {
        assert_eq!(decode(m), Err(WireError::BadConsumers), "{m:?}");
    }
}

#[test]
fn error_zero_consumers() {
    assert_eq!(decode(b"x:0"), Err(WireError::ZeroConsumers));
    assert_eq!(decode(b"x:000"), Err(WireError::ZeroConsumers));
    assert_eq!(
        decode(b"x:0:nonce=0000000000000001"),
        Err(WireError::ZeroConsumers)
    );
    let mut buf = [0u8; 64];
    assert_eq!(
        encode_read_done("x", 0, None, &mut buf),
        Err(WireError::ZeroConsumers)
    );
}

#[test]
fn error_bad_nonce() {
    for m in [
        &b"x:1:nonce="[..],
        b"x:1:nonce=000000000000001",   // 15 digits
        b"x:1:nonce=00000000000000001", // 17 digits
        b"x:1:nonce=000000000000000g",
        b"x:1:nonce=0x00000000000001",
        b"x:1:nonce= 000000000000001",
        b"x:1:nonce=00000000000000\xc3\xa9", // non-ASCII, valid UTF-8
    ] {
        assert_eq!(decode(m), Err(WireError::BadNonce), "{m:?}");
    }
    assert_eq!(
        decode(b"HBC:00000001000000000000000g"),
        Err(WireError::BadNonce)
    );
    assert_eq!(
        decode(b"HBC:00000001g00000000000000f"),
        Err(WireError::BadNonce)
    );
}

#[test]
fn error_zero_nonce() {
    assert_eq!(
        decode(b"x:1:nonce=0000000000000000"),
        Err(WireError::ZeroNonce)
    );
    assert_eq!(
        decode(b"HBC:000000010000000000000000"),
        Err(WireError::ZeroNonce)
    );
    // Zero in a later record is caught up front too.
    assert_eq!(
        decode(b"HBC:000000010000000000000001ffffffff0000000000000000"),
        Err(WireError::ZeroNonce)
    );
}

#[test]
fn error_bad_slot() {
    assert_eq!(
        decode(b"HBC:0000000z0000000000000001"),
        Err(WireError::BadSlot)
    );
    assert_eq!(
        decode(b"HBC:\xff00000000000000000000001"),
        Err(WireError::BadSlot)
    );
}

#[test]
fn error_truncated() {
    assert_eq!(
        decode(b"HBC:00000001000000000000000"),
        Err(WireError::Truncated)
    );
    assert_eq!(decode(b"HBC:1"), Err(WireError::Truncated));
    assert_eq!(
        decode(b"HBC:0000000100000000000000010"),
        Err(WireError::Truncated)
    );
}

#[test]
fn error_no_entries() {
    assert_eq!(decode(b"HBC:"), Err(WireError::NoEntries));
}

#[test]
fn error_message_too_small() {
    let mut s = [0u8; 64];
    assert_eq!(
        encode_heartbeats(["a"], 3, &mut s, |_| ()),
        Err(WireError::MessageTooSmall)
    );
    assert_eq!(
        encode_compact_heartbeats([], 27, &mut s, |_| ()),
        Err(WireError::MessageTooSmall)
    );
    // The smallest legal limits work.
    assert_eq!(collect_hb(&["a"], 4).0, [b"HB:a".to_vec()]);
    let e = CompactEntry {
        slot: 1,
        nonce: nonce(2),
    };
    assert_eq!(collect_compact(&[e], 28).0.len(), 1);
}

#[test]
fn error_buffer_too_small() {
    let mut s = [0u8; 10];
    let mut emitted = false;
    assert_eq!(
        encode_heartbeats(["a"], 11, &mut s, |_| emitted = true),
        Err(WireError::BufferTooSmall)
    );
    assert_eq!(
        encode_compact_heartbeats(
            [CompactEntry {
                slot: 1,
                nonce: nonce(1)
            }],
            28,
            &mut s,
            |_| emitted = true
        ),
        Err(WireError::BufferTooSmall)
    );
    assert!(!emitted);
    let mut out = [0u8; 12];
    assert_eq!(
        encode_read_done("abcdefghij", 10, None, &mut out),
        Err(WireError::BufferTooSmall)
    );
    assert_eq!(encode_read_done("abcdefghi", 10, None, &mut out), Ok(12));
    assert_eq!(&out, b"abcdefghi:10");
}

#[test]
fn error_ambiguous_id() {
    let mut out = [0u8; 64];
    for id in ["HB", "HBC", "HB:x", "HBC:x", "HB:", "HBC:"] {
        assert_eq!(
            encode_read_done(id, 1, None, &mut out),
            Err(WireError::AmbiguousId),
            "{id}"
        );
    }
    for id in ["H", "HB_", "HBCD", "hb", "xHB:"] {
        let msg = rd(id, 1, None);
        assert_eq!(read_done_of(&msg).request_id, id);
    }
}

#[test]
fn heartbeats_take_precedence_like_vllm() {
    // A read-done for the id "HB" is indistinguishable from a heartbeat.
    assert_eq!(ids_of(b"HB:1"), ["1"]);
    assert_eq!(decode(b"HBC:1"), Err(WireError::Truncated));
}

#[test]
fn errors_display_and_are_errors() {
    let all = [
        WireError::Empty,
        WireError::UnknownPrefix,
        WireError::NotUtf8,
        WireError::EmptyId,
        WireError::IdContainsComma,
        WireError::BadConsumers,
        WireError::ZeroConsumers,
        WireError::BadNonce,
        WireError::ZeroNonce,
        WireError::BadSlot,
        WireError::Truncated,
        WireError::NoEntries,
        WireError::MessageTooSmall,
        WireError::BufferTooSmall,
        WireError::AmbiguousId,
    ];
    let mut seen = std::collections::HashSet::new();
    for e in all {
        let s = e.to_string();
        assert!(!s.is_empty());
        assert!(seen.insert(s), "duplicate message for {e:?}");
        let _: &dyn std::error::Error = &e;
    }
}

// -- heartbeats: encode, split, skip ----------------------------------

#[test]
fn heartbeat_iterator_is_exact_and_cloneable() {
    let Ok(Notification::Heartbeat(mut ids)) = decode(b"HB:a,bb,c:c") else {
        panic!()
    };
    assert_eq!(ids.len(), 3);
    assert_eq!(ids.len_hint(), 3);
    let copy = ids.clone();
    assert_eq!(ids.next(), Some("a"));
    assert_eq!(ids.as_str(), "bb,c:c");
    assert_eq!(ids.len(), 2);
    assert_eq!(copy.collect::<Vec<_>>(), ["a", "bb", "c:c"]);
    assert_eq!(ids.by_ref().count(), 2);
    assert!(ids.is_empty());
    assert_eq!(ids.next(), None);
}

#[test]
fn heartbeat_utf8_ids() {
    assert_eq!(ids_of("HB:é,€€,😀".as_bytes()), ["é", "€€", "😀"]);
}

#[test]
fn split_at_exact_boundary() {
    // "HB:aaaa,bbbb" is 12 bytes: exactly max_len is allowed.
    let (m, s) = collect_hb(&["aaaa", "bbbb"], 12);
    assert_eq!(m, [b"HB:aaaa,bbbb".to_vec()]);
    assert_eq!((s.messages, s.entries, s.skipped), (1, 2, 0));
    // One byte less and it splits.
    let (m, s) = collect_hb(&["aaaa", "bbbb"], 11);
    assert_eq!(m, [b"HB:aaaa".to_vec(), b"HB:bbbb".to_vec()]);
    assert_eq!((s.messages, s.entries), (2, 2));
    // An id of exactly max_len - 3 fits alone; one byte more is skipped.
    let (m, s) = collect_hb(&["aaaaaaaa", "bbbbbbbbb", "c"], 11);
    assert_eq!(m, [b"HB:aaaaaaaa".to_vec(), b"HB:c".to_vec()]);
    assert_eq!((s.messages, s.entries, s.skipped), (2, 2, 1));
}

#[test]
fn unencodable_ids_are_skipped_rest_still_go_out() {
    let (m, s) = collect_hb(&["", "a,b", "ok", "", "also-ok"], 64);
    assert_eq!(m, [b"HB:ok,also-ok".to_vec()]);
    assert_eq!((s.messages, s.entries, s.skipped), (1, 2, 3));
    let (m, s) = collect_hb(&["", "a,b"], 64);
    assert!(m.is_empty());
    assert_eq!((s.messages, s.entries, s.skipped), (0, 0, 2));
}

#[test]
fn empty_batches_emit_nothing() {
    let mut s = [0u8; 64];
    let st = encode_heartbeats(core::iter::empty(), 64, &mut s, |_| panic!("emitted"));
    assert_eq!(st, Ok(EncodeStats::default()));
    let st = encode_compact_heartbeats(core::iter::empty(), 64, &mut s, |_| panic!("emitted"));
    assert_eq!(st, Ok(EncodeStats::default()));
}

#[test]
fn scratch_may_be_longer_than_max_len() {
    let mut s = [0u8; 100];
    let mut out = Vec::new();
    encode_heartbeats(["aaaa", "bbbb"], 8, &mut s, |m| out.push(m.to_vec())).expect("encode");
    assert_eq!(out, [b"HB:aaaa".to_vec(), b"HB:bbbb".to_vec()]);
}

// -- compact heartbeats ------------------------------------------------

#[test]
fn compact_exact_bytes() {
    let e = [
        CompactEntry {
            slot: 7,
            nonce: nonce(0xff),
        },
        CompactEntry {
            slot: u32::MAX,
            nonce: nonce(0x0123_4567_89ab_cdef),
        },
    ];
    let (m, s) = collect_compact(&e, 4 + 48);
    assert_eq!(
        m,
        [b"HBC:0000000700000000000000ffffffffff0123456789abcdef".to_vec()]
    );
    assert_eq!((s.messages, s.entries, s.skipped), (1, 2, 0));
    assert_eq!(entries_of(&m[0]), e);
    // Upper case decodes to the same values.
    assert_eq!(
        entries_of(b"HBC:0000000700000000000000FFFFFFFFFF0123456789ABCDEF"),
        e
    );
}

#[test]
fn compact_split_at_exact_boundary() {
    let e: Vec<_> = (1..=5)
        .map(|i| CompactEntry {
            slot: i,
            nonce: nonce(u64::from(i) << 40),
        })
        .collect();
    // 4 + 2*24 = 52: exactly two records a message.
    for (max_len, per) in [(52, 2), (51, 1), (75, 2), (76, 3), (1000, 5)] {
        let (m, s) = collect_compact(&e, max_len);
        assert!(m.iter().all(|m| m.len() <= max_len));
        assert_eq!(m[0].len(), 4 + 24 * per, "max_len {max_len}");
        assert_eq!(s.messages as usize, 5usize.div_ceil(per));
        let back: Vec<_> = m.iter().flat_map(|m| entries_of(m)).collect();
        assert_eq!(back, e);
    }
}

#[test]
fn compact_iterator_is_exact() {
    let Ok(Notification::CompactHeartbeat(mut it)) =
        decode(b"HBC:000000010000000000000001000000020000000000000002")
    else {
        panic!()
    };
    assert_eq!(it.len(), 2);
    assert_eq!(it.next().map(|e| e.slot), Some(1));
    assert_eq!(it.len(), 1);
    assert_eq!(it.as_bytes(), b"000000020000000000000002");
    assert_eq!(it.next().map(|e| e.nonce), Some(nonce(2)));
    assert!(it.is_empty());
    assert_eq!(it.next(), None);
}

/// Issue 19 item 11: a peer without lease slots only ever gets vLLM's
/// `id:consumers`, which a stock P (splitting at its last `:`) parses; the
/// nonce form goes only to peers that export slots.
#[test]
fn the_read_done_form_follows_what_the_peer_advertised() {
    use crate::fabric::{PeerInfo, RegionId};
    let stock = PeerInfo {
        slot_region: None,
        slot_count: 0,
        compact_heartbeats: false,
        clock: None,
    };
    let kvlease_p = PeerInfo {
        slot_region: Some(RegionId(0)),
        slot_count: 64,
        ..stock
    };
    let nonce = crate::Nonce::new(0x5eed);
    let mut buf = [0u8; 96];
    let plain = ReadDoneForm::for_peer_info(&stock);
    assert_eq!(plain, ReadDoneForm::Plain);
    let n = encode_read_done_for(plain, "cmpl-a:0", 2, nonce, &mut buf).unwrap();
    let msg = core::str::from_utf8(&buf[..n]).unwrap();
    // What vLLM 0.34's P does with it: rsplit(":", 1).
    let (id, count) = msg.rsplit_once(':').unwrap();
    assert_eq!((id, count), ("cmpl-a:0", "2"));
    let with = ReadDoneForm::for_peer_info(&kvlease_p);
    let n = encode_read_done_for(with, "cmpl-a:0", 2, nonce, &mut buf).unwrap();
    match decode(&buf[..n]).unwrap() {
        Notification::ReadDone(rd) => {
            assert_eq!(
                (rd.request_id, rd.consumers, rd.nonce),
                ("cmpl-a:0", 2, nonce)
            )
        }
        other => panic!("{other:?}"),
    }
}
