//! What the sender reports: its counters, a step's report and errors, a
//! peer's status.

use super::*;

/// What one sender has done, as plain monotonic counts since construction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SenderCounters {
    /// Due engines handed to `send_due` ([`BatchReason::Due`]).
    pub engines_due: u64,
    /// Owed engines handed to `send_due` ([`BatchReason::Owed`]): only the
    /// P ranks still owed a heartbeat are served.
    pub owed_visits: u64,
    /// Due engines not heartbeated because of a [`SenderError`].
    pub engines_refused: u64,
    /// Notifications sent (a split batch counts each piece).
    pub messages_sent: u64,
    /// Bytes in those notifications.
    pub bytes_sent: u64,
    /// Of the messages, compact ones.
    pub compact_messages_sent: u64,
    /// Per-peer heartbeats deferred because the peer was not ready.
    pub deferred: u64,
    /// Deferred heartbeats sent later, once the peer became ready.
    pub deferred_sent: u64,
    /// Deferred heartbeats dropped because their engine disappeared (a
    /// "gone" notice, or a new engine in its slot).
    pub deferred_dropped: u64,
    /// Handshakes started (including retries).
    pub handshakes_started: u64,
    /// Of those, started again at the end of a step from the engine's kept
    /// key, without a plan: retries past their backoff, and peers the
    /// fabric forgot.
    pub handshakes_redialled: u64,
    /// Handshakes that completed.
    pub handshakes_ready: u64,
    /// Handshake attempts that failed (start refused, state `Failed`, or an
    /// unformattable address); each one backs off.
    pub handshakes_failed: u64,
    /// Peer addresses that could not be formatted (or did not fit).
    pub address_errors: u64,
    /// Sends the fabric refused; the peer is retried.
    pub send_failed: u64,
    /// Ready peers the fabric no longer knew at a send (it removed or
    /// evicted them: `UnknownAgent`): forgotten, and handshaken again at
    /// their next visit without backoff.
    pub peers_forgotten: u64,
    /// Ids the encoder could not fit into a message (longer than the limit).
    pub ids_skipped: u64,
}

/// What one step of a sender did ([`HeartbeatSender::step`],
/// [`HeartbeatSender::send_plan`], [`HeartbeatSender::finish_step`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StepReport {
    /// Due engines handed to the sender this step.
    pub engines_due: u32,
    /// Owed engines handed to the sender this step.
    pub engines_owed: u32,
    /// Notifications sent.
    pub messages_sent: u32,
    /// Peers whose heartbeat is owed (not ready) after this step.
    pub peers_owed: u32,
    /// The last error of this step: a refused engine, a failed handshake or
    /// a failed send.
    pub last_error: Option<StepError>,
}

/// An error met during a step, for logging.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// A due engine was refused.
    #[error("engine not heartbeated: {0}")]
    Sender(#[source] SenderError),
    /// The fabric failed a handshake or a send to `rank` of `engine`.
    #[error(
        "heartbeat to P rank {rank} of engine slot {} (generation {}): {error}",
        .engine.index, .engine.generation
    )]
    Fabric {
        /// The engine.
        engine: EngineHandle,
        /// The P rank.
        rank: u32,
        /// What the fabric said.
        #[source]
        error: FabricError,
    },
}

/// Where the link to one P rank stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerStatus {
    /// No handshake started.
    Idle,
    /// Handshake started; not complete.
    Pending(AgentId),
    /// Handshake complete: heartbeats go out.
    Ready {
        /// The agent.
        agent: AgentId,
        /// The peer takes compact heartbeats.
        compact: bool,
    },
    /// The last attempt failed; the next starts at `retry_at`.
    Failed {
        /// When the next attempt may start.
        retry_at: Instant,
        /// Consecutive failures so far.
        failures: u32,
    },
}
