//! The P side: `PrefillScheduler` (one per engine, in vLLM's scheduler
//! process) and `PrefillRank` (one per worker, owning the lease-slot array
//! that the worker's `nixl_agent` registers).
//!
//! Directives go from the scheduler to every rank as one `bytes` object per
//! step (carried in vLLM's connector metadata); reports come back as one
//! `bytes` object per rank per step (the worker-metadata channel).

use std::sync::Arc;

use kvlease::producer::{LeaseStatus, ShareOutcome};
use kvlease::{LeaseSlots, ReleaseReason};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::config::LeaseConfig;
use crate::convert::{counters_dict, instant, seconds, with_bytes};
use crate::errors::{self, raise};

/// A released lease's slot: give it back with
/// `PrefillScheduler.blocks_freed` once the engine freed the blocks, and
/// only then (the next lease may get the slot at once). Usable once.
#[pyclass(module = "kvlease._native")]
pub(crate) struct SlotTicket {
    ticket: Option<kvlease::SlotTicket>,
    slot: u32,
}

#[pymethods]
impl SlotTicket {
    /// The slot index.
    #[getter]
    fn slot(&self) -> u32 {
        self.slot
    }

    fn __repr__(&self) -> String {
        let state = if self.ticket.is_some() {
            ""
        } else {
            ", returned"
        };
        format!("SlotTicket(slot={}{state})", self.slot)
    }
}

/// The release reason's name as Python sees it.
pub(crate) fn reason_name(r: ReleaseReason) -> &'static str {
    match r {
        ReleaseReason::ReadDone => "read_done",
        ReleaseReason::Expired => "expired",
        ReleaseReason::Cancelled => "cancelled",
        ReleaseReason::NotHeld => "not_held",
    }
}

/// The P engine's scheduler-side lease role (`kvlease::PrefillScheduler`):
/// entries, slots and nonces, directives for the ranks, the aggregation of
/// their reports, and slot reuse only after the blocks were freed.
#[pyclass(module = "kvlease._native")]
pub(crate) struct PrefillScheduler {
    inner: kvlease::PrefillScheduler,
}

#[pymethods]
impl PrefillScheduler {
    /// A scheduler for an engine of `ranks` workers (TP x PP).
    #[new]
    fn new(config: &LeaseConfig, ranks: u32, now: f64) -> PyResult<Self> {
        let inner = kvlease::PrefillScheduler::new(&config.inner, ranks, instant(now)?)
            .map_err(|e| raise("ConfigError", e))?;
        Ok(PrefillScheduler { inner })
    }

    /// Assigns `request_id` an entry, a nonce and (verification on, a slot
    /// free) a slot; the next `encode_directives` makes every rank publish
    /// the nonce. Call when the request is first scheduled. Returns
    /// `(slot, nonce)` for `kv_transfer_params` (`remote_lease_slot`,
    /// `remote_lease_nonce`, nonce as int64), or `None` when the lease is
    /// granted without verification fields. Raises `GrantError`.
    fn assign(&mut self, request_id: &str, now: f64) -> PyResult<Option<(u32, i64)>> {
        let a = self
            .inner
            .assign(request_id, instant(now)?)
            .map_err(|e| raise("GrantError", e))?;
        Ok(a.fields.map(|f| (f.slot, f.nonce_param())))
    }

    /// Starts the lease of an assigned request (its prefill finished);
    /// returns its expiry (seconds, this clock). Raises `StartError`.
    fn start(&mut self, request_id: &str, now: f64) -> PyResult<f64> {
        let expiry = self
            .inner
            .start(request_id, instant(now)?)
            .map_err(|e| raise("StartError", e))?;
        Ok(seconds(expiry).unwrap_or(f64::INFINITY))
    }

    /// `assign` and `start` in one step. Returns what `assign` returns.
    fn grant(&mut self, request_id: &str, now: f64) -> PyResult<Option<(u32, i64)>> {
        let g = self
            .inner
            .grant(request_id, instant(now)?)
            .map_err(|e| raise("GrantError", e))?;
        Ok(g.fields.map(|f| (f.slot, f.nonce_param())))
    }

    /// Releases the lease of `request_id` (aborted or preempted on P,
    /// engine shutdown). Returns whether a live lease was found.
    fn cancel(&mut self, request_id: &str) -> bool {
        self.inner.cancel(request_id)
    }

    /// The backstop: probes every started lease a rank left unanswered (one
    /// rank let go a `kv_lease_duration` ago and another never answered: its
    /// Start goes out again, a duplicate to ranks that hold it), and
    /// cancels a lease past `kv_lease_max_pin` / `kv_lease_max_hold` by as
    /// much. Returns how many directives it queued. Call once per step,
    /// before `encode_directives`.
    fn poll(&mut self, now: f64) -> PyResult<u32> {
        Ok(self.inner.poll(instant(now)?))
    }

    /// This step's directives as one message for every rank (empty when
    /// there is nothing to say: then send nothing).
    fn encode_directives<'py>(
        &mut self,
        py: Python<'py>,
        now: f64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let now = instant(now)?;
        if self.inner.pending_directives() == 0 {
            return Ok(PyBytes::new(py, b""));
        }
        let len = self.inner.directives_len(now);
        let inner = &mut self.inner;
        PyBytes::new_with(py, len, |buf| {
            let n = inner.encode_directives(now, buf).map_err(errors::ipc)?;
            debug_assert_eq!(n, len);
            Ok(())
        })
    }

    /// Applies one report message of worker `rank`. Returns `(counted,
    /// released, ignored)`. Raises `IpcError` for bytes that do not decode
    /// (counted; nothing applied).
    fn apply_reports(&mut self, rank: u32, msg: &Bound<'_, PyAny>) -> PyResult<(u32, u32, u32)> {
        with_bytes(msg, |msg| {
            if msg.is_empty() {
                return Ok((0, 0, 0));
            }
            let s = self.inner.apply_reports(rank, msg).map_err(errors::ipc)?;
            Ok((s.counted, s.released, s.ignored))
        })
    }

    /// Every lease released by every rank, oldest first, as
    /// `(request_id, nonce, reason, ticket)`: free the request's blocks,
    /// then give the ticket (if any) to `blocks_freed`.
    fn drain_released(&mut self) -> Vec<(String, i64, &'static str, Option<SlotTicket>)> {
        let mut out = Vec::new();
        self.inner.drain_released(|r| {
            let ticket = r.slot.map(|t| SlotTicket {
                slot: t.slot(),
                ticket: Some(t),
            });
            out.push((
                r.request_id.to_owned(),
                r.nonce.as_int64(),
                reason_name(r.reason),
                ticket,
            ));
        });
        out
    }

    /// The engine freed the blocks of a released lease: its slot may be
    /// reused. A ticket is usable once (`ValueError` the second time).
    fn blocks_freed(&mut self, ticket: &mut SlotTicket) -> PyResult<()> {
        let t = ticket
            .ticket
            .take()
            .ok_or_else(|| PyValueError::new_err("this slot ticket was given back already"))?;
        self.inner.blocks_freed(t);
        Ok(())
    }

    /// Rank `rank`'s worker process died: every live lease, and every lease
    /// granted until `rank_restarted`, counts as let go by it.
    fn rank_lost(&mut self, rank: u32) {
        self.inner.rank_lost(rank)
    }

    /// A fresh worker process took rank `rank`'s place.
    fn rank_restarted(&mut self, rank: u32) {
        self.inner.rank_restarted(rank)
    }

    /// Where the lease of `request_id` stands: `"assigned"`, `"held"`,
    /// `"released"`, or `None`.
    fn status(&self, request_id: &str) -> Option<&'static str> {
        self.inner.status(request_id).map(|s| match s {
            LeaseStatus::Assigned => "assigned",
            LeaseStatus::Held => "held",
            LeaseStatus::Released(_) => "released",
        })
    }

    /// Leases assigned or held.
    #[getter]
    fn held(&self) -> u32 {
        self.inner.held()
    }

    /// Directives waiting for the next `encode_directives`.
    #[getter]
    fn pending_directives(&self) -> u32 {
        self.inner.pending_directives()
    }

    /// Event counts since construction.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.counters();
        counters_dict!(
            py,
            c,
            [
                granted,
                granted_without_slot,
                grant_refused_full,
                grant_refused_bad_id,
                grant_refused_duplicate,
                grant_refused_release_pending,
                grant_refused_no_ranks,
                backstop_probes,
                backstop_cancels,
                directives_sent,
                reports_applied,
                reports_stale,
                reports_duplicate,
                reports_not_held,
                report_messages_refused,
                report_seq_gaps,
                released_read,
                expired,
                cancelled,
                not_held,
                lost_rank_releases,
                ranks_restarted,
                reported,
                slots_returned,
            ]
        )
    }
}

/// One P worker's share of the leases (`kvlease::PrefillRank`), with its
/// lease-slot array: register `slots_address`/`slots_nbytes` with the
/// worker's `nixl_agent` (DRAM) and advertise them in the handshake.
#[pyclass(module = "kvlease._native")]
pub(crate) struct PrefillRank {
    inner: kvlease::PrefillRank,
    slots: Arc<LeaseSlots>,
}

/// A share outcome's name as Python sees it.
fn share_name(s: ShareOutcome) -> &'static str {
    match s {
        ShareOutcome::ShareReleased => "share_released",
        ShareOutcome::Counted => "counted",
        ShareOutcome::Unknown => "unknown",
        ShareOutcome::StaleNonce => "stale_nonce",
        ShareOutcome::DuplicateSender => "duplicate_sender",
        _ => "other",
    }
}

#[pymethods]
impl PrefillRank {
    /// Rank `rank` of the engine configured by `config`, with a fresh
    /// slot array of `kv_lease_slots` words (all 0).
    #[new]
    fn new(config: &LeaseConfig, rank: u32, now: f64) -> PyResult<Self> {
        let slots = Arc::new(LeaseSlots::new(config.inner.lease_slots));
        let inner =
            kvlease::PrefillRank::new(&config.inner, rank, Arc::clone(&slots), instant(now)?)
                .map_err(|e| raise("ConfigError", e))?;
        Ok(PrefillRank { inner, slots })
    }

    /// This rank's index.
    #[getter]
    fn rank(&self) -> u32 {
        self.inner.rank()
    }

    /// Address of the slot array (int64 words, little endian), to register.
    #[getter]
    fn slots_address(&self) -> usize {
        self.slots.as_ptr() as usize
    }

    /// Bytes the slot array spans.
    #[getter]
    fn slots_nbytes(&self) -> usize {
        self.slots.byte_len()
    }

    /// Number of lease slots.
    #[getter]
    fn slot_count(&self) -> u32 {
        self.slots.len()
    }

    /// The word slot `slot` holds now (its lease's nonce, or 0).
    fn slot_word(&self, slot: u32) -> Option<i64> {
        self.slots.load(slot).map(|w| w as i64)
    }

    /// Applies one directive message from the scheduler (empty: nothing).
    /// Returns `(applied, ignored, refused)`. Raises `IpcError` for bytes
    /// that do not decode (counted; nothing applied).
    fn apply_directives(&mut self, msg: &Bound<'_, PyAny>, now: f64) -> PyResult<(u32, u32, u32)> {
        let now = instant(now)?;
        with_bytes(msg, |msg| {
            if msg.is_empty() {
                return Ok((0, 0, 0));
            }
            let s = self.inner.apply_directives(msg, now).map_err(errors::ipc)?;
            Ok((s.applied, s.ignored, s.refused))
        })
    }

    /// Applies one notification received from agent `sender`: a heartbeat
    /// renews, a read-done counts (once per sender and lease). Returns
    /// `(renewed, ignored, read_done)`, `read_done` being `None` or the
    /// outcome's name (`"share_released"`, `"counted"`, `"unknown"`,
    /// `"stale_nonce"`, `"duplicate_sender"`). Raises `WireError` for a
    /// message that does not decode (counted).
    fn on_notification(
        &mut self,
        sender: &str,
        msg: &Bound<'_, PyAny>,
        now: f64,
    ) -> PyResult<(u32, u32, Option<&'static str>)> {
        let now = instant(now)?;
        with_bytes(msg, |msg| {
            let s = self
                .inner
                .on_notification(sender, msg, now)
                .map_err(errors::wire)?;
            Ok((s.renewed, s.ignored, s.read_done.map(share_name)))
        })
    }

    /// Expires what is due (leases past their deadline, pinned leases past
    /// `kv_lease_max_pin`). Call once per step.
    fn poll(&mut self, now: f64) -> PyResult<()> {
        self.inner.poll(instant(now)?);
        Ok(())
    }

    /// This step's reports as one message for the scheduler (empty when
    /// there are none: then send nothing).
    fn encode_reports<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        if self.inner.pending_reports() == 0 {
            return Ok(PyBytes::new(py, b""));
        }
        let len = self.inner.reports_len();
        let inner = &mut self.inner;
        PyBytes::new_with(py, len, |buf| {
            inner.encode_reports(buf).map_err(errors::ipc)?;
            Ok(())
        })
    }

    /// Leases this rank holds.
    #[getter]
    fn held(&self) -> u32 {
        self.inner.held()
    }

    /// When this rank's lease of `request_id` lapses (seconds), `inf` while
    /// pinned, `None` when it holds none.
    fn expiry(&self, request_id: &str) -> Option<f64> {
        self.inner
            .expiry(request_id)
            .map(|t| seconds(t).unwrap_or(f64::INFINITY))
    }

    /// Event counts since construction.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.counters();
        counters_dict!(
            py,
            c,
            [
                directives_applied,
                directives_duplicate,
                directives_stale,
                directives_refused,
                directive_conflicts,
                directive_messages_refused,
                directive_seq_gaps,
                renewed,
                renew_capped,
                renew_unknown,
                renew_nonce_mismatch,
                heartbeat_empty_ids,
                read_done,
                read_done_without_nonce,
                read_done_unknown,
                read_done_stale_nonce,
                read_done_duplicate_sender,
                malformed_notifications,
                released_read,
                expired,
                cancelled,
                pinned_expired,
                not_held_reported,
                senders_evicted,
                reports_dropped,
                reports_sent,
            ]
        )
    }
}
