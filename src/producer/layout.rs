//! [`EntryLayout`]: how leases are numbered, identically on the P scheduler
//! and on every P rank.
//!
//! The scheduler hands each lease an *entry*; directives and reports name the
//! lease by it, and every rank keeps the lease's state at that index. The
//! numbering is fixed by the configuration, so a rank can check a directive's
//! entry without asking anyone:
//!
//! ```text
//!  entry:  0 ............ slotted-1 | slotted ........ slotted+unslotted-1
//!          a lease holding slot e    | a lease without a slot
//!          (entry == its lease slot) | (verification off, or the pool was empty)
//! ```
//!
//! Entry == slot is what makes a compact `HBC:` renewal one cache line on a
//! rank: the (slot, nonce) record indexes the lease directly. The slot pool
//! is then the free list of the slotted range, and a slotted entry becomes
//! reusable exactly when its slot does: after the engine freed the blocks.
//! The unslotted range is as large as the lease capacity, because every live
//! lease may be unslotted (the pool may be empty while freed blocks' tickets
//! are still out). That doubles the per-entry arrays when slots are on; the
//! bytes per entry are in `docs/embedding.md`, "Limits and degraded
//! behaviour".

use crate::config::LeaseConfig;

/// The numbering of lease entries. See the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryLayout {
    /// Entries `0..slotted` are leases holding that slot.
    pub slotted: u32,
    /// Entries `slotted..slotted + unslotted` are leases without a slot.
    pub unslotted: u32,
}

impl EntryLayout {
    /// The layout a configuration implies: `kv_lease_slots` slotted entries
    /// when verification is on (none when off), `kv_lease_capacity`
    /// unslotted ones.
    pub fn of(config: &LeaseConfig) -> EntryLayout {
        EntryLayout {
            slotted: if config.verification {
                config.lease_slots
            } else {
                0
            },
            unslotted: config.lease_capacity,
        }
    }

    /// Entries in all.
    pub fn entries(&self) -> u32 {
        self.slotted.saturating_add(self.unslotted)
    }

    /// The lease slot of `entry`, if it is a slotted one.
    #[inline]
    pub fn slot_of(&self, entry: u32) -> Option<u32> {
        (entry < self.slotted).then_some(entry)
    }

    /// Whether `(entry, slot)` is a consistent pair in this layout: a slotted
    /// entry carries its own index as slot, an unslotted one none.
    pub fn consistent(&self, entry: u32, slot: Option<u32>) -> bool {
        entry < self.entries() && self.slot_of(entry) == slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slotted_entries_are_their_slots() {
        let l = EntryLayout {
            slotted: 4,
            unslotted: 6,
        };
        assert_eq!(l.entries(), 10);
        assert_eq!(l.slot_of(3), Some(3));
        assert_eq!(l.slot_of(4), None);
        assert!(l.consistent(2, Some(2)));
        assert!(!l.consistent(2, Some(3)));
        assert!(!l.consistent(2, None));
        assert!(l.consistent(9, None));
        assert!(!l.consistent(10, None));
    }
}
