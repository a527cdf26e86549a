//! The loopback fabric: several agents in one process, on one thread or
//! many, with deterministic fault injection. For tests and the simulator.
//!
//! This module owns [`LoopbackNetwork`] (the shared world: agents, their
//! queues and registered memory, the virtual clock, the fault tables) and
//! [`LoopbackFabric`] (one agent, implementing [`Fabric`]). It holds no lease
//! logic and may not touch lease words except through
//! [`LeaseSlots::load`]. Submodules, one concept each: `queue` (the lock-free
//! notification ring), `inbox` (delivery order, delayed messages), `faults`
//! (fault settings and seeded draws), `liveness` (crash/restart/drop),
//! `memory` (region tables, the READ copy), `reads` (the in-flight table).
//!
//! # Time
//!
//! The core never reads a clock and neither does this fabric. The network
//! keeps a *virtual clock*: the latest `now` any agent passed to a method that
//! takes one (or that the controller set with [`LoopbackNetwork::advance_to`]).
//! Callers pass the shared virtual time as `now`. An agent's *own* clock, the
//! one it reports in handshakes, is virtual time plus its configured offset
//! ([`LoopbackNetwork::set_clock_offset`]), so [`crate::clock_offset`] has an
//! offset to find. Delayed notifications are released by the first drain at or after
//! their due virtual time.
//!
//! # What happens when
//!
//! - **Handshake.** `start_handshake(name)` resolves the agent by name at
//!   once (unknown name: `BadAddress`) and completes on the `handshake_state`
//!   poll that is at least the [`LoopbackConfig::handshake_polls`]-th one and
//!   at least [`LoopbackConfig::handshake_latency`] after the start. If the
//!   link is down then, it fails with `PeerUnreachable`. The remote's clock
//!   sample is taken at the midpoint of start and completion.
//! - **Notification.** `send_notification` draws the message's fate (drop,
//!   delay, reorder, deliver) and copies it into the receiver's ring; a full
//!   ring is `Full`. The receiver's `drain_notifications` lends the bytes from
//!   the ring cell. No allocation on either side.
//! - **READ.** `post_read` checks every descriptor against both agents'
//!   region tables (typed errors) and records it. It completes on the first
//!   `read_state` poll with `now >= post + read_latency (+ injected delay)`
//!   while the link is up, and only then copies the bytes and sends the
//!   attached notification: a slot that changes between post and completion
//!   is seen changed. Past [`LoopbackConfig::transfer_timeout`] it is
//!   `Failed(TimedOut)`.
//!
//! # Faults
//!
//! Controlled from any thread through the network: per directed link
//! [`NotificationFaults`] and [`ReadFaults`] (probabilities), "drop the next
//! N" / "fail the next N", [`LoopbackNetwork::partition`] /
//! [`LoopbackNetwork::heal`] (both directions), and per agent
//! [`LoopbackNetwork::crash`] / [`LoopbackNetwork::restart`]. A link is
//! *down* while either end is crashed or the pair is partitioned:
//!
//! - sends over it fail with `PeerUnreachable` (or are silently lost, see
//!   [`UnreachableSends`]);
//! - READs over it make no progress (they complete if it comes back in time,
//!   else time out);
//! - handshakes over it fail.
//!
//! A crashed agent drains nothing. When it restarts it is a new incarnation:
//! what was queued for its old life is discarded, its own handshakes and
//! READs are forgotten, and peers' handshakes with it and READs against it
//! report `PeerUnreachable` (re-handshake to continue). Dropping a
//! [`LoopbackFabric`] is a crash that never restarts.
//!
//! Fates are seeded and counted per link (see `faults`), so a run with the
//! same seed, the same calls and the same virtual times delivers the same
//! messages in the same order.
//!
//! # Allocation
//!
//! Everything is allocated in [`LoopbackNetwork::new`] and
//! [`LoopbackFabric::join`] from [`LoopbackConfig`]'s capacities. Sending,
//! draining, posting and polling READs, and handshake polls allocate nothing
//! (`tests/loopback_alloc.rs` counts).

mod faults;
mod inbox;
mod liveness;
mod memory;
pub mod queue;
mod reads;

use core::time::Duration;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

pub use faults::{NotificationFaults, ReadFaults, INJECTED_READ_FAILURE};

use self::faults::{LinkCell, NotificationFate};
use self::inbox::{Inbox, InboxStats, FLAG_HOLD};
use self::liveness::Liveness;
use self::memory::{copy_into, Region, RegionTable};
use self::queue::{Envelope, QueueError, QueueProducer};
use self::reads::{ReadPlan, ReadTable};
use crate::fabric::{
    AgentId, ClockSample, Fabric, FabricError, HandshakeState, LandingWords, LeaseAdvert, PeerInfo,
    PeerRecord, ReadDesc, RegionId, SlotRegion, XferId, XferState,
};
use crate::slots::LeaseSlots;
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::time::Instant;

/// Upper bound on [`LoopbackConfig::max_agents`]: the link table is
/// quadratic in it.
pub const MAX_AGENTS: u32 = 1024;

/// Longest agent name.
pub const MAX_NAME_LEN: usize = 256;

/// What a send over a down link does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnreachableSends {
    /// Fails with [`FabricError::PeerUnreachable`] (a transport that notices
    /// a dead endpoint).
    #[default]
    Error,
    /// Returns `Ok` and loses the message (a datagram into the void).
    SilentDrop,
}

/// Capacities and timings of a loopback network, fixed at construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoopbackConfig {
    /// Most agents that may join (at most [`MAX_AGENTS`]).
    pub max_agents: u32,
    /// Cells in each agent's notification ring (at least
    /// [`queue::MIN_CAPACITY`], 2; a smaller value is raised).
    pub queue_capacity: u32,
    /// Largest notification, in bytes (each ring and pen cell holds one).
    pub max_notification_len: usize,
    /// Delayed or reordered notifications an agent can hold back at once.
    pub pen_capacity: u32,
    /// Regions each agent may register (lease slots included).
    pub max_regions: u32,
    /// READs each agent may have in flight.
    pub max_reads_in_flight: u32,
    /// Descriptors per READ.
    pub max_descs_per_read: u32,
    /// How long a READ takes, before injected delays.
    pub read_latency: Duration,
    /// A READ not complete this long after it was posted fails `TimedOut`.
    pub transfer_timeout: Duration,
    /// A handshake completes on the n-th `handshake_state` poll at the
    /// earliest (0 and 1 both mean the first poll).
    pub handshake_polls: u32,
    /// ... and no earlier than this after `start_handshake`.
    pub handshake_latency: Duration,
    /// Seed of every fault draw.
    pub seed: u64,
    /// What a send over a down link does.
    pub unreachable_sends: UnreachableSends,
}

impl Default for LoopbackConfig {
    fn default() -> Self {
        LoopbackConfig {
            max_agents: 16,
            queue_capacity: 256,
            max_notification_len: 4096,
            pen_capacity: 64,
            max_regions: 16,
            max_reads_in_flight: 64,
            max_descs_per_read: 256,
            read_latency: Duration::ZERO,
            transfer_timeout: Duration::from_secs(30),
            handshake_polls: 1,
            handshake_latency: Duration::ZERO,
            seed: 0,
            unreachable_sends: UnreachableSends::Error,
        }
    }
}

/// An agent's index on its network, for the control methods. Stable for the
/// network's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u32);

impl NodeId {
    /// The index (0 for the first agent that joined, and so on).
    pub fn index(self) -> u32 {
        self.0
    }
}

/// Which agents a fault setting applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nodes {
    /// Every agent that has joined (or joins later: settings are per index).
    All,
    /// One agent.
    One(NodeId),
}

impl From<NodeId> for Nodes {
    fn from(n: NodeId) -> Nodes {
        Nodes::One(n)
    }
}

/// Why an agent could not join a network.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoopbackError {
    /// The name is empty or longer than [`MAX_NAME_LEN`].
    BadName,
    /// An agent with this name already joined.
    DuplicateName,
    /// [`LoopbackConfig::max_agents`] agents already joined.
    TooManyAgents,
}

impl core::fmt::Display for LoopbackError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            LoopbackError::BadName => "agent name empty or too long",
            LoopbackError::DuplicateName => "an agent with this name already joined",
            LoopbackError::TooManyAgents => "the network is full",
        })
    }
}

impl std::error::Error for LoopbackError {}

/// Counters of one agent. Sender-side counts are about messages and READs
/// this agent sent or posted; receiver-side ones about what it drained.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoopbackStats {
    /// Notifications put into a receiver's ring (including delayed and
    /// reordered ones, and READ notifications).
    pub notifications_sent: u64,
    /// Notifications lost to an injected drop.
    pub notifications_dropped: u64,
    /// Notifications given an injected delay.
    pub notifications_delayed: u64,
    /// Notifications given an injected reorder.
    pub notifications_reordered: u64,
    /// Sends refused or lost because the link was down.
    pub notifications_unreachable: u64,
    /// Sends refused because the receiver's ring was full.
    pub notifications_full: u64,
    /// Notifications handed to this agent's drain sink.
    pub notifications_delivered: u64,
    /// Queued notifications discarded because they were sent to an earlier
    /// incarnation of this agent.
    pub notifications_discarded_stale: u64,
    /// Delayed or reordered notifications delivered early because the pen
    /// was full.
    pub pen_overflow: u64,
    /// READs accepted by `post_read`.
    pub reads_posted: u64,
    /// READs reported `Done`.
    pub reads_done: u64,
    /// READs reported `Failed` other than by timeout.
    pub reads_failed: u64,
    /// READs reported `Failed(TimedOut)`.
    pub reads_timed_out: u64,
    /// READs cancelled.
    pub reads_cancelled: u64,
    /// READ-completion notifications that could not be sent (ring full, or
    /// lost to an injected drop).
    pub read_notifications_lost: u64,
}

/// What other agents may see of one agent.
struct AgentRecord {
    name: Box<str>,
    producer: QueueProducer,
    regions: RegionTable,
    /// The lease-slot advert (see `pack_advert`); 0 = no slots.
    advert: AtomicU64,
}

struct NodeCell {
    record: OnceLock<AgentRecord>,
    liveness: Liveness,
    /// Own clock minus virtual time, ns (an i64 in two's complement).
    clock_offset: AtomicU64,
}

/// The shared world of loopback agents. See the module docs.
pub struct LoopbackNetwork {
    config: LoopbackConfig,
    /// Virtual time, ns: the latest `now` observed.
    clock: AtomicU64,
    nodes: Box<[NodeCell]>,
    /// Agents joined; records below this index are set.
    joined: AtomicU32,
    /// `links[from * max_agents + to]`.
    links: Box<[LinkCell]>,
    /// Serialises joins (a cold path) so names stay unique.
    join_lock: Mutex<()>,
}

impl core::fmt::Debug for LoopbackNetwork {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("LoopbackNetwork")
            .field("config", &self.config)
            .field("now", &self.now())
            .field("agents", &self.agent_count())
            .finish()
    }
}

const ADVERT_PRESENT: u64 = 1 << 63;
const ADVERT_COMPACT: u64 = 1 << 62;

fn pack_advert(region: RegionId, count: u32, compact: bool) -> u64 {
    ADVERT_PRESENT
        | if compact { ADVERT_COMPACT } else { 0 }
        | u64::from(region.0 & 0x3FFF_FFFF) << 32
        | u64::from(count)
}

fn unpack_advert(word: u64) -> (Option<RegionId>, u32, bool) {
    if word & ADVERT_PRESENT == 0 {
        return (None, 0, false);
    }
    (
        Some(RegionId((word >> 32) as u32 & 0x3FFF_FFFF)),
        word as u32,
        word & ADVERT_COMPACT != 0,
    )
}

impl LoopbackNetwork {
    /// A network with room for `config.max_agents` agents (clamped to
    /// [`MAX_AGENTS`]). Agents join with [`LoopbackFabric::join`].
    pub fn new(config: LoopbackConfig) -> Arc<LoopbackNetwork> {
        let config = LoopbackConfig {
            max_agents: config.max_agents.min(MAX_AGENTS),
            ..config
        };
        let n = config.max_agents as usize;
        Arc::new(LoopbackNetwork {
            config,
            clock: AtomicU64::new(0),
            nodes: (0..n)
                .map(|_| NodeCell {
                    record: OnceLock::new(),
                    liveness: Liveness::new(),
                    clock_offset: AtomicU64::new(0),
                })
                .collect(),
            joined: AtomicU32::new(0),
            links: (0..n * n).map(|_| LinkCell::new()).collect(),
            join_lock: Mutex::new(()),
        })
    }

    /// The configuration (with `max_agents` clamped).
    pub fn config(&self) -> &LoopbackConfig {
        &self.config
    }

    /// Current virtual time.
    pub fn now(&self) -> Instant {
        Instant::from_nanos(self.clock.load(Ordering::Acquire))
    }

    /// Moves virtual time forward to `t` (never backward). Agents' calls
    /// with a `now` do the same.
    pub fn advance_to(&self, t: Instant) {
        self.clock.fetch_max(t.as_nanos(), Ordering::AcqRel);
    }

    /// Number of agents that joined.
    pub fn agent_count(&self) -> u32 {
        self.joined.load(Ordering::Acquire)
    }

    /// The agent called `name`.
    pub fn node(&self, name: &str) -> Option<NodeId> {
        self.lookup(name).map(NodeId)
    }

    /// The name of agent `node`.
    pub fn name_of(&self, node: NodeId) -> Option<&str> {
        self.record(node.0).map(|r| &*r.name)
    }

    /// Sets `node`'s own clock to virtual time + `offset_nanos` (may be
    /// negative; its readings saturate at the clock's origin).
    pub fn set_clock_offset(&self, node: NodeId, offset_nanos: i64) {
        if let Some(cell) = self.nodes.get(node.0 as usize) {
            cell.clock_offset
                .store(offset_nanos as u64, Ordering::Release);
        }
    }

    /// Freezes `node`: it stops answering (see the module docs).
    pub fn crash(&self, node: NodeId) {
        if let Some(cell) = self.nodes.get(node.0 as usize) {
            cell.liveness.crash();
        }
    }

    /// Brings a crashed `node` back as a new incarnation. No effect on an
    /// agent that is up, or whose fabric was dropped.
    pub fn restart(&self, node: NodeId) {
        if let Some(cell) = self.nodes.get(node.0 as usize) {
            cell.liveness.restart();
        }
    }

    /// True while `node` is crashed (or its fabric was dropped).
    pub fn is_crashed(&self, node: NodeId) -> bool {
        self.nodes
            .get(node.0 as usize)
            .is_some_and(|c| c.liveness.is_down())
    }

    /// Cuts every link between `a` and `b`, both directions.
    pub fn partition(&self, a: impl Into<Nodes>, b: impl Into<Nodes>) {
        self.set_partition(a.into(), b.into(), true);
    }

    /// Restores the links [`LoopbackNetwork::partition`] cut between `a` and
    /// `b`.
    pub fn heal(&self, a: impl Into<Nodes>, b: impl Into<Nodes>) {
        self.set_partition(a.into(), b.into(), false);
    }

    fn set_partition(&self, a: Nodes, b: Nodes, on: bool) {
        self.for_links(a, b, |l| l.set_partitioned(on));
        self.for_links(b, a, |l| l.set_partitioned(on));
    }

    /// Sets the notification faults of every link `from` -> `to`.
    pub fn set_notification_faults(
        &self,
        from: impl Into<Nodes>,
        to: impl Into<Nodes>,
        faults: NotificationFaults,
    ) {
        self.for_links(from.into(), to.into(), |l| {
            l.set_notification_faults(&faults)
        });
    }

    /// Drops the next `n` notifications on each link `from` -> `to`
    /// (adds to any count not yet used up).
    pub fn drop_next_notifications(&self, from: impl Into<Nodes>, to: impl Into<Nodes>, n: u32) {
        self.for_links(from.into(), to.into(), |l| l.add_drop_next(n));
    }

    /// Sets the READ faults of every link `reader` -> `remote`.
    pub fn set_read_faults(
        &self,
        reader: impl Into<Nodes>,
        remote: impl Into<Nodes>,
        faults: ReadFaults,
    ) {
        self.for_links(reader.into(), remote.into(), |l| l.set_read_faults(&faults));
    }

    /// Fails the next `n` READs on each link `reader` -> `remote` with the
    /// link's [`ReadFaults::fail_with`] (default [`INJECTED_READ_FAILURE`]).
    pub fn fail_next_reads(&self, reader: impl Into<Nodes>, remote: impl Into<Nodes>, n: u32) {
        self.for_links(reader.into(), remote.into(), |l| l.add_fail_next_reads(n));
    }

    /// Clears every link fault and partition. Crashed agents stay crashed.
    pub fn clear_faults(&self) {
        self.links.iter().for_each(LinkCell::clear);
    }

    fn for_links(&self, from: Nodes, to: Nodes, f: impl Fn(&LinkCell)) {
        let n = self.config.max_agents;
        let range = |sel: Nodes| match sel {
            Nodes::All => 0..n,
            Nodes::One(NodeId(i)) if i < n => i..i + 1,
            Nodes::One(_) => 0..0,
        };
        for a in range(from) {
            for b in range(to) {
                f(self.link(a, b));
            }
        }
    }

    fn link(&self, from: u32, to: u32) -> &LinkCell {
        // Callers pass indices below max_agents; the link table is its square.
        &self.links[from as usize * self.config.max_agents as usize + to as usize]
    }

    fn record(&self, node: u32) -> Option<&AgentRecord> {
        self.nodes.get(node as usize).and_then(|c| c.record.get())
    }

    fn liveness(&self, node: u32) -> Option<&Liveness> {
        self.nodes.get(node as usize).map(|c| &c.liveness)
    }

    fn incarnation(&self, node: u32) -> u32 {
        self.liveness(node).map_or(0, Liveness::incarnation)
    }

    fn lookup(&self, name: &str) -> Option<u32> {
        (0..self.agent_count()).find(|&i| self.record(i).is_some_and(|r| &*r.name == name))
    }

    fn observe(&self, now: Instant) {
        self.advance_to(now);
    }

    /// Either end crashed or gone, or the pair partitioned.
    fn link_down(&self, from: u32, to: u32) -> bool {
        let down = |n| self.liveness(n).is_none_or(Liveness::is_down);
        down(from) || down(to) || self.link(from, to).is_partitioned()
    }

    /// `node`'s own clock at virtual time `t`.
    fn own_clock(&self, node: u32, t: Instant) -> Instant {
        let offset = self
            .nodes
            .get(node as usize)
            .map_or(0, |c| c.clock_offset.load(Ordering::Acquire) as i64);
        if offset >= 0 {
            t.saturating_add(Duration::from_nanos(offset as u64))
        } else {
            t.saturating_sub(Duration::from_nanos(offset.unsigned_abs()))
        }
    }
}

/// Where a handshake with one peer stands.
#[derive(Clone, Copy, Debug)]
enum Handshake {
    Idle,
    Pending {
        started: Instant,
        polls: u32,
    },
    /// `incarnation` is the remote's at completion; when it changes the
    /// handshake is stale.
    Ready {
        info: PeerInfo,
        incarnation: u32,
    },
    Failed(FabricError),
}

/// This agent's view of one other agent.
#[derive(Clone, Copy, Debug)]
struct Peer {
    handshake: Handshake,
    /// Per-link sequence numbers of fault draws (see `faults`). Kept across
    /// restarts so that a new life does not replay the old one's fates.
    notification_seq: u64,
    read_seq: u64,
}

/// One loopback agent. See the module docs.
pub struct LoopbackFabric {
    net: Arc<LoopbackNetwork>,
    node: u32,
    /// The incarnation this fabric's local state belongs to.
    incarnation: u32,
    inbox: Inbox,
    inbox_stats: InboxStats,
    /// Indexed by the peer's node index, which is also its [`AgentId`].
    peers: Box<[Peer]>,
    reads: ReadTable,
    next_region: u32,
    stats: LoopbackStats,
    /// Shares of the landing buffers registered with `register_landing`:
    /// dropped with the fabric, after `Drop::drop` retired the agent (so no
    /// copy can target them any more).
    landing: Vec<Arc<LandingWords>>,
}

impl core::fmt::Debug for LoopbackFabric {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("LoopbackFabric")
            .field("name", &self.name())
            .field("node", &self.node)
            .field("incarnation", &self.incarnation)
            .field("stats", &self.stats())
            .finish()
    }
}

impl LoopbackFabric {
    /// Joins `net` as a new agent called `name`, allocating its ring, pen,
    /// region table and READ table.
    ///
    /// # Agent names are addresses
    ///
    /// The name is the agent's whole address on the loopback network:
    /// [`Fabric::start_handshake`] resolves its `address` argument by exact,
    /// byte-for-byte comparison with the joined names (no parsing, no
    /// host/port split; an unknown name is [`FabricError::BadAddress`]),
    /// [`Fabric::name`] returns it, and [`Fabric::drain_notifications`]
    /// reports it as the sender of every message. So name each P rank with
    /// the string D's heartbeat sender will ask for: with
    /// [`crate::consumer::DefaultPeerAddress`], `{host}:{port}/{engine_id}/{rank}`
    /// (e.g. `10.0.0.1:5600/prefill-a/0` for the request's `remote_host`,
    /// `remote_port` and `remote_engine_id`); with
    /// [`crate::consumer::PortPerRankAddress`], `{host}:{port + rank}`; or
    /// whatever a custom [`crate::consumer::PeerAddress`] writes. A name is
    /// 1..=[`MAX_NAME_LEN`] bytes ([`LoopbackError::BadName`]) and unique in
    /// its network ([`LoopbackError::DuplicateName`]); a crashed agent that
    /// restarts keeps it. [`LoopbackNetwork::node`] and
    /// [`LoopbackNetwork::name_of`] map between names and [`NodeId`]s for
    /// fault injection.
    pub fn join(net: &Arc<LoopbackNetwork>, name: &str) -> Result<LoopbackFabric, LoopbackError> {
        if name.is_empty() || name.len() > MAX_NAME_LEN {
            return Err(LoopbackError::BadName);
        }
        let cfg = net.config;
        // A poisoned lock only means another join panicked; the state it
        // guards (records below `joined`) is still consistent.
        let _guard = net.join_lock.lock().unwrap_or_else(PoisonError::into_inner);
        if net.lookup(name).is_some() {
            return Err(LoopbackError::DuplicateName);
        }
        let node = net.agent_count();
        let cell = net
            .nodes
            .get(node as usize)
            .ok_or(LoopbackError::TooManyAgents)?;
        let (producer, consumer) = queue::channel(cfg.queue_capacity, cfg.max_notification_len);
        let record = AgentRecord {
            name: name.into(),
            producer,
            regions: RegionTable::new(cfg.max_regions),
            advert: AtomicU64::new(0),
        };
        cell.record
            .set(record)
            .map_err(|_| LoopbackError::TooManyAgents)?;
        net.joined.store(node + 1, Ordering::Release);
        Ok(LoopbackFabric {
            net: net.clone(),
            node,
            incarnation: cell.liveness.incarnation(),
            inbox: Inbox::new(consumer, cfg.pen_capacity, cfg.max_notification_len),
            inbox_stats: InboxStats::default(),
            peers: vec![
                Peer {
                    handshake: Handshake::Idle,
                    notification_seq: 0,
                    read_seq: 0,
                };
                cfg.max_agents as usize
            ]
            .into_boxed_slice(),
            reads: ReadTable::new(
                cfg.max_reads_in_flight,
                cfg.max_descs_per_read,
                cfg.max_notification_len,
            ),
            next_region: 0,
            stats: LoopbackStats::default(),
            landing: Vec::new(),
        })
    }

    /// This agent's index on the network.
    pub fn node(&self) -> NodeId {
        NodeId(self.node)
    }

    /// The network this agent lives in.
    pub fn network(&self) -> &Arc<LoopbackNetwork> {
        &self.net
    }

    /// This agent's counters.
    pub fn stats(&self) -> LoopbackStats {
        LoopbackStats {
            notifications_delivered: self.inbox_stats.delivered,
            notifications_discarded_stale: self.inbox_stats.discarded_stale,
            pen_overflow: self.inbox_stats.pen_overflow,
            ..self.stats
        }
    }

    fn record(&self) -> Option<&AgentRecord> {
        self.net.record(self.node)
    }

    /// Resets local state if this agent restarted since the last call: a new
    /// process remembers no handshakes, READs or held-back messages.
    fn sync_life(&mut self) {
        let now_life = self.net.incarnation(self.node);
        if now_life != self.incarnation {
            self.incarnation = now_life;
            self.inbox.reset();
            self.reads.clear();
            for p in self.peers.iter_mut() {
                p.handshake = Handshake::Idle;
            }
        }
    }

    /// The node index of a connected peer, or why it is not connected.
    fn connected(&mut self, agent: AgentId) -> Result<u32, FabricError> {
        let remote_life = self.net.incarnation(agent.0);
        let peer = self
            .peers
            .get_mut(agent.0 as usize)
            .ok_or(FabricError::UnknownAgent)?;
        match peer.handshake {
            Handshake::Idle => Err(FabricError::UnknownAgent),
            Handshake::Pending { .. } | Handshake::Failed(_) => Err(FabricError::NotConnected),
            Handshake::Ready { incarnation, .. } if incarnation != remote_life => {
                peer.handshake = Handshake::Failed(FabricError::PeerUnreachable);
                Err(FabricError::PeerUnreachable)
            }
            Handshake::Ready { .. } => Ok(agent.0),
        }
    }

    /// Checks every READ descriptor against both region tables.
    fn check_descs(&self, target: u32, descs: &[ReadDesc]) -> Result<(), FabricError> {
        let local = self.record().ok_or(FabricError::UnknownRegion)?;
        let remote = self.net.record(target).ok_or(FabricError::UnknownAgent)?;
        // Same last-lookup cache as `copy_read`.
        let mut local_cache: Option<(RegionId, &Region)> = None;
        let mut remote_cache: Option<(RegionId, &Region)> = None;
        for d in descs {
            let local_region = match local_cache {
                Some((id, r)) if id == d.local => r,
                // A lease-slot array is written only by its owner's lease
                // book, never by a READ: it is not a landing region.
                _ => match local.regions.get(d.local) {
                    Some(r @ Region::Raw(_)) => {
                        local_cache = Some((d.local, r));
                        r
                    }
                    Some(Region::Slots(_)) | None => return Err(FabricError::UnknownRegion),
                },
            };
            let remote_region = match remote_cache {
                Some((id, r)) if id == d.remote => r,
                _ => {
                    let r = remote
                        .regions
                        .get(d.remote)
                        .ok_or(FabricError::UnknownRegion)?;
                    remote_cache = Some((d.remote, r));
                    r
                }
            };
            if !local_region.contains(d.local_offset, d.len)
                || !remote_region.contains(d.remote_offset, d.len)
            {
                return Err(FabricError::OutOfBounds);
            }
        }
        Ok(())
    }
}

/// Sends `msg` from `from` to `to` through the link's faults. A free
/// function over the fabric's parts so that `read_state` can send a READ's
/// notification while it borrows the READ table.
fn route(
    net: &LoopbackNetwork,
    from: u32,
    peer: &mut Peer,
    stats: &mut LoopbackStats,
    to: u32,
    msg: &[u8],
) -> Result<(), FabricError> {
    if net.link_down(from, to) {
        stats.notifications_unreachable += 1;
        return match net.config.unreachable_sends {
            UnreachableSends::Error => Err(FabricError::PeerUnreachable),
            UnreachableSends::SilentDrop => Ok(()),
        };
    }
    let record = net.record(to).ok_or(FabricError::UnknownAgent)?;
    let seq = peer.notification_seq;
    peer.notification_seq += 1;
    let now = net.clock.load(Ordering::Acquire);
    let (flags, stamp) = match net
        .link(from, to)
        .notification_fate(net.config.seed, from, to, seq)
    {
        NotificationFate::Drop => {
            stats.notifications_dropped += 1;
            return Ok(());
        }
        NotificationFate::Deliver => (0, now),
        NotificationFate::Delay(ns) => {
            stats.notifications_delayed += 1;
            (0, now.saturating_add(ns))
        }
        NotificationFate::Reorder(ns) => {
            stats.notifications_reordered += 1;
            (FLAG_HOLD, now.saturating_add(ns))
        }
    };
    let envelope = Envelope {
        sender: from,
        flags,
        tag: net.incarnation(to),
        stamp,
    };
    match record.producer.push(envelope, msg) {
        Ok(()) => {
            stats.notifications_sent += 1;
            Ok(())
        }
        Err(QueueError::Full) => {
            stats.notifications_full += 1;
            Err(FabricError::Full)
        }
        Err(QueueError::TooLarge) => Err(FabricError::MessageTooLarge),
    }
}

impl Fabric for LoopbackFabric {
    fn name(&self) -> &str {
        self.record().map_or("", |r| &r.name)
    }

    fn register_slots(
        &mut self,
        slots: Arc<LeaseSlots>,
        compact_heartbeats: bool,
    ) -> Result<RegionId, FabricError> {
        let count = slots.len();
        let record = self
            .net
            .record(self.node)
            .ok_or(FabricError::UnknownAgent)?;
        let id = record
            .regions
            .publish(self.next_region, Region::Slots(slots))?;
        self.next_region += 1;
        record.advert.store(
            pack_advert(id, count, compact_heartbeats),
            Ordering::Release,
        );
        Ok(id)
    }

    unsafe fn register_memory(
        &mut self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<RegionId, FabricError> {
        if ptr.is_null() {
            return Err(FabricError::OutOfBounds);
        }
        let record = self
            .net
            .record(self.node)
            .ok_or(FabricError::UnknownAgent)?;
        // SAFETY: our caller accepted register_memory's contract, which is
        // raw_region's; the fabric's Drop retires the agent (waiting out
        // copies) before the memory may go away.
        let region = unsafe { memory::raw_region(ptr, len) };
        let id = record.regions.publish(self.next_region, region)?;
        self.next_region += 1;
        Ok(id)
    }

    fn register_landing(&mut self, words: Arc<LandingWords>) -> Result<RegionId, FabricError> {
        // SAFETY: `self.landing` keeps the words allocated (a boxed slice:
        // never moved) until this fabric is dropped, and its Drop retires
        // the agent before the field is dropped; every Rust-side access to
        // them is atomic.
        let id = unsafe { self.register_memory(words.as_ptr().cast_mut(), words.byte_len())? };
        self.landing.push(words);
        Ok(id)
    }

    fn max_notification_len(&self) -> usize {
        self.net.config.max_notification_len
    }

    fn start_handshake(&mut self, address: &str, now: Instant) -> Result<AgentId, FabricError> {
        self.sync_life();
        self.net.observe(now);
        let node = self.net.lookup(address).ok_or(FabricError::BadAddress)?;
        let peer = self
            .peers
            .get_mut(node as usize)
            .ok_or(FabricError::BadAddress)?;
        if let Handshake::Idle | Handshake::Failed(_) = peer.handshake {
            peer.handshake = Handshake::Pending {
                started: now,
                polls: 0,
            };
        }
        Ok(AgentId(node))
    }

    fn lease_advert(&self) -> LeaseAdvert {
        let word = self
            .record()
            .map_or(0, |r| r.advert.load(Ordering::Acquire));
        let (region, count, compact) = unpack_advert(word);
        LeaseAdvert {
            // On loopback a region's handle is its index.
            slots: region.map(|r| SlotRegion {
                addr: u64::from(r.0),
                len: u64::from(count) * 8,
                count,
            }),
            compact_heartbeats: compact,
        }
    }

    fn add_peer(&mut self, record: &PeerRecord<'_>, now: Instant) -> Result<AgentId, FabricError> {
        self.sync_life();
        self.net.observe(now);
        let node = self
            .net
            .lookup(record.agent_name)
            .ok_or(FabricError::BadAddress)?;
        let remote = self.net.record(node).ok_or(FabricError::BadAddress)?;
        let (slot_region, slot_count) = match record.advert.and_then(|a| a.slots) {
            Some(s) => {
                // The advert must name the remote's slot array, as its own
                // registration published it.
                let id = u32::try_from(s.addr).map_err(|_| FabricError::UnknownRegion)?;
                match remote.regions.get(RegionId(id)) {
                    Some(Region::Slots(slots)) if slots.len() == s.count => {
                        (Some(RegionId(id)), s.count)
                    }
                    _ => return Err(FabricError::UnknownRegion),
                }
            }
            None => (None, 0),
        };
        let incarnation = self.net.incarnation(node);
        let peer = self
            .peers
            .get_mut(node as usize)
            .ok_or(FabricError::BadAddress)?;
        peer.handshake = Handshake::Ready {
            info: PeerInfo {
                slot_region,
                slot_count,
                compact_heartbeats: record.advert.is_some_and(|a| a.compact_heartbeats),
                clock: record.clock,
            },
            incarnation,
        };
        Ok(AgentId(node))
    }

    fn handshake_state(&mut self, agent: AgentId, now: Instant) -> HandshakeState {
        self.sync_life();
        let net = &*self.net;
        net.observe(now);
        let cfg = &net.config;
        let remote_life = net.incarnation(agent.0);
        let Some(peer) = self.peers.get_mut(agent.0 as usize) else {
            return HandshakeState::Failed(FabricError::UnknownAgent);
        };
        let next = match peer.handshake {
            Handshake::Idle => return HandshakeState::Failed(FabricError::UnknownAgent),
            Handshake::Failed(e) => return HandshakeState::Failed(e),
            Handshake::Ready { info, incarnation } if incarnation == remote_life => {
                return HandshakeState::Ready(info)
            }
            Handshake::Ready { .. } => Handshake::Failed(FabricError::PeerUnreachable),
            Handshake::Pending { started, polls } => {
                let polls = polls.saturating_add(1);
                if polls < cfg.handshake_polls || now < started + cfg.handshake_latency {
                    Handshake::Pending { started, polls }
                } else if net.link_down(self.node, agent.0) {
                    Handshake::Failed(FabricError::PeerUnreachable)
                } else {
                    let advert = net
                        .record(agent.0)
                        .map_or(0, |r| r.advert.load(Ordering::Acquire));
                    let (slot_region, slot_count, compact_heartbeats) = unpack_advert(advert);
                    // The remote answers halfway through, so the midpoint
                    // estimate of clock_offset is exact here.
                    let answered = started + now.saturating_duration_since(started) / 2;
                    let info = PeerInfo {
                        slot_region,
                        slot_count,
                        compact_heartbeats,
                        clock: Some(ClockSample {
                            local_send: net.own_clock(self.node, started),
                            remote: net.own_clock(agent.0, answered),
                            local_recv: net.own_clock(self.node, now),
                        }),
                    };
                    Handshake::Ready {
                        info,
                        incarnation: remote_life,
                    }
                }
            }
        };
        peer.handshake = next;
        match next {
            Handshake::Pending { .. } | Handshake::Idle => HandshakeState::Pending,
            Handshake::Ready { info, .. } => HandshakeState::Ready(info),
            Handshake::Failed(e) => HandshakeState::Failed(e),
        }
    }

    fn send_notification(&mut self, to: AgentId, msg: &[u8]) -> Result<(), FabricError> {
        self.sync_life();
        let node = self.connected(to)?;
        if msg.len() > self.net.config.max_notification_len {
            return Err(FabricError::MessageTooLarge);
        }
        let peer = &mut self.peers[node as usize];
        route(&self.net, self.node, peer, &mut self.stats, node, msg)
    }

    fn drain_notifications(
        &mut self,
        sink: &mut dyn FnMut(&str, &[u8]),
    ) -> Result<usize, FabricError> {
        self.sync_life();
        let net = &*self.net;
        if net.liveness(self.node).is_none_or(Liveness::is_down) {
            return Ok(0);
        }
        let now = net.clock.load(Ordering::Acquire);
        let name_of = |i: u32| net.record(i).map_or("", |r| &*r.name);
        Ok(self
            .inbox
            .drain(now, self.incarnation, &name_of, sink, &mut self.inbox_stats))
    }

    fn post_read(
        &mut self,
        from: AgentId,
        descs: &[ReadDesc],
        notification: Option<&[u8]>,
        now: Instant,
    ) -> Result<XferId, FabricError> {
        self.sync_life();
        self.net.observe(now);
        let target = self.connected(from)?;
        let cfg = self.net.config;
        if notification.is_some_and(|n| n.len() > cfg.max_notification_len) {
            return Err(FabricError::MessageTooLarge);
        }
        if descs.len() > self.reads.max_descs() {
            return Err(FabricError::Full);
        }
        self.check_descs(target, descs)?;
        let peer = &mut self.peers[target as usize];
        let seq = peer.read_seq;
        peer.read_seq += 1;
        let fate = self
            .net
            .link(self.node, target)
            .read_fate(cfg.seed, self.node, target, seq);
        let plan = ReadPlan {
            target,
            target_incarnation: self.net.incarnation(target),
            done_at: now + cfg.read_latency + Duration::from_nanos(fate.extra_ns),
            deadline: now + cfg.transfer_timeout,
            fail: fate.fail,
        };
        let id = self.reads.insert(plan, descs, notification)?;
        self.stats.reads_posted += 1;
        Ok(id)
    }

    fn read_state(&mut self, xfer: XferId, now: Instant) -> XferState {
        self.sync_life();
        let net = &*self.net;
        net.observe(now);
        let Some((index, e)) = self.reads.get(xfer) else {
            return XferState::Failed(FabricError::UnknownXfer);
        };
        let target = e.target;
        let state = if net.incarnation(target) != e.target_incarnation {
            // The remote restarted: the memory we were reading is another
            // process's now.
            XferState::Failed(FabricError::PeerUnreachable)
        } else if now >= e.done_at && e.done_at < e.deadline && !net.link_down(self.node, target) {
            match e.fail {
                Some(err) => XferState::Failed(err),
                None => {
                    let copied = copy_read(net, self.node, target, e.descs());
                    match (copied, e.notification()) {
                        (Err(err), _) => XferState::Failed(err),
                        (Ok(()), None) => XferState::Done,
                        (Ok(()), Some(msg)) => {
                            let peer = &mut self.peers[target as usize];
                            let before = self.stats.notifications_dropped;
                            let sent = route(net, self.node, peer, &mut self.stats, target, msg);
                            if sent.is_err() || self.stats.notifications_dropped != before {
                                self.stats.read_notifications_lost += 1;
                            }
                            XferState::Done
                        }
                    }
                }
            }
        } else if now >= e.deadline {
            XferState::Failed(FabricError::TimedOut)
        } else {
            return XferState::InProgress;
        };
        self.reads.remove(index);
        match state {
            XferState::Done => self.stats.reads_done += 1,
            XferState::Failed(FabricError::TimedOut) => self.stats.reads_timed_out += 1,
            XferState::Failed(_) => self.stats.reads_failed += 1,
            XferState::InProgress => {}
        }
        state
    }

    fn cancel_read(&mut self, xfer: XferId) {
        self.sync_life();
        if let Some((index, _)) = self.reads.get(xfer) {
            self.reads.remove(index);
            self.stats.reads_cancelled += 1;
        }
    }
}

/// Copies every descriptor of a completing READ from `target` into `reader`.
fn copy_read(
    net: &LoopbackNetwork,
    reader: u32,
    target: u32,
    descs: &[ReadDesc],
) -> Result<(), FabricError> {
    let (Some(local), Some(remote), Some(liveness)) =
        (net.record(reader), net.record(target), net.liveness(target))
    else {
        return Err(FabricError::UnknownAgent);
    };
    // Holds off the remote's Drop (which may free its raw memory) until the
    // copy is over; a remote already gone is unreachable.
    let Some(_guard) = liveness.begin_copy() else {
        return Err(FabricError::PeerUnreachable);
    };
    // READs usually name one region pair for all their descriptors: keep
    // the last lookup instead of chasing the tables for each.
    let mut src_cache: Option<(RegionId, &Region)> = None;
    let mut dst_cache: Option<(RegionId, &memory::RawRegion)> = None;
    for d in descs {
        let src = match src_cache {
            Some((id, r)) if id == d.remote => r,
            _ => {
                let r = remote
                    .regions
                    .get(d.remote)
                    .ok_or(FabricError::UnknownRegion)?;
                src_cache = Some((d.remote, r));
                r
            }
        };
        let dst = match dst_cache {
            Some((id, r)) if id == d.local => r,
            _ => {
                let Some(Region::Raw(r)) = local.regions.get(d.local) else {
                    return Err(FabricError::UnknownRegion);
                };
                dst_cache = Some((d.local, r));
                r
            }
        };
        // SAFETY: `dst` was registered by this agent under register_memory's
        // contract and this agent (alive: we hold &mut to it) posted the READ
        // into it; `src` is alive (the guard), and a raw `src` is not written
        // during a READ per the same contract. Bounds are re-checked inside.
        unsafe { copy_into(src, d.remote_offset, dst, d.local_offset, d.len)? };
    }
    Ok(())
}

impl Drop for LoopbackFabric {
    /// The agent is gone for good: peers see a crash, and the memory it
    /// registered is never read again once this returns.
    fn drop(&mut self) {
        if let Some(l) = self.net.liveness(self.node) {
            l.retire();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
