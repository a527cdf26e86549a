//! The network's control plane: construction, the clock, agents by name,
//! crashes and restarts, partitions, and the fault settings of each link.

use super::*;

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

    pub(super) fn set_partition(&self, a: Nodes, b: Nodes, on: bool) {
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

    pub(super) fn for_links(&self, from: Nodes, to: Nodes, f: impl Fn(&LinkCell)) {
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

    pub(super) fn link(&self, from: u32, to: u32) -> &LinkCell {
        // Callers pass indices below max_agents; the link table is its square.
        &self.links[from as usize * self.config.max_agents as usize + to as usize]
    }

    pub(super) fn record(&self, node: u32) -> Option<&AgentRecord> {
        self.nodes.get(node as usize).and_then(|c| c.record.get())
    }

    pub(super) fn liveness(&self, node: u32) -> Option<&Liveness> {
        self.nodes.get(node as usize).map(|c| &c.liveness)
    }

    pub(super) fn incarnation(&self, node: u32) -> u32 {
        self.liveness(node).map_or(0, Liveness::incarnation)
    }

    pub(super) fn lookup(&self, name: &str) -> Option<u32> {
        (0..self.agent_count()).find(|&i| self.record(i).is_some_and(|r| &*r.name == name))
    }

    pub(super) fn observe(&self, now: Instant) {
        self.advance_to(now);
    }

    /// Either end crashed or gone, or the pair partitioned.
    pub(super) fn link_down(&self, from: u32, to: u32) -> bool {
        let down = |n| self.liveness(n).is_none_or(Liveness::is_down);
        down(from) || down(to) || self.link(from, to).is_partitioned()
    }

    /// `node`'s own clock at virtual time `t`.
    pub(super) fn own_clock(&self, node: u32, t: Instant) -> Instant {
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
