//! The scheduler's backstop: a Cancel it sends by itself for a lease that
//! some rank will otherwise never answer.
//!
//! This module owns the scheduler's one timer, [`PrefillScheduler::poll`],
//! and the two rules that arm it. It may queue Cancel directives and nothing
//! else: it never counts a rank as having let go (only a rank's own report,
//! or [`PrefillScheduler::rank_lost`], does that), so it cannot free blocks a
//! rank still holds. A Cancel is always safe: each rank zeroes its slot
//! before it reports, and D uses a load only after its slot check passed.
//! The price of a Cancel sent too early is a failed KV load, never a wrong
//! one.
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
//!  straggler: a rank let go of the lease (reported read-done, expired or
//!             not held, or was declared lost), observed at poll time t,
//!             and some rank still has not at t + kv_lease_duration ──▶ Cancel
//!  pinned:    assigned at t and never released by t + kv_lease_max_pin
//!             + kv_lease_duration (the ranks let it go at max_pin)  ──▶ Cancel
//!  held:      started with kv_lease_max_hold: not released by
//!             hold_until + kv_lease_duration                  ──▶ Cancel
//!  after each backstop Cancel: armed again at now + kv_lease_duration,
//!             in case that Cancel is lost too
//! ```
//!
//! One `kv_lease_duration` of slack is generous on purpose. Every rank sees
//! the same heartbeats, so ranks that hold a lease expire it within a
//! heartbeat interval of each other; D's workers read their P ranks in the
//! same step, so read-dones arrive together. A rank still silent a whole
//! lease later either missed the directive or lost its report. Either way
//! the Cancel is answered ("not held" from a rank that never held it), and
//! the lease is released.
//!
//! **Limit:** a started lease that *no* rank ever reports, with
//! `kv_lease_max_hold` off, is not armed: no rank's report starts the
//! straggler rule, and an unbounded lease may legitimately be renewed for as
//! long as D heartbeats. That takes the same message lost to every rank.
//!
//! # Cost
//!
//! One [`TimerWheel`] keyed by entry (O(1) arm and disarm), and a
//! [`DenseSet`] of entries whose first report arrived since the last poll
//! (reports carry no time, so the poll that follows stamps them). A poll
//! costs O(levels + leases armed or due). Nothing allocates.

use super::*;

impl PrefillScheduler {
    /// The scheduler's timer: queues a Cancel for every lease the backstop
    /// finds stuck and returns how many (see *The backstop* in the
    /// [`PrefillScheduler`] docs). Call once per step, before
    /// [`PrefillScheduler::encode_directives`]: a step with no other
    /// directive may still carry a backstop Cancel. Counted in
    /// `backstop_cancels`. Allocates nothing.
    pub fn poll(&mut self, now: Instant) -> u32 {
        // Stamp the first reports seen since the last poll.
        while let Some(e) = self.straggling.get(0) {
            self.straggling.remove(e);
            self.arm_backstop(e, now + self.duration);
        }
        let mut cancels = 0;
        while let Some(e) = self.backstop.pop_expired(now) {
            if !matches!(
                self.leases[e as usize].status,
                Some(LeaseStatus::Assigned | LeaseStatus::Held)
            ) {
                debug_assert!(false, "entry {e} on the backstop wheel but not live");
                continue;
            }
            self.counters.backstop_cancels += 1;
            cancels += 1;
            if self.cancel_entry(e) {
                // Announced: the Cancel goes out; ask again if it is lost.
                self.arm_backstop(e, now + self.duration);
            }
        }
        cancels
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

    /// A rank let go of entry `e` (its report counted, or it was lost) and
    /// the lease is still live: the next poll arms the straggler rule.
    pub(super) fn note_straggler(&mut self, e: u32) {
        self.straggling.insert(e);
    }

    /// Entry `e` is released: nothing left to back stop.
    pub(super) fn disarm_backstop(&mut self, e: u32) {
        self.backstop.cancel(e);
        self.straggling.remove(e);
    }
}
