//! Leases that used to be stuck or leaked on P (issue 19, items 1 and 2):
//! a rank that never applied a Grant (its directive message was lost, it
//! refused the Grant, or it was lost before the Grant went out), a rank
//! that restarts, a lease assigned but never started, and the scheduler's
//! backstop that ends such a lease when nobody else does.
//!
//! Every test drives the split roles through their bytes, as an engine
//! does: the scheduler's poll (its backstop) and directive message to each
//! rank (or not, when the test loses it), each rank's report message back.

use std::sync::Arc;
use std::time::Duration;

use kvlease::testkit::p_side_config;
use kvlease::{
    Instant, LeaseConfig, LeaseSlots, PrefillRank, PrefillScheduler, ReleaseReason, SlotPool,
};

const T0: Instant = Instant::from_secs(10);

struct Engine {
    config: LeaseConfig,
    sched: PrefillScheduler,
    ranks: Vec<PrefillRank>,
    buf: Vec<u8>,
    /// (request id, reason) of every release drained so far.
    released: Vec<(String, ReleaseReason)>,
}

impl Engine {
    fn new(ranks: u32) -> Engine {
        Engine::with_rank_configs(p_side_config(16, 16), ranks, |_, c| c.clone())
    }

    fn with_rank_configs(
        config: LeaseConfig,
        ranks: u32,
        rank_config: impl Fn(u32, &LeaseConfig) -> LeaseConfig,
    ) -> Engine {
        let sched = PrefillScheduler::new(&config, ranks, T0).unwrap();
        let ranks = (0..ranks)
            .map(|r| fresh_rank(&rank_config(r, &config), r))
            .collect();
        Engine {
            config,
            sched,
            ranks,
            buf: vec![0; 1 << 16],
            released: Vec::new(),
        }
    }

    /// One step: directives to every rank not in `lose`, each rank polls at
    /// `now`, reports go up, releases are drained and their blocks freed
    /// (slots back to the pool).
    fn step(&mut self, now: Instant, lose: &[u32]) {
        self.sched.poll(now);
        let n = self.sched.encode_directives(now, &mut self.buf).unwrap();
        let msg = self.buf[..n].to_vec();
        for rank in &mut self.ranks {
            if !lose.contains(&rank.rank()) {
                rank.apply_directives(&msg, now).unwrap();
            }
            rank.poll(now);
        }
        for r in 0..self.ranks.len() {
            let n = self.ranks[r].encode_reports(&mut self.buf).unwrap();
            let msg = self.buf[..n].to_vec();
            self.sched.apply_reports(r as u32, &msg).unwrap();
        }
        let released = &mut self.released;
        self.sched.drain_freed(|rel| {
            released.push((rel.request_id.to_string(), rel.reason));
        });
    }

    /// D heartbeats `id` on `ranks` every heartbeat interval from `from`
    /// until `until`, a step after each round; every renewal must land.
    /// Returns the last heartbeat's instant.
    fn heartbeat(&mut self, id: &str, ranks: &[usize], from: Instant, until: Instant) -> Instant {
        let beat = self.config.heartbeat_interval();
        let mut now = from;
        while now < until {
            now = now + beat;
            for &r in ranks {
                let renewal = self.ranks[r].renew(id.as_bytes(), now);
                assert_eq!(renewal, kvlease::Renewal::Renewed, "rank {r} at {now:?}");
            }
            self.step(now, &[]);
        }
        now
    }

    /// How many slots the pool hands out now (takes them all, gives them back).
    fn free_slots(&self) -> usize {
        let pool: &Arc<SlotPool> = self.sched.slot_pool();
        let taken: Vec<_> = std::iter::from_fn(|| pool.take()).collect();
        let n = taken.len();
        for t in taken {
            pool.give_back(t);
        }
        n
    }
}

fn fresh_rank(config: &LeaseConfig, r: u32) -> PrefillRank {
    PrefillRank::new(config, r, Arc::new(LeaseSlots::new(config.lease_slots)), T0).unwrap()
}

fn far() -> Instant {
    T0 + Duration::from_secs(600)
}

/// The issue's test. Before: rank 1 never saw the Grant, so the scheduler
/// waited for its report forever; `cancel` did not help, because rank 1
/// treated the Cancel as stale and sent nothing. Now it answers "not held".
#[test]
fn a_rank_that_missed_its_grant_is_released_by_cancel() {
    let mut e = Engine::new(2);
    let slots = e.free_slots();
    let g = e.sched.grant("req-1", T0).unwrap();
    assert!(g.lease_fields().is_some());
    e.step(T0, &[1]); // rank 1's first directive message is lost
    e.step(far(), &[]); // rank 0 expires and reports; rank 1 holds nothing
    assert_eq!(e.sched.held(), 1, "waiting for rank 1");
    assert!(e.sched.cancel("req-1"));
    e.step(far(), &[]);
    assert_eq!(e.sched.held(), 0);
    assert_eq!(e.released, [("req-1".to_string(), ReleaseReason::NotHeld)]);
    assert_eq!(e.free_slots(), slots, "the slot is back in the pool");
    assert_eq!(e.ranks[1].counters().not_held_reported, 1);
    assert_eq!(e.sched.counters().not_held, 1);
}

/// A rank that refuses a Grant (here: it stores shorter ids) answers at
/// once, so the lease ends with the other rank's expiry, no cancel needed.
#[test]
fn a_refused_grant_is_answered_at_once() {
    let mut e = Engine::with_rank_configs(p_side_config(16, 16), 2, |r, c| {
        let mut c = c.clone();
        if r == 1 {
            c.max_request_id_len = 4;
        }
        c
    });
    e.sched.grant("request-long", T0).unwrap();
    e.step(T0, &[]);
    assert_eq!(e.ranks[1].counters().directives_refused, 1);
    assert_eq!(e.ranks[1].held(), 0);
    e.step(far(), &[]);
    assert_eq!(e.sched.held(), 0);
    assert_eq!(
        e.released,
        [("request-long".to_string(), ReleaseReason::NotHeld)]
    );
}

/// Before: `rank_lost` acted only on leases whose Grant had gone out, so a
/// lease assigned just before the loss (and every later one) waited for the
/// dead rank forever.
#[test]
fn rank_lost_covers_leases_in_flight_and_granted_later() {
    let mut e = Engine::new(2);
    e.sched.grant("before", T0).unwrap(); // queued, not sent
    e.sched.rank_lost(1);
    assert!(e.sched.is_lost(1));
    e.sched.grant("after", T0).unwrap();
    // The dead rank's process gets nothing any more.
    e.step(T0, &[1]);
    assert_eq!(e.ranks[0].held(), 2, "rank 0 holds both");
    assert_eq!(e.sched.held(), 2, "rank 0 still holds them");
    e.step(far(), &[1]);
    assert_eq!(e.sched.held(), 0);
    let mut got = e.released.clone();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    // Rank 0 expires them; the lost rank counts as "not held". (The loss
    // armed the backstop too: its probe reached rank 0, a duplicate there.)
    assert_eq!(
        got,
        [
            ("after".to_string(), ReleaseReason::NotHeld),
            ("before".to_string(), ReleaseReason::NotHeld)
        ]
    );
    let c = e.sched.counters();
    assert_eq!(c.lost_rank_releases, 2);
    assert_eq!((c.backstop_probes, c.backstop_cancels), (2, 0));
}

/// A restarted rank is resynchronised: leases whose Grant it never saw are
/// counted as let go by it (its slots start at 0, and a later directive for
/// them is answered "not held"), and later leases wait for it again.
#[test]
fn a_restarted_rank_is_resynchronised() {
    let mut e = Engine::new(2);
    e.sched.grant("old", T0).unwrap();
    e.step(T0, &[]);
    // Rank 1's process dies and a new one takes its place.
    e.ranks[1] = fresh_rank(&e.config, 1);
    e.sched.rank_restarted(1);
    assert!(!e.sched.is_lost(1));
    assert_eq!(e.sched.held(), 1, "rank 0 still holds `old`");
    // A Cancel reaches both: rank 0 releases, the new rank 1 says "not held".
    e.sched.cancel("old");
    e.step(T0, &[]);
    assert_eq!(e.released, [("old".to_string(), ReleaseReason::Cancelled)]);
    // A new lease needs both ranks again.
    e.sched.grant("new", T0).unwrap();
    e.step(T0, &[]);
    assert_eq!(e.ranks[1].held(), 1);
    e.step(far(), &[0]); // rank 0 misses nothing it needs; both expire
    assert_eq!(e.sched.held(), 0);
    assert_eq!(e.released[1], ("new".to_string(), ReleaseReason::Expired));
    assert_eq!(e.sched.counters().ranks_restarted, 1);
}

/// Item 2. Before: a lease assigned at the start of its prefill had no
/// timer until its Start; if the engine aborted the request and freed the
/// blocks without a cancel, the entry and its slot leaked, and enough such
/// leaks made every grant `Full`. Now the ranks let a pinned lease go after
/// `kv_lease_max_pin`.
#[test]
fn an_assigned_lease_that_never_starts_is_let_go_after_max_pin() {
    let mut e = Engine::new(2);
    assert_eq!(e.config.max_pin, Duration::from_secs(480));
    let slots = e.free_slots();
    e.sched.assign("aborted", T0).unwrap();
    e.step(T0, &[]);
    e.step(T0 + Duration::from_secs(479), &[]);
    assert_eq!(e.sched.held(), 1, "a long prefill keeps its lease");
    e.step(T0 + Duration::from_secs(481), &[]);
    assert_eq!(e.sched.held(), 0);
    assert_eq!(
        e.released,
        [("aborted".to_string(), ReleaseReason::Expired)]
    );
    assert_eq!(e.free_slots(), slots);
    assert_eq!(e.ranks[0].counters().pinned_expired, 1);
}

/// The abort path: `cancel` on an assigned lease releases it at once, as
/// the README's hook table says an engine does on abort or preemption.
#[test]
fn cancel_on_abort_releases_an_assigned_lease() {
    let mut e = Engine::new(2);
    e.sched.assign("aborted", T0).unwrap();
    e.step(T0, &[]);
    assert!(e.sched.cancel("aborted"));
    e.step(T0, &[]);
    assert_eq!(e.sched.held(), 0);
    assert_eq!(
        e.released,
        [("aborted".to_string(), ReleaseReason::Cancelled)]
    );
}

/// A lease that was pinned and renewed by a heartbeat that overtook its
/// Start keeps the renewal: the Start never shortens it.
#[test]
fn a_renewal_before_the_start_is_kept() {
    let mut e = Engine::new(1);
    e.sched.assign("r", T0).unwrap();
    e.step(T0, &[]);
    e.sched.start("r", T0).unwrap();
    // A heartbeat arrives 15 s later, before the rank's next step.
    let hb = T0 + Duration::from_secs(15);
    let _ = e.ranks[0].renew(b"r", hb);
    e.step(hb, &[]);
    let expiry = e.ranks[0].expiry("r").unwrap();
    assert_eq!(expiry, hb + Duration::from_secs(20), "renewal kept");
}

// ---- the backstop (PrefillScheduler::poll) ------------------------------------------

/// One tick of the wheels: the smallest step that makes a deadline due.
fn tick(e: &Engine) -> Duration {
    e.config.wheel_tick()
}

/// Grants `id`, loses its one Grant+Start message to rank 1, and lets
/// rank 0 expire it. Returns when the scheduler first saw rank 0's report
/// (the next poll): the backstop fires one `kv_lease_duration` after that.
fn lose_grant_to_rank_1_then_expire_on_rank_0(e: &mut Engine, id: &str) -> Instant {
    e.sched.grant(id, T0).unwrap();
    e.step(T0, &[1]);
    assert_eq!(e.ranks[1].held(), 0, "rank 1 never heard of {id}");
    let expired = T0 + e.config.lease_duration();
    e.step(expired, &[]);
    assert_eq!(e.ranks[0].held(), 0, "rank 0 expired {id}");
    assert_eq!(e.sched.held(), 1, "waiting for rank 1");
    let seen = expired + tick(e);
    e.step(seen, &[]);
    seen
}

/// The limit the issue 19 note left open. Before: a lease granted in one
/// step whose message rank 1 lost was never answered by rank 1, so its
/// blocks stayed held until the engine happened to cancel. Now the
/// scheduler probes it (sends its Start again) one `kv_lease_duration`
/// after rank 0 let go, and not a tick earlier; rank 1 answers "not held".
#[test]
fn the_backstop_ends_a_lease_whose_grant_a_rank_lost() {
    let mut e = Engine::new(2);
    let slots = e.free_slots();
    let seen = lose_grant_to_rank_1_then_expire_on_rank_0(&mut e, "req-1");
    let due = seen + e.config.lease_duration();
    assert_eq!(e.sched.backstop_deadline("req-1"), Some(due));
    e.step(due - tick(&e), &[]);
    assert_eq!(e.sched.held(), 1, "not before its deadline");
    assert_eq!(e.sched.counters().backstop_probes, 0);
    e.step(due, &[]);
    let c = e.sched.counters();
    assert_eq!((c.backstop_probes, c.backstop_cancels), (1, 0));
    assert_eq!(e.sched.held(), 0);
    assert_eq!(e.released, [("req-1".to_string(), ReleaseReason::NotHeld)]);
    assert_eq!(e.free_slots(), slots, "the slot is back in the pool");
    assert_eq!(e.ranks[1].counters().not_held_reported, 1);
    assert_eq!(e.sched.backstop_deadline("req-1"), None);
}

/// The probe can be lost as well: the backstop asks again every
/// `kv_lease_duration` until every rank answered.
#[test]
fn the_backstop_asks_again_when_its_probe_is_lost() {
    let mut e = Engine::new(2);
    let seen = lose_grant_to_rank_1_then_expire_on_rank_0(&mut e, "req-1");
    let due = seen + e.config.lease_duration();
    e.step(due, &[1]); // the probe is lost to rank 1 too
    assert_eq!(e.sched.counters().backstop_probes, 1);
    assert_eq!(e.sched.held(), 1);
    let again = due + e.config.lease_duration();
    assert_eq!(e.sched.backstop_deadline("req-1"), Some(again));
    e.step(again, &[]);
    assert_eq!(e.sched.counters().backstop_probes, 2);
    assert_eq!(e.sched.held(), 0);
    assert_eq!(e.released, [("req-1".to_string(), ReleaseReason::NotHeld)]);
}

/// The probe never frees a lease a rank holds. Rank 0's reader finishes;
/// rank 1's reader takes three lease durations more while D keeps
/// heartbeating it: the backstop probes rank 1 on the way (a duplicate
/// Start there, nothing changes), and the lease is released by read.
#[test]
fn the_backstop_never_frees_a_lease_a_rank_holds() {
    let mut e = Engine::new(2);
    let g = e.sched.grant("busy", T0).unwrap();
    e.step(T0, &[]);
    let _ = e.ranks[0].read_done(b"d-0", b"busy", 1, Some(g.nonce));
    e.step(T0, &[]);
    assert_eq!(e.sched.held(), 1, "rank 1's reader is still busy");
    let now = e.heartbeat("busy", &[1], T0, T0 + e.config.lease_duration() * 3);
    // A released lease never comes back: held now means held all along.
    assert_eq!(e.sched.held(), 1, "held at {now:?}");
    let c = e.sched.counters();
    assert!(c.backstop_probes >= 2, "{c:?}");
    assert_eq!(c.backstop_cancels, 0);
    assert_eq!(
        e.ranks[1].counters().directives_duplicate,
        c.backstop_probes,
        "every probe was a duplicate on the rank that holds the lease"
    );
    let _ = e.ranks[1].read_done(b"d-1", b"busy", 1, Some(g.nonce));
    e.step(now, &[]);
    assert_eq!(e.released, [("busy".to_string(), ReleaseReason::ReadDone)]);
    assert_eq!(e.sched.backstop_deadline("busy"), None);
}

/// A lease whose readers finish together never meets the backstop, however
/// long D heartbeats it first.
#[test]
fn a_healthy_lease_is_never_probed() {
    let mut e = Engine::new(2);
    let g = e.sched.grant("ok", T0).unwrap();
    e.step(T0, &[]);
    let now = e.heartbeat("ok", &[0, 1], T0, T0 + e.config.lease_duration() * 10);
    for (r, rank) in e.ranks.iter_mut().enumerate() {
        let _ = rank.read_done(format!("d-{r}").as_bytes(), b"ok", 1, Some(g.nonce));
    }
    e.step(now, &[]);
    assert_eq!(e.released, [("ok".to_string(), ReleaseReason::ReadDone)]);
    let c = e.sched.counters();
    assert_eq!((c.backstop_probes, c.backstop_cancels), (0, 0));
}

/// A probe that reaches a rank which missed the Start alone (assign and
/// start apart) starts the lease there, as the scheduler meant.
#[test]
fn a_probe_starts_a_lease_on_a_rank_that_missed_its_start() {
    let mut e = Engine::new(2);
    e.sched.assign("split", T0).unwrap();
    e.step(T0, &[]);
    e.sched.start("split", T0).unwrap();
    e.step(T0, &[1]); // the Start is lost to rank 1: still pinned there
    let pinned = Some(Instant::MAX);
    assert_eq!(e.ranks[1].expiry("split"), pinned, "pinned, not started");
    assert!(e.sched.probe("split"));
    e.step(T0 + tick(&e), &[]);
    let started = e.ranks[1].expiry("split");
    assert_eq!(started, e.ranks[0].expiry("split"), "started by the probe");
    assert_ne!(started, pinned);
    assert!(!e.sched.probe("unknown"));
}

/// One rank, and its only Grant lost: no rank ever reports, so the
/// straggler rule cannot start. A lease that was never started is cancelled
/// one `kv_lease_duration` after `kv_lease_max_pin` instead.
#[test]
fn an_unanswered_assigned_lease_is_cancelled_after_max_pin() {
    let mut e = Engine::new(1);
    let slots = e.free_slots();
    e.sched.assign("lost", T0).unwrap();
    e.step(T0, &[0]);
    let due = T0 + e.config.max_pin + e.config.lease_duration();
    assert_eq!(e.sched.backstop_deadline("lost"), Some(due));
    e.step(due - tick(&e), &[]);
    assert_eq!(e.sched.held(), 1);
    e.step(due, &[]);
    assert_eq!(e.sched.held(), 0);
    assert_eq!(e.released, [("lost".to_string(), ReleaseReason::NotHeld)]);
    assert_eq!(e.free_slots(), slots);
    assert_eq!(e.sched.counters().backstop_cancels, 1);
}

/// Starting a lease ends the pinned rule: a started lease lives as long as
/// D heartbeats it, well past `kv_lease_max_pin`.
#[test]
fn a_started_lease_outlives_the_pinned_rule() {
    let mut e = Engine::new(1);
    e.sched.assign("long-prefill", T0).unwrap();
    e.step(T0, &[]);
    let started = T0 + Duration::from_secs(400);
    e.sched.start("long-prefill", started).unwrap();
    assert_eq!(
        e.sched.backstop_deadline("long-prefill"),
        None,
        "no max_hold"
    );
    e.heartbeat("long-prefill", &[0], started, T0 + e.config.max_pin * 3);
    assert_eq!(e.sched.held(), 1);
    let c = e.sched.counters();
    assert_eq!((c.backstop_probes, c.backstop_cancels), (0, 0));
}

/// With `kv_lease_max_hold` set, a started lease that no rank answers (one
/// rank, its Grant+Start lost) is cancelled a `kv_lease_duration` past its
/// hold limit.
#[test]
fn max_hold_bounds_a_lease_that_no_rank_answers() {
    let mut config = p_side_config(16, 16);
    config.max_hold_secs = Some(120);
    let mut e = Engine::with_rank_configs(config, 1, |_, c| c.clone());
    e.sched.grant("lost", T0).unwrap();
    e.step(T0, &[0]);
    let due = T0 + Duration::from_secs(120) + e.config.lease_duration();
    assert_eq!(e.sched.backstop_deadline("lost"), Some(due));
    e.step(due - tick(&e), &[]);
    assert_eq!(e.sched.held(), 1);
    e.step(due, &[]);
    assert_eq!(e.released, [("lost".to_string(), ReleaseReason::NotHeld)]);
    assert_eq!(e.sched.counters().backstop_cancels, 1);
}
