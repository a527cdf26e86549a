use super::*;
use crate::rng::SplitMix64;
use std::collections::BTreeMap;

const MS: u64 = 1_000_000;

#[test]
fn wheel_error_displays_and_is_an_error() {
    let mut w = wheel(2);
    let out = w.insert(2, Instant::from_secs(1)).unwrap_err();
    w.insert(0, Instant::from_secs(1)).unwrap();
    let again = w.insert(0, Instant::from_secs(2)).unwrap_err();
    assert_eq!(
        (out, again),
        (WheelError::OutOfRange, WheelError::AlreadyScheduled)
    );
    let (a, b): (&dyn std::error::Error, &dyn std::error::Error) = (&out, &again);
    assert!(a.to_string().contains("capacity"), "{a}");
    assert!(b.to_string().contains("already scheduled"), "{b}");
}

fn wheel(cap: u32) -> TimerWheel {
    TimerWheel::new(
        cap,
        Duration::from_millis(10),
        Duration::from_secs(60),
        Instant::ZERO,
    )
}

fn drain(w: &mut TimerWheel, now: Instant) -> Vec<u32> {
    let mut v: Vec<u32> = std::iter::from_fn(|| w.pop_expired(now)).collect();
    v.sort_unstable();
    v
}

#[test]
fn fires_at_deadline_not_before() {
    let mut w = wheel(4);
    w.insert(0, Instant::from_millis(25)).unwrap();
    assert!(drain(&mut w, Instant::from_millis(24)).is_empty());
    // Deadline 25 ms rounds up to tick 3 (30 ms): never early, at most a tick late.
    assert!(drain(&mut w, Instant::from_millis(29)).is_empty());
    assert_eq!(drain(&mut w, Instant::from_millis(30)), [0]);
    assert!(w.is_empty());
}

#[test]
fn insert_twice_and_out_of_range_are_errors() {
    let mut w = wheel(1);
    w.insert(0, Instant::from_secs(1)).unwrap();
    assert_eq!(
        w.insert(0, Instant::from_secs(2)),
        Err(WheelError::AlreadyScheduled)
    );
    assert_eq!(
        w.insert(1, Instant::from_secs(2)),
        Err(WheelError::OutOfRange)
    );
    assert!(!w.extend(7, Instant::from_secs(9)));
    assert!(!w.cancel(7));
}

#[test]
fn extend_is_lazy_and_never_lowers() {
    let mut w = wheel(2);
    w.insert(0, Instant::from_secs(30)).unwrap();
    assert!(w.extend(0, Instant::from_secs(50)));
    assert!(
        w.extend(0, Instant::from_secs(40)),
        "lower deadline is ignored, call still succeeds"
    );
    assert_eq!(w.deadline(0), Some(Instant::from_secs(50)));
    w.extend(0, Instant::from_nanos(50_000_000_001));
    assert_eq!(
        w.deadline(0),
        Some(Instant::from_nanos(50_000_000_001)),
        "exact, not rounded"
    );
    assert!(drain(&mut w, Instant::from_secs(30)).is_empty());
    assert!(drain(&mut w, Instant::from_secs(50)).is_empty());
    assert_eq!(drain(&mut w, Instant::from_millis(50_010)), [0]);
}

#[test]
fn cancel_removes_from_slot_and_from_pending() {
    let mut w = wheel(3);
    for i in 0..3 {
        w.insert(i, Instant::from_secs(5)).unwrap();
    }
    assert!(w.cancel(1));
    let first = w.pop_expired(Instant::from_secs(5)).unwrap();
    // The rest of the slot is pending now; cancel one of them.
    let other = if first == 0 { 2 } else { 0 };
    assert!(w.cancel(other));
    assert_eq!(w.pop_expired(Instant::from_secs(5)), None);
    assert!(w.is_empty());
}

#[test]
fn past_deadline_fires_on_next_tick() {
    let mut w = TimerWheel::new(
        1,
        Duration::from_millis(10),
        Duration::from_secs(60),
        Instant::from_secs(100),
    );
    w.insert(0, Instant::from_secs(1)).unwrap();
    assert_eq!(drain(&mut w, Instant::from_secs(100)), Vec::<u32>::new());
    assert_eq!(drain(&mut w, Instant::from_millis(100_010)), [0]);
}

#[test]
fn far_deadlines_never_fire_early() {
    // Beyond the top level's span with a 1 ns tick (2^36 ns ~ 69 s).
    let mut w = TimerWheel::new(2, Duration::from_nanos(1), Duration::ZERO, Instant::ZERO);
    let far = Instant::from_secs(1000);
    w.insert(0, far).unwrap();
    w.insert(1, Instant::MAX).unwrap();
    let mut now = 0u64;
    while now < 1000 * 1_000_000_000 {
        now += 7_000_000_000;
        let fired = drain(&mut w, Instant::from_nanos(now));
        if Instant::from_nanos(now) < far {
            assert!(fired.is_empty(), "fired early at {now}");
        } else {
            assert_eq!(fired, [0]);
        }
    }
    assert!(w.is_scheduled(1));
}

#[test]
fn next_deadline_is_a_lower_bound() {
    let mut w = wheel(3);
    assert_eq!(w.next_deadline(), None);
    w.insert(0, Instant::from_secs(20)).unwrap();
    w.insert(1, Instant::from_millis(700)).unwrap();
    let nd = w.next_deadline().unwrap();
    assert!(nd <= Instant::from_millis(700));
    assert!(drain(&mut w, nd.saturating_sub(Duration::from_nanos(1))).is_empty());
}

/// Leases renewed every heartbeat interval, never expiring: the work of a
/// poll stays spread out, with no cascade of the whole book at a window
/// boundary (the first, tokio-style placement moved every lease at once
/// every 40.96 s).
#[test]
fn renewal_work_is_spread_over_polls() {
    let n = 20_000u32;
    let mut w = TimerWheel::new(
        n,
        Duration::from_millis(10),
        Duration::from_secs(60),
        Instant::ZERO,
    );
    // Grants spread over the first 5 s, 30 s leases.
    for i in 0..n {
        let granted = u64::from(i) * 5_000 / u64::from(n);
        w.insert(i, Instant::from_millis(granted + 30_000)).unwrap();
    }
    let mut worst = 0;
    let mut now_ms = 0u64;
    while now_ms < 200_000 {
        now_ms += 20;
        // Every entry is renewed once per 5 s interval (a slice of them per step).
        for i in (0..n).filter(|i| u64::from(*i) % 250 == (now_ms / 20) % 250) {
            assert!(w.extend(i, Instant::from_millis(now_ms + 20_000)));
        }
        let before = w.stats().moved;
        assert_eq!(
            w.pop_expired(Instant::from_millis(now_ms)),
            None,
            "nothing expires"
        );
        worst = worst.max(w.stats().moved - before);
    }
    // About n / (15 s / 20 ms) = 27 moves per step on average.
    println!("worst poll moved {worst} of {n} entries");
    assert!(worst < 200, "a poll moved {worst} of {n} entries");
    assert!(w.stats().moved > u64::from(n), "entries were moved lazily");
}

/// The wheel against a BTreeMap of deadlines over long random sequences of
/// insert / extend / cancel / poll, with irregular poll intervals.
#[test]
fn matches_reference_model() {
    // A horizon of 0 gives the smallest near level (4096 ticks = 41 s), so
    // the far levels and their windows are exercised too.
    for horizon_s in [0, 60, 3_000] {
        for seed in 1..=6u64 {
            run_model(seed, 20_000, horizon_s);
        }
    }
}

fn run_model(seed: u64, ops: usize, horizon_s: u64) {
    let cap = 64u32;
    let tick = 10 * MS;
    let mut w = TimerWheel::new(
        cap,
        Duration::from_nanos(tick),
        Duration::from_secs(horizon_s),
        Instant::ZERO,
    );
    let mut model: BTreeMap<u32, u64> = BTreeMap::new(); // entry -> deadline ns
    let mut rng = SplitMix64::new(seed);
    let mut rand = move || rng.next_u64();
    let mut now = 0u64;
    for _ in 0..ops {
        let r = rand();
        let e = (r % u64::from(cap)) as u32;
        // Deadlines from "already past" to far beyond level 2.
        let delta = match (r >> 8) % 4 {
            0 => (r >> 16) % (100 * MS),
            1 => (r >> 16) % (60_000 * MS),
            2 => (r >> 16) % (10_000_000 * MS),
            _ => 0,
        };
        match (r >> 6) % 4 {
            0 => {
                let d = now + delta;
                let res = w.insert(e, Instant::from_nanos(d));
                if let std::collections::btree_map::Entry::Vacant(v) = model.entry(e) {
                    res.unwrap();
                    v.insert(d);
                } else {
                    assert_eq!(res, Err(WheelError::AlreadyScheduled));
                }
            }
            1 => {
                let d = now + delta;
                let ok = w.extend(e, Instant::from_nanos(d));
                assert_eq!(ok, model.contains_key(&e));
                if let Some(m) = model.get_mut(&e) {
                    *m = (*m).max(d);
                }
            }
            2 => assert_eq!(w.cancel(e), model.remove(&e).is_some()),
            _ => {
                now += (r >> 12) % (3_000 * MS);
                let fired = drain(&mut w, Instant::from_nanos(now));
                for f in &fired {
                    let d = model
                        .remove(f)
                        .expect("fired an entry that was not scheduled");
                    assert!(
                        d <= now,
                        "seed {seed}: entry {f} due {d} fired early at {now}"
                    );
                }
                // Everything due more than a tick ago must have fired.
                for (e, d) in &model {
                    assert!(
                        *d > now.saturating_sub(tick),
                        "seed {seed}: entry {e} due {d} missed at {now}"
                    );
                }
            }
        }
        assert_eq!(w.len() as usize, model.len());
    }
}
