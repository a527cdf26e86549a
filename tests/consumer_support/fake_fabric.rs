//! A recording fake [`Fabric`] for the D-side tests: scripted handshakes,
//! sends recorded into storage preallocated at construction (so the
//! zero-allocation test can use it too). Only what the heartbeat sender uses
//! is implemented; READs and memory registration are refused.
#![allow(dead_code)]

use std::sync::Arc;

use kvlease::fabric::{
    AgentId, Fabric, FabricError, HandshakeState, PeerInfo, ReadDesc, RegionId, XferId, XferState,
};
use kvlease::slots::LeaseSlots;
use kvlease::Instant;

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

/// The fake fabric. Every container has its capacity reserved in `new`.
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
        }
    }

    /// Agents whose address starts with `prefix` follow `policy` (first
    /// matching prefix wins; others follow the default).
    pub fn set_policy(&mut self, prefix: &str, policy: Policy) {
        self.policies.push((prefix.to_string(), policy));
    }

    pub fn set_default_policy(&mut self, policy: Policy) {
        self.default_policy = policy;
    }

    pub fn agent(&self, address: &str) -> Option<&Agent> {
        self.agents.iter().find(|a| a.address() == address)
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
        "fake-d"
    }

    fn register_slots(
        &mut self,
        _slots: Arc<LeaseSlots>,
        _compact_heartbeats: bool,
    ) -> Result<RegionId, FabricError> {
        Err(FabricError::Full)
    }

    unsafe fn register_memory(
        &mut self,
        _ptr: *mut u8,
        _len: usize,
    ) -> Result<RegionId, FabricError> {
        Err(FabricError::Full)
    }

    fn max_notification_len(&self) -> usize {
        self.max_len
    }

    fn start_handshake(&mut self, address: &str, _now: Instant) -> Result<AgentId, FabricError> {
        self.handshake_calls += 1;
        if address.len() > ADDR_CAP {
            return Err(FabricError::BadAddress);
        }
        if let Some(i) = self.agents.iter().position(|a| a.address() == address) {
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
        });
        Ok(AgentId(self.agents.len() as u32 - 1))
    }

    fn handshake_state(&mut self, agent: AgentId, _now: Instant) -> HandshakeState {
        let Some(a) = self.agents.get_mut(agent.0 as usize) else {
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
        let Some(a) = self.agents.get_mut(to.0 as usize) else {
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
        _from: AgentId,
        _descs: &[ReadDesc],
        _notification: Option<&[u8]>,
        _now: Instant,
    ) -> Result<XferId, FabricError> {
        Err(FabricError::Full)
    }

    fn read_state(&mut self, _xfer: XferId, _now: Instant) -> XferState {
        XferState::Failed(FabricError::UnknownXfer)
    }

    fn cancel_read(&mut self, _xfer: XferId) {}
}
