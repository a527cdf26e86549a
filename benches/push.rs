//! Push mode's guard per engine step, beside a naive guard measured in the
//! same run.
//!
//! Sizes: 1k and 10k live registrations (D's registered requests waiting
//! for P's WRITE; a D holds at most its waiting requests). Each iteration is
//! one engine step, 10 ms after the last; nothing ends during the
//! measurement.
//!
//! - `d_quiet`: D's `PushPermits::poll` in a step with nothing due (most
//!   steps): no fence passed, no renewal or revoke owed.
//! - `d_heartbeat`: the step in which P's `PHB:` naming every registration
//!   arrives (once per heartbeat interval): D renews each permit and sends
//!   the `PRN:` renewals.
//! - `p_heartbeat`: P's `PushWrites::poll` in its heartbeat step: the `PHB:`
//!   messages naming every registration it holds.
//! - `naive`: the same D rules on a `HashMap<(slot, nonce), permit>`: every
//!   poll scans every permit for a passed fence; a `PHB:` is split into
//!   records, each looked up and renewed, and the renewals are built with
//!   `format!`. (What a first implementation would write.)
//!
//! Run with `cargo bench --bench push`; the medians are in
//! `docs/benchmarks.md` ("Push guard").

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig};
use kvlease::fabric::ClockSample;
use kvlease::push::{PushConfig, PushPermits, PushWrites};
use kvlease::{Instant, NonceSource};

const SIZES: [u32; 2] = [1_000, 10_000];
const STEP: Duration = Duration::from_millis(10);
/// D's clock reads this much more than P's.
const OFFSET: Duration = Duration::from_secs(1_000);

fn config(n: u32) -> PushConfig {
    PushConfig {
        capacity: n,
        // Long enough that nothing ends while criterion iterates.
        ..PushConfig::with_duration(Duration::from_secs(3_600))
    }
}

fn clock() -> ClockOffset {
    let mut c = ClockOffset::new(ClockOffsetConfig::default());
    c.observe(ClockSample {
        local_send: Instant::from_secs(1),
        remote: Instant::from_secs(1) + OFFSET,
        local_recv: Instant::from_secs(1),
    });
    c
}

/// A D and a P with `n` registrations, and P's `PHB:` messages naming all.
fn pair(n: u32) -> (PushPermits, PushWrites, ClockOffset, Vec<Vec<u8>>) {
    let cfg = config(n);
    let mut d = PushPermits::new(cfg, NonceSource::from_seed(0, 5, 6)).expect("permits");
    let mut p = PushWrites::new(cfg, 9).expect("writes");
    let clock = clock();
    let now = Instant::from_secs(1);
    for _ in 0..n {
        let f = d.register(1, now + OFFSET).expect("register");
        p.register(2, f, true, &clock, now).expect("accepted");
    }
    let mut phb = Vec::new();
    p.poll(|_| Some(&clock), now, |_, m| phb.push(m.to_vec()));
    assert!(!phb.is_empty());
    (d, p, clock, phb)
}

#[derive(Clone, Copy)]
struct NaivePermit {
    deadline: Instant,
    revoking: bool,
    renew_owed: bool,
}

/// The naive guard: see the file docs.
struct Naive {
    permits: HashMap<(u32, u64), NaivePermit>,
    extension: Duration,
    fence_after: Duration,
}

impl Naive {
    fn new(n: u32) -> Naive {
        let cfg = config(n);
        let mut permits = HashMap::new();
        let mut nonces = NonceSource::from_seed(0, 5, 6);
        for slot in 0..n {
            permits.insert(
                (slot, nonces.next_nonce().get()),
                NaivePermit {
                    deadline: Instant::from_secs(1) + OFFSET + cfg.duration,
                    revoking: false,
                    renew_owed: false,
                },
            );
        }
        Naive {
            permits,
            extension: cfg.extension,
            fence_after: cfg.write_bound,
        }
    }

    fn on_alive(&mut self, msg: &[u8], now: Instant) {
        let body = &msg[4..];
        for rec in body.chunks(24) {
            let text = std::str::from_utf8(rec).unwrap_or("");
            let slot = u32::from_str_radix(&text[..8], 16).unwrap_or(0);
            let nonce = u64::from_str_radix(&text[8..], 16).unwrap_or(0);
            if let Some(p) = self.permits.get_mut(&(slot, nonce)) {
                if !p.revoking && now + self.extension > p.deadline {
                    p.deadline = now + self.extension;
                    p.renew_owed = true;
                }
            }
        }
    }

    fn poll(&mut self, now: Instant, mut emit: impl FnMut(&[u8])) -> usize {
        let mut ended = 0;
        let mut renewals = String::from("PRN:");
        for (&(slot, nonce), p) in self.permits.iter_mut() {
            if now >= p.deadline + self.fence_after {
                ended += 1;
            }
            if p.renew_owed {
                p.renew_owed = false;
                renewals.push_str(&format!(
                    "{slot:08x}{nonce:016x}{:016x}",
                    p.deadline.as_nanos()
                ));
            }
        }
        if renewals.len() > 4 {
            emit(renewals.as_bytes());
        }
        ended
    }
}

fn d_steps(c: &mut Criterion) {
    let mut g = c.benchmark_group("push_d_step");
    for n in SIZES {
        let (mut d, _p, _clock, phb) = pair(n);
        let mut now = Instant::from_secs(2) + OFFSET;
        // The first poll sends the registrations' owed state; then quiet.
        d.poll(now, |_, _| {}, |_| unreachable!("nothing ends"));
        g.bench_with_input(BenchmarkId::new("kvlease/quiet", n), &n, |b, _| {
            b.iter(|| {
                // Time moves, but not toward any fence: criterion runs
                // hundreds of millions of quiet steps.
                now = now + Duration::from_nanos(1);
                d.poll(
                    now,
                    |_, m| {
                        black_box(m);
                    },
                    |_| unreachable!("nothing ends"),
                );
            })
        });
        g.bench_with_input(BenchmarkId::new("kvlease/heartbeat", n), &n, |b, _| {
            b.iter(|| {
                now = now + STEP;
                for m in &phb {
                    d.on_message(1, m, now, |_| unreachable!("nothing ends"))
                        .expect("decodes");
                }
                d.poll(
                    now,
                    |_, m| {
                        black_box(m);
                    },
                    |_| unreachable!("nothing ends"),
                );
            })
        });
        let mut naive = Naive::new(n);
        let mut now = Instant::from_secs(2) + OFFSET;
        g.bench_with_input(BenchmarkId::new("naive/quiet", n), &n, |b, _| {
            b.iter(|| {
                now = now + Duration::from_nanos(1);
                black_box(naive.poll(now, |m| {
                    black_box(m);
                }));
            })
        });
        g.bench_with_input(BenchmarkId::new("naive/heartbeat", n), &n, |b, _| {
            b.iter(|| {
                now = now + STEP;
                for m in &phb {
                    naive.on_alive(m, now);
                }
                black_box(naive.poll(now, |m| {
                    black_box(m);
                }));
            })
        });
    }
    g.finish();
}

fn p_steps(c: &mut Criterion) {
    let mut g = c.benchmark_group("push_p_step");
    for n in SIZES {
        let (_d, mut p, clock, _phb) = pair(n);
        let mut now = Instant::from_secs(2);
        g.bench_with_input(BenchmarkId::new("kvlease/quiet", n), &n, |b, _| {
            p.poll(|_| Some(&clock), now, |_, _| {});
            b.iter(|| {
                // Within one heartbeat interval: nothing owed.
                now = now + Duration::from_nanos(1);
                p.poll(
                    |_| Some(&clock),
                    now,
                    |_, m| {
                        black_box(m);
                    },
                );
            })
        });
        // A heartbeat every microsecond, so that every iteration is a
        // heartbeat step while the deadlines stay far away.
        let cfg = PushConfig {
            heartbeat_interval: Duration::from_micros(1),
            ..config(n)
        };
        let mut d = PushPermits::new(cfg, NonceSource::from_seed(0, 5, 6)).expect("permits");
        let mut p = PushWrites::new(cfg, 9).expect("writes");
        for _ in 0..n {
            let f = d.register(1, now + OFFSET).expect("register");
            p.register(2, f, true, &clock, now).expect("accepted");
        }
        g.bench_with_input(BenchmarkId::new("kvlease/heartbeat", n), &n, |b, _| {
            b.iter(|| {
                now = now + Duration::from_micros(1);
                p.poll(
                    |_| Some(&clock),
                    now,
                    |_, m| {
                        black_box(m);
                    },
                );
            })
        });
    }
    g.finish();
}

criterion_group!(benches, d_steps, p_steps);
criterion_main!(benches);
