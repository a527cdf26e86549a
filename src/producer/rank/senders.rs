//! [`SenderTable`]: the decoder agents a P rank has heard read-dones from,
//! each under a small index, so that a lease can remember *which* readers
//! reported it in one 128-bit mask.
//!
//! Why per sender: with D TP 4 and P TP 2, each P rank is read by two D
//! workers and waits for two read-dones. Counted per rank, one duplicated
//! notification from the first worker (a retried send, a router replaying
//! it) freed the rank's share while the second worker was still reading.
//! Counted per (sender, lease), a duplicate changes nothing.
//!
//! # Layout and limits
//!
//! ```text
//!  names:     IdTable(128 x 256 B)   agent name -> index 0..128
//!  last_used: [u64; 128]             a step counter, for eviction
//!  per lease (in the rank):  u128    bit i: sender i's read-done counted
//! ```
//!
//! 128 distinct senders at once is far beyond the decoder workers one P
//! rank serves concurrently. When a 129th appears, the least recently heard
//! sender is forgotten and its index reused. A lease that still has the old
//! sender's bit set then treats the new sender's first read-done as a
//! duplicate: that lease waits for its expiry instead of being freed at
//! once. Late, never early: eviction can only delay a release
//! ([`super::RankCounters::senders_evicted`] counts how often it happens).
//! Names longer than 256 bytes share one index (the same direction of
//! error). The table is allocated once; lookups and inserts allocate
//! nothing.

use crate::ids::IdTable;

/// Senders one rank tells apart at once.
pub(crate) const MAX_SENDERS: u32 = 128;

/// Longest agent name stored; longer ones share [`OVERLONG`].
const MAX_NAME: u16 = 256;

/// The index every overlong (or empty) name maps to.
const OVERLONG: u32 = MAX_SENDERS - 1;

/// Decoder agents by name, each under an index below [`MAX_SENDERS`].
#[derive(Debug)]
pub(crate) struct SenderTable {
    names: IdTable,
    last_used: Box<[u64]>,
    in_use: u32,
    tick: u64,
}

impl SenderTable {
    pub(crate) fn new() -> SenderTable {
        SenderTable {
            // Index OVERLONG is never given to a stored name.
            names: IdTable::new(MAX_SENDERS, MAX_NAME),
            last_used: vec![0; MAX_SENDERS as usize].into_boxed_slice(),
            in_use: 0,
            tick: 0,
        }
    }

    /// The index of `name`, inserting it (and evicting the least recently
    /// used sender when the table is full). Returns the index and whether a
    /// sender was evicted to make room.
    pub(crate) fn index_of(&mut self, name: &[u8]) -> (u32, bool) {
        self.tick += 1;
        if name.is_empty() || name.len() > usize::from(MAX_NAME) {
            return (OVERLONG, false);
        }
        if let Some(i) = self.names.get(name) {
            self.last_used[i as usize] = self.tick;
            return (i, false);
        }
        let (i, evicted) = if self.in_use < OVERLONG {
            self.in_use += 1;
            (self.in_use - 1, false)
        } else {
            // Full: the least recently heard sender goes. O(128), only when
            // more than 127 distinct senders have been heard.
            let i = (0..OVERLONG)
                .min_by_key(|&i| self.last_used[i as usize])
                .unwrap_or(0);
            self.names.remove(i);
            (i, true)
        };
        let stored = self.names.insert(name, i);
        debug_assert!(stored.is_ok(), "a free index and a checked name");
        self.last_used[i as usize] = self.tick;
        (i, evicted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keep_their_index_and_the_least_recent_is_evicted() {
        let mut t = SenderTable::new();
        let names: Vec<String> = (0..OVERLONG).map(|i| format!("agent-{i}")).collect();
        for (k, n) in names.iter().enumerate() {
            assert_eq!(t.index_of(n.as_bytes()), (k as u32, false));
        }
        assert_eq!(t.index_of(b"agent-5"), (5, false), "stable");
        // Touch everything but agent-3: it is the least recently used.
        for n in names.iter().filter(|n| *n != "agent-3") {
            t.index_of(n.as_bytes());
        }
        assert_eq!(t.index_of(b"newcomer"), (3, true));
        assert_eq!(t.index_of(b"newcomer"), (3, false));
        // agent-3 comes back: someone else (now the least recent) goes.
        let (i, evicted) = t.index_of(b"agent-3");
        assert!(evicted && i != 3);
    }

    #[test]
    fn empty_and_overlong_names_share_one_index() {
        let mut t = SenderTable::new();
        assert_eq!(t.index_of(b""), (OVERLONG, false));
        assert_eq!(t.index_of(&[b'a'; 300]), (OVERLONG, false));
        assert_eq!(t.index_of(b"a"), (0, false));
    }
}
