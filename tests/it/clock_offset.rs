//! The clock-offset estimator against virtual clocks: D ahead of P, D
//! behind, clocks that drift apart, and large or asymmetric round trips.
//!
//! The world has one true time `T` (ns). P's clock reads `T + p0`; D's reads
//! `d0 + T + T * drift_ppm / 1e6`. A handshake leaves P at true `T`, reaches
//! D after `fwd` (D stamps its clock), comes back after `back`. D finishes a
//! turn and exports `deadline = D's clock + ttl`. P then checks the gate once
//! per step of length `step` until well past the deadline, re-sampling now
//! and then with jittered, asymmetric delays.
//!
//! Each case runs with vLLM's 5 s margin and with a 100 ms margin (two
//! steps): with the large one the margin alone would hide a gate that
//! ignored the bound; with the small one only the bound keeps reads on time.
//!
//! The two properties, checked at every step of every case:
//!
//! 1. **Never late.** A read the gate lets through at a step starts at the
//!    latest one step later, and D's clock is then still before the deadline.
//! 2. **Never needlessly early.** While P's *estimate* of the time left
//!    exceeds `margin + bound`, the gate reads; and while D's *true* time to
//!    the deadline exceeds `margin + 2 * bound + step`, it reads too (the
//!    estimate itself is off by at most `bound`, and the step is the
//!    granularity at which P looks).

use core::time::Duration;

use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig, ReadGate};
use kvlease::fabric::ClockSample;
use kvlease::testkit::SplitMix64;
use kvlease::Instant;

const MS: i128 = 1_000_000;
const SEC: i128 = 1_000_000_000;

#[derive(Clone, Copy, Debug)]
struct World {
    /// P's clock at true time 0.
    p0: i128,
    /// D's clock at true time 0.
    d0: i128,
    /// D's rate error against true time (P runs at true rate).
    drift_ppm: i128,
}

impl World {
    fn p(&self, t: i128) -> Instant {
        Instant::from_nanos(u64::try_from(self.p0 + t).unwrap())
    }
    fn d_ns(&self, t: i128) -> i128 {
        self.d0 + t + t * self.drift_ppm / 1_000_000
    }
    fn d(&self, t: i128) -> Instant {
        Instant::from_nanos(u64::try_from(self.d_ns(t)).unwrap())
    }
    fn sample(&self, t: i128, fwd: i128, back: i128) -> ClockSample {
        ClockSample {
            local_send: self.p(t),
            remote: self.d(t + fwd),
            local_recv: self.p(t + fwd + back),
        }
    }
}

/// A jitter in `0..n` nanoseconds.
fn below(rng: &mut SplitMix64, n: i128) -> i128 {
    i128::from(rng.below(u64::try_from(n).unwrap()))
}

#[derive(Default, Debug)]
struct Tally {
    reads: u64,
    declines: u64,
    checked_far: u64,
}

/// Runs one case; returns how many steps read and declined.
fn run_case(
    world: World,
    fwd: i128,
    back: i128,
    resample_every: Option<i128>,
    config: ClockOffsetConfig,
    step: i128,
    rng: &mut SplitMix64,
) -> Tally {
    let ttl = 480 * SEC;
    let margin = i128::try_from(config.safety_margin.as_nanos()).unwrap();
    let mut est = ClockOffset::new(config);
    // The handshake, at true time 1 s.
    est.observe(world.sample(SEC, fwd, back));
    // D finishes the turn at true 10 s.
    let deadline = world.d(10 * SEC) + Duration::from_nanos(u64::try_from(ttl).unwrap());
    let mut tally = Tally::default();
    let mut t = 10 * SEC;
    let mut next_resample = resample_every.map(|every| t + every);
    while t < 10 * SEC + ttl + 30 * SEC {
        if let Some(at) = next_resample {
            if t >= at {
                // Jittered, asymmetric: each direction takes its base delay
                // plus up to 4x more.
                let f = fwd + below(rng, 4 * fwd + 1);
                let b = back + below(rng, 4 * back + 1);
                est.observe(world.sample(t, f, b));
                next_resample = resample_every.map(|every| t + every);
            }
        }
        let now = world.p(t);
        let bound = i128::try_from(est.bound(now).unwrap().as_nanos()).unwrap();
        let verdict = est.check_read(Some(deadline), now);
        let remaining = i128::from(deadline.as_nanos()) - world.d_ns(t);
        match verdict {
            ReadGate::Read => {
                tally.reads += 1;
                // Property 1: the read starts within one step, before D frees.
                assert!(
                    world.d(t + step) < deadline,
                    "{world:?} fwd={fwd} back={back}: read accepted at t={t}, \
                     D frees at {deadline:?} but the read starts at {:?}",
                    world.d(t + step)
                );
            }
            ReadGate::Decline => tally.declines += 1,
            ReadGate::NoSample => panic!("a sample was taken"),
        }
        // Property 2, in P's estimate: more than margin + bound left reads
        // (the rule itself; the step is where the next look happens).
        let est_left =
            i128::from(est.to_local(deadline).unwrap().as_nanos()) - i128::from(now.as_nanos());
        if est_left > margin + bound {
            assert_eq!(verdict, ReadGate::Read, "estimate {est_left} ns left");
        }
        // Property 2, in D's true time.
        if remaining > margin + 2 * bound + step {
            tally.checked_far += 1;
            assert_eq!(
                verdict,
                ReadGate::Read,
                "{world:?} fwd={fwd} back={back}: declined at t={t} with \
                 {remaining} ns left, bound {bound}"
            );
        }
        t += step;
    }
    tally
}

fn worlds() -> Vec<(&'static str, World)> {
    vec![
        (
            "D ahead",
            World {
                p0: 5 * SEC,
                d0: 86_400 * SEC,
                drift_ppm: 0,
            },
        ),
        (
            "D behind",
            World {
                p0: 86_400 * SEC,
                d0: 3 * SEC,
                drift_ppm: 0,
            },
        ),
        (
            "D fast",
            World {
                p0: 1_000 * SEC,
                d0: 2_000 * SEC,
                drift_ppm: 90,
            },
        ),
        (
            "D slow",
            World {
                p0: 2_000 * SEC,
                d0: 1_000 * SEC,
                drift_ppm: -90,
            },
        ),
    ]
}

/// (forward, back) one-way delays: symmetric small, symmetric large,
/// and both asymmetries.
const ROUTES: [(i128, i128); 5] = [
    (50_000, 50_000),
    (1_000 * MS, 1_000 * MS),
    (1_000, 300 * MS),
    (300 * MS, 1_000),
    (2 * SEC, 10 * MS),
];

#[test]
fn never_late_and_never_needlessly_early_across_worlds_and_routes() {
    let mut rng = SplitMix64::new(0x9e37_79b9_7f4a_7c15);
    let mut cases = 0;
    for (name, world) in worlds() {
        for (fwd, back) in ROUTES {
            for (resample, margin) in [None, Some(60 * SEC), Some(7 * SEC)]
                .into_iter()
                .flat_map(|r| [(r, Duration::from_secs(5)), (r, Duration::from_millis(100))])
            {
                let config = ClockOffsetConfig {
                    safety_margin: margin,
                    ..ClockOffsetConfig::default()
                };
                let t = run_case(world, fwd, back, resample, config, 50 * MS, &mut rng);
                // Each case has both verdicts, and property 2 was exercised.
                assert!(t.reads > 1000, "{name} {fwd}/{back}: {t:?}");
                assert!(t.declines > 100, "{name} {fwd}/{back}: {t:?}");
                assert!(t.checked_far > 1000, "{name} {fwd}/{back}: {t:?}");
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 4 * 5 * 3 * 2);
}

#[test]
fn drift_beyond_the_allowance_is_still_caught_by_the_margin_but_not_by_the_bound() {
    // 100 ppm allowed, 90 ppm real: covered above. With no allowance at
    // all the bound is only the round trip, and a D that runs 90 ppm fast
    // moves the truth 43 ms over 480 s: still inside the 5 s margin, so no
    // late read, which is why the margin exists. This pins that the margin,
    // not luck, carries the case.
    let mut rng = SplitMix64::new(7);
    let config = ClockOffsetConfig {
        drift_ppm: 0,
        ..ClockOffsetConfig::default()
    };
    let (_, fast) = worlds()[2];
    let t = run_case(fast, 50_000, 50_000, None, config, 50 * MS, &mut rng);
    assert!(t.reads > 1000 && t.declines > 100, "{t:?}");
}

#[test]
fn drift_is_carried_by_the_allowance_when_the_margin_is_thin() {
    // 10 ms steps and a 20 ms margin: over the 480 s TTL a D that runs
    // 90 ppm fast or slow moves 43 ms against the handshake's estimate,
    // more than the margin. Only the drift allowance (100 ppm of the
    // sample's age, in the bound) keeps every accepted read on time.
    let mut rng = SplitMix64::new(11);
    let config = ClockOffsetConfig {
        safety_margin: Duration::from_millis(20),
        ..ClockOffsetConfig::default()
    };
    for (name, world) in &worlds()[2..] {
        let t = run_case(*world, 50_000, 50_000, None, config, 10 * MS, &mut rng);
        assert!(t.reads > 10_000 && t.declines > 100, "{name}: {t:?}");
    }
}

#[test]
fn margin_is_what_decides_near_the_deadline() {
    // One sample with a 2 ms round trip, D 100 s ahead, no drift: the last
    // read accepted is the last one with more than margin + bound left.
    let mut est = ClockOffset::new(ClockOffsetConfig {
        drift_ppm: 0,
        ..ClockOffsetConfig::default()
    });
    est.observe(ClockSample {
        local_send: Instant::from_secs(10),
        remote: Instant::from_nanos(110_001_000_000),
        local_recv: Instant::from_nanos(10_002_000_000),
    });
    let deadline = Instant::from_secs(110 + 600);
    // Local deadline 610 s; latest start 610 - 5 - 0.001 = 604.999 s.
    assert_eq!(
        est.gate(Some(deadline), Instant::from_nanos(604_998_999_999)),
        ReadGate::Read
    );
    assert_eq!(
        est.gate(Some(deadline), Instant::from_nanos(604_999_000_000)),
        ReadGate::Decline
    );
    // Past the deadline it stays declined.
    assert_eq!(
        est.gate(Some(deadline), Instant::from_secs(700)),
        ReadGate::Decline
    );
}
