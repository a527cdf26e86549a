//! An engine-shaped deployment, written once and run two ways: the P engine
//! is a scheduler plus two workers (TP 2), the D engine a scheduler plus one
//! worker (TP 1), and the five talk exactly as an engine's processes do:
//! role messages as bytes between each scheduler and its workers (the
//! engine's IPC), notifications and READs over the fabric between workers.
//!
//! - `tests/it/cluster_loopback.rs`: all five nodes in one process on the
//!   loopback fabric, in virtual time: deterministic, bounds to one step.
//! - `tests/it/cluster_nixl.rs`: five processes (this test binary re-executed
//!   with a role), the role messages crossing pipes through a hub (the
//!   test process, standing in for the engines' IPC), the workers on real
//!   NIXL agents, in real time.
//!
//! A scenario body (the `pub fn`s taking `&mut impl Cluster`) only sends
//! commands (the router's and the engines' decisions: "prefill done",
//! "track", "load", a fault) and reads the stamped events the nodes emit
//! (grants, rank releases, releases, verdicts). It never reaches into a node.
//!
//! ```text
//!            directives (bytes)                 plan (bytes)
//!   P sched ───────────────▶ P rank 0, 1   D sched ──────────▶ D worker
//!           ◀─────────────── reports            ◀──────────  outcomes
//!                                P rank r ◀── HB / HBC / read-done, block and slot READs ── D worker
//! ```

#![allow(dead_code)]
// each test binary uses part of it
// Registered buffers are plain std atomics here: the loom rule is the library's.
#![allow(clippy::disallowed_types)]

use core::fmt;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::pipes::{parse_reason, reason_text};
use kvlease::consumer::{
    EngineKey, HeartbeatSender, HeartbeatTracker, LeaseVerifier, RemotePrefillParams, SenderConfig,
    Verdict, VerifyTarget,
};
use kvlease::fabric::{
    AgentId, Fabric, HandshakeState, PeerInfo, ReadDesc, RegionId, XferId, XferState,
};
use kvlease::ipc::outcome::{self, Outcome, OutcomeMsg};
use kvlease::ipc::plan::HeartbeatPlan;
use kvlease::ipc::report::ReportMsg;
use kvlease::ipc::MsgKind;
use kvlease::testkit::six_second_leases;
use kvlease::{
    wire, Instant, LeaseConfig, LeaseFields, LeaseSlots, Nonce, PrefillRank, PrefillScheduler,
    ReleaseReason,
};

/// The process hub: the deployment as separate processes over real NIXL.
#[cfg(feature = "nixl")]
pub mod process;

/// P's `remote_engine_id`.
pub const ENGINE_ID: &str = "prefill-0";
/// P's tensor-parallel size.
pub const P_TP: u32 = 2;
/// One engine step.
pub const STEP: Duration = Duration::from_millis(50);
/// Words per KV block in each P rank's registered buffer.
pub const BLOCK_WORDS: usize = 16;
/// KV blocks in each P rank's registered buffer.
pub const BLOCKS: usize = 4;

/// Word `i` of P rank `rank`'s KV buffer: distinct, non-zero.
pub fn kv_word(rank: u32, i: usize) -> u64 {
    0xB10C_0000_0000_0000 | (u64::from(rank) << 40) | ((i as u64) << 16) | 0x5A5A
}

/// The deployment's lease settings: the shortest lease the config accepts,
/// 6 s (heartbeat interval 1 s, extension 4 s), so real-time runs stay short.
pub fn lease_config() -> LeaseConfig {
    six_second_leases(24, 8)
}

// ---- roles, commands, events -----------------------------------------------------------

/// Who a node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The P engine's scheduler.
    PSched,
    /// P worker `r`.
    PRank(u32),
    /// The D engine's scheduler.
    DSched,
    /// The D worker.
    DWorker,
}

impl Role {
    /// Every node of the deployment.
    pub const ALL: [Role; 5] = [
        Role::PSched,
        Role::PRank(0),
        Role::PRank(1),
        Role::DSched,
        Role::DWorker,
    ];

    /// The role's name on a command line (`p-sched`, `p-rank-0`, ...).
    pub fn name(self) -> String {
        match self {
            Role::PSched => "p-sched".into(),
            Role::PRank(r) => format!("p-rank-{r}"),
            Role::DSched => "d-sched".into(),
            Role::DWorker => "d-worker".into(),
        }
    }

    /// The inverse of [`Role::name`].
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "p-sched" => Some(Role::PSched),
            "d-sched" => Some(Role::DSched),
            "d-worker" => Some(Role::DWorker),
            _ => s.strip_prefix("p-rank-")?.parse().ok().map(Role::PRank),
        }
    }

    /// Whether the node owns a fabric agent.
    pub fn is_worker(self) -> bool {
        matches!(self, Role::PRank(_) | Role::DWorker)
    }
}

/// Where a role message goes: by its kind (and, for reports, its sender).
pub fn route(msg: &[u8]) -> Vec<Role> {
    let kind = msg
        .get(6..8)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .unwrap_or(0);
    if kind == MsgKind::Directives.code() {
        (0..P_TP).map(Role::PRank).collect()
    } else if kind == MsgKind::RankReports.code() {
        vec![Role::PSched]
    } else if kind == MsgKind::HeartbeatPlan.code() {
        vec![Role::DWorker]
    } else if kind == MsgKind::VerifyOutcomes.code() {
        vec![Role::DSched]
    } else {
        Vec::new()
    }
}

/// A decision from outside the lease machinery: the router's, the engine's
/// or the test's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cmd {
    /// P scheduler: the prefill of `id` completed: grant its lease.
    Prefill(String),
    /// P worker: lose (or stop losing) every notification it receives.
    Deaf(bool),
    /// D scheduler and worker: P rank `rank` is at `addr` (the handshake
    /// address; the engine's own discovery in real life).
    Peer(u32, String),
    /// D scheduler: request `d_id` arrived for P's `p_id` with these lease
    /// fields: start heartbeating.
    Track {
        /// D's request id.
        d_id: String,
        /// P's request id.
        p_id: String,
        /// P's lease fields, if it exported them.
        lease: Option<LeaseFields>,
    },
    /// D worker: pull `d_id`'s KV (blocks from every P rank), verify it, send
    /// the read-dones.
    Load {
        /// D's request id.
        d_id: String,
        /// P's request id.
        p_id: String,
        /// P's lease fields.
        lease: Option<LeaseFields>,
    },
}

fn lease_text(l: Option<LeaseFields>) -> String {
    match l {
        Some(f) => format!("{} {}", f.slot, f.nonce.get()),
        None => "- -".into(),
    }
}

fn parse_lease(slot: &str, nonce: &str) -> Option<LeaseFields> {
    LeaseFields::from_params(slot.parse().ok(), nonce.parse().ok())
}

impl fmt::Display for Cmd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cmd::Prefill(id) => write!(f, "prefill {id}"),
            Cmd::Deaf(on) => write!(f, "deaf {}", u8::from(*on)),
            Cmd::Peer(r, a) => write!(f, "peer {r} {a}"),
            Cmd::Track { d_id, p_id, lease } => {
                write!(f, "track {d_id} {p_id} {}", lease_text(*lease))
            }
            Cmd::Load { d_id, p_id, lease } => {
                write!(f, "load {d_id} {p_id} {}", lease_text(*lease))
            }
        }
    }
}

impl Cmd {
    /// The inverse of `Display`.
    pub fn parse(line: &str) -> Option<Cmd> {
        let w: Vec<&str> = line.split_whitespace().collect();
        Some(match w.as_slice() {
            ["prefill", id] => Cmd::Prefill(id.to_string()),
            ["deaf", on] => Cmd::Deaf(*on == "1"),
            ["peer", r, a] => Cmd::Peer(r.parse().ok()?, a.to_string()),
            ["track", d, p, s, n] => Cmd::Track {
                d_id: d.to_string(),
                p_id: p.to_string(),
                lease: parse_lease(s, n),
            },
            ["load", d, p, s, n] => Cmd::Load {
                d_id: d.to_string(),
                p_id: p.to_string(),
                lease: parse_lease(s, n),
            },
            _ => return None,
        })
    }
}

/// What a node saw happen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A worker's agent is up at `addr`.
    Ready(Role, String),
    /// P scheduler: `id` leased, with these fields.
    Granted(String, Option<LeaseFields>),
    /// P rank `rank` let go of its share of lease `entry`/`nonce`, slot zeroed.
    RankReleased(u32, u32, u64, ReleaseReason),
    /// P rank `rank` renewed `n` leases from one heartbeat.
    Renewed(u32, u32),
    /// D worker: `n` heartbeat notifications left for P ranks in one step.
    HbSent(u64),
    /// P scheduler: every rank let go of `id`; blocks freed, slot returned.
    Released {
        /// The request.
        id: String,
        /// Why.
        reason: ReleaseReason,
        /// Its lease's nonce.
        nonce: u64,
        /// Its slot.
        slot: Option<u32>,
    },
    /// D worker: its verdict on `d_id` (`verified`, `lapsed`, ...).
    Loaded(String, String),
    /// D scheduler: the outcome applied to `d_id`.
    Outcome(String, String),
}

/// A verdict as one word.
pub fn verdict_text(v: Verdict) -> String {
    match v {
        Verdict::Verified => "verified".into(),
        Verdict::Lapsed => "lapsed".into(),
        Verdict::Unverifiable => "unverifiable".into(),
        Verdict::ReadFailed(e) => format!("read-failed:{}", format!("{e:?}").replace(' ', "")),
        other => format!("{other:?}").replace(' ', ""),
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Ready(role, addr) => write!(f, "ready {} {addr}", role.name()),
            Event::Granted(id, l) => write!(f, "granted {id} {}", lease_text(*l)),
            Event::RankReleased(r, e, n, why) => {
                write!(f, "rank-released {r} {e} {n} {}", reason_text(*why))
            }
            Event::Renewed(r, n) => write!(f, "renewed {r} {n}"),
            Event::HbSent(n) => write!(f, "hb-sent {n}"),
            Event::Released {
                id,
                reason,
                nonce,
                slot,
            } => write!(
                f,
                "released {id} {} {nonce} {}",
                reason_text(*reason),
                slot.map_or("-".to_string(), |s| s.to_string())
            ),
            Event::Loaded(d, v) => write!(f, "loaded {d} {v}"),
            Event::Outcome(d, v) => write!(f, "outcome {d} {v}"),
        }
    }
}

impl Event {
    /// The inverse of `Display`.
    pub fn parse(line: &str) -> Option<Event> {
        let w: Vec<&str> = line.split_whitespace().collect();
        Some(match w.as_slice() {
            ["ready", role, addr] => Event::Ready(Role::parse(role)?, addr.to_string()),
            ["granted", id, s, n] => Event::Granted(id.to_string(), parse_lease(s, n)),
            ["rank-released", r, e, n, why] => Event::RankReleased(
                r.parse().ok()?,
                e.parse().ok()?,
                n.parse().ok()?,
                parse_reason(why)?,
            ),
            ["renewed", r, n] => Event::Renewed(r.parse().ok()?, n.parse().ok()?),
            ["hb-sent", n] => Event::HbSent(n.parse().ok()?),
            ["released", id, why, n, s] => Event::Released {
                id: id.to_string(),
                reason: parse_reason(why)?,
                nonce: n.parse().ok()?,
                slot: s.parse().ok(),
            },
            ["loaded", d, v] => Event::Loaded(d.to_string(), v.to_string()),
            ["outcome", d, v] => Event::Outcome(d.to_string(), v.to_string()),
            _ => return None,
        })
    }
}

/// An event and when the hub saw it.
#[derive(Clone, Debug)]
pub struct Stamped {
    /// The hub's clock.
    pub at: Instant,
    /// When the emitting process produced it: its wall clock in ns since the
    /// Unix epoch (processes on one machine share it), for latencies across
    /// processes. 0 where all nodes share the hub's virtual clock.
    pub wall_ns: u64,
    /// Who emitted it.
    pub from: Role,
    /// What.
    pub event: Event,
}

/// What one node call produced: role messages to route, events to report.
#[derive(Default, Debug)]
pub struct Outbox {
    /// Role messages (routed by kind: [`route`]).
    pub msgs: Vec<Vec<u8>>,
    /// Events.
    pub events: Vec<Event>,
}

/// One process of the deployment.
pub trait Node {
    /// A command from outside.
    fn command(&mut self, cmd: &Cmd, now: Instant, out: &mut Outbox);
    /// A role message from its scheduler or worker.
    fn deliver(&mut self, from: Role, msg: &[u8], now: Instant, out: &mut Outbox);
    /// One engine step.
    fn step(&mut self, now: Instant, out: &mut Outbox);
}

/// `n` registrable words, leaked so that they outlive every fabric, set
/// to `init(i)`, and only ever touched through atomics.
pub fn leak_words(n: usize, init: impl Fn(usize) -> u64) -> &'static [AtomicU64] {
    Box::leak((0..n).map(|i| AtomicU64::new(init(i))).collect())
}

/// Registers leaked words with `f`.
pub fn register_words<F: Fabric>(f: &mut F, words: &'static [AtomicU64]) -> RegionId {
    // SAFETY: `words` is 'static (leaked), so it stays allocated and unmoved
    // past the fabric; it is only accessed through atomics, and only read
    // after the READs that write it have completed.
    unsafe { f.register_memory(words.as_ptr() as *mut u8, std::mem::size_of_val(words)) }
        .expect("register memory")
}

// ---- the P nodes ----------------------------------------------------------------------

/// The P engine's scheduler process.
pub struct PSchedNode {
    sched: PrefillScheduler,
    buf: Vec<u8>,
}

impl PSchedNode {
    /// A scheduler for [`P_TP`] ranks.
    pub fn new(config: &LeaseConfig, now: Instant) -> PSchedNode {
        PSchedNode {
            sched: PrefillScheduler::new(config, P_TP, now).expect("scheduler"),
            buf: vec![0; 1 << 16],
        }
    }
}

impl Node for PSchedNode {
    fn command(&mut self, cmd: &Cmd, now: Instant, out: &mut Outbox) {
        if let Cmd::Prefill(id) = cmd {
            let g = self.sched.grant(id, now).expect("grant");
            out.events
                .push(Event::Granted(id.clone(), g.lease_fields()));
        }
    }

    fn deliver(&mut self, from: Role, msg: &[u8], _now: Instant, _out: &mut Outbox) {
        if let Role::PRank(r) = from {
            self.sched
                .apply_reports(r, msg)
                .expect("a worker's reports decode");
        }
    }

    fn step(&mut self, now: Instant, out: &mut Outbox) {
        if self.sched.pending_directives() > 0 {
            let n = self
                .sched
                .encode_directives(now, &mut self.buf)
                .expect("directives fit");
            out.msgs.push(self.buf[..n].to_vec());
        }
        let mut tickets = Vec::new();
        self.sched.drain_released(|r| {
            out.events.push(Event::Released {
                id: r.request_id.to_owned(),
                reason: r.reason,
                nonce: r.nonce.get(),
                slot: r.slot.as_ref().map(|t| t.slot()),
            });
            tickets.extend(r.slot);
        });
        // The engine frees the blocks at once; then the slots may be reused.
        for t in tickets {
            self.sched.blocks_freed(t);
        }
    }
}

/// One P worker process: its rank role over its own agent.
pub struct PRankNode<F: Fabric> {
    rank: PrefillRank,
    fabric: F,
    deaf: bool,
    buf: Vec<u8>,
}

impl<F: Fabric> PRankNode<F> {
    /// Rank `r` on `fabric`: lease slots registered first (region 0), then a
    /// KV buffer of [`BLOCKS`] blocks (region 1).
    pub fn new(mut fabric: F, config: &LeaseConfig, r: u32, now: Instant) -> PRankNode<F> {
        let slots = Arc::new(LeaseSlots::new(config.lease_slots));
        let rank = PrefillRank::new(config, r, slots.clone(), now).expect("rank");
        fabric.register_slots(slots, true).expect("register slots");
        let kv = leak_words(BLOCKS * BLOCK_WORDS, |i| kv_word(r, i));
        register_words(&mut fabric, kv);
        PRankNode {
            buf: vec![0; rank.max_reports_len()],
            rank,
            fabric,
            deaf: false,
        }
    }

    /// The worker's agent.
    pub fn fabric(&self) -> &F {
        &self.fabric
    }
}

impl<F: Fabric> Node for PRankNode<F> {
    fn command(&mut self, cmd: &Cmd, _now: Instant, _out: &mut Outbox) {
        if let Cmd::Deaf(on) = cmd {
            self.deaf = *on;
        }
    }

    fn deliver(&mut self, _from: Role, msg: &[u8], now: Instant, _out: &mut Outbox) {
        self.rank
            .apply_directives(msg, now)
            .expect("the scheduler's directives decode");
    }

    fn step(&mut self, now: Instant, out: &mut Outbox) {
        let r = self.rank.rank();
        let (rank, deaf) = (&mut self.rank, self.deaf);
        let events = &mut out.events;
        self.fabric
            .drain_notifications(&mut |_from, msg| {
                if deaf {
                    return;
                }
                if let Ok(s) = rank.on_notification(_from, msg, now) {
                    if s.renewed > 0 {
                        events.push(Event::Renewed(r, s.renewed));
                    }
                }
            })
            .expect("P drains");
        self.rank.poll(now);
        if self.rank.pending_reports() > 0 {
            let n = self
                .rank
                .encode_reports(&mut self.buf)
                .expect("reports fit");
            let msg = self.buf[..n].to_vec();
            if let Ok(m) = ReportMsg::decode(&msg) {
                for rep in m.iter() {
                    out.events.push(Event::RankReleased(
                        r,
                        rep.entry,
                        rep.nonce.get(),
                        rep.reason,
                    ));
                }
            }
            out.msgs.push(msg);
        }
    }
}

// ---- the D nodes ----------------------------------------------------------------------

/// P ranks' handshake addresses, as the D engine's discovery learned them.
pub type Peers = Rc<RefCell<Vec<Option<String>>>>;

/// The D engine's scheduler process.
pub struct DSchedNode {
    tracker: HeartbeatTracker,
    buf: Vec<u8>,
}

impl DSchedNode {
    /// A tracker whose verdicts come from one worker (D TP 1).
    pub fn new(config: &LeaseConfig) -> DSchedNode {
        let tracker = HeartbeatTracker::new(config, 1).expect("tracker");
        DSchedNode {
            tracker,
            buf: vec![0; 1 << 16],
        }
    }
}

impl Node for DSchedNode {
    fn command(&mut self, cmd: &Cmd, now: Instant, _out: &mut Outbox) {
        if let Cmd::Track { d_id, p_id, lease } = cmd {
            let params = RemotePrefillParams {
                do_remote_prefill: true,
                remote_engine_id: Some(ENGINE_ID),
                remote_request_id: Some(p_id),
                // The D worker resolves P ranks through its peer table.
                remote_host: Some("p-engine"),
                remote_port: Some(1),
                tp_size: Some(P_TP),
                remote_lease_slot: lease.map(|l| l.slot),
                remote_lease_nonce: lease.map(|l| l.nonce.as_int64()),
                ..Default::default()
            };
            self.tracker
                .on_new_request(d_id, &params, now)
                .expect("tracked");
        }
    }

    fn deliver(&mut self, _from: Role, msg: &[u8], _now: Instant, out: &mut Outbox) {
        let msg = OutcomeMsg::decode(msg).expect("the worker's outcomes decode");
        self.tracker
            .apply_outcomes(&msg, |id, v| {
                out.events
                    .push(Event::Outcome(id.to_owned(), verdict_text(v)))
            })
            .expect("outcomes apply");
    }

    fn step(&mut self, now: Instant, out: &mut Outbox) {
        let n = self
            .tracker
            .encode_plan(now, &mut self.buf)
            .expect("the plan fits");
        let plan = HeartbeatPlan::decode(&self.buf[..n]).expect("own plan decodes");
        if !plan.is_empty() || plan.gone().len() > 0 {
            out.msgs.push(self.buf[..n].to_vec());
        }
    }
}

/// The D worker's handshake address writer: P rank `rank` of any engine is
/// wherever the peer table says.
pub type DAddress = Box<dyn Fn(&EngineKey<'_>, u32, &mut dyn fmt::Write) -> fmt::Result>;

#[derive(Debug)]
enum Stage {
    /// Waiting for every P rank's handshake.
    Handshake,
    /// Block READs in flight, one per P rank.
    Reading(Vec<Option<XferId>>),
    /// Submitted to the verifier.
    Verifying,
}

struct Load {
    d_id: String,
    p_id: String,
    lease: Option<LeaseFields>,
    stage: Stage,
    failed: Option<Verdict>,
}

/// One D worker process: heartbeat sender, block READs, lease verifier.
pub struct DWorkerNode<F: Fabric> {
    sender: HeartbeatSender<F, DAddress>,
    verifier: LeaseVerifier,
    peers: Peers,
    agents: Vec<Option<(AgentId, Option<PeerInfo>)>>,
    landing: &'static [AtomicU64],
    landing_region: RegionId,
    loads: Vec<Load>,
    outcomes: Vec<(String, Verdict)>,
    buf: Vec<u8>,
    seq: u32,
}

impl<F: Fabric> DWorkerNode<F> {
    /// D worker 0 of TP 1 on `fabric`.
    pub fn new(fabric: F, config: &LeaseConfig) -> DWorkerNode<F> {
        let peers: Peers = Rc::new(RefCell::new(vec![None; P_TP as usize]));
        let table = peers.clone();
        let address: DAddress = Box::new(move |_key, rank, out| {
            match table.borrow().get(rank as usize).and_then(Option::as_ref) {
                Some(a) => out.write_str(a),
                None => Err(fmt::Error),
            }
        });
        let mut sender = HeartbeatSender::new(fabric, address, SenderConfig::new(config, 1, 0))
            .expect("D sender");
        let verifier = LeaseVerifier::new(
            sender.fabric_mut(),
            &kvlease::testkit::verifier_config(64, 8),
        )
        .expect("verifier");
        let landing = leak_words(P_TP as usize * BLOCK_WORDS, |_| 0);
        let landing_region = register_words(sender.fabric_mut(), landing);
        DWorkerNode {
            sender,
            verifier,
            peers,
            agents: vec![None; P_TP as usize],
            landing,
            landing_region,
            loads: Vec::new(),
            outcomes: Vec::new(),
            buf: vec![0; 1 << 16],
            seq: 0,
        }
    }

    /// The worker's agent.
    pub fn fabric(&mut self) -> &mut F {
        self.sender.fabric_mut()
    }

    /// P rank `r`'s agent once its handshake completed; starts it otherwise.
    /// `Err` when it failed.
    fn agent(&mut self, r: u32, now: Instant) -> Result<Option<(AgentId, PeerInfo)>, Verdict> {
        let addr = self.peers.borrow()[r as usize].clone();
        let Some(addr) = addr else {
            return Ok(None);
        };
        let fabric = self.sender.fabric_mut();
        let (id, info) = match self.agents[r as usize] {
            Some(a) => a,
            None => {
                let id = fabric
                    .start_handshake(&addr, now)
                    .map_err(Verdict::ReadFailed)?;
                self.agents[r as usize] = Some((id, None));
                (id, None)
            }
        };
        if let Some(info) = info {
            return Ok(Some((id, info)));
        }
        match fabric.handshake_state(id, now) {
            HandshakeState::Pending => Ok(None),
            HandshakeState::Ready(info) => {
                self.agents[r as usize] = Some((id, Some(info)));
                Ok(Some((id, info)))
            }
            HandshakeState::Failed(e) => {
                // Forget it: a later load starts over.
                self.agents[r as usize] = None;
                Err(Verdict::ReadFailed(e))
            }
        }
    }

    fn advance(&mut self, k: usize, now: Instant) {
        match &self.loads[k].stage {
            Stage::Handshake => {
                let mut ready = Vec::new();
                for r in 0..P_TP {
                    match self.agent(r, now) {
                        Ok(Some(a)) => ready.push(a),
                        Ok(None) => {}
                        Err(v) => {
                            self.loads[k].failed = Some(v);
                            return;
                        }
                    }
                }
                if ready.len() < P_TP as usize {
                    return;
                }
                let mut xfers = Vec::new();
                for (r, (agent, _)) in ready.iter().enumerate() {
                    let desc = ReadDesc {
                        local: self.landing_region,
                        local_offset: (r * BLOCK_WORDS * 8) as u64,
                        remote: RegionId(1),
                        remote_offset: 0,
                        len: (BLOCK_WORDS * 8) as u64,
                    };
                    match self
                        .sender
                        .fabric_mut()
                        .post_read(*agent, &[desc], None, now)
                    {
                        Ok(x) => xfers.push(Some(x)),
                        Err(e) => {
                            self.loads[k].failed = Some(Verdict::ReadFailed(e));
                            return;
                        }
                    }
                }
                self.loads[k].stage = Stage::Reading(xfers);
            }
            Stage::Reading(xfers) => {
                let mut xfers = xfers.clone();
                for x in xfers.iter_mut() {
                    if let Some(id) = *x {
                        match self.sender.fabric_mut().read_state(id, now) {
                            XferState::InProgress => {}
                            XferState::Done => *x = None,
                            XferState::Failed(e) => {
                                self.loads[k].failed = Some(Verdict::ReadFailed(e));
                                return;
                            }
                        }
                    }
                }
                if xfers.iter().any(Option::is_some) {
                    self.loads[k].stage = Stage::Reading(xfers);
                    return;
                }
                // Every block READ completed: now the slot check, on every rank.
                let targets: Vec<VerifyTarget> = self
                    .agents
                    .iter()
                    .filter_map(|a| a.and_then(|(id, info)| VerifyTarget::from_peer(id, &info?)))
                    .collect();
                let lease = self.loads[k].lease;
                match self.verifier.submit(k as u64, lease, &targets) {
                    Ok(()) => self.loads[k].stage = Stage::Verifying,
                    Err(_) => self.loads[k].failed = Some(Verdict::Unverifiable),
                }
            }
            Stage::Verifying => {}
        }
    }

    /// The load's verdict is in: report it, and tell every P rank the READ
    /// is done (with the nonce), whatever the verdict.
    fn finish(&mut self, k: usize, verdict: Verdict, out: &mut Outbox) {
        if matches!(verdict, Verdict::ReadFailed(_)) {
            // The fabric failed the peer (a READ that failed or timed out):
            // the next load handshakes again, as an engine would.
            self.agents.iter_mut().for_each(|a| *a = None);
        }
        let load = &self.loads[k];
        if verdict == Verdict::Verified {
            // A verified load must hold P's blocks, word for word.
            for r in 0..P_TP as usize {
                for i in 0..BLOCK_WORDS {
                    let got = self.landing[r * BLOCK_WORDS + i].load(Ordering::Acquire);
                    assert_eq!(got, kv_word(r as u32, i), "verified, but not P's KV");
                }
            }
        }
        out.events
            .push(Event::Loaded(load.d_id.clone(), verdict_text(verdict)));
        self.outcomes.push((load.d_id.clone(), verdict));
        let mut done = [0u8; 256];
        let nonce: Option<Nonce> = load.lease.map(|l| l.nonce);
        if let Ok(n) = wire::encode_read_done(&load.p_id, 1, nonce, &mut done) {
            for (id, _) in self.agents.iter().flatten() {
                let _ = self.sender.fabric_mut().send_notification(*id, &done[..n]);
            }
        }
        self.loads[k].stage = Stage::Verifying;
        self.loads[k].d_id.clear();
    }
}

impl<F: Fabric> Node for DWorkerNode<F> {
    fn command(&mut self, cmd: &Cmd, _now: Instant, _out: &mut Outbox) {
        match cmd {
            Cmd::Peer(r, addr) => {
                if let Some(p) = self.peers.borrow_mut().get_mut(*r as usize) {
                    if p.as_ref() != Some(addr) {
                        // A new incarnation of the rank: its agent, metadata
                        // and memory are new, so handshake again.
                        self.agents[*r as usize] = None;
                    }
                    *p = Some(addr.clone());
                }
            }
            Cmd::Load { d_id, p_id, lease } => self.loads.push(Load {
                d_id: d_id.clone(),
                p_id: p_id.clone(),
                lease: *lease,
                stage: Stage::Handshake,
                failed: None,
            }),
            _ => {}
        }
    }

    fn deliver(&mut self, _from: Role, msg: &[u8], now: Instant, out: &mut Outbox) {
        let plan = HeartbeatPlan::decode(msg).expect("the scheduler's plan decodes");
        let before = self.sender.counters().messages_sent;
        self.sender.send_plan(&plan, now);
        let sent = self.sender.counters().messages_sent - before;
        if sent > 0 {
            out.events.push(Event::HbSent(sent));
        }
    }

    fn step(&mut self, now: Instant, out: &mut Outbox) {
        for k in 0..self.loads.len() {
            if self.loads[k].d_id.is_empty() {
                continue;
            }
            self.advance(k, now);
            if let Some(v) = self.loads[k].failed.take() {
                self.finish(k, v, out);
            }
        }
        let mut verdicts = Vec::new();
        let (verifier, sender) = (&mut self.verifier, &mut self.sender);
        verifier.step(sender.fabric_mut(), now, |token, v| {
            verdicts.push((token, v))
        });
        for (token, v) in verdicts {
            self.finish(token as usize, v, out);
        }
        // Engine-loop progress: a worker drains its agent every step.
        self.sender
            .fabric_mut()
            .drain_notifications(&mut |_, _| {})
            .expect("D drains");
        let owed: Vec<_> = self.sender.owed_engines().collect();
        if !self.outcomes.is_empty() || !owed.is_empty() {
            let n = outcome::encode(
                &mut self.buf,
                0,
                self.seq,
                self.outcomes.iter().map(|(id, v)| Outcome {
                    request_id: id,
                    verdict: *v,
                }),
                owed,
            )
            .expect("outcomes fit");
            out.msgs.push(self.buf[..n].to_vec());
            self.outcomes.clear();
            self.seq = self.seq.wrapping_add(1);
        }
    }
}

// ---- the deployment, as a scenario sees it --------------------------------------------

/// A running deployment. See the module docs.
pub trait Cluster {
    /// The hub's clock.
    fn now(&self) -> Instant;
    /// Sends `cmd` to the node playing `role`.
    fn command(&mut self, role: Role, cmd: Cmd);
    /// Lets one engine step pass (virtual: exactly [`STEP`]; real: a brief
    /// wait while the processes run), collecting events and routing messages.
    fn tick(&mut self);
    /// Every event so far, in the order the hub saw them.
    fn events(&self) -> &[Stamped];
    /// The node playing `role` dies: no goodbye, nothing drained.
    fn kill(&mut self, role: Role);
    /// How much later than a protocol bound an event may be observed.
    fn slack(&self) -> Duration;
}

/// Ticks until `done` holds on the events or `limit` passed; whether it held.
pub fn run_until<C: Cluster>(
    c: &mut C,
    limit: Duration,
    mut done: impl FnMut(&[Stamped]) -> bool,
) -> bool {
    let end = c.now() + limit;
    loop {
        if done(c.events()) {
            return true;
        }
        if c.now() > end {
            return false;
        }
        c.tick();
    }
}

/// Ticks for `d`.
pub fn run_for<C: Cluster>(c: &mut C, d: Duration) {
    let end = c.now() + d;
    while c.now() < end {
        c.tick();
    }
}

/// The first event matching `pred`.
pub fn find(events: &[Stamped], pred: impl Fn(&Event) -> bool) -> Option<Stamped> {
    events.iter().find(|s| pred(&s.event)).cloned()
}

/// Waits for the first event matching `pred`, for at most `limit`.
pub fn wait_for<C: Cluster>(
    c: &mut C,
    limit: Duration,
    what: &str,
    pred: impl Fn(&Event) -> bool,
) -> Stamped {
    if !run_until(c, limit, |ev| ev.iter().any(|s| pred(&s.event))) {
        panic!("no {what} within {limit:?}; events: {:#?}", c.events());
    }
    find(c.events(), pred).expect("found")
}

/// P grants `id` (its prefill is done); returns its lease fields.
pub fn prefill<C: Cluster>(c: &mut C, id: &str) -> LeaseFields {
    c.command(Role::PSched, Cmd::Prefill(id.into()));
    let g = wait_for(
        c,
        Duration::from_secs(5),
        "grant",
        |e| matches!(e, Event::Granted(x, _) if x == id),
    );
    match g.event {
        Event::Granted(_, Some(l)) => l,
        other => panic!("{id} granted without lease fields: {other:?}"),
    }
}

fn is_rank_release(e: &Event, rank: u32, lease: LeaseFields) -> Option<ReleaseReason> {
    match e {
        Event::RankReleased(r, entry, nonce, why)
            if *r == rank && *entry == lease.slot && *nonce == lease.nonce.get() =>
        {
            Some(*why)
        }
        _ => None,
    }
}

fn is_release(e: &Event, id: &str) -> bool {
    matches!(e, Event::Released { id: x, .. } if x == id)
}

/// Issue 7, case 1: the happy path. D tracks the request from arrival and
/// heartbeats both P ranks for longer than the initial lease; then it pulls
/// the blocks from both ranks, verifies on both, and sends the read-dones;
/// each rank lets go (read), and only then does the scheduler free the blocks.
pub fn happy_path_verified_end_to_end<C: Cluster>(c: &mut C) {
    let config = lease_config();
    let lease = prefill(c, "req-happy");
    let granted = c.now();
    c.command(
        Role::DSched,
        Cmd::Track {
            d_id: "d-happy".into(),
            p_id: "req-happy".into(),
            lease: Some(lease),
        },
    );
    // Queued on D for 1.5 initial leases: heartbeats keep both ranks holding.
    run_for(c, config.lease_duration() * 3 / 2);
    let ev = c.events();
    assert!(
        find(ev, |e| matches!(
            e,
            Event::RankReleased(..) | Event::Released { .. }
        ))
        .is_none(),
        "a heartbeated lease was released: {ev:#?}"
    );
    for r in 0..P_TP {
        assert!(
            find(ev, |e| matches!(e, Event::Renewed(x, _) if *x == r)).is_some(),
            "rank {r} heard no heartbeat"
        );
    }
    assert!(c.now() > granted + config.lease_duration());
    c.command(
        Role::DWorker,
        Cmd::Load {
            d_id: "d-happy".into(),
            p_id: "req-happy".into(),
            lease: Some(lease),
        },
    );
    let limit = Duration::from_secs(10);
    wait_for(
        c,
        limit,
        "D's verdict",
        |e| matches!(e, Event::Loaded(d, v) if d == "d-happy" && v == "verified"),
    );
    wait_for(
        c,
        limit,
        "the D scheduler's outcome",
        |e| matches!(e, Event::Outcome(d, v) if d == "d-happy" && v == "verified"),
    );
    let released = wait_for(c, limit, "the release", |e| is_release(e, "req-happy"));
    let ev = c.events();
    for r in 0..P_TP {
        let share = find(ev, |e| is_rank_release(e, r, lease).is_some())
            .unwrap_or_else(|| panic!("rank {r} never let go"));
        assert_eq!(
            is_rank_release(&share.event, r, lease),
            Some(ReleaseReason::ReadDone)
        );
        assert!(share.at <= released.at, "freed before rank {r} let go");
    }
    assert_eq!(
        released.event,
        Event::Released {
            id: "req-happy".into(),
            reason: ReleaseReason::ReadDone,
            nonce: lease.nonce.get(),
            slot: Some(lease.slot),
        }
    );
}

/// Issue 7, case 2: every notification to P rank 1 is lost. Rank 1 expires on
/// its own and zeroes its slot while rank 0, heartbeated, holds on; D's load
/// then fails its check on rank 1 (fail closed); the blocks are freed only
/// after both ranks reported; and the slot is handed out again only after
/// that.
pub fn deaf_rank_expires_alone_and_the_load_fails<C: Cluster>(c: &mut C) {
    let config = lease_config();
    c.command(Role::PRank(1), Cmd::Deaf(true));
    let lease = prefill(c, "req-deaf");
    let granted = c.now();
    c.command(
        Role::DSched,
        Cmd::Track {
            d_id: "d-deaf".into(),
            p_id: "req-deaf".into(),
            lease: Some(lease),
        },
    );
    let bound = config.lease_duration() + config.wheel_tick() + STEP + c.slack();
    let lapsed = wait_for(c, bound + Duration::from_secs(5), "rank 1's expiry", |e| {
        is_rank_release(e, 1, lease) == Some(ReleaseReason::Expired)
    });
    assert!(
        lapsed.at >= granted + config.lease_duration(),
        "rank 1 expired early"
    );
    assert!(
        lapsed.at <= granted + bound,
        "rank 1 expired late: {:?} after the grant",
        lapsed.at.saturating_duration_since(granted)
    );
    // Another prefill while rank 0 still holds: it must not get the slot.
    let other = prefill(c, "req-other");
    assert_ne!(other.slot, lease.slot, "slot reused while rank 0 holds it");
    let ev = c.events();
    assert!(find(ev, |e| is_rank_release(e, 0, lease).is_some()).is_none());
    assert!(find(ev, |e| is_release(e, "req-deaf")).is_none());

    c.command(
        Role::DWorker,
        Cmd::Load {
            d_id: "d-deaf".into(),
            p_id: "req-deaf".into(),
            lease: Some(lease),
        },
    );
    let limit = Duration::from_secs(10);
    let verdict = wait_for(
        c,
        limit,
        "D's verdict",
        |e| matches!(e, Event::Loaded(d, _) if d == "d-deaf"),
    );
    assert_eq!(
        verdict.event,
        Event::Loaded("d-deaf".into(), "lapsed".into()),
        "rank 1 zeroed its slot: the check must fail"
    );
    wait_for(
        c,
        limit,
        "the failed outcome",
        |e| matches!(e, Event::Outcome(d, v) if d == "d-deaf" && v == "lapsed"),
    );
    let released = wait_for(c, limit, "the release", |e| is_release(e, "req-deaf"));
    let rank0 = find(c.events(), |e| is_rank_release(e, 0, lease).is_some()).expect("rank 0");
    assert_eq!(
        is_rank_release(&rank0.event, 0, lease),
        Some(ReleaseReason::ReadDone)
    );
    assert!(rank0.at <= released.at && lapsed.at <= released.at);
    assert!(
        matches!(&released.event, Event::Released { reason: ReleaseReason::Expired, slot, .. } if *slot == Some(lease.slot)),
        "{released:?}"
    );
    // Now, and only now, the slot may go to a new lease (the pool hands out
    // the most recently freed slot first).
    let next = prefill(c, "req-next");
    assert_eq!(next.slot, lease.slot, "the freed slot is reused");
    assert_ne!(next.nonce, lease.nonce);
}

/// Issue 7, case 3: the D worker process is killed while it heartbeats.
/// Both P ranks reclaim within extension + one interval of the kill.
pub fn killed_d_worker_is_reclaimed_by_both_ranks<C: Cluster>(c: &mut C) {
    let config = lease_config();
    let (interval, extension) = (config.heartbeat_interval(), config.lease_extension());
    let lease = prefill(c, "req-dkill");
    c.command(
        Role::DSched,
        Cmd::Track {
            d_id: "d-dkill".into(),
            p_id: "req-dkill".into(),
            lease: Some(lease),
        },
    );
    // Past the initial lease, heartbeated; the kill half an interval off the
    // heartbeat phase.
    run_for(c, config.lease_duration() + interval / 2);
    assert!(find(c.events(), |e| is_rank_release(e, 0, lease).is_some()).is_none());
    c.kill(Role::DWorker);
    let killed = c.now();
    let bound = extension + interval + config.wheel_tick() + STEP + c.slack();
    let released = wait_for(c, bound + Duration::from_secs(5), "the release", |e| {
        is_release(e, "req-dkill")
    });
    for r in 0..P_TP {
        let share = find(c.events(), |e| is_rank_release(e, r, lease).is_some()).expect("share");
        assert_eq!(
            is_rank_release(&share.event, r, lease),
            Some(ReleaseReason::Expired)
        );
        let took = share.at.saturating_duration_since(killed);
        assert!(
            took <= bound,
            "rank {r} reclaimed {took:?} after the kill (bound {bound:?})"
        );
    }
    assert!(matches!(
        released.event,
        Event::Released {
            reason: ReleaseReason::Expired,
            ..
        }
    ));
}

/// Issue 7, case 4: P worker 1's process is killed. D's pull cannot prove
/// the lease on rank 1: the READ or the slot check fails with a typed
/// error, and nothing is accepted.
pub fn killed_p_rank_fails_the_load<C: Cluster>(c: &mut C) {
    let lease = prefill(c, "req-pkill");
    c.command(
        Role::DSched,
        Cmd::Track {
            d_id: "d-pkill".into(),
            p_id: "req-pkill".into(),
            lease: Some(lease),
        },
    );
    run_for(c, Duration::from_secs(2));
    c.kill(Role::PRank(1));
    c.command(
        Role::DWorker,
        Cmd::Load {
            d_id: "d-pkill".into(),
            p_id: "req-pkill".into(),
            lease: Some(lease),
        },
    );
    let verdict = wait_for(
        c,
        Duration::from_secs(15),
        "D's verdict",
        |e| matches!(e, Event::Loaded(d, _) if d == "d-pkill"),
    );
    let Event::Loaded(_, v) = &verdict.event else {
        unreachable!()
    };
    assert!(
        v.starts_with("read-failed") || v == "lapsed",
        "a load from a dead rank must fail, got {v}"
    );
    wait_for(
        c,
        Duration::from_secs(5),
        "the failed outcome",
        |e| matches!(e, Event::Outcome(d, x) if d == "d-pkill" && x != "verified"),
    );
    assert!(
        find(
            c.events(),
            |e| matches!(e, Event::Loaded(_, v) | Event::Outcome(_, v) if v == "verified")
        )
        .is_none(),
        "nothing may be accepted"
    );
}
