//! The harness's model of the scheduler's backstop
//! ([`PrefillScheduler::poll`], `src/producer/scheduler/backstop.rs`): each
//! engine step polls the real scheduler first, and the model predicts which
//! leases it probes (their Start again) or cancels.
//!
//! The model keeps, per live lease, its limit (`kv_lease_max_pin` or
//! `kv_lease_max_hold`, plus a `kv_lease_duration`), the deadline its timer
//! is armed for, and whether a first let-go waits for the next poll to be
//! stamped. The rules, mirrored from the scheduler's docs:
//!
//! ```text
//!  assign at t        arm t + max_pin + duration (the limit)
//!  start at t         disarm; the limit is hold_until + duration; arm it;
//!                     a lease some rank already let go of is a straggler
//!  first let-go       a straggler: the next poll arms min(now + duration, limit)
//!  released           disarmed
//!  poll, fired:       now >= limit: Cancel (announced: re-armed now + duration;
//!                                   not announced: released at once)
//!                     started: its Start again if announced; re-armed
//!                              min(now + duration, limit)
//!                     assigned: re-armed at its limit
//! ```
//!
//! A timer fires no earlier than its deadline and at the first poll at
//! least one wheel tick after it at the latest (after the time it was
//! armed, when that was later: a deadline armed in the past fires a tick
//! on, never in the poll that armed it). Inside that window the
//! model asks the scheduler whether it fired (its deadline is gone or
//! moved), and checks the rest: what fired, what it queued, the counters,
//! and after every operation each lease's armed deadline.

use super::*;

impl ModelLease {
    /// Arms (or brings forward) the backstop at `at`, at time `now`; never
    /// delays it.
    pub(super) fn arm(&mut self, at: Instant, now: Instant) {
        if at == Instant::MAX {
            return;
        }
        match self.backstop {
            Some(d) if d <= at => {}
            _ => {
                self.backstop = Some(at);
                self.armed_at = now;
            }
        }
    }

    /// Ranks whose let-go reached the scheduler.
    pub(super) fn let_gos(&self) -> usize {
        self.reported.iter().filter(|r| **r).count()
    }
}

impl RolesHarness {
    /// The scheduler's backstop at the start of an engine step, on the
    /// roles and on the model.
    pub(super) fn poll(&mut self) {
        let (now, duration) = (self.now, self.config.lease_duration());
        let tick = self.config.wheel_tick();
        // Stamp the let-gos seen since the last poll.
        for l in self.model.values_mut() {
            if l.reason.is_none() && l.straggling {
                l.straggling = false;
                let at = (now + duration).min(l.limit);
                l.arm(at, now);
            }
        }
        let before = self.scheduler.counters();
        let queued = self.scheduler.poll(now);
        let after = self.scheduler.counters();
        let (mut probes, mut cancels) = (0u32, 0u32);
        let ids: Vec<usize> = self.model.keys().copied().collect();
        for id in ids {
            let armed = self.scheduler.backstop_deadline(&self.ids[id]);
            let Some(l) = self.model.get_mut(&id) else {
                continue;
            };
            let Some(deadline) = l.backstop.filter(|_| l.reason.is_none()) else {
                continue;
            };
            if deadline > now {
                continue;
            }
            // A deadline armed when it had already passed fires a tick after
            // it was armed (the wheel places it at the next tick), so the
            // latest firing is a tick after the later of the two.
            let fired = if now >= deadline.max(l.armed_at) + tick {
                true
            } else {
                // Inside that tick: it fired if its deadline is gone or moved
                // (a re-armed deadline lies after `now`, a fired one never
                // stays where it was).
                armed != Some(deadline)
            };
            if !fired {
                continue;
            }
            l.backstop = None;
            let announced = !l.grant_pending;
            if now >= l.limit {
                cancels += 1;
                if announced {
                    l.cancel_pending = true;
                    l.arm(now + duration, now);
                } else {
                    // No rank heard of it: released at once.
                    l.grant_pending = false;
                    l.start_pending = false;
                    l.reason = Some(ReleaseReason::Cancelled);
                    self.released
                        .push((id, ReleaseReason::Cancelled, l.slot, l.nonce));
                }
            } else if l.started.is_some() {
                // (Its Grant+Start still queued asks every rank by itself.)
                if announced {
                    probes += 1;
                    l.start_pending = true;
                }
                let at = (now + duration).min(l.limit);
                l.arm(at, now);
            } else {
                let limit = l.limit;
                l.arm(limit, now);
            }
        }
        assert_eq!(
            (
                after.backstop_probes - before.backstop_probes,
                after.backstop_cancels - before.backstop_cancels,
            ),
            (u64::from(probes), u64::from(cancels)),
            "backstop at {now:?}: (probes, cancels)"
        );
        assert_eq!(queued, probes + cancels, "directives the backstop queued");
    }
}
