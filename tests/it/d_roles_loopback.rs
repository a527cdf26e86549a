//! The D scheduler and its workers apart, end to end over the loopback
//! fabric in virtual time, exchanging nothing but role-message bytes:
//!
//! ```text
//!  D scheduler (tracker)  --plan bytes-->     D worker r (sender + verifier, own agent)
//!                         <--outcome bytes--  (verdicts, owed engines)
//!  D worker r  --HB:/HBC:-->  P rank r (LeaseBook rank, own agent, lease slots)
//!  D worker r  --slot READ--> P rank r
//! ```
//!
//! P TP 2, D TP 2 (worker r reads P rank r). The first heartbeat is owed
//! (the handshake takes several polls) and leaves at the first step after
//! the handshake completes; heartbeats keep P's leases alive for minutes;
//! the outcomes drive the tracker: a request verified by both workers is
//! received, one without lease fields fails at the first outcome; tracking
//! stops, heartbeats stop, and P reclaims. A slot beyond what the P rank
//! exports fails only its own check over the real loopback READ path.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::support::loopback_p::{loopback_p, p_step, ENGINE};
use kvlease::consumer::{
    EngineHandle, EngineKey, HeartbeatSender, HeartbeatTracker, LeaseVerifier, PeerStatus,
    RemotePrefillParams, SenderConfig, Verdict, VerifyTarget,
};
use kvlease::fabric::loopback::{LoopbackConfig, LoopbackFabric, LoopbackNetwork};
use kvlease::fabric::{Fabric, HandshakeState};
use kvlease::ipc::outcome::{self, Outcome, OutcomeMsg};
use kvlease::ipc::plan::HeartbeatPlan;
use kvlease::slot_pool::SlotPool;
use kvlease::testkit::remote_prefill;
use kvlease::{
    EngineShape, Instant, LeaseBook, LeaseConfig, LeaseFields, LeaseSlots, NonceSource,
    ReleaseReason,
};

type AddressFn = fn(&EngineKey<'_>, u32, &mut dyn fmt::Write) -> fmt::Result;

/// Loopback P agents are named `{engine_id}/{rank}`: that is the address.
fn address(k: &EngineKey<'_>, rank: u32, out: &mut dyn fmt::Write) -> fmt::Result {
    write!(out, "{}/{}", k.engine_id, rank)
}

const TP: u32 = 2;
const STEP: Duration = Duration::from_millis(100);

/// One D worker process: its own agent, sender and verifier, and what it
/// tells the scheduler.
struct Worker {
    rank: u32,
    sender: HeartbeatSender<LoopbackFabric, AddressFn>,
    verifier: LeaseVerifier,
    /// The engine's handle, learnt from the plan.
    engine: Option<EngineHandle>,
    /// Verdicts of this step, by D-side id (the worker's token table).
    verdicts: Vec<(String, Verdict)>,
    seq: u32,
}

impl Worker {
    /// One worker step: the plan in, heartbeats out, slot READs driven, and
    /// the outcome message back (its bytes).
    fn step(&mut self, plan_bytes: &[u8], tokens: &[String], now: Instant) -> Vec<u8> {
        let plan = HeartbeatPlan::decode(plan_bytes).expect("the scheduler's plan decodes");
        if let Some(e) = plan.engines().next() {
            self.engine = Some(e.handle());
        }
        self.sender.send_plan(&plan, now);
        // Engine-loop progress: D drives its agent every step.
        self.sender
            .fabric_mut()
            .drain_notifications(&mut |_, _| {})
            .expect("D drains");
        let verdicts = &mut self.verdicts;
        self.verifier
            .step(self.sender.fabric_mut(), now, |token, v| {
                verdicts.push((tokens[token as usize].clone(), v));
            });
        let outcomes = self.verdicts.iter().map(|(id, v)| Outcome {
            request_id: id,
            verdict: *v,
        });
        let owed = self.sender.owed_engines();
        let mut buf = vec![0u8; outcome::encoded_len(outcomes.clone(), owed.len() as u32)];
        let n = outcome::encode(&mut buf, self.rank, self.seq, outcomes, owed).unwrap();
        buf.truncate(n);
        self.seq += 1;
        self.verdicts.clear();
        buf
    }

    /// The P rank this worker reads from, once its handshake is done.
    fn target(&mut self, now: Instant) -> VerifyTarget {
        let handle = self.engine.expect("planned");
        let Some(PeerStatus::Ready { agent, .. }) = self.sender.peer_status(handle, self.rank)
        else {
            panic!("worker {} has no ready peer", self.rank);
        };
        let HandshakeState::Ready(info) = self.sender.fabric_mut().handshake_state(agent, now)
        else {
            panic!("a ready peer stays ready");
        };
        VerifyTarget::from_peer(agent, &info).expect("P exports lease slots")
    }
}

struct Deployment {
    net: Arc<LoopbackNetwork>,
    config: LeaseConfig,
    book: LeaseBook,
    p_agents: Vec<LoopbackFabric>,
    /// When each P rank heard a heartbeat.
    heard: Vec<Vec<Instant>>,
    released: Vec<(String, ReleaseReason, Instant)>,
    tracker: HeartbeatTracker,
    workers: Vec<Worker>,
    /// The tokens the workers' verifiers report: index -> D-side id.
    tokens: Vec<String>,
    /// What the scheduler learnt from the outcomes: (id, verdict, when).
    outcomes: Vec<(String, Verdict, Instant)>,
    plan: Vec<u8>,
    now: Instant,
}

impl Deployment {
    fn new(compact: bool) -> Deployment {
        let net = LoopbackNetwork::new(LoopbackConfig {
            handshake_polls: 3,
            ..LoopbackConfig::default()
        });
        let config = LeaseConfig::new(EngineShape {
            num_kv_blocks: 256,
            max_num_seqs: 16,
        });
        let now = Instant::from_secs(10);
        let nonces = NonceSource::from_seed(4, 5, 6);
        let (book, p_agents) = loopback_p(&net, &config, TP, compact, nonces, now);
        let workers = (0..TP)
            .map(|rank| {
                let mut f = LoopbackFabric::join(&net, &format!("decode/{rank}")).unwrap();
                let verifier =
                    LeaseVerifier::new(&mut f, &kvlease::testkit::verifier_config(16, 4)).unwrap();
                let sender = HeartbeatSender::new(
                    f,
                    address as AddressFn,
                    SenderConfig::new(&config, TP, rank),
                )
                .unwrap();
                Worker {
                    rank,
                    sender,
                    verifier,
                    engine: None,
                    verdicts: Vec::new(),
                    seq: 0,
                }
            })
            .collect();
        let tracker = HeartbeatTracker::new(&config, TP).expect("tracker");
        Deployment {
            net,
            book,
            p_agents,
            heard: vec![Vec::new(); TP as usize],
            released: Vec::new(),
            tracker,
            workers,
            tokens: Vec::new(),
            outcomes: Vec::new(),
            plan: Vec::new(),
            config,
            now,
        }
    }

    /// P leases `p_id`; D's scheduler receives it as `d_id`, with P's lease
    /// fields unless `drop_fields` (a router lost them). Returns the fields.
    fn route(&mut self, p_id: &str, d_id: &str, drop_fields: bool) -> Option<LeaseFields> {
        let g = self.book.grant(p_id, self.now).unwrap();
        let fields = g.fields;
        let sent = if drop_fields { None } else { fields };
        let params = RemotePrefillParams {
            remote_lease_slot: sent.map(|f| f.slot),
            remote_lease_nonce: sent.map(|f| f.nonce.as_int64()),
            ..remote_prefill(ENGINE, p_id, "10.0.0.1", 5600, TP)
        };
        assert!(params.lease_fields() == sent);
        self.tracker
            .on_new_request(d_id, &params, self.now)
            .unwrap();
        self.tokens.push(d_id.to_string());
        fields.filter(|_| !drop_fields)
    }

    /// One step of everyone: scheduler plan, workers, P, outcomes applied.
    fn step(&mut self) {
        self.now = self.now + STEP;
        let now = self.now;
        self.net.advance_to(now);
        // D scheduler: the plan, as bytes.
        self.plan.resize(self.tracker.plan_len(now), 0);
        let n = self.tracker.encode_plan(now, &mut self.plan).unwrap();
        // D workers: only the bytes cross.
        let messages: Vec<Vec<u8>> = self
            .workers
            .iter_mut()
            .map(|w| w.step(&self.plan[..n], &self.tokens, now))
            .collect();
        // P ranks.
        let (book, agents, heard) = (&mut self.book, &mut self.p_agents, &mut self.heard);
        p_step(book, agents, now, false, &mut self.released, |rank, msg| {
            if msg.starts_with(b"HB") {
                heard[rank].push(now);
            }
        });
        // D scheduler: the outcome bytes from every worker.
        for bytes in messages {
            let msg = OutcomeMsg::decode(&bytes).expect("a worker's outcomes decode");
            let outcomes = &mut self.outcomes;
            self.tracker
                .apply_outcomes(&msg, |id, v| outcomes.push((id.to_string(), v, now)))
                .unwrap();
        }
    }

    fn run(&mut self, dt: Duration) {
        let end = self.now + dt;
        while self.now < end {
            self.step();
        }
    }
}

#[test]
fn scheduler_and_workers_apart_keep_leases_alive_and_outcomes_end_tracking() {
    let mut d = Deployment::new(true);
    let start = d.now;
    let fields = d.route("cmpl-1", "d-1", false).expect("a verifiable lease");
    assert_eq!(d.route("cmpl-2", "d-2", true), None);

    // The first heartbeat is owed: step 1 starts the handshakes, the owed
    // engine is planned again at step 2 (handshakes just started), the
    // workers poll the pending handshakes themselves at the ends of steps 2
    // and 3 (no plan carries the engine meanwhile), and the heartbeat
    // leaves at step 4, the step after the one at which the handshake was
    // ready (the third poll), not an interval later.
    d.run(STEP * 10);
    for rank in 0..TP as usize {
        assert_eq!(
            d.heard[rank].first().copied(),
            Some(start + STEP * 4),
            "P rank {rank}: {:?}",
            d.heard[rank]
        );
    }
    for w in &d.workers {
        let c = w.sender.counters();
        assert_eq!((c.deferred, c.deferred_sent), (1, 1), "rank {}", w.rank);
        assert_eq!(c.compact_messages_sent, 0, "d-2 has no lease: text");
    }
    assert_eq!(d.tracker.counters().engines_owed, 2);

    // Two minutes in D's queue, four times P's initial lease: both leases
    // are kept alive by the workers' heartbeats, one per interval per rank.
    d.run(Duration::from_secs(120));
    assert!(d.released.is_empty(), "{:?}", d.released);
    assert_eq!(d.book.held(), 2);
    for rank in 0..TP as usize {
        let n = d.heard[rank].len();
        assert!((24..=26).contains(&n), "rank {rank}: {n} heartbeats");
    }

    // The block READs completed on both workers: each checks the lease slot
    // of the P rank it read from. d-2 has no lease fields.
    for w in &mut d.workers {
        let target = w.target(d.now);
        assert_eq!(target.slot_count, d.config.lease_slots);
        w.verifier.submit(0, Some(fields), &[target]).unwrap();
        w.verifier.submit(1, None, &[]).unwrap();
    }
    let submitted = d.now;
    d.run(STEP * 3);
    // d-2 failed at the first worker's outcome; d-1 was received once both
    // workers verified it (their outcomes arrive in the same step here).
    assert_eq!(
        d.outcomes,
        [
            ("d-2".to_string(), Verdict::Unverifiable, submitted + STEP),
            ("d-1".to_string(), Verdict::Verified, submitted + STEP),
        ]
    );
    assert!(d.tracker.is_empty(), "tracking stopped for both");
    let c = d.tracker.counters();
    assert_eq!((c.loads_verified, c.loads_failed), (1, 1));
    assert_eq!((c.outcomes, c.outcomes_untracked), (4, 1));
    assert_eq!(c.stopped_transfer_complete, 1);

    // Heartbeats stop; P (which gets no read-done here) reclaims both
    // leases within one extension.
    let heard_before: usize = d.heard.iter().map(Vec::len).sum();
    d.run(d.config.lease_extension() + Duration::from_secs(2));
    let heard_after: usize = d.heard.iter().map(Vec::len).sum();
    assert!(
        heard_after - heard_before <= 2,
        "at most the step in flight"
    );
    let mut released: Vec<_> = d.released.iter().map(|r| (r.0.as_str(), r.1)).collect();
    released.sort_by_key(|r| r.0);
    assert_eq!(
        released,
        [
            ("cmpl-1", ReleaseReason::Expired),
            ("cmpl-2", ReleaseReason::Expired)
        ]
    );
    assert!(d
        .released
        .iter()
        .all(|r| r.2 <= submitted + d.config.lease_extension() + Duration::from_secs(1)));
}

#[test]
fn compact_heartbeats_cross_the_split_when_every_request_is_leased() {
    let mut d = Deployment::new(true);
    d.route("cmpl-1", "d-1", false).unwrap();
    d.route("cmpl-2", "d-2", false).unwrap();
    d.run(Duration::from_secs(60));
    assert!(d.released.is_empty());
    for w in &d.workers {
        let c = w.sender.counters();
        assert!(c.messages_sent >= 12, "{c:?}");
        assert_eq!(c.compact_messages_sent, c.messages_sent);
    }
    assert!(d.book.counters().renewed >= 2 * 2 * 12);
}

/// Issue 8 item 6 over the loopback fabric, which refuses a READ whose
/// descriptor leaves the remote region: before the slot was checked against
/// the advertised count, the good check batched with the bad one failed too
/// (`ReadFailed(OutOfBounds)`).
#[test]
fn a_bad_slot_fails_only_its_own_check_over_loopback() {
    let net = LoopbackNetwork::new(LoopbackConfig::default());
    let config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 256,
        max_num_seqs: 16,
    });
    let slots = Arc::new(LeaseSlots::new(config.lease_slots));
    let mut p = LoopbackFabric::join(&net, "p").unwrap();
    p.register_slots(slots.clone(), false).unwrap();
    let mut d = LoopbackFabric::join(&net, "d").unwrap();
    let now = Instant::from_secs(1);
    let agent = d.start_handshake("p", now).unwrap();
    let info = loop {
        match d.handshake_state(agent, now) {
            HandshakeState::Ready(info) => break info,
            HandshakeState::Pending => {}
            HandshakeState::Failed(e) => panic!("{e}"),
        }
    };
    let target = VerifyTarget::from_peer(agent, &info).unwrap();
    let count = config.lease_slots;
    assert_eq!(target.slot_count, count);
    // Two leases on P: their slots hold their nonces.
    let mut book = LeaseBook::with_parts(
        &config,
        vec![slots],
        Arc::new(SlotPool::new(count)),
        NonceSource::from_seed(1, 2, 3),
        now,
    )
    .unwrap();
    let lease = |g: kvlease::Grant| g.fields;
    let a = lease(book.grant("a", now).unwrap()).unwrap();
    let b = lease(book.grant("b", now).unwrap()).unwrap();
    let bad_fields = |slot| LeaseFields::from_params(Some(slot), Some(77));
    let mut v = LeaseVerifier::new(&mut d, &kvlease::testkit::verifier_config(8, 2)).unwrap();
    // Slot `count` (the first past the end) lies within a span window of a
    // and b: before the fix, one span READ running past the region. Slot
    // 5000 does not: before the fix, one 8-byte descriptor per check, one of
    // them outside the region. Either way the fabric refused the whole READ.
    // Now the bad check fails alone and a and b share one span READ.
    for (bad, coalesced) in [(count, 1u64), (5000, 2)] {
        v.submit(1, Some(a), &[target]).unwrap();
        v.submit(2, bad_fields(bad), &[target]).unwrap();
        v.submit(3, Some(b), &[target]).unwrap();
        let mut got = Vec::new();
        for _ in 0..4 {
            net.advance_to(now);
            v.step(&mut d, now, |t, verdict| got.push((t, verdict)));
        }
        got.sort_by_key(|g| g.0);
        assert_eq!(
            got,
            [
                (1, Verdict::Verified),
                (2, Verdict::SlotOutOfRange),
                (3, Verdict::Verified)
            ],
            "bad slot {bad}"
        );
        assert_eq!(v.counters().coalesced_reads, coalesced);
        assert_eq!(v.counters().read_failed, 0);
    }
    // The verifier may go before the fabric: the fabric keeps its share of
    // the landing buffers (and READs in flight land in them) until it goes.
    v.submit(4, Some(a), &[target]).unwrap();
    v.step(&mut d, now, |_, _| {});
    drop(v);
    for _ in 0..4 {
        let _ = d.drain_notifications(&mut |_, _| {});
    }
    drop(d);
}
