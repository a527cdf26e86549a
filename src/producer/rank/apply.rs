//! Applying the scheduler's directives on a rank: grants write the nonce
//! into the slot in the same step, starts arm the timer, cancels release.

use super::*;

impl PrefillRank {
    pub(super) fn apply_grant(&mut self, d: &Directive<'_>, now: Instant) -> DirectiveOutcome {
        let id = d.request_id.as_bytes();
        if !self.layout.consistent(d.entry, d.slot)
            || id.is_empty()
            || id.len() > self.max_len
            || !self.lines.fits(id.len())
        {
            return DirectiveOutcome::Refused;
        }
        if let Some(head) = self.lines.head(d.entry) {
            // A head's nonce is 0 exactly when the entry is free.
            if head.nonce != 0 {
                if head.nonce == d.nonce.get() {
                    return DirectiveOutcome::Duplicate;
                }
                // The scheduler reuses an entry only after this rank reported
                // it; a held one means a lost or reordered report. Let the old
                // lease go properly (slot zeroed, reported) before the new one.
                self.counters.directive_conflicts += 1;
                self.wheel.cancel(d.entry);
                self.release(d.entry, ReleaseReason::Cancelled);
            }
        }
        let h = self.index.hash(id);
        if let Some(other) = self.index.find(h, |e| self.lines.id_is(e, id)) {
            // Same story: the id's previous lease was never reported here.
            self.counters.directive_conflicts += 1;
            self.wheel.cancel(other);
            self.release(other, ReleaseReason::Cancelled);
        }
        if self.held >= self.capacity {
            // A scheduler never has more than kv_lease_capacity leases live;
            // more can only come from a confused sender. Refusing keeps the
            // index under its load bound.
            return DirectiveOutcome::Refused;
        }
        let e = d.entry;
        // A pinned lease is timed too, by kv_lease_max_pin (on the wheel
        // only: its line's deadline is the floor renewals raise before the
        // Start arrives), so that an engine that aborts the prefill and
        // frees the blocks without cancelling does not leak the entry and
        // its slot.
        let (state, deadline, wheel_at) = match d.lease_remaining {
            Some(r) => {
                let at = (now + r).as_nanos();
                (HELD, at, at)
            }
            None => (PINNED, 0, now.as_nanos().saturating_add(self.max_pin_ns)),
        };
        // fits() and the layout check above make this infallible.
        let filled = self.lines.fill(e, id, d.nonce.get(), state, deadline);
        debug_assert!(filled);
        self.hashes[e as usize] = h;
        self.index.insert(h, e);
        self.reads[e as usize] = 0;
        self.readers[e as usize] = 0;
        self.holds[e as usize] = match d.hold_remaining {
            Some(r) => {
                self.holds_in_use = true;
                (now + r).as_nanos()
            }
            None => u64::MAX,
        };
        if let Some(slot) = d.slot {
            // Written in the step the directive arrives, before any decoder
            // can have the slot (kv_transfer_params leave P after prefill).
            self.slots.publish(slot, d.nonce.get());
        }
        self.schedule(e, wheel_at);
        self.held += 1;
        DirectiveOutcome::Applied
    }

    pub(super) fn apply_start(&mut self, d: &Directive<'_>, now: Instant) -> DirectiveOutcome {
        let Some(remaining) = d.lease_remaining else {
            return DirectiveOutcome::Refused;
        };
        let Some((line, head)) = self.lines.line_and_head_mut(d.entry) else {
            return DirectiveOutcome::Refused;
        };
        if head.nonce != d.nonce.get() || !line.is_held() {
            return DirectiveOutcome::Stale;
        }
        if line.state() == HELD {
            return DirectiveOutcome::Duplicate;
        }
        // A renewal while pinned (a heartbeat that overtook this Start) may
        // already have raised the floor; the wheel held kv_lease_max_pin.
        let deadline = head.deadline.max((now + remaining).as_nanos());
        head.deadline = deadline;
        line.set_state(HELD);
        if let Some(r) = d.hold_remaining {
            self.holds_in_use = true;
            self.holds[d.entry as usize] = (now + r).as_nanos();
        }
        // The lease may end before the pin would have: re-place it at its
        // own deadline (the wheel only catches up lazily with later ones).
        self.wheel.cancel(d.entry);
        self.schedule(d.entry, deadline);
        DirectiveOutcome::Applied
    }

    pub(super) fn apply_cancel(&mut self, d: &Directive<'_>) -> DirectiveOutcome {
        match self.lines.head(d.entry) {
            None => DirectiveOutcome::Refused,
            // A head's nonce is 0 exactly when the entry is free, and a
            // directive's never is.
            Some(head) if head.nonce != d.nonce.get() => DirectiveOutcome::Stale,
            Some(_) => {
                self.wheel.cancel(d.entry);
                self.release(d.entry, ReleaseReason::Cancelled);
                DirectiveOutcome::Applied
            }
        }
    }

    pub(super) fn schedule(&mut self, e: u32, deadline: u64) {
        let placed = self.wheel.insert(e, Instant::from_nanos(deadline));
        debug_assert!(placed.is_ok(), "entry {e} was already on the wheel");
    }

    #[inline]
    pub(super) fn find(&self, id: &[u8]) -> Option<u32> {
        if id.is_empty() || id.len() > self.max_len {
            return None;
        }
        self.find_hashed(id, self.index.hash(id))
    }

    #[inline]
    pub(super) fn find_hashed(&self, id: &[u8], h: u64) -> Option<u32> {
        self.index.find(h, |e| self.lines.id_is(e, id))
    }
}
