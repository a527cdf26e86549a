//! Proof of the step contract for bidirectional mode: after construction,
//! the clock-offset estimator (samples folded in, deadlines checked) makes
//! exactly 0 heap allocations.
//!
//! The counting allocator (tests/support/counting_alloc.rs) counts only on
//! the thread that armed it, so the harness's own threads cannot disturb it.

use core::time::Duration;

use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig, ReadGate};
use kvlease::fabric::ClockSample;
use kvlease::Instant;

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{count_allocs, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const STEPS: u64 = 100_000;

#[test]
fn offset_estimator_allocates_nothing() {
    let mut est = ClockOffset::new(ClockOffsetConfig::default());
    counting_alloc::self_check();
    let ((reads, declines), counts) = count_allocs(|| {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let (mut reads, mut declines) = (0u64, 0u64);
        for step in 0..STEPS {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let now = Instant::from_millis(10_000 + step * 20);
            if step % 64 == 0 {
                let rtt = 1 + rng % 5_000_000;
                est.observe(ClockSample {
                    local_send: now - Duration::from_nanos(rtt),
                    remote: now + Duration::from_secs(1_000),
                    local_recv: now,
                });
            }
            // Deadlines from already past to 30 s away, on D's clock.
            let deadline = now + Duration::from_secs(1_000) + Duration::from_millis(rng % 30_000)
                - Duration::from_secs(5);
            match est.check_read(Some(deadline), now) {
                ReadGate::Read => reads += 1,
                _ => declines += 1,
            }
        }
        (reads, declines)
    });
    assert!(reads > 10_000 && declines > 10_000, "{reads} {declines}");
    assert!(est.counters().adopted > 10, "{:?}", est.counters());
    println!(
        "bidir_alloc: {STEPS} estimator steps: {} allocations, {} bytes",
        counts.allocs, counts.bytes
    );
    assert_eq!((counts.allocs, counts.bytes), (0, 0));
}
