//! The counting global allocator behind every zero-allocation test.
//!
//! Counts the allocations (and bytes) made **on the calling thread while it
//! is armed**, so the test harness's own threads cannot disturb a count. A
//! test binary installs it with
//!
//! ```ignore
//! #[path = "support/counting_alloc.rs"]
//! mod counting_alloc;
//! #[global_allocator]
//! static GLOBAL: counting_alloc::CountingAlloc = counting_alloc::CountingAlloc;
//! ```
//!
//! and wraps the steady-state part in [`count_allocs`].
#![allow(dead_code)] // each test binary uses part of it

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Forwards to the system allocator and counts.
pub struct CountingAlloc;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
    static BYTES: Cell<u64> = const { Cell::new(0) };
}

/// What a counted stretch allocated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Calls to alloc, alloc_zeroed and realloc.
    pub allocs: u64,
    /// Bytes they asked for.
    pub bytes: u64,
}

fn note(size: usize) {
    // try_with: never panic inside the allocator, even during thread teardown.
    if ARMED.try_with(Cell::get).unwrap_or(false) {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        let _ = BYTES.try_with(|c| c.set(c.get() + size as u64));
    }
}

// SAFETY: forwards every call unchanged to the system allocator; the
// bookkeeping touches only const-initialized thread-locals without
// destructors (no allocation, no re-entry).
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract for `alloc` is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: `ptr` came from this allocator (hence from System) with
        // `layout`, as the caller guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as for `realloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Runs `f` with counting armed on this thread; returns its result and
/// what it allocated.
pub fn count_allocs<T>(f: impl FnOnce() -> T) -> (T, Counts) {
    let before = Counts {
        allocs: ALLOCS.with(Cell::get),
        bytes: BYTES.with(Cell::get),
    };
    ARMED.with(|a| a.set(true));
    let v = f();
    ARMED.with(|a| a.set(false));
    let counts = Counts {
        allocs: ALLOCS.with(Cell::get) - before.allocs,
        bytes: BYTES.with(Cell::get) - before.bytes,
    };
    (v, counts)
}

/// The counter counts: one armed 24-byte allocation is seen as exactly that.
pub fn self_check() {
    let ((), c) = count_allocs(|| drop(std::hint::black_box(Vec::<u8>::with_capacity(24))));
    assert_eq!(
        c,
        Counts {
            allocs: 1,
            bytes: 24
        },
        "the counting allocator does not count"
    );
}

/// Writes `prefix` and `n` in decimal into `buf` without allocating (the
/// ids of a counted stretch cannot be `format!`ted); returns the length.
pub fn id_into(buf: &mut [u8], prefix: &[u8], mut n: u64) -> usize {
    let mut digits = [0u8; 20];
    let mut k = digits.len();
    loop {
        k -= 1;
        digits[k] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let len = prefix.len() + digits.len() - k;
    buf[..prefix.len()].copy_from_slice(prefix);
    buf[prefix.len()..len].copy_from_slice(&digits[k..]);
    len
}
