//! Zero allocation across the D scheduler/worker split: after construction,
//! 20,000 steps of a D scheduler and two D workers exchanging only bytes
//! (tracker `plan_len` + `encode_plan`, `HeartbeatPlan::decode`, each
//! worker's `send_plan`, outcome `encode` with verdicts and owed engines,
//! `OutcomeMsg::decode`, tracker `apply_outcomes`), with requests arriving,
//! verified, failing and finishing, engines coming and going, slow, failing
//! and compact peers, allocate exactly nothing. So do 10,000 steps of a
//! `LeaseVerifier` over the loopback fabric (good, lapsed, unverifiable and
//! out-of-range checks, span and per-slot READs).
//!
//! A counting `#[global_allocator]` counts allocations made on the test's
//! own thread while armed (tests/support/counting_alloc.rs).

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{count_allocs, id_into, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

use std::sync::Arc;
use std::time::Duration;

use kvlease::consumer::{
    DefaultPeerAddress, HeartbeatSender, HeartbeatTracker, LeaseVerifier, RemotePrefillParams,
    SenderConfig, TrackOutcome, Verdict, VerifyTarget,
};
use kvlease::fabric::loopback::{LoopbackConfig, LoopbackFabric, LoopbackNetwork};
use kvlease::fabric::{Fabric, FabricError, HandshakeState};
use kvlease::ipc::outcome::{self, Outcome, OutcomeMsg};
use kvlease::ipc::plan::HeartbeatPlan;
use kvlease::slot_pool::SlotPool;
use kvlease::testkit::{FakeFabric, Policy, SplitMix64};
use kvlease::{EngineShape, Instant, LeaseBook, LeaseConfig, LeaseFields, LeaseSlots, NonceSource};

fn text(buf: &[u8; 32], len: usize) -> &str {
    std::str::from_utf8(&buf[..len]).unwrap()
}

const ENGINES: [&str; 10] = ["e0", "e1", "e2", "e3", "e4", "e5", "e6", "e7", "e8", "e9"];
const STEPS: u64 = 20_000;
/// Outcomes a worker reports per step, at most.
const PER_STEP: usize = 4;

/// A worker's verdicts of one step, in fixed storage.
struct Verdicts {
    ids: [[u8; 32]; PER_STEP],
    lens: [usize; PER_STEP],
    verdicts: [Verdict; PER_STEP],
    n: usize,
}

impl Verdicts {
    fn iter(&self) -> impl Iterator<Item = Outcome<'_>> + Clone {
        (0..self.n).map(|i| Outcome {
            request_id: text(&self.ids[i], self.lens[i]),
            verdict: self.verdicts[i],
        })
    }
}

#[test]
fn the_d_split_allocates_nothing_per_step() {
    // ---- construction (may allocate) ----
    let mut config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 4096,
        max_num_seqs: 256,
    });
    config.max_tracked_requests = 2048;
    config.max_remote_engines = 8;
    config.validate().unwrap();
    let mut tracker = HeartbeatTracker::new(&config, 2).expect("tracker");
    let make_fabric = || {
        let mut f = FakeFabric::new(512, 256, 256, 1 << 16);
        f.set_policy("p0:5600/e3/", Policy::unreachable());
        f.set_policy(
            "p0:5600/e4/",
            Policy {
                ready_after_polls: 4,
                ..Policy::compact()
            },
        );
        f.set_policy(
            "p0:5600/e5/",
            Policy {
                send_error: Some(FabricError::Full),
                ..Policy::default()
            },
        );
        f.set_default_policy(Policy::compact());
        f
    };
    let mut workers: Vec<HeartbeatSender<FakeFabric, DefaultPeerAddress>> = (0..2)
        .map(|rank| {
            let cfg = SenderConfig::new(&config, 2, rank);
            HeartbeatSender::new(make_fabric(), DefaultPeerAddress, cfg).unwrap()
        })
        .collect();
    // Room for the largest plan: every request with a 40-byte id, every
    // engine with its key.
    let mut plan_buf = vec![0u8; 32 + 8 * (44 + 16) + 2048 * (24 + 40)];
    let mut outcome_bufs = [vec![0u8; 4096], vec![0u8; 4096]];
    let mut verdicts = [(); 2].map(|_| Verdicts {
        ids: [[0; 32]; PER_STEP],
        lens: [0; PER_STEP],
        verdicts: [Verdict::Verified; PER_STEP],
        n: 0,
    });
    let mut live: Vec<u64> = Vec::with_capacity(4096);
    let mut rng = SplitMix64::new(0x0dd_ba11_cafe_f00du64);
    let mut next = move || rng.next_u64();
    let mut now = Instant::from_secs(1);
    let mut next_id = 0u64;
    let (mut d_buf, mut p_buf) = ([0u8; 32], [0u8; 32]);
    let (mut received, mut failed) = (0u64, 0u64);
    let mut plan_bytes = 0u64;

    counting_alloc::self_check();

    // ---- steady state: nothing below may allocate ----
    let ((), counts) = count_allocs(|| {
        for step in 0..STEPS {
            // A large population first, then a small one in which engines
            // keep emptying (owed engines gone) and coming back.
            let target = if step < STEPS / 2 { 1_500 } else { 10 };
            now = now + Duration::from_millis(40);
            for _ in 0..2 {
                let r = next();
                let n = next_id;
                next_id += 1;
                let e = ENGINES[(r % ENGINES.len() as u64) as usize];
                let leased = (r >> 16) % 8 != 0;
                let dl = id_into(&mut d_buf, b"cmpl-d-", n);
                let pl = id_into(&mut p_buf, b"chatcmpl-p-0123456789-", n);
                let params = RemotePrefillParams {
                    do_remote_prefill: true,
                    remote_engine_id: Some(e),
                    remote_request_id: Some(text(&p_buf, pl)),
                    remote_host: Some("p0"),
                    remote_port: Some(5600),
                    tp_size: Some([1, 2, 4][(r >> 8) as usize % 3]),
                    remote_lease_slot: leased.then_some((n % 4096) as u32),
                    remote_lease_nonce: leased.then_some(n as i64 + 1),
                    ..Default::default()
                };
                if let Ok(TrackOutcome::Started) =
                    tracker.on_new_request(text(&d_buf, dl), &params, now)
                {
                    live.push(n);
                }
            }
            // Verdicts: once the population reached its target, both
            // workers report two requests; one in eight fails on worker 1.
            for v in &mut verdicts {
                v.n = 0;
            }
            for _ in 0..2 {
                if live.len() < target {
                    break;
                }
                let r = next();
                let n = live.swap_remove((r % live.len() as u64) as usize);
                for (w, v) in verdicts.iter_mut().enumerate() {
                    let i = v.n;
                    v.lens[i] = id_into(&mut v.ids[i], b"cmpl-d-", n);
                    v.verdicts[i] = if w == 1 && (r >> 32) % 8 == 0 {
                        Verdict::ReadFailed(FabricError::Backend(-3))
                    } else {
                        Verdict::Verified
                    };
                    v.n += 1;
                }
            }
            // An unknown id now and then (a duplicate or late outcome).
            if step % 7 == 0 {
                let v = &mut verdicts[0];
                let i = v.n;
                v.lens[i] = id_into(&mut v.ids[i], b"never-", step);
                v.verdicts[i] = Verdict::Lapsed;
                v.n += 1;
            }
            // The scheduler's plan.
            let len = tracker.plan_len(now);
            let n = tracker.encode_plan(now, &mut plan_buf).unwrap();
            assert_eq!(n, len);
            plan_bytes += n as u64;
            // Each worker: decode, heartbeat, report.
            let plan = HeartbeatPlan::decode(&plan_buf[..n]).unwrap();
            let mut lens = [0usize; 2];
            for (rank, w) in workers.iter_mut().enumerate() {
                w.send_plan(&plan, now);
                lens[rank] = outcome::encode(
                    &mut outcome_bufs[rank],
                    rank as u32,
                    step as u32,
                    verdicts[rank].iter(),
                    w.owed_engines(),
                )
                .unwrap();
            }
            // The scheduler applies both outcome messages.
            for rank in 0..2 {
                let msg = OutcomeMsg::decode(&outcome_bufs[rank][..lens[rank]]).unwrap();
                tracker
                    .apply_outcomes(&msg, |_, v| {
                        if v.is_verified() {
                            received += 1;
                        } else {
                            failed += 1;
                        }
                    })
                    .unwrap();
            }
        }
    });
    let (allocs, bytes) = (counts.allocs, counts.bytes);
    let tc = tracker.counters();
    let (c0, c1) = (workers[0].counters(), workers[1].counters());
    eprintln!("tracker: {tc:?}");
    eprintln!("rank 0: {c0:?}");
    eprintln!("rank 1: {c1:?}");
    eprintln!("received {received}, failed {failed}, plan bytes {plan_bytes}");
    // The run exercised what it claims to.
    assert!(received > 10_000 && failed > 1_000, "{received} {failed}");
    assert!(tc.requests_due > 100_000, "the large regime heartbeats");
    assert!(tc.engines_owed > 1_000 && tc.owed_stale > 0 && tc.outcomes_untracked > 0);
    for c in [c0, c1] {
        assert!(
            c.messages_sent > 10_000 && c.compact_messages_sent > 0,
            "{c:?}"
        );
        assert!(c.deferred_sent > 0 && c.deferred_dropped > 0, "{c:?}");
        assert!(c.owed_visits > 1_000 && c.send_failed > 0 && c.handshakes_failed > 0);
    }
    assert_eq!(
        (allocs, bytes),
        (0, 0),
        "the D split allocated {allocs} times ({bytes} bytes)"
    );
}

#[test]
fn verifier_steps_over_loopback_allocate_nothing() {
    // ---- construction (may allocate) ----
    let net = LoopbackNetwork::new(LoopbackConfig::default());
    let config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 4096,
        max_num_seqs: 256,
    });
    let count = config.lease_slots;
    let slots = Arc::new(LeaseSlots::new(count));
    let mut p = LoopbackFabric::join(&net, "p").unwrap();
    p.register_slots(slots.clone(), true).unwrap();
    let mut d = LoopbackFabric::join(&net, "d").unwrap();
    let mut now = Instant::from_secs(1);
    let agent = d.start_handshake("p", now).unwrap();
    let info = loop {
        if let HandshakeState::Ready(info) = d.handshake_state(agent, now) {
            break info;
        }
    };
    let target = VerifyTarget::from_peer(agent, &info).unwrap();
    let mut book = LeaseBook::with_parts(
        &config,
        vec![slots],
        Arc::new(SlotPool::new(count)),
        NonceSource::from_seed(7, 8, 9),
        now,
    )
    .unwrap();
    // Leases that stay held, on slots 0..3000: four checks a step often
    // span more than a READ window (per-slot READs), sometimes not (one span).
    let mut held = Vec::with_capacity(3000);
    for i in 0..3000 {
        let g = book.grant(&format!("held-{i}"), now).unwrap();
        held.push(g.fields.unwrap());
    }
    let mut verifier =
        LeaseVerifier::new(&mut d, &kvlease::testkit::verifier_config(64, 4)).unwrap();
    let mut got = [0u64; 5];
    let mut rng_gen = SplitMix64::new(0x5eed_u64);

    // ---- steady state ----
    let ((), counts) = count_allocs(|| {
        for step in 0..10_000u64 {
            now = now + Duration::from_millis(10);
            net.advance_to(now);
            for k in 0..4u64 {
                let rng = rng_gen.next_u64();
                let good = held[(rng % 3000) as usize];
                let lease = match (step + k) % 5 {
                    0 => None,
                    1 => LeaseFields::from_params(Some(count + (rng % 4000) as u32), Some(9)),
                    2 => LeaseFields::from_params(Some(good.slot), Some(good.nonce.as_int64() ^ 1)),
                    _ => Some(good),
                };
                let targets = if lease.is_some() { &[target][..] } else { &[] };
                verifier.submit(step * 4 + k, lease, targets).unwrap();
            }
            verifier.step(&mut d, now, |_, v| {
                let i = match v {
                    Verdict::Verified => 0,
                    Verdict::Lapsed => 1,
                    Verdict::Unverifiable => 2,
                    Verdict::SlotOutOfRange => 3,
                    _ => 4,
                };
                got[i] += 1;
            });
        }
    });
    eprintln!("verdicts {got:?}, counters {:?}", verifier.counters());
    assert!(got[0] > 10_000 && got[1] > 5_000 && got[2] > 5_000 && got[3] > 5_000);
    assert_eq!(got[4], 0, "no READ failed");
    let c = verifier.counters();
    assert!(c.coalesced_reads > 1_000 && c.slot_reads - c.coalesced_reads > 1_000);
    assert_eq!(
        (counts.allocs, counts.bytes),
        (0, 0),
        "verifier steps allocated {} times ({} bytes)",
        counts.allocs,
        counts.bytes
    );
}
