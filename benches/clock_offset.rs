//! Benchmarks of bidirectional mode's per-request costs: folding a clock
//! sample into the offset estimate, the turn-2 deadline check (one per
//! request), and the clock ping/pong codec, beside a naive baseline
//! measured in the same run (vLLM's float comparison
//! `now + margin >= expiry - offset`, which has no error bound and no
//! drift; it is the floor, not a competitor).
//!
//! Run with `cargo bench --bench clock_offset`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig};
use kvlease::clock_ping::{self, ClockPinger};
use kvlease::fabric::ClockSample;
use kvlease::testkit::SplitMix64;
use kvlease::Instant;

const N: usize = 1024;

fn samples(rng: &mut SplitMix64) -> Vec<ClockSample> {
    (0..N)
        .map(|i| {
            let send = 1_000_000_000 + i as u64 * 20_000_000;
            let rtt = 10_000 + rng.below(2_000_000);
            ClockSample {
                local_send: Instant::from_nanos(send),
                remote: Instant::from_nanos(send + 3_600_000_000_000 + rtt / 3),
                local_recv: Instant::from_nanos(send + rtt),
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut rng = SplitMix64::new(0x9e37_79b9_7f4a_7c15);
    let samples = samples(&mut rng);
    let deadlines: Vec<Instant> = (0..N)
        .map(|_| Instant::from_secs(3_600 + rng.below(600)))
        .collect();
    let mut g = c.benchmark_group("clock_offset");
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(2));

    let mut est = ClockOffset::new(ClockOffsetConfig::default());
    let mut i = 0;
    g.bench_function("observe (offset update)", |b| {
        b.iter(|| {
            i = (i + 1) % N;
            black_box(est.observe(black_box(samples[i])))
        })
    });

    let mut est = ClockOffset::new(ClockOffsetConfig::default());
    est.observe(samples[0]);
    let now = Instant::from_secs(300);
    let mut i = 0;
    g.bench_function("check_read (deadline check, counted)", |b| {
        b.iter(|| {
            i = (i + 1) % N;
            black_box(est.check_read(Some(black_box(deadlines[i])), black_box(now)))
        })
    });

    // vLLM: perf_counter floats, offset from the best sample, fixed margin.
    let offset_s = 3_600.0f64;
    let deadlines_s: Vec<f64> = deadlines
        .iter()
        .map(|d| d.as_nanos() as f64 / 1e9)
        .collect();
    let mut i = 0;
    g.bench_function("baseline: float compare (no bound)", |b| {
        b.iter(|| {
            i = (i + 1) % N;
            let now_s = black_box(300.0f64);
            black_box(now_s + 5.0 >= black_box(deadlines_s[i]) - offset_s)
        })
    });

    let mut pinger = ClockPinger::new(1, Duration::ZERO);
    let (mut ping, mut pong) = ([0u8; clock_ping::PING_LEN], [0u8; clock_ping::PONG_LEN]);
    let mut t = 0u64;
    g.bench_function(
        "ping round trip (encode, decode, pong, decode, match)",
        |b| {
            b.iter(|| {
                t += 1_000;
                let now = Instant::from_nanos(t);
                let n = pinger.ping(now, &mut ping).unwrap_or(0);
                let Some(Ok(clock_ping::ClockMessage::Ping { token })) =
                    clock_ping::decode(black_box(&ping[..n]))
                else {
                    return None;
                };
                let m = clock_ping::encode_pong(token, now, &mut pong).unwrap_or(0);
                match clock_ping::decode(black_box(&pong[..m])) {
                    Some(Ok(clock_ping::ClockMessage::Pong { token, remote })) => {
                        black_box(pinger.on_pong(token, remote, now))
                    }
                    _ => None,
                }
            })
        },
    );
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
