//! [`VerifyTarget`]: one P rank a request's blocks were read from, as a
//! check names it.

use super::*;

/// One P rank a request's blocks were read from. Build it with
/// [`VerifyTarget::new`] or [`VerifyTarget::from_peer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifyTarget {
    /// The P agent (rank) read from.
    pub agent: AgentId,
    /// That agent's lease-slot region ([`PeerInfo::slot_region`]).
    pub slot_region: RegionId,
    /// Lease slots that agent exports ([`PeerInfo::slot_count`]): a
    /// `remote_lease_slot` at or beyond it is [`Verdict::SlotOutOfRange`].
    pub slot_count: u32,
}

impl VerifyTarget {
    /// The target `agent`, whose lease slots are `slot_count` words in
    /// region `slot_region` (what its handshake advertised).
    pub const fn new(agent: AgentId, slot_region: RegionId, slot_count: u32) -> VerifyTarget {
        VerifyTarget {
            agent,
            slot_region,
            slot_count,
        }
    }

    /// The target a completed handshake describes: `agent` with the slot
    /// region and count it advertised. `None` when the peer exports no lease
    /// slots (a P started without `kv_lease_verification`): its KV cannot be
    /// verified, so submit the check without lease fields, which fails it
    /// as [`Verdict::Unverifiable`].
    ///
    /// ```
    /// use kvlease::consumer::VerifyTarget;
    /// use kvlease::fabric::{AgentId, PeerInfo, RegionId};
    ///
    /// let info = PeerInfo {
    ///     slot_region: Some(RegionId(0)),
    ///     slot_count: 4096,
    ///     compact_heartbeats: true,
    ///     clock: None,
    /// };
    /// let t = VerifyTarget::from_peer(AgentId(3), &info).unwrap();
    /// assert_eq!((t.agent, t.slot_region, t.slot_count), (AgentId(3), RegionId(0), 4096));
    /// assert!(VerifyTarget::from_peer(AgentId(3), &PeerInfo { slot_region: None, ..info }).is_none());
    /// ```
    pub fn from_peer(agent: AgentId, info: &PeerInfo) -> Option<VerifyTarget> {
        Some(VerifyTarget {
            agent,
            slot_region: info.slot_region?,
            slot_count: info.slot_count,
        })
    }
}
