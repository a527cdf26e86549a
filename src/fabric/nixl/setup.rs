//! Building a [`NixlFabric`] (over an agent of its own or the engine's),
//! its registrations, advert and exported metadata, and the peer and READ
//! bookkeeping the [`Fabric`] methods share: claiming a peer entry (with
//! eviction) and releasing a peer in NIXL. Dropping it stops the side
//! channel's listener.

use super::*;

impl NixlFabric {
    /// Creates the NIXL agent and its UCX backend and starts the handshake
    /// listener. Fails with [`NixlInitError::RuntimeNotFound`] (without
    /// touching NIXL) when `libnixl_capi.so` cannot be loaded.
    pub fn new(config: NixlConfig) -> Result<NixlFabric, NixlInitError> {
        let name = config.agent_name.clone();
        if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
            return Err(NixlInitError::BadName);
        }
        check_config(&config)?;
        if let ProgressMode::Thread { delay_us: 0 } = config.progress {
            return Err(NixlInitError::BadConfig(
                "progress thread delay must be > 0 (0 busy-spins)",
            ));
        }
        if !runtime_available() {
            return Err(NixlInitError::RuntimeNotFound);
        }

        let (prog, delay) = match config.progress {
            ProgressMode::EngineLoop => (false, 0),
            ProgressMode::Thread { delay_us } => (true, delay_us),
        };
        let agent_config = AgentConfig {
            enable_prog_thread: prog,
            enable_listen_thread: false,
            thread_sync: ThreadSync::Default,
            num_workers: 1,
            pthr_delay_us: delay,
            capture_telemetry: false,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(&name, &agent_config)
            .map_err(|e| NixlInitError::Agent(status_of(&e)))?;
        AGENTS_CREATED.fetch_add(1, Ordering::Relaxed);
        let (_mems, defaults) = agent
            .get_plugin_params("UCX")
            .map_err(|e| NixlInitError::Backend(status_of(&e)))?;
        let mut params = defaults
            .clone()
            .map_err(|e| NixlInitError::Backend(status_of(&e)))?;
        let mode = match config.error_handling {
            UcxErrorHandling::None => "none",
            UcxErrorHandling::Peer => "peer",
        };
        params
            .set("ucx_error_handling_mode", mode)
            .map_err(|e| NixlInitError::Backend(status_of(&e)))?;
        // The agent keeps the backend; destroyed with the agent.
        let _backend = agent
            .create_backend("UCX", &params)
            .map_err(|e| NixlInitError::Backend(status_of(&e)))?;
        NixlFabric::build(agent, name, config, false)
    }

    /// A fabric over an agent the engine already owns: kvlease creates no
    /// agent and no backend, registers its lease slots and landing words on
    /// this one, and posts its notifications and slot READs on it, beside
    /// the engine's own KV READs. The agent must already have its backend
    /// (UCX); its name is the fabric's name (`config.agent_name` is
    /// ignored), and its progress and error-handling settings are the
    /// engine's (`config.progress` and `config.error_handling` are ignored).
    ///
    /// **The engine drains.** [`Fabric::drain_notifications`] makes no NIXL
    /// call and returns 0: the engine drains its agent once per step, as it
    /// already does, and hands kvlease's notifications to the roles
    /// ([`PrefillRank::on_notification`](crate::PrefillRank::on_notification)
    /// on P; anything it refuses is the engine's). The engine's drain is
    /// also what progresses the agent in the engine-loop mode, so it must
    /// still happen every step.
    ///
    /// Peers come from the engine's handshake ([`Fabric::add_peer`]), with
    /// [`Fabric::lease_advert`] carried in it; the side channel runs only if
    /// `config.side_channel` is left on.
    ///
    /// `Agent` is not `Send`: build and use the fabric on the thread that
    /// owns the agent. Fails with [`NixlInitError::RuntimeNotFound`] when
    /// `libnixl_capi.so` cannot be loaded.
    pub fn with_agent(agent: &Agent, config: NixlConfig) -> Result<NixlFabric, NixlInitError> {
        check_config(&config)?;
        if !runtime_available() {
            return Err(NixlInitError::RuntimeNotFound);
        }
        let name = agent.name();
        if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
            return Err(NixlInitError::BadName);
        }
        NixlFabric::build(agent.clone(), name, config, true)
    }

    /// The rest of construction, over `agent` (created by us or the engine).
    pub(super) fn build(
        agent: Agent,
        name: String,
        config: NixlConfig,
        engine_drains: bool,
    ) -> Result<NixlFabric, NixlInitError> {
        let helper = |e: NixlError| NixlInitError::Backend(status_of(&e));
        let notif_map = NotificationMap::new().map_err(helper)?;
        let mut opt_plain = OptArgs::new().map_err(helper)?;
        opt_plain.set_has_notification(false).map_err(helper)?;
        let mut opt_notif = OptArgs::new().map_err(helper)?;
        opt_notif.set_has_notification(true).map_err(helper)?;

        let advert = Arc::new(Mutex::new(Arc::new(Vec::new())));
        let listener = if config.side_channel {
            Some(start_listener(
                config.listen_addr,
                advert.clone(),
                config.clock,
                config.max_side_channel_clients,
            )?)
        } else {
            None
        };

        let inflight = config.max_inflight_reads;
        let cache_cap = config.max_cached_requests.max(inflight);
        let mut fabric = NixlFabric {
            cache: (0..cache_cap).map(|_| None).collect(),
            cache_index: FxHashMap::with_capacity_and_hasher(cache_cap, Default::default()),
            cache_free: FreeStack::full(cache_cap as u32),
            reads: vec![FREE_READ; inflight],
            reads_free: FreeStack::full(inflight as u32),
            regions: Vec::new(),
            slot_arrays: Vec::new(),
            landing: Vec::new(),
            slot_advert: None,
            notif_map,
            opt_plain,
            opt_notif,
            peers: PeerTable::new(config.max_agents),
            advert,
            listener,
            engine_drains,
            agent,
            name,
            config,
            read_seq: 0,
            use_counter: 0,
            stats: NixlStats::default(),
        };
        fabric
            .publish_advert()
            .map_err(|e| NixlInitError::Backend(backend_code(e)))?;
        Ok(fabric)
    }

    /// The handshake listener's address: what peers pass to
    /// [`Fabric::start_handshake`] (as `ip:port`).
    pub fn listen_addr(&self) -> SocketAddr {
        self.listener
            .as_ref()
            .map_or(SocketAddr::from(([0, 0, 0, 0], 0)), |l| l.addr)
    }

    /// Whether this fabric runs on an agent the engine owns and drains
    /// ([`NixlFabric::with_agent`]).
    pub fn engine_drains(&self) -> bool {
        self.engine_drains
    }

    /// Counters since construction (and two gauges: peers and prepared
    /// requests held now).
    pub fn stats(&self) -> NixlStats {
        let (answered, refused) = self
            .listener
            .as_ref()
            .map_or((0, 0), |l| l.counters.snapshot());
        NixlStats {
            peers: self.peers.live() as u64,
            cached_requests: self.cache.iter().filter(|c| c.is_some()).count() as u64,
            side_channel_answered: answered,
            side_channel_refused: refused,
            ..self.stats
        }
    }

    /// This agent's NIXL metadata (`get_local_md`), covering every
    /// registration so far: what a peer that does not speak kvlease's side
    /// channel loads (`load_remote_md`) to reach us, e.g. as the
    /// [`PeerRecord::metadata`] of its own fabric's [`Fabric::add_peer`].
    /// Take it after the last registration. Allocates; not a step path.
    pub fn local_metadata(&self) -> Result<Vec<u8>, FabricError> {
        self.agent.get_local_md().map_err(backend)
    }

    /// Local region `id` as a peer names it: the virtual address and length
    /// registered with NIXL (what [`PeerRecord::regions`] carries to a
    /// peer's `add_peer`). `None` for an id not registered here.
    pub fn local_region(&self, id: RegionId) -> Option<RemoteRegion> {
        self.regions.get(id.0 as usize).map(|r| RemoteRegion {
            addr: r.addr as u64,
            len: r.len as u64,
        })
    }

    /// Registers `addr..addr+len` with NIXL and records it as the next region.
    pub(super) fn register_region(
        &mut self,
        addr: usize,
        len: usize,
        kind: RegionKind,
    ) -> Result<RegionId, FabricError> {
        if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
            return Err(FabricError::Backend(STATUS_INVALID_PARAM));
        }
        let id = u32::try_from(self.regions.len()).map_err(|_| FabricError::Full)?;
        if id == NO_REGION {
            return Err(FabricError::Full);
        }
        let registration = self
            .agent
            .register_memory(&DramRange { addr, len }, None)
            .map_err(backend)?;
        self.regions.push(LocalRegion {
            addr,
            len,
            kind,
            _registration: registration,
        });
        Ok(RegionId(id))
    }

    /// Re-encodes what the listener answers: our metadata (which now covers
    /// every registration) and our advertisement.
    pub(super) fn publish_advert(&mut self) -> Result<(), FabricError> {
        let md = self.agent.get_local_md().map_err(backend)?;
        let (slot_region, slot_count, compact) = match self.slot_advert {
            Some((r, n, c)) => (r.0, n, c),
            None => (NO_REGION, 0, false),
        };
        let mut body = Vec::with_capacity(64 + 16 * self.regions.len() + md.len());
        body.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        body.extend_from_slice(self.name.as_bytes());
        body.extend_from_slice(&slot_region.to_le_bytes());
        body.extend_from_slice(&slot_count.to_le_bytes());
        body.push(u8::from(compact));
        body.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            body.extend_from_slice(&(r.addr as u64).to_le_bytes());
            body.extend_from_slice(&(r.len as u64).to_le_bytes());
        }
        body.extend_from_slice(&(md.len() as u32).to_le_bytes());
        body.extend_from_slice(&md);
        let mut guard = self.advert.lock().unwrap_or_else(|p| p.into_inner());
        *guard = Arc::new(body);
        Ok(())
    }

    pub(super) fn peer_index(&self, agent: AgentId) -> Result<usize, FabricError> {
        self.peers.index(agent).ok_or(FabricError::UnknownAgent)
    }

    /// Stamps peer `i` as used now (the eviction order).
    pub(super) fn touch(&mut self, i: usize) {
        self.use_counter += 1;
        if let Some(p) = self.peers.get_mut(i) {
            p.last_used = self.use_counter;
        }
    }

    /// The peer, if its handshake completed and it has not failed since;
    /// stamped as used.
    pub(super) fn ready_peer(&mut self, agent: AgentId) -> Result<usize, FabricError> {
        let i = self.peer_index(agent)?;
        match self.peers.get(i).map(|p| &p.state) {
            Some(PeerState::Ready { .. }) => {
                self.touch(i);
                Ok(i)
            }
            _ => Err(FabricError::NotConnected),
        }
    }

    /// A free entry for a new peer, evicting one when the table is full
    /// (see the module docs, "Peers: removal and eviction"): `Full` when
    /// every peer has a READ in flight.
    pub(super) fn claim_entry(&mut self) -> Result<usize, FabricError> {
        if let Some(i) = self.peers.free_entry() {
            return Ok(i);
        }
        let in_flight = self
            .reads
            .iter()
            .filter(|r| r.id != 0 && r.failed.is_none())
            .map(|r| r.peer as usize);
        let victim = self.peers.victim(in_flight).ok_or(FabricError::Full)?;
        self.release_peer(victim);
        self.stats.peers_evicted += 1;
        debug_assert_eq!(self.peers.free_entry(), Some(victim));
        Ok(victim)
    }

    /// Forgets the peer in entry `i`: its READs in flight end
    /// `Failed(Cancelled)`, its prepared requests are released, its
    /// metadata is invalidated in NIXL (unless another peer entry loaded the
    /// same agent), and its id is retired.
    pub(super) fn release_peer(&mut self, i: usize) {
        // Every READ not yet reported, even one NIXL completed already:
        // whoever removes a peer gets no result from it afterwards.
        self.forget_peer_requests(i, FabricError::Cancelled, true);
        if let Some(peer) = self.peers.take(i) {
            if let Some(name) = peer.name {
                self.invalidate_unshared(&name);
            }
            // A pending handshake's thread finds its receiver gone.
        }
    }

    /// Drops `name`'s metadata from the agent, unless a peer entry still
    /// uses it (two addresses of one remote, or a handshake and an
    /// `add_peer` of the same agent).
    pub(super) fn invalidate_unshared(&self, name: &str) {
        if !self
            .peers
            .iter()
            .any(|(_, p)| p.name.as_deref() == Some(name))
        {
            let _ = self.agent.invalidate_remote_md(name);
        }
    }

    /// Turns a handshake answer into a connected peer (engine thread: this is
    /// where NIXL is touched).
    pub(super) fn complete_handshake(&mut self, i: usize, reply: Reply) -> HandshakeState {
        self.forget_peer_requests(i, FabricError::PeerUnreachable, false);
        if let Some(old) = self.peers.get_mut(i).and_then(|p| p.name.take()) {
            // Re-handshake: drop the old incarnation's metadata first.
            self.invalidate_unshared(&old);
        }
        let agent = &self.agent;
        let loaded = catch_unwind(AssertUnwindSafe(|| agent.load_remote_md(&reply.md)));
        let result = match loaded {
            Err(_) => Err(FabricError::Backend(STATUS_METADATA_REJECTED)),
            Ok(Err(e)) => Err(backend(e)),
            Ok(Ok(name)) if name != reply.name => {
                // The metadata names another agent than the advertisement.
                self.invalidate_unshared(&name);
                Err(FabricError::PeerUnreachable)
            }
            Ok(Ok(name)) => match self.agent.make_connection(&name, None) {
                Ok(()) => Ok(name),
                Err(e) => {
                    self.invalidate_unshared(&name);
                    Err(backend(e))
                }
            },
        };
        let Some(peer) = self.peers.get_mut(i) else {
            // Not reached: callers hold a live entry.
            return HandshakeState::Failed(FabricError::UnknownAgent);
        };
        peer.state = match result {
            Ok(name) => {
                peer.name = Some(name);
                self.stats.handshakes_completed += 1;
                PeerState::Ready {
                    info: PeerInfo {
                        slot_region: reply.slot_region.map(RegionId),
                        slot_count: reply.slot_count,
                        compact_heartbeats: reply.compact,
                        clock: reply.clock,
                    },
                    regions: reply.regions,
                }
            }
            Err(e) => PeerState::Failed(e),
        };
        state_of(&peer.state)
    }

    /// Releases every cached request of peer `i`; READs in flight to it fail
    /// with `err` at their next `read_state` (with `also_done`, so do READs
    /// NIXL completed that were not reported yet).
    pub(super) fn forget_peer_requests(&mut self, i: usize, err: FabricError, also_done: bool) {
        let peer = i as u32;
        for r in self.reads.iter_mut() {
            if r.id != 0 && r.peer == peer {
                if (also_done || !r.done) && r.failed.is_none() {
                    r.failed = Some(err);
                }
                // Its request is released below; the cache slot may be
                // reused before the READ is reported.
                r.cache = NO_CACHE;
            }
        }
        for ci in 0..self.cache.len() {
            if matches!(&self.cache[ci], Some(c) if c.peer == peer) {
                self.drop_cached(ci);
            }
        }
    }

    /// Marks peer `agent` failed after a READ error or timeout (a no-op
    /// when it was removed or evicted since).
    pub(super) fn fail_peer(&mut self, agent: AgentId, err: FabricError) {
        let Some(i) = self.peers.index(agent) else {
            return;
        };
        if let Some(p) = self.peers.get_mut(i) {
            if matches!(p.state, PeerState::Ready { .. }) {
                p.state = PeerState::Failed(err);
            }
        }
    }

    /// Checks one descriptor against our region table and the peer's.
    pub(super) fn check_desc(
        &self,
        regions: &[(u64, u64)],
        d: &ReadDesc,
    ) -> Result<(), FabricError> {
        let local = self
            .regions
            .get(d.local.0 as usize)
            .filter(|r| r.kind == RegionKind::Raw)
            .ok_or(FabricError::UnknownRegion)?;
        let &(raddr, rlen) = regions
            .get(d.remote.0 as usize)
            .ok_or(FabricError::UnknownRegion)?;
        if d.len == 0 {
            return Err(FabricError::OutOfBounds);
        }
        let local_end = d.local_offset.checked_add(d.len);
        let remote_end = d.remote_offset.checked_add(d.len);
        let local_ok = local_end.is_some_and(|e| e <= local.len as u64);
        let remote_ok = remote_end.is_some_and(|e| e <= rlen)
            && raddr
                .checked_add(d.remote_offset)
                .and_then(|a| a.checked_add(d.len))
                .is_some_and(|e| usize::try_from(e).is_ok());
        if local_ok && remote_ok {
            Ok(())
        } else {
            Err(FabricError::OutOfBounds)
        }
    }

    pub(super) fn read_index(&self, xfer: XferId) -> Option<usize> {
        let i = xfer.unpack().1 as usize;
        match self.reads.get(i) {
            Some(r) if r.id != 0 && r.id == xfer.0 => Some(i),
            _ => None,
        }
    }

    /// Frees READ slot `i`; its cached request becomes idle again (or is
    /// released, when `release`).
    pub(super) fn finish_read(&mut self, i: usize, release: bool) {
        let r = self.reads[i];
        self.reads[i] = FREE_READ;
        self.reads_free.push(i as u32);
        if release {
            self.drop_cached(r.cache);
        } else if let Some(Some(c)) = self.cache.get_mut(r.cache) {
            c.busy = false;
        }
    }
}

impl Drop for NixlFabric {
    fn drop(&mut self) {
        let Some(listener) = self.listener.as_mut() else {
            return;
        };
        listener.stop.store(1, Ordering::SeqCst);
        // Wake the accept() with a connection of our own.
        let mut wake = listener.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => [127, 0, 0, 1].into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = listener.thread.take() {
            let _ = t.join();
        }
    }
}
