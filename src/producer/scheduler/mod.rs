//! [`PrefillScheduler`]: the P engine's one scheduler-side lease role.
//!
//! This module owns what only one process per engine may decide: which
//! lease gets which entry, slot and nonce (it holds the [`SlotPool`] and the
//! [`NonceSource`]), what the workers must do each step (directives), when a
//! lease is over for *every* rank (so its blocks may be freed), and when a
//! slot may be reused (only after the engine freed the blocks). It does not
//! touch slot words, timers or notifications: each [`super::PrefillRank`]
//! does that in its own process. It never reads a clock.
//!
//! ```text
//!  assign(id) ──▶ ASSIGNED  (entry, slot, nonce; directive Grant: ranks publish the nonce)
//!  start(id, now) ──▶ HELD  (expiry = now + kv_lease_duration; directive Start)
//!  grant(id, now) = assign + start, one directive
//!  cancel(id) ──▶ directive Cancel (or released at once if no rank heard of it)
//!  rank reports (entry, nonce, why) ... from EVERY rank ──▶ RELEASED(why, combined)
//!  drain_released ──▶ engine frees the blocks (by request id, checked by nonce)
//!  engine freed the blocks ──▶ SlotTicket back to the pool: the slot may be reused
//! ```
//!
//! # When to call what (vLLM's hooks)
//!
//! - `build_connector_meta` for a `do_remote_decode` request scheduled for
//!   the first time: [`PrefillScheduler::assign`]; then
//!   [`PrefillScheduler::encode_directives`] into the step's metadata, so
//!   the workers write the nonce in the step that runs the prefill, long
//!   before `kv_transfer_params` can reach a decoder.
//! - `request_finished` (prefill done): [`PrefillScheduler::start`], and
//!   export [`Assignment::fields`] as `remote_lease_slot` /
//!   `remote_lease_nonce`.
//! - `update_connector_output`: [`PrefillScheduler::apply_reports`] with
//!   each worker's report bytes, then [`PrefillScheduler::drain_released`]:
//!   every release is `finished_sending` for its request.
//! - Once per step, before the directives are encoded:
//!   [`PrefillScheduler::poll`], the backstop (below).
//! - Blocks freed: [`PrefillScheduler::blocks_freed`] (or the pool, from any
//!   thread).
//!
//! # Degraded behaviour
//!
//! - **No free slot**: the lease is granted without lease fields; verifying
//!   decoders decline its KV. Counted in `granted_without_slot`.
//! - **Full** (`kv_lease_capacity` leases live, released-but-undrained
//!   included): [`GrantError::Full`]; the request is not leased: free its
//!   blocks and answer without remote-decode params.
//! - **Re-grant before the drain**: [`GrantError::ReleasePending`]. Drain
//!   first: an engine that frees blocks by request id would otherwise free
//!   the *new* lease's blocks for the old lease's report.
//! - **A rank never reports** (its process died): its leases stay live here
//!   (blocks held) until [`PrefillScheduler::rank_lost`] is called; the
//!   engine must call it when it notices the worker is gone. From then on
//!   every lease, those in flight and those granted later, counts as let go
//!   by that rank, until [`PrefillScheduler::rank_restarted`] says a fresh
//!   worker took its place.
//! - **A rank missed a directive** (a lost message on the engine's IPC, or a
//!   Grant it refused): it answers the Grant it refused, and the Start or
//!   Cancel it cannot match, with a "not held" report, so
//!   [`PrefillScheduler::cancel`] always ends a lease. Every such lease is
//!   released with [`ReleaseReason::NotHeld`] (D's check fails on that rank's
//!   zero slot: it failed closed). A lease granted in one step
//!   ([`PrefillScheduler::grant`], Grant and Start in one message) whose
//!   message a rank lost is never answered by that rank until a later
//!   directive names it; the backstop sends that directive.
//! - **The backstop** ([`PrefillScheduler::poll`]): when one rank let go of
//!   a started lease (read-done, expired, not held, or declared lost) and
//!   another has not answered a `kv_lease_duration` later, the scheduler
//!   sends the lease's Start again (a probe, [`PrefillScheduler::probe`]),
//!   and again every `kv_lease_duration`: a rank that holds the lease takes
//!   it for a duplicate, one that does not answers "not held", so a Grant
//!   lost to one rank ends with the others' let-go and nothing is freed
//!   early. A lease still unreleased a `kv_lease_duration` past
//!   `kv_lease_max_pin` (never started) or past `kv_lease_max_hold` (when
//!   set) gets a Cancel. Counted in `backstop_probes` and
//!   `backstop_cancels`. **Limit:** a started lease that *no* rank ever
//!   reports (the one Grant lost to every rank), with `kv_lease_max_hold`
//!   off, is not armed: it waits for [`PrefillScheduler::cancel`] or
//!   [`PrefillScheduler::rank_restarted`].
//! - **An aborted request** whose engine frees the blocks: call
//!   [`PrefillScheduler::cancel`] from the abort path. If the engine never
//!   does, a lease that was assigned but never started is let go by every
//!   rank after `kv_lease_max_pin` (480 s), so its entry and slot come back.
//! - **Bad report bytes**: refused whole, counted, never a panic; reports for
//!   leases this scheduler does not hold under that nonce are counted no-ops.
//!
//! # Allocation
//!
//! Everything is allocated in the constructor; assign, start, cancel, poll,
//! the directive encoder, report decoding and the drain allocate nothing.
//!
//! # Where each part lives
//!
//! This file holds the lease table and its accessors; the calls are grouped
//! by what they decide: `grant.rs` (assign, start, grant, cancel),
//! `directives.rs` (what the ranks are told each step), `reports.rs` (the
//! ranks' let-gos, the releases, the slots back), `backstop.rs` (`poll`),
//! `lost_ranks.rs` (dead and restarted workers), `errors.rs`.

use core::time::Duration;
use std::sync::Arc;

use super::counters::SchedulerCounters;
use super::layout::EntryLayout;
use crate::collections::{DenseSet, FreeStack, Ring};
use crate::config::LeaseConfig;
use crate::ids::{IdError, IdTable};
use crate::ipc::directive::{self, Directive, DirectiveOp};
use crate::ipc::report::{RankReport, ReportMsg};
use crate::ipc::IpcError;
use crate::lease_fields::LeaseFields;
use crate::nonce::{Nonce, NonceSource};
use crate::release_reason::ReleaseReason;
use crate::slot_pool::{SlotPool, SlotTicket};
use crate::time::Instant;
use crate::wheel::TimerWheel;

/// Most ranks one scheduler aggregates (TP × PP of one engine).
pub const MAX_RANKS: u32 = 4096;

const OP_GRANT: u8 = 1;
const OP_START: u8 = 2;
const OP_CANCEL: u8 = 4;

/// Where a lease stands on the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseStatus {
    /// Entry, slot and nonce assigned; the lease has not started.
    Assigned,
    /// Started: ranks hold it until their readers are done or it expires.
    Held,
    /// Every rank reported; waiting for [`PrefillScheduler::drain_released`].
    Released(ReleaseReason),
}

#[derive(Debug)]
struct Lease {
    status: Option<LeaseStatus>,
    nonce: Nonce,
    /// When started: the expiry the ranks are told (their clocks rebase it).
    expiry: Instant,
    hold_until: Instant,
    /// Directives not yet handed out (OP_*).
    ops: u8,
    /// The ranks were told about it (a Grant went out).
    announced: bool,
    /// The backstop's deadline by its pinned or held rule (`Instant::MAX`:
    /// none), restored when a restart takes back the only let-go.
    limit: Instant,
    /// The reason so far, combined over the ranks that reported.
    reason: Option<ReleaseReason>,
    reports: u32,
    slot: Option<SlotTicket>,
}

/// What one rank report did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportOutcome {
    /// Counted; other ranks still hold the lease.
    Counted,
    /// The last rank: the lease is released (drain it).
    Released,
    /// No live lease in that entry under that nonce: ignored.
    Stale,
    /// This rank already reported this lease: ignored.
    Duplicate,
    /// Not one of this scheduler's ranks: ignored.
    BadRank,
}

/// What one report message did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReportSummary {
    /// Reports that counted.
    pub counted: u32,
    /// Leases this message completed.
    pub released: u32,
    /// Stale or duplicate reports: ignored.
    pub ignored: u32,
}

/// A released lease, as reported by [`PrefillScheduler::drain_released`].
#[derive(Debug)]
pub struct Released<'a> {
    /// The request whose blocks may now be freed (vLLM's finished_sending).
    pub request_id: &'a str,
    /// The nonce of the lease released: the engine holds it since the grant,
    /// and must free the blocks of *this* lease (check it, if it keys blocks
    /// by request id alone).
    pub nonce: Nonce,
    /// Why it was released.
    pub reason: ReleaseReason,
    /// The slot it held, already zeroed on every rank. Give it back (to
    /// `blocks_freed` or the pool, from any thread) only after the blocks are
    /// freed.
    pub slot: Option<SlotTicket>,
}

/// The P engine's scheduler-side lease role. See the module docs.
#[derive(Debug)]
pub struct PrefillScheduler {
    layout: EntryLayout,
    ranks: u32,
    duration: Duration,
    max_hold: Option<Duration>,
    verification: bool,
    capacity: u32,
    leases: Box<[Lease]>,
    ids: IdTable,
    unslotted: FreeStack,
    /// Leases live: assigned, held, or released and not drained.
    live: u32,
    /// Leases assigned or held.
    held: u32,
    /// Per entry, one bit per rank that reported it.
    reported: Box<[u64]>,
    words: usize,
    pool: Arc<SlotPool>,
    nonces: NonceSource,
    /// Entries with directives not yet handed out.
    pending: DenseSet,
    released: Ring<u32>,
    directive_seq: u32,
    /// Per rank: the next report sequence number expected (u64::MAX: none yet).
    report_seq: Box<[u64]>,
    /// One bit per rank declared lost ([`PrefillScheduler::rank_lost`]).
    lost: Box<[u64]>,
    lost_count: u32,
    /// `kv_lease_max_pin`: when the ranks let go of a lease never started.
    max_pin: Duration,
    /// The backstop's timer, by entry ([`PrefillScheduler::poll`]).
    backstop: TimerWheel,
    /// Entries whose first rank report came since the last poll.
    straggling: DenseSet,
    counters: SchedulerCounters,
}

impl PrefillScheduler {
    /// A scheduler for an engine of `ranks` workers, with its own pool of
    /// `kv_lease_slots` slots and nonces from OS randomness.
    pub fn new(
        config: &LeaseConfig,
        ranks: u32,
        now: Instant,
    ) -> Result<PrefillScheduler, SchedulerError> {
        let pool = Arc::new(SlotPool::new(config.lease_slots));
        PrefillScheduler::with_parts(config, ranks, pool, NonceSource::from_entropy(), now)
    }

    /// As [`PrefillScheduler::new`] with a given pool (exactly
    /// `kv_lease_slots` slots when verification is on) and nonce source.
    pub fn with_parts(
        config: &LeaseConfig,
        ranks: u32,
        pool: Arc<SlotPool>,
        nonces: NonceSource,
        now: Instant,
    ) -> Result<PrefillScheduler, SchedulerError> {
        if ranks == 0 || ranks > MAX_RANKS {
            return Err(SchedulerError::BadRankCount(ranks));
        }
        let layout = EntryLayout::of(config);
        if config.verification && pool.capacity() != layout.slotted {
            return Err(SchedulerError::PoolMismatch {
                pool: pool.capacity(),
                slots: layout.slotted,
            });
        }
        let entries = layout.entries();
        let words = (ranks as usize).div_ceil(64);
        Ok(PrefillScheduler {
            layout,
            ranks,
            duration: config.lease_duration(),
            max_hold: config.max_hold(),
            verification: config.verification,
            capacity: config.lease_capacity,
            leases: (0..entries)
                .map(|_| Lease {
                    status: None,
                    nonce: Nonce::ONE,
                    expiry: Instant::MAX,
                    hold_until: Instant::MAX,
                    ops: 0,
                    announced: false,
                    limit: Instant::MAX,
                    reason: None,
                    reports: 0,
                    slot: None,
                })
                .collect(),
            ids: IdTable::new(entries, config.max_request_id_len),
            unslotted: FreeStack::range(layout.slotted, entries),
            live: 0,
            held: 0,
            reported: vec![0; entries as usize * words].into_boxed_slice(),
            words,
            pool,
            nonces,
            pending: DenseSet::new(entries),
            released: Ring::new(entries, u32::MAX),
            directive_seq: 0,
            report_seq: vec![u64::MAX; ranks as usize].into_boxed_slice(),
            lost: vec![0; words].into_boxed_slice(),
            lost_count: 0,
            max_pin: config.max_pin,
            // Most deadlines sit one or two lease durations out; the near
            // level covers that, longer ones (max_pin, max_hold) cascade
            // once per far window, which is rare and cheap.
            backstop: TimerWheel::new(
                entries,
                config.wheel_tick(),
                config.lease_duration().saturating_mul(2),
                now,
            ),
            straggling: DenseSet::new(entries),
            counters: SchedulerCounters::default(),
        })
    }

    /// Makes every lease started from now on a fixed term of `term`: the
    /// expiry is `now + term` and the ranks cap renewals there, so nothing
    /// can extend it. D's cache of finished turns ([`crate::decoder_cache`])
    /// is this scheduler with a fixed term of `decoder_kv_blocks_ttl`.
    pub(crate) fn set_fixed_term(&mut self, term: Duration) {
        self.duration = term;
        self.max_hold = Some(term);
    }

    /// Event counts since construction.
    pub fn counters(&self) -> SchedulerCounters {
        self.counters
    }

    /// The ranks whose reports this scheduler waits for.
    pub fn ranks(&self) -> u32 {
        self.ranks
    }

    /// The entry numbering (the ranks must be built from the same config).
    pub fn layout(&self) -> EntryLayout {
        self.layout
    }

    /// Leases assigned or held (not yet released by every rank).
    pub fn held(&self) -> u32 {
        self.held
    }

    /// Released leases waiting for [`PrefillScheduler::drain_released`].
    pub fn pending_releases(&self) -> usize {
        self.released.len()
    }

    /// The pool slots come from; give tickets back here from any thread.
    pub fn slot_pool(&self) -> &Arc<SlotPool> {
        &self.pool
    }

    /// Where the lease of `request_id` stands, if it is live.
    pub fn status(&self, request_id: &str) -> Option<LeaseStatus> {
        let e = self.ids.get(request_id.as_bytes())?;
        self.leases[e as usize].status
    }

    /// The expiry the scheduler gave the lease of `request_id` (its own
    /// clock), if started. Ranks hold their own, renewed copies.
    pub fn expiry(&self, request_id: &str) -> Option<Instant> {
        let e = self.ids.get(request_id.as_bytes())?;
        let l = &self.leases[e as usize];
        (l.status == Some(LeaseStatus::Held)).then_some(l.expiry)
    }
}

mod backstop;
mod directives;
mod errors;
mod grant;
mod lost_ranks;
mod reports;

pub use errors::{GrantError, SchedulerError, StartError};
pub use grant::{Assignment, Grant};
