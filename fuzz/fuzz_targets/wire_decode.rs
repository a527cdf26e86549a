//! Fuzz target for `kvlease::wire`.
//!
//! Every input is used three ways:
//! 1. as a notification: `decode` must not panic; its verdict must agree with
//!    a deliberately naive reference decoder (std parsing, no SWAR); whatever
//!    decodes is re-encoded and must decode to the same value (and, for text
//!    heartbeats without empty pieces, to the very same bytes; with them, to
//!    the same ids without the empty pieces, which encoders never write),
//!    also when re-split under a smaller message limit;
//! 2. as a batch of heartbeat ids (lines of the input) under a message limit
//!    taken from its first byte: the messages must fit, and their ids,
//!    concatenated, must be exactly the encodable input ids in order;
//! 3. as a batch of (slot, nonce) records: the same round trip, through
//!    both record forms (`HBC:` hex, `HBP:` packed).
#![no_main]

use kvlease::wire::{
    self, CompactEntry, Notification, WireError, COMPACT_HEARTBEAT_PREFIX, HEARTBEAT_PREFIX,
    PACKED_HEARTBEAT_PREFIX,
};
use kvlease::Nonce;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check_decode(data);
    check_heartbeat_batch(data);
    check_compact_batch(data);
});

/// What a message means, in owned, obviously-correct terms.
#[derive(Debug, PartialEq, Eq)]
enum Meaning {
    /// The non-empty ids, and how many pieces were empty (vLLM's P skips them).
    Heartbeat(Vec<String>, usize),
    Compact(Vec<(u32, u64)>),
    Packed(Vec<(u32, u64)>),
    ReadDone(String, u32, Option<u64>),
}

fn meaning(n: &Notification<'_>) -> Meaning {
    match n {
        Notification::Heartbeat(ids) => {
            Meaning::Heartbeat(ids.clone().map(String::from).collect(), ids.empty_pieces())
        }
        Notification::CompactHeartbeat(e) => {
            Meaning::Compact(e.clone().map(|e| (e.slot, e.nonce.get())).collect())
        }
        Notification::PackedHeartbeat(e) => {
            Meaning::Packed(e.clone().map(|e| (e.slot, e.nonce.get())).collect())
        }
        Notification::ReadDone(r) => Meaning::ReadDone(
            r.request_id.to_string(),
            r.consumers,
            r.nonce.map(Nonce::get),
        ),
    }
}

/// The naive reference: the module docs' grammar, written with std parsing.
fn reference(msg: &[u8]) -> Option<Meaning> {
    if let Some(body) = msg.strip_prefix(COMPACT_HEARTBEAT_PREFIX) {
        if body.is_empty() || body.len() % 24 != 0 || !body.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        let text = std::str::from_utf8(body).ok()?;
        let mut out = Vec::new();
        for i in (0..text.len()).step_by(24) {
            let slot = u32::from_str_radix(&text[i..i + 8], 16).ok()?;
            let nonce = u64::from_str_radix(&text[i + 8..i + 24], 16).ok()?;
            if nonce == 0 {
                return None;
            }
            out.push((slot, nonce));
        }
        return Some(Meaning::Compact(out));
    }
    if let Some(body) = msg.strip_prefix(PACKED_HEARTBEAT_PREFIX) {
        // Digit k of a record is byte k - 0x40; V = sum of digit k << 6k.
        if body.is_empty() || body.len() % 16 != 0 || !body.iter().all(|b| (0x40..0x80).contains(b))
        {
            return None;
        }
        let mut out = Vec::new();
        for rec in body.chunks(16) {
            let v = rec
                .iter()
                .enumerate()
                .fold(0u128, |v, (k, &b)| v | (u128::from(b - 0x40) << (6 * k)));
            let (slot, nonce) = (v as u32, (v >> 32) as u64);
            if nonce == 0 {
                return None;
            }
            out.push((slot, nonce));
        }
        return Some(Meaning::Packed(out));
    }
    if let Some(body) = msg.strip_prefix(HEARTBEAT_PREFIX) {
        // vLLM's P: split on ',', renew what it holds, ignore empty pieces.
        let text = std::str::from_utf8(body).ok()?;
        let pieces: Vec<&str> = text.split(',').collect();
        let ids: Vec<String> = pieces
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| p.to_string())
            .collect();
        let empty = pieces.len() - ids.len();
        return Some(Meaning::Heartbeat(ids, empty));
    }
    let text = std::str::from_utf8(msg).ok()?;
    let (head, last) = text.rsplit_once(':')?;
    let (id, consumers, nonce) = match last.strip_prefix("nonce=") {
        Some(hex) => {
            if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            let nonce = u64::from_str_radix(hex, 16).ok().filter(|&n| n != 0)?;
            let (id, consumers) = head.rsplit_once(':')?;
            (id, consumers, Some(nonce))
        }
        None => (head, last, None),
    };
    if consumers.is_empty() || !consumers.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let consumers: u32 = consumers.parse().ok().filter(|&c| c != 0)?;
    if id.is_empty() {
        return None;
    }
    Some(Meaning::ReadDone(id.to_string(), consumers, nonce))
}

fn check_decode(data: &[u8]) {
    let decoded = wire::decode(data);
    let want = reference(data);
    match &decoded {
        Ok(n) => assert_eq!(
            Some(meaning(n)),
            want,
            "decode disagrees with the reference"
        ),
        Err(e) => {
            assert_eq!(
                want, None,
                "decode rejected ({e}) what the reference accepts"
            );
            assert!(!e.to_string().is_empty());
        }
    }
    let Ok(n) = decoded else { return };

    match n {
        Notification::Heartbeat(ids) => {
            // No id at all (`HB:`, `HB:,,`): only empty pieces, nothing to
            // re-encode (and a limit of 3 bytes is below any heartbeat's).
            if ids.is_empty() {
                assert!(ids.empty_pieces() > 0);
                return;
            }
            // At the message's own length: one message, the same bytes when
            // there were no empty pieces; else the canonical form (no empty
            // pieces).
            let msgs = encode_hb(ids.clone(), data.len());
            assert_eq!(msgs.1.skipped, 0);
            if ids.empty_pieces() == 0 {
                assert_eq!(msgs.0, [data.to_vec()]);
            } else {
                let canonical = format!("HB:{}", ids.clone().collect::<Vec<_>>().join(","));
                assert_eq!(msgs.0, [canonical.into_bytes()]);
                match wire::decode(&msgs.0[0]) {
                    Ok(Notification::Heartbeat(again)) => assert_eq!(again.empty_pieces(), 0),
                    other => panic!("re-encoded heartbeat decodes to {other:?}"),
                }
            }
            // Under a tighter limit: split, same ids in order.
            let longest = ids.clone().map(str::len).max().unwrap_or(1);
            let limit = (longest + 3).max(data.len() / 3);
            let (msgs, stats) = encode_hb(ids.clone(), limit);
            assert_eq!(stats.skipped, 0);
            assert!(msgs.iter().all(|m| m.len() <= limit));
            let back: Vec<String> = msgs.iter().flat_map(|m| heartbeat_ids(m)).collect();
            let orig: Vec<String> = ids.map(String::from).collect();
            assert_eq!(back, orig);
        }
        Notification::CompactHeartbeat(entries) => {
            let (msgs, stats) = encode_compact(entries.clone(), data.len());
            assert_eq!(stats.messages, 1);
            // The encoder writes lowercase; the decoder accepted either case.
            let mut lower = data.to_vec();
            lower[COMPACT_HEARTBEAT_PREFIX.len()..].make_ascii_lowercase();
            assert_eq!(msgs[0], lower);
            match wire::decode(&msgs[0]) {
                Ok(Notification::CompactHeartbeat(again)) => assert_eq!(again, entries),
                other => panic!("re-encoded compact heartbeat decodes to {other:?}"),
            }
            let limit = 28 + data.len() / 4;
            let (msgs, _) = encode_compact(entries.clone(), limit);
            assert!(msgs.iter().all(|m| m.len() <= limit));
            assert_eq!(compact_entries(&msgs), entries.collect::<Vec<_>>());
        }
        Notification::PackedHeartbeat(entries) => {
            // The packed form is canonical: the very same bytes come back.
            let (msgs, stats) = encode_packed(entries.clone(), data.len());
            assert_eq!(stats.messages, 1);
            assert_eq!(msgs[0], data);
            let limit = 20 + data.len() / 4;
            let (msgs, _) = encode_packed(entries.clone(), limit);
            assert!(msgs.iter().all(|m| m.len() <= limit));
            assert_eq!(record_entries(&msgs), entries.collect::<Vec<_>>());
        }
        Notification::ReadDone(r) => {
            let mut out = vec![0u8; wire::read_done_len(r.request_id, r.consumers, r.nonce)];
            // The original message did not start with a heartbeat prefix and
            // began with the same `id:`, so the encoder cannot call it ambiguous.
            let len = wire::encode_read_done(r.request_id, r.consumers, r.nonce, &mut out)
                .expect("a decoded read-done re-encodes");
            assert_eq!(len, out.len());
            match wire::decode(&out) {
                Ok(Notification::ReadDone(again)) => assert_eq!(again, r),
                other => panic!("re-encoded read-done decodes to {other:?}"),
            }
            // One byte short is reported, not a panic.
            if let Some(short) = out.get_mut(..len - 1) {
                assert_eq!(
                    wire::encode_read_done(r.request_id, r.consumers, r.nonce, short),
                    Err(WireError::BufferTooSmall)
                );
            }
        }
    }
}

fn encode_hb<'i>(
    ids: impl IntoIterator<Item = &'i str>,
    max_len: usize,
) -> (Vec<Vec<u8>>, wire::EncodeStats) {
    let mut scratch = vec![0u8; max_len];
    let mut out = Vec::new();
    let stats = wire::encode_heartbeats(ids, max_len, &mut scratch, |m| out.push(m.to_vec()))
        .expect("valid limit and scratch");
    (out, stats)
}

fn encode_compact(
    entries: impl IntoIterator<Item = CompactEntry>,
    max_len: usize,
) -> (Vec<Vec<u8>>, wire::EncodeStats) {
    let mut scratch = vec![0u8; max_len];
    let mut out = Vec::new();
    let stats =
        wire::encode_compact_heartbeats(entries, max_len, &mut scratch, |m| out.push(m.to_vec()))
            .expect("valid limit and scratch");
    (out, stats)
}

fn encode_packed(
    entries: impl IntoIterator<Item = CompactEntry>,
    max_len: usize,
) -> (Vec<Vec<u8>>, wire::EncodeStats) {
    let mut scratch = vec![0u8; max_len];
    let mut out = Vec::new();
    let stats =
        wire::encode_packed_heartbeats(entries, max_len, &mut scratch, |m| out.push(m.to_vec()))
            .expect("valid limit and scratch");
    (out, stats)
}

/// Every entry of the compact heartbeats `msgs`, in order (each must be one).
fn compact_entries(msgs: &[Vec<u8>]) -> Vec<CompactEntry> {
    msgs.iter()
        .flat_map(|m| match wire::decode(m) {
            Ok(Notification::CompactHeartbeat(e)) => e.collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        })
        .collect()
}

/// Every entry of the packed heartbeats `msgs`, in order (each must be one).
fn record_entries(msgs: &[Vec<u8>]) -> Vec<CompactEntry> {
    msgs.iter()
        .flat_map(|m| match wire::decode(m) {
            Ok(Notification::PackedHeartbeat(e)) => e.collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        })
        .collect()
}

fn heartbeat_ids(msg: &[u8]) -> Vec<String> {
    match wire::decode(msg) {
        Ok(Notification::Heartbeat(ids)) => ids.map(String::from).collect(),
        other => panic!("encoder produced {other:?} from {msg:?}"),
    }
}

/// Lines of the input (after the first byte) as ids, under a limit of
/// 4 + first byte % 64.
fn check_heartbeat_batch(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let max_len = 4 + usize::from(first % 64);
    let text = String::from_utf8_lossy(rest);
    let ids: Vec<&str> = text.split('\n').collect();
    let (msgs, stats) = encode_hb(ids.iter().copied(), max_len);
    let encodable: Vec<&str> = ids
        .iter()
        .copied()
        .filter(|id| wire::check_heartbeat_id(id).is_ok() && id.len() <= max_len - 3)
        .collect();
    assert!(msgs.iter().all(|m| m.len() <= max_len));
    let back: Vec<String> = msgs.iter().flat_map(|m| heartbeat_ids(m)).collect();
    assert_eq!(back, encodable);
    assert_eq!(stats.messages as usize, msgs.len());
    assert_eq!(stats.entries as usize, encodable.len());
    assert_eq!(stats.skipped as usize, ids.len() - encodable.len());
}

/// 12-byte chunks of the input (after the first byte) as (slot, nonce)
/// records, under a limit of 28 + first byte.
fn check_compact_batch(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let max_len = 28 + usize::from(first);
    let entries: Vec<CompactEntry> = rest
        .chunks_exact(12)
        .filter_map(|c| {
            let slot = u32::from_be_bytes(c[..4].try_into().ok()?);
            let nonce = Nonce::new(u64::from_be_bytes(c[4..].try_into().ok()?))?;
            Some(CompactEntry { slot, nonce })
        })
        .collect();
    let (msgs, stats) = encode_compact(entries.iter().copied(), max_len);
    assert!(msgs.iter().all(|m| m.len() <= max_len));
    assert_eq!(stats.entries as usize, entries.len());
    assert_eq!(compact_entries(&msgs), entries);
    let (msgs, stats) = encode_packed(entries.iter().copied(), max_len);
    assert!(msgs.iter().all(|m| m.len() <= max_len));
    assert_eq!(stats.entries as usize, entries.len());
    assert_eq!(record_entries(&msgs), entries);
}
