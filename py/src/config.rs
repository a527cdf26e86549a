//! `LeaseConfig`: `kv_connector_extra_config` parsed by the library, its
//! derived values as Python numbers.

use kvlease::EngineShape;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::convert::secs;
use crate::errors;

/// Every lease setting and capacity, parsed from vLLM's
/// `kv_connector_extra_config` (the keys `kv_lease_duration`,
/// `kv_lease_verification`, `kv_lease_slots`, `kv_lease_max_hold`, ...).
/// Keys it does not know are kept in `unknown_keys` (log them: a misspelt
/// key leaves its default in force).
#[pyclass(module = "kvlease._native", frozen)]
pub(crate) struct LeaseConfig {
    pub(crate) inner: kvlease::LeaseConfig,
    unknown: Vec<String>,
}

#[pymethods]
impl LeaseConfig {
    /// Parses `extra` (a JSON object as `str`, a `dict`, or `None` for the
    /// defaults) for an engine of `num_kv_blocks` KV blocks and
    /// `max_num_seqs` sequences (the defaults of `kv_lease_slots` and
    /// `kv_lease_capacity` derive from them). A whole `--kv-transfer-config`
    /// object works too: its `kv_connector_extra_config` member is used.
    /// Raises `kvlease.errors.ConfigError` naming the key at fault.
    #[staticmethod]
    #[pyo3(signature = (extra, num_kv_blocks, max_num_seqs))]
    fn parse(
        py: Python<'_>,
        extra: Option<&Bound<'_, PyAny>>,
        num_kv_blocks: u32,
        max_num_seqs: u32,
    ) -> PyResult<LeaseConfig> {
        let shape = EngineShape {
            num_kv_blocks,
            max_num_seqs,
        };
        let json: String = match extra {
            None => "{}".to_string(),
            Some(v) if v.is_instance_of::<PyString>() => v.extract()?,
            Some(v) if v.is_instance_of::<PyDict>() => {
                py.import("json")?.call_method1("dumps", (v,))?.extract()?
            }
            Some(v) => {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "extra must be a JSON str, a dict or None, not {}",
                    v.get_type().name()?
                )))
            }
        };
        let parsed =
            kvlease::LeaseConfig::from_extra_config_json(&json, shape).map_err(errors::config)?;
        Ok(LeaseConfig {
            inner: parsed.config,
            unknown: parsed.unknown_keys,
        })
    }

    /// Keys of the object that are not kvlease settings, sorted.
    #[getter]
    fn unknown_keys(&self) -> Vec<String> {
        self.unknown.clone()
    }

    /// `kv_lease_duration` in seconds: the initial lease on P.
    #[getter]
    fn lease_duration(&self) -> f64 {
        secs(self.inner.lease_duration())
    }

    /// `kv_lease_duration // 6`, whole seconds: D's heartbeat interval.
    #[getter]
    fn heartbeat_interval(&self) -> f64 {
        secs(self.inner.heartbeat_interval())
    }

    /// `kv_lease_duration * 2 // 3`, whole seconds: a renewal's extension.
    #[getter]
    fn lease_extension(&self) -> f64 {
        secs(self.inner.lease_extension())
    }

    /// Push mode's guard settings from the same keys: a permit lasts
    /// `kv_lease_duration`, with this config's interval and extension (one
    /// derivation), `kv_lease_push_write_bound` and `kv_lease_push_capacity`
    /// (parsed and checked with the rest). Raises `ConfigError` when the
    /// guard refuses them.
    fn push_config(&self) -> PyResult<crate::push::PushConfig> {
        let inner = kvlease::push::PushConfig::from_lease_config(&self.inner);
        inner.validate().map_err(errors::config)?;
        Ok(crate::push::PushConfig { inner })
    }

    /// `kv_lease_verification`: D uses pulled KV only after the slot check.
    #[getter]
    fn verification(&self) -> bool {
        self.inner.verification
    }

    /// `kv_lease_require_verification`: D also fails loads from a P that
    /// advertises no lease slots (a stock P) instead of using them unverified.
    #[getter]
    fn require_verification(&self) -> bool {
        self.inner.require_verification
    }

    /// `kv_lease_max_peers`: P ranks one D worker checks against at once.
    #[getter]
    fn max_peers(&self) -> u32 {
        self.inner.max_peers
    }

    /// `kv_lease_slots`: lease slots each P worker exports.
    #[getter]
    fn lease_slots(&self) -> u32 {
        self.inner.lease_slots
    }

    /// `kv_lease_capacity`: leases one P engine holds at once.
    #[getter]
    fn lease_capacity(&self) -> u32 {
        self.inner.lease_capacity
    }

    /// `kv_lease_max_hold` in seconds, or `None` (no renewal ceiling).
    #[getter]
    fn max_hold(&self) -> Option<f64> {
        self.inner.max_hold().map(secs)
    }

    /// `kv_lease_max_pin` in seconds: how long a lease may stay assigned
    /// but not started.
    #[getter]
    fn max_pin(&self) -> f64 {
        secs(self.inner.max_pin)
    }

    /// `kv_lease_max_fan_out`: most P ranks one D rank reads for a request.
    #[getter]
    fn max_fan_out(&self) -> u32 {
        self.inner.max_fan_out
    }

    /// `kv_lease_max_request_id_len`: longest request id, bytes.
    #[getter]
    fn max_request_id_len(&self) -> u16 {
        self.inner.max_request_id_len
    }

    /// `kv_lease_max_tracked_requests`: requests D tracks at once.
    #[getter]
    fn max_tracked_requests(&self) -> u32 {
        self.inner.max_tracked_requests
    }

    fn __repr__(&self) -> String {
        format!(
            "LeaseConfig(lease_duration={:?}, verification={}, lease_slots={}, lease_capacity={})",
            secs(self.inner.lease_duration()),
            if self.inner.verification {
                "True"
            } else {
                "False"
            },
            self.inner.lease_slots,
            self.inner.lease_capacity
        )
    }
}
