//! Granting: a lease is assigned an entry, a slot and a nonce, started
//! when its prefill is done, or cancelled by the engine; each queues the
//! directive that tells the ranks.
//!
//! This file owns the scheduler's side of those three calls and what they
//! hand the engine ([`Assignment`], [`Grant`]). The only let-go it records
//! is a lost rank's, for a lease granted while that rank is lost; the
//! ranks' own let-gos are `reports.rs`'s, and losses `lost_ranks.rs`'s.

use super::*;

/// What [`PrefillScheduler::assign`] gave the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The lease's entry (directives and reports name it).
    pub entry: u32,
    /// The lease's nonce (exported only together with a slot).
    pub nonce: Nonce,
    /// `remote_lease_slot` / `remote_lease_nonce` for `kv_transfer_params`,
    /// or `None` when the lease cannot be verified (omit both fields).
    pub fields: Option<LeaseFields>,
}

impl Assignment {
    /// [`Assignment::fields`]: the same accessor as [`Grant::lease_fields`].
    pub fn lease_fields(&self) -> Option<LeaseFields> {
        self.fields
    }
}

/// What a grant gave the request: the (slot, nonce) pair in the same shape
/// as an [`Assignment`]'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// `remote_lease_slot` / `remote_lease_nonce` for `kv_transfer_params`,
    /// or `None` when the lease cannot be verified (omit both fields).
    pub fields: Option<LeaseFields>,
    /// The lease's nonce (exported only together with a slot).
    pub nonce: Nonce,
    /// When the lease expires unless renewed (the scheduler's clock).
    pub expiry: Instant,
}

impl Grant {
    /// [`Grant::fields`]: the same accessor as [`Assignment::lease_fields`].
    pub fn lease_fields(&self) -> Option<LeaseFields> {
        self.fields
    }
}

impl PrefillScheduler {
    /// Assigns `request_id` an entry, a nonce and (verification on, a slot
    /// free) a slot, and queues the Grant directive that makes every rank
    /// publish the nonce. Call when the request is first scheduled; the
    /// lease starts with [`PrefillScheduler::start`].
    pub fn assign(&mut self, request_id: &str, now: Instant) -> Result<Assignment, GrantError> {
        let id = request_id.as_bytes();
        if let Err(e) = self.ids.check(id) {
            self.counters.grant_refused_bad_id += 1;
            return Err(GrantError::BadId(e));
        }
        if let Some(e) = self.ids.get(id) {
            return Err(match self.leases[e as usize].status {
                Some(LeaseStatus::Released(_)) => {
                    self.counters.grant_refused_release_pending += 1;
                    GrantError::ReleasePending
                }
                _ => {
                    self.counters.grant_refused_duplicate += 1;
                    GrantError::Duplicate
                }
            });
        }
        if self.live >= self.capacity {
            self.counters.grant_refused_full += 1;
            return Err(GrantError::Full);
        }
        if self.lost_count == self.ranks {
            self.counters.grant_refused_no_ranks += 1;
            return Err(GrantError::NoRanks);
        }
        let slot = if self.verification {
            self.pool.take()
        } else {
            None
        };
        let entry = match &slot {
            Some(t) => t.slot(),
            None => match self.unslotted.pop() {
                Some(e) => e,
                None => {
                    // live < capacity == unslotted range: cannot happen.
                    debug_assert!(false, "unslotted range exhausted below capacity");
                    self.counters.grant_refused_full += 1;
                    return Err(GrantError::Full);
                }
            },
        };
        if let Err(e) = self.ids.insert(id, entry) {
            debug_assert!(false, "id insert failed after checks: {e}");
            self.give_entry_back(entry, slot);
            self.counters.grant_refused_bad_id += 1;
            return Err(GrantError::BadId(e));
        }
        if slot.is_none() {
            self.counters.granted_without_slot += 1;
        }
        let nonce = self.nonces.next_nonce();
        let fields = slot.as_ref().map(|t| LeaseFields {
            slot: t.slot(),
            nonce,
        });
        let lease = &mut self.leases[entry as usize];
        debug_assert!(lease.status.is_none() && lease.slot.is_none());
        *lease = Lease {
            status: Some(LeaseStatus::Assigned),
            nonce,
            expiry: Instant::MAX,
            hold_until: Instant::MAX,
            ops: OP_GRANT,
            announced: false,
            limit: now + self.max_pin + self.duration,
            reason: None,
            reports: 0,
            slot,
        };
        // Ranks that are lost count as let go from the start.
        let words = self.words;
        self.reported[entry as usize * words..(entry as usize + 1) * words]
            .copy_from_slice(&self.lost);
        if self.lost_count > 0 {
            self.counters.lost_rank_releases += u64::from(self.lost_count);
            let lease = &mut self.leases[entry as usize];
            lease.reports = self.lost_count;
            lease.reason = Some(ReleaseReason::NotHeld);
            self.note_straggler(entry);
        }
        self.pending.insert(entry);
        self.arm_backstop(entry, self.leases[entry as usize].limit);
        self.live += 1;
        self.held += 1;
        self.counters.granted += 1;
        Ok(Assignment {
            entry,
            nonce,
            fields,
        })
    }

    /// Starts the lease of an assigned request (its prefill completed):
    /// expiry = `now + kv_lease_duration`; queues the Start directive.
    pub fn start(&mut self, request_id: &str, now: Instant) -> Result<Instant, StartError> {
        let Some(e) = self.ids.get(request_id.as_bytes()) else {
            return Err(StartError::Unknown);
        };
        let lease = &mut self.leases[e as usize];
        match lease.status {
            Some(LeaseStatus::Assigned) => {}
            Some(LeaseStatus::Held) => return Err(StartError::AlreadyStarted),
            Some(LeaseStatus::Released(_)) => return Err(StartError::Released),
            None => return Err(StartError::Unknown),
        }
        lease.status = Some(LeaseStatus::Held);
        lease.expiry = now + self.duration;
        lease.hold_until = self.max_hold.map_or(Instant::MAX, |h| now + h);
        lease.ops |= OP_START;
        // The pinned rule is over: a started lease lives as long as D
        // heartbeats it, up to kv_lease_max_hold.
        lease.limit = lease.hold_until + self.duration;
        let (expiry, limit, let_go) = (lease.expiry, lease.limit, lease.reports > 0);
        self.pending.insert(e);
        self.backstop.cancel(e);
        self.arm_backstop(e, limit);
        if let_go {
            self.note_straggler(e);
        }
        Ok(expiry)
    }

    /// Assigns and starts a lease in one step (its prefill already ran):
    /// one Grant directive that starts the lease on every rank.
    pub fn grant(&mut self, request_id: &str, now: Instant) -> Result<Grant, GrantError> {
        let a = self.assign(request_id, now)?;
        let expiry = match self.start(request_id, now) {
            Ok(x) => x,
            Err(e) => {
                debug_assert!(false, "start right after assign failed: {e}");
                now + self.duration
            }
        };
        Ok(Grant {
            fields: a.fields,
            nonce: a.nonce,
            expiry,
        })
    }

    /// Releases the lease of `request_id` (aborted on P, engine shutdown):
    /// a Cancel directive for the ranks, or, when no rank has heard of the
    /// lease yet, released at once. Returns whether a live, unreleased lease
    /// was found.
    pub fn cancel(&mut self, request_id: &str) -> bool {
        let Some(e) = self.ids.get(request_id.as_bytes()) else {
            return false;
        };
        match self.leases[e as usize].status {
            Some(LeaseStatus::Assigned | LeaseStatus::Held) => {}
            _ => return false,
        }
        self.cancel_entry(e);
        true
    }

    /// Cancels live entry `e`: queues a Cancel directive and returns true,
    /// or, when no rank has heard of the lease, releases it at once and
    /// returns false.
    pub(super) fn cancel_entry(&mut self, e: u32) -> bool {
        let lease = &mut self.leases[e as usize];
        if lease.announced {
            lease.ops |= OP_CANCEL;
            self.pending.insert(e);
            true
        } else {
            // No rank wrote the nonce: nothing to zero, nobody to wait for.
            lease.ops = 0;
            lease.reason = Some(ReleaseReason::Cancelled);
            self.pending.remove(e);
            self.finish(e);
            false
        }
    }
}
