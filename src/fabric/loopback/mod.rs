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
//! - **Removal.** `remove_peer` returns the agent to "never handshaken":
//!   its id (the node index, stable for the network's life) is
//!   `UnknownAgent` until the next handshake with it, and READs from it in
//!   flight are `Failed(Cancelled)` at their next poll. The table has one
//!   entry per node, so it never fills and nothing is evicted.
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

mod fabric_api;
mod faults;
mod inbox;
mod liveness;
mod memory;
mod network;
#[doc(hidden)]
pub mod queue;
mod reads;

use core::time::Duration;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

pub use faults::{NotificationFaults, ReadFaults, INJECTED_READ_FAILURE};

use self::faults::{LinkCell, NotificationFate};
use self::inbox::{Inbox, InboxStats, FLAG_HOLD};
use self::liveness::Liveness;
use self::memory::{copy_into, LastRegion, Region, RegionTable};
use self::queue::{Envelope, QueueError, QueueProducer};
use self::reads::{ReadPlan, ReadTable};
use crate::fabric::{
    AgentId, ClockSample, Fabric, FabricError, HandshakeState, LandingWords, LeaseAdvert, PeerInfo,
    PeerRecord, ReadDesc, RegionId, SlotRegion, XferId, XferState,
};
use crate::pack::Field;
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoopbackError {
    /// The name is empty or longer than [`MAX_NAME_LEN`].
    #[error("agent name empty or too long")]
    BadName,
    /// An agent with this name already joined.
    #[error("an agent with this name already joined")]
    DuplicateName,
    /// [`LoopbackConfig::max_agents`] agents already joined.
    #[error("the network is full")]
    TooManyAgents,
}

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

/// An agent's advert, one atomic word so that a handshake reads it whole:
/// slot count, slot region, compact flag, present flag (diagram in
/// [`crate::design`], "Packed words").
const ADVERT_COUNT: Field = Field::new(0, 32);
const ADVERT_REGION: Field = Field::above(ADVERT_COUNT, 30);
const ADVERT_COMPACT: Field = Field::above(ADVERT_REGION, 1);
const ADVERT_PRESENT: Field = Field::above(ADVERT_COMPACT, 1);
#[cfg(test)]
pub(crate) const ADVERT_LAYOUT: [Field; 4] =
    [ADVERT_COUNT, ADVERT_REGION, ADVERT_COMPACT, ADVERT_PRESENT];

fn pack_advert(region: RegionId, count: u32, compact: bool) -> u64 {
    ADVERT_PRESENT.put(1)
        | ADVERT_COMPACT.put(u64::from(compact))
        | ADVERT_REGION.put(u64::from(region.0))
        | ADVERT_COUNT.put(u64::from(count))
}

fn unpack_advert(word: u64) -> (Option<RegionId>, u32, bool) {
    if ADVERT_PRESENT.get(word) == 0 {
        return (None, 0, false);
    }
    (
        Some(RegionId(ADVERT_REGION.get(word) as u32)),
        ADVERT_COUNT.get(word) as u32,
        ADVERT_COMPACT.get(word) != 0,
    )
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
        let mut local_regions = LastRegion::new();
        let mut remote_regions = LastRegion::new();
        for d in descs {
            // A lease-slot array is written only by its owner's lease book,
            // never by a READ: it is not a landing region.
            let local_region = local_regions.get(d.local, || {
                local
                    .regions
                    .get(d.local)
                    .filter(|r| matches!(r, Region::Raw(_)))
            })?;
            let remote_region = remote_regions.get(d.remote, || remote.regions.get(d.remote))?;
            if !local_region.contains(d.local_offset, d.len)
                || !remote_region.contains(d.remote_offset, d.len)
            {
                return Err(FabricError::OutOfBounds);
            }
        }
        Ok(())
    }
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
