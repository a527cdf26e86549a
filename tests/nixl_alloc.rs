#![cfg(feature = "nixl")]
//! Steady-state READs and empty notification drains on the real NIXL
//! fabric make no Rust heap allocation (NIXL's C++ side is not seen): once a
//! descriptor set has been posted, re-posting it re-uses the prepared
//! request. Counted by the counting global allocator on the test's thread,
//! which is why this test is a binary of its own (the rest of the NIXL
//! fabric tests are `it::nixl_fabric`).
//!
//! Needs `libnixl_capi.so` on `LD_LIBRARY_PATH` (see `tests/it/nixl_fabric.rs`).

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
#[path = "support/nixl_gate.rs"]
mod nixl_gate;
#[path = "support/nixl_pair.rs"]
mod nixl_pair;

use std::sync::Arc;

use kvlease::fabric::nixl::ProgressMode;
use kvlease::fabric::{Fabric, XferState};
use kvlease::{LeaseSlots, MonotonicClock};
use nixl_gate::nixl_or_skip;
use nixl_pair::{connect, desc, fabric, finish, poll_until, register_words, WAIT};

#[global_allocator]
static ALLOC: counting_alloc::CountingAlloc = counting_alloc::CountingAlloc;

/// Allocations `f` makes on this thread.
fn allocations<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let (v, counts) = counting_alloc::count_allocs(f);
    (v, counts.allocs)
}

#[test]
fn steady_state_reads_and_empty_drains_allocate_nothing() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    let slots = Arc::new(LeaseSlots::new(64));
    let mut landing = vec![0u64; 64];
    let mut p = fabric("p", clock, ProgressMode::EngineLoop);
    let mut d = fabric("d", clock, ProgressMode::EngineLoop);
    let region = p.register_slots(slots, true).unwrap();
    let d_land = register_words(&mut d, &mut landing);
    let (pid, _) = connect(&mut d, &mut p, clock);
    let word = |s: u32| {
        [desc(
            d_land,
            8 * u64::from(s),
            region,
            LeaseSlots::offset_of(s),
            8,
        )]
    };

    // One READ per descriptor set to prepare the requests (allocates).
    for s in 0..4 {
        let x = d.post_read(pid, &word(s), None, clock.now()).unwrap();
        assert_eq!(finish(&mut d, &mut p, x, clock), XferState::Done);
    }
    let mut heard = 0usize;
    for i in 0..1000u32 {
        let s = i % 4;
        let note: Option<&[u8]> = if i % 2 == 0 { None } else { Some(b"req-1:1") };
        // Only D's calls are counted. P's engine loop runs between them (over
        // TCP the target must progress for a READ to complete), and its
        // drain allocates whenever a read-done arrives.
        let (x, mut n) = allocations(|| d.post_read(pid, &word(s), note, clock.now()).unwrap());
        let state = poll_until(WAIT, || {
            let (state, k) = allocations(|| {
                assert_eq!(d.drain_notifications(&mut |_, _| {}), Ok(0));
                d.read_state(x, clock.now())
            });
            n += k;
            p.drain_notifications(&mut |_, _| heard += 1).unwrap();
            match state {
                XferState::InProgress => None,
                s => Some(s),
            }
        });
        assert_eq!(state, Some(XferState::Done));
        assert_eq!(
            n, 0,
            "iteration {i} (slot {s}, notification {note:?}) allocated"
        );
    }
    poll_until(WAIT, || {
        p.drain_notifications(&mut |_, _| heard += 1).unwrap();
        (heard == 500).then_some(())
    })
    .expect("every read-done notification");
    assert_eq!(d.stats().request_cache_misses, 4);
    // The counter is live: a new descriptor set does allocate.
    let (x, n) = allocations(|| d.post_read(pid, &word(9), None, clock.now()).unwrap());
    assert!(n > 0, "a request-cache miss must show allocations");
    assert_eq!(finish(&mut d, &mut p, x, clock), XferState::Done);
}
