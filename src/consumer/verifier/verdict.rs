//! What a check concludes ([`Verdict`]), a target to check against, and
//! the verifier's errors and counters.

use super::*;

/// One P rank a request's blocks were read from. Build it with
/// [`VerifyTarget::new`] or [`VerifyTarget::from_peer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifyTarget {
    /// The P agent (rank) read from.
    pub agent: AgentId,
    /// That agent's lease-slot region ([`PeerInfo::slot_region`]).
    pub slot_region: RegionId,
    /// Lease slots that agent exports ([`PeerInfo::slot_count`]): a
    /// `remote_lease_slot` at or beyond it is [`Verdict::SlotOutOfRange`].
    pub slot_count: u32,
}

impl VerifyTarget {
    /// The target `agent`, whose lease slots are `slot_count` words in
    /// region `slot_region` (what its handshake advertised).
    pub const fn new(agent: AgentId, slot_region: RegionId, slot_count: u32) -> VerifyTarget {
        VerifyTarget {
            agent,
            slot_region,
            slot_count,
        }
    }

    /// The target a completed handshake describes: `agent` with the slot
    /// region and count it advertised. `None` when the peer exports no lease
    /// slots (a P started without `kv_lease_verification`): its KV cannot be
    /// verified, so submit the check without lease fields, which fails it
    /// as [`Verdict::Unverifiable`].
    ///
    /// ```
    /// use kvlease::consumer::VerifyTarget;
    /// use kvlease::fabric::{AgentId, PeerInfo, RegionId};
    ///
    /// let info = PeerInfo {
    ///     slot_region: Some(RegionId(0)),
    ///     slot_count: 4096,
    ///     compact_heartbeats: true,
    ///     clock: None,
    /// };
    /// let t = VerifyTarget::from_peer(AgentId(3), &info).unwrap();
    /// assert_eq!((t.agent, t.slot_region, t.slot_count), (AgentId(3), RegionId(0), 4096));
    /// assert!(VerifyTarget::from_peer(AgentId(3), &PeerInfo { slot_region: None, ..info }).is_none());
    /// ```
    pub fn from_peer(agent: AgentId, info: &PeerInfo) -> Option<VerifyTarget> {
        Some(VerifyTarget {
            agent,
            slot_region: info.slot_region?,
            slot_count: info.slot_count,
        })
    }
}

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
    pub(super) fn worse(self, other: Verdict) -> Verdict {
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

/// Why a check was refused. The caller must fail the KV load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// `capacity` checks are waiting.
    #[error("lease verifier full")]
    Full,
    /// No target, or more than `kv_lease_max_fan_out`.
    #[error("a check names {targets} P ranks; it needs 1..={max_fan_out} (kv_lease_max_fan_out)")]
    BadTargets {
        /// Targets the check named.
        targets: u32,
        /// The verifier's fan-out limit.
        max_fan_out: u32,
    },
    /// More distinct P agents than `max_agents` have checks waiting.
    #[error("too many distinct P agents with checks waiting")]
    TooManyAgents,
}

/// Event counts since construction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifierCounters {
    /// Checks accepted.
    pub submitted: u64,
    /// Checks refused (full, bad targets, too many agents).
    pub refused: u64,
    /// Verdicts: verified.
    pub verified: u64,
    /// Verdicts: lapsed.
    pub lapsed: u64,
    /// Verdicts: unverifiable.
    pub unverifiable: u64,
    /// Verdicts: slot out of range (no READ was posted for them).
    pub slot_out_of_range: u64,
    /// Verdicts: slot READ failed.
    pub read_failed: u64,
    /// Verdicts: accepted unchecked (verification off).
    pub unchecked: u64,
    /// Slot READs posted (one per agent per batch).
    pub slot_reads: u64,
    /// Of those, READs of one contiguous span (one descriptor).
    pub coalesced_reads: u64,
}
