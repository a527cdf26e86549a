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
    /// No heartbeat kept it alive.
    Expired,
    /// The engine cancelled it.
    Cancelled,
}

impl ReleaseReason {
    /// The reason for the whole lease when one rank ended its share for
    /// `self` and another for `other`: a cancel wins (the engine asked), then
    /// an expiry (some rank's readers may not have finished), and only when
    /// every rank saw its readers done is the lease released by read.
    pub fn combine(self, other: ReleaseReason) -> ReleaseReason {
        use ReleaseReason::*;
        match (self, other) {
            (Cancelled, _) | (_, Cancelled) => Cancelled,
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

/// Result of one read-done notification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadDoneOutcome {
    /// The last expected reader: the lease (on a rank: this rank's share) is
    /// released.
    Released,
    /// Counted; more readers (or ranks) to go.
    Counted,
    /// No held lease with that id: dropped.
    Unknown,
    /// The nonce is an earlier lease's: dropped.
    StaleNonce,
    /// The rank is not one of the book's: dropped.
    BadRank,
}

#[cfg(test)]
mod tests {
    use super::ReleaseReason::*;

    #[test]
    fn combine_is_symmetric_with_cancel_then_expiry_winning() {
        for a in [ReadDone, Expired, Cancelled] {
            for b in [ReadDone, Expired, Cancelled] {
                assert_eq!(a.combine(b), b.combine(a));
            }
        }
        assert_eq!(ReadDone.combine(ReadDone), ReadDone);
        assert_eq!(ReadDone.combine(Expired), Expired);
        assert_eq!(Expired.combine(Cancelled), Cancelled);
    }
}
