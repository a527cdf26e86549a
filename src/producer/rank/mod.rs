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
//!  directive Grant ──▶ PINNED (nonce in slot; prefill running; deadline = now + kv_lease_max_pin)
//!  directive Grant with a lease, or Start ──▶ HELD, deadline = now + remaining
//!  HELD ──heartbeat──▶ deadline = max(deadline, min(now + extension, hold))
//!  HELD ──read-done from each of this rank's consumers──▶ released (read)
//!  PINNED/HELD ──poll, deadline <= now───────▶ released (expired)
//!  PINNED/HELD ──directive Cancel────────────▶ released (cancelled)
//!  released: slot word zeroed, id unindexed, entry free ──then──▶ report queued
//!  Grant refused, or Start/Cancel for a lease not held here ──▶ report "not held"
//! ```
//!
//! # Every directive is answered
//!
//! The scheduler frees a lease's blocks only once every rank reported it,
//! so a rank that stays silent about a lease holds those blocks forever.
//! A rank therefore answers every Grant it refuses, and every Start or
//! Cancel for a lease it does not hold (its Grant was lost on the engine's
//! IPC, or refused), with a "not held" report ([`ReleaseReason::NotHeld`]):
//! its slot is 0 there, so the scheduler may count it as let go. A lease
//! the rank already reported gets the same answer again, which the
//! scheduler ignores as a duplicate.
//!
//! # Read-dones count once per sender
//!
//! A rank read by several decoder workers (D TP > P TP) waits for one
//! read-done from each. It remembers which senders reported each lease
//! (`senders.rs`), so a duplicated notification cannot stand in for a
//! worker that is still reading.
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

use core::time::Duration;
use std::sync::Arc;

use super::counters::RankCounters;
use super::layout::EntryLayout;
use super::lease_line::{LeaseLines, HELD, PINNED};
use super::{Renewal, ShareOutcome};
use crate::collections::Ring;
use crate::config::LeaseConfig;
use crate::ids::IdIndex;
use crate::ipc::directive::{Directive, DirectiveMsg, DirectiveOp};
use crate::ipc::report::{self, RankReport};
use crate::ipc::IpcError;
use crate::nonce::Nonce;
use crate::release_reason::ReleaseReason;
use crate::slots::LeaseSlots;
use crate::time::{duration_nanos, Instant};
use crate::wheel::TimerWheel;

/// Why a rank could not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RankError {
    /// The rank's slot array is smaller than the slotted entry range.
    #[error("rank {rank} exports {len} slots but the scheduler hands out {needed}")]
    SlotArrayTooSmall {
        /// The rank.
        rank: u32,
        /// Its slot count.
        len: u32,
        /// Slots the layout hands out (`kv_lease_slots`).
        needed: u32,
    },
}

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
    /// Per entry: the senders whose read-done was counted (bit = index in
    /// `senders`).
    readers: Box<[u128]>,
    senders: SenderTable,
    /// `kv_lease_max_pin` in ns: how long a lease may stay pinned.
    max_pin_ns: u64,
    index: IdIndex,
    wheel: TimerWheel,
    slots: Arc<LeaseSlots>,
    reports: Ring<RankReport>,
    held: u32,
    last_directive_seq: Option<u32>,
    report_seq: u32,
    counters: RankCounters,
    #[cfg(feature = "mutant_zero_after_report")]
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
            readers: vec![0; entries as usize].into_boxed_slice(),
            senders: SenderTable::new(),
            max_pin_ns: duration_nanos(config.max_pin),
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
            // Per entry, between two report messages: its release by this
            // rank's own rule, then a "not held" answer to each directive
            // that can name it in one message (a Start, which the
            // scheduler's backstop re-sends as a probe, and a Cancel; a
            // Grant and its Start travel as one). More only if the engine
            // stops shipping reports (counted, dropped). The backstop's
            // probes made it three: the role-model harness, polling the
            // scheduler, overflowed a ring of two per entry.
            reports: Ring::new(entries.saturating_mul(3), PLACEHOLDER),
            held: 0,
            last_directive_seq: None,
            report_seq: 0,
            counters: RankCounters::default(),
            #[cfg(feature = "mutant_zero_after_report")]
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
    pub fn counters(&self) -> RankCounters {
        self.counters
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
            HELD => Instant::from_nanos(self.lines.head(e)?.deadline),
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

    /// Applies one directive (in process, or from a decoded message). A
    /// Grant this rank refuses, and a Start or Cancel for a lease it does
    /// not hold, is answered with a "not held" report (module docs).
    pub fn apply(&mut self, d: &Directive<'_>, now: Instant) -> DirectiveOutcome {
        let outcome = match d.op {
            DirectiveOp::Grant => self.apply_grant(d, now),
            DirectiveOp::Start => self.apply_start(d, now),
            DirectiveOp::Cancel => self.apply_cancel(d),
        };
        let unanswered = matches!(
            (d.op, outcome),
            (_, DirectiveOutcome::Refused)
                | (
                    DirectiveOp::Start | DirectiveOp::Cancel,
                    DirectiveOutcome::Stale
                )
        );
        if unanswered {
            self.report_not_held(d.entry, d.nonce);
        }
        let c = &mut self.counters;
        match outcome {
            DirectiveOutcome::Applied => c.directives_applied += 1,
            DirectiveOutcome::Duplicate => c.directives_duplicate += 1,
            DirectiveOutcome::Stale => c.directives_stale += 1,
            DirectiveOutcome::Refused => c.directives_refused += 1,
        }
        outcome
    }

    // ---- renewal ---------------------------------------------------------------

    // ---- read-done ----------------------------------------------------------------

    // ---- expiry and reports ----------------------------------------------------------

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

mod apply;
mod release;
mod renew;
mod senders;

pub(crate) use renew::SlotTally;

use senders::SenderTable;
