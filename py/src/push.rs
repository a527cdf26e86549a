//! Push mode's guard (`kvlease::push`): `PushPermits` (D: the write
//! permits it granted with its registrations) and `PushWrites` (P: the
//! registrations it holds and the gate in front of each WRITE), their
//! settings (`PushConfig`), and P's estimate of a D's clock
//! (`ClockEstimate`, which the gate reads).
//!
//! As everywhere here, the library decides and the caller moves the bytes:
//! `poll` and `on_message` take and return notifications as `bytes`, the
//! registration field is 40 ASCII hex digits, and how a permit ended comes
//! back as a tuple. Times are seconds of the caller's monotonic clock; a
//! permit's deadline is on D's clock, which P reads only through its
//! `ClockEstimate` of that D.

use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig, SampleOutcome};
use kvlease::fabric::ClockSample;
use kvlease::push::{self, PermitEnd, PermitFields, PostRefused, PushEnd, Refusal};
use kvlease::{Nonce, NonceSource};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::convert::{counters_dict, instant, seconds, secs, with_bytes};
use crate::errors::{self, raise, wire};

fn duration(name: &str, s: f64) -> PyResult<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(s).map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must be a finite, non-negative number of seconds (got {s})"
        ))
    })
}

/// The guard's settings; the same on D and P.
#[pyclass(module = "kvlease._native", frozen)]
pub(crate) struct PushConfig {
    pub(crate) inner: push::PushConfig,
}

#[pymethods]
impl PushConfig {
    /// The defaults for a permit `duration` (vLLM's `kv_lease_duration`),
    /// each overridable: extension `duration * 2 // 3` and heartbeat
    /// interval `duration // 6` (whole seconds, the pull side's rule),
    /// write bound 10 s, post margin 1 s, 100 ppm, 1,024 registrations,
    /// 64 KiB messages. Raises `ConfigError` on settings the library refuses.
    /// An engine reading vLLM's config takes `LeaseConfig.push_config()`.
    #[new]
    #[pyo3(signature = (duration, *, capacity=None, extension=None, heartbeat_interval=None,
                        write_bound=None, post_margin=None, drift_ppm=None, max_message_len=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        duration: f64,
        capacity: Option<u32>,
        extension: Option<f64>,
        heartbeat_interval: Option<f64>,
        write_bound: Option<f64>,
        post_margin: Option<f64>,
        drift_ppm: Option<u32>,
        max_message_len: Option<usize>,
    ) -> PyResult<Self> {
        let mut c = push::PushConfig::with_duration(self::duration("duration", duration)?);
        if let Some(v) = capacity {
            c.capacity = v;
        }
        if let Some(v) = extension {
            c.extension = self::duration("extension", v)?;
        }
        if let Some(v) = heartbeat_interval {
            c.heartbeat_interval = self::duration("heartbeat_interval", v)?;
        }
        if let Some(v) = write_bound {
            c.write_bound = self::duration("write_bound", v)?;
        }
        if let Some(v) = post_margin {
            c.post_margin = self::duration("post_margin", v)?;
        }
        if let Some(v) = drift_ppm {
            c.drift_ppm = v;
        }
        if let Some(v) = max_message_len {
            c.max_message_len = v;
        }
        c.validate().map_err(errors::config)?;
        Ok(PushConfig { inner: c })
    }

    #[getter]
    fn capacity(&self) -> u32 {
        self.inner.capacity
    }
    #[getter]
    fn duration(&self) -> f64 {
        secs(self.inner.duration)
    }
    #[getter]
    fn extension(&self) -> f64 {
        secs(self.inner.extension)
    }
    #[getter]
    fn heartbeat_interval(&self) -> f64 {
        secs(self.inner.heartbeat_interval)
    }
    #[getter]
    fn write_bound(&self) -> f64 {
        secs(self.inner.write_bound)
    }
    /// How long after its post P holds its own blocks for a WRITE that
    /// never ended (s): by then D's fence has passed, so P lets them go.
    #[getter]
    fn hold_bound(&self) -> f64 {
        secs(self.inner.hold_bound())
    }
    #[getter]
    fn post_margin(&self) -> f64 {
        secs(self.inner.post_margin)
    }
    #[getter]
    fn drift_ppm(&self) -> u32 {
        self.inner.drift_ppm
    }
    #[getter]
    fn max_message_len(&self) -> usize {
        self.inner.max_message_len
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "PushConfig(duration={}, capacity={}, extension={}, heartbeat_interval={}, \
             write_bound={}, post_margin={}, drift_ppm={}, max_message_len={})",
            secs(c.duration),
            c.capacity,
            secs(c.extension),
            secs(c.heartbeat_interval),
            secs(c.write_bound),
            secs(c.post_margin),
            c.drift_ppm,
            c.max_message_len
        )
    }
}

/// P's estimate of one remote clock from round trips
/// (`kvlease::clock_offset::ClockOffset`): the offset, bounded by half the
/// round trip and widened by `drift_ppm` of the sample's age.
#[pyclass(module = "kvlease._native")]
pub(crate) struct ClockEstimate {
    inner: ClockOffset,
}

#[pymethods]
impl ClockEstimate {
    /// An estimate with no sample yet.
    #[new]
    #[pyo3(signature = (drift_ppm=100))]
    fn new(drift_ppm: u32) -> Self {
        ClockEstimate {
            inner: ClockOffset::new(ClockOffsetConfig {
                drift_ppm,
                ..ClockOffsetConfig::default()
            }),
        }
    }

    /// One round trip: our clock when the request left, the remote's clock
    /// in its answer, our clock when the answer came. Returns `"adopted"`
    /// (it is the estimate now), `"kept"` (the current one is as tight) or
    /// `"refused"` (received before sent).
    fn observe(&mut self, local_send: f64, remote: f64, local_recv: f64) -> PyResult<&'static str> {
        let sample = ClockSample {
            local_send: instant(local_send)?,
            remote: instant(remote)?,
            local_recv: instant(local_recv)?,
        };
        Ok(match self.inner.observe(sample) {
            SampleOutcome::Adopted => "adopted",
            SampleOutcome::Kept => "kept",
            SampleOutcome::Refused => "refused",
        })
    }

    /// Whether any sample was adopted (without one, P refuses every
    /// registration of that D).
    #[getter]
    fn has_sample(&self) -> bool {
        self.inner.has_sample()
    }

    /// A remote clock reading on our clock (the estimate's middle), or None
    /// with no sample.
    fn to_local(&self, remote: f64) -> PyResult<Option<f64>> {
        Ok(self.inner.to_local(instant(remote)?).and_then(seconds))
    }

    /// The estimated offset, remote clock minus ours (s), or None with no
    /// sample: what a test compares with the hosts' true offset.
    #[getter]
    fn offset(&self) -> Option<f64> {
        self.inner.offset_nanos().map(|ns| ns as f64 / 1e9)
    }

    /// The estimate's error bound at our clock's `now` (s): half the
    /// sample's round trip, widened for its age; None with no sample.
    fn bound(&self, now: f64) -> PyResult<Option<f64>> {
        Ok(self.inner.bound(instant(now)?).map(secs))
    }
}

/// How a permit ended, as `(slot, nonce, peer, end)`; `end` is `"written"`
/// (the load succeeded), `"refused"`, `"ended_by_p"`, `"lapsed"` or
/// `"revoked"` (failed loads: free the blocks).
type EndTuple = (u32, i64, u16, &'static str);

fn end_tuple(e: PermitEnd) -> EndTuple {
    let end = match e.end {
        PushEnd::Written => "written",
        PushEnd::Refused => "refused",
        PushEnd::EndedByP => "ended_by_p",
        PushEnd::Lapsed => "lapsed",
        PushEnd::Revoked => "revoked",
    };
    (e.slot, e.nonce.as_int64(), e.peer, end)
}

fn permit_nonce(nonce: i64) -> PyResult<Nonce> {
    Nonce::from_int64(nonce).ok_or_else(|| PyValueError::new_err("nonce 0 names no permit"))
}

/// D's write permits (`kvlease::push::PushPermits`). Every ended permit is
/// reported once, by `on_message` or `poll`; from then on its blocks are
/// the engine's again.
#[pyclass(module = "kvlease._native")]
pub(crate) struct PushPermits {
    inner: push::PushPermits,
}

#[pymethods]
impl PushPermits {
    /// Room for `config.capacity` permits; everything allocated now.
    /// `seed`: nonces from a seeded sequence (tests); None: from entropy.
    #[new]
    #[pyo3(signature = (config, seed=None))]
    fn new(config: &PushConfig, seed: Option<u64>) -> PyResult<Self> {
        let nonces = match seed {
            Some(s) => NonceSource::from_seed(s, 0x6b76_6c65, 0x7075_7368),
            None => NonceSource::from_entropy(),
        };
        let inner = push::PushPermits::new(config.inner, nonces).map_err(errors::config)?;
        Ok(PushPermits { inner })
    }

    /// A permit for a registration to P peer `peer`: returns `(slot, nonce,
    /// field)`, where `field` (40 ASCII hex digits) goes with the
    /// registration. Raises `PushError` (`Exhausted`) when no permit is
    /// free: fail the load, do not register.
    fn register<'py>(
        &mut self,
        py: Python<'py>,
        peer: u16,
        now: f64,
    ) -> PyResult<(u32, i64, Bound<'py, PyBytes>)> {
        let f = self
            .inner
            .register(peer, instant(now)?)
            .map_err(|e| raise("PushError", e))?;
        Ok((f.slot, f.nonce.as_int64(), PyBytes::new(py, &f.encode())))
    }

    /// D gives up on the push (abort, preemption, its own watchdog): P is
    /// told, and the permit ends when P answers or at its fence, never
    /// before a WRITE of P could still land. Keep the blocks until then.
    fn revoke(&mut self, slot: u32, nonce: i64) -> PyResult<()> {
        self.inner
            .revoke(slot, permit_nonce(nonce)?)
            .map_err(|e| raise("PushError", e))
    }

    /// A notification from P peer `peer`; returns the permits it ended.
    /// Raises `WireError` on bytes that are not a push message (nothing
    /// changed).
    fn on_message(
        &mut self,
        peer: u16,
        msg: &Bound<'_, PyAny>,
        now: f64,
    ) -> PyResult<Vec<EndTuple>> {
        let now = instant(now)?;
        let mut ends = Vec::new();
        with_bytes(msg, |b| {
            self.inner
                .on_message(peer, b, now, |e| ends.push(end_tuple(e)))
                .map_err(wire)
        })?;
        Ok(ends)
    }

    /// Once per step: returns `(messages, ended)`, the `(peer, bytes)`
    /// notifications to send to P (renewals, revocations) and the permits
    /// that ended at their fence.
    #[allow(clippy::type_complexity)]
    fn poll<'py>(
        &mut self,
        py: Python<'py>,
        now: f64,
    ) -> PyResult<(Vec<(u16, Bound<'py, PyBytes>)>, Vec<EndTuple>)> {
        let (mut out, mut ends) = (Vec::new(), Vec::new());
        self.inner.poll(
            instant(now)?,
            |peer, m| out.push((peer, PyBytes::new(py, m))),
            |e| ends.push(end_tuple(e)),
        );
        Ok((out, ends))
    }

    /// The permit's deadline on this clock, or None if it is not live.
    fn deadline(&self, slot: u32, nonce: i64) -> PyResult<Option<f64>> {
        Ok(self
            .inner
            .deadline(slot, permit_nonce(nonce)?)
            .and_then(seconds))
    }

    /// The moment after which no WRITE under `deadline` can land.
    fn fence(&self, deadline: f64) -> PyResult<Option<f64>> {
        Ok(seconds(self.inner.fence(instant(deadline)?)))
    }

    /// Permits live now.
    #[getter]
    fn live(&self) -> u32 {
        self.inner.live()
    }

    /// The P peers that live permits name: a peer in none of them may be
    /// forgotten and its id given to another engine. O(live permits): for
    /// making room in a full peer table, not for every step.
    fn peers_in_use(&self) -> std::collections::BTreeSet<u16> {
        self.inner.peers_in_use().collect()
    }

    /// What it did so far.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.counters();
        counters_dict!(
            py,
            c,
            [
                registered,
                exhausted,
                renewed,
                revoked,
                written,
                refused,
                ended_by_p,
                lapsed,
                revoke_ended,
                stale_records,
                malformed,
                messages_sent
            ]
        )
    }
}

/// P's name for one registration it accepted.
#[pyclass(module = "kvlease._native", frozen, eq, hash)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct WriteHandle {
    inner: push::WriteHandle,
}

#[pymethods]
impl WriteHandle {
    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }
}

fn refusal_name(r: Refusal) -> &'static str {
    match r {
        Refusal::RequestGone => "request_gone",
        Refusal::NoClock => "no_clock",
        Refusal::PastDeadline => "past_deadline",
        Refusal::Exhausted => "exhausted",
        Refusal::AlreadyEnded(_) => "already_ended",
    }
}

/// P's registrations (`kvlease::push::PushWrites`): one WRITE each, posted
/// only while the gate is open.
#[pyclass(module = "kvlease._native")]
pub(crate) struct PushWrites {
    inner: push::PushWrites,
}

#[pymethods]
impl PushWrites {
    /// Room for `config.capacity` registrations. `hash_key` keys the index
    /// (random per process: D's fields come off the wire).
    #[new]
    fn new(config: &PushConfig, hash_key: u64) -> PyResult<Self> {
        let inner = push::PushWrites::new(config.inner, hash_key).map_err(errors::config)?;
        Ok(PushWrites { inner })
    }

    /// D peer `peer`'s registration `field` (the 40 hex digits) for a
    /// request P still has (`request_live`) or not. Returns `(handle,
    /// None)` when accepted, or `(None, reason)`: `"request_gone"`,
    /// `"no_clock"`, `"past_deadline"`, `"already_ended"` (P answers D in
    /// the next `poll`) or `"exhausted"` (no room: not answered, D's fence
    /// ends it), or `"duplicate"`: a copy of a live registration P holds
    /// already (its WRITE or its end answers both). Raises `WireError` on a
    /// malformed field.
    fn register(
        &mut self,
        peer: u16,
        field: &Bound<'_, PyAny>,
        request_live: bool,
        clock: &ClockEstimate,
        now: f64,
    ) -> PyResult<(Option<WriteHandle>, Option<&'static str>)> {
        let now = instant(now)?;
        let fields = with_bytes(field, |b| PermitFields::decode(b).map_err(wire))?;
        let seen = self.inner.counters().duplicates;
        Ok(
            match self
                .inner
                .register(peer, fields, request_live, &clock.inner, now)
            {
                Ok(_) if self.inner.counters().duplicates != seen => (None, Some("duplicate")),
                Ok(h) => (Some(WriteHandle { inner: h }), None),
                Err(r) => (None, Some(refusal_name(r))),
            },
        )
    }

    /// Right before posting the WRITE of `handle`: None when it may be
    /// posted now (within `post_margin`), else why not: `"closed"` (D
    /// revoked it or its deadline is too close: P ended it, do not post),
    /// `"already_posted"`, `"unknown_handle"`.
    fn begin_write(
        &mut self,
        handle: &WriteHandle,
        clock: &ClockEstimate,
        now: f64,
    ) -> PyResult<Option<&'static str>> {
        Ok(
            match self
                .inner
                .begin_write(handle.inner, &clock.inner, instant(now)?)
            {
                Ok(()) => None,
                Err(PostRefused::Closed) => Some("closed"),
                Err(PostRefused::AlreadyPosted) => Some("already_posted"),
                Err(PostRefused::UnknownHandle) => Some("unknown_handle"),
            },
        )
    }

    /// The posted WRITE of `handle` reached its terminal state (`ok`: the
    /// data is in D's blocks). False for a handle with no WRITE in flight.
    fn write_done(&mut self, handle: &WriteHandle, ok: bool, now: f64) -> PyResult<bool> {
        Ok(self.inner.write_done(handle.inner, ok, instant(now)?))
    }

    /// P lets the request go before writing: a held registration ends.
    fn cancel(&mut self, handle: &WriteHandle) -> bool {
        self.inner.cancel(handle.inner)
    }

    /// A notification from D peer `peer` (renewals, revocations). Raises
    /// `WireError` on bytes that are not a push message.
    fn on_message(&mut self, peer: u16, msg: &Bound<'_, PyAny>) -> PyResult<()> {
        with_bytes(msg, |b| self.inner.on_message(peer, b).map_err(wire))
    }

    /// Once per step: the `(peer, bytes)` notifications to send to D (ends
    /// owed, and every heartbeat interval the `PHB:` naming what P holds).
    /// `clocks` maps each D peer to P's `ClockEstimate` of it; a peer with
    /// none has every gate closed.
    fn poll<'py>(
        &mut self,
        py: Python<'py>,
        clocks: &Bound<'py, PyDict>,
        now: f64,
    ) -> PyResult<Vec<(u16, Bound<'py, PyBytes>)>> {
        let now = instant(now)?;
        // Only a poll that scans reads the estimates: the others (most of
        // them: every drain of vLLM's writer thread polls) take none.
        let mut held: Vec<(u16, PyRef<'py, ClockEstimate>)> = Vec::new();
        if self.inner.scans_at(now) {
            held.reserve(clocks.len());
            for (k, v) in clocks.iter() {
                held.push((k.extract()?, v.extract()?));
            }
            held.sort_unstable_by_key(|(p, _)| *p);
        }
        let mut out = Vec::new();
        self.inner.poll(
            |peer| {
                let at = held.binary_search_by_key(&peer, |(p, _)| *p).ok()?;
                Some(&held[at].1.inner)
            },
            now,
            |peer, m| out.push((peer, PyBytes::new(py, m))),
        );
        Ok(out)
    }

    /// Registrations held, ended ones kept for duplicates included.
    #[getter]
    fn held(&self) -> u32 {
        self.inner.held()
    }

    /// The D peers that held entries name (ended ones kept for duplicates
    /// or owing an answer included): a peer in none of them may be
    /// forgotten and its id given to another engine. O(held entries): for
    /// making room in a full peer table, not for every step.
    fn peers_in_use(&self) -> std::collections::BTreeSet<u16> {
        self.inner.peers_in_use().collect()
    }

    /// What it did so far.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.counters();
        counters_dict!(
            py,
            c,
            [
                accepted,
                refused_gone,
                refused_no_clock,
                refused_past_deadline,
                refused_exhausted,
                duplicates,
                posted,
                closed_at_gate,
                written,
                ended,
                revoked,
                renewed,
                stale_records,
                malformed,
                messages_sent,
                late_writes
            ]
        )
    }
}
