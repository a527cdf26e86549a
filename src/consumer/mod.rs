//! The decode side (D): keeping P's leases alive while D waits for the KV,
//! and checking, after the READ, that P still held it.
//!
//! This module owns what D does about leases: the scheduler-side
//! [`HeartbeatTracker`] (which requests to renew, grouped by P engine, and
//! when each engine is due; which requests' KV every worker verified), the
//! worker-side [`HeartbeatSender`] (turning a planned engine into one batched
//! notification to every P rank this D rank reads from, handshaking first
//! when needed) and the worker-side [`LeaseVerifier`] (the post-READ slot
//! check). It does not decide what the bytes look like ([`crate::wire`] for
//! notifications, [`crate::ipc`] for the scheduler/worker messages), which P
//! ranks a D rank maps to ([`crate::topology`]), or how messages travel
//! ([`crate::fabric`]).
//!
//! # Scheduler and workers
//!
//! vLLM runs one scheduler process per engine and one worker process per
//! GPU, each worker with its own NIXL agent. The D side splits the same way,
//! and the halves exchange two messages the engine carries over its own IPC
//! (inside the connector metadata and the connector output):
//!
//! ```text
//!  D scheduler                                      D worker r (one per TP rank)
//!  request arrives      tracker.on_new_request
//!  each step            tracker.encode_plan  --plan-->  HeartbeatPlan::decode
//!                                                       sender.send_plan      HB:/HBC: to its P ranks
//!                                                       verifier.step         slot READs, verdicts
//!                       tracker.apply_outcomes <--outcomes-- outcome::encode(verdicts, sender.owed_engines())
//!                         verified by every worker: received (tracking stops)
//!                         anything else: load failed (tracking stops, kv_load_failure_policy)
//!  request finished     tracker.on_request_finished
//! ```
//!
//! A heartbeat a worker could not send (the P rank's handshake was not
//! ready) travels back as an owed engine and comes again in the next plan;
//! see the tracker's and the sender's docs. An engine with the scheduler and
//! its only worker in one process runs the same loop without the bytes:
//! [`HeartbeatSender::step`] (and [`HeartbeatTracker::on_transfer_complete`]
//! once its verifier says so).
//!
//! ```
//! use kvlease::consumer::{
//!     DefaultPeerAddress, HeartbeatSender, HeartbeatTracker, RemotePrefillParams, SenderConfig,
//!     Verdict,
//! };
//! use kvlease::fabric::loopback::{LoopbackConfig, LoopbackFabric, LoopbackNetwork};
//! use kvlease::ipc::outcome::{self, Outcome, OutcomeMsg};
//! use kvlease::ipc::plan::HeartbeatPlan;
//! use kvlease::{EngineShape, Instant, LeaseConfig};
//!
//! let config = LeaseConfig::new(EngineShape { num_kv_blocks: 4096, max_num_seqs: 256 });
//! let now = Instant::from_secs(1);
//!
//! // D scheduler: a request with do_remote_prefill arrives (before it is scheduled).
//! let mut tracker = HeartbeatTracker::new(&config, 1).expect("tracker");
//! let params = RemotePrefillParams {
//!     do_remote_prefill: true,
//!     remote_engine_id: Some("prefill-0"),
//!     remote_request_id: Some("cmpl-p-1"),
//!     remote_host: Some("10.0.0.7"),
//!     remote_port: Some(5600),
//!     tp_size: Some(1),
//!     remote_lease_slot: Some(12),
//!     remote_lease_nonce: Some(0x5eed),
//!     ..Default::default()
//! };
//! tracker.on_new_request("cmpl-d-1", &params, now)?;
//! // Each step: the plan, as bytes for every worker.
//! let mut plan = vec![0u8; tracker.plan_len(now)];
//! let n = tracker.encode_plan(now, &mut plan)?;
//!
//! // D worker 0 (another process, its own agent).
//! let net = LoopbackNetwork::new(LoopbackConfig::default());
//! let agent = LoopbackFabric::join(&net, "decode-0")?;
//! let mut sender = HeartbeatSender::new(agent, DefaultPeerAddress, SenderConfig::new(&config, 1, 0))?;
//! let report = sender.send_plan(&HeartbeatPlan::decode(&plan[..n])?, now);
//! assert_eq!(report.engines_due, 1);
//! // ... verifier.step(..) gave this step's verdicts. P here is unreachable:
//! // the heartbeat is owed (its handshake failed and backs off), and the
//! // engine goes back with the verdicts only once the backoff ran out.
//! assert_eq!(report.peers_owed, 1);
//! let verdicts = [Outcome { request_id: "cmpl-d-1", verdict: Verdict::Verified }];
//! let mut out = vec![0u8; outcome::encoded_len(verdicts, sender.owed_engines().len() as u32)];
//! let m = outcome::encode(&mut out, 0, 0, verdicts, sender.owed_engines())?;
//!
//! // D scheduler again: received, tracking stops.
//! let applied = tracker.apply_outcomes(&OutcomeMsg::decode(&out[..m])?, |id, verdict| {
//!     assert_eq!((id, verdict), ("cmpl-d-1", Verdict::Verified));
//! })?;
//! assert_eq!(applied.received, 1);
//! assert!(tracker.is_empty());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Everything is fixed-capacity and allocation-free after construction
//! (`tests/consumer_alloc.rs` and `tests/d_roles_alloc.rs` prove it with a
//! counting allocator).

mod id_arena;
mod sender;
mod tracker;
mod verifier;

pub use crate::heartbeat_batch::{BatchReason, HeartbeatBatch, TrackedRemote};
pub use sender::{
    DefaultPeerAddress, HeartbeatSender, OwedEngines, PeerAddress, PeerStatus, PortPerRankAddress,
    SenderConfig, SenderCounters, SenderError, StepError, StepReport, MAX_MESSAGE_LEN,
};
pub use tracker::{
    ApplyReport, EngineBatch, EngineHandle, EngineKey, HeartbeatTracker, ParamProblem,
    RemotePrefillParams, TrackError, TrackOutcome, TrackerCounters, TrackerError, INLINE_ID_LEN,
    MAX_HOST_LEN,
};
pub use verifier::{
    LeaseVerifier, Verdict, VerifierConfig, VerifierCounters, VerifyError, VerifyTarget,
    MAX_TARGETS, WINDOW_SLOTS,
};
