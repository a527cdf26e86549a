//! [`LeaseBook`]: the whole P side in one process: one
//! [`PrefillScheduler`] plus the [`PrefillRank`] of every local rank, wired
//! together directly instead of through role messages.
//!
//! This module owns only the wiring. Every lease decision is the
//! scheduler's or a rank's, made by the very same code an engine with one
//! process per GPU runs in separate processes: a grant goes through the
//! scheduler's directive queue and is applied by every rank at once; a
//! rank's release report goes straight to the scheduler. So the book adds no
//! lease logic of its own, and its tests (and `testkit`'s model) exercise
//! the roles.
//!
//! ```text
//!  grant ──▶ scheduler (entry, slot, nonce) ──directives──▶ rank 0 .. rank N-1 (nonce in slot)
//!  heartbeat / read-done on rank r ──▶ rank r (its own expiry, its own counts)
//!  rank r released its share (slot zeroed) ──report──▶ scheduler
//!  every rank reported ──▶ drain_released ──▶ engine frees blocks ──▶ slot reusable
//! ```
//!
//! Calls without a rank ([`LeaseBook::renew`] and friends) act on every rank,
//! as a decoder that heartbeats every P rank it reads from does.
//!
//! # Degraded behaviour
//!
//! As the scheduler's and the ranks' (see their module docs): no free slot
//! grants without lease fields; a full book refuses with
//! [`GrantError::Full`]; an id whose previous lease is not drained yet is
//! refused with [`GrantError::ReleasePending`]; unknown ids, stale nonces,
//! duplicate or late notifications are counted no-ops.
//!
//! # Allocation
//!
//! Everything is allocated in the constructor. Grant, renew, read-done,
//! poll, drain and slot return allocate nothing (`tests/zero_alloc.rs`).

use std::sync::Arc;

use super::counters::BookCounters;
use super::inbox::InboxSummary;
use super::rank::{PrefillRank, RankError};
use super::scheduler::{
    Assignment, Grant, GrantError, LeaseStatus, PrefillScheduler, Released, SchedulerError,
    StartError,
};
use super::{ReadDoneOutcome, Renewal, ShareOutcome};
use crate::config::LeaseConfig;
use crate::nonce::{Nonce, NonceSource};
use crate::slot_pool::{SlotPool, SlotTicket};
use crate::slots::LeaseSlots;
use crate::time::Instant;
use crate::wire::WireError;

/// Why the book could not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BookError {
    /// No rank slot arrays were given.
    #[error("a lease book needs at least one rank's slot array")]
    NoRanks,
    /// A rank's slot array is smaller than the pool it takes slots from.
    #[error("rank {rank} exports {len} slots but the pool hands out {pool}")]
    SlotArrayTooSmall {
        /// The rank.
        rank: u32,
        /// Its slot count.
        len: u32,
        /// The pool's capacity.
        pool: u32,
    },
    /// The scheduler refused the parts (rank count, pool size).
    #[error("{0}")]
    Scheduler(SchedulerError),
}

/// The P side of one engine whose ranks all live in this process. See the
/// module docs.
#[derive(Debug)]
pub struct LeaseBook {
    scheduler: PrefillScheduler,
    ranks: Box<[PrefillRank]>,
    read_done_bad_rank: u64,
}

impl LeaseBook {
    /// A book for one rank with its own slot array and pool of
    /// `config.lease_slots` slots, and nonces from OS randomness.
    pub fn new(config: &LeaseConfig, now: Instant) -> LeaseBook {
        let slots = Arc::new(LeaseSlots::new(config.lease_slots));
        let pool = Arc::new(SlotPool::new(config.lease_slots));
        match LeaseBook::with_parts(config, vec![slots], pool, NonceSource::from_entropy(), now) {
            Ok(b) => b,
            // One rank, array and pool of config.lease_slots: always accepted.
            Err(e) => unreachable!("one rank with a matching pool is always accepted: {e}"),
        }
    }

    /// A book over the given per-rank slot arrays (at least one, each at
    /// least as large as the pool) sharing `pool` (exactly
    /// `kv_lease_slots` slots when verification is on), with the given nonces.
    pub fn with_parts(
        config: &LeaseConfig,
        rank_slots: Vec<Arc<LeaseSlots>>,
        pool: Arc<SlotPool>,
        nonces: NonceSource,
        now: Instant,
    ) -> Result<LeaseBook, BookError> {
        if rank_slots.is_empty() {
            return Err(BookError::NoRanks);
        }
        for (rank, s) in rank_slots.iter().enumerate() {
            if s.len() < pool.capacity() {
                return Err(BookError::SlotArrayTooSmall {
                    rank: rank as u32,
                    len: s.len(),
                    pool: pool.capacity(),
                });
            }
        }
        let scheduler =
            PrefillScheduler::with_parts(config, rank_slots.len() as u32, pool, nonces, now)
                .map_err(BookError::Scheduler)?;
        let ranks = rank_slots
            .into_iter()
            .enumerate()
            .map(|(r, s)| {
                PrefillRank::new(config, r as u32, s, now).map_err(|e| match e {
                    RankError::SlotArrayTooSmall { rank, len, needed } => {
                        BookError::SlotArrayTooSmall {
                            rank,
                            len,
                            pool: needed,
                        }
                    }
                })
            })
            .collect::<Result<Box<[_]>, _>>()?;
        Ok(LeaseBook {
            scheduler,
            ranks,
            read_done_bad_rank: 0,
        })
    }

    /// Event counts since construction: the scheduler's, and every rank's
    /// summed.
    pub fn counters(&self) -> BookCounters {
        BookCounters::combine(
            self.scheduler.counters(),
            self.ranks.iter().map(PrefillRank::counters),
            self.read_done_bad_rank,
        )
    }

    /// The scheduler role inside the book.
    pub fn scheduler(&self) -> &PrefillScheduler {
        &self.scheduler
    }

    /// Rank `rank`'s role inside the book.
    pub fn rank(&self, rank: u32) -> Option<&PrefillRank> {
        self.ranks.get(rank as usize)
    }

    /// Leases held (not yet released by every rank).
    pub fn held(&self) -> u32 {
        self.scheduler.held()
    }

    /// Released leases waiting for [`LeaseBook::drain_released`].
    pub fn pending_releases(&self) -> usize {
        self.scheduler.pending_releases()
    }

    /// The local ranks this book serves.
    pub fn ranks(&self) -> u32 {
        self.ranks.len() as u32
    }

    /// Rank `rank`'s exported slot array (register it with the fabric).
    pub fn rank_slots(&self, rank: u32) -> Option<&Arc<LeaseSlots>> {
        self.ranks.get(rank as usize).map(PrefillRank::slots)
    }

    /// The pool slots come from; give tickets back here from any thread.
    pub fn slot_pool(&self) -> &Arc<SlotPool> {
        self.scheduler.slot_pool()
    }

    /// When the lease of `request_id` first lapses on some rank (ranks renew
    /// independently); `None` when no rank holds it.
    pub fn expiry(&self, request_id: &str) -> Option<Instant> {
        self.ranks.iter().filter_map(|r| r.expiry(request_id)).min()
    }

    /// No lease expires before this instant (a lower bound; `None`: none held).
    /// An engine that idles may sleep until then.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.ranks
            .iter()
            .filter_map(PrefillRank::next_deadline)
            .min()
    }

    /// Where the lease of `request_id` stands on the scheduler, if live.
    pub fn status(&self, request_id: &str) -> Option<LeaseStatus> {
        self.scheduler.status(request_id)
    }

    /// Grants a lease to `request_id` when its prefill completes: expiry
    /// `now + kv_lease_duration`, a nonce, and (verification on, a slot free)
    /// a slot holding that nonce on every rank.
    pub fn grant(&mut self, request_id: &str, now: Instant) -> Result<Grant, GrantError> {
        let g = self.scheduler.grant(request_id, now)?;
        self.push_directives(now);
        Ok(g)
    }

    /// Assigns `request_id` its entry, slot and nonce (published on every
    /// rank now) without starting the lease: call when the prefill is first
    /// scheduled, and [`LeaseBook::start`] when it completes.
    pub fn assign(&mut self, request_id: &str, now: Instant) -> Result<Assignment, GrantError> {
        let a = self.scheduler.assign(request_id, now)?;
        self.push_directives(now);
        Ok(a)
    }

    /// Starts the lease of an assigned request (its prefill completed).
    pub fn start(&mut self, request_id: &str, now: Instant) -> Result<Instant, StartError> {
        let x = self.scheduler.start(request_id, now)?;
        self.push_directives(now);
        Ok(x)
    }

    /// Renews `request_id` on every rank, as a heartbeat to each would: the
    /// result is the best any rank reported (Renewed, else Capped, else
    /// Unknown). Never shortens a lease.
    pub fn renew(&mut self, request_id: &[u8], now: Instant) -> Renewal {
        let mut best = Renewal::Unknown;
        for r in self.ranks.iter_mut() {
            best = match (best, r.renew(request_id, now)) {
                (Renewal::Renewed, _) | (_, Renewal::Renewed) => Renewal::Renewed,
                (Renewal::Capped, _) | (_, Renewal::Capped) => Renewal::Capped,
                _ => Renewal::Unknown,
            };
        }
        best
    }

    /// Renews every id on every rank ([`PrefillRank::renew_all`]); returns
    /// (renewed, ignored) summed over the ranks.
    pub fn renew_all<'a, I>(&mut self, ids: I, now: Instant) -> (u32, u32)
    where
        I: IntoIterator<Item = &'a [u8]>,
        I::IntoIter: Clone,
    {
        let ids = ids.into_iter();
        let mut total = (0, 0);
        for r in self.ranks.iter_mut() {
            let (a, b) = r.renew_all(ids.clone(), now);
            total = (total.0 + a, total.1 + b);
        }
        total
    }

    /// Renews by (slot, nonce) on every rank; the best result any rank gave.
    pub fn renew_slot(&mut self, slot: u32, nonce: Nonce, now: Instant) -> Renewal {
        let mut best = Renewal::Unknown;
        for r in self.ranks.iter_mut() {
            best = match (best, r.renew_slot(slot, nonce, now)) {
                (Renewal::Renewed, _) | (_, Renewal::Renewed) => Renewal::Renewed,
                (Renewal::Capped, _) | (_, Renewal::Capped) => Renewal::Capped,
                _ => Renewal::Unknown,
            };
        }
        best
    }

    /// Renews every (slot, nonce) on every rank; (renewed, ignored) summed.
    pub fn renew_slots_all<I>(&mut self, entries: I, now: Instant) -> (u32, u32)
    where
        I: IntoIterator<Item = (u32, Nonce)>,
        I::IntoIter: Clone,
    {
        let entries = entries.into_iter();
        let mut total = (0, 0);
        for r in self.ranks.iter_mut() {
            let (a, b) = r.renew_slots_all(entries.clone(), now);
            total = (total.0 + a, total.1 + b);
        }
        total
    }

    /// Counts one read-done notification that local rank `rank` received
    /// from agent `sender` (`consumers`: the decoder ranks that read from
    /// that rank; each sender counts once per lease). Returns
    /// [`ReadDoneOutcome::Released`] when it completed the whole lease (every
    /// rank released its share), `Counted` when it only advanced or completed
    /// this rank's share.
    pub fn read_done(
        &mut self,
        rank: u32,
        sender: &str,
        request_id: &[u8],
        consumers: u32,
        nonce: Option<Nonce>,
        _now: Instant,
    ) -> ReadDoneOutcome {
        let Some(r) = self.ranks.get_mut(rank as usize) else {
            self.read_done_bad_rank += 1;
            return ReadDoneOutcome::BadRank;
        };
        let outcome = r.read_done(sender.as_bytes(), request_id, consumers, nonce);
        self.after_rank_event(rank, request_id, outcome)
    }

    /// Releases the lease of `request_id` now on every rank (engine shutdown,
    /// or the request was aborted on P). Returns whether it was held.
    pub fn cancel(&mut self, request_id: &str) -> bool {
        let was = self.scheduler.cancel(request_id);
        // The cancel directive's remaining lease is irrelevant: any instant does.
        self.push_directives(Instant::ZERO);
        for r in 0..self.ranks.len() as u32 {
            self.pull_reports(r);
        }
        was
    }

    /// Expires every lease whose expiry is at or before `now` on some rank,
    /// then runs the scheduler's backstop ([`PrefillScheduler::poll`]): a
    /// lease one rank let go of a `kv_lease_duration` ago while another has
    /// not is probed (its Start again: a duplicate where it is held, "not
    /// held" where it is not). Call once per step. Costs
    /// O(levels + expired + re-placed) per rank, whatever the number of
    /// leases held.
    pub fn poll(&mut self, now: Instant) {
        for r in 0..self.ranks.len() as u32 {
            self.ranks[r as usize].poll(now);
            self.pull_reports(r);
        }
        if self.scheduler.poll(now) > 0 {
            self.push_directives(now);
        }
    }

    /// Reports every released lease, oldest first, then forgets it: its id
    /// may be granted again. The slot in each report is already zero on
    /// every rank. Call once per step after `poll` and the notifications.
    pub fn drain_released(&mut self, report: impl FnMut(Released<'_>)) {
        self.scheduler.drain_released(report);
    }

    /// As [`LeaseBook::drain_released`] for an engine that frees a lease's
    /// blocks inside the callback; each slot then goes back to the pool at
    /// once ([`PrefillScheduler::drain_freed`]).
    pub fn drain_freed(&mut self, free_blocks: impl FnMut(&Released<'_>)) {
        self.scheduler.drain_freed(free_blocks);
    }

    /// The engine freed the blocks of a released lease: its slot may be
    /// reused.
    pub fn blocks_freed(&mut self, ticket: SlotTicket) {
        debug_assert!(self
            .ranks
            .iter()
            .all(|r| r.slots().load(ticket.slot()) == Some(0)));
        self.scheduler.blocks_freed(ticket);
    }

    /// Decodes one notification that local rank `rank` received from agent
    /// `sender` and applies it on that rank (see
    /// [`PrefillRank::on_notification`]); a read-done outcome is reported as
    /// [`LeaseBook::read_done`] reports it.
    pub fn on_notification(
        &mut self,
        rank: u32,
        sender: &str,
        msg: &[u8],
        now: Instant,
    ) -> Result<InboxSummary<ReadDoneOutcome>, WireError> {
        let Some(r) = self.ranks.get_mut(rank as usize) else {
            // A notification for a rank the book does not have: decode it
            // for the caller's error, count it as a bad rank.
            let decoded = crate::wire::decode(msg).map(|_| ());
            self.read_done_bad_rank += 1;
            decoded?;
            return Ok(InboxSummary {
                read_done: Some(ReadDoneOutcome::BadRank),
                ..InboxSummary::default()
            });
        };
        let summary = r.on_notification(sender, msg, now)?;
        let read_done = match summary.read_done {
            Some(outcome) => {
                // The id was in the message; the rank's outcome is per rank.
                let id = match crate::wire::decode(msg) {
                    Ok(crate::wire::Notification::ReadDone(rd)) => rd.request_id,
                    _ => "",
                };
                Some(self.after_rank_event(rank, id.as_bytes(), outcome))
            }
            // No read-done: the rank's reports (none from a heartbeat) are
            // still forwarded at the next event or poll.
            None => None,
        };
        Ok(InboxSummary {
            renewed: summary.renewed,
            ignored: summary.ignored,
            read_done,
        })
    }

    /// Forwards rank `rank`'s reports and turns its read-done outcome into
    /// the book's: `Released` only when the whole lease is.
    fn after_rank_event(
        &mut self,
        rank: u32,
        request_id: &[u8],
        outcome: ShareOutcome,
    ) -> ReadDoneOutcome {
        self.pull_reports(rank);
        if outcome != ShareOutcome::ShareReleased {
            return ReadDoneOutcome::from_share(outcome);
        }
        let id = core::str::from_utf8(request_id).unwrap_or("");
        match self.scheduler.status(id) {
            Some(LeaseStatus::Released(_)) => ReadDoneOutcome::Released,
            _ => ReadDoneOutcome::Counted,
        }
    }

    fn push_directives(&mut self, now: Instant) {
        let ranks = &mut self.ranks;
        self.scheduler.drain_directives(now, |d| {
            for r in ranks.iter_mut() {
                r.apply(d, now);
            }
        });
        // A directive may release a rank's share (cancel, or a conflict).
        for r in 0..self.ranks.len() as u32 {
            self.pull_reports(r);
        }
    }

    fn pull_reports(&mut self, rank: u32) {
        let Some(r) = self.ranks.get_mut(rank as usize) else {
            return;
        };
        let scheduler = &mut self.scheduler;
        r.drain_reports(|rep| {
            scheduler.on_report(rank, rep);
        });
    }
}
