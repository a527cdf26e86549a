//! Fuzz target for `kvlease::ipc::outcome` (D worker -> D scheduler).
//!
//! Every input is used two ways, each decoded and, when it decodes,
//! re-encoded (it must give back the very same bytes) and applied to a
//! tracker tracking a few of the ids it may name:
//! 1. as a message;
//! 2. behind a valid frame header whose counts come from the first two
//!    bytes and whose sender rank from the third.
//!
//! Applying it must follow `HeartbeatTracker::apply_outcomes`'s documented
//! rules (`src/consumer/tracker/outcomes.rs`): each `on_outcome` call ends
//! the tracking of one request the message named, and nothing else stops
//! being tracked. A message from a worker the tracker does not have (rank
//! not below its worker count) fails every tracked request it names, each
//! once and as `Unverifiable`, and returns `UnknownWorker`; it changes
//! nothing else.
//!
//! Regression inputs (`fuzz/regressions/verify_outcomes/`, replayed by
//! `.ci/run`'s fuzz smoke before it fuzzes): `unknown-worker-names-tracked`
//! is a framed outcome from rank 1 to a one-worker tracker that names a
//! tracked request (a 4-minute run found it while this target still
//! asserted that a refused message changes nothing).
#![no_main]

use kvlease::consumer::{HeartbeatTracker, RemotePrefillParams, TrackOutcome, Verdict};
use kvlease::ipc::outcome::{self, OutcomeMsg, OWED_RECORD_LEN, RECORD_LEN};
use kvlease::ipc::{IpcError, MsgKind};
use kvlease::{EngineShape, Instant, LeaseConfig};
use libfuzzer_sys::fuzz_target;

#[path = "common/mod.rs"]
mod common;
use common::Frame;

fuzz_target!(|data: &[u8]| {
    check(data);
    check(&framed(data));
});

fn check(bytes: &[u8]) {
    let Ok(msg) = OutcomeMsg::decode(bytes) else {
        return;
    };
    for o in msg.iter() {
        assert!(!o.request_id.is_empty());
    }
    let mut again = vec![0u8; outcome::encoded_len(msg.iter(), msg.owed().len() as u32)];
    let n = outcome::encode(&mut again, msg.rank(), msg.seq(), msg.iter(), msg.owed())
        .expect("re-encodes");
    assert_eq!(
        &again[..n],
        bytes,
        "a decoded message re-encodes to the same bytes"
    );

    // Apply it to a tracker that tracks a few short ids.
    let mut c = LeaseConfig::new(EngineShape {
        num_kv_blocks: 64,
        max_num_seqs: 8,
    });
    c.max_tracked_requests = 16;
    c.max_remote_engines = 2;
    if c.validate().is_err() {
        return;
    }
    let Ok(mut t) = HeartbeatTracker::new(&c, 1 + msg.seq() % 3) else {
        return;
    };
    let mut tracked: Vec<&str> = Vec::new();
    for d in ["a", "b", "c", "\u{0}", "ab"] {
        let params = RemotePrefillParams {
            do_remote_prefill: true,
            remote_engine_id: Some("e"),
            remote_request_id: Some("p"),
            remote_host: Some("h"),
            remote_port: Some(1),
            tp_size: Some(1),
            ..Default::default()
        };
        if let Ok(TrackOutcome::Started) = t.on_new_request(d, &params, Instant::ZERO) {
            tracked.push(d);
        }
    }
    assert_eq!(t.len() as usize, tracked.len());
    // The tracked requests the message names, each once, in message order.
    let mut named: Vec<&str> = Vec::new();
    for o in msg.iter() {
        if let Some(d) = tracked.iter().find(|d| **d == o.request_id) {
            if !named.contains(d) {
                named.push(d);
            }
        }
    }
    let mut reported: Vec<(String, Verdict)> = Vec::new();
    let result = t.apply_outcomes(&msg, |id, verdict| {
        reported.push((id.to_string(), verdict));
    });
    // Each report ends the tracking of one request the message named; every
    // other request is still tracked.
    for (k, (id, _)) in reported.iter().enumerate() {
        assert!(
            named.contains(&id.as_str()),
            "reported {id:?}, not a tracked request the message named"
        );
        assert!(
            reported[..k].iter().all(|(x, _)| x != id),
            "{id:?} reported twice"
        );
        assert!(
            t.remote_of(id).is_none(),
            "{id:?} reported but still tracked"
        );
    }
    for d in &tracked {
        let ended = reported.iter().any(|(x, _)| x == d);
        assert_eq!(t.remote_of(d).is_some(), !ended, "tracking of {d:?}");
    }
    assert_eq!(t.len() as usize, tracked.len() - reported.len());
    match result {
        Ok(r) => {
            assert!(msg.rank() < t.workers());
            assert_eq!(r.received + r.failed, reported.len() as u32);
            assert_eq!(r.outcomes, msg.len());
        }
        Err(e) => {
            // The only refusal: a worker the tracker does not have. Exactly
            // the tracked requests the message named fail, as unverifiable.
            assert!(msg.rank() >= t.workers());
            assert_eq!(
                e,
                IpcError::UnknownWorker {
                    rank: msg.rank(),
                    workers: t.workers()
                }
            );
            let want: Vec<(String, Verdict)> = named
                .iter()
                .map(|d| (d.to_string(), Verdict::Unverifiable))
                .collect();
            assert_eq!(
                reported, want,
                "a refused message fails exactly what it names"
            );
        }
    }
}

fn framed(data: &[u8]) -> Vec<u8> {
    let (records, extras, rank) = match data {
        [a, b, r, ..] => (u32::from(a % 8), u32::from(b % 4), u32::from(r % 4)),
        _ => (0, 0, 0),
    };
    Frame {
        kind: MsgKind::VerifyOutcomes,
        sender: rank,
        seq: 3,
        records,
        record_len: RECORD_LEN,
        extras,
        extra_len: OWED_RECORD_LEN,
    }
    .wrap(data.get(3..).unwrap_or_default())
}
