//! The decode side (D): keeping P's leases alive while D waits for the KV.
//!
//! This module owns what D does about leases: the scheduler-side
//! [`HeartbeatTracker`] (which requests to renew, grouped by P engine, and
//! when each engine is due) and the worker-side [`HeartbeatSender`] (turning
//! a due engine into one batched notification to every P rank this D rank
//! reads from, handshaking first when needed). It does not decide what the
//! bytes look like ([`crate::wire`]), which P ranks a D rank maps to
//! ([`crate::topology`]), or how messages travel ([`crate::fabric`]).
//!
//! # A D step
//!
//! ```text
//! request arrives (do_remote_prefill)   tracker.on_new_request(id, &params, now)
//! each engine step                      sender.step(&mut tracker, now)
//!                                         = tracker.due(now, ...) -> send_batch
//!                                         + retry deferred sends (handshakes)
//! KV transfer complete                  tracker.on_transfer_complete(id)
//! request finished / aborted            tracker.on_request_finished(id)
//! ```
//!
//! Both halves are fixed-capacity and allocation-free after construction
//! (`tests/consumer_alloc.rs` proves it with a counting allocator).

pub(crate) mod batch;
mod id_arena;
mod sender;
mod tracker;
mod verifier;

pub use batch::{BatchReason, HeartbeatBatch};
pub use sender::{
    DefaultPeerAddress, HeartbeatSender, OwedEngines, PeerAddress, PeerStatus, PortPerRankAddress,
    SenderConfig, SenderCounters, SenderError, StepError, StepReport, MAX_MESSAGE_LEN,
};
pub use tracker::{
    ApplyReport, EngineBatch, EngineHandle, EngineKey, HeartbeatTracker, ParamProblem,
    RemotePrefillParams, TrackError, TrackOutcome, TrackedRemote, TrackerCounters, INLINE_ID_LEN,
    MAX_HOST_LEN,
};
pub use verifier::{
    LeaseVerifier, Verdict, VerifierCounters, VerifyError, VerifyTarget, MAX_TARGETS, WINDOW_SLOTS,
};
