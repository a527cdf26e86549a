//! [`LeaseSlots`]: the array of lease words a P worker exports to decoders.
//!
//! This module owns the memory layout of the exported array and the two
//! writes P makes to it. It does not decide *which* slot a lease gets (that
//! is [`crate::SlotPool`]) nor *when* to write (that is the lease book).
//!
//! # Layout
//!
//! ```text
//!   byte offset   0        8        16             8*(n-1)
//!                 +--------+--------+-- ... --+--------+
//!   word          | slot 0 | slot 1 |         | slot n-1|   u64, little-endian
//!                 +--------+--------+-- ... --+--------+
//!   value         0 = free; otherwise the nonce of the lease that holds it
//! ```
//!
//! The array is one contiguous, 8-byte aligned allocation that never moves
//! after construction, so it can be registered once with NIXL
//! ([`LeaseSlots::as_ptr`], [`LeaseSlots::byte_len`]) and read remotely by
//! decoders: one 8-byte READ at offset `8 * slot`. Words are stored in the
//! machine's byte order; the crate only builds for little-endian targets so
//! that the remote reader can decode with `u64::from_le_bytes`.
//!
//! # Ordering
//!
//! P writes a nonce at grant (`Release`) before it exports the slot in
//! `kv_transfer_params`, and zeroes the word at release (`SeqCst`) before the
//! release is reported to the engine, which is what lets the engine reuse the
//! blocks. A reader that loads the nonce *after* it finished reading the
//! blocks therefore sees the nonce only if the blocks were not yet handed
//! back (`loom_tests/` checks this with atomics standing in for the READs).

#[cfg(target_endian = "big")]
compile_error!(
    "kvlease lease slots are exported little-endian; big-endian targets are not supported"
);

use crate::sync::{AtomicU64, Ordering};

/// Bytes per slot word.
pub const SLOT_BYTES: usize = 8;

/// One worker's exported lease words. See the module docs for the layout.
#[derive(Debug)]
pub struct LeaseSlots {
    words: Box<[AtomicU64]>,
}

impl LeaseSlots {
    /// `count` free (zeroed) slots.
    pub fn new(count: u32) -> LeaseSlots {
        LeaseSlots {
            words: (0..count).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Number of slots.
    pub fn len(&self) -> u32 {
        // new() takes a u32 count, so this cannot truncate.
        self.words.len() as u32
    }

    /// True when the array has no slots.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// The word in `slot` (0 = free), or `None` when `slot` is out of range.
    /// This is what a local reader (the loopback fabric) sees.
    pub fn load(&self, slot: u32) -> Option<u64> {
        self.words
            .get(slot as usize)
            .map(|w| w.load(Ordering::Acquire))
    }

    /// Byte offset of `slot` in the registered region.
    pub const fn offset_of(slot: u32) -> u64 {
        slot as u64 * SLOT_BYTES as u64
    }

    /// Writes `nonce` into `slot`: the lease is now verifiable.
    pub(crate) fn publish(&self, slot: u32, nonce: u64) {
        debug_assert_ne!(nonce, 0, "a published nonce is never 0");
        if let Some(w) = self.words.get(slot as usize) {
            debug_assert_eq!(
                w.load(Ordering::Relaxed),
                0,
                "slot {slot} published while held"
            );
            w.store(nonce, Ordering::Release);
        }
    }

    /// Zeroes `slot`: from now on no reader can verify the old lease.
    pub(crate) fn clear(&self, slot: u32) {
        if let Some(w) = self.words.get(slot as usize) {
            w.store(0, Ordering::SeqCst);
        }
    }
}

#[cfg(not(loom))]
impl LeaseSlots {
    /// Start of the array, for memory registration with a fabric.
    ///
    /// The pointer stays valid and fixed for the life of `self`. Remote
    /// agents may only *read* through it; every local write goes through
    /// atomics.
    pub fn as_ptr(&self) -> *const u8 {
        self.words.as_ptr().cast()
    }

    /// Length of the array in bytes (`8 * len()`).
    pub fn byte_len(&self) -> usize {
        self.words.len() * SLOT_BYTES
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn new_slots_are_free_and_addressable() {
        let s = LeaseSlots::new(4);
        assert_eq!(s.len(), 4);
        assert!((0..4).all(|i| s.load(i) == Some(0)));
        assert_eq!(s.load(4), None);
        assert_eq!(s.byte_len(), 32);
        assert_eq!(LeaseSlots::offset_of(3), 24);
        assert_eq!(s.as_ptr() as usize % 8, 0);
    }

    #[test]
    fn publish_then_clear_is_visible_in_the_byte_view() {
        let s = LeaseSlots::new(2);
        s.publish(1, 0x0102_0304_0506_0708);
        // SAFETY: as_ptr/byte_len describe the live array; we only read.
        let bytes = unsafe { std::slice::from_raw_parts(s.as_ptr(), s.byte_len()) };
        assert_eq!(&bytes[8..16], &0x0102_0304_0506_0708u64.to_le_bytes());
        s.clear(1);
        assert_eq!(s.load(1), Some(0));
        // Out-of-range writes are no-ops, not panics.
        s.publish(9, 1);
        s.clear(9);
    }
}
