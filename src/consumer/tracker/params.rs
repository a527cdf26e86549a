//! What the tracker reads of vLLM's `kv_transfer_params`, and how it
//! refuses a request it cannot track.

use super::*;

/// The part of vLLM's `kv_transfer_params` the tracker reads, borrowed from
/// wherever the engine parsed it. Field names are vLLM's; `None` is "absent".
///
/// `remote_block_ids` and `remote_blocks_expiry_time` are not here: the
/// tracker renews leases, it does not read blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemotePrefillParams<'a> {
    /// The request's KV was prefilled remotely and must be pulled (D side).
    /// Only such requests are heartbeated.
    pub do_remote_prefill: bool,
    /// The request is prefilled here for a remote decoder (P side); ignored.
    pub do_remote_decode: bool,
    /// The P engine holding the KV.
    pub remote_engine_id: Option<&'a str>,
    /// The request's id on P: what a heartbeat names.
    pub remote_request_id: Option<&'a str>,
    /// P's handshake host.
    pub remote_host: Option<&'a str>,
    /// P's handshake port.
    pub remote_port: Option<u16>,
    /// P's tensor-parallel size.
    pub tp_size: Option<u32>,
    /// P's pipeline-parallel size (1 when absent).
    pub pp_size: Option<u32>,
    /// P's decode-context-parallel size (1 when absent).
    pub dcp_size: Option<u32>,
    /// Tokens P computed; not used by the tracker, carried for completeness.
    pub remote_num_tokens: Option<u64>,
    /// The lease slot P exported for the request (the seed's addition).
    pub remote_lease_slot: Option<u32>,
    /// The nonce P wrote into that slot, in the seed's signed int64 form (a
    /// foreign P may send a negative one; its bits are the slot word). 0 is
    /// treated as absent.
    pub remote_lease_nonce: Option<i64>,
}

impl RemotePrefillParams<'_> {
    /// `remote_lease_slot` and `remote_lease_nonce` as one value: `None`
    /// when either is absent or the nonce is 0 (no lease has it).
    pub fn lease_fields(&self) -> Option<LeaseFields> {
        LeaseFields::from_params(self.remote_lease_slot, self.remote_lease_nonce)
    }
}

/// What [`HeartbeatTracker::on_new_request`] did with a request it did not
/// refuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrackOutcome {
    /// Tracked: its engine heartbeats it from the next due step on.
    Started,
    /// `do_remote_prefill` is not set: not D's business, not tracked.
    NotRemotePrefill,
    /// `do_remote_prefill` is set but a field heartbeats need is absent
    /// (vLLM skips such requests too): not tracked, counted.
    MissingParam {
        /// The first absent field, by its vLLM name.
        field: &'static str,
    },
}

/// What is wrong with a present parameter.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParamProblem {
    /// The string is empty.
    #[error("is empty")]
    Empty,
    /// The string is longer than the limit.
    #[error("is {len} bytes, the limit is {max}")]
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The P-side id contains `,`, which a text heartbeat cannot carry.
    #[error("contains ','")]
    ContainsComma,
    /// A size is 0.
    #[error("is 0")]
    Zero,
}

/// Why a remote-prefill request was refused. The request is not
/// heartbeated; each variant bumps a [`TrackerCounters`] field.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TrackError {
    /// `max_tracked_requests` (`kv_lease_max_tracked_requests`) requests are
    /// tracked already. Counted in [`TrackerCounters::refused_requests_full`]
    /// and [`TrackerCounters::not_heartbeated`]. Degraded behaviour: the
    /// request still runs, but P frees its blocks when the initial lease
    /// runs out; if D reads later, lease verification fails the KV load
    /// (`kv_load_failure_policy` applies). Log it and raise the capacity.
    #[error("heartbeat tracker full ({capacity} requests, kv_lease_max_tracked_requests)")]
    RequestsFull {
        /// The capacity.
        capacity: u32,
    },
    /// The request names a new engine and `max_remote_engines` are tracked.
    #[error(
        "heartbeat tracker tracks {capacity} remote engines already (kv_lease_max_remote_engines)"
    )]
    EnginesFull {
        /// The capacity.
        capacity: u32,
    },
    /// A request with this D-side id is already tracked.
    #[error("request id already tracked")]
    Duplicate,
    /// A parameter (or the D-side request id) is unusable.
    #[error("{field} {problem}")]
    BadParam {
        /// The field, by its vLLM name (`request_id` for the D-side id).
        field: &'static str,
        /// What is wrong with it.
        problem: ParamProblem,
    },
}

pub(super) fn bad(field: &'static str, problem: ParamProblem) -> TrackError {
    TrackError::BadParam { field, problem }
}

pub(super) fn check_str(field: &'static str, s: &str, max: usize) -> Result<(), TrackError> {
    if s.is_empty() {
        Err(bad(field, ParamProblem::Empty))
    } else if s.len() > max {
        Err(bad(field, ParamProblem::TooLong { len: s.len(), max }))
    } else {
        Ok(())
    }
}
