//! The `bidirectional-skew` scenario: turn 2 of multi-turn conversations,
//! pulled by P from the blocks D cached after turn 1, across clocks that
//! disagree.
//!
//! This module owns a small world of its own, because the main engines
//! ([`super::world`]) model single-turn requests only. What is **real**: D's
//! cache roles ([`kvlease::decoder_cache::DecoderCacheScheduler`] and a
//! cache rank, directives and reports as bytes), P's clock estimate
//! ([`kvlease::clock_offset::ClockOffset`], fed by the loopback handshake
//! and by `CLKPING:`/`CLKPONG:` re-samples), the turn-2 decision
//! ([`kvlease::turn2_read::decide`]), the lease verifier, the read-done
//! notifications, and the loopback fabric, whose READs copy D's words when
//! they complete. What is **modelled**: conversations (Poisson arrivals, a
//! client think time between turns), D's pool of block sets (a freed set is
//! the next one reused), and the clocks.
//!
//! The clocks: D's runs [`D_AHEAD`] ahead of P's and [`D_DRIFT_PPM`] fast
//! (the loopback network's per-agent clock offset, moved every step). Half
//! the clients come back within 0.2–0.9 × `decoder_kv_blocks_ttl`, half in
//! a stress band from 15 s before D's deadline to 5 s after it;
//! [`SLOW_READ_PERCENT`] % of READs take [`SLOW_READ`] longer, more than the
//! 5 s safety margin, so some reads that the gate rightly accepted are
//! overtaken by the TTL while in flight.
//!
//! The policies here: `lease+verify` runs the library's gate (margin plus
//! error bound, drift allowance) and verifies; `lease-noverify` the same
//! gate without verification; `fixed-480` and `fixed-30` are vLLM's rule
//! for turn 2 (`now + margin >= expiry - offset`: no error bound, no
//! verification), which does not depend on P's lease length, so the two
//! are the same run.
//!
//! The run lasts the scenario's duration (or `--duration`); `--requests N`
//! stops arrivals after N conversations.
//!
//! Counted: `arrived` conversations; `completed` turn 2s loaded with their
//! own KV; `recomputed` turn 2s declined by the gate or whose load failed;
//! `stale_reads` READs that completed after D freed the blocks;
//! `stale_caught` the stale ones verification failed; `silent_corruptions`
//! loads accepted with another conversation's KV; `verified_but_wrong`
//! (must be 0); `failed_loads`, which with verification also counts reads
//! that completed in time but whose slot check (over the same slow link)
//! came after the expiry: the check fails closed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvlease::clock_offset::ClockOffset;
use kvlease::clock_ping::{self, ClockMessage, ClockPinger};
use kvlease::consumer::{LeaseVerifier, Verdict, VerifierConfig, VerifyTarget};
use kvlease::decoder_cache::{self, DecoderCacheScheduler};
use kvlease::fabric::loopback::{LoopbackConfig, LoopbackFabric, LoopbackNetwork, ReadFaults};
use kvlease::fabric::{
    AgentId, Fabric, HandshakeState, PeerInfo, ReadDesc, RegionId, XferId, XferState,
};
use kvlease::turn2_read::{self, Turn2Read};
use kvlease::{Instant, LeaseConfig, LeaseFields, LeaseSlots, PrefillRank};

use super::error::SimError;
use super::metrics::Metrics;
use super::policy::Policy;
use super::rng::SimRng;
use super::scenario::{D_AHEAD, D_DRIFT_PPM, SLOW_READ, SLOW_READ_PERCENT};
use super::spec::{RunOutput, RunSpec};

/// Conversations per second.
const RATE: f64 = 2.0;
/// Engine step of both sides.
const STEP: Duration = Duration::from_millis(100);
/// READ latency of the link (a slow READ adds [`SLOW_READ`]).
const READ_LATENCY: Duration = Duration::from_millis(200);
/// Words per block set (one conversation's cached KV).
const SET_WORDS: usize = 8;
/// Clock re-sample interval.
const PING_EVERY: Duration = Duration::from_secs(60);

/// The tag conversation `serial` writes into its blocks (never 0).
fn tag(serial: u64) -> u64 {
    serial + 1
}

struct Conv {
    id: String,
    set: u32,
    /// D's deadline, as P reads it from the params.
    deadline: Instant,
    fields: Option<LeaseFields>,
    turn2_at: Instant,
    /// P's clock when D freed the blocks (expiry), if it did.
    freed_at: Option<Instant>,
}

struct Read {
    conv: usize,
    landing: u32,
    xfer: XferId,
    verify: Option<LeaseFields>,
}

fn words(n: usize) -> Box<[AtomicU64]> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

fn register(f: &mut LoopbackFabric, w: &[AtomicU64]) -> Result<RegionId, SimError> {
    // SAFETY: `w` is a boxed slice owned by `run`, declared before the
    // fabrics, so it outlives them (locals drop in reverse order) and never
    // moves; every Rust-side access is atomic, and a set is written only
    // after D freed it, which is exactly the reuse the scenario measures.
    unsafe { f.register_memory(w.as_ptr() as *mut u8, std::mem::size_of_val(w)) }
        .map_err(|e| SimError(format!("bidirectional-skew: register memory: {e}")))
}

fn err(what: &str) -> impl Fn(String) -> SimError + '_ {
    move |e| SimError(format!("bidirectional-skew: {what}: {e}"))
}

/// Runs the scenario under `spec.policy` for `duration` of virtual time.
pub fn run(
    spec: &RunSpec,
    config: &LeaseConfig,
    duration: Duration,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<RunOutput, SimError> {
    let verify = spec.policy == Policy::LeaseVerify;
    let library_gate = matches!(spec.policy, Policy::LeaseVerify | Policy::LeaseNoVerify);
    let ttl = config.decoder_kv_blocks_ttl();
    let mut c = config.clone();
    c.verification = verify;
    // Every conversation alive at once, with room: about RATE x TTL.
    let sets = ((RATE * ttl.as_secs_f64() * 1.5) as u32 + 64).min(1 << 20);
    c.lease_slots = sets;
    c.lease_capacity = sets;
    c.max_request_id_len = 32;

    // Memory first: it must outlive the fabrics (dropped before it).
    let kv = words(sets as usize * SET_WORDS);
    let landing = words(1024 * SET_WORDS);

    let net = LoopbackNetwork::new(LoopbackConfig {
        max_agents: 2,
        queue_capacity: 4096,
        max_reads_in_flight: 2048,
        read_latency: READ_LATENCY,
        transfer_timeout: Duration::from_secs(60),
        seed: spec.seed,
        ..LoopbackConfig::default()
    });
    let t0 = Instant::from_secs(1);
    net.advance_to(t0);
    let mut df = LoopbackFabric::join(&net, "D").map_err(|e| err("join")(e.to_string()))?;
    let mut pf = LoopbackFabric::join(&net, "P").map_err(|e| err("join")(e.to_string()))?;
    let (d_node, p_node) = (df.node(), pf.node());
    let ahead = D_AHEAD.as_nanos() as i64;
    net.set_clock_offset(d_node, ahead);
    net.set_read_faults(
        p_node,
        d_node,
        ReadFaults {
            delay_probability: f64::from(SLOW_READ_PERCENT) / 100.0,
            delay: SLOW_READ,
            ..ReadFaults::default()
        },
    );
    let d_clock = |v: Instant, t0: Instant| {
        let drift = v.saturating_duration_since(t0).as_nanos() as u64 * D_DRIFT_PPM / 1_000_000;
        v + D_AHEAD + Duration::from_nanos(drift)
    };

    // D: slots (when verifying), KV sets, the cache roles.
    let slots = Arc::new(LeaseSlots::new(c.lease_slots));
    if verify {
        df.register_slots(slots.clone(), true)
            .map_err(|e| err("register slots")(e.to_string()))?;
    }
    let kv_region = register(&mut df, &kv)?;
    let d0 = d_clock(t0, t0);
    let mut cache =
        DecoderCacheScheduler::new(&c, 1, d0).map_err(|e| err("cache")(e.to_string()))?;
    let mut rank = decoder_cache::new_cache_rank(&c, 0, slots, d0)
        .map_err(|e| err("cache rank")(e.to_string()))?;
    let mut free_sets: Vec<u32> = (0..sets).rev().collect();
    let (mut meta, mut out) = (vec![0u8; 1 << 20], vec![0u8; rank.max_reports_len()]);

    // P: landing sets, the verifier, the handshake, the clock estimate.
    let landing_region = register(&mut pf, &landing)?;
    let mut free_landing: Vec<u32> = (0..1024).rev().collect();
    let mut verifier = LeaseVerifier::new(&mut pf, &VerifierConfig::new(&c, 1024, 2))
        .map_err(|e| err("verifier")(e.to_string()))?;
    let to_d = pf
        .start_handshake("D", t0)
        .map_err(|e| err("handshake")(e.to_string()))?;
    let to_p = df
        .start_handshake("P", t0)
        .map_err(|e| err("handshake")(e.to_string()))?;
    let mut info: Option<PeerInfo> = None;
    let mut d_ready = false;
    let mut est = ClockOffset::new(c.clock_offset_config());
    let mut pinger = ClockPinger::new(spec.seed, PING_EVERY);

    let mut m = Metrics::default();
    let mut rng = SimRng::new(spec.seed, 7);
    let mut convs: Vec<Conv> = Vec::new();
    let mut next_arrival = t0 + Duration::from_secs_f64(rng.exponential(1.0 / RATE));
    let mut pending_turn2: Vec<usize> = Vec::new();
    let mut reads: Vec<Read> = Vec::new();
    let mut pongs: Vec<u64> = Vec::new();
    let end = t0 + duration;
    let mut now = t0;
    let mut last_second = 0u64;
    while now < end {
        now = now + STEP;
        net.advance_to(now);
        let drift = now.saturating_duration_since(t0).as_nanos() as u64 * D_DRIFT_PPM / 1_000_000;
        net.set_clock_offset(d_node, ahead + drift as i64);
        let dn = d_clock(now, t0);

        // Turn 1 finishes on D: cache the blocks.
        while next_arrival <= now && spec.workload.max_requests.is_none_or(|n| m.arrived < n) {
            next_arrival = next_arrival + Duration::from_secs_f64(rng.exponential(1.0 / RATE));
            m.arrived += 1;
            let serial = convs.len() as u64;
            let Some(set) = free_sets.pop() else {
                continue; // D's pool is full: not cached, turn 2 recomputes.
            };
            for w in &kv[set as usize * SET_WORDS..(set as usize + 1) * SET_WORDS] {
                w.store(tag(serial), Ordering::Release);
            }
            let id = format!("conv-{serial}");
            let kept = cache
                .keep(&id, dn)
                .map_err(|e| err("keep")(e.to_string()))?;
            // The deadline crosses the router as vLLM's float seconds.
            let deadline =
                decoder_cache::parse_expiry_time(decoder_cache::expiry_time_param(kept.expiry))
                    .map_err(|e| err("expiry")(e.to_string()))?;
            // Half the clients come back well inside the TTL, half around
            // its end (from 15 s before to 5 s after): the stress band where
            // the gate decides and slow READs straddle the expiry.
            let think = if rng.unit() < 0.5 {
                ttl.mul_f64(0.2 + 0.7 * rng.unit())
            } else {
                (ttl + Duration::from_secs(5))
                    .saturating_sub(Duration::from_secs_f64(20.0 * rng.unit()))
            };
            convs.push(Conv {
                id,
                set,
                deadline,
                fields: kept.fields,
                turn2_at: now + think,
                freed_at: None,
            });
            pending_turn2.push(convs.len() - 1);
        }

        // D's step: directives, notifications (read-dones, pings), expiry, reports.
        let n = cache
            .scheduler_mut()
            .encode_directives(dn, &mut meta)
            .map_err(|e| err("directives")(e.to_string()))?;
        rank.apply_directives(&meta[..n], dn)
            .map_err(|e| err("apply")(e.to_string()))?;
        let rank_ref: &mut PrefillRank = &mut rank;
        df.drain_notifications(&mut |from, msg| match clock_ping::decode(msg) {
            Some(Ok(ClockMessage::Ping { token })) => pongs.push(token),
            Some(_) => {}
            None => {
                let _ = rank_ref.on_notification(from, msg, dn);
            }
        })
        .map_err(|e| err("drain")(e.to_string()))?;
        if !d_ready {
            d_ready = matches!(df.handshake_state(to_p, now), HandshakeState::Ready(_));
        }
        if d_ready {
            for token in pongs.drain(..) {
                let mut buf = [0u8; clock_ping::PONG_LEN];
                if let Ok(k) = clock_ping::encode_pong(token, dn, &mut buf) {
                    let _ = df.send_notification(to_p, &buf[..k]);
                }
            }
        }
        rank.poll(dn);
        let k = rank
            .encode_reports(&mut out)
            .map_err(|e| err("reports")(e.to_string()))?;
        cache
            .scheduler_mut()
            .apply_reports(0, &out[..k])
            .map_err(|e| err("apply reports")(e.to_string()))?;
        let mut released = Vec::new();
        cache.scheduler_mut().drain_released(|rel| {
            released.push((rel.request_id.to_owned(), rel.slot));
        });
        for (id, ticket) in released {
            if let Some(i) = id
                .strip_prefix("conv-")
                .and_then(|s| s.parse::<usize>().ok())
            {
                if let Some(conv) = convs.get_mut(i) {
                    conv.freed_at = Some(now);
                    free_sets.push(conv.set);
                }
            }
            if let Some(t) = ticket {
                cache.scheduler_mut().blocks_freed(t);
            }
        }

        // P's step: handshake, pongs, pings, turn 2s, READs, verdicts.
        if info.is_none() {
            if let HandshakeState::Ready(i) = pf.handshake_state(to_d, now) {
                if let Some(sample) = i.clock {
                    est.observe(sample);
                }
                info = Some(i);
            }
        }
        let (pinger_ref, est_ref) = (&mut pinger, &mut est);
        pf.drain_notifications(&mut |_, msg| {
            if let Some(Ok(ClockMessage::Pong { token, remote })) = clock_ping::decode(msg) {
                if let Some(sample) = pinger_ref.on_pong(token, remote, now) {
                    est_ref.observe(sample);
                }
            }
        })
        .map_err(|e| err("drain")(e.to_string()))?;
        let Some(peer) = info else { continue };
        if clock_ping::peer_answers_pings(&peer) && pinger.due(now) {
            let mut buf = [0u8; clock_ping::PING_LEN];
            if let Ok(k) = pinger.ping(now, &mut buf) {
                let _ = pf.send_notification(to_d, &buf[..k]);
            }
        }
        let mut still = Vec::with_capacity(pending_turn2.len());
        for i in pending_turn2.drain(..) {
            let conv = &convs[i];
            if conv.turn2_at > now {
                still.push(i);
                continue;
            }
            let plan = if library_gate {
                turn2_read::decide(&mut est, Some(conv.deadline), conv.fields, &peer, true, now)
            } else {
                // vLLM: no error bound, no verification.
                match est.to_local(conv.deadline) {
                    Some(local) if now + c.turn2_safety_margin < local => Turn2Read::Unverified,
                    _ => Turn2Read::Decline,
                }
            };
            let verify_with = match plan {
                Turn2Read::Decline => {
                    m.recomputed += 1;
                    continue;
                }
                Turn2Read::Verified(f) => Some(f),
                Turn2Read::Unverified => None,
            };
            let Some(slot) = free_landing.pop() else {
                m.recomputed += 1;
                continue;
            };
            let descs = [ReadDesc {
                local: landing_region,
                local_offset: u64::from(slot) * (SET_WORDS * 8) as u64,
                remote: kv_region,
                remote_offset: u64::from(conv.set) * (SET_WORDS * 8) as u64,
                len: (SET_WORDS * 8) as u64,
            }];
            match pf.post_read(to_d, &descs, None, now) {
                Ok(xfer) => reads.push(Read {
                    conv: i,
                    landing: slot,
                    xfer,
                    verify: verify_with,
                }),
                Err(_) => {
                    free_landing.push(slot);
                    m.failed_loads += 1;
                    m.recomputed += 1;
                }
            }
        }
        pending_turn2 = still;

        let mut in_flight = Vec::with_capacity(reads.len());
        for r in reads.drain(..) {
            match pf.read_state(r.xfer, now) {
                XferState::InProgress => {
                    in_flight.push(r);
                    continue;
                }
                XferState::Failed(_) => {
                    free_landing.push(r.landing);
                    m.failed_loads += 1;
                    m.recomputed += 1;
                    continue;
                }
                XferState::Done => {}
            }
            let conv = &convs[r.conv];
            let base = r.landing as usize * SET_WORDS;
            let own = landing[base..base + SET_WORDS]
                .iter()
                .all(|w| w.load(Ordering::Acquire) == tag(r.conv as u64));
            let stale = conv.freed_at.is_some();
            m.stale_reads += u64::from(stale);
            free_landing.push(r.landing);
            match r.verify {
                Some(fields) => {
                    let target = VerifyTarget::from_peer(to_d, &peer);
                    if let Some(t) = target {
                        if verifier
                            .submit(
                                ((r.conv as u64) << 2) | (u64::from(stale) << 1) | u64::from(own),
                                Some(fields),
                                &[t],
                            )
                            .is_ok()
                        {
                            continue;
                        }
                    }
                    m.failed_loads += 1;
                    m.recomputed += 1;
                    m.stale_caught += u64::from(stale);
                }
                None => {
                    if own {
                        m.completed_ok += 1;
                        read_done(&mut pf, to_d, &conv.id, None);
                    } else {
                        m.completed_corrupt += 1;
                        m.silent_corruptions += 1;
                    }
                }
            }
        }
        reads = in_flight;
        let mut verdicts = Vec::new();
        verifier.step(&mut pf, now, |token, v| verdicts.push((token, v)));
        for (token, v) in verdicts {
            // Stale and own as they were when the block READ completed.
            let (i, stale, own) = ((token >> 2) as usize, token & 2 != 0, token & 1 != 0);
            let conv = &convs[i];
            if v == Verdict::Verified {
                if own {
                    m.completed_ok += 1;
                } else {
                    m.completed_corrupt += 1;
                    m.verified_but_wrong += 1;
                }
                read_done(&mut pf, to_d, &conv.id, conv.fields);
            } else {
                m.failed_loads += 1;
                m.recomputed += 1;
                m.stale_caught += u64::from(stale);
            }
        }

        let second = now.saturating_duration_since(t0).as_secs();
        if second > last_second {
            progress(second - last_second);
            last_second = second;
        }
    }
    drop(pf);
    drop(df);
    Ok(RunOutput {
        metrics: m,
        seconds: duration.as_secs_f64(),
    })
}

/// P's read-done to D: with the nonce when the turn was verified.
fn read_done(pf: &mut LoopbackFabric, to_d: AgentId, id: &str, fields: Option<LeaseFields>) {
    let mut buf = [0u8; 96];
    if let Ok(n) = kvlease::wire::encode_read_done(id, 1, fields.map(|f| f.nonce), &mut buf) {
        let _ = pf.send_notification(to_d, &buf[..n]);
    }
}
