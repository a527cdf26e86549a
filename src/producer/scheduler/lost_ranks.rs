//! Ranks whose worker process died or restarted: every lease counts as let
//! go by a lost rank, and a restarted rank is waited for again.
//!
//! This file owns [`PrefillScheduler::rank_lost`],
//! [`PrefillScheduler::rank_restarted`] and the lost-rank bits they keep.
//! Only the engine knows a worker died; the scheduler never guesses it.

use super::*;

impl PrefillScheduler {
    /// The engine lost rank `rank`: its worker process died, and its slot
    /// words with it. Every live lease counts as let go by that rank
    /// ([`ReleaseReason::NotHeld`]), whether its Grant went out or is still
    /// queued, and so does every lease granted while the rank stays lost, so
    /// the blocks the other ranks let go of are not held forever. O(entries),
    /// once per loss. A rank already lost, or out of range, is a no-op.
    ///
    /// Only for a dead process: a rank that is alive keeps nonces in its
    /// slots, and counting its leases as let go would free blocks under
    /// them. A worker that restarts calls for
    /// [`PrefillScheduler::rank_restarted`].
    pub fn rank_lost(&mut self, rank: u32) {
        if rank >= self.ranks || self.is_lost(rank) {
            return;
        }
        let (w, b) = (rank as usize / 64, rank % 64);
        self.lost[w] |= 1 << b;
        self.lost_count += 1;
        for e in 0..self.leases.len() as u32 {
            if !matches!(
                self.leases[e as usize].status,
                Some(LeaseStatus::Assigned | LeaseStatus::Held)
            ) {
                continue;
            }
            let bits = self.reported_bits_mut(e);
            if bits[w] & (1 << b) != 0 {
                continue;
            }
            bits[w] |= 1 << b;
            self.counters.lost_rank_releases += 1;
            let lease = &mut self.leases[e as usize];
            lease.reports += 1;
            lease.reason = Some(lease.reason.map_or(ReleaseReason::NotHeld, |r| {
                r.combine(ReleaseReason::NotHeld)
            }));
            if lease.reports >= self.ranks {
                lease.ops = 0;
                self.pending.remove(e);
                self.finish(e);
            } else if lease.reports == 1 {
                // The first let-go starts the straggler rule.
                self.note_straggler(e);
            }
        }
    }

    /// A fresh worker process took rank `rank`'s place (a restart): the
    /// scheduler resynchronises with it. Leases whose Grant already went out
    /// stay let go by this rank (the new process never saw them; its slots
    /// start at 0, and any later directive for them is answered "not held");
    /// leases whose Grant is still queued, and every later one, wait for it
    /// again. Its report numbering starts over. Implies
    /// [`PrefillScheduler::rank_lost`] when the loss was not declared first.
    pub fn rank_restarted(&mut self, rank: u32) {
        if rank >= self.ranks {
            return;
        }
        self.rank_lost(rank);
        let (w, b) = (rank as usize / 64, rank % 64);
        self.lost[w] &= !(1 << b);
        self.lost_count -= 1;
        self.report_seq[rank as usize] = u64::MAX;
        self.counters.ranks_restarted += 1;
        for e in 0..self.leases.len() as u32 {
            let lease = &self.leases[e as usize];
            let queued = lease.ops & OP_GRANT != 0 && !lease.announced;
            if !queued
                || !matches!(
                    lease.status,
                    Some(LeaseStatus::Assigned | LeaseStatus::Held)
                )
            {
                continue;
            }
            // The Grant has not gone out: the new process will get it.
            let bits = self.reported_bits_mut(e);
            if bits[w] & (1 << b) != 0 {
                bits[w] &= !(1 << b);
                let lease = &mut self.leases[e as usize];
                lease.reports -= 1;
                if lease.reports == 0 {
                    // Nobody let go after all: only the lease's own limit
                    // stays armed.
                    lease.reason = None;
                    let limit = lease.limit;
                    self.disarm_backstop(e);
                    self.arm_backstop(e, limit);
                }
            }
        }
    }

    /// Whether rank `rank` is declared lost (and not restarted since).
    pub fn is_lost(&self, rank: u32) -> bool {
        rank < self.ranks && self.lost[rank as usize / 64] & (1 << (rank % 64)) != 0
    }
}
