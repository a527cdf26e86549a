//! Letting go on a rank: read-dones, expiries, and the reports that leave
//! only after the slot was zeroed.

use super::*;

impl PrefillRank {
    /// Counts one read-done notification that this rank received from
    /// agent `sender`. `consumers` is the number of decoder ranks that read
    /// from this rank (current vLLM's `id:consumers`); this rank's share is
    /// released once that many *distinct senders* reported it: a second
    /// read-done from the same sender for the same lease is
    /// [`ShareOutcome::DuplicateSender`]. With `nonce`, a notification for
    /// an earlier lease with the same id is dropped; without one (vLLM's
    /// form) it is accepted and counted. [`ShareOutcome::ShareReleased`] is
    /// about *this rank's* share; the blocks wait for every rank.
    pub fn read_done(
        &mut self,
        sender: &[u8],
        request_id: &[u8],
        consumers: u32,
        nonce: Option<Nonce>,
    ) -> ShareOutcome {
        let Some(e) = self.find(request_id) else {
            self.counters.read_done_unknown += 1;
            return ShareOutcome::Unknown;
        };
        let held_nonce = self.lines.head(e).map_or(0, |h| h.nonce);
        match nonce {
            Some(n) if n.get() != held_nonce => {
                self.counters.read_done_stale_nonce += 1;
                return ShareOutcome::StaleNonce;
            }
            Some(_) => {}
            None => self.counters.read_done_without_nonce += 1,
        }
        let (who, evicted) = self.senders.index_of(sender);
        self.counters.senders_evicted += u64::from(evicted);
        let bit = 1u128 << who;
        // Mutation check (.ci/mutants.sh): read-dones counted per rank, as
        // before the fix. Must be caught.
        if !cfg!(feature = "mutant_count_per_rank") && self.readers[e as usize] & bit != 0 {
            self.counters.read_done_duplicate_sender += 1;
            return ShareOutcome::DuplicateSender;
        }
        self.readers[e as usize] |= bit;
        self.counters.read_done += 1;
        let cell = &mut self.reads[e as usize];
        let (expected, seen) = ((*cell >> 32) as u32, *cell as u32);
        // The first notification fixes how many this rank expects.
        let expected = if expected == 0 {
            consumers.max(1)
        } else {
            expected
        };
        let seen = seen.saturating_add(1);
        *cell = (u64::from(expected) << 32) | u64::from(seen);
        if seen < expected {
            return ShareOutcome::Counted;
        }
        self.wheel.cancel(e);
        self.release(e, ReleaseReason::ReadDone);
        ShareOutcome::ShareReleased
    }

    /// Expires every lease of this rank whose deadline is at or before `now`
    /// (a started lease's, or a pinned lease's `kv_lease_max_pin`). Call
    /// once per step. Costs O(levels + expired + re-placed): a renewed
    /// lease whose old wheel slot comes up is placed again at its deadline.
    pub fn poll(&mut self, now: Instant) {
        #[cfg(feature = "mutant_zero_after_report")]
        for slot in core::mem::take(&mut self.deferred_zero) {
            self.slots.clear(slot);
        }
        while let Some(e) = self.wheel.pop_expired(now) {
            let Some(line) = self.lines.get(e) else {
                continue;
            };
            debug_assert!(line.is_held(), "entry {e} on the wheel but not held");
            if !line.is_held() {
                continue;
            }
            if line.state() == PINNED {
                // A pinned entry is on the wheel only at its kv_lease_max_pin
                // deadline (its line holds the renewal floor, not a time).
                self.counters.pinned_expired += 1;
                self.release(e, ReleaseReason::Expired);
                continue;
            }
            let deadline = self.lines.head(e).map_or(0, |h| h.deadline);
            if deadline > now.as_nanos() {
                self.schedule(e, deadline);
                continue;
            }
            self.release(e, ReleaseReason::Expired);
        }
    }

    /// Queues a "not held" report for (entry, nonce): this rank refused the
    /// lease's Grant, or got a Start or Cancel for a lease it does not hold.
    /// Its slot is 0 for that lease (never written, or zeroed before an
    /// earlier report), so the scheduler may count it as let go.
    pub(super) fn report_not_held(&mut self, entry: u32, nonce: Nonce) {
        self.counters.not_held_reported += 1;
        self.queue_report(RankReport {
            entry,
            nonce,
            reason: ReleaseReason::NotHeld,
        });
    }

    fn queue_report(&mut self, r: RankReport) {
        if !self.reports.push(r) {
            self.counters.reports_dropped += 1;
        }
    }

    /// Ends this rank's share of entry `e`: zero the slot first, then unindex
    /// and free the entry, then queue the report (invariant 1: the slot is
    /// zeroed before the release can be reported, so before the blocks can
    /// be freed). The caller has taken `e` off the wheel.
    pub(super) fn release(&mut self, e: u32, reason: ReleaseReason) {
        let (Some(line), Some(head)) = (self.lines.get(e), self.lines.head(e)) else {
            return;
        };
        debug_assert!(line.is_held());
        let nonce = head.nonce;
        if let Some(slot) = self.layout.slot_of(e) {
            #[cfg(not(feature = "mutant_zero_after_report"))]
            self.slots.clear(slot);
            // Mutation check (.ci/mutants.sh): the slot is zeroed only at the
            // next poll, after the report may have left. Must be caught.
            #[cfg(feature = "mutant_zero_after_report")]
            self.deferred_zero.push(slot);
        }
        let h = self.hashes[e as usize];
        let hashes = &self.hashes;
        let removed = self.index.remove(h, e, |x| hashes[x as usize]);
        debug_assert!(removed, "held entry {e} was not indexed");
        self.lines.clear(e);
        self.held -= 1;
        match reason {
            ReleaseReason::ReadDone => self.counters.released_read += 1,
            ReleaseReason::Expired => self.counters.expired += 1,
            ReleaseReason::Cancelled | ReleaseReason::NotHeld => self.counters.cancelled += 1,
        }
        let Some(nonce) = Nonce::new(nonce) else {
            return;
        };
        self.queue_report(RankReport {
            entry: e,
            nonce,
            reason,
        });
    }

    /// Reports waiting to go to the scheduler.
    pub fn pending_reports(&self) -> usize {
        self.reports.len()
    }

    /// Bytes [`PrefillRank::encode_reports`] needs now.
    pub fn reports_len(&self) -> usize {
        report::encoded_len(self.reports.len() as u32)
    }

    /// Bytes a report message can take at most (every entry reported at
    /// once): size the engine's buffer with this once.
    pub fn max_reports_len(&self) -> usize {
        report::encoded_len(self.lines.len())
    }

    /// Encodes every waiting report into `buf` as this rank's next report
    /// message and forgets them; returns the message length. The engine
    /// ships it to the scheduler (vLLM: in the KV connector output). With
    /// [`IpcError::BufferTooSmall`] nothing is consumed.
    pub fn encode_reports(&mut self, buf: &mut [u8]) -> Result<usize, IpcError> {
        let n = self.reports.len();
        let reports = &self.reports;
        let len = report::encode(
            buf,
            self.rank,
            self.report_seq,
            (0..n).map(|k| reports.get(k).unwrap_or(PLACEHOLDER)),
        )?;
        self.report_seq = self.report_seq.wrapping_add(1);
        for _ in 0..n {
            self.reports.pop();
        }
        self.counters.reports_sent += n as u64;
        Ok(len)
    }

    /// Hands every waiting report to `sink` and forgets it (in-process
    /// engines: the scheduler is in the same process).
    pub fn drain_reports(&mut self, mut sink: impl FnMut(RankReport)) {
        while let Some(r) = self.reports.pop() {
            self.counters.reports_sent += 1;
            sink(r);
        }
    }
}
