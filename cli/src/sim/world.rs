//! One run: a scenario under a policy, event by event in virtual time.
//!
//! This module owns the event loop and the wiring: it builds the loopback
//! network and the engines, draws arrivals, moves prefilled requests from P
//! to D through the router, applies the scenario's faults through the
//! network's controls, samples the blocks P holds once a second, and closes
//! the books at the end. Events are processed in (time, sequence) order, so
//! a run is a pure function of its [`RunSpec`] (`spec.rs`).
//!
//! Arrivals come from the workload (Poisson, with the scenario's surge) or,
//! for `--trace`, from a replay ([`super::replay`]); a replay ends once its
//! last request has arrived and every request has settled, or at its cap.
//!
//! Engines step on their own clocks: a step's duration comes from the work
//! it started (see [`super::model::EngineModel`]); an idle engine polls
//! every `idle_poll`, and a request arriving at an idle engine wakes it.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use kvlease::fabric::loopback::{
    LoopbackConfig, LoopbackNetwork, Nodes, NotificationFaults, ReadFaults, UnreachableSends,
};
use kvlease::Instant;

use super::decode::DecodeEngine;
use super::error::SimError;
use super::ledger::{DState, Ledger, Req};
use super::metrics::Metrics;
use super::model::{EngineModel, Fleet};
use super::prefill::PrefillEngine;
use super::replay::Replay;
use super::rng::SimRng;
use super::router::{least_loaded, Arrivals};
use super::scenario::{Fault, Scenario};
use super::spec::{RunOutput, RunSpec};

/// Where a run's requests come from.
enum Source<'a> {
    /// The workload's Poisson process.
    Poisson(Arrivals),
    /// A trace replay.
    Trace(Replay<'a>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Fault(usize),
    Arrive,
    PStep(u32, u64),
    DStep(u32, u64),
    Deliver(u64),
    Sample,
}

struct World {
    net: std::sync::Arc<LoopbackNetwork>,
    t0: Instant,
    p: Vec<PrefillEngine>,
    d: Vec<DecodeEngine>,
    ledger: Ledger,
    m: Metrics,
    events: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    model: EngineModel,
}

impl World {
    fn at(&mut self, t: Instant, ev: Ev) {
        self.seq += 1;
        self.events.push(Reverse((t.as_nanos(), self.seq, ev)));
    }

    fn wake_p(&mut self, i: u32, now: Instant) {
        let e = &mut self.p[i as usize];
        if e.idle {
            e.step_gen += 1;
            e.idle = false;
            let g = e.step_gen;
            self.at(now, Ev::PStep(i, g));
        }
    }

    fn wake_d(&mut self, i: u32, now: Instant) {
        let e = &mut self.d[i as usize];
        if e.idle && e.alive() {
            e.step_gen += 1;
            e.idle = false;
            let g = e.step_gen;
            self.at(now, Ev::DStep(i, g));
        }
    }

    fn apply(&mut self, fault: Fault, now: Instant) {
        let drop = |on: bool| NotificationFaults {
            drop_probability: if on { 1.0 } else { 0.0 },
            ..NotificationFaults::default()
        };
        match fault {
            Fault::CrashDecode { d } => {
                if let Some(e) = self.d.get_mut(d as usize) {
                    e.crash(now, &self.net, &mut self.ledger, &mut self.m);
                }
            }
            Fault::DecodeNotifications { d, lost } => {
                for node in self
                    .d
                    .get(d as usize)
                    .map(DecodeEngine::nodes)
                    .unwrap_or_default()
                {
                    self.net
                        .set_notification_faults(node, Nodes::All, drop(lost));
                }
            }
            Fault::SlowReads { d, extra } => {
                let faults = ReadFaults {
                    delay_probability: if extra.is_some() { 1.0 } else { 0.0 },
                    delay: extra.unwrap_or_default(),
                    ..ReadFaults::default()
                };
                for node in self
                    .d
                    .get(d as usize)
                    .map(DecodeEngine::nodes)
                    .unwrap_or_default()
                {
                    self.net.set_read_faults(node, Nodes::All, faults);
                }
            }
            Fault::RankDeaf { p, rank, deaf } => {
                if let Some(node) = self.p.get(p as usize).and_then(|e| e.node(rank)) {
                    self.net
                        .set_notification_faults(Nodes::All, node, drop(deaf));
                }
            }
        }
    }
}

/// The loopback network a fleet needs.
fn network(fleet: &Fleet, model: &EngineModel, largest_prompt: u32, seed: u64) -> LoopbackConfig {
    let fan_out = (fleet.p_tp / fleet.d_tp).max(1);
    let p_ranks = fleet.p_engines * fleet.p_tp;
    LoopbackConfig {
        max_agents: fleet.agents(),
        queue_capacity: 256,
        max_notification_len: 2048,
        pen_capacity: 64,
        max_regions: 8,
        // Block READs of every load, plus one lease-check READ per P rank.
        max_reads_in_flight: model.d_max_seqs * fan_out + p_ranks + 16,
        // A load's blocks (one descriptor each at worst) or a batch of lease
        // checks (one each when their slots are scattered; a worker has at
        // most d_max_seqs loads). Preallocated per READ: keep it tight.
        max_descs_per_read: model.blocks_for(largest_prompt).max(model.d_max_seqs) + 8,
        read_latency: model.read_latency,
        transfer_timeout: model.transfer_timeout,
        handshake_polls: 2,
        handshake_latency: Duration::from_millis(1),
        seed,
        unreachable_sends: UnreachableSends::Error,
    }
}

/// Runs one (scenario, policy). `progress` is told of each simulated second
/// (or, for a request-bounded run, each settled request).
pub fn run(spec: &RunSpec, progress: &(dyn Fn(u64) + Sync)) -> Result<RunOutput, SimError> {
    let plan = spec.plan();
    let config = spec.effective_config(&plan);
    config
        .validate()
        .map_err(|e| SimError(format!("lease settings for {}: {e}", spec.policy.name())))?;
    if spec.scenario == Scenario::BidirectionalSkew {
        let ttl = config.decoder_kv_blocks_ttl();
        let duration = spec.duration.unwrap_or_else(|| {
            plan.duration
                .max(ttl.mul_f64(1.25) + Duration::from_secs(60))
        });
        return super::bidir::run(spec, &config, duration, progress);
    }
    if spec.scenario == Scenario::PushFaults {
        let duration = spec.duration.unwrap_or(plan.duration);
        return super::push::run(spec, &config, duration, progress);
    }
    let realised = spec.policy.realise(&config);
    let heartbeats = realised.heartbeats;
    let mut rng = SimRng::new(spec.seed, 0);
    let net = LoopbackNetwork::new(network(
        &spec.fleet,
        &spec.model,
        spec.largest_prompt(),
        rng.next_u64(),
    ));
    let t0 = Instant::from_secs(1);
    net.advance_to(t0);
    let mut p = Vec::new();
    for i in 0..spec.fleet.p_engines {
        p.push(PrefillEngine::new(
            i,
            spec.fleet.p_tp,
            &config,
            &spec.model,
            &net,
            rng.next_u64(),
            t0,
        )?);
    }
    let mut d = Vec::new();
    for i in 0..spec.fleet.d_engines {
        d.push(DecodeEngine::new(
            i,
            &spec.fleet,
            &config,
            heartbeats,
            &spec.model,
            &net,
        )?);
    }
    let mut source = match &spec.trace {
        Some(t) => Source::Trace(Replay::new(&t.arrivals)),
        None => Source::Poisson(Arrivals::new(
            SimRng::new(spec.seed, 1),
            spec.workload,
            plan.surge,
        )),
    };
    let mut w = World {
        net,
        t0,
        p,
        d,
        ledger: Ledger::default(),
        m: Metrics::default(),
        events: BinaryHeap::new(),
        seq: 0,
        model: spec.model.clone(),
    };
    for i in 0..spec.fleet.p_engines {
        w.wake_p(i, t0);
    }
    for i in 0..spec.fleet.d_engines {
        w.wake_d(i, t0);
    }
    for (k, (at, _)) in plan.faults.iter().enumerate() {
        w.at(t0 + *at, Ev::Fault(k));
    }
    w.at(t0 + Duration::from_secs(1), Ev::Sample);
    let replay = spec.trace.is_some();
    let max_requests = if replay {
        None
    } else {
        spec.workload.max_requests
    };
    // A request-bounded run and a replay stop once everything has settled.
    let until_settled = replay || max_requests.is_some();
    let end = match (spec.duration, max_requests) {
        (Some(d), _) => Some(t0 + d),
        (None, Some(_)) => None,
        (None, None) => Some(t0 + plan.duration),
    };
    let first = match &mut source {
        Source::Poisson(a) => a.next_after(Duration::ZERO),
        Source::Trace(r) => r.next_at(),
    };
    if let Some(first) = first {
        w.at(t0 + first, Ev::Arrive);
    }
    let mut arrivals_done = max_requests == Some(0) || first.is_none();
    let mut now = t0;
    let mut settled_reported = 0u64;
    // A replay that settled before its cap ends there, not at the cap.
    let mut settled_early = false;
    while let Some(Reverse((t, _, ev))) = w.events.pop() {
        let t = Instant::from_nanos(t);
        if end.is_some_and(|e| t > e) {
            break;
        }
        now = t;
        w.net.advance_to(now);
        match ev {
            Ev::Arrive => {
                let (prompt, output) = match &mut source {
                    Source::Poisson(a) => a.sizes(),
                    Source::Trace(r) => r.take().unwrap_or((1, 0)),
                };
                let target = least_loaded(w.p.iter().map(|e| Some(e.queued()))).unwrap_or(0);
                let serial = w.ledger.add(Req {
                    prompt,
                    output,
                    arrived: now,
                    p: target as u32,
                    p_blocks: Vec::new(),
                    p_held: false,
                    p_freed_at: None,
                    granted_at: None,
                    lease: None,
                    leased: false,
                    d: None,
                    d_arrived: None,
                    d_state: DState::NotYet,
                    orphaned_at: None,
                    renewed_before_crash: false,
                });
                w.m.arrived += 1;
                w.p[target].enqueue(serial);
                w.wake_p(target as u32, now);
                let next = match &mut source {
                    _ if max_requests.is_some_and(|n| w.ledger.arrived >= n) => None,
                    Source::Poisson(a) => a.next_after(now.saturating_duration_since(t0)),
                    Source::Trace(r) => r.next_at(),
                };
                match next {
                    Some(next) => w.at(t0 + next, Ev::Arrive),
                    None => arrivals_done = true,
                }
            }
            Ev::PStep(i, g) => {
                if w.p[i as usize].step_gen != g {
                    continue;
                }
                let out = w.p[i as usize].step(now, &mut w.ledger, &mut w.m, &w.model)?;
                w.m.longest_p_step = w.m.longest_p_step.max(out.duration);
                for serial in out.done {
                    let at = now + w.model.proxy_latency;
                    w.at(at, Ev::Deliver(serial));
                }
                let e = &mut w.p[i as usize];
                e.step_gen += 1;
                let g = e.step_gen;
                w.at(now + out.duration, Ev::PStep(i, g));
            }
            Ev::DStep(i, g) => {
                let e = &w.d[i as usize];
                if e.step_gen != g || !e.alive() {
                    continue;
                }
                let dur = w.d[i as usize].step(now, &mut w.ledger, &mut w.m, &w.model)?;
                let e = &mut w.d[i as usize];
                e.step_gen += 1;
                let g = e.step_gen;
                w.at(now + dur, Ev::DStep(i, g));
            }
            Ev::Deliver(serial) => {
                // The proxy's hop to a dead D fails at once: it tries the next.
                let target = least_loaded(w.d.iter().map(|e| e.alive().then(|| e.outstanding())));
                match target {
                    Some(di) => {
                        if let Some(req) = w.ledger.get_mut(serial) {
                            req.d = Some(di as u32);
                        }
                        w.d[di].deliver(serial);
                        w.wake_d(di as u32, now);
                    }
                    None => {
                        if let Some(req) = w.ledger.get_mut(serial) {
                            req.d_state = DState::Lost;
                            w.m.lost += 1;
                        }
                        w.ledger.settle_if_done(serial);
                    }
                }
            }
            Ev::Fault(k) => {
                if let Some((_, f)) = plan.faults.get(k) {
                    w.apply(*f, now);
                }
            }
            Ev::Sample => {
                w.m.held_series.push(w.m.blocks_held);
                if max_requests.is_some() {
                    progress(w.ledger.settled - settled_reported);
                    settled_reported = w.ledger.settled;
                    if arrivals_done && w.ledger.is_empty() {
                        break;
                    }
                } else {
                    progress(1);
                    if until_settled && arrivals_done && w.ledger.is_empty() {
                        settled_early = true;
                        break;
                    }
                }
                w.at(now + Duration::from_secs(1), Ev::Sample);
            }
        }
    }
    if let Some(e) = end.filter(|_| !settled_early) {
        now = now.max(e);
    }
    // Close the books: dead blocks still held count up to the end; a request
    // neither done nor lost is still in flight.
    let mut dead_left = 0u64;
    for (_, req) in w.ledger.iter() {
        if !matches!(req.d_state, DState::Done | DState::Lost) {
            w.m.in_flight_at_end += 1;
        }
        if let (Some(crash), true) = (req.orphaned_at, req.p_held) {
            let held = now.saturating_duration_since(crash).as_secs_f64();
            w.m.dead_block_seconds += held * req.p_blocks.len() as f64;
            dead_left += req.p_blocks.len() as u64;
        }
    }
    w.m.dead_blocks_at_end = dead_left;
    if dead_left > 0 {
        // Not every dead block came back within the run.
        w.m.reclaim_s = None;
        w.m.reclaim_renewed_s = None;
    }
    w.m.granted_without_slot = w.p.iter().map(PrefillEngine::granted_without_slot).sum();
    w.m.peak_engine_blocks_held =
        w.p.iter()
            .map(|e| u64::from(e.peak_blocks_used()))
            .max()
            .unwrap_or(0);
    w.m.renewals = w.p.iter().map(PrefillEngine::renewals).sum();
    w.m.heartbeat_messages = w.d.iter().map(DecodeEngine::heartbeat_messages).sum();
    Ok(RunOutput {
        seconds: now.saturating_duration_since(w.t0).as_secs_f64(),
        metrics: w.m,
    })
}
