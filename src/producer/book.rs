//! [`LeaseBook`]: every lease one P engine holds, driven by its engine loop.
//!
//! This module owns the lifecycle of a lease (DESIGN.md, "Lifecycle of one
//! lease"): grant, renew, read-done, expire, cancel, report, slot return. It
//! writes the exported lease slots of every local rank, takes slots from and
//! returns them to the [`SlotPool`], and schedules expiries on its own
//! [`TimerWheel`]. It does not decode bytes off the wire (see `wire`) and
//! never reads a clock: every call takes `now`.
//!
//! ```text
//!  grant ──▶ HELD ──renew──▶ HELD (expiry = max(expiry, min(now + extension, grant + max_hold)))
//!            HELD ──read-done × consumers, on every rank──▶ RELEASED(read)
//!            HELD ──wheel fires, expiry <= now──────────▶ RELEASED(expired)
//!            HELD ──cancel──────────────────────────────▶ RELEASED(cancelled)
//!  RELEASED: slot zeroed on every rank, then queued ──drain_released──▶ reported to the engine
//!  engine frees the blocks ──give the SlotTicket back──▶ slot reusable
//! ```
//!
//! # One book per P engine, ranks inside it
//!
//! DESIGN.md sketches one book per worker. A lease slot, though, must have
//! the same index and nonce on every rank, because `kv_transfer_params`
//! carries one `remote_lease_slot` for the request; and a lease is released
//! only when every rank's readers are done. So one book serves all local
//! ranks of an engine: it writes the nonce into the slot array of every rank,
//! counts read-done notifications per rank (each rank's notification carries
//! the number of decoders that read from that rank), and releases when every
//! rank reached its count. An engine whose ranks live in separate processes
//! shares the slot arrays through shared memory or runs one book per rank
//! with `ranks = 1`.
//!
//! # Nonces without slots
//!
//! Every lease gets a nonce, even one granted without a slot (verification
//! off, or the pool empty). It is only exported with a slot, but it lets the
//! book refuse a late read-done that carries the nonce of an earlier request
//! with the same id.
//!
//! # Degraded behaviour on exhaustion
//!
//! - **No free slot**: the lease is granted without verification fields
//!   ([`Grant::lease_fields`] is `None`); verifying decoders decline its KV
//!   and recompute. Counted in `granted_without_slot`.
//! - **Book full** (`kv_lease_capacity` leases held): [`GrantError::Full`].
//!   The request is *not* leased: the engine should free its blocks now and
//!   answer without remote-decode `kv_transfer_params`, so the decoder
//!   recomputes. The default capacity (KV blocks + max_num_seqs) cannot be
//!   reached, since every held lease holds at least one block.
//!
//! # Allocation
//!
//! Everything is allocated in [`LeaseBook::new`]. Grant, renew, read-done,
//! poll, drain and slot return allocate nothing (`tests/zero_alloc.rs`).

use core::time::Duration;

use crate::config::LeaseConfig;
use crate::ids::{IdError, IdTable};
use crate::nonce::{Nonce, NonceSource};
use crate::producer::counters::BookCounters;
use crate::producer::release_queue::ReleaseQueue;
use crate::slot_pool::{SlotPool, SlotTicket};
use crate::slots::LeaseSlots;
use crate::time::Instant;
use crate::wheel::TimerWheel;
use std::sync::Arc;

const NIL: u32 = u32::MAX;

/// Why a lease ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseReason {
    /// Every expected reader reported the READ done.
    ReadDone,
    /// No heartbeat kept it alive.
    Expired,
    /// The engine cancelled it.
    Cancelled,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Held,
    Released(ReleaseReason),
}

/// Per-lease state. The expiry lives in the wheel entry only (one place to
/// read and raise on a heartbeat), and only held leases are in the id index,
/// so a renewal by id touches the index cell, the id bytes and the wheel
/// entry, and never this struct unless `kv_lease_max_hold` is set.
#[derive(Debug)]
struct Lease {
    state: State,
    /// Renewals never push the expiry past this (grant + max_hold, or MAX).
    hold_until: Instant,
    nonce: Nonce,
    slot: Option<SlotTicket>,
    /// Ranks whose readers are all done.
    ranks_done: u32,
}

/// What a grant gave the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The slot, when the lease is verifiable.
    pub slot: Option<u32>,
    /// The lease's nonce (exported only together with a slot).
    pub nonce: Nonce,
    /// When the lease expires unless renewed.
    pub expiry: Instant,
}

impl Grant {
    /// `(remote_lease_slot, remote_lease_nonce)` for `kv_transfer_params`,
    /// or `None` when the lease cannot be verified (omit both fields).
    pub fn lease_fields(&self) -> Option<(u32, Nonce)> {
        self.slot.map(|s| (s, self.nonce))
    }
}

/// Why a grant was refused. The request is not leased; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrantError {
    /// The book holds `kv_lease_capacity` leases (including released ones
    /// not yet drained).
    Full,
    /// The request id is empty or longer than `kv_lease_max_request_id_len`.
    BadId(IdError),
    /// A lease with this id is held. (A released lease's id may be granted
    /// again at once, even before its release is drained.)
    Duplicate,
}

impl core::fmt::Display for GrantError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            GrantError::Full => f.write_str("lease book full (kv_lease_capacity)"),
            GrantError::BadId(e) => write!(f, "bad request id: {e}"),
            GrantError::Duplicate => f.write_str("request id already leased"),
        }
    }
}

impl std::error::Error for GrantError {}

/// Why the book could not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BookError {
    /// No rank slot arrays were given.
    NoRanks,
    /// A rank's slot array is smaller than the pool it takes slots from.
    SlotArrayTooSmall {
        /// The rank.
        rank: u32,
        /// Its slot count.
        len: u32,
        /// The pool's capacity.
        pool: u32,
    },
}

impl core::fmt::Display for BookError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            BookError::NoRanks => f.write_str("a lease book needs at least one rank's slot array"),
            BookError::SlotArrayTooSmall { rank, len, pool } => {
                write!(
                    f,
                    "rank {rank} exports {len} slots but the pool hands out {pool}"
                )
            }
        }
    }
}

impl std::error::Error for BookError {}

/// Result of a renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renewal {
    /// The expiry is now at least `now + extension`.
    Renewed,
    /// Renewed only up to `grant + kv_lease_max_hold`, or not at all.
    Capped,
    /// The id (or slot and nonce) is not a held lease: ignored.
    Unknown,
}

/// Result of one read-done notification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadDoneOutcome {
    /// The last expected reader: the lease is released.
    Released,
    /// Counted; more readers (or ranks) to go.
    Counted,
    /// No held lease with that id: dropped.
    Unknown,
    /// The nonce is an earlier lease's: dropped.
    StaleNonce,
    /// The rank is not one of the book's: dropped.
    BadRank,
}

/// A released lease, as reported by [`LeaseBook::drain_released`].
#[derive(Debug)]
pub struct Released<'a> {
    /// The request whose blocks may now be freed (vLLM's finished_sending).
    pub request_id: &'a str,
    /// Why it was released.
    pub reason: ReleaseReason,
    /// The slot it held, already zeroed on every rank. Give it back (to
    /// [`LeaseBook::blocks_freed`] or the pool, from any thread) only after
    /// the blocks are freed.
    pub slot: Option<SlotTicket>,
}

/// The P-side lease book. See the module docs.
#[derive(Debug)]
pub struct LeaseBook {
    duration: Duration,
    extension: Duration,
    max_hold: Option<Duration>,
    verification: bool,
    leases: Box<[Lease]>,
    ids: IdTable,
    /// Stack of free entry indices.
    free: Box<[u32]>,
    free_len: usize,
    wheel: TimerWheel,
    /// One exported slot array per local rank; a slot index means the same
    /// slot in each.
    rank_slots: Box<[Arc<LeaseSlots>]>,
    /// Per (entry, rank): readers expected (high 32 bits) and seen (low 32).
    rank_reads: Box<[u64]>,
    /// slot -> (entry holding it, its nonce), for compact renewals: one
    /// cache line answers "is this (slot, nonce) a held lease, and which".
    slot_owner: Box<[(u32, u64)]>,
    pool: Arc<SlotPool>,
    nonces: NonceSource,
    released: ReleaseQueue,
    counters: BookCounters,
}

impl LeaseBook {
    /// A book for one rank with its own slot array and pool of
    /// `config.lease_slots` slots, and nonces from OS randomness.
    pub fn new(config: &LeaseConfig, now: Instant) -> LeaseBook {
        let slots = Arc::new(LeaseSlots::new(config.lease_slots));
        let pool = Arc::new(SlotPool::new(config.lease_slots));
        match LeaseBook::with_parts(config, vec![slots], pool, NonceSource::from_entropy(), now) {
            Ok(b) => b,
            // One rank, array and pool of the same size: with_parts cannot refuse.
            Err(_) => unreachable!("one rank with a matching pool is always accepted"),
        }
    }

    /// A book over the given per-rank slot arrays (at least one, each at
    /// least as large as the pool) sharing `pool`, with the given nonces.
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
        let cap = config.lease_capacity;
        let ranks = rank_slots.len();
        Ok(LeaseBook {
            duration: config.lease_duration(),
            extension: config.lease_extension(),
            max_hold: config.max_hold(),
            verification: config.verification,
            leases: (0..cap)
                .map(|_| Lease {
                    state: State::Free,
                    hold_until: Instant::MAX,
                    nonce: Nonce::ONE,
                    slot: None,
                    ranks_done: 0,
                })
                .collect(),
            ids: IdTable::new(cap, config.max_request_id_len),
            free: (0..cap).rev().collect(),
            free_len: cap as usize,
            // The near level covers the longest lease a grant or a renewal sets, so
            // leases are placed at their exact tick and never cascade.
            wheel: TimerWheel::new(
                cap,
                config.wheel_tick(),
                config.lease_duration().max(config.lease_extension()),
                now,
            ),
            rank_reads: vec![0; cap as usize * ranks].into_boxed_slice(),
            slot_owner: vec![(NIL, 0); pool.capacity() as usize].into_boxed_slice(),
            rank_slots: rank_slots.into_boxed_slice(),
            pool,
            nonces,
            released: ReleaseQueue::new(cap),
            counters: BookCounters::default(),
        })
    }

    /// Event counts since construction.
    pub fn counters(&self) -> &BookCounters {
        &self.counters
    }

    /// Leases held (not yet released).
    pub fn held(&self) -> u32 {
        self.wheel.len()
    }

    /// Released leases waiting for [`LeaseBook::drain_released`].
    pub fn pending_releases(&self) -> usize {
        self.released.len()
    }

    /// The local ranks this book serves.
    pub fn ranks(&self) -> u32 {
        self.rank_slots.len() as u32
    }

    /// Rank `rank`'s exported slot array (register it with the fabric).
    pub fn rank_slots(&self, rank: u32) -> Option<&Arc<LeaseSlots>> {
        self.rank_slots.get(rank as usize)
    }

    /// The pool slots come from; give tickets back here from any thread.
    pub fn slot_pool(&self) -> &Arc<SlotPool> {
        &self.pool
    }

    /// When the held lease `request_id` expires, if it is held.
    pub fn expiry(&self, request_id: &str) -> Option<Instant> {
        self.held_entry(request_id.as_bytes())
            .and_then(|e| self.wheel.deadline(e))
    }

    /// No lease expires before this instant (a lower bound; `None`: none held).
    /// An engine that idles may sleep until then.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.wheel.next_deadline()
    }

    /// Grants a lease to `request_id` when its prefill completes: expiry
    /// `now + kv_lease_duration`, a nonce, and a slot holding that nonce on
    /// every rank when verification is on and a slot is free.
    pub fn grant(&mut self, request_id: &str, now: Instant) -> Result<Grant, GrantError> {
        let id = request_id.as_bytes();
        if let Err(e) = self.ids.check(id) {
            self.counters.grant_refused_bad_id += 1;
            return Err(GrantError::BadId(e));
        }
        if self.ids.get(id).is_some() {
            self.counters.grant_refused_duplicate += 1;
            return Err(GrantError::Duplicate);
        }
        if self.free_len == 0 {
            self.counters.grant_refused_full += 1;
            return Err(GrantError::Full);
        }
        self.free_len -= 1;
        let entry = self.free[self.free_len];
        if let Err(e) = self.ids.insert(id, entry) {
            // check() and get() above rule this out; keep the entry free.
            debug_assert!(false, "id insert failed after checks: {e}");
            self.free_len += 1;
            self.counters.grant_refused_bad_id += 1;
            return Err(GrantError::BadId(e));
        }
        let nonce = self.nonces.next_nonce();
        let slot = if self.verification {
            self.pool.take()
        } else {
            None
        };
        if let Some(t) = &slot {
            self.slot_owner[t.slot() as usize] = (entry, nonce.get());
            for ranks in self.rank_slots.iter() {
                ranks.publish(t.slot(), nonce.get());
            }
        } else {
            self.counters.granted_without_slot += 1;
        }
        let expiry = now + self.duration;
        let ranks = self.rank_slots.len();
        self.rank_reads[entry as usize * ranks..(entry as usize + 1) * ranks].fill(0);
        let slot_index = slot.as_ref().map(SlotTicket::slot);
        let lease = &mut self.leases[entry as usize];
        debug_assert_eq!(lease.state, State::Free);
        *lease = Lease {
            state: State::Held,
            hold_until: self.max_hold.map_or(Instant::MAX, |h| now + h),
            nonce,
            slot,
            ranks_done: 0,
        };
        let scheduled = self.wheel.insert(entry, expiry);
        debug_assert!(
            scheduled.is_ok(),
            "free entry {entry} was still on the wheel"
        );
        self.counters.granted += 1;
        Ok(Grant {
            slot: slot_index,
            nonce,
            expiry,
        })
    }

    /// Renews the lease of `request_id` on a heartbeat: expiry becomes
    /// `max(expiry, now + extension)`, capped at `grant + max_hold`. A renewal
    /// never shortens a lease. Unknown ids are counted and ignored.
    #[inline]
    pub fn renew(&mut self, request_id: &[u8], now: Instant) -> Renewal {
        match self.held_entry(request_id) {
            Some(e) => self.renew_entry(e, now),
            None => {
                self.counters.renew_unknown += 1;
                Renewal::Unknown
            }
        }
    }

    /// Renews every id of a heartbeat, as [`LeaseBook::renew`] would one by
    /// one; returns (renewed, ignored). Capped renewals count as renewed.
    ///
    /// Ids are taken in batches of 64: first every id is hashed and its
    /// index cell, id bytes and wheel entry are loaded, then the batch is
    /// renewed. At 100k leases each renewal is three cache misses; taken one
    /// id at a time they are paid in series, in a batch they overlap.
    pub fn renew_all<'a>(
        &mut self,
        ids: impl IntoIterator<Item = &'a [u8]>,
        now: Instant,
    ) -> (u32, u32) {
        const BATCH: usize = 64;
        let mut batch: [(&[u8], u64); BATCH] = [(&[], 0); BATCH];
        let (mut renewed, mut ignored) = (0u32, 0u32);
        let mut ids = ids.into_iter();
        loop {
            let mut n = 0;
            for id in ids.by_ref().take(BATCH) {
                let h = self.ids.hash_id(id);
                batch[n] = (id, h);
                n += 1;
            }
            if n == 0 {
                return (renewed, ignored);
            }
            for &(_, h) in &batch[..n] {
                if let Some(e) = self.ids.warm(h) {
                    self.wheel.warm(e);
                }
            }
            for &(id, h) in &batch[..n] {
                let outcome = match self.ids.get_hashed(id, h) {
                    Some(e) => self.renew_entry(e, now),
                    None => {
                        self.counters.renew_unknown += 1;
                        Renewal::Unknown
                    }
                };
                match outcome {
                    Renewal::Unknown => ignored += 1,
                    _ => renewed += 1,
                }
            }
        }
    }

    /// Renews every (slot, nonce) of a compact heartbeat, as
    /// [`LeaseBook::renew_slot`] would one by one; returns (renewed, ignored).
    /// Batched like [`LeaseBook::renew_all`]: the slot-owner words and wheel
    /// entries of 64 records are loaded before any is renewed.
    pub fn renew_slots_all(
        &mut self,
        entries: impl IntoIterator<Item = (u32, Nonce)>,
        now: Instant,
    ) -> (u32, u32) {
        const BATCH: usize = 64;
        let mut batch = [(0u32, Nonce::ONE); BATCH];
        let (mut renewed, mut ignored) = (0u32, 0u32);
        let mut entries = entries.into_iter();
        loop {
            let mut n = 0;
            for e in entries.by_ref().take(BATCH) {
                if let Some(owner) = self.slot_owner.get(e.0 as usize) {
                    core::hint::black_box(owner.0);
                }
                batch[n] = e;
                n += 1;
            }
            if n == 0 {
                return (renewed, ignored);
            }
            for &(slot, _) in &batch[..n] {
                if let Some(&(entry, _)) = self.slot_owner.get(slot as usize) {
                    self.wheel.warm(entry);
                }
            }
            for &(slot, nonce) in &batch[..n] {
                match self.renew_slot(slot, nonce, now) {
                    Renewal::Unknown => ignored += 1,
                    _ => renewed += 1,
                }
            }
        }
    }

    /// Renews by (slot, nonce) from a compact heartbeat: O(1), no hashing,
    /// and only the lease that holds that nonce is renewed.
    #[inline]
    pub fn renew_slot(&mut self, slot: u32, nonce: Nonce, now: Instant) -> Renewal {
        let (entry, held_nonce) = self
            .slot_owner
            .get(slot as usize)
            .copied()
            .unwrap_or((NIL, 0));
        if entry == NIL {
            self.counters.renew_unknown += 1;
            return Renewal::Unknown;
        }
        debug_assert_eq!(self.leases[entry as usize].state, State::Held);
        if held_nonce != nonce.get() {
            self.counters.renew_nonce_mismatch += 1;
            return Renewal::Unknown;
        }
        self.renew_entry(entry, now)
    }

    #[inline]
    fn renew_entry(&mut self, entry: u32, now: Instant) -> Renewal {
        let wanted = now + self.extension;
        let target = match self.max_hold {
            Some(_) => wanted.min(self.leases[entry as usize].hold_until),
            None => wanted,
        };
        // The wheel keeps the later of the two: a renewal never shortens.
        let scheduled = self.wheel.extend(entry, target);
        debug_assert!(scheduled, "held lease {entry} is not on the wheel");
        if target < wanted {
            self.counters.renew_capped += 1;
            Renewal::Capped
        } else {
            self.counters.renewed += 1;
            Renewal::Renewed
        }
    }

    /// Counts one read-done notification received on local rank `rank`.
    /// `consumers` is the number of decoder ranks that read from that rank
    /// (vLLM's `id:consumers`); the lease is released when every rank has
    /// seen that many. With `nonce`, a notification for an earlier lease
    /// with the same id is dropped; without one (vLLM's form) it is
    /// accepted and counted in `read_done_without_nonce`.
    pub fn read_done(
        &mut self,
        rank: u32,
        request_id: &[u8],
        consumers: u32,
        nonce: Option<Nonce>,
        _now: Instant,
    ) -> ReadDoneOutcome {
        let ranks = self.rank_slots.len();
        if rank as usize >= ranks {
            self.counters.read_done_bad_rank += 1;
            return ReadDoneOutcome::BadRank;
        }
        let Some(entry) = self.held_entry(request_id) else {
            self.counters.read_done_unknown += 1;
            return ReadDoneOutcome::Unknown;
        };
        match nonce {
            Some(n) if n != self.leases[entry as usize].nonce => {
                self.counters.read_done_stale_nonce += 1;
                return ReadDoneOutcome::StaleNonce;
            }
            Some(_) => {}
            None => self.counters.read_done_without_nonce += 1,
        }
        self.counters.read_done += 1;
        let cell = &mut self.rank_reads[entry as usize * ranks + rank as usize];
        let (expected, seen) = ((*cell >> 32) as u32, *cell as u32);
        if expected != 0 && seen >= expected {
            // This rank already finished; a duplicate changes nothing.
            return ReadDoneOutcome::Counted;
        }
        // The first notification fixes how many this rank expects.
        let expected = if expected == 0 {
            consumers.max(1)
        } else {
            expected
        };
        let seen = seen + 1;
        *cell = (u64::from(expected) << 32) | u64::from(seen);
        if seen < expected {
            return ReadDoneOutcome::Counted;
        }
        let lease = &mut self.leases[entry as usize];
        lease.ranks_done += 1;
        if lease.ranks_done < ranks as u32 {
            return ReadDoneOutcome::Counted;
        }
        self.wheel.cancel(entry);
        self.release(entry, ReleaseReason::ReadDone);
        ReadDoneOutcome::Released
    }

    /// Releases the lease of `request_id` now (engine shutdown, or the
    /// request was aborted on P). Returns whether it was held.
    pub fn cancel(&mut self, request_id: &str) -> bool {
        match self.held_entry(request_id.as_bytes()) {
            Some(e) => {
                self.wheel.cancel(e);
                self.release(e, ReleaseReason::Cancelled);
                true
            }
            None => false,
        }
    }

    /// Expires every lease whose expiry is at or before `now`. Call once per
    /// step. Costs O(levels + expired + re-placed), whatever the number of
    /// leases held: a renewed lease is placed again once, when its old
    /// deadline comes up (see `wheel`).
    pub fn poll(&mut self, now: Instant) {
        // The wheel never fires early (its model test pins that), so every
        // entry it hands out is due.
        while let Some(entry) = self.wheel.pop_expired(now) {
            self.release(entry, ReleaseReason::Expired);
        }
    }

    /// Reports every released lease, oldest first, then forgets it: its id
    /// may be granted again. The slot in each report is already zero on
    /// every rank. Call once per step after `poll` and the notifications.
    pub fn drain_released(&mut self, mut report: impl FnMut(Released<'_>)) {
        while let Some(entry) = self.released.pop() {
            let lease = &mut self.leases[entry as usize];
            let State::Released(reason) = lease.state else {
                debug_assert!(false, "queued entry {entry} is not released");
                continue;
            };
            let slot = lease.slot.take();
            lease.state = State::Free;
            // Ids are stored from &str, so they are valid UTF-8.
            let request_id = core::str::from_utf8(self.ids.id(entry)).unwrap_or("");
            report(Released {
                request_id,
                reason,
                slot,
            });
            self.ids.forget(entry);
            self.free[self.free_len] = entry;
            self.free_len += 1;
            self.counters.reported += 1;
        }
    }

    /// The engine freed the blocks of a released lease: its slot may be
    /// reused. (Tickets may also go straight back to [`LeaseBook::slot_pool`]
    /// from another thread; then they are not counted here.)
    pub fn blocks_freed(&mut self, ticket: SlotTicket) {
        debug_assert!(self
            .rank_slots
            .iter()
            .all(|s| s.load(ticket.slot()) == Some(0)));
        self.pool.give_back(ticket);
        self.counters.slots_returned += 1;
    }

    pub(crate) fn note_malformed(&mut self) {
        self.counters.malformed_notifications += 1;
    }

    /// The entry of a *held* lease with this id: only held leases are indexed.
    #[inline]
    fn held_entry(&self, request_id: &[u8]) -> Option<u32> {
        let e = self.ids.get(request_id)?;
        debug_assert_eq!(self.leases[e as usize].state, State::Held);
        Some(e)
    }

    /// Ends a held lease: zero its slot on every rank first, then queue the
    /// report (invariant 1: zeroed before the release is reported).
    fn release(&mut self, entry: u32, reason: ReleaseReason) {
        let lease = &mut self.leases[entry as usize];
        debug_assert_eq!(lease.state, State::Held);
        if let Some(t) = &lease.slot {
            for ranks in self.rank_slots.iter() {
                ranks.clear(t.slot());
            }
            self.slot_owner[t.slot() as usize] = (NIL, 0);
        }
        lease.state = State::Released(reason);
        // Unfindable from now on (renewals and read-dones for it are unknown,
        // and its id may be granted again), but its bytes stay for the report.
        self.ids.unindex(entry);
        match reason {
            ReleaseReason::ReadDone => self.counters.released_read += 1,
            ReleaseReason::Expired => self.counters.expired += 1,
            ReleaseReason::Cancelled => self.counters.cancelled += 1,
        }
        self.released.push(entry);
    }
}
