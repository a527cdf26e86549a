//! The scheduler's backstop: directives it sends by itself for a lease
//! that some rank would otherwise never answer.
//!
//! This module owns the scheduler's one timer, [`PrefillScheduler::poll`],
//! and the rules that arm it. It may queue directives and nothing else: it
//! never counts a rank as having let go (only a rank's own report, or
//! [`PrefillScheduler::rank_lost`], does that), so it cannot free blocks a
//! rank still holds.
//!
//! # Why a lease can need it
//!
//! A lease whose one Grant+Start message ([`PrefillScheduler::grant`]) was
//! lost on the engine's IPC to one rank is never answered by that rank: it
//! has no timer for a lease it never heard of, and the other ranks' expiry
//! does not reach it. Before this module the blocks stayed held until the
//! engine happened to cancel the request.
//!
//! # The rules
//!
//! ```text
//!  straggler: a rank let go of a started lease (reported read-done, expired
//!             or not held, or was declared lost), observed at poll time t,
//!             and some rank has not at t + kv_lease_duration
//!               ──▶ its Start again (a probe), again every kv_lease_duration
//!  pinned:    assigned at t, not released by t + kv_lease_max_pin
//!             + kv_lease_duration (the ranks let it go at max_pin) ──▶ Cancel
//!  held:      started with kv_lease_max_hold, not released by
//!             hold_until + kv_lease_duration (every rank capped it) ──▶ Cancel
//! ```
//!
//! **The probe changes nothing on a rank that holds the lease.** A rank
//! that has it started takes the repeated Start for a duplicate; a rank
//! that has it pinned (it missed the Start alone) starts it, as the
//! scheduler meant; a rank that does not hold it (it missed the Grant, or
//! let go and its report was lost) answers "not held". So a healthy lease
//! whose readers finish far apart, or a lease whose other ranks D keeps
//! heartbeating after one rank stopped hearing it, is never freed early,
//! and a decoder that reads without verification never reads freed
//! blocks because of it. The two limit rules Cancel, because by then every
//! rank that held the lease let go of it by its own rule.
//!
//! One `kv_lease_duration` of slack is generous on purpose: every rank sees
//! the same heartbeats and D's workers read their P ranks in the same step,
//! so ranks that hold a lease let go of it close together. A rank still
//! silent a whole lease later most likely missed a directive or lost a
//! report; the probe costs one directive if it did not.
//!
//! **Limit:** a started lease that *no* rank ever reports (the same message
//! lost to every rank), with `kv_lease_max_hold` off, is not armed: no
//! rank's report starts the straggler rule, and an unbounded lease may
//! legitimately be renewed for as long as D heartbeats.
//!
//! # Cost
//!
//! One [`TimerWheel`] keyed by entry (O(1) arm and disarm), and a
//! [`DenseSet`] of entries whose first let-go arrived since the last poll
//! (reports carry no time, so the poll that follows stamps them). A poll
//! costs O(levels + leases armed or due). Nothing allocates.

use super::*;

impl PrefillScheduler {
    /// The scheduler's timer: queues the backstop's directives (a probe, or
    /// a Cancel past a limit; see *The backstop* in the [`PrefillScheduler`]
    /// docs) and returns how many. Call once per step, before
    /// [`PrefillScheduler::encode_directives`]: a step with no other
    /// directive may still carry one. Counted in `backstop_probes` and
    /// `backstop_cancels`. Allocates nothing.
    pub fn poll(&mut self, now: Instant) -> u32 {
        // Stamp the let-gos seen since the last poll.
        while let Some(e) = self.straggling.get(0) {
            self.straggling.remove(e);
            let at = (now + self.duration).min(self.leases[e as usize].limit);
            self.arm_backstop(e, at);
        }
        let mut queued = 0;
        while let Some(e) = self.backstop.pop_expired(now) {
            let lease = &self.leases[e as usize];
            let (status, limit, announced) = (lease.status, lease.limit, lease.announced);
            match status {
                Some(LeaseStatus::Assigned | LeaseStatus::Held) => {}
                _ => {
                    debug_assert!(false, "entry {e} on the backstop wheel but not live");
                    continue;
                }
            }
            if now >= limit {
                // Every rank that held it let go by its own rule by now.
                self.counters.backstop_cancels += 1;
                queued += 1;
                if self.cancel_entry(e) {
                    // Ask again if this Cancel is lost too.
                    self.arm_backstop(e, now + self.duration);
                }
            } else if status == Some(LeaseStatus::Held) {
                // (Its Grant+Start still queued asks every rank by itself.)
                if announced {
                    self.counters.backstop_probes += 1;
                    queued += 1;
                    self.probe_entry(e);
                }
                self.arm_backstop(e, (now + self.duration).min(limit));
            } else {
                // Not started: its Start will ask every rank, and only its
                // limit stays armed.
                self.arm_backstop(e, limit);
            }
        }
        queued
    }

    /// Asks every rank about the started lease of `request_id` again: its
    /// Start goes out once more. A rank that holds the lease takes it for a
    /// duplicate (or starts it, if it missed the Start alone); a rank that
    /// does not hold it answers "not held". Returns whether a started lease
    /// whose Grant went out was found. The backstop does this by itself a
    /// `kv_lease_duration` after a rank let go; call it sooner when the
    /// engine knows a directive message was lost.
    pub fn probe(&mut self, request_id: &str) -> bool {
        let Some(e) = self.ids.get(request_id.as_bytes()) else {
            return false;
        };
        let lease = &self.leases[e as usize];
        if lease.status != Some(LeaseStatus::Held) || !lease.announced {
            return false;
        }
        self.probe_entry(e);
        true
    }

    fn probe_entry(&mut self, e: u32) {
        self.leases[e as usize].ops |= OP_START;
        self.pending.insert(e);
    }

    /// When the backstop next fires for `request_id`'s lease, if armed.
    pub fn backstop_deadline(&self, request_id: &str) -> Option<Instant> {
        let e = self.ids.get(request_id.as_bytes())?;
        self.backstop.deadline(e)
    }

    /// Arms (or brings forward) entry `e`'s backstop to `at`. Never delays
    /// one already armed earlier.
    pub(super) fn arm_backstop(&mut self, e: u32, at: Instant) {
        if at == Instant::MAX {
            return;
        }
        match self.backstop.deadline(e) {
            Some(d) if d <= at => {}
            armed => {
                if armed.is_some() {
                    self.backstop.cancel(e);
                }
                let placed = self.backstop.insert(e, at);
                debug_assert!(placed.is_ok(), "backstop wheel refused entry {e}");
            }
        }
    }

    /// The first rank let go of entry `e` (its report counted, or it was
    /// lost) and the lease is still live: the next poll arms the straggler
    /// rule. Later let-gos need nothing: arming never delays a deadline.
    pub(super) fn note_straggler(&mut self, e: u32) {
        self.straggling.insert(e);
    }

    /// Entry `e` is released: nothing left to back stop.
    pub(super) fn disarm_backstop(&mut self, e: u32) {
        self.backstop.cancel(e);
        self.straggling.remove(e);
    }
}
