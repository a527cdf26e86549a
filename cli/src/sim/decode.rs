//! A D engine: one scheduler process and its TP workers.
//!
//! This module owns the modelled D engine: its waiting queue (requests
//! arrive with P's `kv_transfer_params` and may wait far longer than a
//! lease), its KV block pool, the loads in flight, the decode batch and the
//! step durations. The lease machinery in it is the library's: the scheduler
//! holds a [`HeartbeatTracker`] (tracking starts when a request *arrives*,
//! as vLLM's `on_new_request`), sends each worker the real plan bytes, and
//! applies each worker's real outcome message.
//!
//! One step, at virtual time `now`:
//!
//! ```text
//!  workers   get_finished (decode_worker): READ results, verdicts, outcome bytes
//!  scheduler update_connector_output: apply_outcomes -> received / failed
//!            (failed: kv_load_failure_policy = recompute, D prefills itself)
//!            decode one token per running request; finished ones free D blocks
//!            new arrivals: on_new_request (heartbeats start), waiting queue
//!            schedule loads (D blocks, max_num_seqs); encode_plan
//!  workers   start_load_kv: send_plan, post block READs
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use kvlease::consumer::{HeartbeatTracker, RemotePrefillParams, Verdict};
use kvlease::fabric::loopback::{LoopbackNetwork, NodeId};
use kvlease::ipc::outcome::OutcomeMsg;
use kvlease::{Instant, LeaseConfig};

use super::blocks::BlockPool;
use super::decode_worker::{DecodeWorker, LoadSpec, ReadFact};
use super::error::{Context, SimError};
use super::ledger::{d_request_id, p_request_id, serial_of, DState, Ledger};
use super::metrics::{timed, Metrics};
use super::model::{EngineModel, Fleet};
use super::prefill::{engine_id, host, P_PORT};

#[derive(Clone, Copy, Debug, Default)]
struct LoadAgg {
    /// The tracker tracks it: its verdicts come from `apply_outcomes`.
    tracked: bool,
    /// Workers whose block READs all landed.
    landed: u32,
    /// Workers that verified (untracked requests only).
    verified: u32,
    corrupt: bool,
    stale: bool,
}

#[derive(Clone, Copy, Debug)]
struct Running {
    serial: u64,
    left: u32,
    corrupt: bool,
}

/// How a load ended.
#[derive(Clone, Copy, Debug)]
enum Decision {
    Accept { verified: bool },
    Fail(Option<Verdict>),
}

/// One D engine. See the module docs.
pub struct DecodeEngine {
    index: u32,
    alive: bool,
    heartbeats: bool,
    verify: bool,
    tp: u32,
    p_tp: u32,
    interval: Duration,
    /// kv_lease_duration - extension: a lease granted this long before a
    /// crash lives on heartbeats alone (its initial lease ends before the
    /// last renewal does).
    initial_margin: Duration,
    tracker: HeartbeatTracker,
    workers: Vec<DecodeWorker>,
    inbox: Vec<u64>,
    waiting: VecDeque<u64>,
    /// Requests waiting or loading, with what their loads came to so far.
    loading: BTreeMap<u64, LoadAgg>,
    running: Vec<Running>,
    pool: BlockPool,
    d_blocks: BTreeMap<u64, Vec<u32>>,
    plan: Vec<u8>,
    facts: Vec<(u64, ReadFact)>,
    decisions: Vec<(u64, Decision)>,
    /// Generation of the engine's pending step event.
    pub step_gen: u64,
    /// The last step had nothing to do.
    pub idle: bool,
}

impl DecodeEngine {
    /// D engine `index` of `fleet`, its workers joined to `net`.
    pub fn new(
        index: u32,
        fleet: &Fleet,
        config: &LeaseConfig,
        heartbeats: bool,
        model: &EngineModel,
        net: &Arc<LoopbackNetwork>,
    ) -> Result<DecodeEngine, SimError> {
        let tracker = HeartbeatTracker::new(config, fleet.d_tp).context("D tracker")?;
        let workers = (0..fleet.d_tp)
            .map(|r| {
                DecodeWorker::new(
                    index,
                    r,
                    fleet.d_tp,
                    fleet.p_tp,
                    fleet.p_engines,
                    model.d_blocks,
                    config,
                    net,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DecodeEngine {
            index,
            alive: true,
            heartbeats,
            verify: config.verification,
            tp: fleet.d_tp,
            p_tp: fleet.p_tp,
            interval: config.heartbeat_interval(),
            initial_margin: config
                .lease_duration()
                .saturating_sub(config.lease_extension()),
            tracker,
            workers,
            inbox: Vec::new(),
            waiting: VecDeque::new(),
            loading: BTreeMap::new(),
            running: Vec::new(),
            pool: BlockPool::new(model.d_blocks),
            d_blocks: BTreeMap::new(),
            plan: Vec::new(),
            facts: Vec::new(),
            decisions: Vec::new(),
            step_gen: 0,
            idle: true,
        })
    }

    /// Whether the engine is up.
    pub fn alive(&self) -> bool {
        self.alive
    }

    /// Requests the router has given it that are not finished.
    pub fn outstanding(&self) -> usize {
        // `loading` holds the waiting requests too.
        self.inbox.len() + self.loading.len() + self.running.len()
    }

    /// The loopback nodes of its workers.
    pub fn nodes(&self) -> Vec<NodeId> {
        self.workers.iter().map(DecodeWorker::node).collect()
    }

    /// Heartbeat messages its workers sent.
    pub fn heartbeat_messages(&self) -> u64 {
        self.workers
            .iter()
            .map(DecodeWorker::heartbeat_messages)
            .sum()
    }

    /// The router hands it a prefilled request.
    pub fn deliver(&mut self, serial: u64) {
        self.inbox.push(serial);
    }

    /// The engine dies: every request on it is lost; P's blocks for them
    /// are now dead blocks until P reclaims them.
    pub fn crash(
        &mut self,
        now: Instant,
        net: &LoopbackNetwork,
        ledger: &mut Ledger,
        m: &mut Metrics,
    ) {
        self.alive = false;
        for node in self.nodes() {
            net.crash(node);
        }
        let mut gone: Vec<u64> = self.inbox.drain(..).collect();
        self.waiting.clear(); // its requests are in `loading` too
        gone.extend(std::mem::take(&mut self.loading).into_keys());
        gone.extend(self.running.drain(..).map(|r| r.serial));
        for serial in gone {
            let Some(req) = ledger.get_mut(serial) else {
                continue;
            };
            req.d_state = DState::Lost;
            m.lost += 1;
            if req.p_held {
                req.orphaned_at = Some(now);
                m.orphaned += 1;
                // Renewed: tracked for a whole interval (P heard a heartbeat
                // in the last one) and granted long enough ago that the
                // renewal, not the initial lease, decides its expiry. For
                // those the protocol bound is extension + one interval.
                req.renewed_before_crash = self.heartbeats
                    && req.d_arrived.is_some_and(|t| t + self.interval <= now)
                    && req
                        .granted_at
                        .is_some_and(|t| t + self.initial_margin <= now);
            }
            ledger.settle_if_done(serial);
        }
    }

    /// One engine step at `now`. Returns the duration of the forward it starts.
    pub fn step(
        &mut self,
        now: Instant,
        ledger: &mut Ledger,
        m: &mut Metrics,
        model: &EngineModel,
    ) -> Result<Duration, SimError> {
        m.d_steps += 1;
        // get_finished in every worker; update_connector_output.
        for w in 0..self.workers.len() {
            let n =
                self.workers[w].get_finished(now, ledger, &mut self.facts, &mut m.d_lease_ns)?;
            self.apply_facts();
            if let Some(n) = n {
                let (tracker, workers, loading, decisions, tp) = (
                    &mut self.tracker,
                    &self.workers,
                    &mut self.loading,
                    &mut self.decisions,
                    self.tp,
                );
                timed(&mut m.d_lease_ns, || -> Result<(), SimError> {
                    let msg =
                        OutcomeMsg::decode(workers[w].outcome_bytes(n)).context("outcomes")?;
                    tracker
                        .apply_outcomes(&msg, |id, v| {
                            if let Some(s) = serial_of(id) {
                                decisions.push((s, decide(v)));
                            }
                        })
                        .context("apply outcomes")?;
                    // Requests the tracker refused: the engine aggregates them.
                    for o in msg.iter() {
                        let Some(s) = serial_of(o.request_id) else {
                            continue;
                        };
                        let Some(agg) = loading.get_mut(&s) else {
                            continue;
                        };
                        if agg.tracked {
                            continue;
                        }
                        if !o.verdict.is_verified() {
                            decisions.push((s, Decision::Fail(Some(o.verdict))));
                        } else {
                            agg.verified += 1;
                            if agg.verified == tp {
                                decisions.push((s, Decision::Accept { verified: true }));
                            }
                        }
                    }
                    Ok(())
                })?;
            }
        }
        let mut recompute_tokens: u64 = 0;
        for (serial, d) in std::mem::take(&mut self.decisions) {
            recompute_tokens += self.decide_load(serial, d, ledger, m);
        }
        // Decode: one token per running request.
        let mut k = 0;
        while k < self.running.len() {
            let r = &mut self.running[k];
            r.left = r.left.saturating_sub(1);
            if r.left > 0 {
                k += 1;
                continue;
            }
            let r = self.running.swap_remove(k);
            if let Some(blocks) = self.d_blocks.remove(&r.serial) {
                self.pool.give_back(&blocks);
            }
            if r.corrupt {
                m.completed_corrupt += 1;
            } else {
                m.completed_ok += 1;
            }
            if let Some(req) = ledger.get_mut(r.serial) {
                req.d_state = DState::Done;
                m.latencies_s
                    .push(now.saturating_duration_since(req.arrived).as_secs_f64());
            }
            ledger.settle_if_done(r.serial);
        }
        // New arrivals: tracking (heartbeats) starts now, before scheduling.
        for serial in std::mem::take(&mut self.inbox) {
            let Some(req) = ledger.get_mut(serial) else {
                continue;
            };
            req.d_state = DState::Waiting;
            req.d_arrived = Some(now);
            self.waiting.push_back(serial);
            let mut agg = LoadAgg::default();
            if self.heartbeats && req.leased {
                let (e, p_id, h) = (engine_id(req.p), p_request_id(serial), host(req.p));
                let params = RemotePrefillParams {
                    do_remote_prefill: true,
                    remote_engine_id: Some(&e),
                    remote_request_id: Some(&p_id),
                    remote_host: Some(&h),
                    remote_port: Some(P_PORT),
                    tp_size: Some(self.p_tp),
                    remote_lease_slot: req.lease.map(|l| l.slot),
                    remote_lease_nonce: req.lease.map(|l| l.nonce.as_int64()),
                    ..Default::default()
                };
                let d_id = d_request_id(serial);
                agg.tracked = timed(&mut m.d_lease_ns, || {
                    self.tracker.on_new_request(&d_id, &params, now)
                })
                .is_ok_and(|o| o == kvlease::consumer::TrackOutcome::Started);
            }
            self.loading.insert(serial, agg);
        }
        // Schedule: FCFS while sequences and D blocks allow. (`loading`
        // holds waiting requests too, keyed for their aggregation; count
        // only those really loading.)
        let mut busy = self.running.len() + (self.loading.len() - self.waiting.len());
        while busy < model.d_max_seqs as usize {
            let Some(&serial) = self.waiting.front() else {
                break;
            };
            let Some(req) = ledger.get_mut(serial) else {
                self.waiting.pop_front();
                self.loading.remove(&serial);
                continue;
            };
            let Some(blocks) = self.pool.take(model.blocks_for(req.prompt + req.output)) else {
                break;
            };
            self.waiting.pop_front();
            busy += 1;
            if let Some(arrived) = req.d_arrived {
                m.d_waits_s
                    .push(now.saturating_duration_since(arrived).as_secs_f64());
            }
            if !req.leased {
                // No KV to pull (P could not lease it): D prefills it.
                self.loading.remove(&serial);
                m.recomputed += 1;
                recompute_tokens += u64::from(req.prompt);
                req.d_state = DState::Running;
                self.running.push(Running {
                    serial,
                    left: req.output,
                    corrupt: false,
                });
                self.d_blocks.insert(serial, blocks);
                continue;
            }
            req.d_state = DState::Loading;
            for w in &mut self.workers {
                w.add_load(LoadSpec {
                    serial,
                    p: req.p,
                    lease: req.lease,
                    p_blocks: req.p_blocks.clone(),
                    d_blocks: blocks.clone(),
                });
            }
            self.d_blocks.insert(serial, blocks);
        }
        // build_connector_meta: the plan, as bytes, to every worker.
        if self.heartbeats {
            let (tracker, plan) = (&mut self.tracker, &mut self.plan);
            let n = timed(&mut m.d_lease_ns, || -> Result<usize, SimError> {
                let len = tracker.plan_len(now);
                if plan.len() < len {
                    plan.resize(len, 0);
                }
                tracker.encode_plan(now, plan).context("heartbeat plan")
            })?;
            for w in &mut self.workers {
                w.send_plan(&self.plan[..n], now, &mut m.d_lease_ns)?;
            }
        }
        // start_load_kv: post the block READs.
        for w in &mut self.workers {
            w.start_loads(now, &mut self.facts);
        }
        self.apply_facts();
        for (serial, d) in std::mem::take(&mut self.decisions) {
            recompute_tokens += self.decide_load(serial, d, ledger, m);
        }
        let busy = !self.running.is_empty() || self.loading.len() > self.waiting.len();
        self.idle = !busy && recompute_tokens == 0;
        Ok(if self.idle {
            model.idle_poll
        } else {
            model.d_step_base
                + model.d_step_per_seq * self.running.len() as u32
                + model.d_step_per_prefill_token * recompute_tokens as u32
        })
    }

    /// Folds the workers' READ results into the loads; without
    /// verification a load is decided here.
    fn apply_facts(&mut self) {
        for (serial, fact) in std::mem::take(&mut self.facts) {
            let Some(agg) = self.loading.get_mut(&serial) else {
                continue;
            };
            match fact {
                ReadFact::Landed { corrupt, stale } => {
                    agg.landed += 1;
                    agg.corrupt |= corrupt;
                    agg.stale |= stale;
                    if !self.verify && agg.landed == self.tp {
                        self.decisions
                            .push((serial, Decision::Accept { verified: false }));
                    }
                }
                ReadFact::Failed(_) => {
                    if !self.verify {
                        self.decisions.push((serial, Decision::Fail(None)));
                    }
                }
            }
        }
    }

    /// Applies how a load ended; returns the prompt tokens D must now
    /// prefill itself (a failed load under `recompute`).
    fn decide_load(
        &mut self,
        serial: u64,
        d: Decision,
        ledger: &mut Ledger,
        m: &mut Metrics,
    ) -> u64 {
        let Some(agg) = self.loading.remove(&serial) else {
            return 0;
        };
        let Some(req) = ledger.get_mut(serial) else {
            return 0;
        };
        if agg.stale {
            m.stale_reads += 1;
        }
        req.d_state = DState::Running;
        let d_id = d_request_id(serial);
        match d {
            Decision::Accept { verified } => {
                if agg.corrupt {
                    m.silent_corruptions += 1;
                    if verified {
                        m.verified_but_wrong += 1;
                    }
                }
                if agg.tracked && !verified {
                    self.tracker.on_transfer_complete(&d_id);
                }
                self.running.push(Running {
                    serial,
                    left: req.output,
                    corrupt: agg.corrupt,
                });
                0
            }
            Decision::Fail(verdict) => {
                m.failed_loads += 1;
                if agg.stale {
                    m.stale_caught += 1;
                }
                if verdict == Some(Verdict::Unverifiable) {
                    m.unverifiable += 1;
                }
                if agg.tracked && verdict.is_none() {
                    self.tracker.on_request_finished(&d_id);
                }
                m.recomputed += 1;
                self.running.push(Running {
                    serial,
                    left: req.output,
                    corrupt: false,
                });
                u64::from(req.prompt)
            }
        }
    }

    /// The engine's index.
    pub fn index(&self) -> u32 {
        self.index
    }
}

fn decide(v: Verdict) -> Decision {
    if v.is_verified() {
        Decision::Accept { verified: true }
    } else {
        Decision::Fail(Some(v))
    }
}
