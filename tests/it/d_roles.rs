//! The D side split into a scheduler and workers that talk only through
//! bytes (issue 7, item 4), over the recording fake fabric:
//!
//! - the plan carries exactly the engines `due` hands out, step by step;
//! - owed heartbeats travel back (outcome message) and are planned again
//!   until served; stale ones are answered with gone notices;
//! - `HeartbeatSender::step` (one process) and the byte path send the very
//!   same notifications under random churn and hostile peers;
//! - verify outcomes: a request is received only once every worker
//!   verified it, fails at the first worker that did not, and unknown ids
//!   are counted no-ops.

use std::collections::BTreeMap;
use std::time::Duration;

use kvlease::consumer::{
    BatchReason, DefaultPeerAddress, EngineHandle, HeartbeatSender, HeartbeatTracker,
    RemotePrefillParams, SenderConfig, TrackerError, Verdict,
};
use kvlease::fabric::FabricError;
use kvlease::ipc::outcome::{self, Outcome, OutcomeMsg};
use kvlease::ipc::plan::HeartbeatPlan;
use kvlease::ipc::IpcError;
use kvlease::testkit::{d_side_config, remote_prefill, FakeFabric, Policy, SplitMix64};
use kvlease::{Instant, LeaseConfig};

pub(super) type Sender = HeartbeatSender<FakeFabric, DefaultPeerAddress>;

fn lease_config(engines: u32) -> LeaseConfig {
    d_side_config(1024, 64, 256, engines, 64)
}

pub(super) fn params<'a>(engine: &'a str, p_id: &'a str, p_tp: u32) -> RemotePrefillParams<'a> {
    remote_prefill(engine, p_id, "p0", 5600, p_tp)
}

pub(super) const T0: Instant = Instant::from_secs(50);

pub(super) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The scheduler's side of one step: the plan, encoded into `buf`.
pub(super) fn plan_bytes(t: &mut HeartbeatTracker, now: Instant, buf: &mut Vec<u8>) -> usize {
    buf.resize(t.plan_len(now), 0);
    t.encode_plan(now, buf).unwrap()
}

/// A worker's outcome message carrying only what its sender still owes.
pub(super) fn owed_message(s: &Sender, rank: u32, seq: u32) -> Vec<u8> {
    let mut buf = vec![0u8; outcome::encoded_len([], s.owed_engines().len() as u32)];
    let n = outcome::encode(&mut buf, rank, seq, [], s.owed_engines()).unwrap();
    buf.truncate(n);
    buf
}

/// What a plan or a `due` pass hands out: engine id -> (reason, sorted ids).
type Planned = BTreeMap<String, (BatchReason, Vec<String>)>;

fn planned_by_due(t: &mut HeartbeatTracker, now: Instant) -> Planned {
    let mut out = Planned::new();
    t.due(now, |b| {
        let mut ids: Vec<String> = b.remote_request_ids().map(str::to_string).collect();
        ids.sort();
        out.insert(b.key().engine_id.to_string(), (b.reason(), ids));
    });
    out
}

/// The plan's engines, and its gone notices as sorted (index, generation).
fn planned_by_plan(t: &mut HeartbeatTracker, now: Instant) -> (Planned, Vec<(u32, u32)>) {
    let mut buf = Vec::new();
    let n = plan_bytes(t, now, &mut buf);
    let plan = HeartbeatPlan::decode(&buf[..n]).unwrap();
    let engines = plan
        .engines()
        .map(|e| {
            let mut ids: Vec<String> = e.remote_request_ids().map(str::to_string).collect();
            ids.sort();
            (e.key().engine_id.to_string(), (e.reason(), ids))
        })
        .collect();
    let mut gone: Vec<(u32, u32)> = plan.gone().map(|h| (h.index, h.generation)).collect();
    gone.sort();
    (engines, gone)
}

#[test]
fn the_plan_carries_exactly_what_due_hands_out() {
    let cfg = lease_config(4);
    let (mut a, mut b) = (
        HeartbeatTracker::new(&cfg, 1).expect("tracker"),
        HeartbeatTracker::new(&cfg, 1).expect("tracker"),
    );
    let mut rng = SplitMix64::new(0x1234_5678_9abc_def1u64);
    let mut next = move || rng.next_u64();
    let mut now = T0;
    let (mut owed_steps, mut gone_steps) = (0, 0);
    for i in 0..4_000u64 {
        let r = next();
        now = now + ms(r % 700);
        let d = format!("d{}", r % 50);
        if r % 3 == 0 {
            assert_eq!(a.on_request_finished(&d), b.on_request_finished(&d));
        } else {
            let e = format!("e{}", (r >> 8) % 6);
            let p = format!("p{i}");
            let pa = params(&e, &p, 1);
            assert_eq!(
                a.on_new_request(&d, &pa, now),
                b.on_new_request(&d, &pa, now)
            );
        }
        // Now and then a worker owes some engine (live or not).
        if (r >> 20) % 4 == 0 {
            let h = EngineHandle {
                index: ((r >> 24) % 5) as u32,
                generation: ((r >> 28) % 3) as u32,
            };
            assert_eq!(a.request_engines([h]), b.request_engines([h]));
        }
        // One process takes the gone notices before `due`; the plan
        // carries them.
        let mut gone_a = Vec::new();
        a.take_gone(|h| gone_a.push((h.index, h.generation)));
        gone_a.sort();
        let by_due = planned_by_due(&mut a, now);
        let (by_plan, gone_b) = planned_by_plan(&mut b, now);
        assert_eq!(by_due, by_plan, "step {i}");
        assert_eq!(gone_a, gone_b, "step {i}");
        owed_steps += by_due.values().any(|v| v.0 == BatchReason::Owed) as u32;
        gone_steps += !gone_a.is_empty() as u32;
    }
    assert!(owed_steps > 50, "owed engines were planned: {owed_steps}");
    assert!(gone_steps > 50, "gone notices were sent: {gone_steps}");
    let (ca, cb) = (a.counters(), b.counters());
    assert_eq!(
        (
            ca.engines_due,
            ca.requests_due,
            ca.engines_owed,
            ca.owed_stale
        ),
        (
            cb.engines_due,
            cb.requests_due,
            cb.engines_owed,
            cb.owed_stale
        )
    );
}

#[test]
fn an_owed_engine_is_planned_again_until_served_and_a_stale_one_is_gone() {
    let mut t = HeartbeatTracker::new(&lease_config(4), 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 1), T0).unwrap();
    let handle = t.engine_of("d1").unwrap().handle();
    let mut buf = Vec::new();
    let n = plan_bytes(&mut t, T0, &mut buf);
    assert_eq!(HeartbeatPlan::decode(&buf[..n]).unwrap().len(), 1);
    // Not due for an interval; owed on request, for one plan per request.
    assert_eq!(t.plan_len(T0 + ms(10)), 32);
    assert_eq!(t.request_engines([handle]), 1);
    for (step, want) in [(20, 1), (30, 0)] {
        let n = plan_bytes(&mut t, T0 + ms(step), &mut buf);
        let plan = HeartbeatPlan::decode(&buf[..n]).unwrap();
        assert_eq!(plan.len(), want, "step {step}");
        if want == 1 {
            let e = plan.engines().next().unwrap();
            assert_eq!((e.handle(), e.reason()), (handle, BatchReason::Owed));
        }
    }
    // Due again after the interval: due, not owed, even when requested.
    t.request_engines([handle]);
    let n = plan_bytes(&mut t, T0 + Duration::from_secs(5), &mut buf);
    let plan = HeartbeatPlan::decode(&buf[..n]).unwrap();
    assert_eq!(plan.engines().next().unwrap().reason(), BatchReason::Due);
    // Requested, then gone before the next plan: a gone notice.
    t.request_engines([handle]);
    assert!(t.on_transfer_complete("d1"));
    let n = plan_bytes(&mut t, T0 + Duration::from_secs(6), &mut buf);
    let plan = HeartbeatPlan::decode(&buf[..n]).unwrap();
    assert!(plan.is_empty());
    assert_eq!(plan.gone().collect::<Vec<_>>(), [handle]);
    // A report naming the gone engine: counted, answered once more.
    assert_eq!(t.request_engines([handle]), 0);
    let n = plan_bytes(&mut t, T0 + Duration::from_secs(7), &mut buf);
    assert_eq!(
        HeartbeatPlan::decode(&buf[..n])
            .unwrap()
            .gone()
            .collect::<Vec<_>>(),
        [handle]
    );
    let n = plan_bytes(&mut t, T0 + Duration::from_secs(8), &mut buf);
    assert_eq!(HeartbeatPlan::decode(&buf[..n]).unwrap().gone().len(), 0);
    let c = t.counters();
    assert_eq!((c.engines_owed, c.owed_requests, c.owed_stale), (1, 3, 1));
    assert_eq!(c.plans_encoded, 7);
}

/// Runs the same scenario through `HeartbeatSender::step` (one process) and
/// through plan bytes to a worker and outcome bytes back (two processes),
/// for D rank 1 of 2: the same step reports, counters and notifications,
/// byte for byte. Hostile peers: slow, failing and refusing handshakes,
/// compact ones, sends that fail; engines churn and vanish while owed.
#[test]
fn step_and_the_byte_path_send_the_same_heartbeats() {
    let make_fabric = || {
        let mut f = FakeFabric::new(256, 64, 100_000, 1 << 24);
        f.set_policy(
            "p0:5600/e1/",
            Policy {
                ready_after_polls: 4,
                ..Policy::compact()
            },
        );
        f.set_policy(
            "p0:5600/e2/",
            Policy {
                fail_attempts: 3,
                ..Policy::default()
            },
        );
        f.set_policy(
            "p0:5600/e3/",
            Policy {
                send_error: Some(FabricError::Full),
                ..Policy::default()
            },
        );
        f.set_default_policy(Policy {
            ready_after_polls: 2,
            ..Policy::compact()
        });
        f
    };
    let cfg = lease_config(4);
    let scfg = SenderConfig::new(&cfg, 2, 1);
    // A: one process.
    let mut ta = HeartbeatTracker::new(&cfg, 1).expect("tracker");
    let mut sa = Sender::new(make_fabric(), DefaultPeerAddress, scfg).unwrap();
    // B: scheduler and worker apart, only bytes between them.
    let mut tb = HeartbeatTracker::new(&cfg, 2).expect("tracker");
    let mut sb = Sender::new(make_fabric(), DefaultPeerAddress, scfg).unwrap();
    let mut plan_buf = Vec::new();

    let mut rng = SplitMix64::new(0xfeed_5eed_0dd5_u64);
    let mut next = move || rng.next_u64();
    let mut now = T0;
    let mut reports = (0u64, 0u64);
    for i in 0..5_000u64 {
        let r = next();
        now = now + ms(10 + r % 100);
        // Few requests over more engines than the tracker holds: engines
        // keep emptying (often while owed), coming back, and being refused.
        let d = format!("d{}", (r >> 40) % 12);
        if r % 2 == 0 {
            assert_eq!(ta.on_request_finished(&d), tb.on_request_finished(&d));
        } else {
            let e = format!("e{}", (r >> 8) % 6);
            let p = format!("p{i}");
            let tp = [1, 2, 4][(r >> 16) as usize % 3];
            let mut pa = params(&e, &p, tp);
            if (r >> 24) % 8 != 0 {
                pa.remote_lease_slot = Some((r >> 32) as u32 % 1024);
                pa.remote_lease_nonce = Some((r | 1) as i64);
            }
            assert_eq!(
                ta.on_new_request(&d, &pa, now),
                tb.on_new_request(&d, &pa, now)
            );
        }
        let ra = sa.step(&mut ta, now);
        // B: the scheduler plans, the worker sends, the debts come back.
        let n = plan_bytes(&mut tb, now, &mut plan_buf);
        let plan = HeartbeatPlan::decode(&plan_buf[..n]).unwrap();
        let rb = sb.send_plan(&plan, now);
        let msg = owed_message(&sb, 1, i as u32);
        tb.apply_outcomes(&OutcomeMsg::decode(&msg).unwrap(), |_, _| {
            unreachable!("no verdicts in this test")
        })
        .unwrap();
        assert_eq!(ra, rb, "step {i}");
        reports.0 += u64::from(ra.engines_owed);
        reports.1 += u64::from(ra.messages_sent);
    }
    let (fa, fb) = (sa.fabric(), sb.fabric());
    let log_a: Vec<(&str, &[u8])> = fa.sent().collect();
    let log_b: Vec<(&str, &[u8])> = fb.sent().collect();
    assert_eq!(log_a.len(), log_b.len());
    assert!(log_a == log_b, "the two paths sent different heartbeats");
    assert_eq!(sa.counters(), sb.counters());
    let c = sa.counters();
    // The scenario exercised what it claims to.
    assert!(reports.0 > 1_000 && reports.1 > 300, "{reports:?}");
    assert!(c.deferred_sent > 100 && c.deferred_dropped > 10, "{c:?}");
    assert!(c.compact_messages_sent > 0 && c.send_failed > 0 && c.handshakes_failed > 0);
    assert_eq!(fa.unlogged, 0, "every message was compared");
}

/// Two D workers (D TP 2, P TP 2: each reads its own P rank). Worker 0's
/// peer is slow to handshake, worker 1's is quick: the owed engine is
/// planned for both, and only worker 0 sends.
#[test]
fn an_owed_engine_is_served_only_by_the_worker_that_owes_it() {
    let cfg = lease_config(4);
    let mut t = HeartbeatTracker::new(&cfg, 2).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 2), T0).unwrap();
    let mut slow = FakeFabric::new(4096, 8, 64, 1 << 16);
    slow.set_default_policy(Policy {
        ready_after_polls: 3,
        ..Policy::default()
    });
    let mut workers = [
        Sender::new(slow, DefaultPeerAddress, SenderConfig::new(&cfg, 2, 0)).unwrap(),
        Sender::new(
            FakeFabric::new(4096, 8, 64, 1 << 16),
            DefaultPeerAddress,
            SenderConfig::new(&cfg, 2, 1),
        )
        .unwrap(),
    ];
    let mut buf = Vec::new();
    let mut sent_at: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
    for step in 0..6u64 {
        let now = T0 + ms(10 * step);
        let n = plan_bytes(&mut t, now, &mut buf);
        let plan = HeartbeatPlan::decode(&buf[..n]).unwrap();
        for (rank, w) in workers.iter_mut().enumerate() {
            let r = w.send_plan(&plan, now);
            if r.messages_sent > 0 {
                sent_at[rank].push(step);
            }
            let msg = owed_message(w, rank as u32, step as u32);
            t.apply_outcomes(&OutcomeMsg::decode(&msg).unwrap(), |_, _| {})
                .unwrap();
        }
    }
    // Rank 1: handshake at step 0, sent at step 1 (owed). Rank 0: polled in
    // step 1's send and at the ends of steps 1 and 2 (ready at the third
    // poll), sent at step 3, not later. The engine is planned as owed only
    // at steps 1 (handshakes just started) and 3 (rank 0 became ready), not
    // at step 2, while rank 0's handshake was merely pending.
    assert_eq!(sent_at, [vec![3], vec![1]]);
    assert_eq!(
        workers[1].counters().owed_visits,
        2,
        "planned, nothing owed"
    );
    assert_eq!(workers[1].counters().messages_sent, 1);
    assert_eq!(t.counters().engines_owed, 2);
}

fn outcome_msg(rank: u32, outcomes: &[(&str, Verdict)], owed: &[EngineHandle]) -> Vec<u8> {
    let it = outcomes.iter().map(|&(request_id, verdict)| Outcome {
        request_id,
        verdict,
    });
    let mut buf = vec![0u8; outcome::encoded_len(it.clone(), owed.len() as u32)];
    let n = outcome::encode(&mut buf, rank, 0, it, owed.iter().copied()).unwrap();
    buf.truncate(n);
    buf
}

#[test]
fn a_request_is_received_once_every_worker_verified_it() {
    let mut t = HeartbeatTracker::new(&lease_config(4), 2).expect("tracker");
    for d in ["d1", "d2", "d3"] {
        t.on_new_request(d, &params("eng", &format!("p-{d}"), 1), T0)
            .unwrap();
    }
    let mut seen: Vec<(String, Verdict)> = Vec::new();
    let mut apply = |t: &mut HeartbeatTracker, bytes: &[u8]| {
        t.apply_outcomes(&OutcomeMsg::decode(bytes).unwrap(), |id, v| {
            seen.push((id.to_string(), v))
        })
        .unwrap()
    };
    // Worker 0: d1 verified, d2 lapsed, d3 verified, and an unknown id.
    let r = apply(
        &mut t,
        &outcome_msg(
            0,
            &[
                ("d1", Verdict::Verified),
                ("d2", Verdict::Lapsed),
                ("d3", Verdict::Verified),
                ("nope", Verdict::Verified),
            ],
            &[],
        ),
    );
    assert_eq!(
        (r.outcomes, r.received, r.failed, r.pending, r.untracked),
        (4, 0, 1, 2, 1)
    );
    assert!(t.remote_of("d1").is_some(), "one worker is not enough");
    assert!(
        t.remote_of("d2").is_none(),
        "the first failure fails the load"
    );
    // A repeated message from the same worker changes nothing.
    apply(&mut t, &outcome_msg(0, &[("d1", Verdict::Verified)], &[]));
    assert!(t.remote_of("d1").is_some());
    // Worker 1: d1 verified (received), d2 verified (already failed:
    // untracked), d3 read failed.
    let r = apply(
        &mut t,
        &outcome_msg(
            1,
            &[
                ("d1", Verdict::Verified),
                ("d2", Verdict::Verified),
                ("d3", Verdict::ReadFailed(FabricError::TimedOut)),
            ],
            &[],
        ),
    );
    assert_eq!((r.received, r.failed, r.untracked), (1, 1, 1));
    assert_eq!(
        seen,
        [
            ("d2".to_string(), Verdict::Lapsed),
            ("d1".to_string(), Verdict::Verified),
            ("d3".to_string(), Verdict::ReadFailed(FabricError::TimedOut)),
        ]
    );
    assert!(t.is_empty());
    let c = t.counters();
    assert_eq!(
        (
            c.outcomes,
            c.outcomes_untracked,
            c.loads_verified,
            c.loads_failed
        ),
        (8, 2, 1, 2)
    );
    assert_eq!(c.stopped_transfer_complete, 1);
    // A rank beyond the workers: the request it names fails (it cannot be
    // vouched for), its owed engines are ignored, the error is typed.
    t.on_new_request("d4", &params("eng", "p4", 1), T0).unwrap();
    t.on_new_request("d5", &params("eng", "p5", 1), T0).unwrap();
    let handle = t.engine_of("d4").unwrap().handle();
    let bytes = outcome_msg(2, &[("d4", Verdict::Verified)], &[handle]);
    let mut failed = Vec::new();
    assert_eq!(
        t.apply_outcomes(&OutcomeMsg::decode(&bytes).unwrap(), |id, v| {
            failed.push((id.to_string(), v))
        }),
        Err(IpcError::UnknownWorker {
            rank: 2,
            workers: 2
        })
    );
    assert_eq!(failed, [("d4".to_string(), Verdict::Unverifiable)]);
    assert!(t.remote_of("d4").is_none(), "tracking stopped");
    assert_eq!(t.counters().outcomes_refused, 1);
    assert_eq!(t.counters().owed_requests, 0);
    // The owed section is applied with the outcomes.
    let bytes = outcome_msg(1, &[], &[handle]);
    let r = t
        .apply_outcomes(&OutcomeMsg::decode(&bytes).unwrap(), |_, _| {})
        .unwrap();
    assert_eq!(r.owed_live, 1);
}

/// Issue 19 item 5: D TP 2. Before, the worker count defaulted to 1 unless
/// `set_workers` was called: worker 1's message was refused whole with
/// `WrongSender { expected: 1, found: 1 }`, and worker 0's `Verified` alone
/// made the request received, its second shard unverified (fail open). Now
/// the count is part of construction, and the request is received only once
/// both workers verified.
#[test]
fn d_tp2_needs_both_workers_and_never_fails_open() {
    let mut t = HeartbeatTracker::new(&lease_config(4), 2).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 2), T0).unwrap();
    let mut got = Vec::new();
    let w0 = outcome_msg(0, &[("d1", Verdict::Verified)], &[]);
    let r = t
        .apply_outcomes(&OutcomeMsg::decode(&w0).unwrap(), |id, v| {
            got.push((id.to_string(), v))
        })
        .unwrap();
    assert_eq!((r.received, r.pending), (0, 1), "one shard is not enough");
    assert!(got.is_empty());
    let w1 = outcome_msg(1, &[("d1", Verdict::Lapsed)], &[]);
    t.apply_outcomes(&OutcomeMsg::decode(&w1).unwrap(), |id, v| {
        got.push((id.to_string(), v))
    })
    .unwrap();
    assert_eq!(got, [("d1".to_string(), Verdict::Lapsed)]);
    assert_eq!(t.counters().loads_verified, 0);
    assert_eq!(t.counters().loads_failed, 1);
    // A worker count that cannot be right is refused, not guessed.
    assert_eq!(
        HeartbeatTracker::new(&lease_config(4), 0).err(),
        Some(TrackerError::BadWorkerCount(0))
    );
    assert_eq!(
        HeartbeatTracker::new(&lease_config(4), 65).err(),
        Some(TrackerError::BadWorkerCount(65))
    );
}

/// Issue 19 item 12: with verification off, a worker's share is accepted
/// unchecked through the same outcome path, and counted apart.
#[test]
fn unchecked_shares_are_received_and_counted_as_unverified() {
    let mut t = HeartbeatTracker::new(&lease_config(4), 2).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 2), T0).unwrap();
    let mut got = Vec::new();
    for (rank, v) in [(0, Verdict::Verified), (1, Verdict::Unchecked)] {
        let m = outcome_msg(rank, &[("d1", v)], &[]);
        t.apply_outcomes(&OutcomeMsg::decode(&m).unwrap(), |id, v| {
            got.push((id.to_string(), v))
        })
        .unwrap();
    }
    assert_eq!(got, [("d1".to_string(), Verdict::Unchecked)]);
    let c = t.counters();
    assert_eq!(
        (c.loads_unverified, c.loads_verified, c.loads_failed),
        (1, 0, 0)
    );
}

#[test]
fn sixty_four_workers_is_the_most_and_rank_63_counts() {
    let mut t = HeartbeatTracker::new(&lease_config(4), 64).expect("tracker");
    assert_eq!(t.workers(), 64);
    t.on_new_request("d2", &params("eng", "p2", 1), T0).unwrap();
    for rank in 0..64 {
        let bytes = outcome_msg(rank, &[("d2", Verdict::Verified)], &[]);
        let r = t
            .apply_outcomes(&OutcomeMsg::decode(&bytes).unwrap(), |_, _| {})
            .unwrap();
        assert_eq!(r.received, u32::from(rank == 63));
    }
    assert!(t.is_empty());
}
