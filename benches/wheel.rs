//! [`TimerWheel`] beside the naive reaper it replaces, measured in the same
//! run (our speed claims are ratios).
//!
//! The baseline is a `HashMap<String, Instant>` keyed by request id: what a
//! correct dict-based reaper costs (vLLM#50789). Renew = one hash lookup and
//! a `max`; poll = scan every entry for expired ones (`retain`, which also
//! removes them).
//!
//! Each size (1k, 10k, 100k, 1M entries) is built once, outside the timing,
//! with deadlines spread uniformly over 10 s..60 s past the start, at a 10 ms
//! tick; both structures hold the same entries. Then, per size:
//!
//! - `wheel_insert`: 256 inserts of fresh entries into the populated
//!   structure (removed again, untimed). Throughput in elements.
//! - `wheel_renew`: 256 renewals (wheel: `extend`) of entries in random
//!   order to now + 20 s. Throughput in elements.
//! - `wheel_poll_idle`: one poll with nothing due, `now` stepping 20 ms at a
//!   time through the first 9.4 s, in which no wheel slot comes due (every
//!   deadline is >= 10 s away). After 470 steps `now` starts the window over:
//!   the wheel then sees a `now` at or before its last one, and its "nothing
//!   due" path does exactly the same work (pending check, bitmap scan of the
//!   levels), so this only keeps the wheel quiet, it does not flatter it.
//! - `wheel_poll_steady`: one 20 ms engine step in steady state, nothing
//!   expiring: before each step (untimed) a rolling 1/400 of the entries is
//!   renewed to now + 20 s, as heartbeats would, so every entry is renewed
//!   every <= 8 s. The wheel's lazy renewal is paid here: when the old slot
//!   of a renewed entry comes due, the poll places it again. That cost comes
//!   in bursts (a whole level-1 slot at once) and is amortised over the steps.
//! - `wheel_poll_due_k{1,64}`: as `poll_steady`, plus k entries (inserted
//!   untimed the step before) that are due at this step and popped.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant as WallInstant};

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode,
    Throughput,
};
use kvlease::testkit::SplitMix64;
use kvlease::wheel::TimerWheel;
use kvlease::Instant;

mod common;
use common::{map_poll, permutation, request_id};

const SIZES: [u32; 4] = [1_000, 10_000, 100_000, 1_000_000];
const TICK: Duration = Duration::from_millis(10);
/// One engine step.
const STEP: Duration = Duration::from_millis(20);
/// How far a renewal pushes a deadline past `now` (the default extension).
const EXTENSION: Duration = Duration::from_secs(20);
/// Inserts / renewals per timed iteration (one heartbeat message's worth).
const BATCH: u32 = 256;
const KS: [u32; 2] = [1, 64];
const K_MAX: u32 = 64;
const T0: Instant = Instant::from_secs(1_000);
/// Steps of the quiet window used by `poll_idle`: 470 * 20 ms = 9.4 s, before
/// the earliest deadline (10 s) comes due.
const QUIET_STEPS: u32 = 470;
/// Steady state renews every entry once per this many steps at most (8 s).
const RENEW_CYCLE_STEPS: u32 = 400;

/// A deadline uniformly in `now + 10 s .. now + 60 s`.
fn spread_deadline(rng: &mut SplitMix64, now: Instant) -> Instant {
    now + Duration::from_secs(10) + Duration::from_nanos(rng.below(50_000_000_000))
}

struct WheelSide {
    wheel: TimerWheel,
    now: Instant,
    /// Next entry to renew in steady state.
    cursor: u32,
}

struct MapSide {
    map: HashMap<String, Instant>,
    now: Instant,
    cursor: u32,
}

/// One size's structures. Wheel entry `i < n` is the map's `keys[i]`;
/// entries `n..n + BATCH` are the insert bench's, `n + BATCH..` the victims.
struct Fixture {
    n: u32,
    rng: SplitMix64,
    keys: Vec<String>,
    /// Random renewal order.
    order: Vec<u32>,
    spare_keys: Vec<String>,
    spare_deadlines: Vec<Instant>,
    victim_keys: Vec<String>,
    w: WheelSide,
    m: MapSide,
}

impl Fixture {
    fn build(n: u32) -> Fixture {
        let mut rng = SplitMix64::new(0x9e37_79b9_7f4a_7c15 ^ u64::from(n));
        let keys: Vec<String> = (0..n).map(|_| request_id(&mut rng)).collect();
        let capacity = n + BATCH + K_MAX;
        // Horizon 60 s: the 10 s..60 s deadlines sit on the near level, as a
        // lease book sized for them would place them.
        let mut wheel = TimerWheel::new(capacity, TICK, Duration::from_secs(60), T0);
        let mut map = HashMap::with_capacity(capacity as usize);
        for (i, k) in keys.iter().enumerate() {
            let d = spread_deadline(&mut rng, T0);
            wheel.insert(i as u32, d).expect("insert while populating");
            map.insert(k.clone(), d);
        }
        let order = permutation(n, &mut rng);
        let spare_keys = (0..BATCH).map(|_| request_id(&mut rng)).collect();
        let spare_deadlines = (0..BATCH).map(|_| spread_deadline(&mut rng, T0)).collect();
        let victim_keys = (0..K_MAX).map(|_| request_id(&mut rng)).collect();
        Fixture {
            n,
            rng,
            keys,
            order,
            spare_keys,
            spare_deadlines,
            victim_keys,
            w: WheelSide {
                wheel,
                now: T0,
                cursor: 0,
            },
            m: MapSide {
                map,
                now: T0,
                cursor: 0,
            },
        }
    }

    /// Untimed: move both clocks past the quiet window and give every entry a
    /// fresh deadline 10 s..60 s ahead, ready for the steady-state benches.
    fn reseed(&mut self) {
        let now = T0 + Duration::from_secs(10);
        self.w.now = now;
        self.m.now = now;
        for (i, k) in self.keys.iter().enumerate() {
            let d = spread_deadline(&mut self.rng, now);
            assert!(self.w.wheel.extend(i as u32, d));
            let t = self.m.map.get_mut(k.as_str()).expect("key in map");
            *t = (*t).max(d);
        }
    }

    fn renew_chunk(&self) -> u32 {
        self.n.div_ceil(RENEW_CYCLE_STEPS)
    }
}

/// One steady-state step of the wheel with `k` entries due; only the poll is
/// timed.
fn wheel_step(w: &mut WheelSide, n: u32, chunk: u32, k: u32) -> Duration {
    let renew_to = w.now + EXTENSION;
    for _ in 0..chunk {
        w.wheel.extend(w.cursor, renew_to);
        w.cursor = if w.cursor + 1 == n { 0 } else { w.cursor + 1 };
    }
    for v in 0..k {
        w.wheel
            .insert(n + BATCH + v, w.now + STEP)
            .expect("victim is idle");
    }
    w.now = w.now + STEP;
    let now = w.now;
    let start = WallInstant::now();
    let mut fired = 0u32;
    while let Some(e) = w.wheel.pop_expired(black_box(now)) {
        black_box(e);
        fired += 1;
    }
    let elapsed = start.elapsed();
    assert_eq!(fired, k, "only the victims may expire");
    elapsed
}

/// The same step on the baseline.
fn map_step(m: &mut MapSide, keys: &[String], victims: &[String], chunk: u32) -> Duration {
    let n = keys.len() as u32;
    let renew_to = m.now + EXTENSION;
    for _ in 0..chunk {
        if let Some(t) = m.map.get_mut(keys[m.cursor as usize].as_str()) {
            *t = (*t).max(renew_to);
        }
        m.cursor = if m.cursor + 1 == n { 0 } else { m.cursor + 1 };
    }
    for v in victims {
        m.map.insert(v.clone(), m.now + STEP);
    }
    m.now = m.now + STEP;
    let now = m.now;
    let start = WallInstant::now();
    let fired = map_poll(&mut m.map, black_box(now));
    let elapsed = start.elapsed();
    assert_eq!(fired as usize, victims.len(), "only the victims may expire");
    elapsed
}

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    g
}

/// The baseline's full scans at 1M take milliseconds: fewer, flat samples.
fn slow_baseline(g: &mut BenchmarkGroup<'_, WallTime>, n: u32) {
    if n >= 1_000_000 {
        g.sample_size(10).sampling_mode(SamplingMode::Flat);
    }
}

fn bench_poll_idle(c: &mut Criterion, f: &mut Fixture) {
    let n = f.n;
    let nows: Vec<Instant> = (0..QUIET_STEPS).map(|i| T0 + STEP * i).collect();
    let mut g = group(c, "wheel_poll_idle");
    let wheel = &mut f.w.wheel;
    let mut fired = 0u64;
    let mut i = 0usize;
    g.bench_function(BenchmarkId::new("kvlease", n), |b| {
        b.iter(|| {
            let now = nows[i];
            i = if i + 1 == nows.len() { 0 } else { i + 1 };
            let r = wheel.pop_expired(black_box(now));
            fired += u64::from(r.is_some());
            r
        })
    });
    assert_eq!(fired, 0, "nothing may be due in the quiet window");
    slow_baseline(&mut g, n);
    let map = &mut f.m.map;
    let mut fired = 0u64;
    let mut i = 0usize;
    g.bench_function(BenchmarkId::new("baseline", n), |b| {
        b.iter(|| {
            let now = nows[i];
            i = if i + 1 == nows.len() { 0 } else { i + 1 };
            let r = map_poll(map, black_box(now));
            fired += r;
            r
        })
    });
    assert_eq!(fired, 0, "nothing may be due in the quiet window");
    g.finish();
}

fn bench_insert(c: &mut Criterion, f: &mut Fixture) {
    let n = f.n;
    let mut g = group(c, "wheel_insert");
    g.throughput(Throughput::Elements(u64::from(BATCH)));
    let deadlines = &f.spare_deadlines;
    let wheel = &mut f.w.wheel;
    g.bench_function(BenchmarkId::new("kvlease", n), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = WallInstant::now();
                let mut ok = 0u32;
                for (j, d) in deadlines.iter().enumerate() {
                    ok += u32::from(wheel.insert(black_box(n + j as u32), *d).is_ok());
                }
                total += start.elapsed();
                assert_eq!(ok, BATCH);
                for j in 0..BATCH {
                    wheel.cancel(n + j);
                }
            }
            total
        })
    });
    let map = &mut f.m.map;
    let originals = &f.spare_keys;
    let mut spare: Vec<String> = originals.clone();
    g.bench_function(BenchmarkId::new("baseline", n), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = WallInstant::now();
                for (k, d) in spare.drain(..).zip(deadlines) {
                    black_box(map.insert(k, *d));
                }
                total += start.elapsed();
                // Take the keys back out (no allocation in the timed part).
                for k in originals {
                    let (k, _) = map.remove_entry(k.as_str()).expect("inserted");
                    spare.push(k);
                }
            }
            total
        })
    });
    g.finish();
}

fn bench_renew(c: &mut Criterion, f: &mut Fixture) {
    let n = f.n;
    let mut g = group(c, "wheel_renew");
    g.throughput(Throughput::Elements(u64::from(BATCH)));
    let order = &f.order;
    let wheel = &mut f.w.wheel;
    let to = f.w.now + EXTENSION;
    let mut cur = 0usize;
    let (mut renewed, mut calls) = (0u64, 0u64);
    g.bench_function(BenchmarkId::new("kvlease", n), |b| {
        b.iter(|| {
            let to = black_box(to);
            for _ in 0..BATCH {
                let e = order[cur];
                cur = if cur + 1 == order.len() { 0 } else { cur + 1 };
                renewed += u64::from(wheel.extend(e, to));
                calls += 1;
            }
        })
    });
    assert_eq!(renewed, calls, "every entry is scheduled");
    let keys = &f.keys;
    let map = &mut f.m.map;
    let to = f.m.now + EXTENSION;
    let mut cur = 0usize;
    let (mut renewed, mut calls) = (0u64, 0u64);
    g.bench_function(BenchmarkId::new("baseline", n), |b| {
        b.iter(|| {
            let to = black_box(to);
            for _ in 0..BATCH {
                let e = order[cur];
                cur = if cur + 1 == order.len() { 0 } else { cur + 1 };
                if let Some(t) = map.get_mut(keys[e as usize].as_str()) {
                    *t = (*t).max(to);
                    renewed += 1;
                }
                calls += 1;
            }
        })
    });
    assert_eq!(renewed, calls, "every key is present");
    g.finish();
}

/// `poll_steady` (k = 0) and `poll_due_k{k}`.
fn bench_steady(c: &mut Criterion, f: &mut Fixture, k: u32) {
    let n = f.n;
    let chunk = f.renew_chunk();
    let name = if k == 0 {
        "wheel_poll_steady".to_string()
    } else {
        format!("wheel_poll_due_k{k}")
    };
    let mut g = group(c, &name);
    let w = &mut f.w;
    g.bench_function(BenchmarkId::new("kvlease", n), |b| {
        b.iter_custom(|iters| (0..iters).map(|_| wheel_step(w, n, chunk, k)).sum())
    });
    slow_baseline(&mut g, n);
    let m = &mut f.m;
    let keys = &f.keys;
    let victims = &f.victim_keys[..k as usize];
    g.bench_function(BenchmarkId::new("baseline", n), |b| {
        b.iter_custom(|iters| (0..iters).map(|_| map_step(m, keys, victims, chunk)).sum())
    });
    g.finish();
    assert_eq!(f.w.wheel.len(), n, "steady state keeps the wheel at size");
    assert_eq!(
        f.m.map.len(),
        n as usize,
        "steady state keeps the map at size"
    );
}

fn benches(c: &mut Criterion) {
    for n in SIZES {
        let mut f = Fixture::build(n);
        bench_poll_idle(c, &mut f);
        bench_insert(c, &mut f);
        bench_renew(c, &mut f);
        f.reseed();
        bench_steady(c, &mut f, 0);
        for k in KS {
            bench_steady(c, &mut f, k);
        }
    }
}

criterion_group!(wheel_benches, benches);
criterion_main!(wheel_benches);
