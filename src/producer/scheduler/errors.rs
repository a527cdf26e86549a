//! Why the scheduler refused a grant, a start, or its construction.

use super::*;

/// Why a grant was refused. The request is not leased; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GrantError {
    /// `kv_lease_capacity` leases are live (released, undrained ones included).
    Full,
    /// The request id is empty or longer than `kv_lease_max_request_id_len`.
    BadId(IdError),
    /// A lease with this id is live.
    Duplicate,
    /// This id's previous lease is released but not drained: call
    /// `drain_released` first.
    ReleasePending,
}

impl fmt::Display for GrantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GrantError::Full => f.write_str("lease capacity reached (kv_lease_capacity)"),
            GrantError::BadId(e) => write!(f, "bad request id: {e}"),
            GrantError::Duplicate => f.write_str("request id already leased"),
            GrantError::ReleasePending => f.write_str(
                "the request id's previous lease is released but not drained yet; drain first",
            ),
        }
    }
}

impl std::error::Error for GrantError {}

/// Why [`PrefillScheduler::start`] refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StartError {
    /// No live lease with this id.
    Unknown,
    /// Already started.
    AlreadyStarted,
    /// Released (cancelled or reported by every rank) before it started.
    Released,
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StartError::Unknown => "no lease with this request id",
            StartError::AlreadyStarted => "lease already started",
            StartError::Released => "lease released before it started",
        })
    }
}

impl std::error::Error for StartError {}

/// Why a scheduler could not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchedulerError {
    /// Zero ranks, or more than [`MAX_RANKS`].
    BadRankCount(u32),
    /// The slot pool does not hand out exactly `kv_lease_slots` slots.
    PoolMismatch {
        /// The pool's capacity.
        pool: u32,
        /// `kv_lease_slots`.
        slots: u32,
    },
}

impl fmt::Display for SchedulerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SchedulerError::BadRankCount(n) => {
                write!(f, "a scheduler needs 1..={MAX_RANKS} ranks, got {n}")
            }
            SchedulerError::PoolMismatch { pool, slots } => write!(
                f,
                "the slot pool hands out {pool} slots but kv_lease_slots is {slots}"
            ),
        }
    }
}

impl std::error::Error for SchedulerError {}
