//! The [`Fabric`] trait over a loopback agent: registrations, handshakes
//! (in virtual time, with a clock sample), notifications through the
//! receiver's queue, and READs that copy when they complete.

use super::*;

/// Sends `msg` from `from` to `to` through the link's faults. A free
/// function over the fabric's parts so that `read_state` can send a READ's
/// notification while it borrows the READ table.
pub(super) fn route(
    net: &LoopbackNetwork,
    from: u32,
    peer: &mut Peer,
    stats: &mut LoopbackStats,
    to: u32,
    msg: &[u8],
) -> Result<(), FabricError> {
    if net.link_down(from, to) {
        stats.notifications_unreachable += 1;
        return match net.config.unreachable_sends {
            UnreachableSends::Error => Err(FabricError::PeerUnreachable),
            UnreachableSends::SilentDrop => Ok(()),
        };
    }
    let record = net.record(to).ok_or(FabricError::UnknownAgent)?;
    let seq = peer.notification_seq;
    peer.notification_seq += 1;
    let now = net.clock.load(Ordering::Acquire);
    let (flags, stamp) = match net
        .link(from, to)
        .notification_fate(net.config.seed, from, to, seq)
    {
        NotificationFate::Drop => {
            stats.notifications_dropped += 1;
            return Ok(());
        }
        NotificationFate::Deliver => (0, now),
        NotificationFate::Delay(ns) => {
            stats.notifications_delayed += 1;
            (0, now.saturating_add(ns))
        }
        NotificationFate::Reorder(ns) => {
            stats.notifications_reordered += 1;
            (FLAG_HOLD, now.saturating_add(ns))
        }
    };
    let envelope = Envelope {
        sender: from,
        flags,
        tag: net.incarnation(to),
        stamp,
    };
    match record.producer.push(envelope, msg) {
        Ok(()) => {
            stats.notifications_sent += 1;
            Ok(())
        }
        Err(QueueError::Full) => {
            stats.notifications_full += 1;
            Err(FabricError::Full)
        }
        Err(QueueError::TooLarge) => Err(FabricError::MessageTooLarge),
    }
}

impl Fabric for LoopbackFabric {
    fn name(&self) -> &str {
        self.record().map_or("", |r| &r.name)
    }

    fn register_slots(
        &mut self,
        slots: Arc<LeaseSlots>,
        compact_heartbeats: bool,
    ) -> Result<RegionId, FabricError> {
        let count = slots.len();
        let record = self
            .net
            .record(self.node)
            .ok_or(FabricError::UnknownAgent)?;
        let id = record
            .regions
            .publish(self.next_region, Region::Slots(slots))?;
        self.next_region += 1;
        record.advert.store(
            pack_advert(id, count, compact_heartbeats),
            Ordering::Release,
        );
        Ok(id)
    }

    unsafe fn register_memory(
        &mut self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<RegionId, FabricError> {
        if ptr.is_null() {
            return Err(FabricError::OutOfBounds);
        }
        let record = self
            .net
            .record(self.node)
            .ok_or(FabricError::UnknownAgent)?;
        // SAFETY: our caller accepted register_memory's contract, which is
        // raw_region's; the fabric's Drop retires the agent (waiting out
        // copies) before the memory may go away.
        let region = unsafe { memory::raw_region(ptr, len) };
        let id = record.regions.publish(self.next_region, region)?;
        self.next_region += 1;
        Ok(id)
    }

    fn register_landing(&mut self, words: Arc<LandingWords>) -> Result<RegionId, FabricError> {
        // SAFETY: `self.landing` keeps the words allocated (a boxed slice:
        // never moved) until this fabric is dropped, and its Drop retires
        // the agent before the field is dropped; every Rust-side access to
        // them is atomic.
        let id = unsafe { self.register_memory(words.as_ptr().cast_mut(), words.byte_len())? };
        self.landing.push(words);
        Ok(id)
    }

    fn max_notification_len(&self) -> usize {
        self.net.config.max_notification_len
    }

    fn start_handshake(&mut self, address: &str, now: Instant) -> Result<AgentId, FabricError> {
        self.sync_life();
        self.net.observe(now);
        let node = self.net.lookup(address).ok_or(FabricError::BadAddress)?;
        let peer = self
            .peers
            .get_mut(node as usize)
            .ok_or(FabricError::BadAddress)?;
        if let Handshake::Idle | Handshake::Failed(_) = peer.handshake {
            peer.handshake = Handshake::Pending {
                started: now,
                polls: 0,
            };
        }
        Ok(AgentId(node))
    }

    fn lease_advert(&self) -> LeaseAdvert {
        let word = self
            .record()
            .map_or(0, |r| r.advert.load(Ordering::Acquire));
        let (region, count, compact) = unpack_advert(word);
        LeaseAdvert {
            // On loopback a region's handle is its index.
            slots: region.map(|r| SlotRegion {
                addr: u64::from(r.0),
                len: u64::from(count) * 8,
                count,
            }),
            compact_heartbeats: compact,
            // A rank decodes both record forms (`PrefillRank::on_notification`),
            // so whoever accepts one accepts the other.
            packed_heartbeats: compact,
        }
    }

    fn add_peer(&mut self, record: &PeerRecord<'_>, now: Instant) -> Result<AgentId, FabricError> {
        self.sync_life();
        self.net.observe(now);
        let node = self
            .net
            .lookup(record.agent_name)
            .ok_or(FabricError::BadAddress)?;
        let remote = self.net.record(node).ok_or(FabricError::BadAddress)?;
        let (slot_region, slot_count) = match record.advert.and_then(|a| a.slots) {
            Some(s) => {
                // The advert must name the remote's slot array, as its own
                // registration published it.
                let id = u32::try_from(s.addr).map_err(|_| FabricError::UnknownRegion)?;
                match remote.regions.get(RegionId(id)) {
                    Some(Region::Slots(slots)) if slots.len() == s.count => {
                        (Some(RegionId(id)), s.count)
                    }
                    _ => return Err(FabricError::UnknownRegion),
                }
            }
            None => (None, 0),
        };
        let incarnation = self.net.incarnation(node);
        let peer = self
            .peers
            .get_mut(node as usize)
            .ok_or(FabricError::BadAddress)?;
        peer.handshake = Handshake::Ready {
            info: PeerInfo {
                slot_region,
                slot_count,
                compact_heartbeats: record.advert.is_some_and(|a| a.compact_heartbeats),
                clock: record.clock,
            },
            incarnation,
        };
        Ok(AgentId(node))
    }

    fn handshake_state(&mut self, agent: AgentId, now: Instant) -> HandshakeState {
        self.sync_life();
        let net = &*self.net;
        net.observe(now);
        let cfg = &net.config;
        let remote_life = net.incarnation(agent.0);
        let Some(peer) = self.peers.get_mut(agent.0 as usize) else {
            return HandshakeState::Failed(FabricError::UnknownAgent);
        };
        let next = match peer.handshake {
            Handshake::Idle => return HandshakeState::Failed(FabricError::UnknownAgent),
            Handshake::Failed(e) => return HandshakeState::Failed(e),
            Handshake::Ready { info, incarnation } if incarnation == remote_life => {
                return HandshakeState::Ready(info)
            }
            Handshake::Ready { .. } => Handshake::Failed(FabricError::PeerUnreachable),
            Handshake::Pending { started, polls } => {
                let polls = polls.saturating_add(1);
                if polls < cfg.handshake_polls || now < started + cfg.handshake_latency {
                    Handshake::Pending { started, polls }
                } else if net.link_down(self.node, agent.0) {
                    Handshake::Failed(FabricError::PeerUnreachable)
                } else {
                    let advert = net
                        .record(agent.0)
                        .map_or(0, |r| r.advert.load(Ordering::Acquire));
                    let (slot_region, slot_count, compact_heartbeats) = unpack_advert(advert);
                    // The remote answers halfway through, so the midpoint
                    // estimate of clock_offset is exact here.
                    let answered = started + now.saturating_duration_since(started) / 2;
                    let info = PeerInfo {
                        slot_region,
                        slot_count,
                        compact_heartbeats,
                        clock: Some(ClockSample {
                            local_send: net.own_clock(self.node, started),
                            remote: net.own_clock(agent.0, answered),
                            local_recv: net.own_clock(self.node, now),
                        }),
                    };
                    Handshake::Ready {
                        info,
                        incarnation: remote_life,
                    }
                }
            }
        };
        peer.handshake = next;
        match next {
            Handshake::Pending { .. } | Handshake::Idle => HandshakeState::Pending,
            Handshake::Ready { info, .. } => HandshakeState::Ready(info),
            Handshake::Failed(e) => HandshakeState::Failed(e),
        }
    }

    fn send_notification(&mut self, to: AgentId, msg: &[u8]) -> Result<(), FabricError> {
        self.sync_life();
        let node = self.connected(to)?;
        if msg.len() > self.net.config.max_notification_len {
            return Err(FabricError::MessageTooLarge);
        }
        let peer = &mut self.peers[node as usize];
        route(&self.net, self.node, peer, &mut self.stats, node, msg)
    }

    fn drain_notifications(
        &mut self,
        sink: &mut dyn FnMut(&str, &[u8]),
    ) -> Result<usize, FabricError> {
        self.sync_life();
        let net = &*self.net;
        if net.liveness(self.node).is_none_or(Liveness::is_down) {
            return Ok(0);
        }
        let now = net.clock.load(Ordering::Acquire);
        let name_of = |i: u32| net.record(i).map_or("", |r| &*r.name);
        Ok(self
            .inbox
            .drain(now, self.incarnation, &name_of, sink, &mut self.inbox_stats))
    }

    fn post_read(
        &mut self,
        from: AgentId,
        descs: &[ReadDesc],
        notification: Option<&[u8]>,
        now: Instant,
    ) -> Result<XferId, FabricError> {
        self.sync_life();
        self.net.observe(now);
        let target = self.connected(from)?;
        let cfg = self.net.config;
        if notification.is_some_and(|n| n.len() > cfg.max_notification_len) {
            return Err(FabricError::MessageTooLarge);
        }
        if descs.len() > self.reads.max_descs() {
            return Err(FabricError::Full);
        }
        self.check_descs(target, descs)?;
        let peer = &mut self.peers[target as usize];
        let seq = peer.read_seq;
        peer.read_seq += 1;
        let fate = self
            .net
            .link(self.node, target)
            .read_fate(cfg.seed, self.node, target, seq);
        let plan = ReadPlan {
            target,
            target_incarnation: self.net.incarnation(target),
            done_at: now + cfg.read_latency + Duration::from_nanos(fate.extra_ns),
            deadline: now + cfg.transfer_timeout,
            fail: fate.fail,
        };
        let id = self.reads.insert(plan, descs, notification)?;
        self.stats.reads_posted += 1;
        Ok(id)
    }

    fn read_state(&mut self, xfer: XferId, now: Instant) -> XferState {
        self.sync_life();
        let net = &*self.net;
        net.observe(now);
        let Some((index, e)) = self.reads.get(xfer) else {
            return XferState::Failed(FabricError::UnknownXfer);
        };
        let target = e.target;
        let state = if let Some(err) = e.aborted {
            XferState::Failed(err)
        } else if net.incarnation(target) != e.target_incarnation {
            // The remote restarted: the memory we were reading is another
            // process's now.
            XferState::Failed(FabricError::PeerUnreachable)
        } else if now >= e.done_at && e.done_at < e.deadline && !net.link_down(self.node, target) {
            match e.fail {
                Some(err) => XferState::Failed(err),
                None => {
                    let copied = copy_read(net, self.node, target, e.descs());
                    match (copied, e.notification()) {
                        (Err(err), _) => XferState::Failed(err),
                        (Ok(()), None) => XferState::Done,
                        (Ok(()), Some(msg)) => {
                            let peer = &mut self.peers[target as usize];
                            let before = self.stats.notifications_dropped;
                            let sent = route(net, self.node, peer, &mut self.stats, target, msg);
                            if sent.is_err() || self.stats.notifications_dropped != before {
                                self.stats.read_notifications_lost += 1;
                            }
                            XferState::Done
                        }
                    }
                }
            }
        } else if now >= e.deadline {
            XferState::Failed(FabricError::TimedOut)
        } else {
            return XferState::InProgress;
        };
        self.reads.remove(index);
        match state {
            XferState::Done => self.stats.reads_done += 1,
            XferState::Failed(FabricError::TimedOut) => self.stats.reads_timed_out += 1,
            XferState::Failed(_) => self.stats.reads_failed += 1,
            XferState::InProgress => {}
        }
        state
    }

    fn remove_peer(&mut self, agent: AgentId) -> Result<(), FabricError> {
        self.sync_life();
        let peer = self
            .peers
            .get_mut(agent.0 as usize)
            .ok_or(FabricError::UnknownAgent)?;
        if let Handshake::Idle = peer.handshake {
            return Err(FabricError::UnknownAgent);
        }
        // The link's fault sequence numbers stay: a new handshake with the
        // same agent does not replay its fates.
        peer.handshake = Handshake::Idle;
        self.reads.abort_target(agent.0, FabricError::Cancelled);
        Ok(())
    }

    fn cancel_read(&mut self, xfer: XferId) {
        self.sync_life();
        if let Some((index, _)) = self.reads.get(xfer) {
            self.reads.remove(index);
            self.stats.reads_cancelled += 1;
        }
    }
}

/// Copies every descriptor of a completing READ from `target` into `reader`.
pub(super) fn copy_read(
    net: &LoopbackNetwork,
    reader: u32,
    target: u32,
    descs: &[ReadDesc],
) -> Result<(), FabricError> {
    let (Some(local), Some(remote), Some(liveness)) =
        (net.record(reader), net.record(target), net.liveness(target))
    else {
        return Err(FabricError::UnknownAgent);
    };
    // Holds off the remote's Drop (which may free its raw memory) until the
    // copy is over; a remote already gone is unreachable.
    let Some(_guard) = liveness.begin_copy() else {
        return Err(FabricError::PeerUnreachable);
    };
    let mut src_region = LastRegion::new();
    let mut dst_region = LastRegion::new();
    for d in descs {
        let src = src_region.get(d.remote, || remote.regions.get(d.remote))?;
        let dst = dst_region.get(d.local, || match local.regions.get(d.local) {
            Some(Region::Raw(r)) => Some(r),
            _ => None,
        })?;
        // SAFETY: `dst` was registered by this agent under register_memory's
        // contract and this agent (alive: we hold &mut to it) posted the READ
        // into it; `src` is alive (the guard), and a raw `src` is not written
        // during a READ per the same contract. Bounds are re-checked inside.
        unsafe { copy_into(src, d.remote_offset, dst, d.local_offset, d.len)? };
    }
    Ok(())
}
