//! Test support (feature `testkit`): the fake fabric every D-side and
//! verifier test uses ([`FakeFabric`], `fake_fabric.rs`), the one seeded
//! generator ([`SplitMix64`]), and the P roles checked step by step
//! against a reference model. Shared by the randomized test
//! (`tests/it/book_model.rs`) and the fuzz target (`fuzz/`, `lease_book`), so
//! both check the same invariants. Not part of the supported API.
//!
//! The harness runs one [`PrefillScheduler`] and one to three
//! [`PrefillRank`]s exactly as an engine with one process per GPU would:
//! scheduler and ranks exchange nothing but role-message **bytes**, once per
//! [`RolesOp::Step`] (the scheduler's backstop polled, directives down,
//! reports up). Heartbeats and
//! read-dones reach the ranks one by one, so a notification can be dropped
//! for some ranks and not others (per-rank drops), and ranks expire on their
//! own.
//!
//! [`RolesOp`] derives [`Arbitrary`], so any byte string is a valid program
//! (the fuzz target draws a `Vec<RolesOp>`, [`RolesOp::decode`] turns
//! seeded bytes into one), [`RolesHarness::apply`] runs one on the roles
//! and on the model and panics, with the reason, on the first disagreement
//! or broken invariant. A panic here is a bug in the roles, not in the input.
//!
//! The model is deliberately naive: a `BTreeMap` from id to lease, each
//! with a `Vec` of per-rank states, deadlines compared directly.
//!
//! # Invariants checked after every operation
//!
//! 1. A rank's slot word holds a lease's nonce exactly while that rank
//!    holds the lease; zero otherwise (zeroed before the report leaves).
//! 2. Nonces are never 0 and never repeat.
//! 3. A renewal never shortens a rank's deadline; a stale read-done or
//!    renewal changes nothing.
//! 4. A rank never expires early, and at most one tick late.
//! 5. A lease is released to the engine only when no rank holds it, and a
//!    slot is handed to a new lease only after the engine freed the blocks
//!    of the last one.
//! 6. The scheduler's backstop ([`PrefillScheduler::poll`], once per step)
//!    probes and cancels exactly the leases its rules name, never early and
//!    at most a tick late; each lease's timer is armed where the model says.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};

use crate::config::{EngineShape, LeaseConfig};
use crate::lease_fields::LeaseFields;
use crate::nonce::{Nonce, NonceSource};
use crate::producer::{
    GrantError, LeaseStatus, PrefillRank, PrefillScheduler, ReleaseReason, Renewal, ShareOutcome,
};
use crate::slot_pool::{SlotPool, SlotTicket};
use crate::slots::LeaseSlots;
use crate::time::Instant;

/// The crate's one seeded test generator (see `src/rng.rs`), for
/// integration tests, benches and fuzz harnesses.
pub use crate::rng::SplitMix64;

mod fake_fabric;
mod inputs;
pub use fake_fabric::{Agent, FakeFabric, Policy, PostedRead, Sent};
pub use inputs::{
    d_side_config, p_side_config, publish_slot, remote_prefill, six_second_leases, slot_word_descs,
    verifier_config,
};

/// Distinct request ids the operations draw from; the last one is too long.
const IDS: usize = 12;

/// Which nonce an operation presents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Arbitrary)]
pub enum NoncePick {
    /// The current lease's nonce (or a random one if there is none).
    Current,
    /// A nonce of an earlier lease.
    Stale,
    /// No nonce (vLLM's read-done form).
    Absent,
}

/// One operation on the roles. `Arbitrary` draws every field within the
/// range the harness gives meaning to (ids inside the id universe, slots
/// and ranks a little past the real ones), so every byte string is a valid
/// program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Arbitrary)]
pub enum RolesOp {
    /// The scheduler grants (assigns and starts) a lease to id number `id`.
    Grant {
        /// Index into the id universe.
        #[arbitrary(with = id_index)]
        id: u8,
    },
    /// The scheduler assigns id number `id` (prefill scheduled).
    Assign {
        /// Index into the id universe.
        #[arbitrary(with = id_index)]
        id: u8,
    },
    /// The scheduler starts id number `id`'s lease (prefill done).
    Start {
        /// Index into the id universe.
        #[arbitrary(with = id_index)]
        id: u8,
    },
    /// A text heartbeat for the ids whose bits are set in `mask` (ids
    /// 0..8), delivered to the ranks whose bits are set in `ranks`.
    Heartbeat {
        /// Bit i: id number i is in the heartbeat.
        mask: u8,
        /// Bit r: rank r receives it (the others lose it).
        #[arbitrary(with = rank_mask)]
        ranks: u8,
    },
    /// A compact heartbeat for `slot` with the chosen nonce, to `ranks`.
    RenewSlot {
        /// Slot index (may be out of range).
        #[arbitrary(with = |u: &mut Unstructured| u.int_in_range(0..=15))]
        slot: u8,
        /// Which nonce.
        nonce: NoncePick,
        /// Bit r: rank r receives it.
        #[arbitrary(with = rank_mask)]
        ranks: u8,
    },
    /// A read-done notification received by one rank.
    ReadDone {
        /// The rank (may be out of range).
        #[arbitrary(with = |u: &mut Unstructured| u.int_in_range(0..=3))]
        rank: u8,
        /// The sending decoder agent (`d0`..`d2`): each counts once per lease.
        #[arbitrary(with = |u: &mut Unstructured| u.int_in_range(0..=2))]
        sender: u8,
        /// Index into the id universe.
        #[arbitrary(with = id_index)]
        id: u8,
        /// Expected consumers claimed by the notification.
        #[arbitrary(with = |u: &mut Unstructured| u.int_in_range(0..=2))]
        consumers: u8,
        /// Which nonce.
        nonce: NoncePick,
    },
    /// The scheduler cancels id number `id`.
    Cancel {
        /// Index into the id universe.
        #[arbitrary(with = id_index)]
        id: u8,
    },
    /// One engine step's IPC: directives to every rank, then every rank's
    /// reports to the scheduler, all as bytes. The ranks whose bits are set
    /// in `lose` never get this step's directive message (lost on the
    /// engine's IPC).
    Step {
        /// Bit r: rank r loses the directive message.
        #[arbitrary(with = lost_mask)]
        lose: u8,
    },
    /// Time passes by `ms` milliseconds, then every rank polls.
    Advance {
        /// Milliseconds.
        #[arbitrary(with = advance_ms)]
        ms: u32,
    },
    /// The engine drains released leases.
    Drain,
    /// The engine frees the blocks of the `n` oldest drained leases.
    FreeBlocks {
        /// How many.
        #[arbitrary(with = |u: &mut Unstructured| u.int_in_range(0..=3))]
        n: u8,
    },
}

/// An index into the id universe (the last id is the over-long one).
fn id_index(u: &mut Unstructured<'_>) -> arbitrary::Result<u8> {
    u.int_in_range(0..=IDS as u8 - 1)
}

/// Half the notifications reach every rank; the rest are lost on the ranks
/// whose bits are clear, so that ranks diverge now and then but not always.
fn rank_mask(u: &mut Unstructured<'_>) -> arbitrary::Result<u8> {
    Ok(if u.arbitrary()? { 0xFF } else { u.arbitrary()? })
}

/// Mostly no loss; now and then one rank (or several) misses a message.
fn lost_mask(u: &mut Unstructured<'_>) -> arbitrary::Result<u8> {
    Ok(if u.int_in_range(0..=7u8)? == 0 {
        u.arbitrary::<u8>()? & 0b111
    } else {
        0
    })
}

/// Up to about 260 s, mostly short: the square spreads the draws over wheel
/// ticks (1 to 100 ms), lease extensions and whole lease durations alike.
fn advance_ms(u: &mut Unstructured<'_>) -> arbitrary::Result<u32> {
    let coarse = u32::from(u.arbitrary::<u8>()?);
    let fine = u32::from(u.int_in_range(0..=15u8)?);
    Ok(coarse * coarse * 4 + fine)
}

impl RolesOp {
    /// The program `bytes` encode: operations drawn with the derived
    /// [`Arbitrary`] until the bytes run out (about six bytes each). Every
    /// byte string is a valid program. The fuzz target draws a
    /// `Vec<RolesOp>` directly; seeded tests feed this random bytes.
    pub fn decode(bytes: &[u8]) -> impl Iterator<Item = RolesOp> + '_ {
        let mut u = Unstructured::new(bytes);
        // A draw from a non-empty input never fails (exhausted fields read
        // as zeros); a failure would end the program, never panic.
        core::iter::from_fn(move || {
            if u.is_empty() {
                None
            } else {
                RolesOp::arbitrary(&mut u).ok()
            }
        })
    }
}

/// One rank's view of a lease, in the model.
#[derive(Clone, Debug)]
struct RankLease {
    /// `None`: pinned (granted, not started). Pinned renewals raise `floor`.
    deadline: Option<Instant>,
    floor: Instant,
    hold_until: Instant,
    /// While pinned: the `kv_lease_max_pin` deadline.
    pinned_until: Instant,
    /// (expected, seen).
    reads: (u32, u32),
    /// Bit i: sender `d{i}`'s read-done was counted.
    readers: u8,
}

#[derive(Clone, Debug)]
struct ModelLease {
    nonce: Nonce,
    slot: Option<u32>,
    /// The scheduler's expiry and ceiling, once started.
    started: Option<(Instant, Instant)>,
    /// Directives not yet delivered: grant, start, cancel.
    grant_pending: bool,
    start_pending: bool,
    cancel_pending: bool,
    /// Per rank: `Some` while the rank holds it.
    ranks: Vec<Option<RankLease>>,
    /// Per rank: its release, waiting to be delivered to the scheduler.
    unreported: Vec<Option<ReleaseReason>>,
    /// Per rank: its release reached the scheduler.
    reported: Vec<bool>,
    /// The reasons reported so far, combined as the scheduler does.
    combined: Option<ReleaseReason>,
    reason: Option<ReleaseReason>,
    /// The scheduler's backstop (`backstop.rs`): the lease's limit
    /// (`Instant::MAX`: none), when its timer is armed, and whether a first
    /// let-go waits for the next poll to stamp it.
    limit: Instant,
    backstop: Option<Instant>,
    /// When `backstop` was last set.
    armed_at: Instant,
    straggling: bool,
}

/// The roles plus their reference model. See the module docs.
pub struct RolesHarness {
    scheduler: PrefillScheduler,
    ranks: Vec<PrefillRank>,
    config: LeaseConfig,
    ids: Vec<String>,
    now: Instant,
    /// Live leases (assigned, held, or released and not drained) by id.
    model: BTreeMap<usize, ModelLease>,
    /// Released on the scheduler, not drained: (id, reason, slot, nonce).
    released: Vec<(usize, ReleaseReason, Option<u32>, Nonce)>,
    /// Drained tickets whose blocks the engine has not freed yet.
    tickets: Vec<SlotTicket>,
    all_nonces: HashSet<Nonce>,
    old_nonces: Vec<Nonce>,
    buf: Vec<u8>,
    /// Operations applied.
    pub ops: u64,
    /// Rank shares released while another rank still held the lease
    /// (divergence), seen so far.
    pub divergences: u64,
}

impl RolesHarness {
    /// Small roles (so that capacity and slot exhaustion happen) whose
    /// settings are picked by `shape_byte`: verification on or off, one to
    /// three ranks, with or without max_hold, one of four wheel ticks.
    pub fn new(shape_byte: u8) -> RolesHarness {
        let slots = 3 + u32::from(shape_byte % 4);
        let mut config = LeaseConfig::new(EngineShape {
            num_kv_blocks: slots,
            max_num_seqs: 0,
        });
        config.lease_capacity = 6;
        config.max_request_id_len = 8;
        config.verification = shape_byte & 0x10 == 0;
        config.max_hold_secs = (shape_byte & 0x20 != 0).then_some(45);
        config.wheel_tick_ms = [10, 1, 100, 7][usize::from(shape_byte >> 6)];
        // Reachable within a few Advance ops: a pinned lease lets go.
        config.max_pin = Duration::from_secs(90);
        if config.validate().is_err() {
            unreachable!("harness config is valid by construction");
        }
        let n_ranks = 1 + u32::from((shape_byte >> 2) % 3);
        let pool = Arc::new(SlotPool::new(slots));
        let scheduler = match PrefillScheduler::with_parts(
            &config,
            n_ranks,
            pool,
            NonceSource::from_seed(7, 11, 13),
            Instant::ZERO,
        ) {
            Ok(s) => s,
            Err(e) => unreachable!("harness scheduler: {e}"),
        };
        // With three ranks, rank 2 stores shorter ids ("r:10" and "r:11"
        // do not fit): it refuses their Grants and must answer "not held".
        let mut short_ids = config.clone();
        short_ids.max_request_id_len = 3;
        let ranks = (0..n_ranks)
            .map(|r| {
                let c = if r == 2 { &short_ids } else { &config };
                match PrefillRank::new(c, r, Arc::new(LeaseSlots::new(slots)), Instant::ZERO) {
                    Ok(rank) => rank,
                    Err(e) => unreachable!("harness rank: {e}"),
                }
            })
            .collect();
        let mut ids: Vec<String> = (0..IDS - 1).map(|i| format!("r:{i}")).collect();
        ids.push("too-long-id".into());
        RolesHarness {
            scheduler,
            ranks,
            config,
            ids,
            now: Instant::ZERO,
            model: BTreeMap::new(),
            released: Vec::new(),
            tickets: Vec::new(),
            all_nonces: HashSet::new(),
            old_nonces: Vec::new(),
            buf: vec![0; 1 << 16],
            ops: 0,
            divergences: 0,
        }
    }

    /// The scheduler under test.
    pub fn scheduler(&self) -> &PrefillScheduler {
        &self.scheduler
    }

    /// The ranks under test.
    pub fn ranks(&self) -> &[PrefillRank] {
        &self.ranks
    }

    fn n_ranks(&self) -> usize {
        self.ranks.len()
    }

    fn pick_nonce(&self, pick: NoncePick, current: Option<Nonce>) -> Option<Nonce> {
        match pick {
            NoncePick::Current => Some(current.unwrap_or(Nonce::ONE)),
            NoncePick::Stale => Some(self.old_nonces.last().copied().unwrap_or(Nonce::ONE)),
            NoncePick::Absent => None,
        }
    }

    /// Applies one operation to the roles and the model and checks every
    /// invariant. Panics on the first disagreement.
    pub fn apply(&mut self, op: RolesOp) {
        self.ops += 1;
        match op {
            RolesOp::Grant { id } => self.assign(usize::from(id), true),
            RolesOp::Assign { id } => self.assign(usize::from(id), false),
            RolesOp::Start { id } => self.start(usize::from(id)),
            RolesOp::Heartbeat { mask, ranks } => self.heartbeat(mask, ranks),
            RolesOp::RenewSlot { slot, nonce, ranks } => self.renew_slot(slot, nonce, ranks),
            RolesOp::ReadDone {
                rank,
                sender,
                id,
                consumers,
                nonce,
            } => self.read_done(
                usize::from(rank),
                sender,
                usize::from(id),
                u32::from(consumers),
                nonce,
            ),
            RolesOp::Cancel { id } => self.cancel(usize::from(id)),
            RolesOp::Step { lose } => self.step(lose),
            RolesOp::Advance { ms } => self.advance(ms),
            RolesOp::Drain => self.drain(),
            RolesOp::FreeBlocks { n } => {
                for _ in 0..n.min(self.tickets.len() as u8) {
                    let t = self.tickets.remove(0);
                    self.scheduler.blocks_freed(t);
                }
            }
        }
        self.check();
    }
}

mod backstop;
mod ops;
mod step;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_string_decodes() {
        let bytes: Vec<u8> = (0..=255u8).flat_map(|a| [a, a.wrapping_mul(37)]).collect();
        let ops: Vec<RolesOp> = RolesOp::decode(&bytes).collect();
        // Every op takes at least one byte, and 512 bytes make dozens.
        assert!((40..=512).contains(&ops.len()), "{}", ops.len());
        let mut h = RolesHarness::new(0);
        for &op in &ops {
            h.apply(op);
        }
        assert_eq!(h.ops, ops.len() as u64);
    }
}
