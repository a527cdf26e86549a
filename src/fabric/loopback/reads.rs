//! The in-flight READ table of one loopback agent.
//!
//! This module owns the bookkeeping of posted READs: fixed-capacity entries
//! (descriptors and the attached notification copied in at post time), the
//! [`XferId`] encoding and the free list. It does not copy memory or decide
//! completion; the fabric does both on `read_state`.
//!
//! An [`XferId`] is `generation << 32 | index`. The generation of an entry is
//! bumped whenever it is freed, so an id that was already reported, cancelled
//! or forgotten after a restart is recognised as unknown instead of aliasing
//! the next READ that reuses the entry.

use crate::collections::FreeStack;
use crate::fabric::{FabricError, ReadDesc, RegionId, XferId};
use crate::time::Instant;

/// One posted READ.
pub(crate) struct ReadEntry {
    generation: u32,
    active: bool,
    /// The remote agent's index on the network.
    pub(crate) target: u32,
    /// The remote's incarnation at post time: a READ against an agent that
    /// restarted since fails.
    pub(crate) target_incarnation: u32,
    /// Virtual time at which it completes (post + latency + injected delay).
    pub(crate) done_at: Instant,
    /// Virtual time at which it times out.
    pub(crate) deadline: Instant,
    /// Injected failure, reported when it would have completed.
    pub(crate) fail: Option<FabricError>,
    /// Ended before completion (its peer was removed): reported at once.
    pub(crate) aborted: Option<FabricError>,
    descs: Box<[ReadDesc]>,
    desc_count: usize,
    notification: Box<[u8]>,
    notification_len: Option<usize>,
}

impl ReadEntry {
    pub(crate) fn descs(&self) -> &[ReadDesc] {
        &self.descs[..self.desc_count]
    }

    pub(crate) fn notification(&self) -> Option<&[u8]> {
        self.notification_len.map(|n| &self.notification[..n])
    }
}

/// What a new READ is, apart from its descriptors and notification.
pub(crate) struct ReadPlan {
    pub(crate) target: u32,
    pub(crate) target_incarnation: u32,
    pub(crate) done_at: Instant,
    pub(crate) deadline: Instant,
    pub(crate) fail: Option<FabricError>,
}

pub(crate) struct ReadTable {
    entries: Box<[ReadEntry]>,
    /// Free entry indices. Preallocated to the table's capacity and never
    /// grown past it, so pushes and pops do not allocate.
    free: FreeStack,
}

const EMPTY_DESC: ReadDesc = ReadDesc {
    local: RegionId(0),
    local_offset: 0,
    remote: RegionId(0),
    remote_offset: 0,
    len: 0,
};

impl ReadTable {
    pub(crate) fn new(capacity: u32, max_descs: u32, max_notification_len: usize) -> ReadTable {
        ReadTable {
            entries: (0..capacity)
                .map(|_| ReadEntry {
                    generation: 0,
                    active: false,
                    target: 0,
                    target_incarnation: 0,
                    done_at: Instant::ZERO,
                    deadline: Instant::ZERO,
                    fail: None,
                    aborted: None,
                    descs: vec![EMPTY_DESC; max_descs as usize].into_boxed_slice(),
                    desc_count: 0,
                    notification: vec![0u8; max_notification_len].into_boxed_slice(),
                    notification_len: None,
                })
                .collect(),
            // Pop order is ascending index, which keeps ids predictable.
            free: FreeStack::full(capacity),
        }
    }

    /// Most descriptors one READ may carry.
    pub(crate) fn max_descs(&self) -> usize {
        self.entries.first().map_or(0, |e| e.descs.len())
    }

    /// Records a READ; `Full` when every entry is in flight or the READ has
    /// more descriptors than an entry holds. The caller checked the
    /// notification's length against the fabric's limit.
    pub(crate) fn insert(
        &mut self,
        plan: ReadPlan,
        descs: &[ReadDesc],
        notification: Option<&[u8]>,
    ) -> Result<XferId, FabricError> {
        if descs.len() > self.max_descs() {
            return Err(FabricError::Full);
        }
        let index = self.free.pop().ok_or(FabricError::Full)?;
        let e = &mut self.entries[index as usize];
        if let Some(n) = notification {
            if n.len() > e.notification.len() {
                self.free.push(index);
                return Err(FabricError::MessageTooLarge);
            }
            e.notification[..n.len()].copy_from_slice(n);
        }
        e.active = true;
        e.target = plan.target;
        e.target_incarnation = plan.target_incarnation;
        e.done_at = plan.done_at;
        e.deadline = plan.deadline;
        e.fail = plan.fail;
        e.aborted = None;
        e.descs[..descs.len()].copy_from_slice(descs);
        e.desc_count = descs.len();
        e.notification_len = notification.map(<[u8]>::len);
        Ok(XferId::pack(e.generation, index))
    }

    /// The active entry `id` names, if any.
    pub(crate) fn get(&self, id: XferId) -> Option<(u32, &ReadEntry)> {
        let (generation, index) = id.unpack();
        self.entries
            .get(index as usize)
            .filter(|e| e.active && e.generation == generation)
            .map(|e| (index, e))
    }

    /// Forgets the entry at `index` (from [`ReadTable::get`]).
    pub(crate) fn remove(&mut self, index: u32) {
        if let Some(e) = self.entries.get_mut(index as usize) {
            if e.active {
                e.active = false;
                e.generation = e.generation.wrapping_add(1);
                self.free.push(index);
            }
        }
    }

    /// Ends every READ from `target` with `err`, reported at the READ's
    /// next poll (its peer was removed).
    pub(crate) fn abort_target(&mut self, target: u32, err: FabricError) {
        for e in self.entries.iter_mut() {
            if e.active && e.target == target {
                e.aborted = Some(err);
            }
        }
    }

    /// Forgets every READ (the agent restarted).
    pub(crate) fn clear(&mut self) {
        for index in 0..self.entries.len() as u32 {
            self.remove(index);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn plan() -> ReadPlan {
        ReadPlan {
            target: 1,
            target_incarnation: 0,
            done_at: Instant::ZERO,
            deadline: Instant::MAX,
            fail: None,
        }
    }

    #[test]
    fn ids_are_not_reused_after_removal() {
        let mut t = ReadTable::new(1, 2, 4);
        let a = t.insert(plan(), &[EMPTY_DESC], Some(b"hi")).unwrap();
        assert_eq!(t.insert(plan(), &[], None), Err(FabricError::Full));
        let (i, e) = t.get(a).unwrap();
        assert_eq!(e.descs().len(), 1);
        assert_eq!(e.notification(), Some(&b"hi"[..]));
        t.remove(i);
        assert!(t.get(a).is_none());
        let b = t.insert(plan(), &[], None).unwrap();
        assert_ne!(a, b);
        assert!(t.get(b).unwrap().1.notification().is_none());
        t.clear();
        assert!(t.get(b).is_none());
    }

    #[test]
    fn aborting_a_target_marks_only_its_reads() {
        let mut t = ReadTable::new(3, 1, 0);
        let a = t.insert(plan(), &[], None).unwrap();
        let other = ReadPlan {
            target: 2,
            ..plan()
        };
        let b = t.insert(other, &[], None).unwrap();
        t.abort_target(1, FabricError::Cancelled);
        assert_eq!(t.get(a).unwrap().1.aborted, Some(FabricError::Cancelled));
        assert_eq!(t.get(b).unwrap().1.aborted, None);
        // A READ that reuses the entry starts clean.
        let (i, _) = t.get(a).unwrap();
        t.remove(i);
        let c = t.insert(plan(), &[], None).unwrap();
        assert_eq!(t.get(c).unwrap().1.aborted, None);
    }

    #[test]
    fn limits_are_typed_errors() {
        let mut t = ReadTable::new(2, 1, 2);
        assert_eq!(
            t.insert(plan(), &[EMPTY_DESC; 2], None),
            Err(FabricError::Full)
        );
        assert_eq!(
            t.insert(plan(), &[], Some(b"toolong")),
            Err(FabricError::MessageTooLarge)
        );
        // The refused READ gave its entry back.
        t.insert(plan(), &[], None).unwrap();
        t.insert(plan(), &[], None).unwrap();
        assert_eq!(t.get(XferId(u64::MAX)).map(|(i, _)| i), None);
    }
}
