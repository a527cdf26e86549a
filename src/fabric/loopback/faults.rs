//! Fault injection for the loopback fabric: the settings a test or the
//! simulator asks for, where they are stored, and the seeded draws that
//! decide each notification's and each READ's fate.
//!
//! This module owns the fault *policy* only. It never touches queues,
//! memory or handshakes: the fabric asks it "what happens to this message /
//! this READ?" and acts on the answer.
//!
//! # Determinism
//!
//! A fate is a pure function of (network seed, kind, sender, receiver,
//! per-link sequence number) and the link's current settings: a counter-based
//! SplitMix64 stream, not one shared generator. The sequence number is counted
//! by the sending fabric per destination, so the same seed gives the same
//! fates on every link even when agents run on different threads and their
//! calls interleave differently. Each decision always consumes the same draws
//! whatever the settings, so turning one fault on does not reshuffle the
//! others.
//!
//! # Storage
//!
//! Settings live in atomics (one [`LinkCell`] per directed pair of agents;
//! crashes are `liveness`'s) so that the controlling thread can change them
//! while agents run, without locks and without allocation. A group of
//! settings is not changed atomically as a whole; change faults between steps
//! when that matters.

use core::time::Duration;

use crate::fabric::FabricError;
use crate::rng::SplitMix64;
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::time::duration_nanos;

/// The error a READ fails with when [`ReadFaults::fail_probability`] or
/// `fail_next_reads` hits, unless [`ReadFaults::fail_with`] says otherwise.
pub const INJECTED_READ_FAILURE: FabricError = FabricError::Backend(-1);

/// Notification faults on a directed link. Probabilities are in `[0, 1]`
/// (clamped; NaN counts as 0). A message is dropped, or else delayed, or
/// else reordered: at most one of them applies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NotificationFaults {
    /// Chance that a message is silently lost (the send still returns Ok).
    pub drop_probability: f64,
    /// Chance that a message is held back for [`NotificationFaults::delay`].
    pub delay_probability: f64,
    /// How long a delayed message waits: it is delivered by the first drain
    /// at or after (network time at send) + `delay`.
    pub delay: Duration,
    /// Chance that a message is overtaken by the next message the receiver
    /// gets (from anyone): it is delivered right after that one.
    pub reorder_probability: f64,
    /// A reordered message that no later message overtakes is delivered at
    /// send + `reorder_max_hold` anyway.
    pub reorder_max_hold: Duration,
}

impl Default for NotificationFaults {
    /// No faults.
    fn default() -> Self {
        NotificationFaults {
            drop_probability: 0.0,
            delay_probability: 0.0,
            delay: Duration::ZERO,
            reorder_probability: 0.0,
            reorder_max_hold: Duration::from_secs(1),
        }
    }
}

/// READ faults on a directed link (reader -> remote).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReadFaults {
    /// Chance that a READ takes [`ReadFaults::delay`] longer than the
    /// network's READ latency.
    pub delay_probability: f64,
    /// Extra latency of a delayed READ.
    pub delay: Duration,
    /// Chance that a READ fails (when it would have completed) with
    /// [`ReadFaults::fail_with`]; nothing is copied, no notification sent.
    pub fail_probability: f64,
    /// The error an injected failure reports.
    pub fail_with: FabricError,
}

impl Default for ReadFaults {
    /// No faults.
    fn default() -> Self {
        ReadFaults {
            delay_probability: 0.0,
            delay: Duration::ZERO,
            fail_probability: 0.0,
            fail_with: INJECTED_READ_FAILURE,
        }
    }
}

/// What happens to one notification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotificationFate {
    /// Lost.
    Drop,
    /// Delivered normally.
    Deliver,
    /// Delivered no earlier than this many ns after the send.
    Delay(u64),
    /// Overtaken by the next delivered message; at the latest after this
    /// many ns.
    Reorder(u64),
}

/// What happens to one READ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReadFate {
    /// Added to the network's READ latency.
    pub(crate) extra_ns: u64,
    /// Fails with this error when it would have completed.
    pub(crate) fail: Option<FabricError>,
}

/// Draw kinds, mixed into the stream key so notification and READ draws on
/// the same link are independent.
const KIND_NOTIFICATION: u64 = 1;
const KIND_READ: u64 = 2;

/// A keyed fault stream: independent per (seed, kind, link, sequence).
fn stream(seed: u64, kind: u64, from: u32, to: u32, seq: u64) -> SplitMix64 {
    SplitMix64::new(seed)
        .absorb(kind)
        .absorb(u64::from(from) << 32 | u64::from(to))
        .absorb(seq)
}

/// A probability as a threshold on a uniform u64 draw; `u64::MAX` = always.
fn threshold(p: f64) -> u64 {
    if p.is_nan() || p <= 0.0 {
        0
    } else if p >= 1.0 {
        u64::MAX
    } else {
        // p * 2^64 < 2^64 here; the cast saturates anyway.
        (p * 18_446_744_073_709_551_616.0) as u64
    }
}

fn hit(threshold: u64, draw: u64) -> bool {
    threshold == u64::MAX || draw < threshold
}

/// Decrements a "next N" counter; true when it was positive.
fn take_one(counter: &AtomicU32) -> bool {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
        .is_ok()
}

/// A `FabricError` in one word, so `fail_with` fits an atomic: its code in
/// the low byte, the backend status in the high half.
fn encode_error(e: FabricError) -> u64 {
    let (code, backend) = e.code();
    u64::from(backend as u32) << 32 | u64::from(code)
}

fn decode_error(word: u64) -> FabricError {
    let backend = (word >> 32) as u32 as i32;
    // Every stored word came from `encode_error`; the fallback is unreachable.
    FabricError::from_code(word as u8, backend).unwrap_or(FabricError::Backend(backend))
}

/// The fault settings of one directed link (`from` -> `to`).
#[derive(Debug)]
pub(crate) struct LinkCell {
    /// Non-zero while the pair is partitioned (set on both directions).
    partitioned: AtomicU32,
    drop_next: AtomicU32,
    drop_threshold: AtomicU64,
    delay_threshold: AtomicU64,
    delay_ns: AtomicU64,
    reorder_threshold: AtomicU64,
    reorder_hold_ns: AtomicU64,
    read_delay_threshold: AtomicU64,
    read_delay_ns: AtomicU64,
    read_fail_threshold: AtomicU64,
    read_fail_next: AtomicU32,
    read_fail_error: AtomicU64,
}

impl LinkCell {
    pub(crate) fn new() -> LinkCell {
        LinkCell {
            partitioned: AtomicU32::new(0),
            drop_next: AtomicU32::new(0),
            drop_threshold: AtomicU64::new(0),
            delay_threshold: AtomicU64::new(0),
            delay_ns: AtomicU64::new(0),
            reorder_threshold: AtomicU64::new(0),
            reorder_hold_ns: AtomicU64::new(0),
            read_delay_threshold: AtomicU64::new(0),
            read_delay_ns: AtomicU64::new(0),
            read_fail_threshold: AtomicU64::new(0),
            read_fail_next: AtomicU32::new(0),
            read_fail_error: AtomicU64::new(encode_error(INJECTED_READ_FAILURE)),
        }
    }

    pub(crate) fn set_partitioned(&self, on: bool) {
        self.partitioned.store(u32::from(on), Ordering::Release);
    }

    pub(crate) fn is_partitioned(&self) -> bool {
        self.partitioned.load(Ordering::Acquire) != 0
    }

    pub(crate) fn set_notification_faults(&self, f: &NotificationFaults) {
        let r = Ordering::Relaxed;
        self.drop_threshold.store(threshold(f.drop_probability), r);
        self.delay_threshold
            .store(threshold(f.delay_probability), r);
        self.delay_ns.store(duration_nanos(f.delay), r);
        self.reorder_threshold
            .store(threshold(f.reorder_probability), r);
        self.reorder_hold_ns
            .store(duration_nanos(f.reorder_max_hold), r);
    }

    pub(crate) fn add_drop_next(&self, n: u32) {
        // Saturate rather than wrap: "drop the next u32::MAX" is "drop all".
        let _ = self
            .drop_next
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                Some(c.saturating_add(n))
            });
    }

    pub(crate) fn set_read_faults(&self, f: &ReadFaults) {
        let r = Ordering::Relaxed;
        self.read_delay_threshold
            .store(threshold(f.delay_probability), r);
        self.read_delay_ns.store(duration_nanos(f.delay), r);
        self.read_fail_threshold
            .store(threshold(f.fail_probability), r);
        self.read_fail_error.store(encode_error(f.fail_with), r);
    }

    pub(crate) fn add_fail_next_reads(&self, n: u32) {
        let _ = self
            .read_fail_next
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                Some(c.saturating_add(n))
            });
    }

    /// Back to no faults (and not partitioned).
    pub(crate) fn clear(&self) {
        self.set_notification_faults(&NotificationFaults::default());
        self.set_read_faults(&ReadFaults::default());
        self.drop_next.store(0, Ordering::Release);
        self.read_fail_next.store(0, Ordering::Release);
        self.set_partitioned(false);
    }

    /// The fate of the `seq`-th notification from `from` to `to`.
    pub(crate) fn notification_fate(
        &self,
        seed: u64,
        from: u32,
        to: u32,
        seq: u64,
    ) -> NotificationFate {
        let r = Ordering::Relaxed;
        let (drop_t, delay_t, reorder_t) = (
            self.drop_threshold.load(r),
            self.delay_threshold.load(r),
            self.reorder_threshold.load(r),
        );
        if take_one(&self.drop_next) {
            return NotificationFate::Drop;
        }
        if drop_t | delay_t | reorder_t == 0 {
            // No fault can hit: skip the hash. Draws are keyed by sequence
            // number, so skipping them shifts no other message's fate.
            return NotificationFate::Deliver;
        }
        let mut rng = stream(seed, KIND_NOTIFICATION, from, to, seq);
        // Always three draws, see the module docs.
        let (d_drop, d_delay, d_reorder) = (rng.next_u64(), rng.next_u64(), rng.next_u64());
        if hit(drop_t, d_drop) {
            NotificationFate::Drop
        } else if hit(delay_t, d_delay) {
            NotificationFate::Delay(self.delay_ns.load(r))
        } else if hit(reorder_t, d_reorder) {
            NotificationFate::Reorder(self.reorder_hold_ns.load(r))
        } else {
            NotificationFate::Deliver
        }
    }

    /// The fate of the `seq`-th READ by `from` against `to`.
    pub(crate) fn read_fate(&self, seed: u64, from: u32, to: u32, seq: u64) -> ReadFate {
        let r = Ordering::Relaxed;
        let (delay_t, fail_t) = (
            self.read_delay_threshold.load(r),
            self.read_fail_threshold.load(r),
        );
        let fail_next = take_one(&self.read_fail_next);
        let (d_delay, d_fail) = if delay_t | fail_t == 0 {
            (u64::MAX, u64::MAX) // no fault can hit: skip the hash
        } else {
            let mut rng = stream(seed, KIND_READ, from, to, seq);
            (rng.next_u64(), rng.next_u64())
        };
        let extra_ns = if hit(delay_t, d_delay) {
            self.read_delay_ns.load(r)
        } else {
            0
        };
        let fail = if fail_next || hit(fail_t, d_fail) {
            Some(decode_error(self.read_fail_error.load(r)))
        } else {
            None
        };
        ReadFate { extra_ns, fail }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn thresholds_cover_the_edges() {
        assert_eq!(threshold(0.0), 0);
        assert_eq!(threshold(-1.0), 0);
        assert_eq!(threshold(f64::NAN), 0);
        assert_eq!(threshold(1.0), u64::MAX);
        assert_eq!(threshold(7.0), u64::MAX);
        assert_eq!(threshold(0.5), 1 << 63);
        assert!(!hit(0, 0));
        assert!(hit(u64::MAX, u64::MAX));
    }

    #[test]
    fn errors_round_trip_through_a_word() {
        for e in FabricError::EXAMPLES {
            assert_eq!(decode_error(encode_error(e)), e);
        }
    }

    #[test]
    fn fates_are_a_function_of_seed_link_and_sequence() {
        let link = LinkCell::new();
        link.set_notification_faults(&NotificationFaults {
            drop_probability: 0.3,
            delay_probability: 0.3,
            delay: Duration::from_millis(5),
            reorder_probability: 0.3,
            ..NotificationFaults::default()
        });
        let run = |seed| -> Vec<NotificationFate> {
            (0..200)
                .map(|i| link.notification_fate(seed, 1, 2, i))
                .collect()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let all = run(7);
        for want in [
            NotificationFate::Drop,
            NotificationFate::Deliver,
            NotificationFate::Delay(5_000_000),
            NotificationFate::Reorder(1_000_000_000),
        ] {
            assert!(all.contains(&want), "{want:?} never drawn");
        }
    }

    #[test]
    fn next_n_counters_fire_exactly_n_times() {
        let link = LinkCell::new();
        link.add_drop_next(2);
        link.add_fail_next_reads(1);
        let fates: Vec<_> = (0..4).map(|i| link.notification_fate(1, 0, 1, i)).collect();
        assert_eq!(
            fates,
            [
                NotificationFate::Drop,
                NotificationFate::Drop,
                NotificationFate::Deliver,
                NotificationFate::Deliver
            ]
        );
        assert_eq!(link.read_fate(1, 0, 1, 0).fail, Some(INJECTED_READ_FAILURE));
        assert_eq!(link.read_fate(1, 0, 1, 1).fail, None);
        link.add_drop_next(u32::MAX);
        link.add_drop_next(5);
        link.clear();
        assert_eq!(
            link.notification_fate(1, 0, 1, 9),
            NotificationFate::Deliver
        );
    }
}
