//! The P scheduler's backstop, `PrefillScheduler::poll`, once per engine
//! step, beside a naive backstop measured in the same run.
//!
//! Sizes: 1k, 10k, 100k live leases on a scheduler of two ranks (30 s
//! lease, 10 ms tick), every lease granted, started and announced; ids
//! `cmpl-<32 hex>-0`. Each iteration is one engine step, 20 ms after the
//! last.
//!
//! - `idle`: no rank let go of any lease (no `kv_lease_max_hold`), so no
//!   lease is armed: a poll finds nothing to do.
//! - `armed`: rank 0 let go of every lease and rank 1 never answers (the
//!   lost-directive case the backstop is for), so every lease is armed, its
//!   deadlines spread evenly over one lease duration; in each step the
//!   leases whose deadline passed are probed (their Start queued again) and
//!   re-armed a lease duration on: about n / 1,500 per step.
//! - `naive`: the same rule without a timer: every poll scans every live
//!   lease's deadline (`Vec<Option<Instant>>`), probes the due ones (a
//!   pending flag) and re-arms them. O(leases) per step whatever is due.
//!
//! Run with `cargo bench --bench backstop`; the medians are in
//! `docs/benchmarks.md` ("P roles").

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvlease::ipc::report::RankReport;
use kvlease::testkit::SplitMix64;
use kvlease::{Instant, Nonce, PrefillScheduler, ReleaseReason};

mod common;
use common::{lease_config, request_id};

const SIZES: [u32; 3] = [1_000, 10_000, 100_000];
const STEP: Duration = Duration::from_millis(20);
const T0: Instant = Instant::from_secs(1_000);

/// A scheduler of two ranks holding `n` started, announced leases; with
/// `armed`, rank 0 let go of each, stamped over one lease duration of
/// 20 ms steps. Returns it, each lease's (entry, nonce), and the time.
fn scheduler(n: u32, armed: bool) -> (PrefillScheduler, Vec<(u32, Nonce)>, Instant) {
    let cfg = lease_config(n);
    let mut s = PrefillScheduler::new(&cfg, 2, T0).expect("scheduler");
    let mut rng = SplitMix64::new(u64::from(n));
    let mut leases = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let id = request_id(&mut rng);
        let a = s.assign(&id, T0).expect("assign");
        s.start(&id, T0).expect("start");
        leases.push((a.entry, a.nonce));
    }
    s.drain_directives(T0, |_| {});
    let mut now = T0;
    if armed {
        let steps = (cfg.lease_duration().as_millis() / STEP.as_millis()) as usize;
        for chunk in leases.chunks(leases.len().div_ceil(steps)) {
            for &(entry, nonce) in chunk {
                let r = RankReport {
                    entry,
                    nonce,
                    reason: ReleaseReason::ReadDone,
                };
                s.on_report(0, r);
            }
            now = now + STEP;
            s.poll(now);
        }
    }
    (s, leases, now)
}

/// The naive backstop: a deadline per lease, scanned in full every step.
struct Naive {
    deadline: Vec<Option<Instant>>,
    pending: Vec<bool>,
    duration: Duration,
}

impl Naive {
    /// `n` leases, armed (or not) as `scheduler` left its own.
    fn new(n: u32, armed: bool, now: Instant) -> Naive {
        let duration = lease_config(n).lease_duration();
        let deadline = (0..n)
            .map(|k| {
                armed.then(|| {
                    // Spread as the scheduler's are: one lease duration.
                    now + duration.mul_f64(f64::from(k) / f64::from(n))
                })
            })
            .collect();
        Naive {
            deadline,
            pending: vec![false; n as usize],
            duration,
        }
    }

    fn poll(&mut self, now: Instant) -> u32 {
        let mut queued = 0;
        for (d, p) in self.deadline.iter_mut().zip(&mut self.pending) {
            if let Some(at) = *d {
                if at <= now {
                    *p = true;
                    *d = Some(now + self.duration);
                    queued += 1;
                }
            }
        }
        queued
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("backstop_poll");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for n in SIZES {
        for armed in [false, true] {
            let case = if armed { "armed" } else { "idle" };
            let (mut s, _leases, t) = scheduler(n, armed);
            let mut now = t;
            let probes_before = s.counters().backstop_probes;
            let mut steps = 0u64;
            g.bench_with_input(
                BenchmarkId::new(format!("{case}/kvlease"), n),
                &n,
                |b, _| {
                    b.iter(|| {
                        now = now + STEP;
                        steps += 1;
                        black_box(s.poll(now))
                    })
                },
            );
            let probes = s.counters().backstop_probes - probes_before;
            let mut naive = Naive::new(n, armed, t);
            let mut now = t;
            let mut naive_steps = 0u64;
            let mut naive_probes = 0u64;
            g.bench_with_input(BenchmarkId::new(format!("{case}/naive"), n), &n, |b, _| {
                b.iter(|| {
                    now = now + STEP;
                    naive_steps += 1;
                    let q = naive.poll(now);
                    naive_probes += u64::from(q);
                    black_box(q)
                })
            });
            println!(
                "backstop {case} {n}: kvlease {:.2} probes per step over {steps} steps, naive {:.2} over {naive_steps}",
                probes as f64 / steps.max(1) as f64,
                naive_probes as f64 / naive_steps.max(1) as f64,
            );
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
