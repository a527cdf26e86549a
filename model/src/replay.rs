//! The model's honesty check: this module owns the replay of a model trace
//! on the real P roles, and the comparison of what both observe. It drives
//! the roles only through their public API and changes nothing in them.
//!
//! [`Replay`] runs one real [`PrefillScheduler`] and [`RANKS`] real
//! [`PrefillRank`]s, wired as an engine with one process per worker: the
//! scheduler's directives reach the ranks as bytes (a directive message the
//! model loses on its way to one rank is not applied there), the ranks'
//! reports reach the scheduler as bytes, notifications reach a rank as wire
//! bytes from a named sender (`HB:`; read-done with nonce and the mapping's
//! consumer count, from D worker `w`'s agent `d{w}`), cancels go through
//! [`PrefillScheduler::cancel`], the backstop's probes through
//! [`PrefillScheduler::probe`] (its arming is compared after every step, its
//! timing is abstracted), and time is the real [`Instant`] arithmetic (one model tick = [`TICK_SECS`] s, `kv_lease_duration` =
//! 6 s). Each model action is applied to the real roles, and then every
//! observable the model claims is compared: each live rank's slot words,
//! which leases it holds and each one's time left, the scheduler's held
//! count and lease statuses, each grant's slot and nonce, each drained
//! lease's reason and slot ticket, and each D worker's slot checks against
//! the real words (the verifier's decision: a check passes exactly when the
//! word READ holds the nonce).
//!
//! D itself is not replayed (its tracker, sender and verifier hold fabrics
//! and registered memory); the model's D only decides from P's slot words,
//! which is what this compares.
//!
//! Built with `--features mutant_...`, the real roles carry that bug,
//! and [`Replay::mutant`] says which model mutant mirrors it, so the replay
//! also checks that each model mutant is the real bug.

use std::sync::Arc;
use std::time::Duration;

use kvlease::producer::LeaseStatus;
use kvlease::topology::TpMapping;
use kvlease::{
    EngineShape, Instant, LeaseConfig, LeaseSlots, PrefillRank, PrefillScheduler, ReleaseReason,
    SlotPool, SlotTicket,
};

use crate::{
    nonce_of, nonce_source, Action, Bound, DReq, Msg, Mutant, Phase, State, Worker, N, RANKS,
    TICK_SECS,
};

/// The real roles, driven by a model trace.
pub struct Replay {
    config: LeaseConfig,
    slots: u32,
    epoch: u8,
    /// The model's time, in real units: ticks × [`TICK_SECS`].
    now: Instant,
    /// Read-dones each P rank waits for (the `<n>` D sends).
    consumers: u32,
    sched: PrefillScheduler,
    ranks: Vec<Option<PrefillRank>>,
    ids: Vec<String>,
    /// Per request: the slot ticket of its drained lease, until freed.
    tickets: Vec<Option<SlotTicket>>,
    /// Per request: the reason and ticket slot its drain reported.
    drained: Vec<Option<(ReleaseReason, Option<u32>)>>,
    buf: Vec<u8>,
}

impl Replay {
    /// The model mutant that mirrors the bug this build's real code carries.
    pub fn mutant() -> Option<Mutant> {
        if cfg!(feature = "mutant_zero_after_report") {
            Some(Mutant::ZeroAfterReport)
        } else if cfg!(feature = "mutant_reuse_before_free") {
            Some(Mutant::ReuseBeforeFree)
        } else if cfg!(feature = "mutant_free_on_first_report") {
            Some(Mutant::FreeOnFirstReport)
        } else if cfg!(feature = "mutant_count_per_rank") {
            Some(Mutant::CountPerRank)
        } else if cfg!(feature = "mutant_ignore_not_held") {
            Some(Mutant::IgnoreNotHeld)
        } else {
            None
        }
    }

    /// The real roles for a model of `bound` (its requests, slots and D TP).
    pub fn new(bound: &Bound) -> Result<Replay, String> {
        let (requests, slots) = (bound.requests, bound.slots);
        let consumers = TpMapping::new(u32::from(bound.d_tp), RANKS as u32)
            .map_err(|e| format!("D TP {}: {e}", bound.d_tp))?
            .consumers_per_p_rank();
        let mut config = LeaseConfig::new(EngineShape {
            num_kv_blocks: u32::from(slots),
            max_num_seqs: 0,
        });
        config.lease_duration = Duration::from_secs(3 * TICK_SECS);
        config.lease_capacity = u32::from(requests).max(u32::from(slots));
        config.max_request_id_len = 8;
        config
            .validate()
            .map_err(|e| format!("replay config: {e}"))?;
        let (sched, ranks) = roles(&config, 0)?;
        Ok(Replay {
            slots: config.lease_slots,
            config,
            epoch: 0,
            now: Instant::ZERO,
            consumers,
            sched,
            ranks,
            ids: (0..requests).map(|i| format!("req-{i}")).collect(),
            tickets: (0..requests).map(|_| None).collect(),
            drained: vec![None; usize::from(requests)],
            buf: vec![0; 1 << 12],
        })
    }

    /// Applies `action` (taken by the model from `before` to `after`) to the
    /// real roles, then compares them with `after`.
    pub fn step(&mut self, before: &State, action: Action, after: &State) -> Result<(), String> {
        match action {
            Action::Grant(i) => self.grant(usize::from(i), None, after)?,
            Action::GrantMissedBy(i, r) => {
                self.grant(usize::from(i), Some(usize::from(r)), after)?
            }
            Action::Cancel(i) => self.cancel(usize::from(i), None)?,
            Action::CancelMissedBy(i, r) => self.cancel(usize::from(i), Some(usize::from(r)))?,
            // The backstop's probe is `probe`'s (the same entry path); that
            // the real scheduler armed it for this lease exactly when the
            // model's lease was let go by some rank, `compare` checks after
            // every step.
            Action::Backstop(i) => self.probe(usize::from(i), None)?,
            Action::BackstopMissedBy(i, r) => self.probe(usize::from(i), Some(usize::from(r)))?,
            Action::RankLost(r) => {
                self.sched.rank_lost(u32::from(r));
                self.drain();
            }
            Action::FreeBlocks(i) => {
                if let Some(t) = self.tickets[usize::from(i)].take() {
                    self.sched.blocks_freed(t);
                }
            }
            Action::Poll(r) => {
                // Two wheel ticks past the model's instant: expiry is late
                // by at most one tick, and no deadline falls in between.
                let at = self.now + 2 * self.config.wheel_tick();
                if let Some(rank) = self.ranks[usize::from(r)].as_mut() {
                    rank.poll(at);
                }
                self.pump()?;
            }
            Action::Tick => self.now = self.now + Duration::from_secs(TICK_SECS),
            Action::Deliver(m) => self.deliver(m)?,
            Action::CheckSlot(i, w, r) => self.check_slot(
                before,
                (usize::from(i), usize::from(w), usize::from(r)),
                after,
            )?,
            Action::CrashRank(r) => self.ranks[usize::from(r)] = None,
            Action::RestartP => {
                self.epoch += 1;
                let (sched, ranks) = roles(&self.config, self.epoch)?;
                self.sched = sched;
                self.ranks = ranks;
                self.tickets.iter_mut().for_each(|t| *t = None);
            }
            // D's own steps and the network's faults touch no P role.
            Action::Heartbeat
            | Action::StartRead(..)
            | Action::Drop(_)
            | Action::Duplicate(_)
            | Action::CrashD => {}
        }
        self.compare(after)
    }

    /// The scheduler grants request `i`; its directive message reaches
    /// every live rank but `missed`.
    fn grant(&mut self, i: usize, missed: Option<usize>, after: &State) -> Result<(), String> {
        let g = self
            .sched
            .grant(&self.ids[i], self.now)
            .map_err(|e| format!("real grant of request {i} refused: {e}"))?;
        let want = after.sched.leases[i].ok_or("model did not grant")?;
        if g.fields.map(|f| f.slot) != want.slot.map(u32::from)
            || g.nonce != nonce_of(want.nonce.epoch, want.nonce.draw)
        {
            return Err(format!(
                "grant {i}: real slot {:?} nonce {:?}, model {want:?}",
                g.fields.map(|f| f.slot),
                g.nonce
            ));
        }
        self.directives(missed)
    }

    /// The engine cancels request `i`'s lease; the directive message reaches
    /// every live rank but `missed`, and their answers go up at once.
    fn cancel(&mut self, i: usize, missed: Option<usize>) -> Result<(), String> {
        if !self.sched.cancel(&self.ids[i]) {
            return Err(format!("real cancel of request {i} found no live lease"));
        }
        self.directives(missed)
    }

    /// The backstop probes request `i`'s lease (its Start again); the
    /// directive message reaches every live rank but `missed`, and their
    /// answers go up at once.
    fn probe(&mut self, i: usize, missed: Option<usize>) -> Result<(), String> {
        if !self.sched.probe(&self.ids[i]) {
            return Err(format!("real probe of request {i} found no started lease"));
        }
        self.directives(missed)
    }

    /// This step's directive message to every live rank but `missed`, then
    /// every rank's reports up and the drain.
    fn directives(&mut self, missed: Option<usize>) -> Result<(), String> {
        let n = self
            .sched
            .encode_directives(self.now, &mut self.buf)
            .map_err(|e| format!("directives: {e}"))?;
        let msg = self.buf[..n].to_vec();
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            let Some(rank) = rank.as_mut() else {
                continue;
            };
            if missed == Some(r) {
                continue;
            }
            rank.apply_directives(&msg, self.now)
                .map_err(|e| format!("rank {r} refused directives: {e}"))?;
        }
        self.pump()
    }

    fn deliver(&mut self, m: Msg) -> Result<(), String> {
        match m {
            Msg::Params { .. } => {}
            Msg::Heartbeat { epoch, rank, reqs } => {
                if epoch != self.epoch {
                    return Ok(());
                }
                let mut msg = b"HB:".to_vec();
                let names: Vec<&str> = (0..self.ids.len())
                    .filter(|i| reqs & (1 << i) != 0)
                    .map(|i| self.ids[i].as_str())
                    .collect();
                msg.extend_from_slice(names.join(",").as_bytes());
                if let Some(rank) = self.ranks[usize::from(rank)].as_mut() {
                    rank.on_notification("decode", &msg, self.now)
                        .map_err(|e| format!("heartbeat refused: {e}"))?;
                }
            }
            Msg::ReadDone {
                rank,
                req,
                nonce,
                sender,
            } => {
                if nonce.epoch != self.epoch {
                    return Ok(());
                }
                let real = nonce_of(nonce.epoch, nonce.draw);
                let n = kvlease::wire::encode_read_done(
                    &self.ids[usize::from(req)],
                    self.consumers,
                    Some(real),
                    &mut self.buf,
                )
                .map_err(|e| format!("read-done encode: {e}"))?;
                let msg = self.buf[..n].to_vec();
                let from = format!("d{sender}");
                if let Some(rank) = self.ranks[usize::from(rank)].as_mut() {
                    rank.on_notification(&from, &msg, self.now)
                        .map_err(|e| format!("read-done refused: {e}"))?;
                }
                self.pump()?;
            }
        }
        Ok(())
    }

    /// D worker `w`'s slot READ of rank `r` for request `i`: the verifier
    /// passes a rank exactly when the word it READ holds the nonce.
    fn check_slot(
        &mut self,
        before: &State,
        (i, w, r): (usize, usize, usize),
        after: &State,
    ) -> Result<(), String> {
        let DReq::Tracked { pull, workers } = before.d.reqs[i] else {
            return Err(format!("model checked request {i} while D did not know it"));
        };
        let Worker::Reading {
            checks: earlier, ..
        } = workers[w]
        else {
            return Err(format!(
                "model checked request {i} while worker {w} was not reading"
            ));
        };
        let Some(slot) = pull.slot else {
            return Err("model checked a slot-less pull".into());
        };
        let real_ok = pull.nonce.epoch == self.epoch
            && self.ranks[r].as_ref().is_some_and(|rank| {
                rank.slots().load(u32::from(slot))
                    == Some(nonce_of(pull.nonce.epoch, pull.nonce.draw).get())
            });
        let model_ok = match after.d.reqs[i] {
            DReq::Tracked { workers, .. } => match workers[w] {
                Worker::Reading { checks, .. } => checks[r],
                Worker::Done { accepted, .. } => {
                    // The last check decided: it passed iff all did.
                    let others_ok = earlier
                        .iter()
                        .enumerate()
                        .all(|(k, c)| k == r || c.is_none() || *c == Some(true));
                    if accepted {
                        Some(true)
                    } else if others_ok {
                        Some(false)
                    } else {
                        None
                    }
                }
                _ => None,
            },
            DReq::Unknown => None,
        };
        if model_ok.is_some_and(|m| m != real_ok) {
            return Err(format!(
                "slot check of request {i} by worker {w} on rank {r}: real word says {real_ok}, model {model_ok:?}"
            ));
        }
        Ok(())
    }

    /// Every rank's reports to the scheduler (as bytes), then the drain.
    fn pump(&mut self) -> Result<(), String> {
        for r in 0..RANKS {
            let Some(rank) = self.ranks[r].as_mut() else {
                continue;
            };
            let n = rank
                .encode_reports(&mut self.buf)
                .map_err(|e| format!("reports: {e}"))?;
            let msg = self.buf[..n].to_vec();
            self.sched
                .apply_reports(r as u32, &msg)
                .map_err(|e| format!("scheduler refused rank {r}'s reports: {e}"))?;
        }
        self.drain();
        Ok(())
    }

    fn drain(&mut self) {
        let ids = &self.ids;
        let tickets = &mut self.tickets;
        let drained = &mut self.drained;
        self.sched.drain_released(|rel| {
            // Every released id is one of ours (the replay grants no other).
            if let Some(i) = ids.iter().position(|x| x == rel.request_id) {
                drained[i] = Some((rel.reason, rel.slot.as_ref().map(SlotTicket::slot)));
                tickets[i] = rel.slot;
            }
        });
    }

    /// Compares every observable of the real roles with the model's `s`.
    fn compare(&mut self, s: &State) -> Result<(), String> {
        if s.sched.epoch != self.epoch {
            return Err("epochs differ".into());
        }
        // The backstop's poll at the scheduler's first instant: it stamps
        // the let-gos seen so far (deadline one lease duration on) and can
        // fire nothing, so its timing stays out of the replay (the model
        // abstracts it; tests/it/stuck_leases.rs pins it).
        let fired = self.sched.poll(Instant::ZERO);
        if fired != 0 {
            return Err(format!(
                "the backstop queued {fired} directives at time zero"
            ));
        }
        for r in 0..RANKS {
            let model = &s.ranks[r];
            let Some(rank) = self.ranks[r].as_ref() else {
                if model.alive {
                    return Err(format!("rank {r}: dead for real, alive in the model"));
                }
                continue;
            };
            if !model.alive {
                return Err(format!("rank {r}: alive for real, dead in the model"));
            }
            for slot in 0..self.slots {
                let want = model.words[slot as usize].map_or(0, |n| real(n).get());
                let got = rank.slots().load(slot);
                if got != Some(want) {
                    return Err(format!(
                        "rank {r} slot {slot}: real word {got:?}, model {want} ({:?})",
                        model.words[slot as usize]
                    ));
                }
            }
            let mut held = 0;
            for (i, h) in model.held.iter().enumerate() {
                let real_expiry = rank.expiry(&self.ids[i]);
                match (h, real_expiry) {
                    (None, None) => {}
                    (Some(l), Some(x)) => {
                        held += 1;
                        let left = x.saturating_duration_since(self.now);
                        let want = Duration::from_secs(u64::from(l.left) * TICK_SECS);
                        if left != want {
                            return Err(format!(
                                "rank {r} request {i}: real time left {left:?}, model {want:?}"
                            ));
                        }
                    }
                    (h, x) => {
                        return Err(format!(
                            "rank {r} request {i}: real expiry {x:?}, model lease {h:?}"
                        ))
                    }
                }
            }
            if rank.held() != held {
                return Err(format!(
                    "rank {r}: real holds {}, model {held}",
                    rank.held()
                ));
            }
        }
        let mut held = 0;
        for (i, l) in s.sched.leases.iter().enumerate() {
            let status = self.sched.status(&self.ids[i]);
            let Some(l) = l else {
                if status.is_some() {
                    return Err(format!("request {i}: real lease {status:?}, model none"));
                }
                continue;
            };
            if l.nonce.epoch != self.epoch {
                if status.is_some() {
                    return Err(format!("request {i}: lost with P, real {status:?}"));
                }
                continue;
            }
            match l.phase {
                Phase::Held => {
                    held += 1;
                    if status != Some(LeaseStatus::Held) {
                        return Err(format!("request {i}: real {status:?}, model held"));
                    }
                    let armed = self.sched.backstop_deadline(&self.ids[i]).is_some();
                    let let_go = l.reported.iter().any(|r| *r);
                    if armed != let_go {
                        return Err(format!(
                            "request {i}: real backstop armed {armed}, model let go by {:?}",
                            l.reported
                        ));
                    }
                }
                Phase::Drained { ticket } => {
                    let want = (l.reason, ticket.map(u32::from));
                    let got = self.drained[i];
                    if status.is_some() || got.map(|(r, t)| (Some(r), t)) != Some(want) {
                        return Err(format!(
                            "request {i}: real {status:?} drained {got:?}, model drained {want:?}"
                        ));
                    }
                }
                Phase::Freed => {
                    if status.is_some() || self.tickets[i].is_some() {
                        return Err(format!("request {i}: real {status:?}, model freed"));
                    }
                }
                Phase::Lost => {}
            }
        }
        if self.sched.held() != held {
            return Err(format!(
                "scheduler: real holds {}, model {held}",
                self.sched.held()
            ));
        }
        Ok(())
    }
}

fn real(n: N) -> kvlease::Nonce {
    nonce_of(n.epoch, n.draw)
}

fn roles(
    config: &LeaseConfig,
    epoch: u8,
) -> Result<(PrefillScheduler, Vec<Option<PrefillRank>>), String> {
    let pool = Arc::new(SlotPool::new(config.lease_slots));
    let sched = PrefillScheduler::with_parts(
        config,
        RANKS as u32,
        pool,
        nonce_source(epoch),
        Instant::ZERO,
    )
    .map_err(|e| format!("scheduler: {e}"))?;
    let mut ranks = Vec::new();
    for r in 0..RANKS as u32 {
        let slots = Arc::new(LeaseSlots::new(config.lease_slots));
        let rank = PrefillRank::new(config, r, slots, Instant::ZERO)
            .map_err(|e| format!("rank {r}: {e}"))?;
        ranks.push(Some(rank));
    }
    Ok((sched, ranks))
}

/// Replays the whole `trace` (as [`crate::ProtocolModel::successors`]
/// produced it from the initial state) on fresh real roles; the first
/// disagreement, with the step it happened at.
pub fn replay_trace(
    initial: &State,
    trace: &[(Action, State)],
    bound: &Bound,
) -> Result<(), String> {
    let mut replay = Replay::new(bound)?;
    let mut before = initial;
    for (k, (action, after)) in trace.iter().enumerate() {
        replay
            .step(before, *action, after)
            .map_err(|e| format!("step {} ({action:?}): {e}", k + 1))?;
        before = after;
    }
    Ok(())
}
