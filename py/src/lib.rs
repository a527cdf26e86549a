//! `kvlease._native`: the lease roles of the `kvlease` crate as Python
//! classes that take and return bytes.
//!
//! This crate owns the boundary only: argument conversion (times, ids,
//! `bytes`/`memoryview`), errors as Python exceptions with their typed
//! reason (`kvlease.errors`), and counters as dicts. Every lease decision is
//! the library's; nothing here holds lease state of its own. No NIXL call is
//! made from Rust: the Python side (vLLM's `nixl_agent`) does every send,
//! drain and READ, and hands the bytes in.
//!
//! # Ground rules at the boundary
//!
//! - **Time** is `now: float`, seconds of one monotonic clock per process
//!   (`time.monotonic()`), converted to the library's nanosecond
//!   [`kvlease::Instant`]. A negative or non-finite `now` is a `ValueError`.
//! - **Bytes in** are taken as `&[u8]` (a `bytes` object without a copy;
//!   `bytearray` and `memoryview` through the buffer protocol, one copy).
//!   **Bytes out** are written straight into a new `bytes` object.
//! - **Errors** are `kvlease.errors.*` exceptions carrying `reason`, the
//!   library error's variant name; nothing here panics on input.
//! - **Nonces** cross as Python ints in the seed's signed int64 form
//!   (`remote_lease_nonce`), see `kvlease::nonce`.

use pyo3::prelude::*;

mod config;
mod convert;
mod decode;
mod errors;
mod prefill;
mod push;
mod slot_check;
mod wire;

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<config::LeaseConfig>()?;
    m.add_class::<prefill::PrefillScheduler>()?;
    m.add_class::<prefill::PrefillRank>()?;
    m.add_class::<prefill::SlotTicket>()?;
    m.add_class::<decode::HeartbeatTracker>()?;
    m.add_class::<slot_check::SlotChecker>()?;
    m.add_class::<push::PushConfig>()?;
    m.add_class::<push::ClockEstimate>()?;
    m.add_class::<push::PushPermits>()?;
    m.add_class::<push::PushWrites>()?;
    m.add_class::<push::WriteHandle>()?;
    m.add_function(wrap_pyfunction!(decode::encode_outcomes, m)?)?;
    m.add_function(wrap_pyfunction!(decode::decode_outcomes, m)?)?;
    m.add_function(wrap_pyfunction!(wire::encode_read_done, m)?)?;
    m.add_function(wrap_pyfunction!(wire::encode_heartbeats, m)?)?;
    m.add_function(wrap_pyfunction!(wire::encode_compact_heartbeats, m)?)?;
    m.add_function(wrap_pyfunction!(wire::decode_notification, m)?)?;
    m.add_function(wrap_pyfunction!(wire::read_done_form, m)?)?;
    m.add_function(wrap_pyfunction!(wire::lease_advert, m)?)?;
    m.add_function(wrap_pyfunction!(wire::decode_lease_advert, m)?)?;
    m.add_function(wrap_pyfunction!(
        wire::advert_accepts_compact_heartbeats,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(wire::advert_accepts_packed_heartbeats, m)?)?;
    Ok(())
}
