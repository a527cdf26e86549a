//! The D side's scheduler role (`HeartbeatTracker`) and the verify-outcome
//! messages its workers send it.

use kvlease::consumer::{RemotePrefillParams, TrackOutcome, Verdict};
use kvlease::ipc::outcome::{self, Outcome, OutcomeMsg};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::config::LeaseConfig;
use crate::convert::{counters_dict, instant, with_bytes};
use crate::errors::{self, raise};

/// A verdict's name as Python sees it.
pub(crate) fn verdict_name(v: Verdict) -> String {
    match v {
        Verdict::Verified => "verified".into(),
        Verdict::Lapsed => "lapsed".into(),
        Verdict::Unverifiable => "unverifiable".into(),
        Verdict::SlotOutOfRange => "slot_out_of_range".into(),
        Verdict::Unchecked => "unchecked".into(),
        Verdict::ReadFailed(e) => format!("read_failed: {e}"),
        _ => "unknown".into(),
    }
}

/// The verdict a name stands for (the plain ones; a failed READ is
/// `"read_failed"`, with the backend error).
fn verdict_of(name: &str) -> PyResult<Verdict> {
    Ok(match name {
        "verified" => Verdict::Verified,
        "lapsed" => Verdict::Lapsed,
        "unverifiable" => Verdict::Unverifiable,
        "slot_out_of_range" => Verdict::SlotOutOfRange,
        "unchecked" => Verdict::Unchecked,
        n if n.starts_with("read_failed") => Verdict::ReadFailed(kvlease::FabricError::Backend(-1)),
        other => {
            return Err(PyValueError::new_err(format!("unknown verdict {other:?}")));
        }
    })
}

/// D's scheduler-side tracking (`kvlease::consumer::HeartbeatTracker`):
/// which requests to keep alive on which P engine, and the aggregation of
/// every D worker's verify outcome (a request counts as received only once
/// every worker verified its share).
#[pyclass(module = "kvlease._native")]
pub(crate) struct HeartbeatTracker {
    inner: kvlease::consumer::HeartbeatTracker,
}

/// The `kv_transfer_params` fields the tracker reads, owned for the call.
#[derive(Default)]
struct Params {
    do_remote_prefill: bool,
    engine: Option<String>,
    request: Option<String>,
    host: Option<String>,
    port: Option<u16>,
    tp: Option<u32>,
    pp: Option<u32>,
    dcp: Option<u32>,
    slot: Option<u32>,
    nonce: Option<i64>,
}

fn get<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<T>> {
    match d.get_item(key)? {
        Some(v) if !v.is_none() => match v.extract::<T>() {
            Ok(x) => Ok(Some(x)),
            Err(e) => {
                let e: PyErr = e.into();
                Err(PyValueError::new_err(format!(
                    "kv_transfer_params[{key:?}]: {e}"
                )))
            }
        },
        _ => Ok(None),
    }
}

impl Params {
    fn from_dict(d: &Bound<'_, PyDict>) -> PyResult<Params> {
        Ok(Params {
            do_remote_prefill: get(d, "do_remote_prefill")?.unwrap_or(false),
            engine: get(d, "remote_engine_id")?,
            request: get(d, "remote_request_id")?,
            host: get(d, "remote_host")?,
            port: get(d, "remote_port")?,
            tp: get(d, "tp_size")?,
            pp: get(d, "pp_size")?,
            dcp: get(d, "dcp_size")?,
            slot: get(d, "remote_lease_slot")?,
            nonce: get(d, "remote_lease_nonce")?,
        })
    }

    fn borrowed(&self) -> RemotePrefillParams<'_> {
        RemotePrefillParams {
            do_remote_prefill: self.do_remote_prefill,
            remote_engine_id: self.engine.as_deref(),
            remote_request_id: self.request.as_deref(),
            remote_host: self.host.as_deref(),
            remote_port: self.port,
            tp_size: self.tp,
            pp_size: self.pp,
            dcp_size: self.dcp,
            remote_lease_slot: self.slot,
            remote_lease_nonce: self.nonce,
            ..Default::default()
        }
    }
}

#[pymethods]
impl HeartbeatTracker {
    /// A tracker for a D engine of `workers` workers (its TP size).
    #[new]
    fn new(config: &LeaseConfig, workers: u32) -> PyResult<Self> {
        let inner = kvlease::consumer::HeartbeatTracker::new(&config.inner, workers)
            .map_err(|e| raise("ConfigError", e))?;
        Ok(HeartbeatTracker { inner })
    }

    /// vLLM's `on_new_request`: starts tracking `request_id` if its
    /// `kv_transfer_params` ask for a remote prefill. Returns `"started"`,
    /// `"not_remote_prefill"`, or `"missing:<field>"`. Raises `TrackError`
    /// when the tracker refuses it (full, duplicate, a bad field).
    fn on_new_request(
        &mut self,
        request_id: &str,
        params: &Bound<'_, PyDict>,
        now: f64,
    ) -> PyResult<String> {
        let p = Params::from_dict(params)?;
        let out = self
            .inner
            .on_new_request(request_id, &p.borrowed(), instant(now)?)
            .map_err(|e| raise("TrackError", e))?;
        Ok(match out {
            TrackOutcome::Started => "started".into(),
            TrackOutcome::NotRemotePrefill => "not_remote_prefill".into(),
            TrackOutcome::MissingParam { field } => format!("missing:{field}"),
        })
    }

    /// The request finished or was aborted: tracking stops. Returns whether
    /// it was tracked.
    fn on_request_finished(&mut self, request_id: &str) -> bool {
        self.inner.on_request_finished(request_id)
    }

    /// The request's KV transfer completed: tracking stops.
    fn on_transfer_complete(&mut self, request_id: &str) -> bool {
        self.inner.on_transfer_complete(request_id)
    }

    /// This step's heartbeat plan for every worker.
    fn encode_plan<'py>(&mut self, py: Python<'py>, now: f64) -> PyResult<Bound<'py, PyBytes>> {
        let now = instant(now)?;
        let len = self.inner.plan_len(now);
        let inner = &mut self.inner;
        PyBytes::new_with(py, len, |buf| {
            inner.encode_plan(now, buf).map_err(errors::ipc)?;
            Ok(())
        })
    }

    /// Applies one worker's verify-outcome message; returns the decided
    /// requests as `(request_id, verdict)` (`"verified"` / `"unchecked"`:
    /// received; anything else: the load failed). Raises `IpcError` for a
    /// message that does not decode, or from a worker rank the tracker was
    /// not built for (whose requests fail: they are in `e.args`... see the
    /// library's `apply_outcomes`).
    fn apply_outcomes(&mut self, msg: &Bound<'_, PyAny>) -> PyResult<Vec<(String, String)>> {
        with_bytes(msg, |msg| {
            let decoded = OutcomeMsg::decode(msg).map_err(errors::ipc)?;
            let mut out = Vec::new();
            let r = self.inner.apply_outcomes(&decoded, |id, v| {
                out.push((id.to_owned(), verdict_name(v)));
            });
            match r {
                Ok(_) => Ok(out),
                Err(e) => Err(errors::ipc(e)),
            }
        })
    }

    /// Requests tracked now.
    #[getter]
    fn tracked(&self) -> u32 {
        self.inner.len()
    }

    /// Event counts since construction.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.counters();
        counters_dict!(
            py,
            c,
            [
                started,
                started_without_lease,
                ignored_not_remote_prefill,
                missing_params,
                refused_requests_full,
                refused_engines_full,
                refused_duplicate,
                refused_bad_param,
                not_heartbeated,
                stopped_transfer_complete,
                stopped_finished,
                outcomes,
                outcomes_untracked,
                outcomes_refused,
                loads_verified,
                loads_unverified,
                loads_failed,
            ]
        )
    }
}

/// One worker's verify-outcome message: `outcomes` as `(d_request_id,
/// verdict)` from worker `rank`, message number `seq`.
#[pyfunction]
pub(crate) fn encode_outcomes<'py>(
    py: Python<'py>,
    rank: u32,
    seq: u32,
    outcomes: Vec<(String, String)>,
) -> PyResult<Bound<'py, PyBytes>> {
    let verdicts: Vec<Verdict> = outcomes
        .iter()
        .map(|(_, v)| verdict_of(v))
        .collect::<PyResult<_>>()?;
    let it = outcomes
        .iter()
        .zip(&verdicts)
        .map(|((id, _), &verdict)| Outcome {
            request_id: id,
            verdict,
        });
    let len = outcome::encoded_len(it.clone(), 0);
    PyBytes::new_with(py, len, |buf| {
        outcome::encode(buf, rank, seq, it, core::iter::empty()).map_err(errors::ipc)?;
        Ok(())
    })
}

/// The outcomes of a verify-outcome message: `(rank, [(d_request_id,
/// verdict)])`. Raises `IpcError` for bytes that do not decode.
#[pyfunction]
pub(crate) fn decode_outcomes(msg: &Bound<'_, PyAny>) -> PyResult<(u32, Vec<(String, String)>)> {
    with_bytes(msg, |msg| {
        let m = OutcomeMsg::decode(msg).map_err(errors::ipc)?;
        Ok((
            m.rank(),
            m.iter()
                .map(|o| (o.request_id.to_owned(), verdict_name(o.verdict)))
                .collect(),
        ))
    })
}
