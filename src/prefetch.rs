//! [`prefetch`]: ask the CPU to start loading a cache line we will touch
//! soon, without waiting for it.
//!
//! The renewal paths take ids in batches and touch two or three cache lines
//! per id (index cell, lease line) that, at 100k leases and more, are
//! usually not in cache. Loading them with ordinary reads in a first pass
//! still serialises each id's chain (the lease line's address comes from the
//! cell), and the reads cannot retire until the data arrives. A prefetch
//! hint retires at once: a whole batch's misses are in flight together, and
//! the next pass finds the lines in L1. On targets without a stable hint
//! this is a no-op and the batch passes simply do the work.

/// Hints that the cache line holding `*p` will be read soon. Never faults,
/// whatever `p` is: a prefetch has no architectural effect.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse"))]
    {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: PREFETCHT0 is a hint: it performs no access that can fault
        // or be observed, for any address, valid or not. (The intrinsic is
        // safe to call on toolchains with target_feature 1.1; older ones
        // need the block.)
        #[allow(unused_unsafe)]
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>());
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse")))]
    {
        let _ = p;
    }
}
