//! The ranks' reports: aggregating them (a lease's blocks are freed only
//! once every rank let go), the releases handed to the engine, and the
//! slot given back only after the engine freed the blocks.

use super::*;

impl PrefillScheduler {
    /// Decodes one report message from worker `rank` (the engine knows
    /// which worker sent it) and applies every report in it. A message that
    /// does not decode, or claims another sender, changes nothing and is
    /// counted; its error is returned for the engine to log.
    pub fn apply_reports(&mut self, rank: u32, msg: &[u8]) -> Result<ReportSummary, IpcError> {
        let decoded = match ReportMsg::decode(msg) {
            Ok(m) if m.rank() == rank && rank < self.ranks => m,
            Ok(m) => {
                self.counters.report_messages_refused += 1;
                return Err(IpcError::WrongSender {
                    expected: rank,
                    found: m.rank(),
                });
            }
            Err(e) => {
                self.counters.report_messages_refused += 1;
                return Err(e);
            }
        };
        let expected = &mut self.report_seq[rank as usize];
        if *expected != u64::MAX && u64::from(decoded.seq()) != *expected {
            self.counters.report_seq_gaps += 1;
        }
        *expected = u64::from(decoded.seq().wrapping_add(1));
        let mut summary = ReportSummary::default();
        for r in decoded.iter() {
            match self.on_report(rank, r) {
                ReportOutcome::Counted => summary.counted += 1,
                ReportOutcome::Released => {
                    summary.counted += 1;
                    summary.released += 1;
                }
                _ => summary.ignored += 1,
            }
        }
        Ok(summary)
    }

    /// Applies one report of rank `rank` (in process, or from a message).
    pub fn on_report(&mut self, rank: u32, report: RankReport) -> ReportOutcome {
        if rank >= self.ranks {
            return ReportOutcome::BadRank;
        }
        let live = match self.leases.get(report.entry as usize) {
            Some(l) => {
                l.nonce == report.nonce
                    && matches!(l.status, Some(LeaseStatus::Assigned | LeaseStatus::Held))
                    && l.announced
            }
            None => false,
        };
        if !live {
            self.counters.reports_stale += 1;
            return ReportOutcome::Stale;
        }
        let e = report.entry;
        let words = self.words;
        let bits = &mut self.reported[e as usize * words..(e as usize + 1) * words];
        let (w, b) = (rank as usize / 64, rank % 64);
        if bits[w] & (1 << b) != 0 {
            self.counters.reports_duplicate += 1;
            return ReportOutcome::Duplicate;
        }
        bits[w] |= 1 << b;
        self.counters.reports_applied += 1;
        if report.reason == ReleaseReason::NotHeld {
            // Mutation check (.ci/mutants.sh): "not held" answers ignored,
            // as before the fix. Must be caught.
            if cfg!(feature = "mutant_ignore_not_held") {
                bits[w] &= !(1 << b);
                return ReportOutcome::Stale;
            }
            self.counters.reports_not_held += 1;
        }
        let lease = &mut self.leases[e as usize];
        lease.reports += 1;
        lease.reason = Some(
            lease
                .reason
                .map_or(report.reason, |r| r.combine(report.reason)),
        );
        // Mutation check (.ci/mutants.sh): blocks freed once one rank
        // reported. Must be caught.
        let all = if cfg!(feature = "mutant_free_on_first_report") {
            1
        } else {
            self.ranks
        };
        if lease.reports < all {
            if lease.reports == 1 {
                // The first let-go starts the straggler rule.
                self.note_straggler(e);
            }
            return ReportOutcome::Counted;
        }
        // Every rank let go: a pending Start or Cancel is moot.
        lease.ops = 0;
        self.pending.remove(e);
        self.finish(e);
        ReportOutcome::Released
    }

    /// Every rank is done with entry `e`: released, queued for the drain.
    pub(super) fn finish(&mut self, e: u32) {
        let lease = &mut self.leases[e as usize];
        let reason = lease.reason.unwrap_or(ReleaseReason::Cancelled);
        debug_assert!(matches!(
            lease.status,
            Some(LeaseStatus::Assigned | LeaseStatus::Held)
        ));
        lease.status = Some(LeaseStatus::Released(reason));
        self.held -= 1;
        self.disarm_backstop(e);
        match reason {
            ReleaseReason::ReadDone => self.counters.released_read += 1,
            ReleaseReason::Expired => self.counters.expired += 1,
            ReleaseReason::Cancelled => self.counters.cancelled += 1,
            ReleaseReason::NotHeld => self.counters.not_held += 1,
        }
        let queued = self.released.push(e);
        debug_assert!(queued, "release queue overflow");
    }

    /// Reports every released lease, oldest first, then forgets it (its id
    /// may be granted again). Every rank has zeroed the slot in each report.
    /// Call once per step after the reports.
    pub fn drain_released(&mut self, mut report: impl FnMut(Released<'_>)) {
        while let Some(e) = self.released.pop() {
            let lease = &mut self.leases[e as usize];
            let Some(LeaseStatus::Released(reason)) = lease.status else {
                debug_assert!(false, "queued entry {e} is not released");
                continue;
            };
            let slot = lease.slot.take();
            // Mutation check (.ci/mutants.sh): the slot goes back to the pool
            // before the engine freed the blocks. Must be caught.
            #[cfg(feature = "mutant_reuse_before_free")]
            let slot = slot.and_then(|t| {
                self.pool.give_back(t);
                None
            });
            let nonce = lease.nonce;
            lease.status = None;
            lease.announced = false;
            // Ids are stored from &str, so they are valid UTF-8.
            let request_id = core::str::from_utf8(self.ids.id(e)).unwrap_or("");
            report(Released {
                request_id,
                nonce,
                reason,
                slot,
            });
            self.ids.remove(e);
            if self.layout.slot_of(e).is_none() {
                self.unslotted.push(e);
            }
            self.live -= 1;
            self.counters.reported += 1;
        }
    }

    /// As [`PrefillScheduler::drain_released`], for an engine that frees a
    /// lease's blocks inside the callback: once `free_blocks` returns, the
    /// lease's slot goes back to the pool (counted in `slots_returned`), with
    /// no tickets to collect. The callback must not return before the blocks
    /// are really free: the next lease may be handed the slot at once.
    pub fn drain_freed(&mut self, mut free_blocks: impl FnMut(&Released<'_>)) {
        let pool = Arc::clone(&self.pool);
        let mut returned = 0u64;
        self.drain_released(|r| {
            free_blocks(&r);
            if let Some(t) = r.slot {
                pool.give_back(t);
                returned += 1;
            }
        });
        self.counters.slots_returned += returned;
    }

    /// The engine freed the blocks of a released lease: its slot may be
    /// reused. (Tickets may also go straight back to
    /// [`PrefillScheduler::slot_pool`] from another thread; then they are
    /// not counted here.)
    pub fn blocks_freed(&mut self, ticket: SlotTicket) {
        self.pool.give_back(ticket);
        self.counters.slots_returned += 1;
    }

    pub(super) fn give_entry_back(&mut self, entry: u32, slot: Option<SlotTicket>) {
        match slot {
            Some(t) => self.pool.give_back(t),
            None => self.unslotted.push(entry),
        }
    }

    pub(super) fn reported_bits_mut(&mut self, e: u32) -> &mut [u64] {
        let w = self.words;
        &mut self.reported[e as usize * w..(e as usize + 1) * w]
    }
}
