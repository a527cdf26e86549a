//! Starting and stopping the tracking of a request: the engine table, the
//! member lists and the id tables kept in step.

use super::*;

impl HeartbeatTracker {
    /// vLLM's `on_new_request`: starts tracking `request_id` (the D-side id)
    /// if `params` ask for a remote prefill and carry everything a heartbeat
    /// needs. `now` is recorded only through the engine's due time: a new
    /// engine is due at once.
    ///
    /// Nothing is changed when this returns anything but
    /// `Ok(TrackOutcome::Started)`.
    pub fn on_new_request(
        &mut self,
        request_id: &str,
        params: &RemotePrefillParams<'_>,
        now: Instant,
    ) -> Result<TrackOutcome, TrackError> {
        let _ = now; // Due times start at "now or earlier": Instant::ZERO.
        if !params.do_remote_prefill {
            self.counters.ignored_not_remote_prefill += 1;
            return Ok(TrackOutcome::NotRemotePrefill);
        }
        let (engine_id, p_id, host, port, tp_size) = match (
            params.remote_engine_id,
            params.remote_request_id,
            params.remote_host,
            params.remote_port,
            params.tp_size,
        ) {
            (Some(e), Some(r), Some(h), Some(p), Some(t)) => (e, r, h, p, t),
            (e, r, h, p, _) => {
                let field = if e.is_none() {
                    "remote_engine_id"
                } else if r.is_none() {
                    "remote_request_id"
                } else if h.is_none() {
                    "remote_host"
                } else if p.is_none() {
                    "remote_port"
                } else {
                    "tp_size"
                };
                self.counters.missing_params += 1;
                self.counters.not_heartbeated += 1;
                return Ok(TrackOutcome::MissingParam { field });
            }
        };
        match self.start(request_id, engine_id, p_id, host, port, tp_size, params) {
            Ok(()) => Ok(TrackOutcome::Started),
            Err(err) => {
                let c = &mut self.counters;
                match err {
                    TrackError::RequestsFull { .. } => c.refused_requests_full += 1,
                    TrackError::EnginesFull { .. } => c.refused_engines_full += 1,
                    TrackError::Duplicate => c.refused_duplicate += 1,
                    TrackError::BadParam { .. } => c.refused_bad_param += 1,
                }
                c.not_heartbeated += 1;
                Err(err)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        request_id: &str,
        engine_id: &str,
        p_id: &str,
        host: &str,
        port: u16,
        tp_size: u32,
        params: &RemotePrefillParams<'_>,
    ) -> Result<(), TrackError> {
        // Every check first: a refused request changes nothing.
        check_str("request_id", request_id, self.max_id_len)?;
        check_str("remote_request_id", p_id, self.max_id_len)?;
        if wire::check_heartbeat_id(p_id).is_err() {
            return Err(bad("remote_request_id", ParamProblem::ContainsComma));
        }
        check_str("remote_engine_id", engine_id, self.max_id_len)?;
        check_str("remote_host", host, MAX_HOST_LEN)?;
        if tp_size == 0 {
            return Err(bad("tp_size", ParamProblem::Zero));
        }
        // Heartbeats reach P's TP ranks on every pipeline stage
        // (crate::topology): zero stages, or a zero DCP size, describe no P
        // that can exist.
        if params.pp_size == Some(0) {
            return Err(bad("pp_size", ParamProblem::Zero));
        }
        if params.dcp_size == Some(0) {
            return Err(bad("dcp_size", ParamProblem::Zero));
        }
        if self.d_ids.get(request_id.as_bytes()).is_some() {
            return Err(TrackError::Duplicate);
        }
        if self.free_reqs.is_empty() {
            return Err(TrackError::RequestsFull {
                capacity: self.links.len() as u32,
            });
        }
        let key_len = encode_key(&mut self.key_buf, engine_id, host, port, tp_size);
        let key = &self.key_buf[..key_len];
        let existing = self.keys.get(key);
        let needs_chunk = match existing {
            Some(e) => self.engines[e as usize].len as usize % CHUNK == 0,
            None => true,
        };
        if existing.is_none() && self.free_engines.is_empty() {
            return Err(TrackError::EnginesFull {
                capacity: self.engines.len() as u32,
            });
        }
        // The chunk pool is sized so that this cannot fail (module docs);
        // refuse rather than corrupt if that reasoning is ever wrong.
        debug_assert!(!needs_chunk || !self.free_chunks.is_empty());
        if needs_chunk && self.free_chunks.is_empty() {
            return Err(TrackError::RequestsFull {
                capacity: self.links.len() as u32,
            });
        }

        // Commit. None of the pops below can fail: checked above.
        let pp = params.pp_size.unwrap_or(1);
        let dcp = params.dcp_size.unwrap_or(1);
        let e = match existing {
            Some(e) => {
                let eng = &self.engines[e as usize];
                if eng.pp_size != pp || eng.dcp_size != dcp {
                    self.counters.engine_shape_mismatch += 1;
                }
                e
            }
            None => {
                let Some(e) = self.free_engines.pop() else {
                    return Err(TrackError::EnginesFull {
                        capacity: self.engines.len() as u32,
                    });
                };
                if self.keys.insert(key, e).is_err() {
                    // Unreachable: the key was checked absent and is within
                    // the table's length limit by construction.
                    debug_assert!(false, "engine key insert failed");
                    self.free_engines.push(e);
                    return Err(bad("remote_engine_id", ParamProblem::Empty));
                }
                let eng = &mut self.engines[e as usize];
                debug_assert_eq!(eng.len, 0);
                eng.generation = eng.generation.wrapping_add(1);
                // Due at once: the first step after tracking starts sends.
                eng.next_due = Instant::ZERO;
                eng.pp_size = pp;
                eng.dcp_size = dcp;
                eng.unleased = 0;
                eng.id_bytes = 0;
                eng.requested = false;
                eng.head = NIL;
                eng.tail = NIL;
                self.live.insert(e);
                e
            }
        };
        let Some(r) = self.free_reqs.pop() else {
            return Err(TrackError::RequestsFull {
                capacity: self.links.len() as u32,
            });
        };
        if self.d_ids.insert(request_id.as_bytes(), r).is_err() {
            // Unreachable: checked valid and absent above.
            debug_assert!(false, "request id insert failed");
            self.free_reqs.push(r);
            self.drop_engine_if_empty(e);
            return Err(TrackError::Duplicate);
        }
        let lease = params.lease_fields();
        let pos = self.push_member(e);
        self.members[pos as usize] = Member {
            nonce: lease.map_or(0, |l| l.nonce.get()),
            req: r,
            slot: lease.map_or(0, |l| l.slot),
            // check_str bounded the length by max_id_len <= u16::MAX.
            p_len: p_id.len() as u16,
            leased: lease.is_some(),
        };
        // check_str bounded the length by max_id_len, the overflow stride.
        let written = if p_id.len() <= self.inline.stride() {
            self.inline.write(pos, p_id)
        } else {
            self.overflow.write(r, p_id)
        };
        debug_assert!(written);
        self.links[r as usize] = Link { pos, engine: e };
        self.verified_by[r as usize] = 0;
        self.unchecked[r as usize / 64] &= !(1 << (r % 64));
        // p_id.len() <= max_id_len <= 1024 and at most R members: no overflow
        // below 4 million requests; saturate rather than wrap beyond.
        let eng = &mut self.engines[e as usize];
        eng.id_bytes = eng.id_bytes.saturating_add(p_id.len() as u32);
        if lease.is_none() {
            self.engines[e as usize].unleased += 1;
            self.counters.started_without_lease += 1;
        }
        self.tracked += 1;
        self.counters.started += 1;
        Ok(())
    }

    /// Appends a member to engine `e`'s list; returns its (empty) position.
    fn push_member(&mut self, e: u32) -> u32 {
        let eng = &mut self.engines[e as usize];
        let off = eng.len as usize % CHUNK;
        if off == 0 {
            // Checked by the caller: a chunk is free.
            let c = self.free_chunks.pop().unwrap_or(NIL);
            debug_assert_ne!(c, NIL);
            self.chunk_next[c as usize] = NIL;
            self.chunk_prev[c as usize] = eng.tail;
            if eng.tail == NIL {
                eng.head = c;
            } else {
                self.chunk_next[eng.tail as usize] = c;
            }
            eng.tail = c;
        }
        let pos = eng.tail as usize * CHUNK + off;
        debug_assert_eq!(self.members[pos].req, NIL);
        eng.len += 1;
        pos as u32
    }

    /// Frees engine `e` when it has no members left. A worker that owes it
    /// a heartbeat is told, in the next plan, to drop that debt.
    fn drop_engine_if_empty(&mut self, e: u32) {
        let eng = &mut self.engines[e as usize];
        if eng.len != 0 {
            return;
        }
        if eng.requested {
            eng.requested = false;
            let generation = eng.generation;
            self.note_gone(EngineHandle {
                index: e,
                generation,
            });
        }
        let removed = self.keys.remove(e);
        debug_assert!(removed);
        self.live.remove(e);
        self.free_engines.push(e);
    }

    /// vLLM's `update_connector_output` path: the KV of `request_id` (D-side
    /// id) arrived, stop heartbeating it. Returns whether it was tracked.
    pub fn on_transfer_complete(&mut self, request_id: &str) -> bool {
        let stopped = self.stop(request_id);
        if stopped {
            self.counters.stopped_transfer_complete += 1;
        }
        stopped
    }

    /// vLLM's `request_finished`: the request finished or was aborted, stop
    /// heartbeating it. Returns whether it was tracked.
    pub fn on_request_finished(&mut self, request_id: &str) -> bool {
        let stopped = self.stop(request_id);
        if stopped {
            self.counters.stopped_finished += 1;
        }
        stopped
    }

    fn stop(&mut self, request_id: &str) -> bool {
        let Some(r) = self.d_ids.get(request_id.as_bytes()) else {
            self.counters.stop_untracked += 1;
            return false;
        };
        self.stop_request(r);
        true
    }

    /// Stops tracking request `r` (tracked).
    pub(super) fn stop_request(&mut self, r: u32) {
        let Link {
            pos: hole,
            engine: e,
        } = self.links[r as usize];
        let gone = self.members[hole as usize];
        debug_assert_eq!(gone.req, r);
        let eng = &mut self.engines[e as usize];
        debug_assert!(eng.len > 0);
        let last_off = (eng.len as usize - 1) % CHUNK;
        let last = (eng.tail as usize * CHUNK + last_off) as u32;
        eng.len -= 1;
        eng.id_bytes = eng.id_bytes.saturating_sub(u32::from(gone.p_len));
        if !gone.leased {
            eng.unleased -= 1;
        }
        // Move the engine's last member, inline id included, into the hole
        // and erase what is left behind (an overflow id stays where it is,
        // by request).
        let gone_inline = self.is_inline(gone.p_len);
        if !gone_inline {
            self.overflow.erase(r, gone.p_len);
        }
        // The inline bytes now at `hole` that nobody owns any more.
        let stale = if gone_inline { gone.p_len } else { 0 };
        if last == hole {
            self.inline.erase(hole, stale);
        } else {
            let moved = self.members[last as usize];
            if self.is_inline(moved.p_len) {
                self.inline.copy(last, moved.p_len, hole, stale);
                self.inline.erase(last, moved.p_len);
            } else {
                self.inline.erase(hole, stale);
            }
            self.members[hole as usize] = moved;
            self.links[moved.req as usize].pos = hole;
        }
        self.members[last as usize] = NO_MEMBER;
        let eng = &mut self.engines[e as usize];
        if last_off == 0 {
            // The tail chunk is empty now.
            let c = eng.tail;
            eng.tail = self.chunk_prev[c as usize];
            if eng.tail == NIL {
                eng.head = NIL;
            } else {
                self.chunk_next[eng.tail as usize] = NIL;
            }
            self.free_chunks.push(c);
        }
        self.drop_engine_if_empty(e);
        let removed = self.d_ids.remove(r);
        debug_assert!(removed);
        self.links[r as usize] = Link {
            pos: NIL,
            engine: NIL,
        };
        self.free_reqs.push(r);
        self.tracked -= 1;
    }
}
