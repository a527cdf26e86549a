//! Serving one peer (P engine, rank): its slot of peers, the handshake and
//! its backoff (retried from the slot's kept key, without a plan), and the
//! heartbeat forms sent to it.

use super::*;

impl<F: Fabric, A: PeerAddress> HeartbeatSender<F, A> {
    #[inline]
    pub(super) fn peer_index(&self, engine: u32, k: u32) -> usize {
        engine as usize * self.config.max_fan_out as usize + k as usize
    }

    /// The P rank of peer `k` of engine slot `e` (k < the slot's fan-out).
    #[inline]
    pub(super) fn rank_of(&self, e: u32, k: u32) -> u32 {
        let rank = self.slots[e as usize].targets.get(k);
        debug_assert!(rank.is_some(), "peer {k} beyond the fan-out");
        rank.unwrap_or(u32::MAX)
    }

    /// Resets slot `e` for the engine behind `handle` if it held another.
    pub(super) fn prepare_slot<B: HeartbeatBatch>(
        &mut self,
        batch: &B,
    ) -> Result<u32, SenderError> {
        let handle = batch.handle();
        let e = handle.index;
        let max_engines = self.config.max_engines;
        let slot = *self
            .slots
            .get(e as usize)
            .ok_or(SenderError::EngineOutOfRange {
                index: e,
                max_engines,
            })?;
        if slot.used && slot.generation == handle.generation {
            return Ok(e);
        }
        // A new engine in this slot: forget the old one's peers (and any
        // heartbeat still owed to them: that engine is gone).
        self.counters.deferred_dropped += u64::from(slot.owed);
        self.clear_owed(e);
        let key = batch.key();
        let mapping = TpMapping::new(self.config.local_tp, key.tp_size)
            .and_then(|m| m.with_remote_pp(batch.pp_size()))
            .map_err(SenderError::Topology)?;
        let targets = mapping
            .targets(self.config.local_rank)
            .map_err(SenderError::Topology)?;
        let fan_out = mapping.fan_out();
        if fan_out > self.config.max_fan_out {
            return Err(SenderError::FanOutTooLarge {
                fan_out,
                max: self.config.max_fan_out,
            });
        }
        let base = self.peer_index(e, 0);
        for p in &mut self.peers[base..base + self.config.max_fan_out as usize] {
            *p = IDLE_PEER;
        }
        // A key too long to keep only means retries wait for a plan.
        let _ = self.keys.keep(e, &key);
        self.slots[e as usize] = Slot {
            used: true,
            generation: handle.generation,
            targets,
            fan_out,
            owed: 0,
        };
        Ok(e)
    }

    /// Polls the pending handshakes of owed peers (not those started in
    /// this step), starts again those done backing off or forgotten by the
    /// fabric (from the slot's kept key), and rebuilds `ripe`: the owed
    /// engines with a peer that is ready, or whose first handshake started
    /// in this step, or that needs a handshake and has no kept key. O(owed
    /// peers).
    pub(super) fn poll_owed(&mut self, now: Instant) {
        while let Some(e) = self.ripe.get(0) {
            self.ripe.remove(e);
        }
        let mut k = 0;
        while let Some(e) = self.owed.get(k) {
            k += 1;
            let slot = self.slots[e as usize];
            let handle = EngineHandle {
                index: e,
                generation: slot.generation,
            };
            let mut ripe = false;
            for j in 0..slot.fan_out {
                let i = self.peer_index(e, j);
                let peer = self.peers[i];
                if !peer.owed {
                    continue;
                }
                ripe |= match peer.status {
                    PeerStatus::Ready { .. } => true,
                    // Forgotten by the fabric, or done backing off: start
                    // again here, from the kept key. The engine is asked
                    // for once the rank is ready; only a slot without a
                    // kept key needs the plan to address the rank.
                    PeerStatus::Idle => !self.redial(e, j, now),
                    PeerStatus::Failed { retry_at, .. } => {
                        now >= retry_at && !self.redial(e, j, now)
                    }
                    // Started in this step (by a plan's batch): not polled
                    // yet (a handshake answers at a later step). A first
                    // handshake gets one more plan, so that a quick one
                    // sends at the next step; a retry (failures > 0) does
                    // not: an unreachable rank would cost a plan per retry.
                    // Either is then polled here, without plans, until it
                    // answers.
                    PeerStatus::Pending(_) if peer.started_epoch == self.epoch => {
                        peer.failures == 0
                    }
                    PeerStatus::Pending(agent) => match self.fabric.handshake_state(agent, now) {
                        HandshakeState::Pending => false,
                        HandshakeState::Ready(info) => {
                            self.counters.handshakes_ready += 1;
                            let p = &mut self.peers[i];
                            p.status = PeerStatus::Ready {
                                agent,
                                compact: info.compact_heartbeats,
                            };
                            p.failures = 0;
                            true
                        }
                        HandshakeState::Failed(err) => {
                            self.fail_peer(handle, e, j, err, now);
                            false
                        }
                    },
                };
            }
            if ripe {
                self.ripe.insert(e);
            }
        }
    }

    pub(super) fn clear_owed(&mut self, e: u32) {
        let Some(slot) = self.slots.get_mut(e as usize) else {
            return;
        };
        if slot.owed > 0 {
            let base = e as usize * self.config.max_fan_out as usize;
            for p in &mut self.peers[base..base + slot.fan_out as usize] {
                p.owed = false;
            }
            slot.owed = 0;
        }
        self.owed.remove(e);
        self.ripe.remove(e);
    }

    pub(super) fn set_owed(&mut self, e: u32, k: u32, owed: bool) {
        let i = self.peer_index(e, k);
        let p = &mut self.peers[i];
        if p.owed == owed {
            return;
        }
        p.owed = owed;
        let slot = &mut self.slots[e as usize];
        if owed {
            slot.owed += 1;
            self.owed.insert(e);
        } else {
            slot.owed -= 1;
            if slot.owed == 0 {
                self.owed.remove(e);
                self.ripe.remove(e);
            }
        }
        // The owed set is exactly the slots with a debt: what `owed_engines`
        // reports back to the tracker.
        debug_assert_eq!(self.owed.contains(e), slot.owed > 0);
    }

    /// Advances peer `k` of engine `e`: starts, polls or retries its
    /// handshake. Returns whether it is ready to receive now.
    pub(super) fn advance<B: HeartbeatBatch>(
        &mut self,
        batch: &B,
        e: u32,
        k: u32,
        now: Instant,
    ) -> bool {
        let i = self.peer_index(e, k);
        let peer = self.peers[i];
        match peer.status {
            PeerStatus::Ready { .. } => true,
            PeerStatus::Idle => {
                self.start_handshake(batch, e, k, now);
                false
            }
            PeerStatus::Failed { retry_at, .. } => {
                if now >= retry_at {
                    self.start_handshake(batch, e, k, now);
                }
                false
            }
            PeerStatus::Pending(agent) => {
                if peer.started_epoch == self.epoch {
                    // Started in this step: the spec defers to a later step.
                    return false;
                }
                match self.fabric.handshake_state(agent, now) {
                    HandshakeState::Pending => false,
                    HandshakeState::Ready(info) => {
                        self.counters.handshakes_ready += 1;
                        let p = &mut self.peers[i];
                        p.status = PeerStatus::Ready {
                            agent,
                            compact: info.compact_heartbeats,
                        };
                        p.failures = 0;
                        true
                    }
                    HandshakeState::Failed(err) => {
                        self.fail_peer(batch.handle(), e, k, err, now);
                        false
                    }
                }
            }
        }
    }

    /// Starts peer `k`'s handshake, addressed from the batch's key.
    pub(super) fn start_handshake<B: HeartbeatBatch>(
        &mut self,
        batch: &B,
        e: u32,
        k: u32,
        now: Instant,
    ) {
        let rank = self.rank_of(e, k);
        self.addr.len = 0;
        let written = self
            .address
            .write_address(&batch.key(), rank, &mut self.addr)
            .is_ok();
        self.dial(batch.handle(), e, k, written, now);
    }

    /// Starts peer `k` of slot `e` again, addressed from the key kept for
    /// the slot: a retry whose backoff ran out, or a peer the fabric forgot.
    /// Returns false, doing nothing, when the slot keeps no key (the plan
    /// must bring it).
    pub(super) fn redial(&mut self, e: u32, k: u32, now: Instant) -> bool {
        let rank = self.rank_of(e, k);
        let Some(key) = self.keys.get(e) else {
            return false;
        };
        self.addr.len = 0;
        let written = self
            .address
            .write_address(&key, rank, &mut self.addr)
            .is_ok();
        let handle = EngineHandle {
            index: e,
            generation: self.slots[e as usize].generation,
        };
        self.counters.handshakes_redialled += 1;
        self.dial(handle, e, k, written, now);
        true
    }

    /// Starts peer `k`'s handshake with the address just written into
    /// `addr` (`written`: whether it was).
    fn dial(&mut self, engine: EngineHandle, e: u32, k: u32, written: bool, now: Instant) {
        if !written {
            self.counters.address_errors += 1;
            self.fail_peer(engine, e, k, FabricError::BadAddress, now);
            return;
        }
        // AddrBuf is filled only through write_str, whole &strs at a time.
        let Ok(address) = core::str::from_utf8(&self.addr.buf[..self.addr.len]) else {
            self.counters.address_errors += 1;
            self.fail_peer(engine, e, k, FabricError::BadAddress, now);
            return;
        };
        self.counters.handshakes_started += 1;
        match self.fabric.start_handshake(address, now) {
            Ok(agent) => {
                let i = self.peer_index(e, k);
                self.peers[i].status = PeerStatus::Pending(agent);
                self.peers[i].started_epoch = self.epoch;
            }
            Err(err) => self.fail_peer(engine, e, k, err, now),
        }
    }

    /// Peer `k` of engine slot `e` failed: back off, keep the error.
    pub(super) fn fail_peer(
        &mut self,
        engine: EngineHandle,
        e: u32,
        k: u32,
        err: FabricError,
        now: Instant,
    ) {
        self.counters.handshakes_failed += 1;
        let i = self.peer_index(e, k);
        let p = &mut self.peers[i];
        p.failures = p.failures.saturating_add(1);
        let wait = backoff(
            self.config.backoff_initial,
            self.config.backoff_max,
            p.failures,
        );
        p.status = PeerStatus::Failed {
            retry_at: now.saturating_add(wait),
            failures: p.failures,
        };
        self.this_step.error = Some(StepError::Fabric {
            engine,
            rank: self.rank_of(e, k),
            error: err,
        });
    }

    pub(super) fn service<B: HeartbeatBatch>(
        &mut self,
        batch: &B,
        now: Instant,
        mode: Mode,
    ) -> Result<(), SenderError> {
        if mode == Mode::Owed {
            // Only this engine's own debts: a slot holding another engine
            // (or none, or owing nothing) has nothing to serve, and must not
            // be reset by a plan entry that another worker asked for.
            let handle = batch.handle();
            match self.slots.get(handle.index as usize) {
                Some(s) if s.used && s.generation == handle.generation && s.owed > 0 => {}
                _ => return Ok(()),
            }
        }
        let e = self.prepare_slot(batch)?;
        let fan_out = self.slots[e as usize].fan_out;
        let all_leased = batch.all_leased();
        let (mut text, mut compact) = (false, false);
        for k in 0..fan_out {
            let i = self.peer_index(e, k);
            self.peers[i].send = Form::None;
            if mode == Mode::Owed && !self.peers[i].owed {
                // Got this interval's heartbeat already.
                continue;
            }
            if self.advance(batch, e, k, now) {
                let form = match self.peers[i].status {
                    PeerStatus::Ready { compact: true, .. } if all_leased => Form::Compact,
                    _ => Form::Text,
                };
                self.peers[i].send = form;
                text |= form == Form::Text;
                compact |= form == Form::Compact;
            } else {
                if mode == Mode::Due && !self.peers[i].owed {
                    self.counters.deferred += 1;
                }
                self.set_owed(e, k, true);
            }
        }
        if compact
            && self
                .send_form(batch, e, fan_out, Form::Compact, now)
                .is_err()
        {
            // The limit cannot hold one compact record: fall back to text.
            for k in 0..fan_out {
                let i = self.peer_index(e, k);
                if self.peers[i].send == Form::Compact {
                    self.peers[i].send = Form::Text;
                    text = true;
                }
            }
        }
        let mut result = Ok(());
        if text {
            if let Err(err) = self.send_form(batch, e, fan_out, Form::Text, now) {
                result = Err(SenderError::Encode(err));
            }
        }
        // Sweep the peers marked for this batch. A peer whose send failed
        // was unmarked by `send_form` and stays owed; a batch that cannot be
        // encoded at all owes nothing (retrying each step would fail the
        // same way; the next interval tries again).
        for k in 0..fan_out {
            let i = self.peer_index(e, k);
            let p = self.peers[i];
            self.peers[i].send = Form::None;
            match (p.send, result.is_ok()) {
                (Form::None, _) => {}
                (_, true) => {
                    if p.owed {
                        self.counters.deferred_sent += 1;
                    }
                    self.set_owed(e, k, false);
                }
                (_, false) => self.set_owed(e, k, false),
            }
        }
        result
    }

    /// Encodes the batch once in `form` and sends every piece to each peer
    /// marked for that form. A peer whose send fails is unmarked and owed;
    /// on a connection error it goes back through the handshake, with
    /// backoff.
    pub(super) fn send_form<B: HeartbeatBatch>(
        &mut self,
        batch: &B,
        e: u32,
        fan_out: u32,
        form: Form,
        now: Instant,
    ) -> Result<(), WireError> {
        let base = self.peer_index(e, 0);
        let targets = self.slots[e as usize].targets;
        let handle = batch.handle();
        let max_len = self.fabric.max_notification_len().min(self.scratch.len());
        let (initial, max) = (self.config.backoff_initial, self.config.backoff_max);
        let HeartbeatSender {
            fabric,
            peers,
            scratch,
            counters,
            this_step,
            ..
        } = self;
        let peers = &mut peers[base..base + fan_out as usize];
        let mut emit = |msg: &[u8]| {
            for (k, p) in peers.iter_mut().enumerate() {
                if p.send != form {
                    continue;
                }
                let PeerStatus::Ready { agent, .. } = p.status else {
                    debug_assert!(false, "a marked peer is ready");
                    continue;
                };
                match fabric.send_notification(agent, msg) {
                    Ok(()) => {
                        counters.messages_sent += 1;
                        counters.bytes_sent += msg.len() as u64;
                        if form == Form::Compact {
                            counters.compact_messages_sent += 1;
                        }
                    }
                    Err(err) => {
                        counters.send_failed += 1;
                        // Skip this batch's later pieces for the peer; the
                        // owed sweep retries it in a later step.
                        p.send = Form::None;
                        p.send_failed = true;
                        if err == FabricError::UnknownAgent {
                            // The fabric evicted or removed the peer while
                            // it worked: start over at once, as with a peer
                            // never seen (a new handshake re-registers it).
                            counters.peers_forgotten += 1;
                            p.status = PeerStatus::Idle;
                        } else if matches!(
                            err,
                            FabricError::NotConnected | FabricError::PeerUnreachable
                        ) {
                            counters.handshakes_failed += 1;
                            p.failures = p.failures.saturating_add(1);
                            p.status = PeerStatus::Failed {
                                retry_at: now.saturating_add(backoff(initial, max, p.failures)),
                                failures: p.failures,
                            };
                        }
                        this_step.error = Some(StepError::Fabric {
                            engine: handle,
                            rank: targets.get(k as u32).unwrap_or(u32::MAX),
                            error: err,
                        });
                    }
                }
            }
        };
        let stats = match form {
            Form::Compact => {
                wire::encode_compact_heartbeats(batch.leases(), max_len, scratch, &mut emit)
            }
            Form::Text | Form::None => {
                wire::encode_heartbeats(batch.remote_request_ids(), max_len, scratch, &mut emit)
            }
        }?;
        counters.ids_skipped += u64::from(stats.skipped);
        // Peers whose send failed inside `emit` (which cannot reach the
        // owed set) are owed the heartbeat.
        for k in 0..fan_out {
            let i = base + k as usize;
            if self.peers[i].send_failed {
                self.peers[i].send_failed = false;
                self.set_owed(e, k, true);
            }
        }
        Ok(())
    }
}

/// `initial * 2^(failures - 1)`, capped at `max` (and at least `initial`).
pub(super) fn backoff(initial: Duration, max: Duration, failures: u32) -> Duration {
    let shift = failures.saturating_sub(1).min(31);
    initial
        .checked_mul(1u32 << shift)
        .unwrap_or(max)
        .min(max.max(initial))
}
