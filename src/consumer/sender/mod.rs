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
//! With several D ranks in one process (one sender each, one tracker),
//! [`HeartbeatSender::step_all`] is the same step for all of them: one
//! `due` pass feeds every sender (`due` throttles, so a second pass would
//! find nothing due), and every sender's debts go back to the tracker.
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
//! - **forgotten by the fabric**: a send refused with
//!   [`FabricError::UnknownAgent`] means the fabric removed or evicted the
//!   peer (a NIXL fabric whose peer table filled with restarted workers);
//!   the peer goes back to "no handshake yet" without backoff and is owed
//!   the heartbeat ([`SenderCounters::peers_forgotten`]). The sender never
//!   removes fabric peers itself: the verifier and the engine use the same
//!   [`AgentId`]s. Its own peer state is per engine slot, reset when the
//!   tracker reuses the slot, so P restarts do not fill it.
//!
//! # Owed heartbeats
//!
//! A worker in another process cannot look into the tracker, so the debt
//! travels: the sender lists the engines it owes **and can act on now**
//! ([`HeartbeatSender::owed_engines`]), the scheduler requests them
//! ([`HeartbeatTracker::request_engines`]), and the next plan carries each
//! again as [`BatchReason::Owed`] whatever its throttle. For an owed engine
//! the sender serves only the peers still owed, and sends at the first step
//! at which [`Fabric::handshake_state`] is `Ready`, without waiting for the
//! engine's next interval (the early handshake also speeds up the later KV
//! READ).
//!
//! A plan carries every request id of the engines it names, so an engine is
//! asked for only when the sender needs its batch: an owed peer became
//! ready, and the heartbeat can go. Everything else the sender does by
//! itself at the end of each step ([`HeartbeatSender::finish_step`]), with
//! no plan: it polls a pending handshake, lets a peer back off, and, when
//! the backoff runs out (or the fabric forgot the peer), starts the
//! handshake again from the engine's key, which it kept when the engine
//! took its slot (`keys.rs`). So an unreachable P rank costs no plan: with
//! 10,000 requests queued toward it, the owed engine was 630 KB of plan
//! at every step (issue 19), then at every retry of that rank (issue 30),
//! and is now in no plan but its interval's own, when the ranks that are
//! ready take the heartbeat (`tests/it/owed_plan.rs`, `benches/owed_plan.rs`).
//! One exception keeps a quick first handshake quick: the step after a
//! handshake first started, the engine is planned once more, so that a
//! peer ready by then is heartbeated at once. The sender keeps nothing per
//! request for this; the batch it needs arrives with the plan. An engine that disappears from the tracker comes
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
//! State for `max_engines * max_fan_out` peers, one engine key per engine
//! slot, the message scratch buffer and the address buffer are allocated in
//! [`HeartbeatSender::new`]; nothing allocates afterwards. An engine whose fan-out (`P TP / D TP`) exceeds
//! `max_fan_out`, or whose TP sizes do not map, is not heartbeated by this
//! sender: a [`SenderError`] from `send_due`, counted.

use core::fmt;
use core::time::Duration;

use super::tracker::HeartbeatTracker;
use crate::collections::DenseSet;
use crate::config::LeaseConfig;
use crate::fabric::{AgentId, Fabric, FabricError, HandshakeState};
use crate::heartbeat_batch::{BatchReason, HeartbeatBatch};
use crate::ipc::plan::HeartbeatPlan;
use crate::remote_engine::{EngineHandle, EngineKey};
use crate::time::Instant;
use crate::topology::{RemoteRanks, TopologyError, TpMapping};
use crate::wire::{self, WireError};

/// Largest heartbeat message this sender writes, whatever the fabric allows:
/// it bounds the scratch buffer. 64 KiB carries ~1,600 36-byte ids.
pub const MAX_MESSAGE_LEN: usize = 64 * 1024;

mod address;
mod config;
mod counters;
mod keys;
mod owed;
mod service;

pub use address::{DefaultPeerAddress, PeerAddress, PortPerRankAddress};
pub use config::{SenderConfig, SenderError};
pub use counters::{PeerStatus, SenderCounters, StepError, StepReport};
use keys::EngineKeys;
pub use owed::OwedEngines;

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
    /// The P ranks this rank serves for the engine (TP targets on every
    /// pipeline stage); peer `k` is `targets.get(k)`.
    targets: RemoteRanks,
    fan_out: u32,
    /// Peers with `owed` set.
    owed: u32,
}

/// The targets of a slot that has seen no engine: none.
const NO_TARGETS: RemoteRanks = match TpMapping::new(1, 1) {
    Ok(m) => match m.targets(0) {
        Ok(t) => t,
        Err(_) => unreachable!(),
    },
    Err(_) => unreachable!(),
};

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
    /// Each slot's engine key, to start a handshake again without a plan.
    keys: EngineKeys,
    /// Owed engines the next plan must carry (a subset of `owed`): some
    /// owed peer is ready, idle, or done backing off. Rebuilt by
    /// `finish_step`.
    ripe: DenseSet,
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
            targets: NO_TARGETS,
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
            ripe: DenseSet::new(engines),
            scratch: vec![0; msg].into_boxed_slice(),
            addr: AddrBuf {
                buf: vec![0; config.max_address_len as usize].into_boxed_slice(),
                len: 0,
            },
            keys: EngineKeys::new(engines, config.max_address_len),
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
    pub fn counters(&self) -> SenderCounters {
        self.counters
    }

    /// Where the link to P rank `rank` of the engine behind `handle` stands;
    /// `None` when this sender has no state for it.
    pub fn peer_status(&self, handle: EngineHandle, rank: u32) -> Option<PeerStatus> {
        let slot = self.slots.get(handle.index as usize)?;
        if !slot.used || slot.generation != handle.generation {
            return None;
        }
        let k = slot.targets.position(rank)?;
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
        HeartbeatSender::step_all(core::slice::from_mut(self), tracker, now)
    }

    /// A whole step for several D ranks in this process (one sender each)
    /// served by one tracker: every sender gets the tracker's "gone"
    /// notices and every planned engine (the tracker's `due` throttles, so
    /// it must be one pass for all), each finishes its step, and every
    /// sender's owed engines go back to the tracker. This is the only
    /// correct order; doing it by hand, a forgotten `finish_step` or
    /// `request_engines` silently stops deferred heartbeats. Returns the
    /// senders' reports summed (`last_error`: the last sender's with one).
    pub fn step_all(
        senders: &mut [HeartbeatSender<F, A>],
        tracker: &mut HeartbeatTracker,
        now: Instant,
    ) -> StepReport {
        tracker.take_gone(|handle| {
            for s in senders.iter_mut() {
                s.engine_gone(handle);
            }
        });
        tracker.due(now, |batch| {
            for s in senders.iter_mut() {
                // Errors are counted and kept for the report.
                let _ = s.send_due(&batch, now);
            }
        });
        let mut sum = StepReport::default();
        for s in senders.iter_mut() {
            let r = s.finish_step(now);
            sum.engines_due = sum.engines_due.max(r.engines_due);
            sum.engines_owed += r.engines_owed;
            sum.messages_sent += r.messages_sent;
            sum.peers_owed += r.peers_owed;
            sum.last_error = r.last_error.or(sum.last_error);
            tracker.request_engines(s.owed_engines());
        }
        sum
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
        self.finish_step(now)
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
    /// peers still owed a heartbeat and the step's last error. Polls the
    /// pending handshakes of owed peers (those started before this step;
    /// one started during the step is polled from the next one on) and
    /// decides which owed engines the next plan must carry
    /// ([`HeartbeatSender::owed_engines`]).
    pub fn finish_step(&mut self, now: Instant) -> StepReport {
        self.poll_owed(now);
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

    /// The owed engines the next plan must carry, as of the last
    /// [`HeartbeatSender::finish_step`]: some P rank of each is owed a
    /// heartbeat and can take it (its handshake is ready) or needs a retry
    /// (its backoff ran out). Report them to the tracker
    /// ([`HeartbeatTracker::request_engines`]; the owed section of the
    /// outcome message). Engines whose owed peers are only pending or
    /// backing off are not listed: the sender waits on them without a plan
    /// (module docs, "Owed heartbeats").
    pub fn owed_engines(&self) -> OwedEngines<'_> {
        OwedEngines {
            sender_slots: &self.slots,
            owed: &self.ripe,
            next: 0,
        }
    }

    /// Engines with some P rank still owed a heartbeat, ripe or not.
    pub fn engines_owed(&self) -> u32 {
        self.owed.len()
    }
}
