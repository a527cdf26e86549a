//! What a run measured, and the report of one (scenario, policy) run.
//!
//! This module owns the counters and their definitions. Every number in a
//! report is computed here from events the run produced; none is typed in.
//!
//! - **dead-block-seconds**: after a D crash, the integral over time of the
//!   P blocks held for requests of the dead D, until P frees them.
//! - **reclaim**: from the crash until P freed the last of those blocks;
//!   `reclaim_renewed` the same over the requests whose lease heartbeats
//!   had carried past its initial length: tracked by D for at least one
//!   heartbeat interval and granted at least `kv_lease_duration -
//!   extension` before the crash. The protocol bounds the first by
//!   max(kv_lease_duration, extension + interval) and the second by
//!   extension + interval (plus one engine step).
//! - **premature frees**: P freed a request's blocks while its D (alive)
//!   still had to read them; `mid_read` those freed while the READ ran.
//! - **stale reads**: D's block READ completed after P had freed the blocks;
//!   **caught** those whose load verification failed; **silent
//!   corruptions** loads D accepted whose KV words were not the request's
//!   (P had reused the blocks); **verified but wrong** loads that passed
//!   verification with wrong words (must be 0: it would be a library bug).
//! - **D wait**: from a request's arrival in D's queue until D schedules
//!   its load (or, unleased, its own prefill): how long P's blocks wait for
//!   D in the best case; a lease must outlast it when heartbeats stop.
//! - **latency**: from a request's arrival at the router until its last
//!   token (completed requests only; a recomputed prefill is in it).
//! - **goodput**: requests completed with their own KV, per second.
//! - **lease CPU per step**: wall time of the kvlease calls in one engine
//!   step (measured with `std::time::Instant`, the one clock the simulator
//!   reads); never in the JSON unless asked, since it varies run to run.

use serde::Serialize;

/// Counters of one run.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    /// Requests that arrived.
    pub arrived: u64,
    /// Requests completed with their own KV.
    pub completed_ok: u64,
    /// Requests completed on someone else's KV.
    pub completed_corrupt: u64,
    /// Requests lost to a D crash (or with no D alive).
    pub lost: u64,
    /// Requests neither completed nor lost when the run ended.
    pub in_flight_at_end: u64,
    /// Dead-block-seconds (see the module docs).
    pub dead_block_seconds: f64,
    /// Dead blocks still held when the run ended.
    pub dead_blocks_at_end: u64,
    /// Seconds from the crash to the last dead block freed.
    pub reclaim_s: Option<f64>,
    /// The same, over requests D had renewed.
    pub reclaim_renewed_s: Option<f64>,
    /// Requests orphaned by a crash while P held their blocks.
    pub orphaned: u64,
    /// Most P blocks held at once, fleet-wide.
    pub peak_blocks_held: u64,
    /// Most blocks one P engine held at once.
    pub peak_engine_blocks_held: u64,
    /// P blocks held now, fleet-wide.
    pub blocks_held: u64,
    /// Premature frees.
    pub premature_frees: u64,
    /// Premature frees while D's READ ran.
    pub mid_read_frees: u64,
    /// Stale reads.
    pub stale_reads: u64,
    /// Stale reads whose load verification failed.
    pub stale_caught: u64,
    /// Accepted loads with wrong KV.
    pub silent_corruptions: u64,
    /// Verified loads with wrong KV (a library bug if ever non-zero).
    pub verified_but_wrong: u64,
    /// KV loads that failed (any verdict but verified, or a failed READ).
    pub failed_loads: u64,
    /// Failed because the lease carried no slot (or no lease fields).
    pub unverifiable: u64,
    /// Prefills D recomputed itself after a failed load.
    pub recomputed: u64,
    /// Leases granted without a slot (P's scheduler counters).
    pub granted_without_slot: u64,
    /// Heartbeat messages D's workers sent.
    pub heartbeat_messages: u64,
    /// Lease renewals P's ranks applied.
    pub renewals: u64,
    /// Blocks held, one sample per second.
    pub held_series: Vec<u64>,
    /// Every D wait, seconds (see the module docs).
    pub d_waits_s: Vec<f64>,
    /// Every completed request's latency, seconds (see the module docs).
    pub latencies_s: Vec<f64>,
    /// Wall nanoseconds in kvlease calls on P engine steps.
    pub p_lease_ns: u64,
    /// P engine steps.
    pub p_steps: u64,
    /// The longest P step (a P engine sees an expiry at its next step).
    pub longest_p_step: std::time::Duration,
    /// Wall nanoseconds in kvlease calls on D engine steps.
    pub d_lease_ns: u64,
    /// D engine steps.
    pub d_steps: u64,
    /// The `push-faults` scenario's own figures.
    pub push: Option<PushFigures>,
}

/// What the `push-faults` scenario measured ([`super::push`]).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct PushFigures {
    /// Pushes still waiting for P at the end, longer than
    /// [`super::push::HANG_AFTER`].
    pub hung: u64,
    /// Block sets those hold (never freed).
    pub leaked_sets: u64,
    /// WRITEs of P that landed in a set after D freed it.
    pub stray_writes: u64,
    /// 1 once P died.
    pub p_deaths: u64,
    /// Pushes waiting for the dead P (or aborted, set still held) when it died.
    pub outstanding_at_p_death: u64,
    /// From P's death until D freed the last of those sets, seconds (None:
    /// some were still held at the end, or none was outstanding).
    pub reclaim_after_p_death_s: Option<f64>,
    /// The guard's bound on that reclaim, seconds: max(duration, extension +
    /// interval) + write_bound, with the drift allowance (None: no guard).
    pub bound_s: Option<f64>,
    /// D's permit renewals on P's `PHB:` (guard only).
    pub permit_renewals: u64,
    /// Permits ended at the fence without P's word (guard only).
    pub permits_lapsed: u64,
    /// Registrations P refused at once (guard only).
    pub permits_refused: u64,
}

impl Metrics {
    /// P blocks changed by `delta` (allocation positive, free negative).
    pub fn held_delta(&mut self, delta: i64) {
        self.blocks_held = self.blocks_held.saturating_add_signed(delta);
        self.peak_blocks_held = self.peak_blocks_held.max(self.blocks_held);
    }
}

/// The report of one run (what `--json` prints, per scenario and policy).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RunReport {
    /// The policy.
    pub policy: String,
    /// Virtual seconds simulated.
    pub seconds: f64,
    /// Requests that arrived.
    pub arrived: u64,
    /// Requests completed with their own KV.
    pub completed: u64,
    /// Completed requests per second (own KV only).
    pub goodput_rps: f64,
    /// Requests lost to a crash.
    pub lost: u64,
    /// Requests neither completed (own KV or not) nor lost when the run
    /// ended: arrived = completed + silent corruptions' completions + lost +
    /// in flight.
    pub in_flight_at_end: u64,
    /// Requests completed on another request's KV.
    pub completed_corrupt: u64,
    /// Dead-block-seconds after a crash.
    pub dead_block_seconds: f64,
    /// Dead blocks still held at the end.
    pub dead_blocks_at_end: u64,
    /// Crash to the last dead block freed, seconds (None: no crash, or not
    /// all freed by the end).
    pub reclaim_s: Option<f64>,
    /// The same over requests D had renewed.
    pub reclaim_renewed_s: Option<f64>,
    /// Requests orphaned by a crash.
    pub orphaned: u64,
    /// Peak P blocks held, fleet-wide.
    pub peak_blocks_held: u64,
    /// Peak blocks held by one P engine.
    pub peak_engine_blocks_held: u64,
    /// Premature frees (recomputed prefills or corrupt reads follow).
    pub premature_frees: u64,
    /// Premature frees during D's READ.
    pub mid_read_frees: u64,
    /// Stale reads.
    pub stale_reads: u64,
    /// Stale reads caught by verification.
    pub stale_caught: u64,
    /// Silent corruptions (reused blocks accepted).
    pub silent_corruptions: u64,
    /// Verified loads with wrong KV (0, or the library is wrong).
    pub verified_but_wrong: u64,
    /// Failed KV loads.
    pub failed_loads: u64,
    /// Failed for want of lease fields (no slot).
    pub unverifiable: u64,
    /// Prefills recomputed on D.
    pub recomputed: u64,
    /// The 99th percentile of D waits, seconds (None: no request reached D).
    pub d_wait_p99_s: Option<f64>,
    /// The longest D wait, seconds.
    pub d_wait_max_s: Option<f64>,
    /// The longest P engine step, seconds: an expiry is noticed at the end
    /// of the step it falls in, so reclaim bounds carry this much slack.
    pub longest_p_step_s: f64,
    /// Median latency of completed requests, seconds.
    pub latency_p50_s: Option<f64>,
    /// 99th percentile latency of completed requests, seconds.
    pub latency_p99_s: Option<f64>,
    /// Leases granted without a slot.
    pub granted_without_slot: u64,
    /// Heartbeat messages sent.
    pub heartbeat_messages: u64,
    /// Renewals applied on P.
    pub renewals: u64,
    /// The `push-faults` scenario's figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub push: Option<PushFigures>,
    /// Measured lease CPU (only with `--json-timings`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// Measured CPU of the lease machinery.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Timings {
    /// Mean microseconds of kvlease calls per P engine step.
    pub p_us_per_step: f64,
    /// P engine steps.
    pub p_steps: u64,
    /// Mean microseconds of kvlease calls per D engine step.
    pub d_us_per_step: f64,
    /// D engine steps.
    pub d_steps: u64,
}

impl Metrics {
    /// The report of this run under `policy`, over `seconds` of virtual time.
    pub fn report(&self, policy: &str, seconds: f64) -> RunReport {
        let round = |x: f64| (x * 1000.0).round() / 1000.0;
        RunReport {
            policy: policy.to_string(),
            seconds: round(seconds),
            arrived: self.arrived,
            completed: self.completed_ok,
            goodput_rps: round(self.completed_ok as f64 / seconds.max(1e-9)),
            lost: self.lost,
            in_flight_at_end: self.in_flight_at_end,
            completed_corrupt: self.completed_corrupt,
            dead_block_seconds: round(self.dead_block_seconds),
            dead_blocks_at_end: self.dead_blocks_at_end,
            reclaim_s: self.reclaim_s.map(round),
            reclaim_renewed_s: self.reclaim_renewed_s.map(round),
            orphaned: self.orphaned,
            peak_blocks_held: self.peak_blocks_held,
            peak_engine_blocks_held: self.peak_engine_blocks_held,
            premature_frees: self.premature_frees,
            mid_read_frees: self.mid_read_frees,
            stale_reads: self.stale_reads,
            stale_caught: self.stale_caught,
            silent_corruptions: self.silent_corruptions,
            verified_but_wrong: self.verified_but_wrong,
            failed_loads: self.failed_loads,
            unverifiable: self.unverifiable,
            recomputed: self.recomputed,
            d_wait_p99_s: quantile(&self.d_waits_s, 0.99).map(round),
            d_wait_max_s: quantile(&self.d_waits_s, 1.0).map(round),
            longest_p_step_s: round(self.longest_p_step.as_secs_f64()),
            latency_p50_s: quantile(&self.latencies_s, 0.5).map(round),
            latency_p99_s: quantile(&self.latencies_s, 0.99).map(round),
            granted_without_slot: self.granted_without_slot,
            heartbeat_messages: self.heartbeat_messages,
            renewals: self.renewals,
            push: self.push.clone().map(|mut f| {
                f.reclaim_after_p_death_s = f.reclaim_after_p_death_s.map(round);
                f.bound_s = f.bound_s.map(round);
                f
            }),
            timings: None,
        }
    }

    /// The measured lease CPU.
    pub fn timings(&self) -> Timings {
        let per = |ns: u64, steps: u64| {
            if steps == 0 {
                0.0
            } else {
                ns as f64 / steps as f64 / 1000.0
            }
        };
        Timings {
            p_us_per_step: per(self.p_lease_ns, self.p_steps),
            p_steps: self.p_steps,
            d_us_per_step: per(self.d_lease_ns, self.d_steps),
            d_steps: self.d_steps,
        }
    }
}

/// The `q` quantile of `xs` (nearest rank); `None` if empty.
fn quantile(xs: &[f64], q: f64) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// Adds the wall time of `f` to `acc`: the lease-CPU meter, wrapped around
/// kvlease calls only.
#[inline]
pub fn timed<R>(acc: &mut u64, f: impl FnOnce() -> R) -> R {
    let start = std::time::Instant::now();
    let r = f();
    *acc += start.elapsed().as_nanos() as u64;
    r
}
