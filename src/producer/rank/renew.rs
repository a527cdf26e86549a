//! Renewals on a rank: by id (one at a time, or a batch software-pipelined
//! a block at a time over the id index, the lease lines and the heads), and
//! by (slot, nonce).

use super::*;

/// Ids per block of [`PrefillRank::renew_all`]'s pipeline: enough misses in
/// flight to cover a memory latency, few enough for the core to keep them
/// (two or three lines an id).
pub(crate) const ID_BLOCK: usize = 16;

impl PrefillRank {
    /// Renews this rank's lease of `request_id` (a heartbeat): the deadline
    /// becomes `max(deadline, now + extension)`, capped at the lease's hold
    /// ceiling. Never shortens. Unknown ids are counted and ignored.
    #[inline]
    pub fn renew(&mut self, request_id: &[u8], now: Instant) -> Renewal {
        match self.find(request_id) {
            Some(e) => self.renew_entry(e, now),
            None => {
                self.counters.renew_unknown += 1;
                Renewal::Unknown
            }
        }
    }

    /// Renews every id of a heartbeat, as [`PrefillRank::renew`] would one by
    /// one; returns (renewed, ignored). Capped renewals count as renewed.
    ///
    /// A software pipeline over blocks of 16 ids (`ID_BLOCK`), in a fixed
    /// array on the stack (nothing allocated), so that each id's three
    /// cache misses (index cell, id line, head) overlap with the other ids'
    /// instead of following each other: each id of a block is hashed and
    /// its index cell prefetched; then each cell is read and its
    /// candidate's line and head prefetched; then each id is renewed, its
    /// cell, line and head by now in cache. The renewal target is computed
    /// once and the counts are kept in locals until the end, as in
    /// [`PrefillRank::renew_slots_all`]. (The block size, and the forms
    /// measured against it: docs/benchmarks.md, "Lease book".)
    pub fn renew_all<'a>(
        &mut self,
        ids: impl IntoIterator<Item = &'a [u8]>,
        now: Instant,
    ) -> (u32, u32) {
        let wanted = self.renewal_target(now);
        let mut tally = SlotTally::default();
        let mut ids = ids.into_iter();
        let mut block: [(&[u8], u64); ID_BLOCK] = [(&[], 0); ID_BLOCK];
        loop {
            let n = self.hash_block(&mut ids, &mut block);
            let Some(block) = block.get(..n) else { break };
            for &(_, h) in block {
                if let Some(e) = self.index.home_candidate(h) {
                    self.lines.prefetch(e);
                }
            }
            for &(id, h) in block {
                self.renew_hashed_to(id, h, wanted, &mut tally);
            }
            if n < ID_BLOCK {
                break;
            }
        }
        self.add_tally(&tally)
    }

    /// Takes up to [`ID_BLOCK`] ids from `ids` into `block` with their
    /// hashes, prefetching each one's index cell; returns how many. An id no
    /// lease can have (empty, or longer than the rank's limit) is not hashed:
    /// its renewal finds nothing anyway.
    #[inline(always)]
    fn hash_block<'a>(
        &self,
        ids: &mut impl Iterator<Item = &'a [u8]>,
        block: &mut [(&'a [u8], u64); ID_BLOCK],
    ) -> usize {
        let mut n = 0;
        for slot in block.iter_mut() {
            let Some(id) = ids.next() else { break };
            let h = if self.may_hold(id) {
                let h = self.index.hash(id);
                self.index.prefetch(h);
                h
            } else {
                0
            };
            *slot = (id, h);
            n += 1;
        }
        n
    }

    /// Whether an id of this length could be held here.
    #[inline(always)]
    fn may_hold(&self, id: &[u8]) -> bool {
        !id.is_empty() && id.len() <= self.max_len
    }

    /// [`PrefillRank::renew`] of an id whose hash `h` is known, with the
    /// target precomputed and the counts in `tally`: the same outcome.
    #[inline(always)]
    fn renew_hashed_to(&mut self, id: &[u8], h: u64, wanted: u64, tally: &mut SlotTally) {
        let found = if self.may_hold(id) {
            self.find_hashed(id, h)
        } else {
            None
        };
        let Some(e) = found else {
            tally.unknown += 1;
            return;
        };
        let target = if self.holds_in_use {
            self.holds
                .get(e as usize)
                .map_or(wanted, |&c| wanted.min(c))
        } else {
            wanted
        };
        if let Some(head) = self.lines.head_mut(e) {
            // Never shortens; the wheel catches up lazily at poll time.
            head.deadline = head.deadline.max(target);
        }
        if target < wanted {
            tally.capped += 1;
        } else {
            tally.renewed += 1;
        }
    }

    /// Renews by (slot, nonce) from a compact heartbeat: the slot is the
    /// entry, so this is one 16-byte head, and only the lease holding that
    /// nonce is renewed. The batch paths' record step, for one record.
    #[inline]
    pub fn renew_slot(&mut self, slot: u32, nonce: Nonce, now: Instant) -> Renewal {
        let mut tally = SlotTally::default();
        self.renew_slot_to(slot, nonce.get(), self.renewal_target(now), &mut tally);
        self.add_tally(&tally);
        if tally.renewed > 0 {
            Renewal::Renewed
        } else if tally.capped > 0 {
            Renewal::Capped
        } else {
            Renewal::Unknown
        }
    }

    /// Renews every (slot, nonce) of a compact heartbeat, as
    /// [`PrefillRank::renew_slot`] would one by one; returns (renewed,
    /// ignored).
    ///
    /// One pass, the renewal of record `i - LAG` behind the prefetch of
    /// record `i`'s line (a heartbeat's slots are in D's order, which after
    /// churn is no order on P). The renewal target is computed once, and the
    /// counts are kept in locals and added to the counters at the end: per
    /// record this is a bounds check, a state and nonce compare and a `max`
    /// (at 100k leases 2.2 ns a record, against 6 ns for `renew_slot` record
    /// by record; `examples` in docs/benchmarks.md). A packed heartbeat
    /// takes the block form of the same loop (`inbox.rs`).
    pub fn renew_slots_all(
        &mut self,
        entries: impl IntoIterator<Item = (u32, Nonce)>,
        now: Instant,
    ) -> (u32, u32) {
        const LAG: usize = 16;
        // Holds records i - LAG ..= i: larger than LAG, a power of two.
        const RING: usize = 32;
        let mut ring = [(0u32, 0u64); RING];
        let wanted = self.renewal_target(now);
        let mut tally = SlotTally::default();
        let mut n = 0usize;
        for (slot, nonce) in entries {
            self.lines.prefetch_head(slot);
            ring[n % RING] = (slot, nonce.get());
            if n >= LAG {
                let (slot, nonce) = ring[(n - LAG) % RING];
                self.renew_slot_to(slot, nonce, wanted, &mut tally);
            }
            n += 1;
        }
        for k in n.saturating_sub(LAG)..n {
            let (slot, nonce) = ring[k % RING];
            self.renew_slot_to(slot, nonce, wanted, &mut tally);
        }
        self.add_tally(&tally)
    }

    /// The deadline a renewal at `now` asks for (before the hold ceiling).
    #[inline]
    pub(crate) fn renewal_target(&self, now: Instant) -> u64 {
        now.as_nanos().saturating_add(self.extension_ns)
    }

    /// Starts loading the lines of these (slot, nonce) records.
    #[inline]
    pub(crate) fn prefetch_slots(&self, records: impl Iterator<Item = (u32, u64)>) {
        for (slot, _) in records {
            self.lines.prefetch_head(slot);
        }
    }

    /// Adds a batch's outcomes to the counters; returns (renewed, ignored).
    pub(crate) fn add_tally(&mut self, tally: &SlotTally) -> (u32, u32) {
        let c = &mut self.counters;
        c.renewed += u64::from(tally.renewed);
        c.renew_capped += u64::from(tally.capped);
        c.renew_unknown += u64::from(tally.unknown);
        c.renew_nonce_mismatch += u64::from(tally.mismatch);
        (tally.renewed + tally.capped, tally.unknown + tally.mismatch)
    }

    /// [`PrefillRank::renew_slot`] with the target precomputed (`wanted`,
    /// from [`PrefillRank::renewal_target`]) and the counts in `tally`: the
    /// same outcome, record by record. `nonce` is the record's nonce bits
    /// (never 0 off the wire; a 0 would match no held lease).
    #[inline(always)]
    pub(crate) fn renew_slot_to(
        &mut self,
        slot: u32,
        nonce: u64,
        wanted: u64,
        tally: &mut SlotTally,
    ) {
        // A head's nonce is 0 exactly when the entry is free: the head
        // alone says whether the slot holds a lease, and whose.
        let head = match self
            .layout
            .slot_of(slot)
            .and_then(|e| self.lines.head_mut(e))
        {
            Some(head) if head.nonce != 0 => head,
            _ => {
                tally.unknown += 1;
                return;
            }
        };
        if head.nonce != nonce {
            tally.mismatch += 1;
            return;
        }
        let target = if self.holds_in_use {
            self.holds
                .get(slot as usize)
                .map_or(wanted, |&h| wanted.min(h))
        } else {
            wanted
        };
        // Never shortens; the wheel catches up lazily at poll time.
        head.deadline = head.deadline.max(target);
        if target < wanted {
            tally.capped += 1;
        } else {
            tally.renewed += 1;
        }
    }

    #[inline]
    pub(super) fn renew_entry(&mut self, e: u32, now: Instant) -> Renewal {
        let wanted = now.as_nanos().saturating_add(self.extension_ns);
        let target = if self.holds_in_use {
            wanted.min(self.holds[e as usize])
        } else {
            wanted
        };
        if let Some(head) = self.lines.head_mut(e) {
            // Never shortens; the wheel catches up lazily at poll time.
            head.deadline = head.deadline.max(target);
        }
        if target < wanted {
            self.counters.renew_capped += 1;
            Renewal::Capped
        } else {
            self.counters.renewed += 1;
            Renewal::Renewed
        }
    }
}

/// The outcomes of a batch of (slot, nonce) renewals, kept in registers
/// until the batch ends.
#[derive(Default)]
pub(crate) struct SlotTally {
    renewed: u32,
    capped: u32,
    unknown: u32,
    mismatch: u32,
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::ID_BLOCK;
    use crate::producer::lease_line::INLINE_ID;
    use crate::rng::SplitMix64;
    use crate::testkit::p_side_config;
    use crate::{Instant, LeaseBook, LeaseSlots, NonceSource, Renewal, SlotPool};

    /// Two books that made the same grants (same nonces and slots): a
    /// lease of every kind the renewal by id can meet.
    fn twin(c: &crate::LeaseConfig, held: &[Vec<u8>], pinned: &[Vec<u8>]) -> LeaseBook {
        let mut book = LeaseBook::with_parts(
            c,
            vec![Arc::new(LeaseSlots::new(64))],
            Arc::new(SlotPool::new(64)),
            NonceSource::from_seed(1, 2, 3),
            Instant::ZERO,
        )
        .unwrap();
        for (i, id) in held.iter().enumerate() {
            // Half granted at 0 s (ceiling 45 s), half at 20 s (65 s).
            let at = Instant::from_secs(if i % 2 == 0 { 0 } else { 20 });
            book.grant(core::str::from_utf8(id).unwrap(), at).unwrap();
        }
        for id in pinned {
            book.assign(core::str::from_utf8(id).unwrap(), Instant::from_secs(20))
                .unwrap();
        }
        book
    }

    /// `renew_all`'s block pipeline gives exactly what `renew` gives id by
    /// id: random batches (lengths that are and are not multiples of the
    /// block) of held, capped, pinned and released leases, unknown ids, ids
    /// longer than a line's inline bytes (and one differing from a held one
    /// only in its tail), duplicates, empty and over-long ids; renewal
    /// times that go back as well as forward (never shortens). The same
    /// (renewed, ignored), counters and every head's deadline and nonce.
    #[test]
    fn a_batch_of_ids_is_each_id_renewed_alone() {
        let mut c = p_side_config(64, 64);
        c.max_hold_secs = Some(45);
        let max = usize::from(c.max_request_id_len);
        let id = |i: usize, len: usize| {
            let mut v = format!("cmpl-{i:04}-").into_bytes();
            v.resize(len, b'a' + (i % 26) as u8);
            v
        };
        let held: Vec<Vec<u8>> = (0..32)
            .map(|i| id(i, if i % 4 == 3 { INLINE_ID + 1 + i } else { 39 }))
            .collect();
        let pinned: Vec<Vec<u8>> = (32..36).map(|i| id(i, 45)).collect();
        let released: Vec<Vec<u8>> = (36..40).map(|i| id(i, 39)).collect();
        let mut all = held.clone();
        all.extend(pinned.iter().cloned());
        all.extend(released.iter().cloned());
        let (mut batch, mut alone) = (
            twin(&c, &all[..32], &all[32..]),
            twin(&c, &all[..32], &all[32..]),
        );
        for id in &released {
            let id = core::str::from_utf8(id).unwrap();
            assert!(batch.cancel(id) && alone.cancel(id));
        }
        let mut others: Vec<Vec<u8>> = vec![
            Vec::new(),          // empty
            vec![b'x'; max + 1], // too long for any lease
            id(99, 39),          // never granted
            id(0, 38),           // a held id's prefix
            b"x".to_vec(),       // short
        ];
        let mut tail_differs = held[3].clone();
        *tail_differs.last_mut().unwrap() ^= 1;
        others.push(tail_differs);
        let mut head_differs = held[7].clone();
        head_differs[20] ^= 1;
        others.push(head_differs);
        all.extend(others);

        let mut rng = SplitMix64::new(0x5eed);
        let mut now = 10u64;
        let mut lens = vec![
            0,
            1,
            ID_BLOCK - 1,
            ID_BLOCK,
            ID_BLOCK + 1,
            2 * ID_BLOCK,
            3 * ID_BLOCK + 5,
        ];
        lens.extend((0..40).map(|_| rng.below(5 * ID_BLOCK as u64) as usize));
        for len in lens {
            // Forward by up to 10 s, or back by up to 5 s.
            now = (now + rng.below(15_000)).saturating_sub(5_000);
            let at = Instant::from_millis(now);
            let mut ids: Vec<&[u8]> = Vec::new();
            while ids.len() < len {
                let k = rng.below(all.len() as u64) as usize;
                ids.push(&all[k]);
                if rng.below(8) == 0 {
                    ids.push(&all[k]); // a duplicate, at once
                }
            }
            ids.truncate(len);
            let got = batch.renew_all(ids.iter().copied(), at);
            let mut want = (0, 0);
            for id in &ids {
                match alone.renew(id, at) {
                    Renewal::Renewed | Renewal::Capped => want.0 += 1,
                    Renewal::Unknown => want.1 += 1,
                }
            }
            assert_eq!(got, want, "a batch of {len} at {now} ms");
            assert_eq!(batch.counters(), alone.counters());
            let (b, a) = (batch.rank(0).unwrap(), alone.rank(0).unwrap());
            assert_eq!(b.counters(), a.counters());
            for e in 0..b.lines.len() {
                let (hb, ha) = (b.lines.head(e).unwrap(), a.lines.head(e).unwrap());
                assert_eq!(
                    (hb.deadline, hb.nonce),
                    (ha.deadline, ha.nonce),
                    "entry {e}"
                );
            }
        }
        let c = batch.counters();
        assert!(
            c.renewed > 0 && c.renew_capped > 0 && c.renew_unknown > 0,
            "{c:?}"
        );
    }
}
