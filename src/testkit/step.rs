//! The harness's engine step: role messages carried between the real
//! scheduler and ranks, time advanced, releases drained, and every
//! invariant checked against the model.

use super::*;

impl RolesHarness {
    /// Rank `r` lets go of `id`: its slot word must already be zero.
    pub(super) fn model_rank_release(&mut self, id: usize, r: usize, reason: ReleaseReason) {
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

    /// One step's IPC; the ranks whose bits are set in `lose` never get
    /// this step's directive message.
    pub(super) fn step(&mut self, lose: u8) {
        // The backstop first, as an engine calls it: its directives go out
        // in this step's message.
        self.poll();
        // Directives down: the same bytes to every rank (that gets them).
        let n = match self.scheduler.encode_directives(self.now, &mut self.buf) {
            Ok(n) => n,
            Err(e) => panic!("directives did not fit a 64 KiB buffer: {e}"),
        };
        let msg = self.buf[..n].to_vec();
        for rank in &mut self.ranks {
            if lose & (1 << rank.rank()) != 0 {
                continue;
            }
            if let Err(e) = rank.apply_directives(&msg, self.now) {
                panic!(
                    "rank {} refused the scheduler's directives: {e}",
                    rank.rank()
                );
            }
        }
        self.model_directives(lose);
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

    /// The model's view of one directive message, delivered to every rank
    /// but those in `lose`. A rank answers a Grant it refuses (rank 2 of
    /// three stores ids of at most 3 bytes), and a Start or Cancel for a
    /// lease it does not hold, with "not held".
    pub(super) fn model_directives(&mut self, lose: u8) {
        let now = self.now;
        let max_pin = self.config.max_pin;
        let ids: Vec<usize> = self.model.keys().copied().collect();
        for id in ids {
            let n = self.n_ranks();
            let long_id = self.ids[id].len() > 3;
            let Some(l) = self.model.get_mut(&id) else {
                continue;
            };
            let gets = |r: usize| lose & (1 << r) == 0;

            if l.grant_pending {
                l.grant_pending = false;
                let (deadline, hold) = match (l.started, l.start_pending) {
                    (Some((x, h)), true) => {
                        // A Start queued with its Grant travels inside it.
                        l.start_pending = false;
                        (Some(x.max(now)), h.max(now))
                    }
                    _ => (None, Instant::MAX),
                };
                for r in 0..n {
                    if !gets(r) {
                        continue;
                    }
                    if r == 2 && long_id {
                        not_held(l, r);
                        continue;
                    }
                    l.ranks[r] = Some(RankLease {
                        deadline,
                        floor: Instant::ZERO,
                        hold_until: hold,
                        pinned_until: now + max_pin,
                        reads: (0, 0),
                        readers: 0,
                    });
                }
            }
            if l.start_pending {
                l.start_pending = false;
                if let Some((x, h)) = l.started {
                    for r in 0..n {
                        if !gets(r) {
                            continue;
                        }
                        match l.ranks[r].as_mut() {
                            Some(rl) if rl.deadline.is_none() => {
                                rl.deadline = Some(rl.floor.max(x.max(now)));
                                rl.hold_until = h.max(now);
                            }
                            Some(_) => {}
                            None => not_held(l, r),
                        }
                    }
                }
            }
            if l.cancel_pending {
                l.cancel_pending = false;
                let holders: Vec<bool> = l.ranks.iter().map(Option::is_some).collect();
                for (r, holds) in holders.into_iter().enumerate() {
                    if !gets(r) {
                        continue;
                    }
                    if holds {
                        self.model_rank_release(id, r, ReleaseReason::Cancelled);
                    } else if let Some(l) = self.model.get_mut(&id) {
                        not_held(l, r);
                    }
                }
            }
        }
    }

    pub(super) fn model_reports(&mut self, r: usize) {
        for (&id, l) in self.model.iter_mut() {
            let Some(reason) = l.unreported[r].take() else {
                continue;
            };
            // Released already, or a second answer from this rank (a "not
            // held" after its expiry was reported): the scheduler ignores it.
            if l.reason.is_some() || l.reported[r] {
                continue;
            }
            l.reported[r] = true;
            l.combined = Some(l.combined.map_or(reason, |x| x.combine(reason)));
            if l.reported.iter().all(|x| *x) {
                let why = l.combined.unwrap_or(reason);
                l.reason = Some(why);
                l.cancel_pending = false;
                l.start_pending = false;
                l.backstop = None;
                l.straggling = false;
                self.released.push((id, why, l.slot, l.nonce));
            } else if l.let_gos() == 1 {
                // The first let-go starts the straggler rule.
                l.straggling = true;
            }
        }
    }

    pub(super) fn advance(&mut self, ms: u32) {
        self.now = self.now + Duration::from_millis(u64::from(ms));
        let tick = self.config.wheel_tick();
        for r in 0..self.n_ranks() {
            self.ranks[r].poll(self.now);
            let held: Vec<usize> = self
                .model
                .iter()
                .filter(|(_, l)| l.ranks[r].is_some())
                .map(|(i, _)| *i)
                .collect();
            for id in held {
                // A started lease by its deadline, a pinned one by its
                // kv_lease_max_pin.
                let Some(deadline) = self.model[&id].ranks[r]
                    .as_ref()
                    .map(|x| x.deadline.unwrap_or(x.pinned_until))
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

    pub(super) fn drain(&mut self) {
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

    pub(super) fn check(&self) {
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
            let armed = if l.reason.is_some() { None } else { l.backstop };
            assert_eq!(
                self.scheduler.backstop_deadline(&self.ids[*id]),
                armed,
                "backstop of {id}"
            );
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

/// Rank `r` answers a directive for a lease it does not hold: "not held",
/// unless it already has a release of that lease on its way.
fn not_held(l: &mut ModelLease, r: usize) {
    if l.unreported[r].is_none() && !l.reported[r] {
        l.unreported[r] = Some(ReleaseReason::NotHeld);
    }
}
