//! The harness's operations on the real roles, each mirrored on the
//! reference model: assign, start, cancel, heartbeats, slot renewals,
//! read-dones.

use super::*;

impl RolesHarness {
    pub(super) fn live_count(&self) -> usize {
        self.model.len()
    }

    pub(super) fn assign(&mut self, id: usize, start: bool) {
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
                limit: Instant::MAX,
                backstop: None,
                armed_at: Instant::ZERO,
                straggling: false,
            },
        );
        // The backstop's pinned rule: the ranks let a lease that never
        // starts go at max_pin; a duration later it is cancelled.
        let (now, limit) = (
            self.now,
            self.now + self.config.max_pin + self.config.lease_duration(),
        );
        if let Some(l) = self.model.get_mut(&id) {
            l.limit = limit;
            l.arm(limit, now);
        }
        if start {
            self.model_start(id);
        }
    }

    pub(super) fn model_start(&mut self, id: usize) {
        let (now, dur, hold) = (
            self.now,
            self.config.lease_duration(),
            self.config.max_hold(),
        );
        if let Some(l) = self.model.get_mut(&id) {
            let hold_until = hold.map_or(Instant::MAX, |h| now + h);
            l.started = Some((now + dur, hold_until));
            l.start_pending = true;
            // The pinned rule is over: the held rule (with max_hold) takes
            // its place, and a rank's let-go before the start counts now.
            l.limit = hold_until + dur;
            l.backstop = None;
            let limit = l.limit;
            l.arm(limit, now);
            if l.let_gos() > 0 {
                l.straggling = true;
            }
        }
    }

    pub(super) fn start(&mut self, id: usize) {
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

    pub(super) fn cancel(&mut self, id: usize) {
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
            l.backstop = None;
            l.straggling = false;
            let entry = (id, ReleaseReason::Cancelled, l.slot, l.nonce);
            self.released.push(entry);
        } else {
            l.cancel_pending = true;
        }
    }

    /// The model's renewal of `id` on rank `r`; the expected outcome.
    pub(super) fn model_renew(&mut self, id: usize, r: usize) -> Renewal {
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

    pub(super) fn heartbeat(&mut self, mask: u8, ranks: u8) {
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
            let got = self.ranks[r].on_notification("d0", &msg, self.now);
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

    pub(super) fn renew_slot(&mut self, slot: u8, pick: NoncePick, ranks: u8) {
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

    pub(super) fn read_done(
        &mut self,
        rank: usize,
        sender: u8,
        id: usize,
        consumers: u32,
        pick: NoncePick,
    ) {
        if rank >= self.n_ranks() {
            return;
        }
        let held = self
            .model
            .get(&id)
            .and_then(|l| l.ranks[rank].as_ref().map(|_| l.nonce));
        let nonce = self.pick_nonce(pick, held);
        let from = format!("d{sender}");
        let got =
            self.ranks[rank].read_done(from.as_bytes(), self.ids[id].as_bytes(), consumers, nonce);
        let want = match (self.model.get_mut(&id), held) {
            (Some(l), Some(current)) => {
                if nonce.is_some_and(|n| n != current) {
                    ShareOutcome::StaleNonce
                } else {
                    match l.ranks[rank].as_mut() {
                        Some(rl) if rl.readers & (1 << sender) != 0 => {
                            ShareOutcome::DuplicateSender
                        }
                        Some(rl) => {
                            rl.readers |= 1 << sender;
                            let (expected, seen) = &mut rl.reads;
                            if *expected == 0 {
                                *expected = consumers.max(1);
                            }
                            *seen += 1;
                            if *seen >= *expected {
                                self.model_rank_release(id, rank, ReleaseReason::ReadDone);
                                ShareOutcome::ShareReleased
                            } else {
                                ShareOutcome::Counted
                            }
                        }
                        None => ShareOutcome::Unknown,
                    }
                }
            }
            _ => ShareOutcome::Unknown,
        };
        assert_eq!(
            got, want,
            "read_done rank {rank} from d{sender} id {id} consumers {consumers} {pick:?}"
        );
    }
}
