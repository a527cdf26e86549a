//! The small result types every P-side role shares: why a lease ended, what
//! a renewal did, what a read-done did.
//!
//! This module owns only these enums. They cross between the rank and the
//! scheduler (a rank's [`ReleaseReason`] is in its report) and out to the
//! engine.

/// Why a lease (or one rank's share of it) ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReleaseReason {
    /// Every expected reader reported the READ done.
    ReadDone,
    /// No heartbeat kept it alive (or, not started, its prefill outlasted
    /// `kv_lease_max_pin`).
    Expired,
    /// The engine cancelled it.
    Cancelled,
    /// A rank never held it: it missed or refused the Grant (a lost
    /// directive message, a shorter id limit), or its process was lost. Its
    /// slot stayed 0 there, so no reader could verify on that rank: the
    /// lease failed closed, and the rank's report lets its blocks go.
    NotHeld,
}

impl ReleaseReason {
    /// The reason for the whole lease when one rank ended its share for
    /// `self` and another for `other`: a cancel wins (the engine asked),
    /// then a rank that never held it (the lease was broken from the start
    /// there), then an expiry (some rank's readers may not have finished),
    /// and only when every rank saw its readers done is the lease released
    /// by read.
    pub fn combine(self, other: ReleaseReason) -> ReleaseReason {
        use ReleaseReason::*;
        match (self, other) {
            (Cancelled, _) | (_, Cancelled) => Cancelled,
            (NotHeld, _) | (_, NotHeld) => NotHeld,
            (Expired, _) | (_, Expired) => Expired,
            (ReadDone, ReadDone) => ReadDone,
        }
    }
}

/// Result of a renewal.
#[must_use = "a renewal that found no lease (Unknown) or hit the max-hold ceiling (Capped) is worth logging"]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renewal {
    /// The expiry is now at least `now + extension`.
    Renewed,
    /// Renewed only up to `grant + kv_lease_max_hold`, or not at all.
    Capped,
    /// The id (or slot and nonce) is not a held lease: ignored.
    Unknown,
}

/// Result of one read-done notification on one rank
/// ([`crate::PrefillRank::read_done`]): about this rank's *share* only. The
/// blocks may be freed only when the scheduler says the whole lease is
/// released ([`ReadDoneOutcome::Released`], from a [`crate::LeaseBook`], or
/// the scheduler's drain), so this is a different type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShareOutcome {
    /// The last expected reader of this rank: this rank's share is released
    /// (its slot zeroed, its report queued). Other ranks may still hold.
    ShareReleased,
    /// Counted; more readers of this rank to go.
    Counted,
    /// No held lease with that id on this rank: dropped.
    Unknown,
    /// The nonce is an earlier lease's: dropped.
    StaleNonce,
    /// This sender's read-done for this lease was counted already: a
    /// duplicate notification, dropped (counted once per sender and lease).
    DuplicateSender,
}

/// Result of one read-done notification on a [`crate::LeaseBook`]: about
/// the whole lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadDoneOutcome {
    /// The last expected reader of the last rank: the lease is released
    /// (drain it; then the blocks may be freed).
    Released,
    /// Counted; more readers (or ranks) to go.
    Counted,
    /// No held lease with that id: dropped.
    Unknown,
    /// The nonce is an earlier lease's: dropped.
    StaleNonce,
    /// This sender's read-done for this lease was counted already: dropped.
    DuplicateSender,
    /// The rank is not one of the book's: dropped.
    BadRank,
}

impl ReadDoneOutcome {
    /// The book's view of a rank's outcome, before the scheduler had its
    /// say: a share released is only `Counted` until every rank let go.
    pub(crate) fn from_share(s: ShareOutcome) -> ReadDoneOutcome {
        match s {
            ShareOutcome::ShareReleased | ShareOutcome::Counted => ReadDoneOutcome::Counted,
            ShareOutcome::Unknown => ReadDoneOutcome::Unknown,
            ShareOutcome::StaleNonce => ReadDoneOutcome::StaleNonce,
            ShareOutcome::DuplicateSender => ReadDoneOutcome::DuplicateSender,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ReleaseReason::*;

    #[test]
    fn combine_is_symmetric_with_cancel_then_expiry_winning() {
        for a in [ReadDone, Expired, Cancelled, NotHeld] {
            for b in [ReadDone, Expired, Cancelled, NotHeld] {
                assert_eq!(a.combine(b), b.combine(a));
            }
        }
        assert_eq!(ReadDone.combine(ReadDone), ReadDone);
        assert_eq!(ReadDone.combine(Expired), Expired);
        assert_eq!(Expired.combine(NotHeld), NotHeld);
        assert_eq!(NotHeld.combine(Cancelled), Cancelled);
        assert_eq!(Expired.combine(Cancelled), Cancelled);
    }
}
