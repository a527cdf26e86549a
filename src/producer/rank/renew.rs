//! Renewals on a rank: by id (one at a time, or a batch software-pipelined
//! over the id table and the lease lines), and by (slot, nonce).

use super::*;

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
    /// A software pipeline keeps a steady stream of cache misses in flight:
    /// id `i` is hashed and its index cell prefetched; the cell of id
    /// `i - CELL_LAG` is read and its candidate's lease line prefetched; id
    /// `i - LINE_LAG` is renewed, its cell and line by now in cache. (Taken
    /// one at a time, each id pays its two misses in series; in separate
    /// passes over a batch, the misses come in bursts that outrun the
    /// core's outstanding-miss capacity.)
    pub fn renew_all<'a>(
        &mut self,
        ids: impl IntoIterator<Item = &'a [u8]>,
        now: Instant,
    ) -> (u32, u32) {
        const CELL_LAG: usize = 8;
        const LINE_LAG: usize = 16;
        // Holds ids i - LINE_LAG ..= i: larger than LINE_LAG, a power of two.
        const RING: usize = 32;
        let mut ring: [(&[u8], u64); RING] = [(&[], 0); RING];
        let (mut renewed, mut ignored) = (0u32, 0u32);
        let mut tally = |r: Renewal| match r {
            Renewal::Unknown => ignored += 1,
            _ => renewed += 1,
        };
        let mut n = 0usize;
        for id in ids {
            let h = self.index.hash(id);
            self.index.prefetch(h);
            ring[n % RING] = (id, h);
            if n >= CELL_LAG {
                if let Some(e) = self.index.home_candidate(ring[(n - CELL_LAG) % RING].1) {
                    self.lines.prefetch(e);
                }
            }
            if n >= LINE_LAG {
                let (id, h) = ring[(n - LINE_LAG) % RING];
                tally(self.renew_hashed(id, h, now));
            }
            n += 1;
        }
        // The last LINE_LAG ids (or all of a short heartbeat).
        for k in n.saturating_sub(LINE_LAG)..n {
            let (id, h) = ring[k % RING];
            tally(self.renew_hashed(id, h, now));
        }
        (renewed, ignored)
    }

    #[inline]
    pub(super) fn renew_hashed(&mut self, id: &[u8], h: u64, now: Instant) -> Renewal {
        let found = if id.is_empty() || id.len() > self.max_len {
            None
        } else {
            self.find_hashed(id, h)
        };
        match found {
            Some(e) => self.renew_entry(e, now),
            None => {
                self.counters.renew_unknown += 1;
                Renewal::Unknown
            }
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
