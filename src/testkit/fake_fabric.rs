//! The one fake [`Fabric`] of the crate's tests, unit and integration alike
//! (feature `testkit`; the unit tests see it under `cfg(test)`).
//!
//! It owns two things and nothing else:
//!
//! - **Sends and handshakes** (the D-side heartbeat tests): handshakes
//!   scripted per address prefix ([`Policy`]), and every notification
//!   recorded into storage reserved in [`FakeFabric::new`], so the
//!   zero-allocation tests can use it too.
//! - **READs of remote slot arrays** (the lease verifier's tests): agent `i`
//!   of [`FakeFabric::with_remotes`] exports `remotes[i]`; a READ copies the
//!   remote words into the registered local region when it completes
//!   (completion is held back while `complete` is false, so a slot changed
//!   while a READ is "in flight" is observed), and `fail_next` refuses the
//!   next READ.
//!
//! It may not touch anything outside the fake: no sockets, no threads, no
//! global state, no time of its own (every `now` is ignored). Memory it is
//! given to register is written only by a completed READ, inside the
//! registered bounds; landing buffers registered through
//! [`Fabric::register_landing`] are kept in [`FakeFabric::kept`] (not
//! leaked), so a test can see who holds the last share.
//!
//! [`Fabric::remove_peer`] marks an agent removed: its id is
//! `UnknownAgent` from then on and is never issued again; a handshake with
//! its address makes a new agent, which takes a new entry of the reserved
//! table (removed agents still count against it).
//!
//! Notifications to the fake are never delivered: nothing arrives at
//! [`Fabric::drain_notifications`].

use std::sync::Arc;

use crate::fabric::{
    AgentId, Fabric, FabricError, HandshakeState, LandingWords, PeerInfo, ReadDesc, RegionId,
    XferId, XferState,
};
use crate::slots::{LeaseSlots, SLOT_BYTES};
use crate::time::Instant;

const ADDR_CAP: usize = 96;

/// How the agent at an address behaves.
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    /// `handshake_state` answers Ready at this poll (1 = the first poll).
    pub ready_after_polls: u32,
    /// The first this-many handshake attempts fail.
    pub fail_attempts: u32,
    /// The agent advertises compact heartbeats.
    pub compact: bool,
    /// Every send to the agent fails with this error.
    pub send_error: Option<FabricError>,
}

impl Policy {
    /// Every handshake attempt fails (the agent is never reachable).
    pub fn unreachable() -> Policy {
        Policy {
            fail_attempts: u32::MAX,
            ..Policy::default()
        }
    }

    /// Ready at the first poll, advertising compact heartbeats.
    pub fn compact() -> Policy {
        Policy {
            compact: true,
            ..Policy::default()
        }
    }
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            ready_after_polls: 1,
            fail_attempts: 0,
            compact: false,
            send_error: None,
        }
    }
}

/// One agent the fake has handshaked (or tried to).
#[derive(Clone, Copy, Debug)]
pub struct Agent {
    addr: [u8; ADDR_CAP],
    addr_len: usize,
    pub policy: Policy,
    /// Handshake attempts (start_handshake calls that (re)started it).
    pub attempts: u32,
    /// Polls in the current attempt.
    pub polls: u32,
    pub messages: u64,
    pub bytes: u64,
    pub compact_messages: u64,
    /// Forgotten by `remove_peer`: its id is unknown from then on, and a
    /// handshake with its address makes a new agent.
    pub removed: bool,
}

impl Agent {
    pub fn address(&self) -> &str {
        std::str::from_utf8(&self.addr[..self.addr_len]).unwrap()
    }

    fn failing(&self) -> bool {
        self.attempts <= self.policy.fail_attempts
    }
}

/// A sent message as recorded (when the log has room).
#[derive(Clone, Copy, Debug)]
pub struct Sent {
    pub agent: u32,
    start: usize,
    len: usize,
}

/// A READ as posted: (from, descriptors, finished).
pub type PostedRead = (AgentId, Vec<ReadDesc>, bool);

/// The fake fabric. Every container of the send path has its capacity
/// reserved in `new`.
pub struct FakeFabric {
    max_len: usize,
    agents: Vec<Agent>,
    policies: Vec<(String, Policy)>,
    default_policy: Policy,
    log: Vec<Sent>,
    log_bytes: Vec<u8>,
    pub handshake_calls: u64,
    pub total_messages: u64,
    pub total_bytes: u64,
    pub unlogged: u64,
    /// The remote agents' exported slot arrays, by agent id.
    pub remotes: Vec<Arc<LeaseSlots>>,
    /// Registered local regions, by RegionId (0 is a placeholder).
    regions: Vec<(*mut u8, usize)>,
    /// Every READ posted, by XferId.
    pub reads: Vec<PostedRead>,
    /// While false, every READ stays in progress.
    pub complete: bool,
    /// The next `post_read` fails with this error.
    pub fail_next: Option<FabricError>,
    /// The landing buffers registered with the fake (its share of each).
    pub kept: Vec<Arc<LandingWords>>,
}

impl FakeFabric {
    /// Room for `max_agents` agents and `log_messages` recorded messages
    /// (`log_bytes` bytes in all); `max_len` is the notification limit.
    pub fn new(max_len: usize, max_agents: usize, log_messages: usize, log_bytes: usize) -> Self {
        FakeFabric {
            max_len,
            agents: Vec::with_capacity(max_agents),
            policies: Vec::new(),
            default_policy: Policy::default(),
            log: Vec::with_capacity(log_messages),
            log_bytes: Vec::with_capacity(log_bytes),
            handshake_calls: 0,
            total_messages: 0,
            total_bytes: 0,
            unlogged: 0,
            remotes: Vec::new(),
            regions: vec![(std::ptr::null_mut(), 0)],
            reads: Vec::new(),
            complete: true,
            fail_next: None,
            kept: Vec::new(),
        }
    }

    /// A fake whose agents `0..agents` each export `slots` lease slots (for
    /// READs), with a 4 KiB notification limit and a small send log.
    pub fn with_remotes(agents: usize, slots: u32) -> Self {
        let mut f = FakeFabric::new(4096, 16, 64, 1 << 12);
        f.remotes = (0..agents)
            .map(|_| Arc::new(LeaseSlots::new(slots)))
            .collect();
        f
    }

    /// Agents whose address starts with `prefix` follow `policy` (first
    /// matching prefix wins; others follow the default).
    pub fn set_policy(&mut self, prefix: &str, policy: Policy) {
        self.policies.push((prefix.to_string(), policy));
    }

    pub fn set_default_policy(&mut self, policy: Policy) {
        self.default_policy = policy;
    }

    /// The live (not removed) agent at `address`.
    pub fn agent(&self, address: &str) -> Option<&Agent> {
        self.agents
            .iter()
            .find(|a| !a.removed && a.address() == address)
    }

    pub fn agents(&self) -> &[Agent] {
        &self.agents
    }

    /// Recorded messages as (agent address, bytes).
    pub fn sent(&self) -> impl Iterator<Item = (&str, &[u8])> + '_ {
        self.log.iter().map(|s| {
            (
                self.agents[s.agent as usize].address(),
                &self.log_bytes[s.start..s.start + s.len],
            )
        })
    }

    /// Recorded messages to `address`, as strings.
    pub fn sent_to(&self, address: &str) -> Vec<String> {
        self.sent()
            .filter(|(a, _)| *a == address)
            .map(|(_, m)| String::from_utf8(m.to_vec()).unwrap())
            .collect()
    }

    pub fn clear_log(&mut self) {
        self.log.clear();
        self.log_bytes.clear();
    }

    fn policy_for(&self, address: &str) -> Policy {
        self.policies
            .iter()
            .find(|(p, _)| address.starts_with(p.as_str()))
            .map(|(_, p)| *p)
            .unwrap_or(self.default_policy)
    }
}

impl Fabric for FakeFabric {
    fn name(&self) -> &str {
        "fake"
    }

    fn register_slots(
        &mut self,
        _slots: Arc<LeaseSlots>,
        _compact_heartbeats: bool,
    ) -> Result<RegionId, FabricError> {
        Ok(RegionId(0))
    }

    unsafe fn register_memory(
        &mut self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<RegionId, FabricError> {
        self.regions.push((ptr, len));
        Ok(RegionId(self.regions.len() as u32 - 1))
    }

    fn register_landing(&mut self, words: Arc<LandingWords>) -> Result<RegionId, FabricError> {
        // SAFETY: `kept` holds a share of the words until the fake is
        // dropped, and a boxed slice never moves.
        let id = unsafe { self.register_memory(words.as_ptr().cast_mut(), words.byte_len())? };
        self.kept.push(words);
        Ok(id)
    }

    fn max_notification_len(&self) -> usize {
        self.max_len
    }

    fn start_handshake(&mut self, address: &str, _now: Instant) -> Result<AgentId, FabricError> {
        self.handshake_calls += 1;
        if address.len() > ADDR_CAP {
            return Err(FabricError::BadAddress);
        }
        if let Some(i) = self
            .agents
            .iter()
            .position(|a| !a.removed && a.address() == address)
        {
            let a = &mut self.agents[i];
            if a.failing() {
                // A failed handshake restarts.
                a.attempts += 1;
                a.polls = 0;
            }
            return Ok(AgentId(i as u32));
        }
        if self.agents.len() == self.agents.capacity() {
            return Err(FabricError::Full);
        }
        let mut addr = [0u8; ADDR_CAP];
        addr[..address.len()].copy_from_slice(address.as_bytes());
        let policy = self.policy_for(address);
        self.agents.push(Agent {
            addr,
            addr_len: address.len(),
            policy,
            attempts: 1,
            polls: 0,
            messages: 0,
            bytes: 0,
            compact_messages: 0,
            removed: false,
        });
        Ok(AgentId(self.agents.len() as u32 - 1))
    }

    fn handshake_state(&mut self, agent: AgentId, _now: Instant) -> HandshakeState {
        let Some(a) = self.agents.get_mut(agent.0 as usize).filter(|a| !a.removed) else {
            return HandshakeState::Failed(FabricError::UnknownAgent);
        };
        if a.failing() {
            return HandshakeState::Failed(FabricError::PeerUnreachable);
        }
        a.polls += 1;
        if a.polls >= a.policy.ready_after_polls {
            HandshakeState::Ready(PeerInfo {
                slot_region: Some(RegionId(0)),
                slot_count: 1024,
                compact_heartbeats: a.policy.compact,
                clock: None,
            })
        } else {
            HandshakeState::Pending
        }
    }

    fn send_notification(&mut self, to: AgentId, msg: &[u8]) -> Result<(), FabricError> {
        if msg.len() > self.max_len {
            return Err(FabricError::MessageTooLarge);
        }
        let Some(a) = self.agents.get_mut(to.0 as usize).filter(|a| !a.removed) else {
            return Err(FabricError::UnknownAgent);
        };
        if a.failing() || a.polls < a.policy.ready_after_polls {
            return Err(FabricError::NotConnected);
        }
        if let Some(e) = a.policy.send_error {
            return Err(e);
        }
        a.messages += 1;
        a.bytes += msg.len() as u64;
        if msg.starts_with(b"HBC:") {
            a.compact_messages += 1;
        }
        self.total_messages += 1;
        self.total_bytes += msg.len() as u64;
        if self.log.len() < self.log.capacity()
            && self.log_bytes.capacity() - self.log_bytes.len() >= msg.len()
        {
            self.log.push(Sent {
                agent: to.0,
                start: self.log_bytes.len(),
                len: msg.len(),
            });
            self.log_bytes.extend_from_slice(msg);
        } else {
            self.unlogged += 1;
        }
        Ok(())
    }

    fn drain_notifications(
        &mut self,
        _sink: &mut dyn FnMut(&str, &[u8]),
    ) -> Result<usize, FabricError> {
        Ok(0)
    }

    fn post_read(
        &mut self,
        from: AgentId,
        descs: &[ReadDesc],
        _notification: Option<&[u8]>,
        _now: Instant,
    ) -> Result<XferId, FabricError> {
        if let Some(e) = self.fail_next.take() {
            return Err(e);
        }
        if self.agents.get(from.0 as usize).is_some_and(|a| a.removed) {
            return Err(FabricError::UnknownAgent);
        }
        // An agent that exports no slot array has nothing to read.
        let Some(remote) = self.remotes.get(from.0 as usize) else {
            return Err(FabricError::Full);
        };
        // Like the real fabrics: one descriptor outside the remote region
        // refuses the whole READ.
        let bytes = u64::from(remote.len()) * SLOT_BYTES as u64;
        if descs.iter().any(|d| d.remote_offset + d.len > bytes) {
            return Err(FabricError::OutOfBounds);
        }
        self.reads.push((from, descs.to_vec(), false));
        Ok(XferId(self.reads.len() as u64 - 1))
    }

    fn read_state(&mut self, xfer: XferId, _now: Instant) -> XferState {
        if !self.complete {
            return XferState::InProgress;
        }
        let Some((agent, descs, finished)) = self.reads.get_mut(xfer.0 as usize) else {
            return XferState::Failed(FabricError::UnknownXfer);
        };
        if !*finished {
            *finished = true;
            for d in descs.iter() {
                for w in 0..d.len / 8 {
                    let slot = (d.remote_offset / 8 + w) as u32;
                    let word = self.remotes[agent.0 as usize].load(slot).unwrap_or(0);
                    let at = (d.local_offset + 8 * w) as usize;
                    let (ptr, len) = self.regions[d.local.0 as usize];
                    assert!(at + 8 <= len, "READ past its local region");
                    // SAFETY: inside the registered region (checked above),
                    // which its registrant keeps alive and does not read
                    // until the READ is reported done.
                    unsafe { ptr.add(at).cast::<u64>().write_unaligned(word.to_le()) };
                }
            }
        }
        XferState::Done
    }

    fn remove_peer(&mut self, agent: AgentId) -> Result<(), FabricError> {
        match self.agents.get_mut(agent.0 as usize) {
            Some(a) if !a.removed => {
                a.removed = true;
                Ok(())
            }
            _ => Err(FabricError::UnknownAgent),
        }
    }

    fn cancel_read(&mut self, _xfer: XferId) {}
}
