//! Test support (feature `testkit`): the lease book checked step by step
//! against a reference model. Shared by the randomized test
//! (`tests/book_model.rs`) and the fuzz target (`fuzz/`, `lease_book`), so
//! both check the same invariants. Not part of the supported API.
//!
//! [`BookOp::decode`] turns arbitrary bytes into operations (every byte
//! string is a valid program), [`BookHarness::apply`] runs one on the book
//! and on the model and panics, with the reason, on the first disagreement
//! or broken invariant. A panic here is a bug in the book, not in the input.
//!
//! The model is deliberately naive: a `BTreeMap` from id to lease state with
//! deadlines compared directly, slots tracked as a set.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::config::{EngineShape, LeaseConfig};
use crate::nonce::{Nonce, NonceSource};
use crate::producer::{GrantError, LeaseBook, ReadDoneOutcome, ReleaseReason, Renewal};
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

/// One operation on the book.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BookOp {
    /// Grant a lease to id number `id`.
    Grant {
        /// Index into the id universe.
        id: u8,
    },
    /// Heartbeat for id number `id`.
    Renew {
        /// Index into the id universe.
        id: u8,
    },
    /// A batched heartbeat (`renew_all`) for the ids whose bits are set in
    /// `mask` (ids 0..8).
    RenewAll {
        /// Bit i: id number i is in the heartbeat.
        mask: u8,
    },
    /// Compact heartbeat for `slot` with the chosen nonce.
    RenewSlot {
        /// Slot index (may be out of range).
        slot: u8,
        /// Which nonce.
        nonce: NoncePick,
    },
    /// Read-done notification.
    ReadDone {
        /// Local rank (may be out of range).
        rank: u8,
        /// Index into the id universe.
        id: u8,
        /// Expected consumers claimed by the notification.
        consumers: u8,
        /// Which nonce.
        nonce: NoncePick,
    },
    /// The engine cancels id number `id`.
    Cancel {
        /// Index into the id universe.
        id: u8,
    },
    /// Time passes by `ms` milliseconds, then the book is polled.
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

impl BookOp {
    /// Decodes a whole program from bytes: two bytes per operation, a
    /// trailing odd byte ignored. Every input is a valid program.
    pub fn decode(bytes: &[u8]) -> impl Iterator<Item = BookOp> + '_ {
        bytes.chunks_exact(2).map(|c| {
            let (a, b) = (c[0], c[1]);
            let pick = match b >> 6 {
                0 | 1 => NoncePick::Current,
                2 => NoncePick::Stale,
                _ => NoncePick::Absent,
            };
            match a % 16 {
                0..=2 => BookOp::Grant { id: b % IDS as u8 },
                3 | 4 => BookOp::Renew { id: b % IDS as u8 },
                5 => BookOp::RenewAll { mask: b },
                6 => BookOp::RenewSlot {
                    slot: b & 0x0f,
                    nonce: pick,
                },
                7..=8 => BookOp::ReadDone {
                    rank: (a >> 4) % 3,
                    id: b % IDS as u8,
                    consumers: (a >> 6) % 3,
                    nonce: pick,
                },
                9 => BookOp::Cancel { id: b % IDS as u8 },
                10..=12 => BookOp::Advance {
                    ms: u32::from(b) * u32::from(b) * 4 + u32::from(a >> 4),
                },
                13 | 14 => BookOp::Drain,
                _ => BookOp::FreeBlocks { n: b % 4 },
            }
        })
    }
}

#[derive(Clone, Debug)]
struct ModelLease {
    expiry: Instant,
    hold_until: Instant,
    nonce: Nonce,
    slot: Option<u32>,
    /// (expected, seen) per rank.
    reads: Vec<(u32, u32)>,
}

/// The book plus its reference model. See the module docs.
pub struct BookHarness {
    book: LeaseBook,
    config: LeaseConfig,
    ranks: Vec<Arc<LeaseSlots>>,
    ids: Vec<String>,
    now: Instant,
    /// Held leases by id.
    model: BTreeMap<usize, ModelLease>,
    /// Released, not yet drained: (id, reason, slot). An id may appear here
    /// and in `model` at once (released, then granted again before the drain).
    released: Vec<(usize, ReleaseReason, Option<u32>)>,
    /// Drained tickets whose blocks the engine has not freed yet.
    tickets: Vec<SlotTicket>,
    all_nonces: HashSet<Nonce>,
    old_nonces: Vec<Nonce>,
    /// Operations applied.
    pub ops: u64,
}

impl BookHarness {
    /// A small book (so that capacity and slot exhaustion happen) whose
    /// settings are picked by `shape_byte`: verification on or off, one to
    /// three ranks, with or without max_hold.
    pub fn new(shape_byte: u8) -> BookHarness {
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
        let ranks: Vec<_> = (0..1 + usize::from((shape_byte >> 2) % 3))
            .map(|_| Arc::new(LeaseSlots::new(slots)))
            .collect();
        let pool = Arc::new(SlotPool::new(slots));
        let book = match LeaseBook::with_parts(
            &config,
            ranks.clone(),
            pool,
            NonceSource::from_seed(7, 11, 13),
            Instant::ZERO,
        ) {
            Ok(b) => b,
            Err(e) => unreachable!("harness book: {e}"),
        };
        let mut ids: Vec<String> = (0..IDS - 1).map(|i| format!("r:{i}")).collect();
        ids.push("too-long-id".into());
        BookHarness {
            book,
            config,
            ranks,
            ids,
            now: Instant::ZERO,
            model: BTreeMap::new(),
            released: Vec::new(),
            tickets: Vec::new(),
            all_nonces: HashSet::new(),
            old_nonces: Vec::new(),
            ops: 0,
        }
    }

    /// The book under test.
    pub fn book(&self) -> &LeaseBook {
        &self.book
    }

    fn held(&self, id: usize) -> Option<&ModelLease> {
        self.model.get(&id)
    }

    fn pick_nonce(&self, pick: NoncePick, current: Option<Nonce>) -> Option<Nonce> {
        match pick {
            NoncePick::Current => Some(current.unwrap_or(Nonce::ONE)),
            NoncePick::Stale => Some(self.old_nonces.last().copied().unwrap_or(Nonce::ONE)),
            NoncePick::Absent => None,
        }
    }

    /// Applies one operation to the book and the model and checks every
    /// invariant. Panics on the first disagreement.
    pub fn apply(&mut self, op: BookOp) {
        self.ops += 1;
        match op {
            BookOp::Grant { id } => self.grant(usize::from(id)),
            BookOp::Renew { id } => {
                let id = usize::from(id);
                let got = self.book.renew(self.ids[id].as_bytes(), self.now);
                let want = self.model_renew(id);
                assert_eq!(got, want, "renew {id}");
            }
            BookOp::RenewAll { mask } => {
                let chosen: Vec<usize> = (0..8).filter(|i| mask & (1 << i) != 0).collect();
                let ids: Vec<&[u8]> = chosen.iter().map(|&i| self.ids[i].as_bytes()).collect();
                let got = self.book.renew_all(ids, self.now);
                let mut want = (0, 0);
                for i in chosen {
                    match self.model_renew(i) {
                        Renewal::Unknown => want.1 += 1,
                        _ => want.0 += 1,
                    }
                }
                assert_eq!(got, want, "renew_all {mask:08b}");
            }
            BookOp::RenewSlot { slot, nonce } => {
                let slot = u32::from(slot);
                let owner = self
                    .model
                    .iter()
                    .find(|(_, l)| l.slot == Some(slot))
                    .map(|(i, l)| (*i, l.nonce));
                let Some(n) = self.pick_nonce(nonce, owner.map(|o| o.1)) else {
                    return;
                };
                let mismatches = self.book.counters().renew_nonce_mismatch;
                // Alternate between the single and the batched compact path.
                let got = if self.ops % 2 == 0 {
                    self.book.renew_slot(slot, n, self.now)
                } else {
                    let capped = self.book.counters().renew_capped;
                    match self.book.renew_slots_all([(slot, n)], self.now) {
                        (1, 0) if self.book.counters().renew_capped > capped => Renewal::Capped,
                        (1, 0) => Renewal::Renewed,
                        (0, 1) => Renewal::Unknown,
                        other => panic!("renew_slots_all of one record returned {other:?}"),
                    }
                };
                let want = match owner {
                    Some((id, owner_nonce)) if owner_nonce == n => self.model_renew(id),
                    _ => Renewal::Unknown,
                };
                assert_eq!(got, want, "renew_slot {slot}");
                // A wrong nonce for a held slot is a mismatch; a slot no lease holds is unknown.
                let mismatch = owner.is_some_and(|(_, o)| o != n);
                assert_eq!(
                    self.book.counters().renew_nonce_mismatch - mismatches,
                    u64::from(mismatch),
                    "renew_slot {slot} counted"
                );
            }
            BookOp::ReadDone {
                rank,
                id,
                consumers,
                nonce,
            } => self.read_done(
                u32::from(rank),
                usize::from(id),
                u32::from(consumers),
                nonce,
            ),
            BookOp::Cancel { id } => {
                let id = usize::from(id);
                let was = self.held(id).is_some();
                assert_eq!(self.book.cancel(&self.ids[id]), was, "cancel {id}");
                if was {
                    self.model_release(id, ReleaseReason::Cancelled);
                }
            }
            BookOp::Advance { ms } => self.advance(ms),
            BookOp::Drain => self.drain(),
            BookOp::FreeBlocks { n } => {
                for _ in 0..n.min(self.tickets.len() as u8) {
                    let t = self.tickets.remove(0);
                    self.book.blocks_freed(t);
                }
            }
        }
        self.check();
    }

    fn grant(&mut self, id: usize) {
        let got = self.book.grant(&self.ids[id], self.now);
        if self.ids[id].len() > self.config.max_request_id_len as usize {
            assert!(
                matches!(got, Err(GrantError::BadId(_))),
                "over-long id: {got:?}"
            );
            return;
        }
        if self.model.contains_key(&id) {
            assert_eq!(got, Err(GrantError::Duplicate), "grant of a held id {id}");
            return;
        }
        if self.model.len() + self.released.len() == self.config.lease_capacity as usize {
            assert_eq!(got, Err(GrantError::Full));
            return;
        }
        let g = match got {
            Ok(g) => g,
            Err(e) => panic!("grant {id} refused: {e}"),
        };
        assert!(
            self.all_nonces.insert(g.nonce),
            "nonce {:?} repeated",
            g.nonce
        );
        let slots_in_use = self.model.values().filter(|l| l.slot.is_some()).count()
            + self.released.iter().filter(|r| r.2.is_some()).count()
            + self.tickets.len();
        let free_slots = self.config.lease_slots as usize - slots_in_use;
        assert_eq!(
            g.slot.is_some(),
            self.config.verification && free_slots > 0,
            "slot iff verifying and a slot is free"
        );
        if let Some(s) = g.slot {
            assert!(
                self.model.values().all(|l| l.slot != Some(s))
                    && self.released.iter().all(|r| r.2 != Some(s)),
                "slot {s} given twice"
            );
            assert!(
                self.tickets.iter().all(|t| t.slot() != s),
                "slot {s} reused before its blocks were freed"
            );
        }
        assert_eq!(g.expiry, self.now + self.config.lease_duration());
        self.model.insert(
            id,
            ModelLease {
                expiry: g.expiry,
                hold_until: self
                    .config
                    .max_hold()
                    .map_or(Instant::MAX, |h| self.now + h),
                nonce: g.nonce,
                slot: g.slot,
                reads: vec![(0, 0); self.ranks.len()],
            },
        );
    }

    fn model_renew(&mut self, id: usize) -> Renewal {
        let now = self.now;
        let ext = self.config.lease_extension();
        let Some(l) = self.model.get_mut(&id) else {
            return Renewal::Unknown;
        };
        let wanted = now + ext;
        let target = wanted.min(l.hold_until);
        let before = l.expiry;
        l.expiry = l.expiry.max(target);
        assert!(l.expiry >= before, "renewal shortened a lease");
        if target < wanted {
            Renewal::Capped
        } else {
            Renewal::Renewed
        }
    }

    fn read_done(&mut self, rank: u32, id: usize, consumers: u32, pick: NoncePick) {
        let current = self.held(id).map(|l| l.nonce);
        let nonce = self.pick_nonce(pick, current);
        let got = self
            .book
            .read_done(rank, self.ids[id].as_bytes(), consumers, nonce, self.now);
        let ranks = self.ranks.len();
        let want = if rank as usize >= ranks {
            ReadDoneOutcome::BadRank
        } else if let Some(l) = self.model.get_mut(&id) {
            if nonce.is_some_and(|n| n != l.nonce) {
                ReadDoneOutcome::StaleNonce
            } else {
                let (expected, seen) = &mut l.reads[rank as usize];
                if *expected != 0 && *seen >= *expected {
                    ReadDoneOutcome::Counted
                } else {
                    if *expected == 0 {
                        *expected = consumers.max(1);
                    }
                    *seen += 1;
                    if l.reads.iter().all(|(e, s)| *e != 0 && s >= e) {
                        self.model_release(id, ReleaseReason::ReadDone);
                        ReadDoneOutcome::Released
                    } else {
                        ReadDoneOutcome::Counted
                    }
                }
            }
        } else {
            ReadDoneOutcome::Unknown
        };
        assert_eq!(
            got, want,
            "read_done rank {rank} id {id} consumers {consumers} {pick:?}"
        );
    }

    fn model_release(&mut self, id: usize, reason: ReleaseReason) {
        if let Some(l) = self.model.remove(&id) {
            self.old_nonces.push(l.nonce);
            self.released.push((id, reason, l.slot));
        }
    }

    fn advance(&mut self, ms: u32) {
        self.now = self.now + Duration::from_millis(u64::from(ms));
        self.book.poll(self.now);
        let tick = self.config.wheel_tick();
        let held: Vec<usize> = self.model.keys().copied().collect();
        for id in held {
            let expiry = self.model[&id].expiry;
            let still_held = self.book.expiry(&self.ids[id]).is_some();
            if still_held {
                assert!(
                    expiry + tick > self.now,
                    "id {id} due at {expiry:?} not expired at {:?}",
                    self.now
                );
            } else {
                assert!(
                    expiry <= self.now,
                    "id {id} expired early: due {expiry:?}, now {:?}",
                    self.now
                );
                self.model_release(id, ReleaseReason::Expired);
            }
        }
    }

    fn drain(&mut self) {
        let mut reported: Vec<(String, ReleaseReason, Option<SlotTicket>)> = Vec::new();
        let ranks = &self.ranks;
        self.book.drain_released(|r| {
            if let Some(t) = &r.slot {
                for a in ranks {
                    assert_eq!(
                        a.load(t.slot()),
                        Some(0),
                        "slot {} not zeroed before report",
                        t.slot()
                    );
                }
            }
            reported.push((r.request_id.to_string(), r.reason, r.slot));
        });
        let mut want: Vec<(String, ReleaseReason, Option<u32>)> = self
            .released
            .drain(..)
            .map(|(i, r, slot)| (self.ids[i].clone(), r, slot))
            .collect();
        let mut got: Vec<(String, ReleaseReason, Option<u32>)> = reported
            .iter()
            .map(|(i, r, t)| (i.clone(), *r, t.as_ref().map(SlotTicket::slot)))
            .collect();
        let key =
            |x: &(String, ReleaseReason, Option<u32>)| (x.0.clone(), format!("{:?}", x.1), x.2);
        want.sort_by_key(key);
        got.sort_by_key(key);
        assert_eq!(got, want, "released set, each with its lease's slot");
        self.tickets
            .extend(reported.into_iter().filter_map(|(_, _, t)| t));
    }

    fn check(&self) {
        assert_eq!(self.book.held() as usize, self.model.len(), "held count");
        assert_eq!(
            self.book.pending_releases(),
            self.released.len(),
            "pending releases"
        );
        let slots = self.config.lease_slots;
        for s in 0..slots {
            let owner = self.model.values().find(|l| l.slot == Some(s));
            for (r, a) in self.ranks.iter().enumerate() {
                let want = owner.map_or(0, |l| l.nonce.get());
                assert_eq!(a.load(s), Some(want), "rank {r} slot {s}");
            }
        }
        for (id, l) in &self.model {
            assert_eq!(
                self.book.expiry(&self.ids[*id]),
                Some(l.expiry),
                "expiry of {id}"
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
        let ops: Vec<BookOp> = BookOp::decode(&bytes).collect();
        assert_eq!(ops.len(), 256);
        let mut h = BookHarness::new(0);
        for op in ops {
            h.apply(op);
        }
        assert_eq!(h.ops, 256);
    }
}
