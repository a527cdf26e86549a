//! [`ClockOffset`]: the estimate of a remote engine's monotonic clock, and
//! the turn-2 read gate that uses it.
//!
//! This module owns the arithmetic of comparing an instant on *another*
//! process's clock with our own: folding clock samples (from the handshake,
//! [`crate::fabric::ClockSample`], or from a later ping/pong,
//! [`crate::clock_ping`]) into one offset with an error bound, widening that
//! bound as the sample ages, and deciding whether a read of blocks that the
//! remote holds until a deadline on *its* clock may still start. It reads no
//! clock (callers pass `now`), sends nothing, allocates nothing, and knows
//! nothing about requests or blocks beyond the one deadline it is asked about.
//!
//! # Why
//!
//! In bidirectional mode D keeps a finished turn's KV blocks for
//! `decoder_kv_blocks_ttl` and exports the deadline as
//! `remote_blocks_expiry_time` *on D's monotonic clock*. P's monotonic clock
//! has another origin (another process, maybe another host), so P must
//! translate before it compares, and must know how wrong the translation
//! can be.
//!
//! # The estimate
//!
//! A sample is (our send, the remote's reading, our receive). The remote read
//! its clock somewhere between our send and our receive, so
//!
//! ```text
//! offset = remote - (send + recv) / 2        (remote clock minus ours)
//! bound  = (recv - send) / 2                 (|true offset - offset| <= bound)
//! ```
//!
//! whatever the split of the round trip between the two directions: an
//! asymmetric route moves the estimate but never outside the bound. We keep
//! the one sample whose bound is tightest **now**, and replace it when a
//! better one arrives. A sample does not stay good forever: the two clocks
//! drift apart (quartz: tens of ppm), so once a sample is older than
//! [`ClockOffsetConfig::drift_free_age`] its bound grows by
//! [`ClockOffsetConfig::drift_ppm`] of its age. A fresh sample with a wider
//! round trip therefore eventually beats an old narrow one, which is what
//! "keep the smallest round trip" means once drift is honest.
//!
//! # The gate
//!
//! ```text
//! local deadline = remote deadline - offset
//! read iff  now + safety_margin + bound  <  local deadline
//! ```
//!
//! `safety_margin` is vLLM's `_KV_BLOCKS_EXPIRY_SAFETY_MARGIN` (5 s): it
//! covers the read itself and the step between this check and the READ. A
//! declined read is a recompute, never a failure of the request: the caller
//! treats it as a KV load that did not happen. With no sample at all the
//! deadline cannot be compared and the read is declined (counted apart);
//! with no deadline (a router dropped `remote_blocks_expiry_time`) the read
//! goes ahead as vLLM's does, and should be verified.
//!
//! ```
//! use core::time::Duration;
//! use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig, ReadGate};
//! use kvlease::fabric::ClockSample;
//! use kvlease::Instant;
//!
//! let mut est = ClockOffset::new(ClockOffsetConfig::default());
//! // D's clock is 1000 s ahead; 2 ms round trip.
//! est.observe(ClockSample {
//!     local_send: Instant::from_millis(10_000),
//!     remote: Instant::from_millis(1_010_001),
//!     local_recv: Instant::from_millis(10_002),
//! });
//! let now = Instant::from_millis(10_002);
//! let deadline_on_d = Instant::from_secs(1_010 + 480); // exported by D
//! assert_eq!(est.check_read(Some(deadline_on_d), now), ReadGate::Read);
//! let almost_over = Instant::from_secs(1_010 + 4); // 4 s left < 5 s margin
//! assert_eq!(est.check_read(Some(almost_over), now), ReadGate::Decline);
//! assert_eq!(est.counters().declined, 1);
//! # let _ = Duration::ZERO;
//! ```

use core::time::Duration;

use crate::fabric::ClockSample;
use crate::time::{duration_nanos, Instant};

/// Settings of one estimator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockOffsetConfig {
    /// Declined unless the read starts this long before the deadline (plus
    /// the bound). vLLM: 5 s.
    pub safety_margin: Duration,
    /// How fast the two clocks may drift apart, in parts per million of a
    /// sample's age. 100 ppm is twice a cheap crystal's tolerance.
    pub drift_ppm: u32,
    /// A sample younger than this is trusted at its round-trip bound; past it
    /// the bound grows by `drift_ppm` of the whole age. Zero (the default)
    /// widens from the start, which is the honest bound.
    pub drift_free_age: Duration,
}

impl Default for ClockOffsetConfig {
    fn default() -> Self {
        ClockOffsetConfig {
            safety_margin: Duration::from_secs(5),
            drift_ppm: 100,
            drift_free_age: Duration::ZERO,
        }
    }
}

/// What the estimator did, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClockOffsetCounters {
    /// Samples offered.
    pub samples: u64,
    /// Samples that became the estimate (the first one included).
    pub adopted: u64,
    /// Samples refused as impossible (received before sent).
    pub refused: u64,
    /// Reads let through.
    pub allowed: u64,
    /// Reads declined because the deadline is too close (recompute).
    pub declined: u64,
    /// Reads declined because no sample was ever taken (recompute).
    pub declined_no_sample: u64,
    /// Reads with no deadline (let through, as vLLM does).
    pub no_deadline: u64,
}

/// What [`ClockOffset::observe`] did with a sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleOutcome {
    /// It is the estimate now.
    Adopted,
    /// The current estimate is at least as tight; kept.
    Kept,
    /// Received before it was sent: not a sample of this clock. Counted.
    Refused,
}

/// The verdict on one turn-2 read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadGate {
    /// Start the read.
    Read,
    /// Too close to (or past) the remote deadline in the worst case:
    /// recompute instead.
    Decline,
    /// No clock sample yet: the deadline cannot be compared. Recompute.
    NoSample,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Best {
    /// remote - local, in ns.
    offset_ns: i128,
    /// Half the round trip, in ns.
    half_rtt_ns: u64,
    /// Our clock at the sample's receive.
    taken_at: Instant,
}

/// The offset to one remote clock. See the module docs.
#[derive(Clone, Debug)]
pub struct ClockOffset {
    config: ClockOffsetConfig,
    margin_ns: u64,
    drift_free_ns: u64,
    best: Option<Best>,
    counters: ClockOffsetCounters,
}

impl ClockOffset {
    /// An estimator with no sample.
    pub fn new(config: ClockOffsetConfig) -> ClockOffset {
        ClockOffset {
            margin_ns: duration_nanos(config.safety_margin),
            drift_free_ns: duration_nanos(config.drift_free_age),
            config,
            best: None,
            counters: ClockOffsetCounters::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &ClockOffsetConfig {
        &self.config
    }

    /// What it did so far.
    pub fn counters(&self) -> ClockOffsetCounters {
        self.counters
    }

    /// Whether any sample was adopted.
    pub fn has_sample(&self) -> bool {
        self.best.is_some()
    }

    /// Folds one sample in: it becomes the estimate when its bound (at its
    /// own receive time, so fresh) is no wider than the current estimate's
    /// bound at that time (aged). Ties go to the newer sample.
    pub fn observe(&mut self, sample: ClockSample) -> SampleOutcome {
        self.counters.samples += 1;
        if sample.local_recv < sample.local_send {
            self.counters.refused += 1;
            return SampleOutcome::Refused;
        }
        let (send, recv) = (sample.local_send.as_nanos(), sample.local_recv.as_nanos());
        // Round up: the bound must never be narrower than the truth.
        let half_rtt_ns = (recv - send).div_ceil(2);
        // remote - (send + recv) / 2, doubled first so that it is exact up
        // to the final halving; the shift floors (a constant i128 division
        // would be a libcall on the hot path), which moves the estimate by
        // under 1 ns, inside the rounded-up bound.
        let offset_ns =
            (2 * i128::from(sample.remote.as_nanos()) - i128::from(send) - i128::from(recv)) >> 1;
        let candidate = Best {
            offset_ns,
            half_rtt_ns,
            taken_at: sample.local_recv,
        };
        let adopt = match self.best {
            None => true,
            Some(best) => half_rtt_ns <= self.bound_of(best, sample.local_recv),
        };
        if adopt {
            self.best = Some(candidate);
            self.counters.adopted += 1;
            SampleOutcome::Adopted
        } else {
            SampleOutcome::Kept
        }
    }

    /// Forgets the estimate (the remote restarted: its clock has a new origin).
    pub fn reset(&mut self) {
        self.best = None;
    }

    /// The estimated offset (remote minus local, ns), if any sample was taken.
    pub fn offset_nanos(&self) -> Option<i128> {
        self.best.map(|b| b.offset_ns)
    }

    /// The error bound of the estimate at `now`: half the sample's round
    /// trip, widened for its age. `None` without a sample.
    pub fn bound(&self, now: Instant) -> Option<Duration> {
        self.best
            .map(|b| Duration::from_nanos(self.bound_of(b, now)))
    }

    fn bound_of(&self, b: Best, now: Instant) -> u64 {
        let age = now.as_nanos().saturating_sub(b.taken_at.as_nanos());
        let ppm = u64::from(self.config.drift_ppm);
        let drift = if age <= self.drift_free_ns {
            0
        } else if let Some(scaled) = age.checked_mul(ppm) {
            // ppm of the age, rounded up; a constant u64 division is a multiply.
            scaled.div_ceil(1_000_000)
        } else {
            // Ages past ~5 years at 100 ppm: round the age up first instead
            // (never narrower than the exact figure), saturating.
            age.div_ceil(1_000_000).saturating_mul(ppm)
        };
        b.half_rtt_ns.saturating_add(drift)
    }

    /// A remote instant translated to our clock (the estimate, not the worst
    /// case); saturates at our clock's ends. `None` without a sample.
    pub fn to_local(&self, remote: Instant) -> Option<Instant> {
        self.best
            .map(|b| clamp_instant(i128::from(remote.as_nanos()) - b.offset_ns))
    }

    /// Whether a read of blocks the remote holds until `remote_deadline` (on
    /// its clock) may start at `now`, and counts the verdict. See the module
    /// docs for the rule; `None` (no deadline exported) reads.
    pub fn check_read(&mut self, remote_deadline: Option<Instant>, now: Instant) -> ReadGate {
        let verdict = self.gate(remote_deadline, now);
        match (verdict, remote_deadline) {
            (ReadGate::Read, None) => self.counters.no_deadline += 1,
            (ReadGate::Read, Some(_)) => self.counters.allowed += 1,
            (ReadGate::Decline, _) => self.counters.declined += 1,
            (ReadGate::NoSample, _) => self.counters.declined_no_sample += 1,
        }
        verdict
    }

    /// [`ClockOffset::check_read`] without counting.
    pub fn gate(&self, remote_deadline: Option<Instant>, now: Instant) -> ReadGate {
        let Some(deadline) = remote_deadline else {
            return ReadGate::Read;
        };
        let Some(best) = self.best else {
            return ReadGate::NoSample;
        };
        let local_deadline = i128::from(deadline.as_nanos()) - best.offset_ns;
        let latest_start =
            local_deadline - i128::from(self.margin_ns) - i128::from(self.bound_of(best, now));
        if i128::from(now.as_nanos()) < latest_start {
            ReadGate::Read
        } else {
            ReadGate::Decline
        }
    }
}

fn clamp_instant(ns: i128) -> Instant {
    Instant::from_nanos(u64::try_from(ns.max(0)).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(send_ms: u64, remote_ms: u64, recv_ms: u64) -> ClockSample {
        ClockSample {
            local_send: Instant::from_millis(send_ms),
            remote: Instant::from_millis(remote_ms),
            local_recv: Instant::from_millis(recv_ms),
        }
    }

    #[test]
    fn offset_and_bound_from_one_sample() {
        let mut e = ClockOffset::new(ClockOffsetConfig::default());
        assert_eq!(e.observe(sample(100, 5_101, 102)), SampleOutcome::Adopted);
        assert_eq!(e.offset_nanos(), Some(5_000_000_000));
        assert_eq!(
            e.bound(Instant::from_millis(102)),
            Some(Duration::from_millis(1))
        );
        assert_eq!(
            e.to_local(Instant::from_millis(6_000)),
            Some(Instant::from_millis(1_000))
        );
    }

    #[test]
    fn remote_behind_gives_a_negative_offset() {
        let mut e = ClockOffset::new(ClockOffsetConfig::default());
        e.observe(sample(50_000, 1_001, 50_002));
        assert_eq!(e.offset_nanos(), Some(-49_000_000_000));
        // Translating an instant from before our origin saturates at zero.
        assert_eq!(e.to_local(Instant::ZERO), Some(Instant::from_secs(49)));
        assert_eq!(
            e.to_local(Instant::from_secs(1)),
            Some(Instant::from_secs(50))
        );
    }

    #[test]
    fn keeps_the_tighter_sample_and_refuses_impossible_ones() {
        let mut e = ClockOffset::new(ClockOffsetConfig {
            drift_ppm: 0,
            ..ClockOffsetConfig::default()
        });
        e.observe(sample(0, 1_000, 10));
        assert_eq!(e.observe(sample(20, 1_030, 40)), SampleOutcome::Kept);
        assert_eq!(e.observe(sample(50, 1_051, 52)), SampleOutcome::Adopted);
        assert_eq!(e.offset_nanos(), Some(1_000_000_000));
        assert_eq!(e.observe(sample(60, 1_000, 59)), SampleOutcome::Refused);
        let c = e.counters();
        assert_eq!((c.samples, c.adopted, c.refused), (4, 2, 1));
    }

    #[test]
    fn an_old_sample_widens_and_loses_to_a_fresh_wider_one() {
        let mut e = ClockOffset::new(ClockOffsetConfig {
            drift_ppm: 100,
            drift_free_age: Duration::from_secs(10),
            ..ClockOffsetConfig::default()
        });
        e.observe(sample(0, 1_000, 2)); // bound 1 ms
                                        // Inside the drift-free age: unchanged.
        assert_eq!(
            e.bound(Instant::from_secs(10)),
            Some(Duration::from_millis(1))
        );
        // 100 s later: 1 ms + 100 ppm of 100 s = 11 ms.
        assert_eq!(
            e.bound(Instant::from_millis(100_002)),
            Some(Duration::from_millis(11))
        );
        // A 20 ms round trip (10 ms bound) now beats it.
        assert_eq!(
            e.observe(sample(100_000, 101_010, 100_020)),
            SampleOutcome::Adopted
        );
    }

    #[test]
    fn gate_without_sample_or_deadline() {
        let mut e = ClockOffset::new(ClockOffsetConfig::default());
        assert_eq!(
            e.check_read(Some(Instant::MAX), Instant::ZERO),
            ReadGate::NoSample
        );
        assert_eq!(e.check_read(None, Instant::ZERO), ReadGate::Read);
        assert_eq!(e.counters().declined_no_sample, 1);
        assert_eq!(e.counters().no_deadline, 1);
    }

    #[test]
    fn extreme_values_saturate_instead_of_overflowing() {
        let mut e = ClockOffset::new(ClockOffsetConfig {
            drift_ppm: u32::MAX,
            safety_margin: Duration::MAX,
            drift_free_age: Duration::ZERO,
        });
        e.observe(ClockSample {
            local_send: Instant::ZERO,
            remote: Instant::MAX,
            local_recv: Instant::MAX,
        });
        assert_eq!(e.gate(Some(Instant::MAX), Instant::MAX), ReadGate::Decline);
        assert!(e.bound(Instant::MAX).is_some());
        assert!(e.to_local(Instant::ZERO).is_some());
    }
}
