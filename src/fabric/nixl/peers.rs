//! The NIXL fabric's peer table: a fixed number of entries
//! ([`NixlConfig::max_agents`]), the [`AgentId`]s it issues, and which
//! entry gives way when a new peer needs one (see the module docs of
//! [`crate::fabric::nixl`], "Peers: removal and eviction"). It touches no
//! NIXL object: releasing what the fabric prepared for a peer is
//! `setup.rs`'s business.
//!
//! An [`AgentId`] is `generation << index_bits | index`, `index_bits` just
//! wide enough for the table. An entry's generation is bumped whenever its
//! peer is removed or evicted, so an id held past that (by a heartbeat
//! sender, a verifier, the engine) is [`FabricError::UnknownAgent`] instead
//! of naming the entry's next peer. Generations wrap after
//! `2^(32 - index_bits)` reuses of one entry (67 million with the default 64
//! entries).

use super::*;

/// Largest peer table: ids keep at least 12 bits of generation.
pub(super) const MAX_PEER_TABLE: usize = 1 << 20;

pub(super) enum PeerState {
    Pending {
        rx: Receiver<Result<Reply, FabricError>>,
        deadline: Instant,
    },
    Ready {
        info: PeerInfo,
        regions: Vec<(u64, u64)>,
    },
    Failed(FabricError),
}

pub(super) struct Peer {
    pub(super) address: String,
    /// Registered from the engine's handshake ([`Fabric::add_peer`]): only
    /// a new `add_peer` revives it, `start_handshake` never dials it.
    pub(super) registered: bool,
    pub(super) state: PeerState,
    /// The NIXL name whose metadata is loaded for this peer, if any.
    pub(super) name: Option<String>,
    /// The fabric's use counter when the peer was last handshaken with,
    /// sent to or read from: the eviction order.
    pub(super) last_used: u64,
}

struct Entry {
    generation: u32,
    peer: Option<Peer>,
    /// Scratch of `victim`: a READ of this peer is in flight.
    busy: bool,
}

pub(super) struct PeerTable {
    entries: Vec<Entry>,
    index_bits: u32,
    live: usize,
}

impl PeerTable {
    /// A table of `capacity` entries (1..=[`MAX_PEER_TABLE`], checked by
    /// `check_config`).
    pub(super) fn new(capacity: usize) -> PeerTable {
        debug_assert!((1..=MAX_PEER_TABLE).contains(&capacity));
        let index_bits = usize::BITS - capacity.saturating_sub(1).leading_zeros();
        PeerTable {
            entries: (0..capacity)
                .map(|_| Entry {
                    generation: 0,
                    peer: None,
                    busy: false,
                })
                .collect(),
            index_bits: index_bits.max(1),
            live: 0,
        }
    }

    /// Peers in the table.
    pub(super) fn live(&self) -> usize {
        self.live
    }

    fn generation_mask(&self) -> u32 {
        u32::MAX >> self.index_bits
    }

    /// The id of the peer in entry `i`.
    pub(super) fn id(&self, i: usize) -> AgentId {
        let generation = self.entries.get(i).map_or(0, |e| e.generation);
        AgentId((generation << self.index_bits) | i as u32)
    }

    /// The entry of a current id; `None` for an id never issued, or whose
    /// peer was removed or evicted since.
    pub(super) fn index(&self, agent: AgentId) -> Option<usize> {
        let i = (agent.0 & ((1u32 << self.index_bits) - 1)) as usize;
        let e = self.entries.get(i)?;
        (e.peer.is_some() && e.generation == agent.0 >> self.index_bits).then_some(i)
    }

    pub(super) fn get(&self, i: usize) -> Option<&Peer> {
        self.entries.get(i).and_then(|e| e.peer.as_ref())
    }

    pub(super) fn get_mut(&mut self, i: usize) -> Option<&mut Peer> {
        self.entries.get_mut(i).and_then(|e| e.peer.as_mut())
    }

    /// The entry of the peer keyed by `address`.
    pub(super) fn find(&self, address: &str) -> Option<usize> {
        self.iter()
            .find(|(_, p)| p.address == address)
            .map(|(i, _)| i)
    }

    /// Every peer, with its entry.
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &Peer)> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.peer.as_ref().map(|p| (i, p)))
    }

    /// The lowest free entry.
    pub(super) fn free_entry(&self) -> Option<usize> {
        self.entries.iter().position(|e| e.peer.is_none())
    }

    /// Puts `peer` into free entry `i`; its id.
    pub(super) fn insert(&mut self, i: usize, peer: Peer) -> AgentId {
        debug_assert!(self.entries[i].peer.is_none(), "entry {i} is taken");
        self.entries[i].peer = Some(peer);
        self.live += 1;
        self.id(i)
    }

    /// Empties entry `i` and retires its id.
    pub(super) fn take(&mut self, i: usize) -> Option<Peer> {
        let mask = self.generation_mask();
        let e = self.entries.get_mut(i)?;
        let peer = e.peer.take()?;
        e.generation = e.generation.wrapping_add(1) & mask;
        self.live -= 1;
        Some(peer)
    }

    /// The peer to evict for a new one: among those without a READ in
    /// flight (`in_flight` yields the entries of READs not yet reported),
    /// a failed peer before any other, then the least recently used.
    /// `None` when every peer has a READ in flight.
    pub(super) fn victim(&mut self, in_flight: impl Iterator<Item = usize>) -> Option<usize> {
        for i in in_flight {
            if let Some(e) = self.entries.get_mut(i) {
                e.busy = true;
            }
        }
        let mut best: Option<((u8, u64), usize)> = None;
        for (i, e) in self.entries.iter_mut().enumerate() {
            let busy = core::mem::take(&mut e.busy);
            let Some(p) = e.peer.as_ref() else { continue };
            if busy {
                continue;
            }
            let class = match p.state {
                PeerState::Failed(_) => 0,
                PeerState::Ready { .. } => 1,
                // A handshake under way was started recently on purpose.
                PeerState::Pending { .. } => 2,
            };
            let key = (class, p.last_used);
            if best.is_none_or(|(k, _)| key < k) {
                best = Some((key, i));
            }
        }
        best.map(|(_, i)| i)
    }
}
