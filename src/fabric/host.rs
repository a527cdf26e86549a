//! [`HostFabric`]: a [`Fabric`] whose NIXL calls the host engine makes.
//!
//! This module owns the bookkeeping of a fabric that does no I/O of its
//! own: it records the READs a role posts, hands them to the engine, and
//! answers [`Fabric::read_state`] with what the engine reported. It exists
//! for engines whose NIXL agent cannot be shared with Rust (vLLM's Python
//! `nixl_agent` is a pybind11 object with no raw agent pointer): the engine
//! keeps its agent and does every READ, and the lease roles keep their state
//! here, unchanged. The lease verifier runs over it exactly as over the
//! NIXL fabric: one slot READ per P rank per step, coalesced windows,
//! verdicts from the landed words.
//!
//! It may not touch a network, a clock or another process: `now` is only
//! passed through, and nothing here blocks.
//!
//! ```text
//!  engine (host)                         HostFabric                  LeaseVerifier
//!  add_peer(name, slot count) ───────▶ AgentId, Ready at once
//!  register each landing_region() ◀─── regions the verifier registered (addr, len)
//!                                                               ◀── step: post_read(agent, descs)
//!  take_posted(): one READ per P rank ◀── queued READs (xfer, agent, descs)
//!  nixl READ(remote slot base + remote_offset → local addr + local_offset)
//!  complete(xfer, Ok | Err) ─────────▶ Done / Failed ───────────▶ step: read_state, verdicts
//! ```
//!
//! # Capacities
//!
//! Fixed at construction ([`HostConfig`]): peers, READs in flight (posted
//! and not yet reported by `read_state`), and descriptors posted between
//! two [`HostFabric::take_posted`] calls (a coalesced slot check is one
//! descriptor; a scattered one, one per slot). Descriptors live only until
//! the host takes them (it copies them into its own transfer request), so
//! their arena starts over at every `take_posted`. A READ beyond these
//! capacities is refused with [`FabricError::Full`], which the verifier
//! turns into a failed check (fail closed). Nothing allocates after
//! construction except [`Fabric::add_peer`] and the registrations.
//!
//! # Notifications
//!
//! The host sends and drains notifications itself (vLLM's heartbeats and
//! read-dones stay in its own code), so [`Fabric::send_notification`] is
//! [`FabricError::Unsupported`] and [`Fabric::drain_notifications`] never
//! delivers anything.

use std::sync::Arc;

use super::{
    AgentId, Fabric, FabricError, HandshakeState, LandingWords, PeerInfo, PeerRecord, ReadDesc,
    RegionId, XferId, XferState,
};
use crate::slots::LeaseSlots;
use crate::time::Instant;

/// How many of each a [`HostFabric`] holds at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostConfig {
    /// Remote agents (P ranks) at once.
    pub max_peers: u32,
    /// READs posted and not yet reported done or failed.
    pub max_reads: u32,
    /// Descriptors posted between two [`HostFabric::take_posted`] calls.
    pub max_descs: u32,
}

impl HostConfig {
    /// Room for a verifier of `capacity` checks against `max_agents` P
    /// ranks with `max_fan_out` targets each: one READ per agent in
    /// flight, and descriptors for every check's every target (the
    /// scattered worst case).
    pub fn for_verifier(capacity: u32, max_agents: u32, max_fan_out: u32) -> HostConfig {
        HostConfig {
            max_peers: max_agents,
            max_reads: max_agents,
            max_descs: capacity.saturating_mul(max_fan_out).max(max_agents),
        }
    }
}

#[derive(Debug)]
struct Peer {
    name: String,
    slot_count: u32,
    /// The peer's lease slots are remote region `slot_region`.
    slot_region: Option<RegionId>,
    generation: u32,
    in_use: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadState {
    Free,
    /// Posted by a role, not yet taken by the host.
    Queued,
    /// Taken by the host, not yet completed.
    Taken,
    Done,
    Failed(FabricError),
}

#[derive(Clone, Copy, Debug)]
struct Read {
    state: ReadState,
    generation: u32,
    agent: AgentId,
    /// The READ's descriptors: `descs[first..first + count]`.
    first: u32,
    count: u32,
}

/// A READ for the host to perform: from peer `agent` (its name:
/// [`HostFabric::peer_name`]), each descriptor `len` bytes from the peer's
/// region `remote` at `remote_offset` into local region `local` at
/// `local_offset` ([`HostFabric::local_region`] gives the address).
#[derive(Clone, Copy, Debug)]
pub struct PostedRead<'a> {
    /// The READ's id: report it with [`HostFabric::complete`].
    pub xfer: XferId,
    /// The remote agent.
    pub agent: AgentId,
    /// What to copy.
    pub descs: &'a [ReadDesc],
}

/// A fabric whose I/O the host engine performs. See the module docs.
#[derive(Debug)]
pub struct HostFabric {
    name: String,
    config: HostConfig,
    peers: Vec<Peer>,
    /// Local regions: landing buffers (kept alive here) and raw memory.
    locals: Vec<(usize, usize)>,
    landings: Vec<Arc<LandingWords>>,
    /// Keeps a registered slot array alive while the host reads from it.
    #[cfg_attr(loom, allow(dead_code))]
    slots: Option<Arc<LeaseSlots>>,
    reads: Box<[Read]>,
    free_reads: Vec<u32>,
    /// Descriptors of the READs not yet taken, back to back.
    descs: Box<[ReadDesc]>,
    desc_head: u32,
    /// READs posted and not yet taken, in posting order.
    queued: Vec<u32>,
}

const NO_DESC: ReadDesc = ReadDesc {
    local: RegionId(0),
    local_offset: 0,
    remote: RegionId(0),
    remote_offset: 0,
    len: 0,
};

impl HostFabric {
    /// A fabric named `name` (the host agent's name) with room for `config`.
    pub fn new(name: impl Into<String>, config: HostConfig) -> HostFabric {
        let max_reads = config.max_reads.max(1);
        HostFabric {
            name: name.into(),
            config,
            peers: Vec::with_capacity(config.max_peers as usize),
            locals: Vec::new(),
            landings: Vec::new(),
            slots: None,
            reads: vec![
                Read {
                    state: ReadState::Free,
                    generation: 0,
                    agent: AgentId(0),
                    first: 0,
                    count: 0,
                };
                max_reads as usize
            ]
            .into_boxed_slice(),
            free_reads: (0..max_reads).rev().collect(),
            descs: vec![NO_DESC; config.max_descs.max(1) as usize].into_boxed_slice(),
            desc_head: 0,
            queued: Vec::with_capacity(max_reads as usize),
        }
    }

    /// A local region's (address, length), for the host to register with
    /// its agent; `None` for an id this fabric did not issue.
    pub fn local_region(&self, region: RegionId) -> Option<(usize, usize)> {
        self.locals.get(region.0 as usize).copied()
    }

    /// Every local region, in id order.
    pub fn local_regions(&self) -> impl Iterator<Item = (RegionId, usize, usize)> + '_ {
        self.locals
            .iter()
            .enumerate()
            .map(|(i, &(a, l))| (RegionId(i as u32), a, l))
    }

    /// The name the host gave peer `agent`, while it is registered.
    pub fn peer_name(&self, agent: AgentId) -> Option<&str> {
        self.peer(agent).map(|p| p.name.as_str())
    }

    fn peer(&self, agent: AgentId) -> Option<&Peer> {
        let (generation, index) = unpack_agent(agent);
        self.peers
            .get(index as usize)
            .filter(|p| p.in_use && p.generation == generation)
    }

    /// Hands every READ posted since the last call to `sink`, oldest first,
    /// and marks it taken: the host performs it and reports it with
    /// [`HostFabric::complete`]. Allocates nothing.
    pub fn take_posted(&mut self, mut sink: impl FnMut(PostedRead<'_>)) -> usize {
        let n = self.queued.len();
        for k in 0..n {
            let i = self.queued[k];
            let r = &mut self.reads[i as usize];
            if r.state != ReadState::Queued {
                continue; // cancelled before it was taken
            }
            r.state = ReadState::Taken;
            let r = *r;
            let descs = self.desc_slice(r.first, r.count);
            sink(PostedRead {
                xfer: XferId::pack(r.generation, i),
                agent: r.agent,
                descs,
            });
        }
        self.queued.clear();
        // The host has its copies: the arena starts over.
        self.desc_head = 0;
        n
    }

    /// The host finished READ `xfer`: `Ok` when every descriptor was
    /// copied, else the error to fail it with (a timeout, a backend
    /// status). An id that is unknown, or already completed or cancelled,
    /// is a no-op: returns false.
    pub fn complete(&mut self, xfer: XferId, result: Result<(), FabricError>) -> bool {
        let (generation, index) = xfer.unpack();
        match self.reads.get_mut(index as usize) {
            Some(r) if r.generation == generation && r.state == ReadState::Taken => {
                r.state = match result {
                    Ok(()) => ReadState::Done,
                    Err(e) => ReadState::Failed(e),
                };
                true
            }
            _ => false,
        }
    }

    /// READs posted and not yet reported by [`Fabric::read_state`].
    pub fn reads_in_flight(&self) -> u32 {
        self.reads
            .iter()
            .filter(|r| r.state != ReadState::Free)
            .count() as u32
    }

    fn desc_slice(&self, first: u32, count: u32) -> &[ReadDesc] {
        self.descs
            .get(first as usize..(first + count) as usize)
            .unwrap_or(&[])
    }

    fn release(&mut self, index: u32) {
        let r = &mut self.reads[index as usize];
        r.state = ReadState::Free;
        r.generation = r.generation.wrapping_add(1);
        r.count = 0;
        self.free_reads.push(index);
    }
}

/// An [`AgentId`] of this fabric: a peer's table index (low 16 bits) and
/// the generation of that table entry (high 16 bits), bumped on every
/// reuse, so that a removed peer's id never names its successor.
fn pack_agent(generation: u32, index: u32) -> AgentId {
    AgentId(((generation & 0xFFFF) << 16) | (index & 0xFFFF))
}

/// (generation, index) of an [`AgentId`] made by [`pack_agent`].
fn unpack_agent(agent: AgentId) -> (u32, u32) {
    (agent.0 >> 16, agent.0 & 0xFFFF)
}

impl Fabric for HostFabric {
    fn name(&self) -> &str {
        &self.name
    }

    /// Keeps the array and its region; the host registers it with its own
    /// agent ([`HostFabric::local_region`]) and advertises it itself.
    fn register_slots(
        &mut self,
        slots: Arc<LeaseSlots>,
        _compact_heartbeats: bool,
    ) -> Result<RegionId, FabricError> {
        // Under loom the slot words are loom atomics with no byte view
        // (`LeaseSlots::as_ptr`); the loom models never register them here.
        #[cfg(loom)]
        {
            let _ = slots;
            Err(FabricError::Unsupported)
        }
        #[cfg(not(loom))]
        {
            let id = RegionId(self.locals.len() as u32);
            self.locals
                .push((slots.as_ptr() as usize, slots.byte_len()));
            self.slots = Some(slots);
            Ok(id)
        }
    }

    unsafe fn register_memory(
        &mut self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<RegionId, FabricError> {
        if ptr.is_null() || len == 0 {
            return Err(FabricError::OutOfBounds);
        }
        let id = RegionId(self.locals.len() as u32);
        self.locals.push((ptr as usize, len));
        Ok(id)
    }

    fn register_landing(&mut self, words: Arc<LandingWords>) -> Result<RegionId, FabricError> {
        let id = RegionId(self.locals.len() as u32);
        self.locals
            .push((words.as_ptr() as usize, words.byte_len()));
        self.landings.push(words);
        Ok(id)
    }

    fn max_notification_len(&self) -> usize {
        0
    }

    /// A peer is added by the host ([`Fabric::add_peer`]); a handshake by
    /// address finds it by name.
    fn start_handshake(&mut self, address: &str, _now: Instant) -> Result<AgentId, FabricError> {
        self.peers
            .iter()
            .enumerate()
            .find(|(_, p)| p.in_use && p.name == address)
            .map(|(i, p)| pack_agent(p.generation, i as u32))
            .ok_or(FabricError::UnknownAgent)
    }

    fn handshake_state(&mut self, agent: AgentId, _now: Instant) -> HandshakeState {
        match self.peer(agent) {
            Some(p) => HandshakeState::Ready(PeerInfo {
                slot_region: p.slot_region,
                slot_count: p.slot_count,
                compact_heartbeats: false,
                clock: None,
            }),
            None => HandshakeState::Failed(FabricError::UnknownAgent),
        }
    }

    /// Registers a P rank by the name the host's agent knows it by. Its
    /// slot region is remote region 0 (the host reads `remote_offset` from
    /// the base of the slot array that P advertised in its handshake). The
    /// same name again replaces the old incarnation (a restarted P).
    fn add_peer(&mut self, peer: &PeerRecord<'_>, _now: Instant) -> Result<AgentId, FabricError> {
        let (slot_region, slot_count) = match peer.advert.and_then(|a| a.slots) {
            Some(s) => (Some(RegionId(0)), s.count),
            None => (None, 0),
        };
        if let Some(i) = self
            .peers
            .iter()
            .position(|p| p.in_use && p.name == peer.agent_name)
        {
            let p = &mut self.peers[i];
            p.generation = p.generation.wrapping_add(1) & 0xFFFF;
            p.slot_region = slot_region;
            p.slot_count = slot_count;
            return Ok(pack_agent(p.generation, i as u32));
        }
        let fresh = Peer {
            name: peer.agent_name.to_string(),
            slot_count,
            slot_region,
            generation: 0,
            in_use: true,
        };
        if let Some(i) = self.peers.iter().position(|p| !p.in_use) {
            let generation = (self.peers[i].generation.wrapping_add(1)) & 0xFFFF;
            self.peers[i] = Peer {
                generation,
                ..fresh
            };
            return Ok(pack_agent(generation, i as u32));
        }
        if self.peers.len() >= self.config.max_peers as usize || self.peers.len() > 0xFFFF {
            return Err(FabricError::Full);
        }
        self.peers.push(fresh);
        Ok(pack_agent(0, self.peers.len() as u32 - 1))
    }

    /// Forgets the peer; READs from it not yet reported fail with
    /// [`FabricError::Cancelled`].
    fn remove_peer(&mut self, agent: AgentId) -> Result<(), FabricError> {
        let (_, index) = unpack_agent(agent);
        if self.peer(agent).is_none() {
            return Err(FabricError::UnknownAgent);
        }
        self.peers[index as usize].in_use = false;
        for r in self.reads.iter_mut() {
            if r.agent == agent && matches!(r.state, ReadState::Queued | ReadState::Taken) {
                r.state = ReadState::Failed(FabricError::Cancelled);
            }
        }
        Ok(())
    }

    fn send_notification(&mut self, _to: AgentId, _msg: &[u8]) -> Result<(), FabricError> {
        Err(FabricError::Unsupported)
    }

    fn drain_notifications(
        &mut self,
        _sink: &mut dyn FnMut(&str, &[u8]),
    ) -> Result<usize, FabricError> {
        Ok(0)
    }

    /// Queues the READ for the host ([`HostFabric::take_posted`]). A
    /// notification cannot be attached (the host sends read-dones itself,
    /// after the verdict).
    fn post_read(
        &mut self,
        from: AgentId,
        descs: &[ReadDesc],
        notification: Option<&[u8]>,
        _now: Instant,
    ) -> Result<XferId, FabricError> {
        if notification.is_some() {
            return Err(FabricError::Unsupported);
        }
        if self.peer(from).is_none() {
            return Err(FabricError::UnknownAgent);
        }
        for d in descs {
            match self.local_region(d.local) {
                Some((_, len)) if d.local_offset.saturating_add(d.len) <= len as u64 => {}
                Some(_) => return Err(FabricError::OutOfBounds),
                None => return Err(FabricError::UnknownRegion),
            }
        }
        let count = descs.len() as u32;
        let first = self.desc_head;
        if first as usize + descs.len() > self.descs.len() {
            return Err(FabricError::Full);
        }
        let Some(i) = self.free_reads.pop() else {
            return Err(FabricError::Full);
        };
        self.descs[first as usize..first as usize + descs.len()].copy_from_slice(descs);
        self.desc_head += count;
        let r = &mut self.reads[i as usize];
        r.state = ReadState::Queued;
        r.agent = from;
        r.first = first;
        r.count = count;
        self.queued.push(i);
        Ok(XferId::pack(r.generation, i))
    }

    fn read_state(&mut self, xfer: XferId, _now: Instant) -> XferState {
        let (generation, index) = xfer.unpack();
        let Some(r) = self.reads.get(index as usize).copied() else {
            return XferState::Failed(FabricError::UnknownXfer);
        };
        if r.generation != generation {
            return XferState::Failed(FabricError::UnknownXfer);
        }
        match r.state {
            ReadState::Free => XferState::Failed(FabricError::UnknownXfer),
            ReadState::Queued | ReadState::Taken => XferState::InProgress,
            ReadState::Done => {
                self.release(index);
                XferState::Done
            }
            ReadState::Failed(e) => {
                self.release(index);
                XferState::Failed(e)
            }
        }
    }

    fn cancel_read(&mut self, xfer: XferId) {
        let (generation, index) = xfer.unpack();
        if let Some(r) = self.reads.get(index as usize) {
            if r.generation == generation && r.state != ReadState::Free {
                self.release(index);
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
