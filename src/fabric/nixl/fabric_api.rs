//! The [`Fabric`] trait over the NIXL agent: registrations, handshakes (by
//! the side channel or from the engine's own), notifications and READs.

use super::*;

impl Fabric for NixlFabric {
    fn name(&self) -> &str {
        &self.name
    }

    fn register_slots(
        &mut self,
        slots: Arc<LeaseSlots>,
        compact_heartbeats: bool,
    ) -> Result<RegionId, FabricError> {
        let id =
            self.register_region(slots.as_ptr() as usize, slots.byte_len(), RegionKind::Slots)?;
        self.slot_advert = Some((id, slots.len(), compact_heartbeats));
        // Keeps the registered array alive as long as the registration.
        self.slot_arrays.push(slots);
        self.publish_advert()?;
        Ok(id)
    }

    unsafe fn register_memory(
        &mut self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<RegionId, FabricError> {
        let id = self.register_region(ptr as usize, len, RegionKind::Raw)?;
        self.publish_advert()?;
        Ok(id)
    }

    fn register_landing(&mut self, words: Arc<LandingWords>) -> Result<RegionId, FabricError> {
        let id =
            self.register_region(words.as_ptr() as usize, words.byte_len(), RegionKind::Raw)?;
        self.publish_advert()?;
        // Keeps the words alive as long as the registration (field order).
        self.landing.push(words);
        Ok(id)
    }

    fn max_notification_len(&self) -> usize {
        self.config.max_notification_len
    }

    fn start_handshake(&mut self, address: &str, now: Instant) -> Result<AgentId, FabricError> {
        if address.is_empty() || address.len() > MAX_ADDRESS_LEN {
            return Err(FabricError::BadAddress);
        }
        let existing = self.peers.find(address);
        if let Some(i) = existing {
            self.touch(i);
            if let Some(p) = self.peers.get(i) {
                if p.registered || !matches!(p.state, PeerState::Failed(_)) {
                    return Ok(self.peers.id(i));
                }
            }
        }
        let (tx, rx) = mpsc::channel();
        let target = address.to_owned();
        let clock = self.config.clock;
        let timeout = self.config.handshake_timeout;
        std::thread::Builder::new()
            .name("kvlease-nixl-hs".into())
            .spawn(move || {
                // The receiver may be gone (fabric dropped): nothing to do.
                let _ = tx.send(exchange(&target, clock, timeout));
            })
            .map_err(|_| FabricError::Backend(STATUS_SPAWN_FAILED))?;
        let state = PeerState::Pending {
            rx,
            deadline: now + timeout,
        };
        match existing.and_then(|i| self.peers.get_mut(i).map(|p| (i, p))) {
            Some((i, p)) => {
                p.state = state;
                Ok(self.peers.id(i))
            }
            None => {
                // Claimed after the spawn, so that a failed spawn evicts
                // nobody.
                let i = self.claim_entry()?;
                self.use_counter += 1;
                Ok(self.peers.insert(
                    i,
                    Peer {
                        address: address.to_owned(),
                        registered: false,
                        state,
                        name: None,
                        last_used: self.use_counter,
                    },
                ))
            }
        }
    }

    fn lease_advert(&self) -> LeaseAdvert {
        let slots = self.slot_advert.and_then(|(region, count, _)| {
            let r = self.regions.get(region.0 as usize)?;
            Some(SlotRegion {
                addr: r.addr as u64,
                len: r.len as u64,
                count,
            })
        });
        LeaseAdvert {
            slots,
            compact_heartbeats: self.slot_advert.is_some_and(|(_, _, c)| c),
            // A rank decodes both record forms, as on loopback.
            packed_heartbeats: self.slot_advert.is_some_and(|(_, _, c)| c),
        }
    }

    fn add_peer(&mut self, record: &PeerRecord<'_>, _now: Instant) -> Result<AgentId, FabricError> {
        let name = record.agent_name;
        if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
            return Err(FabricError::BadAddress);
        }
        if record.regions.len() >= MAX_REGIONS
            || record
                .regions
                .iter()
                .any(|r| r.len == 0 || r.addr.checked_add(r.len).is_none())
        {
            return Err(FabricError::UnknownRegion);
        }
        // Keyed by the agent's name, so that a sender whose peer address is
        // that name finds it through `start_handshake`.
        let i = match self.peers.find(name) {
            Some(i) => i,
            None => {
                let i = self.claim_entry()?;
                self.peers.insert(
                    i,
                    Peer {
                        address: name.to_owned(),
                        registered: true,
                        state: PeerState::Failed(FabricError::NotConnected),
                        name: None,
                        last_used: 0,
                    },
                );
                i
            }
        };
        self.touch(i);
        if let Some(p) = self.peers.get_mut(i) {
            p.registered = true;
        }
        let advert = record.advert.unwrap_or(LeaseAdvert {
            slots: None,
            compact_heartbeats: false,
            packed_heartbeats: false,
        });
        // The remote's regions, as the record lists them (its KV), then its
        // slot array, if it advertises one.
        let mut regions: Vec<(u64, u64)> = record.regions.iter().map(|r| (r.addr, r.len)).collect();
        let (slot_region, slot_count) = match advert.slots {
            Some(s) => {
                regions.push((s.addr, s.len));
                (Some(regions.len() as u32 - 1), s.count)
            }
            None => (None, 0),
        };
        let reply = Reply {
            name: name.to_owned(),
            slot_region,
            slot_count,
            compact: advert.compact_heartbeats,
            regions,
            md: record.metadata.to_vec(),
            clock: record.clock,
        };
        match self.complete_handshake(i, reply) {
            HandshakeState::Ready(_) => Ok(self.peers.id(i)),
            HandshakeState::Failed(e) => Err(e),
            HandshakeState::Pending => Err(FabricError::NotConnected),
        }
    }

    fn handshake_state(&mut self, agent: AgentId, now: Instant) -> HandshakeState {
        let i = match self.peer_index(agent) {
            Ok(i) => i,
            Err(e) => return HandshakeState::Failed(e),
        };
        let Some(peer) = self.peers.get_mut(i) else {
            return HandshakeState::Failed(FabricError::UnknownAgent);
        };
        let polled = match &peer.state {
            PeerState::Pending { rx, deadline } => match rx.try_recv() {
                Ok(answer) => Some(answer),
                Err(TryRecvError::Empty) if now >= *deadline => Some(Err(FabricError::TimedOut)),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => Some(Err(FabricError::PeerUnreachable)),
            },
            _ => None,
        };
        match polled {
            Some(Ok(reply)) => self.complete_handshake(i, reply),
            Some(Err(e)) => {
                peer.state = PeerState::Failed(e);
                HandshakeState::Failed(e)
            }
            None => state_of(&peer.state),
        }
    }

    fn send_notification(&mut self, to: AgentId, msg: &[u8]) -> Result<(), FabricError> {
        let i = self.ready_peer(to)?;
        if msg.len() > self.config.max_notification_len {
            return Err(FabricError::MessageTooLarge);
        }
        let name = self
            .peers
            .get(i)
            .and_then(|p| p.name.as_deref())
            .ok_or(FabricError::NotConnected)?;
        match self.agent.send_notification(name, msg, None) {
            Ok(()) => {
                self.stats.notifications_sent += 1;
                Ok(())
            }
            Err(NixlError::NotFound) => Err(FabricError::NotConnected),
            Err(_) => {
                // NIXL reports a broken endpoint (the peer's process died,
                // its TCP connection was reset) only as a backend error.
                // Fail the peer, as a failed READ does, so that the sender
                // backs off and handshakes again (a restarted peer has a new
                // agent) instead of retrying a dead endpoint every step.
                self.stats.notifications_failed += 1;
                self.fail_peer(to, FabricError::PeerUnreachable);
                Err(FabricError::PeerUnreachable)
            }
        }
    }

    fn drain_notifications(
        &mut self,
        sink: &mut dyn FnMut(&str, &[u8]),
    ) -> Result<usize, FabricError> {
        if self.engine_drains {
            // The engine drains its own agent and routes kvlease's messages
            // to the roles; draining here would take the engine's.
            return Ok(0);
        }
        let drained =
            drain_raw_notifications(&self.agent, &mut self.notif_map, sink).map_err(backend)?;
        if drained.map_replaced {
            self.stats.notification_map_resets += 1;
        }
        self.stats.notifications_received += drained.delivered as u64;
        Ok(drained.delivered)
    }

    fn post_read(
        &mut self,
        from: AgentId,
        descs: &[ReadDesc],
        notification: Option<&[u8]>,
        now: Instant,
    ) -> Result<XferId, FabricError> {
        let pi = self.ready_peer(from)?;
        if notification.is_some_and(|m| m.len() > self.config.max_notification_len) {
            return Err(FabricError::MessageTooLarge);
        }
        if descs.is_empty() {
            return Err(FabricError::Backend(STATUS_INVALID_PARAM));
        }
        {
            let Some(PeerState::Ready { regions, .. }) = self.peers.get(pi).map(|p| &p.state)
            else {
                return Err(FabricError::NotConnected);
            };
            for d in descs {
                self.check_desc(regions, d)?;
            }
        }
        let Some(slot) = self.reads_free.peek() else {
            return Err(FabricError::Full);
        };
        let peer = pi as u32;
        let hash = desc_hash(descs);
        let ci = match self.find_idle(peer, hash, descs) {
            Some(ci) => {
                self.stats.request_cache_hits += 1;
                ci
            }
            None => {
                self.stats.request_cache_misses += 1;
                self.create_cached(peer, hash, descs)?
            }
        };
        let opt = match notification {
            Some(msg) => {
                self.opt_notif
                    .set_notification_message(msg)
                    .map_err(backend)?;
                &self.opt_notif
            }
            None => &self.opt_plain,
        };
        let Some(cached) = self.cache[ci].as_mut() else {
            return Err(FabricError::Backend(STATUS_BACKEND));
        };
        match self.agent.post_xfer_req(&cached.req, Some(opt)) {
            Ok(in_progress) => {
                self.use_counter += 1;
                cached.busy = true;
                cached.last_used = self.use_counter;
                self.reads_free.pop();
                self.read_seq = self.read_seq.wrapping_add(1).max(1);
                let id = XferId::pack(self.read_seq, slot).0;
                self.reads[slot as usize] = Inflight {
                    id,
                    cache: ci,
                    peer,
                    agent: from,
                    posted_at: now,
                    done: !in_progress,
                    failed: None,
                };
                self.stats.reads_posted += 1;
                Ok(XferId(id))
            }
            Err(e) => {
                let err = backend(e);
                self.drop_cached(ci);
                self.stats.reads_failed += 1;
                self.fail_peer(from, err);
                Err(err)
            }
        }
    }

    fn read_state(&mut self, xfer: XferId, now: Instant) -> XferState {
        let Some(i) = self.read_index(xfer) else {
            return XferState::Failed(FabricError::UnknownXfer);
        };
        let r = self.reads[i];
        if let Some(err) = r.failed {
            self.stats.reads_failed += 1;
            self.finish_read(i, true);
            return XferState::Failed(err);
        }
        if r.done {
            self.finish_read(i, false);
            return XferState::Done;
        }
        let status = match self.cache.get(r.cache).and_then(Option::as_ref) {
            Some(c) => self.agent.get_xfer_status(&c.req),
            None => Err(NixlError::BackendError),
        };
        match status {
            Ok(XferStatus::Success) => {
                self.finish_read(i, false);
                XferState::Done
            }
            Ok(XferStatus::InProgress) => {
                if now.saturating_duration_since(r.posted_at) >= self.config.transfer_timeout {
                    self.stats.reads_failed += 1;
                    self.finish_read(i, true);
                    self.fail_peer(r.agent, FabricError::TimedOut);
                    XferState::Failed(FabricError::TimedOut)
                } else {
                    XferState::InProgress
                }
            }
            Err(e) => {
                let err = backend(e);
                self.stats.reads_failed += 1;
                self.finish_read(i, true);
                self.fail_peer(r.agent, err);
                XferState::Failed(err)
            }
        }
    }

    fn remove_peer(&mut self, agent: AgentId) -> Result<(), FabricError> {
        let i = self.peer_index(agent)?;
        self.release_peer(i);
        self.stats.peers_removed += 1;
        Ok(())
    }

    fn cancel_read(&mut self, xfer: XferId) {
        if let Some(i) = self.read_index(xfer) {
            let r = self.reads[i];
            // An unfinished request is released, which makes NIXL abort it.
            self.finish_read(i, !r.done);
        }
    }
}
