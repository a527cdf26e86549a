//! The small result types the P-side roles hand to the engine: what a
//! renewal did, what a read-done did.
//!
//! This module owns only these enums. Why a lease ended, which also crosses
//! between the rank and the scheduler in a report, is
//! [`ReleaseReason`](crate::ReleaseReason), below the roles and the role
//! messages (`src/release_reason.rs`).

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
