//! Fuzz target for `kvlease::ipc::plan` (D scheduler -> D workers).
//!
//! Every input is used three ways:
//! 1. as a message: `HeartbeatPlan::decode` must not panic; whatever decodes
//!    is walked in full (engines, keys, members, leases, gone notices) and
//!    re-encoded with `plan::encode`, which must give back the very same
//!    bytes (the encoding is unique);
//! 2. behind a valid frame header whose counts are taken from the first two
//!    bytes, so that random records reach the record checks;
//! 3. as a program for a `HeartbeatTracker` (arrivals, stops, owed-engine
//!    reports, steps): each step's `encode_plan` must decode, match
//!    `plan_len`, and carry the tracker's engines.
#![no_main]

use arbitrary::Arbitrary;
use kvlease::consumer::{EngineHandle, HeartbeatTracker, RemotePrefillParams};
use kvlease::ipc::plan::{self, HeartbeatPlan, ENGINE_RECORD_LEN, MEMBER_RECORD_LEN};
use kvlease::ipc::{MsgKind, FROM_SCHEDULER};
use kvlease::{EngineShape, Instant, LeaseConfig};
use libfuzzer_sys::fuzz_target;

#[path = "common/mod.rs"]
mod common;
use common::{program, upto, Frame};

fuzz_target!(|data: &[u8]| {
    check_message(data);
    check_message(&framed(data));
    check_tracker(data);
});

/// Decodes `bytes`; whatever decodes must re-encode to the same bytes.
fn check_message(bytes: &[u8]) {
    let Ok(p) = HeartbeatPlan::decode(bytes) else {
        return;
    };
    let mut members = 0usize;
    for e in p.engines() {
        let k = e.key();
        assert!(!k.engine_id.is_empty() && !k.host.is_empty() && k.tp_size != 0);
        assert!(e.len() >= 1);
        assert_eq!(e.remotes().len(), e.len());
        let leased = e.remotes().filter(|r| r.lease.is_some()).count();
        assert_eq!(e.all_leased(), leased == e.len());
        assert_eq!(e.leases().count(), leased);
        for id in e.remote_request_ids() {
            assert!(!id.is_empty() && !id.contains(','));
        }
        members += e.len();
    }
    assert_eq!(members, p.members() as usize);
    let _ = p.gone().count();
    let mut again = vec![0u8; plan::encoded_len(p.engines(), p.gone())];
    let n = plan::encode(&mut again, p.seq(), p.engines(), p.gone()).expect("re-encodes");
    assert_eq!(
        &again[..n],
        bytes,
        "a decoded plan re-encodes to the same bytes"
    );
}

/// `data` behind a frame header that agrees with its length: records and
/// extras counts from the first two bytes, the rest is the id area.
fn framed(data: &[u8]) -> Vec<u8> {
    let (records, extras) = match data {
        [a, b, ..] => (u32::from(a % 6), u32::from(b % 12)),
        _ => (0, 0),
    };
    Frame {
        kind: MsgKind::HeartbeatPlan,
        sender: FROM_SCHEDULER,
        seq: 7,
        records,
        record_len: ENGINE_RECORD_LEN,
        extras,
        extra_len: MEMBER_RECORD_LEN,
    }
    .wrap(data.get(2..).unwrap_or_default())
}

const IDS: [&str; 6] = ["a", "cmpl-0123", "ü", "x-y:z", "longer-request-id-42", "b"];
const ENGINES: [&str; 4] = ["e0", "e1", "prefill-é", "e3"];

/// One tracker operation; the input, read as a program, is a sequence of them.
#[derive(Debug, Arbitrary)]
enum TrackerOp {
    /// A remote-prefill request arrives for D-side id `d{d}`.
    Arrive {
        #[arbitrary(with = upto::<23>)]
        d: u8,
        /// P-side id: `IDS[id]-{n}`; `n * 7` is also the lease slot.
        #[arbitrary(with = upto::<5>)]
        id: u8,
        n: u8,
        #[arbitrary(with = upto::<3>)]
        engine: u8,
        #[arbitrary(with = upto::<3>)]
        tp_minus_one: u8,
        #[arbitrary(with = upto::<7>)]
        pp: u8,
        /// The lease nonce (shifted left 3) when the request carries a lease.
        lease: Option<u8>,
    },
    /// D-side id `d{d}` finishes, then the tracker is told which engines
    /// are live (an engine handle that may be stale or unknown).
    Finish {
        #[arbitrary(with = upto::<23>)]
        d: u8,
        #[arbitrary(with = upto::<4>)]
        index: u8,
        #[arbitrary(with = upto::<3>)]
        generation: u8,
    },
    /// Time passes by `ticks * 40 ms`, then a plan is encoded and checked.
    Plan { ticks: u8 },
}

/// Runs `data` as a tracker program.
fn check_tracker(data: &[u8]) {
    let mut c = LeaseConfig::new(EngineShape {
        num_kv_blocks: 64,
        max_num_seqs: 8,
    });
    c.max_tracked_requests = 24;
    c.max_remote_engines = 3;
    c.max_request_id_len = 48;
    if c.validate().is_err() {
        return;
    }
    let mut t = HeartbeatTracker::new(&c, 1).expect("tracker");
    let mut now = Instant::from_secs(1);
    let mut buf = vec![0u8; 1 << 14];
    for op in program::<TrackerOp>(data) {
        match op {
            TrackerOp::Arrive {
                d,
                id,
                n,
                engine,
                tp_minus_one,
                pp,
                lease,
            } => {
                let p = format!("{}-{}", IDS[usize::from(id)], n);
                let params = RemotePrefillParams {
                    do_remote_prefill: true,
                    remote_engine_id: Some(ENGINES[usize::from(engine)]),
                    remote_request_id: Some(&p),
                    remote_host: Some("10.0.0.1"),
                    remote_port: Some(5600),
                    tp_size: Some(1 + u32::from(tp_minus_one)),
                    pp_size: Some(u32::from(pp)),
                    remote_lease_slot: lease.map(|_| u32::from(n) * 7),
                    remote_lease_nonce: lease.map(|x| i64::from(x) << 3),
                    ..Default::default()
                };
                let _ = t.on_new_request(&format!("d{d}"), &params, now);
            }
            TrackerOp::Finish {
                d,
                index,
                generation,
            } => {
                let _ = t.on_request_finished(&format!("d{d}"));
                t.request_engines([EngineHandle {
                    index: u32::from(index),
                    generation: u32::from(generation),
                }]);
            }
            TrackerOp::Plan { ticks } => {
                now = now + std::time::Duration::from_millis(u64::from(ticks) * 40);
                let len = t.plan_len(now);
                let live = t.engine_count();
                let n = t
                    .encode_plan(now, &mut buf)
                    .expect("the buffer fits 24 requests");
                assert_eq!(n, len);
                let p = HeartbeatPlan::decode(&buf[..n]).expect("a tracker's plan decodes");
                assert!(p.len() <= live);
                for e in p.engines() {
                    let batch = t.batch(e.handle()).expect("planned engines are live");
                    assert_eq!(batch.len(), e.len());
                    assert_eq!(batch.key(), e.key());
                }
                check_message(&buf[..n]);
            }
        }
    }
}
