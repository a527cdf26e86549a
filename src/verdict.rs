//! [`Verdict`]: what D's post-READ lease check concluded about one
//! request's KV.
//!
//! This module owns only the verdict and its ordering. The verifier reaches
//! it ([`crate::consumer::LeaseVerifier`]), the worker ships it to its
//! scheduler ([`crate::ipc::outcome`]) and the tracker turns it into
//! received or failed ([`crate::consumer::HeartbeatTracker::apply_outcomes`]).
//! It sits below all three, so each imports it downward; it imports only the
//! fabric's error, which a failed slot READ carries.

use core::fmt;

use crate::fabric::FabricError;

/// What the check found. Only [`Verdict::Verified`] may be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// Every slot still held the nonce: the pulled KV is the request's own.
    Verified,
    /// A slot no longer held the nonce: the lease lapsed before the READ
    /// finished. Fail the load (`kv_load_failure_policy`).
    Lapsed,
    /// The request carried no lease fields (a router dropped them, or P had
    /// no free slot). Fail the load.
    Unverifiable,
    /// The request's `remote_lease_slot` is not below the slot count some P
    /// rank advertised: it names no slot there, so nothing can be verified.
    /// Fail the load. (Only this check fails: see the module docs.)
    SlotOutOfRange,
    /// The slot READ failed. Fail the load.
    ReadFailed(FabricError),
    /// Verification is off (`kv_lease_verification = false`): the load is
    /// accepted without the slot check, as stock vLLM accepts it. Counted
    /// apart from verified loads.
    Unchecked,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Verified => f.write_str("lease verified"),
            Verdict::Lapsed => f.write_str("lease lapsed before the READ finished"),
            Verdict::Unverifiable => f.write_str("no lease fields: KV cannot be verified"),
            Verdict::SlotOutOfRange => {
                f.write_str("remote_lease_slot beyond the slots P exports: KV cannot be verified")
            }
            Verdict::ReadFailed(e) => write!(f, "lease slot READ failed: {e}"),
            Verdict::Unchecked => f.write_str("accepted without a lease check (verification off)"),
        }
    }
}

impl Verdict {
    /// True only for [`Verdict::Verified`].
    pub fn is_verified(self) -> bool {
        self == Verdict::Verified
    }

    /// Whether the engine may use the pulled KV: [`Verdict::Verified`], or
    /// [`Verdict::Unchecked`] when verification is off. Everything else
    /// fails the load (`kv_load_failure_policy`).
    pub fn is_usable(self) -> bool {
        matches!(self, Verdict::Verified | Verdict::Unchecked)
    }

    /// When several ranks disagree, the worst verdict wins.
    pub(crate) fn worse(self, other: Verdict) -> Verdict {
        fn rank(v: Verdict) -> u8 {
            match v {
                Verdict::Verified | Verdict::Unchecked => 0,
                Verdict::Unverifiable => 1,
                Verdict::SlotOutOfRange => 2,
                Verdict::ReadFailed(_) => 3,
                Verdict::Lapsed => 4,
            }
        }
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }
}
