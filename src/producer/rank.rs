//! [`PrefillRank`]: one P worker's share of the leases, in that worker's
//! process.
//!
//! This module owns what a P rank decides on its own: it applies the
//! scheduler's directives (publishing a lease's nonce in its slot array in
//! the step the directive arrives), renews on the heartbeats *it* receives,
//! counts the read-dones *its* readers send, expires on *its* clock, and
//! reports each release to the scheduler, zeroing its slot first. It does not
//! choose slots or nonces (the [`super::PrefillScheduler`] does), does not
//! free blocks (the engine does, once the scheduler says every rank let go),
//! decodes no bytes itself (`wire`, `ipc`) and never reads a clock.
//!
//! ```text
//!  directive Grant ──▶ PINNED (nonce in slot; prefill running, not timed)
//!  directive Grant with a lease, or Start ──▶ HELD, deadline = now + remaining
//!  HELD ──heartbeat──▶ deadline = max(deadline, min(now + extension, hold))
//!  HELD ──read-done × this rank's consumers──▶ released (read)
//!  HELD ──poll, deadline <= now──────────────▶ released (expired)
//!  PINNED/HELD ──directive Cancel────────────▶ released (cancelled)
//!  released: slot word zeroed, id unindexed, entry free ──then──▶ report queued
//! ```
//!
//! # Ranks are independent
//!
//! Each rank expires on its own heartbeats. When they disagree (rank 1's
//! notifications were lost, so rank 1 expired while rank 0 still holds),
//! rank 1 zeroes its slot and reports; the scheduler frees the blocks only
//! after rank 0 reports too; and a decoder that reads from rank 1 fails its
//! check on rank 1's zeroed slot. Divergence fails closed.
//!
//! # Degraded behaviour
//!
//! Directives are outside input: one the rank cannot place (entry or slot
//! outside the layout, an id longer than `kv_lease_max_request_id_len`) is
//! refused and counted, and that lease is simply not held here: its slot
//! stays 0, so a decoder's check on this rank fails. A repeated directive is
//! a no-op; one for a lease this rank already released is a no-op.
//!
//! # Allocation
//!
//! Everything is allocated in [`PrefillRank::new`]: directive application,
//! renewal, read-done, poll and report encoding allocate nothing
//! (`tests/roles_alloc.rs`).

use core::fmt;
use core::time::Duration;
use std::sync::Arc;

use super::counters::RankCounters;
use super::layout::EntryLayout;
use super::lease_line::{LeaseLines, HELD, PINNED};
use super::{ReadDoneOutcome, ReleaseReason, Renewal};
use crate::collections::Ring;
use crate::config::LeaseConfig;
use crate::ids::IdIndex;
use crate::ipc::directive::{Directive, DirectiveMsg, DirectiveOp};
use crate::ipc::report::{self, RankReport};
use crate::ipc::IpcError;
use crate::nonce::Nonce;
use crate::slots::LeaseSlots;
use crate::time::{duration_nanos, Instant};
use crate::wheel::TimerWheel;

/// Why a rank could not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RankError {
    /// The rank's slot array is smaller than the slotted entry range.
    SlotArrayTooSmall {
        /// The rank.
        rank: u32,
        /// Its slot count.
        len: u32,
        /// Slots the layout hands out (`kv_lease_slots`).
        needed: u32,
    },
}

impl fmt::Display for RankError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankError::SlotArrayTooSmall { rank, len, needed } => write!(
                f,
                "rank {rank} exports {len} slots but the scheduler hands out {needed}"
            ),
        }
    }
}

impl std::error::Error for RankError {}

/// What one directive did on a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectiveOutcome {
    /// Applied.
    Applied,
    /// The same directive was applied before: nothing changed.
    Duplicate,
    /// For a lease this rank no longer holds: nothing changed.
    Stale,
    /// Cannot be placed on this rank (see [`RankCounters::directives_refused`]).
    Refused,
}

/// What one directive message did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirectiveSummary {
    /// Directives applied.
    pub applied: u32,
    /// Duplicates and stale directives: no-ops.
    pub ignored: u32,
    /// Directives refused.
    pub refused: u32,
}

/// One P rank's lease state. See the module docs.
#[derive(Debug)]
pub struct PrefillRank {
    rank: u32,
    layout: EntryLayout,
    extension_ns: u64,
    max_len: usize,
    lines: LeaseLines,
    /// Most leases held at once (`kv_lease_capacity`): what the index is sized for.
    capacity: u32,
    /// Each held entry's id hash: the index's backward shift needs the home
    /// of the entries it moves, and rehashing ids there would cost a miss each.
    hashes: Box<[u64]>,
    /// Renewal ceilings (ns), read only once a directive carried one.
    holds: Box<[u64]>,
    holds_in_use: bool,
    /// Per entry: readers expected (high 32 bits) and seen (low 32).
    reads: Box<[u64]>,
    index: IdIndex,
    wheel: TimerWheel,
    slots: Arc<LeaseSlots>,
    reports: Ring<RankReport>,
    held: u32,
    last_directive_seq: Option<u32>,
    report_seq: u32,
    counters: RankCounters,
    #[cfg(kvlease_mutant = "zero_after_report")]
    deferred_zero: Vec<u32>,
}

impl PrefillRank {
    /// Rank `rank` of an engine configured by `config`, exporting `slots`
    /// (at least `kv_lease_slots` of them when verification is on).
    pub fn new(
        config: &LeaseConfig,
        rank: u32,
        slots: Arc<LeaseSlots>,
        now: Instant,
    ) -> Result<PrefillRank, RankError> {
        let layout = EntryLayout::of(config);
        if slots.len() < layout.slotted {
            return Err(RankError::SlotArrayTooSmall {
                rank,
                len: slots.len(),
                needed: layout.slotted,
            });
        }
        let entries = layout.entries();
        let max_len = usize::from(config.max_request_id_len);
        Ok(PrefillRank {
            rank,
            layout,
            extension_ns: duration_nanos(config.lease_extension()),
            max_len,
            lines: LeaseLines::new(entries, max_len),
            hashes: vec![0; entries as usize].into_boxed_slice(),
            holds: vec![u64::MAX; entries as usize].into_boxed_slice(),
            holds_in_use: false,
            reads: vec![0; entries as usize].into_boxed_slice(),
            // Sized for the leases that can be live (not for every entry):
            // half the cells, half the cache and TLB footprint per lookup.
            index: IdIndex::new(config.lease_capacity, crate::nonce::entropy_u64()),
            capacity: config.lease_capacity,
            // The near level covers the longest lease a grant or a renewal
            // sets, so leases are placed at their exact tick and never cascade.
            wheel: TimerWheel::new(
                entries,
                config.wheel_tick(),
                config.lease_duration().max(config.lease_extension()),
                now,
            ),
            slots,
            reports: Ring::new(entries, PLACEHOLDER),
            held: 0,
            last_directive_seq: None,
            report_seq: 0,
            counters: RankCounters::default(),
            #[cfg(kvlease_mutant = "zero_after_report")]
            deferred_zero: Vec::new(),
        })
    }

    /// This rank's index.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The exported slot array (register it with this worker's fabric).
    pub fn slots(&self) -> &Arc<LeaseSlots> {
        &self.slots
    }

    /// The entry numbering this rank expects.
    pub fn layout(&self) -> EntryLayout {
        self.layout
    }

    /// Event counts since construction.
    pub fn counters(&self) -> &RankCounters {
        &self.counters
    }

    /// Leases this rank holds (pinned or timed).
    pub fn held(&self) -> u32 {
        self.held
    }

    /// When this rank's lease of `request_id` lapses: `None` when it holds
    /// none, [`Instant::MAX`] while it is pinned (not started).
    pub fn expiry(&self, request_id: &str) -> Option<Instant> {
        let e = self.find(request_id.as_bytes())?;
        let line = self.lines.get(e)?;
        Some(match line.state() {
            HELD => Instant::from_nanos(line.deadline),
            _ => Instant::MAX,
        })
    }

    /// The entry of this rank's lease of `request_id`, if it holds one.
    pub fn entry_of(&self, request_id: &str) -> Option<u32> {
        self.find(request_id.as_bytes())
    }

    /// No lease of this rank lapses before this instant (a lower bound).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.wheel.next_deadline()
    }

    // ---- directives ----------------------------------------------------------

    /// Decodes one directive message from the scheduler and applies every
    /// directive in it, in order. A message that does not decode changes
    /// nothing and is counted; its error is returned for the engine to log.
    pub fn apply_directives(
        &mut self,
        msg: &[u8],
        now: Instant,
    ) -> Result<DirectiveSummary, IpcError> {
        let decoded = match DirectiveMsg::decode(msg) {
            Ok(m) => m,
            Err(e) => {
                self.counters.directive_messages_refused += 1;
                return Err(e);
            }
        };
        if let Some(prev) = self.last_directive_seq {
            if decoded.seq() != prev.wrapping_add(1) {
                self.counters.directive_seq_gaps += 1;
            }
        }
        self.last_directive_seq = Some(decoded.seq());
        let mut summary = DirectiveSummary::default();
        for d in decoded.iter() {
            match self.apply(&d, now) {
                DirectiveOutcome::Applied => summary.applied += 1,
                DirectiveOutcome::Duplicate | DirectiveOutcome::Stale => summary.ignored += 1,
                DirectiveOutcome::Refused => summary.refused += 1,
            }
        }
        Ok(summary)
    }

    /// Applies one directive (in process, or from a decoded message).
    pub fn apply(&mut self, d: &Directive<'_>, now: Instant) -> DirectiveOutcome {
        let outcome = match d.op {
            DirectiveOp::Grant => self.apply_grant(d, now),
            DirectiveOp::Start => self.apply_start(d, now),
            DirectiveOp::Cancel => self.apply_cancel(d),
        };
        let c = &mut self.counters;
        match outcome {
            DirectiveOutcome::Applied => c.directives_applied += 1,
            DirectiveOutcome::Duplicate => c.directives_duplicate += 1,
            DirectiveOutcome::Stale => c.directives_stale += 1,
            DirectiveOutcome::Refused => c.directives_refused += 1,
        }
        outcome
    }

    fn apply_grant(&mut self, d: &Directive<'_>, now: Instant) -> DirectiveOutcome {
        let id = d.request_id.as_bytes();
        if !self.layout.consistent(d.entry, d.slot)
            || id.is_empty()
            || id.len() > self.max_len
            || !self.lines.fits(id.len())
        {
            return DirectiveOutcome::Refused;
        }
        if let Some(line) = self.lines.get(d.entry) {
            if line.is_held() {
                if line.nonce == d.nonce.get() {
                    return DirectiveOutcome::Duplicate;
                }
                // The scheduler reuses an entry only after this rank reported
                // it; a held one means a lost or reordered report. Let the old
                // lease go properly (slot zeroed, reported) before the new one.
                self.counters.directive_conflicts += 1;
                self.wheel.cancel(d.entry);
                self.release(d.entry, ReleaseReason::Cancelled);
            }
        }
        let h = self.index.hash(id);
        if let Some(other) = self.index.find(h, |e| self.lines.id_is(e, id)) {
            // Same story: the id's previous lease was never reported here.
            self.counters.directive_conflicts += 1;
            self.wheel.cancel(other);
            self.release(other, ReleaseReason::Cancelled);
        }
        if self.held >= self.capacity {
            // A scheduler never has more than kv_lease_capacity leases live;
            // more can only come from a confused sender. Refusing keeps the
            // index under its load bound.
            return DirectiveOutcome::Refused;
        }
        let e = d.entry;
        let (state, deadline) = match d.lease_remaining {
            Some(r) => (HELD, (now + r).as_nanos()),
            None => (PINNED, 0),
        };
        // fits() and the layout check above make this infallible.
        let filled = self.lines.fill(e, id, d.nonce.get(), state, deadline);
        debug_assert!(filled);
        self.hashes[e as usize] = h;
        self.index.insert(h, e);
        self.reads[e as usize] = 0;
        self.holds[e as usize] = match d.hold_remaining {
            Some(r) => {
                self.holds_in_use = true;
                (now + r).as_nanos()
            }
            None => u64::MAX,
        };
        if let Some(slot) = d.slot {
            // Written in the step the directive arrives, before any decoder
            // can have the slot (kv_transfer_params leave P after prefill).
            self.slots.publish(slot, d.nonce.get());
        }
        if state == HELD {
            self.schedule(e, deadline);
        }
        self.held += 1;
        DirectiveOutcome::Applied
    }

    fn apply_start(&mut self, d: &Directive<'_>, now: Instant) -> DirectiveOutcome {
        let Some(remaining) = d.lease_remaining else {
            return DirectiveOutcome::Refused;
        };
        let Some(line) = self.lines.get_mut(d.entry) else {
            return DirectiveOutcome::Refused;
        };
        if line.nonce != d.nonce.get() || !line.is_held() {
            return DirectiveOutcome::Stale;
        }
        if line.state() == HELD {
            return DirectiveOutcome::Duplicate;
        }
        // A renewal while pinned may already have raised the floor.
        let deadline = line.deadline.max((now + remaining).as_nanos());
        line.deadline = deadline;
        line.set_state(HELD);
        if let Some(r) = d.hold_remaining {
            self.holds_in_use = true;
            self.holds[d.entry as usize] = (now + r).as_nanos();
        }
        self.schedule(d.entry, deadline);
        DirectiveOutcome::Applied
    }

    fn apply_cancel(&mut self, d: &Directive<'_>) -> DirectiveOutcome {
        match self.lines.get(d.entry) {
            None => DirectiveOutcome::Refused,
            Some(line) if line.nonce != d.nonce.get() || !line.is_held() => DirectiveOutcome::Stale,
            Some(_) => {
                self.wheel.cancel(d.entry);
                self.release(d.entry, ReleaseReason::Cancelled);
                DirectiveOutcome::Applied
            }
        }
    }

    fn schedule(&mut self, e: u32, deadline: u64) {
        let placed = self.wheel.insert(e, Instant::from_nanos(deadline));
        debug_assert!(placed.is_ok(), "entry {e} was already on the wheel");
    }

    // ---- renewal ---------------------------------------------------------------

    #[inline]
    fn find(&self, id: &[u8]) -> Option<u32> {
        if id.is_empty() || id.len() > self.max_len {
            return None;
        }
        self.find_hashed(id, self.index.hash(id))
    }

    #[inline]
    fn find_hashed(&self, id: &[u8], h: u64) -> Option<u32> {
        self.index.find(h, |e| self.lines.id_is(e, id))
    }

    /// Renews this rank's lease of `request_id` (a heartbeat): the deadline
    /// becomes `max(deadline, now + extension)`, capped at the lease's hold
    /// ceiling. Never shortens. Unknown ids are counted and ignored.
    #[inline]
    pub fn renew(&mut self, request_id: &[u8], now: Instant) -> Renewal {
        match self.find(request_id) {
            Some(e) => self.renew_entry(e, now),
            None => {
                self.counters.renew_unknown += 1;
                Renewal::Unknown
            }
        }
    }

    /// Renews every id of a heartbeat, as [`PrefillRank::renew`] would one by
    /// one; returns (renewed, ignored). Capped renewals count as renewed.
    ///
    /// A software pipeline keeps a steady stream of cache misses in flight:
    /// id `i` is hashed and its index cell prefetched; the cell of id
    /// `i - CELL_LAG` is read and its candidate's lease line prefetched; id
    /// `i - LINE_LAG` is renewed, its cell and line by now in cache. (Taken
    /// one at a time, each id pays its two misses in series; in separate
    /// passes over a batch, the misses come in bursts that outrun the
    /// core's outstanding-miss capacity.)
    pub fn renew_all<'a>(
        &mut self,
        ids: impl IntoIterator<Item = &'a [u8]>,
        now: Instant,
    ) -> (u32, u32) {
        const CELL_LAG: usize = 8;
        const LINE_LAG: usize = 16;
        // Holds ids i - LINE_LAG ..= i: larger than LINE_LAG, a power of two.
        const RING: usize = 32;
        let mut ring: [(&[u8], u64); RING] = [(&[], 0); RING];
        let (mut renewed, mut ignored) = (0u32, 0u32);
        let mut tally = |r: Renewal| match r {
            Renewal::Unknown => ignored += 1,
            _ => renewed += 1,
        };
        let mut n = 0usize;
        for id in ids {
            let h = self.index.hash(id);
            self.index.prefetch(h);
            ring[n % RING] = (id, h);
            if n >= CELL_LAG {
                if let Some(e) = self.index.home_candidate(ring[(n - CELL_LAG) % RING].1) {
                    self.lines.prefetch(e);
                }
            }
            if n >= LINE_LAG {
                let (id, h) = ring[(n - LINE_LAG) % RING];
                tally(self.renew_hashed(id, h, now));
            }
            n += 1;
        }
        // The last LINE_LAG ids (or all of a short heartbeat).
        for k in n.saturating_sub(LINE_LAG)..n {
            let (id, h) = ring[k % RING];
            tally(self.renew_hashed(id, h, now));
        }
        (renewed, ignored)
    }

    #[inline]
    fn renew_hashed(&mut self, id: &[u8], h: u64, now: Instant) -> Renewal {
        let found = if id.is_empty() || id.len() > self.max_len {
            None
        } else {
            self.find_hashed(id, h)
        };
        match found {
            Some(e) => self.renew_entry(e, now),
            None => {
                self.counters.renew_unknown += 1;
                Renewal::Unknown
            }
        }
    }

    /// Renews by (slot, nonce) from a compact heartbeat: the slot is the
    /// entry, so this is one cache line, and only the lease holding that
    /// nonce is renewed.
    #[inline]
    pub fn renew_slot(&mut self, slot: u32, nonce: Nonce, now: Instant) -> Renewal {
        let held = match self.layout.slot_of(slot).and_then(|e| self.lines.get(e)) {
            Some(line) if line.is_held() => line.nonce,
            _ => {
                self.counters.renew_unknown += 1;
                return Renewal::Unknown;
            }
        };
        if held != nonce.get() {
            self.counters.renew_nonce_mismatch += 1;
            return Renewal::Unknown;
        }
        self.renew_entry(slot, now)
    }

    /// Renews every (slot, nonce) of a compact heartbeat, as
    /// [`PrefillRank::renew_slot`] would one by one; returns (renewed,
    /// ignored). Batched like [`PrefillRank::renew_all`].
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
                self.lines.prefetch(e.0);
                batch[n] = e;
                n += 1;
            }
            if n == 0 {
                return (renewed, ignored);
            }
            for &(slot, nonce) in &batch[..n] {
                match self.renew_slot(slot, nonce, now) {
                    Renewal::Unknown => ignored += 1,
                    _ => renewed += 1,
                }
            }
        }
    }

    #[inline]
    fn renew_entry(&mut self, e: u32, now: Instant) -> Renewal {
        let wanted = now.as_nanos().saturating_add(self.extension_ns);
        let target = if self.holds_in_use {
            wanted.min(self.holds[e as usize])
        } else {
            wanted
        };
        if let Some(line) = self.lines.get_mut(e) {
            // Never shortens; the wheel catches up lazily at poll time.
            line.deadline = line.deadline.max(target);
        }
        if target < wanted {
            self.counters.renew_capped += 1;
            Renewal::Capped
        } else {
            self.counters.renewed += 1;
            Renewal::Renewed
        }
    }

    // ---- read-done ----------------------------------------------------------------

    /// Counts one read-done notification received by this rank. `consumers`
    /// is the number of decoder ranks that read from this rank (current
    /// vLLM's `id:consumers`); this rank's share is released when that many
    /// arrived. With `nonce`, a notification for an earlier lease with the
    /// same id is dropped; without one (vLLM's form) it is accepted and
    /// counted. [`ReadDoneOutcome::Released`] means *this rank's* share.
    pub fn read_done(
        &mut self,
        request_id: &[u8],
        consumers: u32,
        nonce: Option<Nonce>,
    ) -> ReadDoneOutcome {
        let Some(e) = self.find(request_id) else {
            self.counters.read_done_unknown += 1;
            return ReadDoneOutcome::Unknown;
        };
        let held_nonce = self.lines.get(e).map_or(0, |l| l.nonce);
        match nonce {
            Some(n) if n.get() != held_nonce => {
                self.counters.read_done_stale_nonce += 1;
                return ReadDoneOutcome::StaleNonce;
            }
            Some(_) => {}
            None => self.counters.read_done_without_nonce += 1,
        }
        self.counters.read_done += 1;
        let cell = &mut self.reads[e as usize];
        let (expected, seen) = ((*cell >> 32) as u32, *cell as u32);
        // The first notification fixes how many this rank expects.
        let expected = if expected == 0 {
            consumers.max(1)
        } else {
            expected
        };
        let seen = seen.saturating_add(1);
        *cell = (u64::from(expected) << 32) | u64::from(seen);
        if seen < expected {
            return ReadDoneOutcome::Counted;
        }
        self.wheel.cancel(e);
        self.release(e, ReleaseReason::ReadDone);
        ReadDoneOutcome::Released
    }

    // ---- expiry and reports ----------------------------------------------------------

    /// Expires every lease of this rank whose deadline is at or before `now`.
    /// Call once per step. Costs O(levels + expired + re-placed): a renewed
    /// lease whose old wheel slot comes up is placed again at its deadline.
    pub fn poll(&mut self, now: Instant) {
        #[cfg(kvlease_mutant = "zero_after_report")]
        for slot in core::mem::take(&mut self.deferred_zero) {
            self.slots.clear(slot);
        }
        while let Some(e) = self.wheel.pop_expired(now) {
            let Some(line) = self.lines.get(e) else {
                continue;
            };
            debug_assert_eq!(line.state(), HELD, "entry {e} on the wheel but not held");
            if line.state() != HELD {
                continue;
            }
            if line.deadline > now.as_nanos() {
                let deadline = line.deadline;
                self.schedule(e, deadline);
                continue;
            }
            self.release(e, ReleaseReason::Expired);
        }
    }

    /// Ends this rank's share of entry `e`: zero the slot first, then unindex
    /// and free the entry, then queue the report (invariant 1: the slot is
    /// zeroed before the release can be reported, so before the blocks can
    /// be freed). The caller has taken `e` off the wheel.
    fn release(&mut self, e: u32, reason: ReleaseReason) {
        let Some(line) = self.lines.get(e) else {
            return;
        };
        debug_assert!(line.is_held());
        let nonce = line.nonce;
        if let Some(slot) = self.layout.slot_of(e) {
            #[cfg(not(kvlease_mutant = "zero_after_report"))]
            self.slots.clear(slot);
            // Mutation check (.ci/mutants.sh): the slot is zeroed only at the
            // next poll, after the report may have left. Must be caught.
            #[cfg(kvlease_mutant = "zero_after_report")]
            self.deferred_zero.push(slot);
        }
        let h = self.hashes[e as usize];
        let hashes = &self.hashes;
        let removed = self.index.remove(h, e, |x| hashes[x as usize]);
        debug_assert!(removed, "held entry {e} was not indexed");
        self.lines.clear(e);
        self.held -= 1;
        match reason {
            ReleaseReason::ReadDone => self.counters.released_read += 1,
            ReleaseReason::Expired => self.counters.expired += 1,
            ReleaseReason::Cancelled => self.counters.cancelled += 1,
        }
        let Some(nonce) = Nonce::new(nonce) else {
            return;
        };
        // At most one report per entry per grant is queued, and the ring is
        // as large as the entry count.
        let queued = self.reports.push(RankReport {
            entry: e,
            nonce,
            reason,
        });
        debug_assert!(queued);
    }

    /// Reports waiting to go to the scheduler.
    pub fn pending_reports(&self) -> usize {
        self.reports.len()
    }

    /// Bytes [`PrefillRank::encode_reports`] needs now.
    pub fn reports_len(&self) -> usize {
        report::encoded_len(self.reports.len() as u32)
    }

    /// Bytes a report message can take at most (every entry reported at
    /// once): size the engine's buffer with this once.
    pub fn max_reports_len(&self) -> usize {
        report::encoded_len(self.lines.len())
    }

    /// Encodes every waiting report into `buf` as this rank's next report
    /// message and forgets them; returns the message length. The engine
    /// ships it to the scheduler (vLLM: in the KV connector output). With
    /// [`IpcError::BufferTooSmall`] nothing is consumed.
    pub fn encode_reports(&mut self, buf: &mut [u8]) -> Result<usize, IpcError> {
        let n = self.reports.len();
        let reports = &self.reports;
        let len = report::encode(
            buf,
            self.rank,
            self.report_seq,
            (0..n).map(|k| reports.get(k).unwrap_or(PLACEHOLDER)),
        )?;
        self.report_seq = self.report_seq.wrapping_add(1);
        for _ in 0..n {
            self.reports.pop();
        }
        self.counters.reports_sent += n as u64;
        Ok(len)
    }

    /// Hands every waiting report to `sink` and forgets it (in-process
    /// engines: the scheduler is in the same process).
    pub fn drain_reports(&mut self, mut sink: impl FnMut(RankReport)) {
        while let Some(r) = self.reports.pop() {
            self.counters.reports_sent += 1;
            sink(r);
        }
    }

    pub(crate) fn note_clock_message(&mut self) {
        self.counters.clock_messages += 1;
    }

    pub(crate) fn note_malformed(&mut self) {
        self.counters.malformed_notifications += 1;
    }

    pub(crate) fn note_empty_ids(&mut self, n: u32) {
        self.counters.heartbeat_empty_ids += u64::from(n);
    }
}

const PLACEHOLDER: RankReport = RankReport {
    entry: u32::MAX,
    nonce: Nonce::ONE,
    reason: ReleaseReason::Cancelled,
};

impl PrefillRank {
    /// The renewal extension this rank applies.
    pub fn extension(&self) -> Duration {
        Duration::from_nanos(self.extension_ns)
    }
}
