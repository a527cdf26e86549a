//! [`HeartbeatBatch`]: one P engine and the requests to renew on it, as the
//! heartbeat sender reads it, whichever side of a process boundary it came
//! from; why it is in a step's batch ([`BatchReason`]), and one request as a
//! heartbeat needs it ([`TrackedRemote`]).
//!
//! This module owns only the shape of that view. Two types implement it:
//! the tracker's [`EngineBatch`] (borrowed from the [`HeartbeatTracker`] in
//! the same process) and the heartbeat plan's [`PlanEngine`] (borrowed from
//! the bytes the D scheduler sent to a worker in another process). The
//! sender's per-engine logic ([`HeartbeatSender::send_due`]) and the plan
//! encoder ([`crate::ipc::plan::encode`]) are written once, against this
//! trait, so the single-process path and the scheduler/worker split cannot
//! drift apart. It sits below the D roles and the plan codec, so both import
//! it downward; it imports nothing of theirs.
//!
//! The trait is sealed: the sender relies on what both implementations
//! guarantee (a live engine has at least one request, every P-side id is
//! non-empty and free of `,`, `all_leased` agrees with the members).
//!
//! [`EngineBatch`]: crate::consumer::EngineBatch
//! [`HeartbeatTracker`]: crate::consumer::HeartbeatTracker
//! [`PlanEngine`]: crate::ipc::plan::PlanEngine
//! [`HeartbeatSender::send_due`]: crate::consumer::HeartbeatSender::send_due

use crate::lease_fields::LeaseFields;
use crate::remote_engine::{EngineHandle, EngineKey};
use crate::wire::CompactEntry;

/// Why an engine is handed to the sender this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BatchReason {
    /// Its heartbeat interval has run out: every P rank of it gets this
    /// interval's heartbeat.
    Due,
    /// Not due, but a worker reported that it still owes some P rank of it a
    /// heartbeat (the rank's handshake was not ready when the engine was
    /// due): only those ranks are served, the others already have it.
    Owed,
}

/// One tracked request as a heartbeat needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrackedRemote<'t> {
    /// The id P knows the request by.
    pub remote_request_id: &'t str,
    /// Its lease slot and nonce, when P exported them.
    pub lease: Option<LeaseFields>,
}

pub(crate) mod sealed {
    /// Only the tracker's and the plan's views implement the batch trait.
    pub trait Sealed {}
}

/// One P engine and its tracked requests, as the heartbeat sender needs
/// them. See the module docs; implemented by
/// [`crate::consumer::EngineBatch`] and [`crate::ipc::plan::PlanEngine`]
/// only.
pub trait HeartbeatBatch: sealed::Sealed {
    /// The engine's handle in the tracker that planned it.
    fn handle(&self) -> EngineHandle;

    /// The engine's identity (id, host, port, P's TP size).
    fn key(&self) -> EngineKey<'_>;

    /// P's pipeline-parallel size.
    fn pp_size(&self) -> u32;

    /// P's decode-context-parallel size.
    fn dcp_size(&self) -> u32;

    /// Why the engine is in this step's batch.
    fn reason(&self) -> BatchReason;

    /// Requests in the batch (at least 1 for a planned engine).
    fn len(&self) -> usize;

    /// True when the batch holds no request (never for a planned engine).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether every request has a lease slot and nonce, so that the engine
    /// can be heartbeated in compact form.
    fn all_leased(&self) -> bool;

    /// Total bytes of the requests' P-side ids (sizes a plan in O(1)).
    fn id_bytes(&self) -> usize;

    /// Each request's P-side id and lease.
    fn remotes(&self) -> impl Iterator<Item = TrackedRemote<'_>> + Clone + '_;

    /// The P-side ids, for a text heartbeat.
    fn remote_request_ids(&self) -> impl Iterator<Item = &str> + Clone + '_;

    /// The (slot, nonce) pairs of the requests that have them, for a compact
    /// heartbeat (complete only when [`HeartbeatBatch::all_leased`]).
    fn leases(&self) -> impl Iterator<Item = CompactEntry> + Clone + '_;
}
