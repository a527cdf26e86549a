//! Fuzz target for `kvlease::ipc::outcome` (D worker -> D scheduler).
//!
//! Every input is used two ways, each decoded and, when it decodes,
//! re-encoded (it must give back the very same bytes) and applied to a
//! tracker tracking a few of the ids it may name (which must not panic, and
//! must stop tracking exactly the requests it reports):
//! 1. as a message;
//! 2. behind a valid frame header whose counts come from the first two
//!    bytes and whose sender rank from the third.
#![no_main]

use kvlease::consumer::{HeartbeatTracker, RemotePrefillParams};
use kvlease::ipc::outcome::{self, OutcomeMsg, OWED_RECORD_LEN, RECORD_LEN};
use kvlease::ipc::MsgKind;
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
        let _ = t.on_new_request(d, &params, Instant::ZERO);
    }
    let before = t.len();
    let mut reported = 0u32;
    if let Ok(r) = t.apply_outcomes(&msg, |id, _| {
        assert!(!id.is_empty());
        reported += 1;
    }) {
        assert_eq!(r.received + r.failed, reported);
        assert_eq!(
            before - t.len(),
            reported,
            "each report ends one tracked request"
        );
        assert_eq!(r.outcomes, msg.len());
    } else {
        assert!(msg.rank() >= t.workers());
        assert_eq!(t.len(), before);
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
