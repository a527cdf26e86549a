//! [`HeartbeatSender`]: D's worker-side heartbeats, one batched notification
//! per due engine to every P rank this D rank reads from.
//!
//! This module owns the per-(engine, P rank) connection state of one D rank:
//! the [`AgentId`] the fabric issued, where the handshake stands, the retry
//! backoff, and whether a heartbeat is owed because the peer was not ready
//! when its engine was due. It does not decide *when* an engine is due (the
//! [`HeartbeatTracker`] does), what the bytes are ([`crate::wire`]) or which
//! ranks to talk to ([`crate::topology`]); it never reads a clock.
//!
//! # A step
//!
//! The sender heartbeats the engines a plan hands it, one
//! [`HeartbeatBatch`] each; where the plan comes from is the only difference
//! between the two ways to run it:
//!
//! ```text
//! scheduler and worker apart (vLLM's layout):
//!   scheduler: n = tracker.encode_plan(now, &mut buf)?      -> bytes to every worker
//!   worker:    plan = HeartbeatPlan::decode(&bytes)?
//!              sender.send_plan(&plan, now)                  // gone notices, send_due per engine, finish_step
//!              sender.owed_engines()                         -> outcome message -> scheduler
//!   scheduler: tracker.apply_outcomes(&msg, ..)              // request_engines(owed) inside
//!
//! one process:
//!   sender.step(&mut tracker, now)                           // the same, without the bytes
//! ```
//!
//! (With several D ranks in one process, call every rank's `send_due` from
//! the same [`HeartbeatTracker::due`] callback, since `due` throttles, then
//! each rank's `finish_step`, and give every rank's `owed_engines` to
//! [`HeartbeatTracker::request_engines`] and every "gone" notice of
//! [`HeartbeatTracker::take_gone`] to each rank's `engine_gone`.)
//!
//! For a due engine, [`HeartbeatSender::send_due`] maps this rank to its P
//! ranks ([`TpMapping::targets`]: P TP 4 / D TP 2 gives two ranks, P TP 2 /
//! D TP 4 one) and for each:
//!
//! - **ready** (handshake complete): gets the batch now;
//! - **no handshake yet**: [`Fabric::start_handshake`] (non-blocking), and the
//!   peer is *owed* this heartbeat;
//! - **failed**: retried with exponential backoff from
//!   [`SenderConfig::backoff_initial`], doubling per consecutive failure up to
//!   [`SenderConfig::backoff_max`]; counted in [`SenderCounters`], never a
//!   panic. A send that fails with a connection error sends the peer back
//!   through the handshake, and the peer is owed the heartbeat.
//!
//! # Owed heartbeats
//!
//! A worker in another process cannot look into the tracker, so the debt
//! travels: the sender lists the engines it owes
//! ([`HeartbeatSender::owed_engines`]), the scheduler requests them
//! ([`HeartbeatTracker::request_engines`]), and the next plan carries each
//! again as [`BatchReason::Owed`] whatever its throttle. For an owed engine
//! the sender serves only the peers still owed: it polls their handshakes
//! (not in the step a handshake started) and sends at the first step at
//! which [`Fabric::handshake_state`] is `Ready`, without waiting for the
//! engine's next interval (the early handshake also speeds up the later KV
//! READ). The sender keeps nothing per request for this; the batch it needs
//! arrives with the plan. An engine that disappears from the tracker comes
//! back as a "gone" notice ([`HeartbeatSender::engine_gone`]), and what is
//! owed to it is dropped. [`HeartbeatSender::step`] runs exactly this loop
//! in one process, so the single-process tests pin the split's behaviour.
//!
//! # One message, split when it must be
//!
//! The batch is encoded once per form and each resulting message goes to
//! every peer that wants that form: compact (`HBC:`, (slot, nonce) records)
//! when the peer advertised [`PeerInfo::compact_heartbeats`] and every request
//! of the engine has a lease slot and nonce, text (`HB:` ids, vLLM's form)
//! otherwise. A batch larger than `min(fabric.max_notification_len(),
//! MAX_MESSAGE_LEN)` is split by the encoder into several complete
//! heartbeats.
//!
//! # Peer addresses
//!
//! [`Fabric::start_handshake`] takes a fabric-specific address string. The
//! engine supplies the formatting as a [`PeerAddress`] (any
//! `Fn(&EngineKey, u32, &mut dyn fmt::Write) -> fmt::Result` is one), which
//! writes into a buffer preallocated at construction. The default,
//! [`DefaultPeerAddress`], writes `{host}:{port}/{engine_id}/{rank}`;
//! [`PortPerRankAddress`] writes `{host}:{port + rank}`, the `ip:port` of a
//! rank's handshake listener that the NIXL fabric takes; the
//! loopback fabric names agents however its test wires them, so tests pass
//! their own closure.
//!
//! # Progress
//!
//! The sender only sends. With the NIXL fabric in engine-loop progress mode
//! (its default) a message leaves only while the fabric is called, so the D
//! worker must drive its fabric every step, as P does: drain its
//! notifications (`fabric_mut().drain_notifications(..)`) once per step. A D
//! that sends heartbeats and never polls gets its first heartbeat out and no
//! more (seen in `benches/fabric.rs`).
//!
//! # Fixed capacity
//!
//! State for `max_engines * max_fan_out` peers, the message scratch buffer and
//! the address buffer are allocated in [`HeartbeatSender::new`]; nothing
//! allocates afterwards. An engine whose fan-out (`P TP / D TP`) exceeds
//! `max_fan_out`, or whose TP sizes do not map, is not heartbeated by this
//! sender: a [`SenderError`] from `send_due`, counted.

use core::fmt;
use core::time::Duration;

use super::batch::{BatchReason, HeartbeatBatch};
use super::tracker::{EngineHandle, EngineKey, HeartbeatTracker};
use crate::collections::DenseSet;
use crate::config::LeaseConfig;
use crate::fabric::{AgentId, Fabric, FabricError, HandshakeState};
use crate::ipc::plan::HeartbeatPlan;
use crate::time::Instant;
use crate::topology::{TopologyError, TpMapping};
use crate::wire::{self, WireError};

/// Largest heartbeat message this sender writes, whatever the fabric allows:
/// it bounds the scratch buffer. 64 KiB carries ~1,600 36-byte ids.
pub const MAX_MESSAGE_LEN: usize = 64 * 1024;

/// Formats the fabric address of P rank `rank` of `engine`.
pub trait PeerAddress {
    /// Writes the address; an error (or a buffer overflow) makes the
    /// handshake attempt fail with [`FabricError::BadAddress`].
    fn write_address(
        &self,
        engine: &EngineKey<'_>,
        rank: u32,
        out: &mut dyn fmt::Write,
    ) -> fmt::Result;
}

impl<F> PeerAddress for F
where
    F: Fn(&EngineKey<'_>, u32, &mut dyn fmt::Write) -> fmt::Result,
{
    fn write_address(
        &self,
        engine: &EngineKey<'_>,
        rank: u32,
        out: &mut dyn fmt::Write,
    ) -> fmt::Result {
        self(engine, rank, out)
    }
}

/// `{host}:{port}/{engine_id}/{rank}`, e.g. `10.0.0.7:5600/prefill-0/3`:
/// names every (engine, rank) distinctly, for fabrics that resolve names
/// (the loopback fabric and the tests). The NIXL fabric wants the `ip:port`
/// of the rank's handshake listener: use [`PortPerRankAddress`] there.
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultPeerAddress;

impl PeerAddress for DefaultPeerAddress {
    fn write_address(
        &self,
        engine: &EngineKey<'_>,
        rank: u32,
        out: &mut dyn fmt::Write,
    ) -> fmt::Result {
        write!(
            out,
            "{}:{}/{}/{}",
            engine.host, engine.port, engine.engine_id, rank
        )
    }
}

/// `{host}:{port + rank}`, e.g. `10.0.0.7:5603` for rank 3 of an engine whose
/// `remote_port` is 5600: one handshake listener per P rank on consecutive
/// ports, the `ip:port` form the NIXL fabric takes (`fabric::nixl::NixlFabric`,
/// feature `nixl`; not a link, so that the docs build without it). An
/// engine that lays out its listeners otherwise supplies its own
/// [`PeerAddress`].
#[derive(Clone, Copy, Debug, Default)]
pub struct PortPerRankAddress;

impl PeerAddress for PortPerRankAddress {
    fn write_address(
        &self,
        engine: &EngineKey<'_>,
        rank: u32,
        out: &mut dyn fmt::Write,
    ) -> fmt::Result {
        write!(out, "{}:{}", engine.host, u32::from(engine.port) + rank)
    }
}

/// Sizing and policy of one D rank's sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SenderConfig {
    /// This D instance's tensor-parallel size.
    pub local_tp: u32,
    /// This worker's rank, `0..local_tp`.
    pub local_rank: u32,
    /// Engine slots: must be at least the tracker's `max_remote_engines`.
    pub max_engines: u32,
    /// Most P ranks one engine maps this rank to (`P TP / D TP`).
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
    /// engine slots from `config.max_remote_engines`, fan-out up to 16,
    /// addresses up to 512 bytes, backoff from 250 ms doubling up to the
    /// heartbeat interval (so a recovered P is heartbeated again within one
    /// interval, well inside the lease extension).
    pub fn new(config: &LeaseConfig, local_tp: u32, local_rank: u32) -> SenderConfig {
        let initial = Duration::from_millis(250);
        SenderConfig {
            local_tp,
            local_rank,
            max_engines: config.max_remote_engines,
            max_fan_out: 16,
            max_address_len: 512,
            backoff_initial: initial,
            backoff_max: config.heartbeat_interval().max(initial),
        }
    }
}

/// Why a due engine was not heartbeated by this sender, or the sender could
/// not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SenderError {
    /// The TP sizes do not map (zero, not divisible) or the local rank is out
    /// of range.
    Topology(TopologyError),
    /// The engine maps this rank to more P ranks than `max_fan_out`.
    FanOutTooLarge {
        /// P ranks this rank would heartbeat.
        fan_out: u32,
        /// The configured maximum.
        max: u32,
    },
    /// The engine's slot index is beyond `max_engines` (sender smaller than
    /// its tracker).
    EngineOutOfRange {
        /// The tracker's slot index.
        index: u32,
        /// The sender's engine capacity.
        max_engines: u32,
    },
    /// The batch could not be encoded (the fabric's message limit is too
    /// small for even one id).
    Encode(WireError),
}

impl fmt::Display for SenderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SenderError::Topology(e) => write!(f, "heartbeat topology: {e}"),
            SenderError::FanOutTooLarge { fan_out, max } => write!(
                f,
                "engine maps this rank to {fan_out} P ranks, more than max_fan_out {max}"
            ),
            SenderError::EngineOutOfRange { index, max_engines } => write!(
                f,
                "engine slot {index} is beyond the sender's {max_engines} engine slots"
            ),
            SenderError::Encode(e) => write!(f, "heartbeat encoding: {e}"),
        }
    }
}

impl std::error::Error for SenderError {}

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
    /// Handshakes that completed.
    pub handshakes_ready: u64,
    /// Handshake attempts that failed (start refused, state `Failed`, or an
    /// unformattable address); each one backs off.
    pub handshakes_failed: u64,
    /// Peer addresses that could not be formatted (or did not fit).
    pub address_errors: u64,
    /// Sends the fabric refused; the peer is retried.
    pub send_failed: u64,
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StepError {
    /// A due engine was refused.
    Sender(SenderError),
    /// The fabric failed a handshake or a send to `rank` of `engine`.
    Fabric {
        /// The engine.
        engine: EngineHandle,
        /// The P rank.
        rank: u32,
        /// What the fabric said.
        error: FabricError,
    },
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepError::Sender(e) => write!(f, "engine not heartbeated: {e}"),
            StepError::Fabric {
                engine,
                rank,
                error,
            } => write!(
                f,
                "heartbeat to P rank {rank} of engine slot {} (generation {}): {error}",
                engine.index, engine.generation
            ),
        }
    }
}

impl std::error::Error for StepError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StepError::Sender(e) => Some(e),
            StepError::Fabric { error, .. } => Some(error),
        }
    }
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

#[derive(Clone, Copy, Debug)]
struct Peer {
    status: PeerStatus,
    /// Consecutive failures (kept across Pending, reset on Ready).
    failures: u32,
    /// The step (epoch) in which the current handshake started: not polled
    /// in that step.
    started_epoch: u64,
    /// A heartbeat of the current interval has not reached this peer yet.
    owed: bool,
    /// Scratch for one send: this peer gets the message in this form.
    send: Form,
    /// Scratch for one send: its send failed and it must be registered owed.
    send_failed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    None,
    Text,
    Compact,
}

const IDLE_PEER: Peer = Peer {
    status: PeerStatus::Idle,
    failures: 0,
    started_epoch: 0,
    owed: false,
    send: Form::None,
    send_failed: false,
};

#[derive(Clone, Copy, Debug)]
struct Slot {
    /// Whether `generation` is meaningful (the slot has seen an engine).
    used: bool,
    generation: u32,
    first_rank: u32,
    fan_out: u32,
    /// Peers with `owed` set.
    owed: u32,
}

/// The engines a sender owes a heartbeat, as [`EngineHandle`]s
/// ([`HeartbeatSender::owed_engines`]).
#[derive(Clone, Debug)]
pub struct OwedEngines<'s> {
    sender_slots: &'s [Slot],
    owed: &'s DenseSet,
    next: u32,
}

impl Iterator for OwedEngines<'_> {
    type Item = EngineHandle;

    fn next(&mut self) -> Option<EngineHandle> {
        let index = self.owed.get(self.next)?;
        self.next += 1;
        Some(EngineHandle {
            index,
            generation: self.sender_slots.get(index as usize)?.generation,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.owed.len().saturating_sub(self.next) as usize;
        (left, Some(left))
    }
}

impl ExactSizeIterator for OwedEngines<'_> {}

/// Why `service` is called.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// The engine is due: every peer gets this interval's heartbeat.
    Due,
    /// A later step: only peers still owed one.
    Owed,
}

/// A fixed buffer that `fmt::Write` fills; overflow is an error.
#[derive(Debug)]
struct AddrBuf {
    buf: Box<[u8]>,
    len: usize,
}

impl fmt::Write for AddrBuf {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len.checked_add(s.len()).ok_or(fmt::Error)?;
        let dst = self.buf.get_mut(self.len..end).ok_or(fmt::Error)?;
        dst.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// One D rank's heartbeat sender. See the module docs.
pub struct HeartbeatSender<F: Fabric, A: PeerAddress = DefaultPeerAddress> {
    fabric: F,
    address: A,
    config: SenderConfig,
    slots: Box<[Slot]>,
    peers: Box<[Peer]>,
    owed: DenseSet,
    scratch: Box<[u8]>,
    addr: AddrBuf,
    epoch: u64,
    counters: SenderCounters,
    /// This step so far, for its [`StepReport`].
    this_step: StepTally,
}

/// What the current step did so far; reset by `finish_step`.
#[derive(Clone, Copy, Debug, Default)]
struct StepTally {
    due: u32,
    owed: u32,
    /// `counters.messages_sent` when the step began.
    messages_before: u64,
    /// The step's last error.
    error: Option<StepError>,
}

impl<F: Fabric, A: PeerAddress> fmt::Debug for HeartbeatSender<F, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeartbeatSender")
            .field("fabric", &self.fabric.name())
            .field("config", &self.config)
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl<F: Fabric, A: PeerAddress> HeartbeatSender<F, A> {
    /// A sender for `config.local_rank` over `fabric`. Allocates all its
    /// state now. Fails when the local rank is not in `0..local_tp`.
    pub fn new(fabric: F, address: A, config: SenderConfig) -> Result<Self, SenderError> {
        // Validates local_tp != 0 and the rank, against a same-size peer.
        TpMapping::new(config.local_tp, config.local_tp)
            .and_then(|m| m.targets(config.local_rank))
            .map_err(SenderError::Topology)?;
        let engines = config.max_engines.max(1);
        let fan = config.max_fan_out.max(1);
        let msg = fabric.max_notification_len().min(MAX_MESSAGE_LEN);
        let slot = Slot {
            used: false,
            generation: 0,
            first_rank: 0,
            fan_out: 0,
            owed: 0,
        };
        Ok(HeartbeatSender {
            fabric,
            address,
            config: SenderConfig {
                max_engines: engines,
                max_fan_out: fan,
                ..config
            },
            slots: vec![slot; engines as usize].into_boxed_slice(),
            peers: vec![IDLE_PEER; engines as usize * fan as usize].into_boxed_slice(),
            owed: DenseSet::new(engines),
            scratch: vec![0; msg].into_boxed_slice(),
            addr: AddrBuf {
                buf: vec![0; config.max_address_len as usize].into_boxed_slice(),
                len: 0,
            },
            epoch: 1,
            counters: SenderCounters::default(),
            this_step: StepTally::default(),
        })
    }

    /// The fabric (e.g. for the KV READs of the same worker).
    pub fn fabric(&self) -> &F {
        &self.fabric
    }

    /// The fabric, mutably. Agents it issued stay valid for this sender.
    pub fn fabric_mut(&mut self) -> &mut F {
        &mut self.fabric
    }

    /// The configuration in force (capacities raised to at least 1).
    pub fn config(&self) -> &SenderConfig {
        &self.config
    }

    /// The counters; a borrow.
    pub fn counters(&self) -> &SenderCounters {
        &self.counters
    }

    /// Where the link to P rank `rank` of the engine behind `handle` stands;
    /// `None` when this sender has no state for it.
    pub fn peer_status(&self, handle: EngineHandle, rank: u32) -> Option<PeerStatus> {
        let slot = self.slots.get(handle.index as usize)?;
        if !slot.used || slot.generation != handle.generation {
            return None;
        }
        let k = rank.checked_sub(slot.first_rank)?;
        if k >= slot.fan_out {
            return None;
        }
        self.peers
            .get(self.peer_index(handle.index, k))
            .map(|p| p.status)
    }

    /// Peers (engine, P rank) currently owed a heartbeat.
    pub fn peers_owed(&self) -> u32 {
        let mut n = 0;
        for k in 0..self.owed.len() {
            if let Some(e) = self.owed.get(k) {
                n += self.slots[e as usize].owed;
            }
        }
        n
    }

    /// A whole step for a tracker in the same process that this sender
    /// serves alone. Built from the same pieces as the scheduler/worker
    /// split (see the module docs): the tracker's "gone" notices, then its
    /// planned engines ([`HeartbeatTracker::due`], the selection
    /// [`HeartbeatTracker::encode_plan`] uses) into
    /// [`HeartbeatSender::send_due`], [`HeartbeatSender::finish_step`], and
    /// the engines still owed back to the tracker
    /// ([`HeartbeatTracker::request_engines`]) for the next step.
    pub fn step(&mut self, tracker: &mut HeartbeatTracker, now: Instant) -> StepReport {
        tracker.take_gone(|handle| self.engine_gone(handle));
        tracker.due(now, |batch| {
            // Errors are counted and kept for the report.
            let _ = self.send_due(&batch, now);
        });
        let report = self.finish_step();
        tracker.request_engines(self.owed_engines());
        report
    }

    /// A whole step of a worker whose scheduler runs in another process:
    /// drops what is owed to the plan's gone engines, heartbeats every
    /// engine of the plan ([`HeartbeatSender::send_due`]), and ends the step
    /// ([`HeartbeatSender::finish_step`]). Report
    /// [`HeartbeatSender::owed_engines`] back to the scheduler (the owed
    /// section of the verify-outcome message, [`crate::ipc::outcome`]).
    pub fn send_plan(&mut self, plan: &HeartbeatPlan<'_>, now: Instant) -> StepReport {
        for handle in plan.gone() {
            self.engine_gone(handle);
        }
        for engine in plan.engines() {
            // Errors are counted and kept for the report.
            let _ = self.send_due(&engine, now);
        }
        self.finish_step()
    }

    /// Heartbeats one planned engine. A due engine
    /// ([`BatchReason::Due`]): one message (or its split pieces) to every
    /// ready P rank this rank maps to; the others are handshaked and owed
    /// the heartbeat. An owed engine ([`BatchReason::Owed`]): only the P
    /// ranks this rank still owes (none if it owes nothing: another worker
    /// does). Call once per planned engine per step, then
    /// [`HeartbeatSender::finish_step`] once.
    pub fn send_due<B: HeartbeatBatch>(
        &mut self,
        batch: &B,
        now: Instant,
    ) -> Result<(), SenderError> {
        let mode = match batch.reason() {
            BatchReason::Due => {
                self.counters.engines_due += 1;
                self.this_step.due += 1;
                Mode::Due
            }
            BatchReason::Owed => {
                self.counters.owed_visits += 1;
                self.this_step.owed += 1;
                Mode::Owed
            }
        };
        let r = self.service(batch, now, mode);
        if let Err(e) = r {
            if mode == Mode::Due {
                self.counters.engines_refused += 1;
            }
            self.this_step.error = Some(StepError::Sender(e));
        }
        r
    }

    /// Drops every heartbeat owed to the engine behind `handle`, which the
    /// tracker no longer has (a "gone" notice). A handle this sender holds
    /// nothing for is a no-op.
    pub fn engine_gone(&mut self, handle: EngineHandle) {
        let Some(slot) = self.slots.get(handle.index as usize) else {
            return;
        };
        if slot.used && slot.generation == handle.generation {
            self.counters.deferred_dropped += u64::from(slot.owed);
            self.clear_owed(handle.index);
        }
    }

    /// Ends a step and reports it: engines handed over, messages sent, the
    /// peers still owed a heartbeat and the step's last error. Handshakes
    /// started during the step are polled from the next one on.
    pub fn finish_step(&mut self) -> StepReport {
        self.epoch += 1;
        let t = core::mem::take(&mut self.this_step);
        self.this_step.messages_before = self.counters.messages_sent;
        StepReport {
            engines_due: t.due,
            engines_owed: t.owed,
            messages_sent: u32::try_from(self.counters.messages_sent - t.messages_before)
                .unwrap_or(u32::MAX),
            peers_owed: self.peers_owed(),
            last_error: t.error,
        }
    }

    /// The engines for which some P rank is still owed a heartbeat: report
    /// them to the tracker ([`HeartbeatTracker::request_engines`]) so that
    /// it plans them again at the next step.
    pub fn owed_engines(&self) -> OwedEngines<'_> {
        OwedEngines {
            sender_slots: &self.slots,
            owed: &self.owed,
            next: 0,
        }
    }

    #[inline]
    fn peer_index(&self, engine: u32, k: u32) -> usize {
        engine as usize * self.config.max_fan_out as usize + k as usize
    }

    /// Resets slot `e` for the engine behind `handle` if it held another.
    fn prepare_slot<B: HeartbeatBatch>(&mut self, batch: &B) -> Result<u32, SenderError> {
        let handle = batch.handle();
        let e = handle.index;
        let max_engines = self.config.max_engines;
        let slot = *self
            .slots
            .get(e as usize)
            .ok_or(SenderError::EngineOutOfRange {
                index: e,
                max_engines,
            })?;
        if slot.used && slot.generation == handle.generation {
            return Ok(e);
        }
        // A new engine in this slot: forget the old one's peers (and any
        // heartbeat still owed to them: that engine is gone).
        self.counters.deferred_dropped += u64::from(slot.owed);
        self.clear_owed(e);
        let key = batch.key();
        let mapping =
            TpMapping::new(self.config.local_tp, key.tp_size).map_err(SenderError::Topology)?;
        let targets = mapping
            .targets(self.config.local_rank)
            .map_err(SenderError::Topology)?;
        let fan_out = mapping.fan_out();
        if fan_out > self.config.max_fan_out {
            return Err(SenderError::FanOutTooLarge {
                fan_out,
                max: self.config.max_fan_out,
            });
        }
        let base = self.peer_index(e, 0);
        for p in &mut self.peers[base..base + self.config.max_fan_out as usize] {
            *p = IDLE_PEER;
        }
        self.slots[e as usize] = Slot {
            used: true,
            generation: handle.generation,
            first_rank: targets.first(),
            fan_out,
            owed: 0,
        };
        Ok(e)
    }

    fn clear_owed(&mut self, e: u32) {
        let Some(slot) = self.slots.get_mut(e as usize) else {
            return;
        };
        if slot.owed > 0 {
            let base = e as usize * self.config.max_fan_out as usize;
            for p in &mut self.peers[base..base + slot.fan_out as usize] {
                p.owed = false;
            }
            slot.owed = 0;
        }
        self.owed.remove(e);
    }

    fn set_owed(&mut self, e: u32, k: u32, owed: bool) {
        let i = self.peer_index(e, k);
        let p = &mut self.peers[i];
        if p.owed == owed {
            return;
        }
        p.owed = owed;
        let slot = &mut self.slots[e as usize];
        if owed {
            slot.owed += 1;
            self.owed.insert(e);
        } else {
            slot.owed -= 1;
            if slot.owed == 0 {
                self.owed.remove(e);
            }
        }
        // The owed set is exactly the slots with a debt: what `owed_engines`
        // reports back to the tracker.
        debug_assert_eq!(self.owed.contains(e), slot.owed > 0);
    }

    /// Advances peer `k` of engine `e`: starts, polls or retries its
    /// handshake. Returns whether it is ready to receive now.
    fn advance<B: HeartbeatBatch>(&mut self, batch: &B, e: u32, k: u32, now: Instant) -> bool {
        let i = self.peer_index(e, k);
        let peer = self.peers[i];
        match peer.status {
            PeerStatus::Ready { .. } => true,
            PeerStatus::Idle => {
                self.start_handshake(batch, e, k, now);
                false
            }
            PeerStatus::Failed { retry_at, .. } => {
                if now >= retry_at {
                    self.start_handshake(batch, e, k, now);
                }
                false
            }
            PeerStatus::Pending(agent) => {
                if peer.started_epoch == self.epoch {
                    // Started in this step: the spec defers to a later step.
                    return false;
                }
                match self.fabric.handshake_state(agent, now) {
                    HandshakeState::Pending => false,
                    HandshakeState::Ready(info) => {
                        self.counters.handshakes_ready += 1;
                        let p = &mut self.peers[i];
                        p.status = PeerStatus::Ready {
                            agent,
                            compact: info.compact_heartbeats,
                        };
                        p.failures = 0;
                        true
                    }
                    HandshakeState::Failed(err) => {
                        self.fail(batch, e, k, err, now);
                        false
                    }
                }
            }
        }
    }

    fn start_handshake<B: HeartbeatBatch>(&mut self, batch: &B, e: u32, k: u32, now: Instant) {
        let rank = self.slots[e as usize].first_rank + k;
        self.addr.len = 0;
        let key = batch.key();
        if self
            .address
            .write_address(&key, rank, &mut self.addr)
            .is_err()
        {
            self.counters.address_errors += 1;
            self.fail(batch, e, k, FabricError::BadAddress, now);
            return;
        }
        // AddrBuf is filled only through write_str, whole &strs at a time.
        let Ok(address) = core::str::from_utf8(&self.addr.buf[..self.addr.len]) else {
            self.counters.address_errors += 1;
            self.fail(batch, e, k, FabricError::BadAddress, now);
            return;
        };
        self.counters.handshakes_started += 1;
        match self.fabric.start_handshake(address, now) {
            Ok(agent) => {
                let i = self.peer_index(e, k);
                self.peers[i].status = PeerStatus::Pending(agent);
                self.peers[i].started_epoch = self.epoch;
            }
            Err(err) => self.fail(batch, e, k, err, now),
        }
    }

    fn fail<B: HeartbeatBatch>(
        &mut self,
        batch: &B,
        e: u32,
        k: u32,
        err: FabricError,
        now: Instant,
    ) {
        self.counters.handshakes_failed += 1;
        let i = self.peer_index(e, k);
        let p = &mut self.peers[i];
        p.failures = p.failures.saturating_add(1);
        let wait = backoff(
            self.config.backoff_initial,
            self.config.backoff_max,
            p.failures,
        );
        p.status = PeerStatus::Failed {
            retry_at: now.saturating_add(wait),
            failures: p.failures,
        };
        self.this_step.error = Some(StepError::Fabric {
            engine: batch.handle(),
            rank: self.slots[e as usize].first_rank + k,
            error: err,
        });
    }

    fn service<B: HeartbeatBatch>(
        &mut self,
        batch: &B,
        now: Instant,
        mode: Mode,
    ) -> Result<(), SenderError> {
        if mode == Mode::Owed {
            // Only this engine's own debts: a slot holding another engine
            // (or none, or owing nothing) has nothing to serve, and must not
            // be reset by a plan entry that another worker asked for.
            let handle = batch.handle();
            match self.slots.get(handle.index as usize) {
                Some(s) if s.used && s.generation == handle.generation && s.owed > 0 => {}
                _ => return Ok(()),
            }
        }
        let e = self.prepare_slot(batch)?;
        let fan_out = self.slots[e as usize].fan_out;
        let all_leased = batch.all_leased();
        let (mut text, mut compact) = (false, false);
        for k in 0..fan_out {
            let i = self.peer_index(e, k);
            self.peers[i].send = Form::None;
            if mode == Mode::Owed && !self.peers[i].owed {
                // Got this interval's heartbeat already.
                continue;
            }
            if self.advance(batch, e, k, now) {
                let form = match self.peers[i].status {
                    PeerStatus::Ready { compact: true, .. } if all_leased => Form::Compact,
                    _ => Form::Text,
                };
                self.peers[i].send = form;
                text |= form == Form::Text;
                compact |= form == Form::Compact;
            } else {
                if mode == Mode::Due && !self.peers[i].owed {
                    self.counters.deferred += 1;
                }
                self.set_owed(e, k, true);
            }
        }
        if compact
            && self
                .send_form(batch, e, fan_out, Form::Compact, now)
                .is_err()
        {
            // The limit cannot hold one compact record: fall back to text.
            for k in 0..fan_out {
                let i = self.peer_index(e, k);
                if self.peers[i].send == Form::Compact {
                    self.peers[i].send = Form::Text;
                    text = true;
                }
            }
        }
        let mut result = Ok(());
        if text {
            if let Err(err) = self.send_form(batch, e, fan_out, Form::Text, now) {
                result = Err(SenderError::Encode(err));
            }
        }
        // Sweep the peers marked for this batch. A peer whose send failed
        // was unmarked by `send_form` and stays owed; a batch that cannot be
        // encoded at all owes nothing (retrying each step would fail the
        // same way; the next interval tries again).
        for k in 0..fan_out {
            let i = self.peer_index(e, k);
            let p = self.peers[i];
            self.peers[i].send = Form::None;
            match (p.send, result.is_ok()) {
                (Form::None, _) => {}
                (_, true) => {
                    if p.owed {
                        self.counters.deferred_sent += 1;
                    }
                    self.set_owed(e, k, false);
                }
                (_, false) => self.set_owed(e, k, false),
            }
        }
        result
    }

    /// Encodes the batch once in `form` and sends every piece to each peer
    /// marked for that form. A peer whose send fails is unmarked and owed;
    /// on a connection error it goes back through the handshake, with
    /// backoff.
    fn send_form<B: HeartbeatBatch>(
        &mut self,
        batch: &B,
        e: u32,
        fan_out: u32,
        form: Form,
        now: Instant,
    ) -> Result<(), WireError> {
        let base = self.peer_index(e, 0);
        let first_rank = self.slots[e as usize].first_rank;
        let handle = batch.handle();
        let max_len = self.fabric.max_notification_len().min(self.scratch.len());
        let (initial, max) = (self.config.backoff_initial, self.config.backoff_max);
        let HeartbeatSender {
            fabric,
            peers,
            scratch,
            counters,
            this_step,
            ..
        } = self;
        let peers = &mut peers[base..base + fan_out as usize];
        let mut emit = |msg: &[u8]| {
            for (k, p) in peers.iter_mut().enumerate() {
                if p.send != form {
                    continue;
                }
                let PeerStatus::Ready { agent, .. } = p.status else {
                    debug_assert!(false, "a marked peer is ready");
                    continue;
                };
                match fabric.send_notification(agent, msg) {
                    Ok(()) => {
                        counters.messages_sent += 1;
                        counters.bytes_sent += msg.len() as u64;
                        if form == Form::Compact {
                            counters.compact_messages_sent += 1;
                        }
                    }
                    Err(err) => {
                        counters.send_failed += 1;
                        // Skip this batch's later pieces for the peer; the
                        // owed sweep retries it in a later step.
                        p.send = Form::None;
                        p.send_failed = true;
                        if matches!(
                            err,
                            FabricError::NotConnected
                                | FabricError::UnknownAgent
                                | FabricError::PeerUnreachable
                        ) {
                            counters.handshakes_failed += 1;
                            p.failures = p.failures.saturating_add(1);
                            p.status = PeerStatus::Failed {
                                retry_at: now.saturating_add(backoff(initial, max, p.failures)),
                                failures: p.failures,
                            };
                        }
                        this_step.error = Some(StepError::Fabric {
                            engine: handle,
                            rank: first_rank + k as u32,
                            error: err,
                        });
                    }
                }
            }
        };
        let stats = match form {
            Form::Compact => {
                wire::encode_compact_heartbeats(batch.leases(), max_len, scratch, &mut emit)
            }
            Form::Text | Form::None => {
                wire::encode_heartbeats(batch.remote_request_ids(), max_len, scratch, &mut emit)
            }
        }?;
        counters.ids_skipped += u64::from(stats.skipped);
        // Peers whose send failed inside `emit` (which cannot reach the
        // owed set) are owed the heartbeat.
        for k in 0..fan_out {
            let i = base + k as usize;
            if self.peers[i].send_failed {
                self.peers[i].send_failed = false;
                self.set_owed(e, k, true);
            }
        }
        Ok(())
    }
}

/// `initial * 2^(failures - 1)`, capped at `max` (and at least `initial`).
fn backoff(initial: Duration, max: Duration, failures: u32) -> Duration {
    let shift = failures.saturating_sub(1).min(31);
    initial
        .checked_mul(1u32 << shift)
        .unwrap_or(max)
        .min(max.max(initial))
}
