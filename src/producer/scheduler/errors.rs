//! Why the scheduler refused a grant, a start, or its construction.

use super::*;

/// Why a grant was refused. The request is not leased; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GrantError {
    /// `kv_lease_capacity` leases are live (released, undrained ones included).
    #[error("lease capacity reached (kv_lease_capacity)")]
    Full,
    /// The request id is empty or longer than `kv_lease_max_request_id_len`.
    #[error("bad request id: {0}")]
    BadId(IdError),
    /// A lease with this id is live.
    #[error("request id already leased")]
    Duplicate,
    /// This id's previous lease is released but not drained: call
    /// `drain_released` first.
    #[error("the request id's previous lease is released but not drained yet; drain first")]
    ReleasePending,
    /// Every rank of the engine is lost (`rank_lost`): no rank can hold a
    /// lease. Free the blocks and answer without remote-decode params.
    #[error("every P rank is lost: nothing can hold a lease")]
    NoRanks,
}

/// Why [`PrefillScheduler::start`] refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// No live lease with this id.
    #[error("no lease with this request id")]
    Unknown,
    /// Already started.
    #[error("lease already started")]
    AlreadyStarted,
    /// Released (cancelled or reported by every rank) before it started.
    #[error("lease released before it started")]
    Released,
}

/// Why a scheduler could not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulerError {
    /// Zero ranks, or more than [`MAX_RANKS`].
    #[error("a scheduler needs 1..={max} ranks, got {0}", max = MAX_RANKS)]
    BadRankCount(u32),
    /// The slot pool does not hand out exactly `kv_lease_slots` slots.
    #[error("the slot pool hands out {pool} slots but kv_lease_slots is {slots}")]
    PoolMismatch {
        /// The pool's capacity.
        pool: u32,
        /// `kv_lease_slots`.
        slots: u32,
    },
}
