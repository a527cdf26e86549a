//! Conversions at the boundary: `now` in seconds to the library's
//! [`Instant`], durations back to seconds, nonces in their int64 form, and
//! counter structs to dicts.

use std::time::Duration;

use kvlease::{Instant, Nonce};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// `now` (seconds of a monotonic clock) as an [`Instant`]. Refuses what no
/// clock reads: negative, NaN, infinite, or beyond 2^64 ns (584 years).
pub(crate) fn instant(now: f64) -> PyResult<Instant> {
    if !(0.0..1.8e10).contains(&now) {
        return Err(PyValueError::new_err(format!(
            "now must be a finite, non-negative number of seconds (got {now})"
        )));
    }
    Ok(Instant::from_nanos((now * 1e9) as u64))
}

/// An [`Instant`] as seconds; `None` for [`Instant::MAX`] ("never").
pub(crate) fn seconds(t: Instant) -> Option<f64> {
    (t != Instant::MAX).then(|| t.as_nanos() as f64 / 1e9)
}

/// A duration as seconds.
pub(crate) fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// A nonce from `remote_lease_nonce` (int64; 0 is no lease). Python ints
/// outside int64 are refused by the conversion itself (`OverflowError`).
pub(crate) fn nonce(v: i64) -> Option<Nonce> {
    Nonce::from_int64(v)
}

/// Builds a dict from a counter struct's named fields.
macro_rules! counters_dict {
    ($py:expr, $c:expr, [$($field:ident),* $(,)?]) => {{
        let d = pyo3::types::PyDict::new($py);
        $( d.set_item(stringify!($field), $c.$field)?; )*
        Ok::<_, PyErr>(d)
    }};
}
pub(crate) use counters_dict;

/// Calls `f` with the bytes of a `bytes` object (no copy), or of anything
/// else that `bytes()` accepts (`bytearray`, `memoryview`, ...: one copy;
/// the limited API of Python 3.10, which an abi3 wheel targets, has no
/// buffer protocol). A `str` is refused: notifications are bytes.
pub(crate) fn with_bytes<R>(
    obj: &Bound<'_, PyAny>,
    f: impl FnOnce(&[u8]) -> PyResult<R>,
) -> PyResult<R> {
    use pyo3::types::{PyBytes, PyString};
    if let Ok(b) = obj.cast::<PyBytes>() {
        return f(b.as_bytes());
    }
    if obj.is_instance_of::<PyString>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(
            "expected bytes, bytearray or memoryview, not str",
        ));
    }
    let copied = obj
        .py()
        .get_type::<PyBytes>()
        .call1((obj,))?
        .cast_into::<PyBytes>()?;
    f(copied.as_bytes())
}
