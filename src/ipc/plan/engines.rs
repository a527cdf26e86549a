//! Reading a decoded plan: its engines ([`PlanEngine`], a
//! [`HeartbeatBatch`] the sender serves directly) and their members.

use super::*;

/// The engines of a [`HeartbeatPlan`], in order.
#[derive(Clone, Debug)]
pub struct PlanEngines<'a> {
    pub(super) plan: HeartbeatPlan<'a>,
    pub(super) next: u32,
}

impl<'a> Iterator for PlanEngines<'a> {
    type Item = PlanEngine<'a>;

    fn next(&mut self) -> Option<PlanEngine<'a>> {
        if self.next >= self.plan.engines {
            return None;
        }
        let i = self.next;
        self.next += 1;
        Some(PlanEngine {
            plan: self.plan,
            rec: self.plan.frame.record(i),
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.plan.engines.saturating_sub(self.next) as usize;
        (left, Some(left))
    }
}

impl ExactSizeIterator for PlanEngines<'_> {}

/// One engine of a received plan and its requests, borrowed from the bytes.
/// What [`crate::consumer::HeartbeatSender::send_plan`] heartbeats.
#[derive(Clone, Copy)]
pub struct PlanEngine<'a> {
    pub(super) plan: HeartbeatPlan<'a>,
    pub(super) rec: EngineRecord,
}

impl<'a> PlanEngine<'a> {
    /// The engine's handle in the scheduler's tracker.
    pub fn handle(&self) -> EngineHandle {
        EngineHandle {
            index: self.rec.index,
            generation: self.rec.generation,
        }
    }

    /// The engine's identity.
    pub fn key(&self) -> EngineKey<'a> {
        EngineKey {
            engine_id: self
                .plan
                .id(self.rec.engine_id_offset, self.rec.engine_id_len),
            host: self.plan.id(self.rec.host_offset, self.rec.host_len),
            port: self.rec.port,
            tp_size: self.rec.tp_size,
        }
    }

    /// P's pipeline-parallel size.
    pub fn pp_size(&self) -> u32 {
        self.rec.pp_size
    }

    /// P's decode-context-parallel size.
    pub fn dcp_size(&self) -> u32 {
        self.rec.dcp_size
    }

    /// Due, or owed by some worker.
    pub fn reason(&self) -> BatchReason {
        if self.rec.kind == KIND_OWED {
            BatchReason::Owed
        } else {
            BatchReason::Due
        }
    }

    /// Requests (at least 1).
    pub fn len(&self) -> usize {
        self.rec.member_count as usize
    }

    /// Never true for a decoded engine.
    pub fn is_empty(&self) -> bool {
        self.rec.member_count == 0
    }

    /// Whether every request has a lease slot and nonce.
    pub fn all_leased(&self) -> bool {
        self.rec.flags & FLAG_ALL_LEASED != 0
    }

    /// Each request's P-side id and lease, in the scheduler's order.
    pub fn remotes(&self) -> PlanMembers<'a> {
        PlanMembers {
            plan: self.plan,
            next: self.rec.first_member,
            end: self.rec.first_member.saturating_add(self.rec.member_count),
        }
    }

    /// The P-side ids.
    pub fn remote_request_ids(&self) -> impl ExactSizeIterator<Item = &'a str> + Clone + 'a {
        self.remotes().map(|r| r.remote_request_id)
    }

    /// The (slot, nonce) pairs of the requests that have them.
    pub fn leases(&self) -> impl Iterator<Item = CompactEntry> + Clone + 'a {
        self.remotes()
            .filter_map(|r| r.lease.map(CompactEntry::from))
    }
}

impl fmt::Debug for PlanEngine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlanEngine")
            .field("key", &self.key())
            .field("handle", &self.handle())
            .field("reason", &self.reason())
            .field("len", &self.len())
            .finish()
    }
}

impl sealed::Sealed for PlanEngine<'_> {}

impl HeartbeatBatch for PlanEngine<'_> {
    fn handle(&self) -> EngineHandle {
        PlanEngine::handle(self)
    }

    fn key(&self) -> EngineKey<'_> {
        PlanEngine::key(self)
    }

    fn pp_size(&self) -> u32 {
        self.rec.pp_size
    }

    fn dcp_size(&self) -> u32 {
        self.rec.dcp_size
    }

    fn reason(&self) -> BatchReason {
        PlanEngine::reason(self)
    }

    fn len(&self) -> usize {
        PlanEngine::len(self)
    }

    fn all_leased(&self) -> bool {
        PlanEngine::all_leased(self)
    }

    fn id_bytes(&self) -> usize {
        self.remote_request_ids().map(str::len).sum()
    }

    fn remotes(&self) -> impl Iterator<Item = TrackedRemote<'_>> + Clone + '_ {
        PlanEngine::remotes(self)
    }

    fn remote_request_ids(&self) -> impl Iterator<Item = &str> + Clone + '_ {
        PlanEngine::remote_request_ids(self)
    }

    fn leases(&self) -> impl Iterator<Item = CompactEntry> + Clone + '_ {
        PlanEngine::leases(self)
    }
}

/// The requests of a [`PlanEngine`], in the scheduler's order.
#[derive(Clone)]
pub struct PlanMembers<'a> {
    pub(super) plan: HeartbeatPlan<'a>,
    pub(super) next: u32,
    pub(super) end: u32,
}

impl<'a> Iterator for PlanMembers<'a> {
    type Item = TrackedRemote<'a>;

    #[inline]
    fn next(&mut self) -> Option<TrackedRemote<'a>> {
        if self.next >= self.end {
            return None;
        }
        let j = self.next;
        self.next += 1;
        Some(self.plan.member(j))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.end.saturating_sub(self.next) as usize;
        (left, Some(left))
    }
}

impl ExactSizeIterator for PlanMembers<'_> {}

impl fmt::Debug for PlanMembers<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlanMembers")
            .field("left", &self.len())
            .finish()
    }
}
