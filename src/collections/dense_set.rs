//! [`DenseSet`]: a fixed-capacity set of small indices with O(1) insert,
//! remove and membership, iterated densely.
//!
//! This module owns only the set's two arrays. The tracker keeps its live
//! engines in one (so a step visits live engines, not every engine slot), the
//! sender keeps the engines it owes a deferred heartbeat in another, and the
//! P scheduler the leases with directives waiting for this step's message.
//! Removal swaps the last member into the hole, so iteration order is not
//! insertion order; nobody relies on it.

const ABSENT: u32 = u32::MAX;

/// Indices `0..capacity`, each present at most once. See the module docs.
#[derive(Debug)]
pub(crate) struct DenseSet {
    /// Members in `items[..len]`.
    items: Box<[u32]>,
    /// `pos[i]` is `i`'s position in `items`, or `ABSENT`.
    pos: Box<[u32]>,
    len: u32,
}

impl DenseSet {
    /// An empty set for indices `0..capacity`. Allocates both arrays now.
    pub(crate) fn new(capacity: u32) -> DenseSet {
        DenseSet {
            items: vec![0; capacity as usize].into_boxed_slice(),
            pos: vec![ABSENT; capacity as usize].into_boxed_slice(),
            len: 0,
        }
    }

    /// Adds `i`; false when it was already present or is out of range.
    pub(crate) fn insert(&mut self, i: u32) -> bool {
        match self.pos.get(i as usize) {
            Some(&ABSENT) => {}
            _ => return false,
        }
        // len < capacity: i is in range and absent, so some cell is free.
        let at = self.len;
        self.items[at as usize] = i;
        self.pos[i as usize] = at;
        self.len += 1;
        true
    }

    /// Removes `i`; false when it was absent.
    pub(crate) fn remove(&mut self, i: u32) -> bool {
        let at = match self.pos.get(i as usize) {
            Some(&ABSENT) | None => return false,
            Some(&p) => p,
        };
        debug_assert!(at < self.len && self.items[at as usize] == i);
        self.len -= 1;
        let last = self.items[self.len as usize];
        self.items[at as usize] = last;
        self.pos[last as usize] = at;
        self.pos[i as usize] = ABSENT;
        true
    }

    /// Whether `i` is present.
    pub(crate) fn contains(&self, i: u32) -> bool {
        matches!(self.pos.get(i as usize), Some(&p) if p != ABSENT)
    }

    /// Number of members.
    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    /// The member at position `k` (`k < len`), or `None`.
    #[inline]
    pub(crate) fn get(&self, k: u32) -> Option<u32> {
        if k < self.len {
            self.items.get(k as usize).copied()
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_iterate() {
        let mut s = DenseSet::new(4);
        assert!(s.insert(2));
        assert!(!s.insert(2));
        assert!(s.insert(0));
        assert!(s.insert(3));
        assert!(!s.insert(4), "out of range");
        assert_eq!(s.len(), 3);
        assert!(s.remove(2));
        assert!(!s.remove(2));
        assert!(!s.remove(9));
        assert!(!s.contains(2));
        let mut got: Vec<u32> = (0..s.len()).filter_map(|k| s.get(k)).collect();
        got.sort();
        assert_eq!(got, [0, 3]);
        assert_eq!(s.get(2), None);
    }
}
