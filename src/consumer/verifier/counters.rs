//! What the verifier reports: why it refused a check, and its counters.

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
