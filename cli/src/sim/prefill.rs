//! A P engine: one scheduler process and its TP workers, as vLLM runs them.
//!
//! This module owns the modelled P engine: its prefill queue, its KV block
//! pool, its forward steps and their durations. The lease machinery in it
//! is the library's, split as an engine deploys it: the scheduler holds a
//! [`PrefillScheduler`], each worker a [`PrefillRank`] on its own loopback
//! agent with its own lease slots and KV words, and the two exchange the
//! real role messages (directives one way, rank reports the other) as bytes.
//!
//! One step, at virtual time `now` (the previous forward just ended):
//!
//! ```text
//!  workers   get_finished: drain notifications -> on_notification; poll; encode_reports
//!  scheduler update_connector_output: apply_reports per worker
//!            request_finished for last step's prefills: start (the lease runs)
//!            drain_released -> free the blocks -> blocks_freed (slot reusable)
//!            schedule prefills: blocks from the pool, assign (slot, nonce)
//!            build_connector_meta: encode_directives
//!  workers   start_load_kv: apply_directives (nonce published); the forward
//!            writes the new prefills' KV words
//! ```

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kvlease::fabric::loopback::{LoopbackFabric, LoopbackNetwork, NodeId};
use kvlease::fabric::Fabric;
use kvlease::{
    Instant, LeaseConfig, LeaseSlots, NonceSource, PrefillRank, PrefillScheduler, SlotPool,
    SlotTicket,
};

use super::blocks::BlockPool;
use super::error::{Context, SimError};
use super::kv::KvAgent;
use super::ledger::{p_request_id, serial_of, DState, Ledger};
use super::metrics::{timed, Metrics};
use super::model::EngineModel;

/// The handshake port every P engine advertises (`remote_port`).
pub const P_PORT: u16 = 5600;

/// P engine `p`'s `remote_engine_id`.
pub fn engine_id(p: u32) -> String {
    format!("prefill-{p}")
}

/// P engine `p`'s `remote_host`.
pub fn host(p: u32) -> String {
    format!("p{p}")
}

/// The loopback name of P engine `p`'s rank `r`: what
/// [`kvlease::consumer::DefaultPeerAddress`] writes for it
/// (`{host}:{port}/{engine_id}/{rank}`), since a loopback agent's name is
/// its address.
pub fn rank_address(p: u32, r: u32) -> String {
    format!("{}:{}/{}/{}", host(p), P_PORT, engine_id(p), r)
}

struct PrefillWorker {
    rank: PrefillRank,
    kv: KvAgent,
    out: Vec<u8>,
}

/// One P engine. See the module docs.
pub struct PrefillEngine {
    index: u32,
    sched: PrefillScheduler,
    workers: Vec<PrefillWorker>,
    pool: BlockPool,
    waiting: VecDeque<u64>,
    /// Prefills running in the current forward.
    prefilling: Vec<u64>,
    meta: Vec<u8>,
    released: Vec<u64>,
    tickets: Vec<SlotTicket>,
    /// Generation of the engine's pending step event (a newer one
    /// supersedes it: see `World::wake`).
    pub step_gen: u64,
    /// The last step scheduled nothing: the engine idles between polls.
    pub idle: bool,
}

/// What one P step produced.
pub struct PStepOut {
    /// Requests whose prefill finished: their kv_transfer_params go to the router.
    pub done: Vec<u64>,
    /// How long the forward this step started takes.
    pub duration: Duration,
}

impl PrefillEngine {
    /// P engine `index` with `tp` workers joined to `net`, nonces from
    /// `nonce_seed` (deterministic runs).
    pub fn new(
        index: u32,
        tp: u32,
        config: &LeaseConfig,
        model: &EngineModel,
        net: &Arc<LoopbackNetwork>,
        nonce_seed: u64,
        now: Instant,
    ) -> Result<PrefillEngine, SimError> {
        let layout = kvlease::producer::EntryLayout::of(config);
        let pool = Arc::new(SlotPool::new(layout.slotted));
        let nonces = NonceSource::from_seed(nonce_seed, nonce_seed ^ 0x6b76, u64::from(index));
        let sched =
            PrefillScheduler::with_parts(config, tp, pool, nonces, now).context("P scheduler")?;
        let mut workers = Vec::with_capacity(tp as usize);
        for r in 0..tp {
            let slots = Arc::new(LeaseSlots::new(config.lease_slots));
            let rank = PrefillRank::new(config, r, Arc::clone(&slots), now).context("P rank")?;
            let mut fabric =
                LoopbackFabric::join(net, &rank_address(index, r)).context("P agent")?;
            fabric
                .register_slots(slots, true)
                .context("register lease slots")?;
            let (kv, _region) = KvAgent::new(fabric, model.p_blocks).context("register KV")?;
            workers.push(PrefillWorker {
                out: vec![0; rank.max_reports_len()],
                rank,
                kv,
            });
        }
        Ok(PrefillEngine {
            index,
            sched,
            workers,
            pool: BlockPool::new(model.p_blocks),
            waiting: VecDeque::new(),
            prefilling: Vec::new(),
            meta: Vec::new(),
            released: Vec::new(),
            tickets: Vec::new(),
            step_gen: 0,
            idle: true,
        })
    }

    /// The loopback node of worker `r`.
    pub fn node(&self, r: u32) -> Option<NodeId> {
        self.workers.get(r as usize).map(|w| w.kv.fabric.node())
    }

    /// A new request for this engine's prefill queue.
    pub fn enqueue(&mut self, serial: u64) {
        self.waiting.push_back(serial);
    }

    /// Requests waiting for a prefill.
    pub fn queued(&self) -> usize {
        self.waiting.len()
    }

    /// Most KV blocks this engine had in use at once.
    pub fn peak_blocks_used(&self) -> u32 {
        self.pool.peak_used()
    }

    /// Leases granted without a slot so far.
    pub fn granted_without_slot(&self) -> u64 {
        self.sched.counters().granted_without_slot
    }

    /// Renewals applied by every rank so far.
    pub fn renewals(&self) -> u64 {
        self.workers.iter().map(|w| w.rank.counters().renewed).sum()
    }

    /// One engine step at `now`. See the module docs.
    pub fn step(
        &mut self,
        now: Instant,
        ledger: &mut Ledger,
        m: &mut Metrics,
        model: &EngineModel,
    ) -> Result<PStepOut, SimError> {
        m.p_steps += 1;
        // get_finished in every worker; update_connector_output in the scheduler.
        for (r, w) in self.workers.iter_mut().enumerate() {
            let PrefillWorker { rank, kv, out } = w;
            let sched = &mut self.sched;
            timed(&mut m.p_lease_ns, || -> Result<(), SimError> {
                kv.fabric
                    .drain_notifications(&mut |from, msg| {
                        // A notification that does not decode is counted by
                        // the rank; nothing else to do with it here.
                        let _ = rank.on_notification(from, msg, now);
                    })
                    .context("P worker drains its agent")?;
                rank.poll(now);
                if rank.pending_reports() > 0 {
                    let n = rank.encode_reports(out).context("rank reports")?;
                    sched
                        .apply_reports(r as u32, &out[..n])
                        .context("the scheduler applies a rank's reports")?;
                }
                Ok(())
            })?;
        }
        // request_finished for the prefills of the forward that just ended.
        let mut done = Vec::with_capacity(self.prefilling.len());
        for serial in self.prefilling.drain(..) {
            let Some(req) = ledger.get_mut(serial) else {
                continue;
            };
            if req.lease.is_some() || req.leased {
                let id = p_request_id(serial);
                timed(&mut m.p_lease_ns, || self.sched.start(&id, now)).context("lease start")?;
            }
            req.granted_at = Some(now);
            done.push(serial);
        }
        // finished_sending: every rank let go; free the blocks, then the slots.
        let (released, tickets) = (&mut self.released, &mut self.tickets);
        timed(&mut m.p_lease_ns, || {
            self.sched.drain_released(|rel| {
                if let Some(s) = serial_of(rel.request_id) {
                    released.push(s);
                }
                tickets.extend(rel.slot);
            })
        });
        for serial in std::mem::take(&mut self.released) {
            self.free_blocks(serial, now, ledger, m);
        }
        for t in self.tickets.drain(..) {
            timed(&mut m.p_lease_ns, || self.sched.blocks_freed(t));
        }
        // Unleased requests (the book was full) hold their blocks only for
        // the prefill itself.
        for &serial in &done {
            if ledger.get(serial).is_some_and(|r| !r.leased) {
                self.free_blocks(serial, now, ledger, m);
            }
        }
        // Schedule the next prefills: FCFS, as many as fit the token budget
        // and the free blocks.
        let mut tokens: u64 = 0;
        while let Some(&serial) = self.waiting.front() {
            let Some(req) = ledger.get_mut(serial) else {
                self.waiting.pop_front();
                continue;
            };
            let prompt = u64::from(req.prompt);
            if tokens > 0 && tokens + prompt > u64::from(model.p_batch_tokens) {
                break;
            }
            let Some(blocks) = self.pool.take(model.blocks_for(req.prompt)) else {
                break;
            };
            self.waiting.pop_front();
            let id = p_request_id(serial);
            match timed(&mut m.p_lease_ns, || self.sched.assign(&id, now)) {
                Ok(a) => {
                    req.lease = a.fields;
                    req.leased = true;
                }
                // Full or refused: answered without a lease; D recomputes.
                Err(_) => req.leased = false,
            }
            for (r, w) in self.workers.iter().enumerate() {
                w.kv.write(&blocks, serial, r as u32);
            }
            m.held_delta(blocks.len() as i64);
            req.p_blocks = blocks;
            req.p_held = true;
            tokens += prompt;
            self.prefilling.push(serial);
        }
        // build_connector_meta -> start_load_kv: the same bytes to every
        // worker, after the backstop queued its probes (if any).
        self.sched.poll(now);
        if self.sched.pending_directives() > 0 {
            let (sched, meta, workers) = (&mut self.sched, &mut self.meta, &mut self.workers);
            timed(&mut m.p_lease_ns, || -> Result<(), SimError> {
                let len = sched.directives_len(now);
                if meta.len() < len {
                    meta.resize(len, 0);
                }
                let n = sched.encode_directives(now, meta).context("directives")?;
                for w in workers.iter_mut() {
                    w.rank
                        .apply_directives(&meta[..n], now)
                        .context("a worker applies the directives")?;
                }
                Ok(())
            })?;
        }
        self.idle = tokens == 0;
        let duration = if self.idle {
            model.idle_poll
        } else {
            model.p_step_base + model.p_step_per_token * tokens as u32
        };
        Ok(PStepOut { done, duration })
    }

    /// The engine frees request `serial`'s blocks (its lease is over).
    fn free_blocks(&mut self, serial: u64, now: Instant, ledger: &mut Ledger, m: &mut Metrics) {
        let Some(req) = ledger.get_mut(serial) else {
            return;
        };
        if !req.p_held {
            return;
        }
        // The ids stay in the request: D holds them as remote_block_ids.
        let blocks = req.p_blocks.len();
        self.pool.give_back(&req.p_blocks);
        m.held_delta(-(blocks as i64));
        req.p_held = false;
        req.p_freed_at = Some(now);
        if let Some(crash) = req.orphaned_at {
            let held = now.saturating_duration_since(crash).as_secs_f64();
            m.dead_block_seconds += held * blocks as f64;
            m.reclaim_s = Some(m.reclaim_s.map_or(held, |x| x.max(held)));
            if req.renewed_before_crash {
                m.reclaim_renewed_s = Some(m.reclaim_renewed_s.map_or(held, |x| x.max(held)));
            }
        } else if req.leased && matches!(req.d_state, DState::Waiting | DState::Loading) {
            m.premature_frees += 1;
            if req.d_state == DState::Loading {
                m.mid_read_frees += 1;
            }
        }
        ledger.settle_if_done(serial);
    }

    /// The engine's index.
    pub fn index(&self) -> u32 {
        self.index
    }
}
