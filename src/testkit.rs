//! Test support (feature `testkit`): the P roles checked step by step
//! against a reference model. Shared by the randomized test
//! (`tests/book_model.rs`) and the fuzz target (`fuzz/`, `lease_book`), so
//! both check the same invariants. Not part of the supported API.
//!
//! The harness runs one [`PrefillScheduler`] and one to three
//! [`PrefillRank`]s exactly as an engine with one process per GPU would:
//! scheduler and ranks exchange nothing but role-message **bytes**, once per
//! [`RolesOp::Step`] (directives down, reports up). Heartbeats and
//! read-dones reach the ranks one by one, so a notification can be dropped
//! for some ranks and not others (per-rank drops), and ranks expire on their
//! own.
//!
//! [`RolesOp::decode`] turns arbitrary bytes into operations (every byte
//! string is a valid program), [`RolesHarness::apply`] runs one on the roles
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

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::config::{EngineShape, LeaseConfig};
use crate::lease_fields::LeaseFields;
use crate::nonce::{Nonce, NonceSource};
use crate::producer::{
    GrantError, LeaseStatus, PrefillRank, PrefillScheduler, ReadDoneOutcome, ReleaseReason, Renewal,
};
use crate::slot_pool::{SlotPool, SlotTicket};
use crate::slots::LeaseSlots;
use crate::time::Instant;

/// Distinct request ids the operations draw from; the last one is too long.
const IDS: usize = 12;

/// Which nonce an operation presents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoncePick {
    /// The current lease's nonce (or a random one if there is none).
    Current,
    /// A nonce of an earlier lease.
    Stale,
    /// No nonce (vLLM's read-done form).
    Absent,
}

/// One operation on the roles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RolesOp {
    /// The scheduler grants (assigns and starts) a lease to id number `id`.
    Grant {
        /// Index into the id universe.
        id: u8,
    },
    /// The scheduler assigns id number `id` (prefill scheduled).
    Assign {
        /// Index into the id universe.
        id: u8,
    },
    /// The scheduler starts id number `id`'s lease (prefill done).
    Start {
        /// Index into the id universe.
        id: u8,
    },
    /// A text heartbeat for the ids whose bits are set in `mask` (ids
    /// 0..8), delivered to the ranks whose bits are set in `ranks`.
    Heartbeat {
        /// Bit i: id number i is in the heartbeat.
        mask: u8,
        /// Bit r: rank r receives it (the others lose it).
        ranks: u8,
    },
    /// A compact heartbeat for `slot` with the chosen nonce, to `ranks`.
    RenewSlot {
        /// Slot index (may be out of range).
        slot: u8,
        /// Which nonce.
        nonce: NoncePick,
        /// Bit r: rank r receives it.
        ranks: u8,
    },
    /// A read-done notification received by one rank.
    ReadDone {
        /// The rank (may be out of range).
        rank: u8,
        /// Index into the id universe.
        id: u8,
        /// Expected consumers claimed by the notification.
        consumers: u8,
        /// Which nonce.
        nonce: NoncePick,
    },
    /// The scheduler cancels id number `id`.
    Cancel {
        /// Index into the id universe.
        id: u8,
    },
    /// One engine step's IPC: directives to every rank, then every rank's
    /// reports to the scheduler, all as bytes.
    Step,
    /// Time passes by `ms` milliseconds, then every rank polls.
    Advance {
        /// Milliseconds.
        ms: u32,
    },
    /// The engine drains released leases.
    Drain,
    /// The engine frees the blocks of the `n` oldest drained leases.
    FreeBlocks {
        /// How many.
        n: u8,
    },
}

impl RolesOp {
    /// Decodes a whole program from bytes: two bytes per operation, a
    /// trailing odd byte ignored. Every input is a valid program.
    pub fn decode(bytes: &[u8]) -> impl Iterator<Item = RolesOp> + '_ {
        bytes.chunks_exact(2).map(|c| {
            let (a, b) = (c[0], c[1]);
            let pick = match b >> 6 {
                0 | 1 => NoncePick::Current,
                2 => NoncePick::Stale,
                _ => NoncePick::Absent,
            };
            // Most notifications reach every rank; some are lost on some.
            let ranks = if a & 0x80 == 0 { 0xFF } else { a >> 4 };
            let id = b % IDS as u8;
            match a % 16 {
                0 | 1 => RolesOp::Grant { id },
                2 => RolesOp::Assign { id },
                3 => RolesOp::Start { id },
                4 | 5 => RolesOp::Heartbeat { mask: b, ranks },
                6 => RolesOp::RenewSlot {
                    slot: b & 0x0f,
                    nonce: pick,
                    ranks,
                },
                7 | 8 => RolesOp::ReadDone {
                    rank: (a >> 4) % 4,
                    id,
                    consumers: (a >> 6) % 3,
                    nonce: pick,
                },
                9 => RolesOp::Cancel { id },
                10 | 11 => RolesOp::Step,
                12 | 13 => RolesOp::Advance {
                    ms: u32::from(b) * u32::from(b) * 4 + u32::from(a >> 4),
                },
                14 => RolesOp::Drain,
                _ => RolesOp::FreeBlocks { n: b % 4 },
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
    /// (expected, seen).
    reads: (u32, u32),
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
        let ranks = (0..n_ranks)
            .map(|r| {
                match PrefillRank::new(&config, r, Arc::new(LeaseSlots::new(slots)), Instant::ZERO)
                {
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
                id,
                consumers,
                nonce,
            } => self.read_done(
                usize::from(rank),
                usize::from(id),
                u32::from(consumers),
                nonce,
            ),
            RolesOp::Cancel { id } => self.cancel(usize::from(id)),
            RolesOp::Step => self.step(),
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

    fn live_count(&self) -> usize {
        self.model.len()
    }

    fn assign(&mut self, id: usize, start: bool) {
        let name = self.ids[id].clone();
        let got = if start {
            self.scheduler
                .grant(&name, self.now)
                .map(|g| (g.lease_fields(), g.nonce))
        } else {
            self.scheduler
                .assign(&name, self.now)
                .map(|a| (a.fields, a.nonce))
        };
        if name.len() > usize::from(self.config.max_request_id_len) {
            assert!(
                matches!(got, Err(GrantError::BadId(_))),
                "over-long id: {got:?}"
            );
            return;
        }
        if let Some(l) = self.model.get(&id) {
            let want = if l.reason.is_some() {
                GrantError::ReleasePending
            } else {
                GrantError::Duplicate
            };
            assert_eq!(got, Err(want), "grant of a live id {id}");
            return;
        }
        if self.live_count() == self.config.lease_capacity as usize {
            assert_eq!(got, Err(GrantError::Full));
            return;
        }
        let (fields, nonce) = match got {
            Ok(g) => g,
            Err(e) => panic!("grant {id} refused: {e}"),
        };
        assert!(self.all_nonces.insert(nonce), "nonce {nonce:?} repeated");
        let slots_in_use =
            self.model.values().filter(|l| l.slot.is_some()).count() + self.tickets.len();
        let free_slots = self.config.lease_slots as usize - slots_in_use;
        assert_eq!(
            fields.is_some(),
            self.config.verification && free_slots > 0,
            "slot iff verifying and a slot is free"
        );
        let slot = fields.map(|f: LeaseFields| f.slot);
        if let Some(s) = slot {
            assert!(
                self.model.values().all(|l| l.slot != Some(s)),
                "slot {s} given twice"
            );
            assert!(
                self.tickets.iter().all(|t| t.slot() != s),
                "slot {s} reused before its blocks were freed"
            );
        }
        let n = self.n_ranks();
        self.model.insert(
            id,
            ModelLease {
                nonce,
                slot,
                started: None,
                grant_pending: true,
                start_pending: false,
                cancel_pending: false,
                ranks: vec![None; n],
                unreported: vec![None; n],
                reported: vec![false; n],
                combined: None,
                reason: None,
            },
        );
        if start {
            self.model_start(id);
        }
    }

    fn model_start(&mut self, id: usize) {
        let (now, dur, hold) = (
            self.now,
            self.config.lease_duration(),
            self.config.max_hold(),
        );
        if let Some(l) = self.model.get_mut(&id) {
            l.started = Some((now + dur, hold.map_or(Instant::MAX, |h| now + h)));
            l.start_pending = true;
        }
    }

    fn start(&mut self, id: usize) {
        let got = self.scheduler.start(&self.ids[id], self.now);
        let ok = match self.model.get(&id) {
            Some(l) => l.reason.is_none() && l.started.is_none(),
            None => false,
        };
        assert_eq!(got.is_ok(), ok, "start {id}: {got:?}");
        if let Ok(expiry) = got {
            assert_eq!(expiry, self.now + self.config.lease_duration());
            self.model_start(id);
        }
    }

    fn cancel(&mut self, id: usize) {
        let got = self.scheduler.cancel(&self.ids[id]);
        let want = self.model.get(&id).is_some_and(|l| l.reason.is_none());
        assert_eq!(got, want, "cancel {id}");
        if !want {
            return;
        }
        let Some(l) = self.model.get_mut(&id) else {
            return;
        };
        if l.grant_pending {
            // No rank heard of it: released at once.
            l.grant_pending = false;
            l.start_pending = false;
            l.reason = Some(ReleaseReason::Cancelled);
            let entry = (id, ReleaseReason::Cancelled, l.slot, l.nonce);
            self.released.push(entry);
        } else {
            l.cancel_pending = true;
        }
    }

    /// The model's renewal of `id` on rank `r`; the expected outcome.
    fn model_renew(&mut self, id: usize, r: usize) -> Renewal {
        let now = self.now;
        let ext = self.config.lease_extension();
        let Some(rl) = self.model.get_mut(&id).and_then(|l| l.ranks[r].as_mut()) else {
            return Renewal::Unknown;
        };
        let wanted = now + ext;
        let target = wanted.min(rl.hold_until);
        match &mut rl.deadline {
            Some(d) => {
                let before = *d;
                *d = (*d).max(target);
                assert!(*d >= before, "renewal shortened a lease");
            }
            None => rl.floor = rl.floor.max(target),
        }
        if target < wanted {
            Renewal::Capped
        } else {
            Renewal::Renewed
        }
    }

    fn heartbeat(&mut self, mask: u8, ranks: u8) {
        let chosen: Vec<usize> = (0..8).filter(|i| mask & (1 << i) != 0).collect();
        let mut msg = b"HB:".to_vec();
        for (k, &i) in chosen.iter().enumerate() {
            if k > 0 {
                msg.push(b',');
            }
            msg.extend_from_slice(self.ids[i].as_bytes());
        }
        for r in 0..self.n_ranks() {
            if ranks & (1 << r) == 0 {
                continue;
            }
            let got = self.ranks[r].on_notification(&msg, self.now);
            if chosen.is_empty() {
                // `HB:` with no id renews nothing, whatever the codec thinks of it.
                assert!(
                    got.map_or(true, |s| s.renewed == 0),
                    "empty heartbeat renewed"
                );
                continue;
            }
            let s = got.unwrap_or_else(|e| panic!("heartbeat {msg:?} refused: {e}"));
            let mut want = (0, 0);
            for &i in &chosen {
                match self.model_renew(i, r) {
                    Renewal::Unknown => want.1 += 1,
                    _ => want.0 += 1,
                }
            }
            assert_eq!(
                (s.renewed, s.ignored),
                want,
                "heartbeat {mask:08b} on rank {r}"
            );
        }
    }

    fn renew_slot(&mut self, slot: u8, pick: NoncePick, ranks: u8) {
        let slot = u32::from(slot);
        for r in 0..self.n_ranks() {
            if ranks & (1 << r) == 0 {
                continue;
            }
            let owner = self
                .model
                .iter()
                .find(|(_, l)| l.slot == Some(slot) && l.ranks[r].is_some())
                .map(|(i, l)| (*i, l.nonce));
            let Some(n) = self.pick_nonce(pick, owner.map(|o| o.1)) else {
                return;
            };
            let mismatches = self.ranks[r].counters().renew_nonce_mismatch;
            // Alternate between the single and the batched compact path.
            let got = if self.ops % 2 == 0 {
                self.ranks[r].renew_slot(slot, n, self.now)
            } else {
                let capped = self.ranks[r].counters().renew_capped;
                match self.ranks[r].renew_slots_all([(slot, n)], self.now) {
                    (1, 0) if self.ranks[r].counters().renew_capped > capped => Renewal::Capped,
                    (1, 0) => Renewal::Renewed,
                    (0, 1) => Renewal::Unknown,
                    other => panic!("renew_slots_all of one record returned {other:?}"),
                }
            };
            let want = match owner {
                Some((id, owner_nonce)) if owner_nonce == n => self.model_renew(id, r),
                _ => Renewal::Unknown,
            };
            assert_eq!(got, want, "renew_slot {slot} on rank {r}");
            let mismatch = owner.is_some_and(|(_, o)| o != n);
            assert_eq!(
                self.ranks[r].counters().renew_nonce_mismatch - mismatches,
                u64::from(mismatch),
                "renew_slot {slot} counted on rank {r}"
            );
        }
    }

    fn read_done(&mut self, rank: usize, id: usize, consumers: u32, pick: NoncePick) {
        if rank >= self.n_ranks() {
            return;
        }
        let held = self
            .model
            .get(&id)
            .and_then(|l| l.ranks[rank].as_ref().map(|_| l.nonce));
        let nonce = self.pick_nonce(pick, held);
        let got = self.ranks[rank].read_done(self.ids[id].as_bytes(), consumers, nonce);
        let want = match (self.model.get_mut(&id), held) {
            (Some(l), Some(current)) => {
                if nonce.is_some_and(|n| n != current) {
                    ReadDoneOutcome::StaleNonce
                } else {
                    let rl = l.ranks[rank].as_mut().map(|rl| &mut rl.reads);
                    match rl {
                        Some((expected, seen)) => {
                            if *expected == 0 {
                                *expected = consumers.max(1);
                            }
                            *seen += 1;
                            if *seen >= *expected {
                                self.model_rank_release(id, rank, ReleaseReason::ReadDone);
                                ReadDoneOutcome::Released
                            } else {
                                ReadDoneOutcome::Counted
                            }
                        }
                        None => ReadDoneOutcome::Unknown,
                    }
                }
            }
            _ => ReadDoneOutcome::Unknown,
        };
        assert_eq!(
            got, want,
            "read_done rank {rank} id {id} consumers {consumers} {pick:?}"
        );
    }

    /// Rank `r` lets go of `id`: its slot word must already be zero.
    fn model_rank_release(&mut self, id: usize, r: usize, reason: ReleaseReason) {
        let Some(l) = self.model.get_mut(&id) else {
            return;
        };
        if l.ranks[r].take().is_some() {
            l.unreported[r] = Some(reason);
            if l.ranks.iter().any(Option::is_some) {
                self.divergences += 1;
            }
        }
        if let Some(s) = l.slot {
            assert_eq!(
                self.ranks[r].slots().load(s),
                Some(0),
                "rank {r} released {id} without zeroing slot {s}"
            );
        }
    }

    fn step(&mut self) {
        // Directives down: the same bytes to every rank.
        let n = match self.scheduler.encode_directives(self.now, &mut self.buf) {
            Ok(n) => n,
            Err(e) => panic!("directives did not fit a 64 KiB buffer: {e}"),
        };
        let msg = self.buf[..n].to_vec();
        for rank in &mut self.ranks {
            if let Err(e) = rank.apply_directives(&msg, self.now) {
                panic!(
                    "rank {} refused the scheduler's directives: {e}",
                    rank.rank()
                );
            }
        }
        self.model_directives();
        // Reports up, rank by rank.
        for r in 0..self.n_ranks() {
            let n = match self.ranks[r].encode_reports(&mut self.buf) {
                Ok(n) => n,
                Err(e) => panic!("reports did not fit: {e}"),
            };
            let msg = self.buf[..n].to_vec();
            if let Err(e) = self.scheduler.apply_reports(r as u32, &msg) {
                panic!("scheduler refused rank {r}'s reports: {e}");
            }
            self.model_reports(r);
        }
    }

    fn model_directives(&mut self) {
        let now = self.now;
        let ids: Vec<usize> = self.model.keys().copied().collect();
        for id in ids {
            let n = self.n_ranks();
            let Some(l) = self.model.get_mut(&id) else {
                continue;
            };
            if l.grant_pending {
                l.grant_pending = false;
                let (deadline, hold) = match (l.started, l.start_pending) {
                    (Some((x, h)), true) => {
                        l.start_pending = false;
                        (Some(x.max(now)), h.max(now))
                    }
                    _ => (None, Instant::MAX),
                };
                for r in 0..n {
                    l.ranks[r] = Some(RankLease {
                        deadline,
                        floor: Instant::ZERO,
                        hold_until: hold,
                        reads: (0, 0),
                    });
                }
            }
            if l.start_pending {
                l.start_pending = false;
                if let Some((x, h)) = l.started {
                    for rl in l.ranks.iter_mut().flatten() {
                        if rl.deadline.is_none() {
                            rl.deadline = Some(rl.floor.max(x.max(now)));
                            rl.hold_until = h.max(now);
                        }
                    }
                }
            }
            if l.cancel_pending {
                l.cancel_pending = false;
                for r in 0..n {
                    self.model_rank_release(id, r, ReleaseReason::Cancelled);
                }
            }
        }
    }

    fn model_reports(&mut self, r: usize) {
        for (&id, l) in self.model.iter_mut() {
            let Some(reason) = l.unreported[r].take() else {
                continue;
            };
            if l.reason.is_some() {
                continue;
            }
            l.reported[r] = true;
            l.combined = Some(l.combined.map_or(reason, |x| x.combine(reason)));
            if l.reported.iter().all(|x| *x) {
                let why = l.combined.unwrap_or(reason);
                l.reason = Some(why);
                l.cancel_pending = false;
                l.start_pending = false;
                self.released.push((id, why, l.slot, l.nonce));
            }
        }
    }

    fn advance(&mut self, ms: u32) {
        self.now = self.now + Duration::from_millis(u64::from(ms));
        let tick = self.config.wheel_tick();
        for r in 0..self.n_ranks() {
            self.ranks[r].poll(self.now);
            let held: Vec<usize> = self
                .model
                .iter()
                .filter(|(_, l)| l.ranks[r].as_ref().is_some_and(|rl| rl.deadline.is_some()))
                .map(|(i, _)| *i)
                .collect();
            for id in held {
                let Some(deadline) = self.model[&id].ranks[r].as_ref().and_then(|x| x.deadline)
                else {
                    continue;
                };
                let still_held = self.ranks[r].expiry(&self.ids[id]).is_some();
                if still_held {
                    assert!(
                        deadline + tick > self.now,
                        "rank {r}: id {id} due at {deadline:?} not expired at {:?}",
                        self.now
                    );
                } else {
                    assert!(
                        deadline <= self.now,
                        "rank {r}: id {id} expired early: due {deadline:?}, now {:?}",
                        self.now
                    );
                    self.model_rank_release(id, r, ReleaseReason::Expired);
                }
            }
        }
    }

    fn drain(&mut self) {
        let mut reported: Vec<(String, ReleaseReason, Option<SlotTicket>, Nonce)> = Vec::new();
        let ranks = &self.ranks;
        self.scheduler.drain_released(|r| {
            for rank in ranks {
                if let Some(t) = &r.slot {
                    assert_eq!(
                        rank.slots().load(t.slot()),
                        Some(0),
                        "slot {} not zeroed on rank {} before the release was reported",
                        t.slot(),
                        rank.rank()
                    );
                }
                assert!(
                    rank.entry_of(r.request_id).is_none(),
                    "{} released while rank {} still holds it",
                    r.request_id,
                    rank.rank()
                );
            }
            reported.push((r.request_id.to_string(), r.reason, r.slot, r.nonce));
        });
        let mut want: Vec<(String, ReleaseReason, Option<u32>, Nonce)> = self
            .released
            .drain(..)
            .map(|(i, r, slot, n)| (self.ids[i].clone(), r, slot, n))
            .collect();
        let mut got: Vec<(String, ReleaseReason, Option<u32>, Nonce)> = reported
            .iter()
            .map(|(i, r, t, n)| (i.clone(), *r, t.as_ref().map(SlotTicket::slot), *n))
            .collect();
        let key = |x: &(String, ReleaseReason, Option<u32>, Nonce)| x.3;
        want.sort_by_key(key);
        got.sort_by_key(key);
        assert_eq!(
            got, want,
            "released set, each with its lease's slot and nonce"
        );
        for (id, _, _, nonce) in &want {
            let i = self.ids.iter().position(|x| x == id).unwrap_or(usize::MAX);
            self.model.remove(&i);
            self.old_nonces.push(*nonce);
        }
        self.tickets
            .extend(reported.into_iter().filter_map(|(_, _, t, _)| t));
    }

    fn check(&self) {
        let held = self.model.values().filter(|l| l.reason.is_none()).count();
        assert_eq!(self.scheduler.held() as usize, held, "held count");
        assert_eq!(
            self.scheduler.pending_releases(),
            self.released.len(),
            "pending releases"
        );
        for (r, rank) in self.ranks.iter().enumerate() {
            for s in 0..self.config.lease_slots {
                let owner = self
                    .model
                    .values()
                    .find(|l| l.slot == Some(s) && l.ranks[r].is_some());
                let want = owner.map_or(0, |l| l.nonce.get());
                assert_eq!(rank.slots().load(s), Some(want), "rank {r} slot {s}");
            }
            let rank_held = self.model.values().filter(|l| l.ranks[r].is_some()).count();
            assert_eq!(rank.held() as usize, rank_held, "rank {r} held count");
            for (id, l) in &self.model {
                let want = l.ranks[r]
                    .as_ref()
                    .map(|rl| rl.deadline.unwrap_or(Instant::MAX));
                assert_eq!(
                    rank.expiry(&self.ids[*id]),
                    want,
                    "rank {r}: expiry of {id}"
                );
            }
        }
        for (id, l) in &self.model {
            let want = match (l.reason, l.started) {
                (Some(r), _) => LeaseStatus::Released(r),
                (None, Some(_)) => LeaseStatus::Held,
                (None, None) => LeaseStatus::Assigned,
            };
            assert_eq!(
                self.scheduler.status(&self.ids[*id]),
                Some(want),
                "status of {id}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_string_decodes() {
        let bytes: Vec<u8> = (0..=255u8).flat_map(|a| [a, a.wrapping_mul(37)]).collect();
        let ops: Vec<RolesOp> = RolesOp::decode(&bytes).collect();
        assert_eq!(ops.len(), 256);
        let mut h = RolesHarness::new(0);
        for op in ops {
            h.apply(op);
        }
        assert_eq!(h.ops, 256);
    }
}
