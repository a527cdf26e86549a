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
        let existing = self.peers.iter().position(|p| p.address == address);
        let i = match existing {
            Some(i) if self.peers[i].registered => return Ok(AgentId(i as u32)),
            Some(i) if !matches!(self.peers[i].state, PeerState::Failed(_)) => {
                return Ok(AgentId(i as u32));
            }
            Some(i) => i,
            None if self.peers.len() >= self.config.max_agents => return Err(FabricError::Full),
            None => self.peers.len(),
        };
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
        if i == self.peers.len() {
            self.peers.push(Peer {
                address: address.to_owned(),
                registered: false,
                state,
                name: None,
            });
        } else {
            self.peers[i].state = state;
        }
        Ok(AgentId(i as u32))
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
        }
    }

    fn add_peer(&mut self, record: &PeerRecord<'_>, _now: Instant) -> Result<AgentId, FabricError> {
        let name = record.agent_name;
        if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
            return Err(FabricError::BadAddress);
        }
        // Keyed by the agent's name, so that a sender whose peer address is
        // that name finds it through `start_handshake`.
        let i = match self.peers.iter().position(|p| p.address == name) {
            Some(i) => i,
            None if self.peers.len() >= self.config.max_agents => return Err(FabricError::Full),
            None => {
                self.peers.push(Peer {
                    address: name.to_owned(),
                    registered: true,
                    state: PeerState::Failed(FabricError::NotConnected),
                    name: None,
                });
                self.peers.len() - 1
            }
        };
        self.peers[i].registered = true;
        let advert = record.advert.unwrap_or(LeaseAdvert {
            slots: None,
            compact_heartbeats: false,
        });
        // The remote's slot region is its region 0 here: a registered peer
        // exports nothing else to kvlease (the engine READs its KV itself).
        let (slot_region, slot_count, regions) = match advert.slots {
            Some(s) => (Some(0), s.count, vec![(s.addr, s.len)]),
            None => (None, 0, Vec::new()),
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
            HandshakeState::Ready(_) => Ok(AgentId(i as u32)),
            HandshakeState::Failed(e) => Err(e),
            HandshakeState::Pending => Err(FabricError::NotConnected),
        }
    }

    fn handshake_state(&mut self, agent: AgentId, now: Instant) -> HandshakeState {
        let i = match self.peer_index(agent) {
            Ok(i) => i,
            Err(e) => return HandshakeState::Failed(e),
        };
        let polled = match &self.peers[i].state {
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
                self.peers[i].state = PeerState::Failed(e);
                HandshakeState::Failed(e)
            }
            None => state_of(&self.peers[i].state),
        }
    }

    fn send_notification(&mut self, to: AgentId, msg: &[u8]) -> Result<(), FabricError> {
        let i = self.ready_peer(to)?;
        if msg.len() > self.config.max_notification_len {
            return Err(FabricError::MessageTooLarge);
        }
        let name = self.peers[i]
            .name
            .as_deref()
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
                self.fail_peer(i, FabricError::PeerUnreachable);
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
        self.agent
            .get_notifications(&mut self.notif_map, None)
            .map_err(backend)?;
        if self.notif_map.is_empty().map_err(backend)? {
            return Ok(0);
        }
        let mut n = 0usize;
        match self.notif_map.take_notifs() {
            Ok(all) => {
                for (sender, msgs) in &all {
                    for m in msgs {
                        sink(sender, m.as_bytes());
                        n += 1;
                    }
                }
            }
            Err(_) => {
                // nixl-sys refuses to take (and so to clear) a map holding a
                // notification that is not UTF-8. Hand out the bytes as they
                // are, then replace the map: the only way to empty it.
                for sender in self.notif_map.agents() {
                    let Ok(sender) = sender else { continue };
                    let Ok(msgs) = self.notif_map.get_notifications(sender) else {
                        continue;
                    };
                    for m in msgs.flatten() {
                        sink(sender, &m);
                        n += 1;
                    }
                }
                self.notif_map = NotificationMap::new().map_err(backend)?;
                self.stats.notification_map_resets += 1;
            }
        }
        self.stats.notifications_received += n as u64;
        Ok(n)
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
            let PeerState::Ready { regions, .. } = &self.peers[pi].state else {
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
                self.fail_peer(pi, err);
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
                    self.fail_peer(r.peer as usize, FabricError::TimedOut);
                    XferState::Failed(FabricError::TimedOut)
                } else {
                    XferState::InProgress
                }
            }
            Err(e) => {
                let err = backend(e);
                self.stats.reads_failed += 1;
                self.finish_read(i, true);
                self.fail_peer(r.peer as usize, err);
                XferState::Failed(err)
            }
        }
    }

    fn cancel_read(&mut self, xfer: XferId) {
        if let Some(i) = self.read_index(xfer) {
            let r = self.reads[i];
            // An unfinished request is released, which makes NIXL abort it.
            self.finish_read(i, !r.done);
        }
    }
}
