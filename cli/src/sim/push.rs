//! The `push-faults` scenario: vLLM's push mode, where D registers blocks
//! with P and P WRITEs its KV into them, under the faults that make a push
//! never come (issue 29), and a dead P.
//!
//! This module owns a small world of its own, like [`super::bidir`]: the
//! main engines ([`super::world`]) pull. What is **real**: the push guard's
//! roles, D's [`PushPermits`] and P's [`PushWrites`], with their messages as
//! bytes (`PHB:`, `PRN:`, `PRV:`, `PEND:`), and P's clock estimate of D
//! ([`ClockOffset`]) across clocks that disagree ([`D_AHEAD`],
//! [`D_DRIFT_PPM`]). What is **modelled**: the network (latency, loss,
//! duplication, reordering), the registration's channel, the WRITE (it
//! lands after its latency, into whatever D's block set holds then, even
//! after P died: a posted RDMA WRITE is the NIC's), D's pool of block sets
//! (a freed set is the next one reused), and the requests' fault classes.
//!
//! A request: P prefills it and holds its KV `kv_lease_duration` for D's
//! registration; the router then sends it to D (10 ms later),
//! which takes a block set and registers it with P; P WRITEs; D decodes [`DECODE`] on the set, then
//! frees it. Fault classes, per request:
//!
//! | share | class |
//! |---:|---|
//! | 70 % | normal: the registration takes 5-50 ms, the WRITE 20 ms |
//! | 10 % | late: the registration reaches P 1-5 s after P let the request go (D's worker slept) |
//! | 5 % | lost: the registration never reaches P (P's handshake back to D failed) |
//! | 10 % | abort: D aborts 1 s after registering, while P's WRITE (2-6 s) is in flight |
//! | 5 % | slow: the WRITE takes 2-8 s |
//!
//! and at [`P_DEATH`] P dies: it sends and writes nothing more (WRITEs
//! already posted still land), and the router sends no new request. Every
//! notification is lost with 2 %, duplicated with 2 % probability, and
//! takes 1-30 ms, so some overtake others.
//!
//! The policies: `lease+verify` and `lease-noverify` run the guard (push
//! has no READ to verify: the same run); `fixed-480` is stock vLLM, where D
//! keeps registered blocks until P reports the transfer (its 480 s
//! registration watchdog only logs); `fixed-30` is the naive fix, D frees
//! on an abort at once and 30 s after registering without P's report.
//!
//! Counted ([`PushFigures`]): pushes `loaded` on their own KV, `failed`
//! (recomputed), `hung` (still waiting for P at the end, longer than
//! [`HANG_AFTER`]) and the block sets they hold (`leaked_sets`), `stray`
//! WRITEs that landed in a set after D freed it, requests that decoded on
//! a set a stray WRITE overwrote (`corrupt`), and the reclaim after P's
//! death: from the death until D freed the last set registered with it.

use std::collections::HashMap;
use std::time::Duration;

use kvlease::clock_offset::ClockOffset;
use kvlease::fabric::ClockSample;
use kvlease::push::{PermitEnd, PermitFields, PushConfig, PushEnd, PushPermits, PushWrites};
use kvlease::push::{PostRefused, WriteHandle};
use kvlease::{Instant, LeaseConfig, NonceSource};

use super::error::SimError;
use super::metrics::{Metrics, PushFigures};
use super::policy::Policy;
use super::rng::SimRng;
use super::scenario::{D_AHEAD, D_DRIFT_PPM, P_DEATH};
use super::spec::{RunOutput, RunSpec};

/// Push requests per second.
const RATE: f64 = 4.0;
/// Engine step of both sides.
const STEP: Duration = Duration::from_millis(50);
/// From the end of P's prefill to D's registration (the router's hop).
const ROUTER_HOP: Duration = Duration::from_millis(10);
/// D decodes this long on a loaded set before freeing it.
pub const DECODE: Duration = Duration::from_secs(2);
/// A push still waiting for P this long at the end of the run hangs.
pub const HANG_AFTER: Duration = Duration::from_secs(120);
/// The naive policy's timeout (`fixed-30`).
const NAIVE_TIMEOUT: Duration = Duration::from_secs(30);
/// D's block sets.
const SETS: u32 = 1024;
/// P's re-sample of D's clock.
const CLOCK_EVERY: Duration = Duration::from_secs(30);
/// P's name for D, D's name for P.
const D_PEER: u16 = 1;
const P_PEER: u16 = 0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Guard {
    /// kvlease's permits and gate.
    Permits,
    /// Stock vLLM: D frees only on P's report.
    Stock,
    /// D frees on abort and after [`NAIVE_TIMEOUT`].
    Naive,
}

/// What crosses the network.
#[derive(Clone)]
enum Payload {
    /// The guard's wire bytes.
    Guard(Vec<u8>),
    /// Stock's "transfer done" from P, for request `i`.
    Done(usize),
}

struct Msg {
    at: Instant,
    to_p: bool,
    payload: Payload,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DState {
    /// Registered, waiting for P.
    Waiting,
    /// D aborted it; the set is still held (stock, guard).
    Aborted,
    /// Loaded; decoding until the time given.
    Decoding(Instant),
    /// The set is free again.
    Freed,
}

struct Req {
    set: u32,
    /// P lets the request go at this P time unless registered.
    hold_until: Instant,
    /// When the registration reaches P (None: never).
    reg_at: Option<Instant>,
    write_latency: Duration,
    abort_at: Option<Instant>,
    registered_at: Instant,
    permit: Option<PermitFields>,
    handle: Option<WriteHandle>,
    state: DState,
    /// Whether a WRITE of this request was posted (once).
    posted: bool,
    /// D found another request's KV in the set (at the load, or after a
    /// stray WRITE overwrote it during the decode).
    corrupt: bool,
    /// When D freed the set.
    freed_at: Option<Instant>,
}

struct Landing {
    at: Instant,
    req: usize,
}

/// Runs the scenario under `spec.policy` for `duration` of virtual time.
pub fn run(
    spec: &RunSpec,
    config: &LeaseConfig,
    duration: Duration,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<RunOutput, SimError> {
    let guard = match spec.policy {
        Policy::LeaseVerify | Policy::LeaseNoVerify => Guard::Permits,
        Policy::Fixed480 => Guard::Stock,
        Policy::Fixed30 => Guard::Naive,
    };
    // P's hold is the operator's lease under every policy (vLLM's own push
    // mode holds P's KV under kv_lease_duration too); the policies differ
    // only in what D does.
    let hold = spec.config.lease_duration();
    // The guard's settings as an engine reads them from the same keys.
    let push_config = PushConfig {
        capacity: SETS,
        ..PushConfig::from_lease_config(&spec.config)
    };
    let err = |what: &str, e: String| SimError(format!("push-faults: {what}: {e}"));
    let mut permits = PushPermits::new(push_config, NonceSource::from_seed(spec.seed, 3, 5))
        .map_err(|e| err("permits", e.to_string()))?;
    let mut writes = PushWrites::new(push_config, spec.seed ^ 0x9e37)
        .map_err(|e| err("writes", e.to_string()))?;

    let t0 = Instant::from_secs(1);
    let d_clock = |v: Instant| {
        let drift = v.saturating_duration_since(t0).as_nanos() as u64 * D_DRIFT_PPM / 1_000_000;
        v + D_AHEAD + Duration::from_nanos(drift)
    };
    let mut clock = ClockOffset::new(config.clock_offset_config());
    let sample = |at: Instant| ClockSample {
        local_send: Instant::from_nanos(at.as_nanos() - 2_000_000),
        remote: d_clock(Instant::from_nanos(at.as_nanos() - 1_000_000)),
        local_recv: at,
    };
    clock.observe(sample(t0));
    let mut next_sample = t0 + CLOCK_EVERY;

    // The workload's draws apart from the network's: every policy gets the
    // same requests in the same classes.
    let mut rng = SimRng::new(spec.seed, 29);
    let mut net_rng = SimRng::new(spec.seed, 30);
    let mut words = vec![0u64; SETS as usize];
    let mut owner: Vec<Option<usize>> = vec![None; SETS as usize];
    let mut free_sets: Vec<u32> = (0..SETS).rev().collect();
    let mut reqs: Vec<Req> = Vec::new();
    let mut by_permit: HashMap<(u32, u64), usize> = HashMap::new();
    let mut net: Vec<Msg> = Vec::new();
    let mut landings: Vec<Landing> = Vec::new();
    let mut m = Metrics::default();
    let mut f = PushFigures::default();
    let death = t0 + P_DEATH;
    let mut outstanding_at_death: Vec<usize> = Vec::new();
    let mut next_arrival = t0 + Duration::from_secs_f64(rng.exponential(1.0 / RATE));
    let end = t0 + duration;
    let mut now = t0;
    let mut last_second = 0u64;

    while now < end {
        now = now + STEP;
        let dn = d_clock(now);
        let p_alive = now < death;
        if !p_alive && f.p_deaths == 0 {
            f.p_deaths = 1;
            outstanding_at_death = (0..reqs.len())
                .filter(|&i| matches!(reqs[i].state, DState::Waiting | DState::Aborted))
                .collect();
            f.outstanding_at_p_death = outstanding_at_death.len() as u64;
        }

        // Arrivals: P prefilled; D takes a set and registers it.
        while next_arrival <= now && p_alive {
            next_arrival = next_arrival + Duration::from_secs_f64(rng.exponential(1.0 / RATE));
            if spec.workload.max_requests.is_some_and(|n| m.arrived >= n) {
                continue;
            }
            m.arrived += 1;
            let i = reqs.len();
            let Some(set) = free_sets.pop() else {
                m.recomputed += 1; // no room on D: recompute without a push
                continue;
            };
            // The router hands D the request PREFILL after it reached P, and
            // 10 ms after P's prefill ended, when P's hold began.
            let prefilled = now.saturating_sub(ROUTER_HOP);
            let ms = |lo: u64, hi: u64, r: &mut SimRng| Duration::from_millis(r.between(lo, hi));
            let class = rng.unit();
            let (reg_delay, write_latency, abort) = if class < 0.70 {
                (Some(ms(5, 50, &mut rng)), ms(20, 20, &mut rng), None)
            } else if class < 0.80 {
                (
                    Some(hold + ms(1000, 5000, &mut rng)),
                    ms(20, 20, &mut rng),
                    None,
                )
            } else if class < 0.85 {
                (None, ms(20, 20, &mut rng), None)
            } else if class < 0.95 {
                (
                    Some(ms(20, 20, &mut rng)),
                    ms(2000, 6000, &mut rng),
                    Some(now + Duration::from_secs(1)),
                )
            } else {
                (Some(ms(5, 50, &mut rng)), ms(2000, 8000, &mut rng), None)
            };
            let permit = match guard {
                Guard::Permits => match permits.register(P_PEER, dn) {
                    Ok(p) => Some(p),
                    Err(_) => {
                        // Fail closed: no permit, no push.
                        free_sets.push(set);
                        m.failed_loads += 1;
                        m.recomputed += 1;
                        continue;
                    }
                },
                _ => None,
            };
            owner[set as usize] = Some(i);
            if let Some(p) = permit {
                by_permit.insert((p.slot, p.nonce.get()), i);
            }
            reqs.push(Req {
                set,
                hold_until: prefilled + hold,
                reg_at: reg_delay.map(|d| now + d),
                write_latency,
                abort_at: abort,
                registered_at: now,
                permit,
                handle: None,
                state: DState::Waiting,
                posted: false,
                corrupt: false,
                freed_at: None,
            });
        }

        // The network: what is due now, in the order it arrives.
        let (mut due, later): (Vec<Msg>, Vec<Msg>) = std::mem::take(&mut net)
            .into_iter()
            .partition(|msg| msg.at <= now);
        net = later;
        due.sort_by_key(|msg| msg.at);
        let mut ends: Vec<PermitEnd> = Vec::new();
        for msg in due {
            match (msg.to_p, msg.payload) {
                (true, Payload::Guard(bytes)) if p_alive => {
                    let _ = writes.on_message(D_PEER, &bytes);
                }
                (false, Payload::Guard(bytes)) => {
                    let _ = permits.on_message(P_PEER, &bytes, dn, |e| ends.push(e));
                }
                (false, Payload::Done(i)) if i < reqs.len() => {
                    let r = &mut reqs[i];
                    match r.state {
                        DState::Waiting => {
                            r.state = DState::Decoding(now + DECODE);
                            r.corrupt = words[r.set as usize] != tag(i);
                        }
                        DState::Aborted => free(r, &mut owner, &mut free_sets, now),
                        _ => {}
                    }
                }
                _ => {}
            }
        }

        // P's step: registrations that arrived, WRITEs, clock, poll.
        if p_alive {
            if now >= next_sample {
                clock.observe(sample(now));
                next_sample = now + CLOCK_EVERY;
            }
            for (i, r) in reqs.iter_mut().enumerate() {
                let Some(at) = r.reg_at else { continue };
                if at > now || r.posted || r.handle.is_some() {
                    continue;
                }
                r.reg_at = None; // handled once
                let live = at < r.hold_until;
                match guard {
                    Guard::Permits => {
                        let Some(fields) = r.permit else { continue };
                        let Ok(h) = writes.register(D_PEER, fields, live, &clock, now) else {
                            continue; // refused: answered in this step's poll
                        };
                        r.handle = Some(h);
                        match writes.begin_write(h, &clock, now) {
                            Ok(()) => {
                                r.posted = true;
                                landings.push(Landing {
                                    at: now + r.write_latency,
                                    req: i,
                                });
                            }
                            Err(PostRefused::Closed | PostRefused::UnknownHandle) => {}
                            Err(PostRefused::AlreadyPosted) => {}
                        }
                    }
                    Guard::Stock | Guard::Naive if live => {
                        r.posted = true;
                        landings.push(Landing {
                            at: now + r.write_latency,
                            req: i,
                        });
                    }
                    _ => {} // stock P ignores a registration it has no request for
                }
            }
        }

        // WRITEs land, P alive or not: into whatever the set holds now.
        let (landed, later): (Vec<Landing>, Vec<Landing>) = std::mem::take(&mut landings)
            .into_iter()
            .partition(|l| l.at <= now);
        landings = later;
        for l in landed {
            let r = &reqs[l.req];
            words[r.set as usize] = tag(l.req);
            if owner[r.set as usize] != Some(l.req) {
                f.stray_writes += 1;
            }
            if !p_alive {
                continue; // nobody reports it
            }
            match guard {
                Guard::Permits => {
                    if let Some(h) = r.handle {
                        writes.write_done(h, true, now);
                    }
                }
                _ => send(&mut net, &mut net_rng, now, false, Payload::Done(l.req)),
            }
        }
        if p_alive && guard == Guard::Permits {
            let (net_ref, rng_ref) = (&mut net, &mut net_rng);
            writes.poll(
                |peer| (peer == D_PEER).then_some(&clock),
                now,
                |_, bytes| send(net_ref, rng_ref, now, false, Payload::Guard(bytes.to_vec())),
            );
        }

        // D's step: aborts, the naive timeout, the guard's poll, ends, decodes.
        for (i, r) in reqs.iter_mut().enumerate() {
            if r.state == DState::Waiting && r.abort_at.is_some_and(|a| a <= now) {
                m.failed_loads += 1;
                m.recomputed += 1;
                match guard {
                    Guard::Permits => {
                        r.state = DState::Aborted;
                        if let Some(p) = r.permit {
                            let _ = permits.revoke(p.slot, p.nonce);
                        }
                    }
                    Guard::Stock => r.state = DState::Aborted,
                    Guard::Naive => free(r, &mut owner, &mut free_sets, now),
                }
            } else if guard == Guard::Naive
                && r.state == DState::Waiting
                && now >= r.registered_at + NAIVE_TIMEOUT
            {
                m.failed_loads += 1;
                m.recomputed += 1;
                free(r, &mut owner, &mut free_sets, now);
            } else if let DState::Decoding(until) = r.state {
                if now >= until {
                    if r.corrupt || words[r.set as usize] != tag(i) {
                        // A stray WRITE overwrote the KV this request decoded on.
                        m.silent_corruptions += 1;
                        m.completed_corrupt += 1;
                    } else {
                        m.completed_ok += 1;
                    }
                    free(r, &mut owner, &mut free_sets, now);
                }
            }
        }
        if guard == Guard::Permits {
            let (net_ref, rng_ref) = (&mut net, &mut net_rng);
            permits.poll(
                dn,
                |_, bytes| send(net_ref, rng_ref, now, true, Payload::Guard(bytes.to_vec())),
                |e| ends.push(e),
            );
        }
        for e in ends {
            let Some(&i) = by_permit.get(&(e.slot, e.nonce.get())) else {
                continue;
            };
            by_permit.remove(&(e.slot, e.nonce.get()));
            let r = &mut reqs[i];
            if e.end == PushEnd::Written && r.state == DState::Waiting {
                r.state = DState::Decoding(now + DECODE);
                r.corrupt = words[r.set as usize] != tag(i);
                continue;
            }
            if r.state == DState::Waiting {
                m.failed_loads += 1;
                m.recomputed += 1;
            }
            free(r, &mut owner, &mut free_sets, now);
        }

        let second = now.saturating_duration_since(t0).as_secs();
        if second > last_second {
            progress(second - last_second);
            last_second = second;
        }
    }

    // What is left: hangs, leaked sets, the reclaim after P's death.
    for r in &reqs {
        if matches!(r.state, DState::Waiting | DState::Aborted)
            && now.saturating_duration_since(r.registered_at) > HANG_AFTER
        {
            f.hung += 1;
            f.leaked_sets += 1;
        }
    }
    m.in_flight_at_end = reqs
        .iter()
        .filter(|r| matches!(r.state, DState::Waiting | DState::Decoding(_)))
        .count() as u64;
    let freed: Option<Vec<Instant>> = outstanding_at_death
        .iter()
        .map(|&i| reqs[i].freed_at)
        .collect();
    f.reclaim_after_p_death_s = match freed {
        Some(v) if !outstanding_at_death.is_empty() => v
            .iter()
            .map(|t| t.saturating_duration_since(death).as_secs_f64())
            .reduce(f64::max),
        _ => None,
    };
    f.bound_s = (guard == Guard::Permits).then(|| push_bound(&push_config).as_secs_f64());
    let c = permits.counters();
    f.permit_renewals = c.renewed;
    f.permits_lapsed = c.lapsed;
    f.permits_refused = c.refused;
    m.push = Some(f);
    Ok(RunOutput {
        metrics: m,
        seconds: duration.as_secs_f64(),
    })
}

/// The longest D waits for its sets after P's last word: the permit's
/// fence, `max(duration, extension + interval) + write_bound` with the
/// drift allowance (the module docs of `kvlease::push`).
pub fn push_bound(c: &PushConfig) -> Duration {
    let wait = c.duration.max(c.extension + c.heartbeat_interval);
    wait + c.write_bound.mul_f64(1.0 + f64::from(c.drift_ppm) / 1e6)
}

/// The tag request `i` writes into its set (never 0).
fn tag(i: usize) -> u64 {
    i as u64 + 1
}

/// D gives `r`'s set back to its pool (the next request takes it first).
fn free(r: &mut Req, owner: &mut [Option<usize>], free_sets: &mut Vec<u32>, now: Instant) {
    if r.state == DState::Freed {
        return;
    }
    r.state = DState::Freed;
    r.freed_at = Some(now);
    owner[r.set as usize] = None;
    free_sets.push(r.set);
}

/// Queues `payload` with the network's faults: 2 % lost, 2 % twice, 1-30 ms.
fn send(net: &mut Vec<Msg>, rng: &mut SimRng, now: Instant, to_p: bool, payload: Payload) {
    let x = rng.unit();
    if x < 0.02 {
        return;
    }
    let at = now + Duration::from_millis(rng.between(1, 30));
    if x < 0.04 {
        net.push(Msg {
            at: now + Duration::from_millis(rng.between(1, 30)),
            to_p,
            payload: payload.clone(),
        });
    }
    net.push(Msg { at, to_p, payload });
}
