//! The sender's settings and its construction errors.

use super::*;

/// Sizing and policy of one D rank's sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SenderConfig {
    /// This D instance's tensor-parallel size.
    pub local_tp: u32,
    /// This worker's rank, `0..local_tp`.
    pub local_rank: u32,
    /// Engine slots: must be at least the tracker's `max_remote_engines`.
    pub max_engines: u32,
    /// Most P ranks one engine maps this rank to (`P TP / D TP` × P's PP):
    /// `kv_lease_max_fan_out`, the same number the verifier is sized by.
    pub max_fan_out: u32,
    /// Longest peer address, in bytes.
    pub max_address_len: u32,
    /// Wait after the first failed handshake.
    pub backoff_initial: Duration,
    /// Ceiling of the doubling backoff.
    pub backoff_max: Duration,
}

impl SenderConfig {
    /// Defaults for rank `local_rank` of a D instance with TP `local_tp`:
    /// engine slots from `config.max_remote_engines`, fan-out from
    /// `config.max_fan_out` (`kv_lease_max_fan_out`, 16 by default),
    /// addresses up to 512 bytes, backoff from 250 ms doubling up to the
    /// heartbeat interval (so a recovered P is heartbeated again within one
    /// interval, well inside the lease extension).
    pub fn new(config: &LeaseConfig, local_tp: u32, local_rank: u32) -> SenderConfig {
        let initial = Duration::from_millis(250);
        SenderConfig {
            local_tp,
            local_rank,
            max_engines: config.max_remote_engines,
            max_fan_out: config.max_fan_out,
            max_address_len: 512,
            backoff_initial: initial,
            backoff_max: config.heartbeat_interval().max(initial),
        }
    }
}

/// Why a due engine was not heartbeated by this sender, or the sender could
/// not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SenderError {
    /// The TP sizes do not map (zero, not divisible) or the local rank is out
    /// of range.
    #[error("heartbeat topology: {0}")]
    Topology(TopologyError),
    /// The engine maps this rank to more P ranks than `max_fan_out`.
    #[error("engine maps this rank to {fan_out} P ranks, more than max_fan_out {max}")]
    FanOutTooLarge {
        /// P ranks this rank would heartbeat.
        fan_out: u32,
        /// The configured maximum.
        max: u32,
    },
    /// The engine's slot index is beyond `max_engines` (sender smaller than
    /// its tracker).
    #[error("engine slot {index} is beyond the sender's {max_engines} engine slots")]
    EngineOutOfRange {
        /// The tracker's slot index.
        index: u32,
        /// The sender's engine capacity.
        max_engines: u32,
    },
    /// The batch could not be encoded (the fabric's message limit is too
    /// small for even one id).
    #[error("heartbeat encoding: {0}")]
    Encode(WireError),
}
