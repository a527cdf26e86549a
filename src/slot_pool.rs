//! [`SlotPool`]: the lock-free pool of free lease-slot indices.
//!
//! This module owns which slot indices are free. It never touches the slot
//! words themselves (that is [`crate::LeaseSlots`]).
//!
//! # Why lock-free
//!
//! The engine loop takes slots; but a slot may only come back once the engine
//! has really freed the blocks, and engines free blocks from wherever their
//! block manager runs. So [`SlotPool::give_back`] may be called from any
//! thread, and nobody may block the engine loop while doing it.
//!
//! # Layout: a Treiber stack with a tagged head
//!
//! ```text
//!  head: AtomicU64 = [ tag: u32 | top index: u32 ]      NIL = u32::MAX
//!  next: [AtomicU32; capacity]   next[i] = index below i on the stack
//!
//!    head ─▶ 7 ─▶ 2 ─▶ 5 ─▶ NIL
//! ```
//!
//! Every successful CAS on `head` bumps the tag, so a pop that read
//! `head = (t, x)` and `next[x] = y` cannot succeed after other threads popped
//! `x`, popped `y` and pushed `x` back: the head is then `(t + 3, x)` (ABA).
//! A 32-bit tag wraps only after 2^32 operations between one thread's load
//! and its CAS. `loom_tests/` checks concurrent take/give-back and the ABA
//! interleaving.
//!
//! # Ownership
//!
//! [`SlotPool::take`] returns a [`SlotTicket`]: not `Clone`, not `Copy`, only
//! made here. Giving a slot back consumes the ticket, so a slot cannot be
//! returned twice or returned without having been taken. Dropping a ticket
//! without giving it back leaks the slot (it is `#[must_use]`).

use crossbeam_utils::CachePadded;

use crate::pack::Field;
use crate::sync::{AtomicU32, AtomicU64, Ordering};

const NIL: u32 = u32::MAX;

/// The right to one lease slot, until given back to its pool.
#[must_use = "dropping a SlotTicket leaks its slot: give it back to the pool"]
#[derive(Debug, PartialEq, Eq)]
pub struct SlotTicket {
    slot: u32,
}

impl SlotTicket {
    /// The slot index this ticket holds.
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

/// Lock-free pool of free slot indices `0..capacity`. See the module docs.
#[derive(Debug)]
pub struct SlotPool {
    head: CachePadded<AtomicU64>,
    next: Box<[AtomicU32]>,
}

/// The head word: the free list's first index, and a tag bumped on every
/// pop so that a stale compare-and-swap fails (the ABA guard). Diagram in
/// [`crate::design`], "Packed words".
const INDEX: Field = Field::new(0, 32);
const TAG: Field = Field::above(INDEX, 32);
#[cfg(test)]
pub(crate) const LAYOUT: [Field; 2] = [INDEX, TAG];

#[inline]
fn pack(tag: u32, index: u32) -> u64 {
    TAG.put(u64::from(tag)) | INDEX.put(u64::from(index))
}

#[inline]
fn unpack(word: u64) -> (u32, u32) {
    (TAG.get(word) as u32, INDEX.get(word) as u32)
}

impl SlotPool {
    /// A pool with every slot in `0..capacity` free. `capacity` must be below
    /// `u32::MAX` (the NIL marker); larger values are clamped.
    pub fn new(capacity: u32) -> SlotPool {
        let capacity = capacity.min(NIL - 1);
        let next: Box<[AtomicU32]> = (0..capacity)
            .map(|i| AtomicU32::new(if i + 1 < capacity { i + 1 } else { NIL }))
            .collect();
        let top = if capacity == 0 { NIL } else { 0 };
        SlotPool {
            head: CachePadded::new(AtomicU64::new(pack(0, top))),
            next,
        }
    }

    /// Number of slots the pool manages.
    pub fn capacity(&self) -> u32 {
        self.next.len() as u32
    }

    /// Takes a free slot, or `None` when every slot is in use. Lock-free.
    ///
    /// `#[must_use]`: a ticket that is dropped instead of given back leaks
    /// its slot for the pool's life, and `SlotTicket`'s own `#[must_use]`
    /// does not reach through the `Option`.
    ///
    /// ```compile_fail
    /// #![deny(unused_must_use)]
    /// let pool = kvlease::SlotPool::new(4);
    /// pool.take(); // error: unused return value of `SlotPool::take`
    /// ```
    #[must_use = "a taken slot that is dropped leaks; give the ticket back with SlotPool::give_back"]
    pub fn take(&self) -> Option<SlotTicket> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let (tag, top) = unpack(head);
            if top == NIL {
                return None;
            }
            // `top` may be popped and re-pushed by another thread between
            // this load and the CAS; then `below` is stale, but the tag has
            // moved on and the CAS fails.
            let below = self.next[top as usize].load(Ordering::Relaxed);
            match self.head.compare_exchange_weak(
                head,
                pack(tag.wrapping_add(1), below),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(SlotTicket { slot: top }),
                Err(actual) => head = actual,
            }
        }
    }

    /// Returns a slot to the pool. Lock-free; callable from any thread.
    ///
    /// Only give a ticket back once the blocks of the lease that held it are
    /// freed: the next lease to take the slot may be verified against it.
    pub fn give_back(&self, ticket: SlotTicket) {
        let slot = ticket.slot;
        debug_assert!(
            (slot as usize) < self.next.len(),
            "ticket from another pool"
        );
        let Some(link) = self.next.get(slot as usize) else {
            return; // a ticket from a larger pool: refuse rather than corrupt
        };
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            let (tag, top) = unpack(head);
            link.store(top, Ordering::Relaxed);
            match self.head.compare_exchange_weak(
                head,
                pack(tag.wrapping_add(1), slot),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(actual) => head = actual,
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn takes_every_slot_once_then_runs_dry() {
        let pool = SlotPool::new(5);
        let mut got: Vec<u32> = std::iter::from_fn(|| pool.take())
            .map(|t| t.slot())
            .collect();
        got.sort_unstable();
        assert_eq!(got, [0, 1, 2, 3, 4]);
        assert!(pool.take().is_none());
    }

    #[test]
    fn given_back_slot_is_taken_again() {
        let pool = SlotPool::new(2);
        let a = pool.take().unwrap();
        let b = pool.take().unwrap();
        assert!(pool.take().is_none());
        let a_slot = a.slot();
        pool.give_back(a);
        assert_eq!(pool.take().map(|t| t.slot()), Some(a_slot));
        pool.give_back(b);
    }

    #[test]
    fn empty_pool_is_fine() {
        let pool = SlotPool::new(0);
        assert_eq!(pool.capacity(), 0);
        assert!(pool.take().is_none());
    }

    #[test]
    fn tag_packing_round_trips() {
        for (tag, idx) in [(0, 0), (1, NIL), (u32::MAX, 7), (0xdead_beef, 0x1234_5678)] {
            assert_eq!(unpack(pack(tag, idx)), (tag, idx));
        }
    }

    #[test]
    fn threads_never_hold_the_same_slot() {
        use std::sync::atomic::AtomicBool;
        let pool = SlotPool::new(8);
        let held: Vec<AtomicBool> = (0..8).map(|_| AtomicBool::new(false)).collect();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    // Miri (.ci/run's bounded step) interprets this ~1000x slower.
                    for _ in 0..if cfg!(miri) { 200 } else { 20_000 } {
                        if let Some(t) = pool.take() {
                            let was = held[t.slot() as usize].swap(true, Ordering::AcqRel);
                            assert!(!was, "slot {} handed out twice", t.slot());
                            held[t.slot() as usize].store(false, Ordering::Release);
                            pool.give_back(t);
                        }
                    }
                });
            }
        });
        let mut all: Vec<u32> = std::iter::from_fn(|| pool.take())
            .map(|t| t.slot())
            .collect();
        all.sort_unstable();
        assert_eq!(
            all,
            (0..8).collect::<Vec<_>>(),
            "no slot lost or duplicated"
        );
    }
}
