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
    /// entry, so this is one cache line, and only the lease holding that
    /// nonce is renewed.
    #[inline]
    pub fn renew_slot(&mut self, slot: u32, nonce: Nonce, now: Instant) -> Renewal {
        let held = match self.layout.slot_of(slot).and_then(|e| self.lines.get(e)) {
            Some(line) if line.is_held() => line.nonce,
            _ => {
                self.counters.renew_unknown += 1;
                return Renewal::Unknown;
            }
        };
        if held != nonce.get() {
            self.counters.renew_nonce_mismatch += 1;
            return Renewal::Unknown;
        }
        self.renew_entry(slot, now)
    }

    /// Renews every (slot, nonce) of a compact heartbeat, as
    /// [`PrefillRank::renew_slot`] would one by one; returns (renewed,
    /// ignored). Batched like [`PrefillRank::renew_all`].
    pub fn renew_slots_all(
        &mut self,
        entries: impl IntoIterator<Item = (u32, Nonce)>,
        now: Instant,
    ) -> (u32, u32) {
        const BATCH: usize = 64;
        let mut batch = [(0u32, Nonce::ONE); BATCH];
        let (mut renewed, mut ignored) = (0u32, 0u32);
        let mut entries = entries.into_iter();
        loop {
            let mut n = 0;
            for e in entries.by_ref().take(BATCH) {
                self.lines.prefetch(e.0);
                batch[n] = e;
                n += 1;
            }
            if n == 0 {
                return (renewed, ignored);
            }
            for &(slot, nonce) in &batch[..n] {
                match self.renew_slot(slot, nonce, now) {
                    Renewal::Unknown => ignored += 1,
                    _ => renewed += 1,
                }
            }
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
        if let Some(line) = self.lines.get_mut(e) {
            // Never shortens; the wheel catches up lazily at poll time.
            line.deadline = line.deadline.max(target);
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
