//! [`IdTable`]: fixed-capacity request ids stored inline, and the
//! preallocated index from id to entry.
//!
//! This module owns the bytes of the request ids a structure holds and the
//! map from id to the holder's entry index. It does not know what an entry
//! is: the lease book and the heartbeat tracker number their entries
//! `0..capacity` and keep their own state per entry; this table keeps entry
//! `e`'s id and finds `e` again from the id.
//!
//! The index alone is `IdIndex` (crate-internal): a structure that keeps its ids somewhere
//! better for its hot path (the P rank keeps each id in the same cache line
//! as the lease's expiry and nonce) uses it directly and answers "is entry
//! `e`'s id this one?" with a closure.
//!
//! # Layout
//!
//! ```text
//!  IdIndex
//!   cells: [u64; 2^k >= 2*capacity]   open addressing, linear probing
//!          EMPTY, or a packed cell:
//!
//!          63                32 31                 0
//!          +-------------------+--------------------+
//!          | tag = hash >> 32  |       entry        |
//!          +-------------------+--------------------+
//!
//!          the tag rejects almost every wrong candidate without touching
//!          its id bytes (one cache miss saved per probe)
//!  IdTable = IdIndex +
//!   arena: [u8; capacity * max_len]   entry e's id at e*max_len, len[e] bytes
//!   len:   [u16; capacity]            0 = entry holds no id
//! ```
//!
//! Everything is allocated at construction; no operation allocates. The load
//! factor stays at or under 1/2, so a probe sequence is short on average.
//! Deletion shifts later cells of the cluster back (no tombstones), so the
//! table never degrades with churn. The hash is keyed with per-table random
//! bits: ids come from outside, and a fixed hash would let a client pick ids
//! that collide.

use crate::pack::Field;

const EMPTY: u64 = u64::MAX;

/// Why an id was refused.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The id is the empty string.
    #[error("empty request id")]
    Empty,
    /// The id is longer than the configured maximum.
    #[error("request id of {len} bytes exceeds the limit of {max}")]
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// The id is already in the table.
    #[error("request id already present")]
    Duplicate,
    /// The entry index is out of range or already holds an id.
    #[error("entry index out of range or in use")]
    BadEntry,
}

/// The id -> entry index without id storage. See the module docs.
///
/// The caller owns the ids: lookups and deletions ask it, through a closure,
/// whether entry `e` holds a given id or what `e`'s id hashes to.
#[derive(Debug)]
pub(crate) struct IdIndex {
    cells: Box<[u64]>,
    mask: usize,
    key: u64,
}

impl IdIndex {
    /// Room for `capacity` entries at a load factor of at most 1/2, hashing
    /// with `key`.
    pub(crate) fn new(capacity: u32, key: u64) -> IdIndex {
        let cells = (capacity as usize * 2).max(2).next_power_of_two();
        IdIndex {
            cells: vec![EMPTY; cells].into_boxed_slice(),
            mask: cells - 1,
            key,
        }
    }

    /// The index's keyed hash of an id.
    #[inline]
    pub(crate) fn hash(&self, id: &[u8]) -> u64 {
        keyed_hash(self.key, id)
    }

    /// The entry whose id hashes to `h` and for which `is_it` says yes.
    /// `is_it` is asked only for entries whose tag matches.
    #[inline]
    pub(crate) fn find(&self, h: u64, mut is_it: impl FnMut(u32) -> bool) -> Option<u32> {
        let mut i = (h as usize) & self.mask;
        loop {
            let c = self.cells[i];
            if c == EMPTY {
                return None;
            }
            if tag(c) == tag_of(h) && is_it(cell_entry(c)) {
                return Some(cell_entry(c));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Loads the home cell of `h`, so that a batch of lookups has its cache
    /// misses in flight together; returns the candidate entry when the
    /// home cell's tag matches, for the caller to warm its own data.
    #[inline]
    pub(crate) fn warm(&self, h: u64) -> Option<u32> {
        let c = core::hint::black_box(self.cells[(h as usize) & self.mask]);
        (c != EMPTY && tag(c) == tag_of(h)).then_some(cell_entry(c))
    }

    /// Starts loading the home cell of `h` without waiting for it.
    #[inline]
    pub(crate) fn prefetch(&self, h: u64) {
        crate::prefetch::prefetch(&self.cells[(h as usize) & self.mask]);
    }

    /// The entry in the home cell of `h` when its tag matches: the likely
    /// answer of [`IdIndex::find`], read without waiting on anything else.
    #[inline]
    pub(crate) fn home_candidate(&self, h: u64) -> Option<u32> {
        let c = self.cells[(h as usize) & self.mask];
        (c != EMPTY && tag(c) == tag_of(h)).then_some(cell_entry(c))
    }

    /// Indexes `entry` under hash `h`. The caller has checked (with
    /// [`IdIndex::find`]) that the id is not indexed yet. The load factor
    /// bound means an empty cell always exists.
    pub(crate) fn insert(&mut self, h: u64, entry: u32) {
        let mut i = (h as usize) & self.mask;
        while self.cells[i] != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.cells[i] = TAG.put(tag_of(h)) | ENTRY.put(u64::from(entry));
    }

    /// Removes `entry`, indexed under hash `h`; `hash_of(e)` must give the
    /// hash of any other indexed entry's id (the backward shift moves later
    /// members of the cluster by their home cell). Returns whether it was
    /// indexed.
    pub(crate) fn remove(
        &mut self,
        h: u64,
        entry: u32,
        mut hash_of: impl FnMut(u32) -> u64,
    ) -> bool {
        let mut i = (h as usize) & self.mask;
        loop {
            let c = self.cells[i];
            if c == EMPTY {
                return false;
            }
            if cell_entry(c) == entry {
                break;
            }
            i = (i + 1) & self.mask;
        }
        // Backward-shift deletion (no tombstones): move later members of the
        // cluster into the hole when their home is not inside (hole, current].
        let mut hole = i;
        let mut j = (i + 1) & self.mask;
        loop {
            let c = self.cells[j];
            if c == EMPTY {
                break;
            }
            let home = (hash_of(cell_entry(c)) as usize) & self.mask;
            let dist_home = j.wrapping_sub(home) & self.mask;
            let dist_hole = j.wrapping_sub(hole) & self.mask;
            if dist_home >= dist_hole {
                self.cells[hole] = c;
                hole = j;
            }
            j = (j + 1) & self.mask;
        }
        self.cells[hole] = EMPTY;
        true
    }
}

/// Fixed-capacity id storage plus id -> entry index. See the module docs.
#[derive(Debug)]
pub struct IdTable {
    arena: Box<[u8]>,
    len: Box<[u16]>,
    index: IdIndex,
    max_len: usize,
}

impl IdTable {
    /// Room for `capacity` ids of up to `max_len` bytes each, with a hash key
    /// from OS randomness.
    pub fn new(capacity: u32, max_len: u16) -> IdTable {
        IdTable::with_key(capacity, max_len, crate::nonce::entropy_u64())
    }

    /// As [`IdTable::new`] with a fixed hash key (deterministic tests).
    pub fn with_key(capacity: u32, max_len: u16, key: u64) -> IdTable {
        let cap = capacity as usize;
        let max_len = usize::from(max_len);
        IdTable {
            arena: vec![0; cap * max_len].into_boxed_slice(),
            len: vec![0; cap].into_boxed_slice(),
            index: IdIndex::new(capacity, key),
            max_len,
        }
    }

    /// Longest id accepted, in bytes.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Checks an id against the table's limits without inserting it.
    pub fn check(&self, id: &[u8]) -> Result<(), IdError> {
        if id.is_empty() {
            return Err(IdError::Empty);
        }
        if id.len() > self.max_len {
            return Err(IdError::TooLong {
                len: id.len(),
                max: self.max_len,
            });
        }
        Ok(())
    }

    /// Stores `id` as entry `entry`'s id and indexes it.
    pub fn insert(&mut self, id: &[u8], entry: u32) -> Result<(), IdError> {
        self.check(id)?;
        let e = entry as usize;
        if e >= self.len.len() || self.len[e] != 0 {
            return Err(IdError::BadEntry);
        }
        let h = self.index.hash(id);
        if self.get_hashed(id, h).is_some() {
            return Err(IdError::Duplicate);
        }
        self.arena[e * self.max_len..e * self.max_len + id.len()].copy_from_slice(id);
        // check() bounded id.len() by max_len <= u16::MAX.
        self.len[e] = id.len() as u16;
        self.index.insert(h, entry);
        Ok(())
    }

    /// The entry holding `id`, if any.
    #[inline]
    pub fn get(&self, id: &[u8]) -> Option<u32> {
        if id.is_empty() || id.len() > self.max_len {
            return None;
        }
        self.get_hashed(id, self.index.hash(id))
    }

    /// The table's hash of `id` (for [`IdTable::get_hashed`] and
    /// [`IdTable::warm`]).
    #[inline]
    pub fn hash_id(&self, id: &[u8]) -> u64 {
        self.index.hash(id)
    }

    /// Loads what a lookup of hash `h` will need first (its home cell and,
    /// when that cell's tag matches, the candidate's id bytes), so that a
    /// batch of lookups can have its cache misses in flight together. Returns
    /// the candidate entry, for the caller to warm its own per-entry data.
    #[inline]
    pub fn warm(&self, h: u64) -> Option<u32> {
        let e = self.index.warm(h)?;
        if let Some(b) = self.arena.get(e as usize * self.max_len) {
            core::hint::black_box(*b);
        }
        Some(e)
    }

    /// As [`IdTable::get`], with the hash already computed by [`IdTable::hash_id`].
    #[inline]
    pub fn get_hashed(&self, id: &[u8], h: u64) -> Option<u32> {
        debug_assert_eq!(h, self.index.hash(id));
        if id.is_empty() || id.len() > self.max_len {
            return None;
        }
        self.index.find(h, |e| self.id(e) == id)
    }

    /// Entry `entry`'s id; empty when the entry holds none.
    #[inline]
    pub fn id(&self, entry: u32) -> &[u8] {
        let e = entry as usize;
        match self.len.get(e) {
            Some(&n) => &self.arena[e * self.max_len..e * self.max_len + usize::from(n)],
            None => &[],
        }
    }

    /// Removes entry `entry`'s id from the table and forgets its bytes;
    /// returns whether it held one.
    pub fn remove(&mut self, entry: u32) -> bool {
        let had = self.unindex(entry);
        self.forget(entry);
        had
    }

    /// Makes `entry`'s id unfindable by [`IdTable::get`] but keeps its bytes
    /// ([`IdTable::id`]) until [`IdTable::forget`]; the same id may be
    /// inserted again for another entry meanwhile. Returns whether it was
    /// indexed.
    pub fn unindex(&mut self, entry: u32) -> bool {
        let id = self.id(entry);
        if id.is_empty() {
            return false;
        }
        let h = self.index.hash(id);
        let (arena, len, max_len) = (&self.arena, &self.len, self.max_len);
        let key = self.index.key;
        let id_of = |e: u32| {
            let n = len.get(e as usize).map_or(0, |&n| usize::from(n));
            let start = e as usize * max_len;
            arena.get(start..start + n).unwrap_or(&[])
        };
        self.index.remove(h, entry, |e| keyed_hash(key, id_of(e)))
    }

    /// Forgets `entry`'s id bytes (after [`IdTable::unindex`]); the entry may
    /// then take a new id.
    pub fn forget(&mut self, entry: u32) {
        if let Some(n) = self.len.get_mut(entry as usize) {
            *n = 0;
        }
    }
}

/// Keyed 64-bit hash of an id: 8 bytes a round, multiply-xorshift mixing.
#[inline]
fn keyed_hash(key: u64, id: &[u8]) -> u64 {
    const M: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h = key ^ (id.len() as u64).wrapping_mul(M);
    let mut chunks = id.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(M);
        h ^= h >> 29;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        h = (h ^ tail_word(rest)).wrapping_mul(M);
    }
    h ^= h >> 32;
    h = h.wrapping_mul(0xd6e8_feb8_6659_fd93);
    h ^ (h >> 32)
}

/// The 1..=7 bytes of `rest`, zero-padded, as a little-endian word: what
/// copying them into `[0u8; 8]` gives, read as two overlapping 4-byte words
/// (or three single bytes) instead of a variable-length copy (a `memcpy`
/// call, a fifth of the hash's time on a 39-byte id). Each byte lands at
/// the bit offset of its index; the overlapping bytes are the same bytes,
/// so or-ing them changes nothing.
#[inline(always)]
fn tail_word(rest: &[u8]) -> u64 {
    let n = rest.len();
    if n >= 4 {
        let word4 = |at: usize| {
            let mut w = [0u8; 4];
            if let Some(b) = rest.get(at..at + 4) {
                w.copy_from_slice(b);
            }
            u64::from(u32::from_le_bytes(w))
        };
        word4(0) | (word4(n - 4) << (8 * (n - 4)))
    } else {
        let byte = |at: usize| rest.get(at).map_or(0, |&b| u64::from(b)) << (8 * at);
        byte(0) | byte(n / 2) | byte(n.saturating_sub(1))
    }
}

/// A cell: the entry, and the top half of its id's hash as a tag (diagram
/// above and in [`crate::design`], "Packed words").
const ENTRY: Field = Field::new(0, 32);
const TAG: Field = Field::above(ENTRY, 32);
#[cfg(test)]
pub(crate) const LAYOUT: [Field; 2] = [ENTRY, TAG];

#[inline]
fn tag_of(h: u64) -> u64 {
    TAG.get(h)
}

#[inline]
fn tag(cell: u64) -> u64 {
    TAG.get(cell)
}

#[inline]
fn cell_entry(cell: u64) -> u32 {
    ENTRY.get(cell) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use std::collections::HashMap;

    #[test]
    fn insert_get_remove() {
        let mut t = IdTable::with_key(4, 16, 1);
        t.insert(b"req-a", 0).unwrap();
        t.insert(b"req-b", 3).unwrap();
        assert_eq!(t.get(b"req-a"), Some(0));
        assert_eq!(t.get(b"req-b"), Some(3));
        assert_eq!(t.get(b"req-c"), None);
        assert_eq!(t.id(3), b"req-b");
        assert!(t.remove(0));
        assert!(!t.remove(0));
        assert_eq!(t.get(b"req-a"), None);
        assert_eq!(t.get(b"req-b"), Some(3));
    }

    #[test]
    fn unindexed_id_keeps_its_bytes_and_may_be_reused() {
        let mut t = IdTable::with_key(2, 8, 1);
        t.insert(b"a", 0).unwrap();
        assert!(t.unindex(0));
        assert!(!t.unindex(0));
        assert_eq!(t.get(b"a"), None);
        assert_eq!(t.id(0), b"a");
        t.insert(b"a", 1).unwrap();
        assert_eq!(t.get(b"a"), Some(1));
        t.forget(0);
        assert_eq!(t.id(0), b"");
        assert_eq!(t.insert(b"b", 0), Ok(()));
    }

    #[test]
    fn refuses_bad_ids_and_entries() {
        let mut t = IdTable::with_key(2, 4, 1);
        assert_eq!(t.insert(b"", 0), Err(IdError::Empty));
        assert_eq!(
            t.insert(b"12345", 0),
            Err(IdError::TooLong { len: 5, max: 4 })
        );
        assert_eq!(t.insert(b"a", 2), Err(IdError::BadEntry));
        t.insert(b"a", 0).unwrap();
        assert_eq!(t.insert(b"b", 0), Err(IdError::BadEntry));
        assert_eq!(t.insert(b"a", 1), Err(IdError::Duplicate));
        assert_eq!(t.get(b"12345"), None);
        assert_eq!(t.id(99), b"");
    }

    /// The hash as it was before [`tail_word`]: the tail copied into a
    /// zeroed word. The keyed hash must not change with the speed-up.
    fn keyed_hash_by_copy(key: u64, id: &[u8]) -> u64 {
        const M: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut h = key ^ (id.len() as u64).wrapping_mul(M);
        let mut chunks = id.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            h = (h ^ u64::from_le_bytes(w)).wrapping_mul(M);
            h ^= h >> 29;
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            h = (h ^ u64::from_le_bytes(w)).wrapping_mul(M);
        }
        h ^= h >> 32;
        h = h.wrapping_mul(0xd6e8_feb8_6659_fd93);
        h ^ (h >> 32)
    }

    #[test]
    fn tail_words_hash_as_the_copied_tail_did() {
        let mut rng = SplitMix64::new(7);
        let rounds = if cfg!(miri) { 2 } else { 64 };
        for len in 0..=70usize {
            for _ in 0..rounds {
                let key = rng.next_u64();
                // Random bytes, high bits included (the tail's bytes must
                // not spill into each other's positions).
                let id: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
                assert_eq!(keyed_hash(key, &id), keyed_hash_by_copy(key, &id), "{len}");
            }
        }
        for n in 1..8usize {
            let rest: Vec<u8> = (1..=n as u8).map(|b| b | 0x80).collect();
            let mut w = [0u8; 8];
            w[..n].copy_from_slice(&rest);
            assert_eq!(tail_word(&rest), u64::from_le_bytes(w), "{n}");
        }
    }

    #[test]
    fn matches_a_hashmap_under_random_churn() {
        // Small table, many collisions (key 0, short ids): exercises the
        // backward shift across wrapped clusters.
        let cap = 64u32;
        let mut t = IdTable::with_key(cap, 8, 0);
        let mut model: HashMap<Vec<u8>, u32> = HashMap::new();
        let mut free: Vec<u32> = (0..cap).collect();
        let mut rng = SplitMix64::new(0x1234_5678_9abc_def0u64);
        let mut next = || rng.next_u64();
        // Miri (.ci/run's bounded step) interprets this ~1000x slower.
        let rounds = if cfg!(miri) { 500 } else { 200_000 };
        for _ in 0..rounds {
            let r = next();
            let id = format!("{}", r % 200).into_bytes();
            if r & (1 << 40) != 0 {
                match (model.get(&id), free.pop()) {
                    (Some(_), Some(e)) => {
                        assert_eq!(t.insert(&id, e), Err(IdError::Duplicate));
                        free.push(e);
                    }
                    (None, Some(e)) => {
                        t.insert(&id, e).unwrap();
                        model.insert(id.clone(), e);
                    }
                    (_, None) => {}
                }
            } else if let Some(e) = model.remove(&id) {
                assert!(t.remove(e));
                free.push(e);
            }
            assert_eq!(t.get(&id), model.get(&id).copied());
        }
        for (id, e) in &model {
            assert_eq!(t.get(id), Some(*e));
            assert_eq!(t.id(*e), &id[..]);
        }
    }
}
