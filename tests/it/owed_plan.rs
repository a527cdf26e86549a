//! What an unreachable P rank costs D's heartbeat plan: P TP 2 with rank 1
//! unreachable and rank 0 healthy, 10,000 requests queued on D, one D
//! worker, scheduler and worker apart (plan and outcome bytes).
//!
//! - issue 19 item 6: the owed engine is no longer planned at every step;
//! - issue 30 item 1: nor at every retry of rank 1. The worker keeps the
//!   engine's key and starts the retry itself; it asks for the engine (and
//!   its 10,000 ids) only once a rank is ready to take the heartbeat.

use kvlease::consumer::{DefaultPeerAddress, HeartbeatSender, HeartbeatTracker, SenderConfig};
use kvlease::ipc::outcome::OutcomeMsg;
use kvlease::ipc::plan::HeartbeatPlan;
use kvlease::testkit::{d_side_config, FakeFabric, Policy};
use kvlease::Instant;

use super::d_roles::{ms, owed_message, params, plan_bytes, Sender, T0};

const RANK0: &str = "p0:5600/eng/0";
const RANK1: &str = "p0:5600/eng/1";

/// A D scheduler tracking 10,000 requests on engine `eng` (P TP 2), and a
/// worker whose fabric never reaches rank 1.
fn queued_on_d() -> (HeartbeatTracker, Sender) {
    let cfg = d_side_config(1024, 64, 16_384, 4, 64);
    let mut t = HeartbeatTracker::new(&cfg, 1).expect("tracker");
    for i in 0..10_000 {
        let (d, p) = (format!("d-{i}"), format!("cmpl-{i:032x}-0"));
        t.on_new_request(&d, &params("eng", &p, 2), T0).unwrap();
    }
    let mut fabric = FakeFabric::new(1 << 16, 8, 4096, 1 << 22);
    fabric.set_policy(RANK1, Policy::unreachable());
    let w = HeartbeatSender::new(fabric, DefaultPeerAddress, SenderConfig::new(&cfg, 1, 0))
        .expect("sender");
    (t, w)
}

/// One D step at `now`: the plan's bytes, the worker's step, the owed
/// engines back to the scheduler. Returns the plan's length and the
/// messages rank 0 received.
fn step(t: &mut HeartbeatTracker, w: &mut Sender, now: Instant, seq: u32) -> (usize, usize) {
    let mut buf = Vec::new();
    let n = plan_bytes(t, now, &mut buf);
    let plan = HeartbeatPlan::decode(&buf[..n]).unwrap();
    w.send_plan(&plan, now);
    let to_rank0 = w.fabric().sent_to(RANK0).len();
    w.fabric_mut().clear_log();
    let msg = owed_message(w, 0, seq);
    t.apply_outcomes(&OutcomeMsg::decode(&msg).unwrap(), |_, _| {})
        .unwrap();
    (n, to_rank0)
}

/// Issue 19 item 6. Before, the owed engine went into every step's plan
/// with all its request ids (630,093 bytes per step at 10k queued
/// requests, against 32 when nothing is owed). Now the worker polls a
/// pending handshake itself. Over 10 s of 10 ms steps, plans carry the
/// engine at a handful of steps; every other plan is the bare header.
#[test]
fn an_unreachable_p_rank_does_not_put_every_request_in_every_plan() {
    let (mut t, mut w) = queued_on_d();
    let (mut big, mut total, mut header, mut to_rank0) = (0u32, 0usize, usize::MAX, 0);
    let steps = 1000u64;
    for s in 0..steps {
        let (n, sent) = step(&mut t, &mut w, T0 + ms(10 * s), s as u32);
        header = header.min(n);
        total += n;
        big += u32::from(n > 1024);
        to_rank0 += sent;
    }
    // Due at 0 s and 5 s; the first handshakes started at step 0 (planned
    // again at step 1, so that a quick handshake sends at once).
    assert!(big <= 4, "{big} of {steps} plans carried the engine");
    assert_eq!(header, 32, "a plan with nothing to do is the bare header");
    assert!(total < 4 * 640_000, "{total} plan bytes over {steps} steps");
    assert!(w.peers_owed() >= 1, "rank 1 is still owed");
    assert!(w.counters().handshakes_failed >= 5);
    // Rank 0 got both intervals' heartbeats (each split to the limit).
    assert!(to_rank0 >= 2, "{to_rank0} messages to rank 0");
}

/// Issue 30 item 1. Rank 1's retries (after backoffs of 250 ms, 0.5, 1, 2
/// and 4 s, then every 5 s, the cap) need only the engine's key, which the
/// worker kept: no retry asks for the engine. Before, each retry's plan
/// carried all 10,000 ids (630,093 bytes at 0.5, 1.2, 2.4, 4.6 s, ...).
/// After the first heartbeat of the healthy rank, the only plans over 64
/// KiB are the interval's own (the engine is due: rank 0 takes the ids
/// then), and rank 1 is still retried on its backoff and still owed.
#[test]
fn an_unreachable_p_ranks_retries_do_not_ask_for_the_engine() {
    let (mut t, mut w) = queued_on_d();
    let interval = t.interval();
    let mut first_heartbeat = None;
    let mut retries = Vec::new();
    let mut big_after_first = Vec::new();
    let attempts = |w: &Sender| w.fabric().agent(RANK1).map_or(0, |a| a.attempts);
    for s in 0..3000u64 {
        let now = T0 + ms(10 * s);
        let before = attempts(&w);
        let (n, sent) = step(&mut t, &mut w, now, s as u32);
        let at = now.saturating_duration_since(T0);
        if attempts(&w) > before && before > 0 {
            retries.push((at, n));
        }
        if first_heartbeat.is_some() && n > 64 * 1024 {
            big_after_first.push(at);
        }
        if sent > 0 && first_heartbeat.is_none() {
            first_heartbeat = Some(at);
        }
    }
    println!("rank 1 retries (time into the run, plan bytes that step): {retries:?}");
    let first = first_heartbeat.expect("rank 0 was heartbeated");
    assert!(first < ms(100), "rank 0's first heartbeat at {first:?}");
    assert!(retries.len() >= 8, "rank 1 retried {} times", retries.len());
    for &(at, n) in &retries {
        assert_eq!(n, 32, "the plan of the retry at {at:?} was {n} bytes");
    }
    // Due every interval from the start: 0 s (before the first heartbeat),
    // 5, 10, 15, 20 and 25 s.
    let due: Vec<_> = (1..6).map(|k| interval * k).collect();
    assert_eq!(
        big_after_first, due,
        "plans over 64 KiB after the first heartbeat"
    );
    assert!(w.peers_owed() >= 1, "rank 1 is still owed");
}
