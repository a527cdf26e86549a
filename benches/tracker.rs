//! Benchmarks of the D-side `HeartbeatTracker` step: 10,000 tracked requests
//! over 16 engines, every engine due every iteration (`now` advances by one
//! heartbeat interval per iteration), and every due request visited the way
//! the sender visits it (its P-side id read, or its slot and nonce).
//!
//! Beside it, in the same group, the naive baselines: a
//! `HashMap<String, Vec<String>>` from engine to P-side ids, (a) rebuilt
//! from the tracked requests and iterated each step (what a per-step
//! "heartbeat metadata" dict costs), and (b) kept across steps and only
//! iterated (the floor for any map-of-vectors layout).
//!
//! And the scheduler/worker split's cost beside them: the D scheduler's
//! `encode_plan` (all 16 engines due, every request's P-side id and lease
//! written), a worker's `HeartbeatPlan::decode` plus the walk the sender
//! makes (every id and lease read), and both together.
//!
//! Throughput is in tracked requests, so criterion's elements/s inverts to
//! the per-request cost. Run with `cargo bench --bench tracker`.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvlease::consumer::{HeartbeatTracker, RemotePrefillParams};
use kvlease::ipc::plan::HeartbeatPlan;
use kvlease::{EngineShape, Instant, LeaseConfig};

mod common;
use common::uuid_request_id;

const REQUESTS: usize = 10_000;
const ENGINES: usize = 16;

/// `cmpl-xxxxxxxx-xxxx-4xxx-yxxx-xxxxxxxxxxxx-0`-shaped ids (43 bytes), as
/// vLLM's, derived from `n` so every run sees the same inputs.
fn vllm_id(prefix: &str, n: u64) -> String {
    let a = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let b = a.rotate_left(29) ^ 0xbf58_476d_1ce4_e5b9;
    uuid_request_id(prefix, a, b)
}

struct Workload {
    /// (D-side id, engine id, P-side id), in arrival order.
    requests: Vec<(String, String, String)>,
}

fn workload() -> Workload {
    let engines: Vec<String> = (0..ENGINES).map(|e| format!("prefill-{e}")).collect();
    let requests = (0..REQUESTS as u64)
        .map(|n| {
            (
                vllm_id("cmpl", n),
                engines[n as usize % ENGINES].clone(),
                vllm_id("chatcmpl", n),
            )
        })
        .collect();
    Workload { requests }
}

fn tracker(w: &Workload, leased: bool) -> HeartbeatTracker {
    let mut config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 16_384,
        max_num_seqs: 512,
    });
    config.max_tracked_requests = REQUESTS as u32;
    config.max_remote_engines = ENGINES as u32;
    config.validate().expect("bench config");
    let mut t = HeartbeatTracker::new(&config, 1).expect("tracker");
    for (i, (d, e, p)) in w.requests.iter().enumerate() {
        let params = RemotePrefillParams {
            do_remote_prefill: true,
            remote_engine_id: Some(e),
            remote_request_id: Some(p),
            remote_host: Some("10.0.0.7"),
            remote_port: Some(5600),
            tp_size: Some(4),
            remote_lease_slot: leased.then_some(i as u32),
            remote_lease_nonce: leased.then_some(i as i64 + 1),
            ..Default::default()
        };
        t.on_new_request(d, &params, Instant::ZERO)
            .expect("capacity fits the workload");
    }
    assert_eq!(t.len() as usize, REQUESTS);
    assert_eq!(t.engine_count() as usize, ENGINES);
    t
}

fn bench_step(c: &mut Criterion) {
    let w = workload();
    let mut g = c.benchmark_group("tracker_step_10k_req_16_engines");
    g.throughput(Throughput::Elements(REQUESTS as u64));
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(30);

    // The tracker: due() on all 16 engines, every P-side id read.
    {
        let mut t = tracker(&w, false);
        let interval = t.interval();
        let mut now = Instant::ZERO;
        g.bench_function("tracker_due_ids", |b| {
            b.iter(|| {
                now = now + interval;
                let mut acc = 0usize;
                let due = t.due(now, |batch| {
                    for id in batch.remote_request_ids() {
                        acc = acc.wrapping_add(id.len()) ^ usize::from(id.as_bytes()[0]);
                    }
                });
                debug_assert_eq!(due as usize, ENGINES);
                black_box((due, acc))
            })
        });
    }

    // The tracker, compact form: every (slot, nonce) read.
    {
        let mut t = tracker(&w, true);
        let interval = t.interval();
        let mut now = Instant::ZERO;
        g.bench_function("tracker_due_leases", |b| {
            b.iter(|| {
                now = now + interval;
                let mut acc = 0u64;
                let due = t.due(now, |batch| {
                    if batch.all_leased() {
                        for l in batch.leases() {
                            acc = acc.wrapping_add(u64::from(l.slot)) ^ l.nonce.get();
                        }
                    }
                });
                black_box((due, acc))
            })
        });
    }

    // The split: the scheduler encodes the plan (all due), a worker decodes
    // it and walks every id and lease as the sender does.
    {
        let mut t = tracker(&w, true);
        let interval = t.interval();
        let mut now = Instant::ZERO;
        let mut buf = vec![0u8; t.plan_len(now)];
        g.bench_function("plan_encode", |b| {
            b.iter(|| {
                now = now + interval;
                black_box(t.encode_plan(now, &mut buf).expect("sized"))
            })
        });
        now = now + interval;
        let n = t.encode_plan(now, &mut buf).expect("sized");
        let bytes = buf[..n].to_vec();
        let walk = |bytes: &[u8]| {
            let plan = HeartbeatPlan::decode(bytes).expect("decodes");
            let mut acc = 0u64;
            for e in plan.engines() {
                for r in e.remotes() {
                    acc = acc.wrapping_add(r.remote_request_id.len() as u64)
                        ^ r.lease.map_or(0, |l| l.nonce.get());
                }
            }
            debug_assert_eq!(plan.len() as usize, ENGINES);
            acc
        };
        g.bench_function("plan_decode_walk", |b| {
            b.iter(|| black_box(walk(black_box(&bytes))))
        });
        g.bench_function("plan_encode_decode_walk", |b| {
            b.iter(|| {
                now = now + interval;
                let n = t.encode_plan(now, &mut buf).expect("sized");
                black_box(walk(&buf[..n]))
            })
        });
    }

    // Naive (a): rebuild HashMap<String, Vec<String>> from the tracked
    // requests each step, then iterate it.
    {
        let tracked: Vec<(String, String)> = w
            .requests
            .iter()
            .map(|(_, e, p)| (e.clone(), p.clone()))
            .collect();
        g.bench_function("naive_hashmap_rebuilt", |b| {
            b.iter(|| {
                let mut by_engine: HashMap<String, Vec<String>> = HashMap::new();
                for (e, p) in &tracked {
                    by_engine.entry(e.clone()).or_default().push(p.clone());
                }
                let mut acc = 0usize;
                for ids in by_engine.values() {
                    for id in ids {
                        acc = acc.wrapping_add(id.len()) ^ usize::from(id.as_bytes()[0]);
                    }
                }
                black_box(acc)
            })
        });
    }

    // Naive (b): the same map kept across steps, only iterated.
    {
        let mut by_engine: HashMap<String, Vec<String>> = HashMap::new();
        for (_, e, p) in &w.requests {
            by_engine.entry(e.clone()).or_default().push(p.clone());
        }
        g.bench_function("naive_hashmap_iterated", |b| {
            b.iter(|| {
                let mut acc = 0usize;
                for ids in by_engine.values() {
                    for id in ids {
                        acc = acc.wrapping_add(id.len()) ^ usize::from(id.as_bytes()[0]);
                    }
                }
                black_box(acc)
            })
        });
    }
    g.finish();
}

/// One request's whole tracked life at steady state with 10k tracked:
/// `on_new_request` then `on_request_finished`.
fn bench_churn(c: &mut Criterion) {
    let w = workload();
    let mut g = c.benchmark_group("tracker_churn_10k_tracked");
    g.throughput(Throughput::Elements(1));
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(2));
    g.sample_size(30);
    let mut t = tracker(&w, true);
    let mut i = 0usize;
    g.bench_function("track_then_stop", |b| {
        b.iter(|| {
            // Stop the oldest-in-rotation request and track it again.
            let (d, e, p) = &w.requests[i % REQUESTS];
            i += 1;
            let stopped = t.on_request_finished(d);
            let params = RemotePrefillParams {
                do_remote_prefill: true,
                remote_engine_id: Some(e),
                remote_request_id: Some(p),
                remote_host: Some("10.0.0.7"),
                remote_port: Some(5600),
                tp_size: Some(4),
                remote_lease_slot: Some(7),
                remote_lease_nonce: Some(9),
                ..Default::default()
            };
            black_box((stopped, t.on_new_request(d, &params, Instant::ZERO)))
        })
    });
    g.finish();
}

criterion_group!(benches, bench_step, bench_churn);
criterion_main!(benches);
