//! Library errors as Python exceptions: `kvlease.errors.<Class>(message,
//! reason)`, where `reason` is the library error's variant name.
//!
//! The exception classes live in pure Python (`kvlease/errors.py`) so that
//! they are ordinary, picklable classes with a documented `reason`
//! attribute; this module only looks them up, on error paths.

use std::fmt::{Debug, Display};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The variant name of an error's `Debug` form: `Full`, `BadId`,
/// `TooLong`, ... (the part before any payload).
fn variant<E: Debug>(e: &E) -> String {
    let d = format!("{e:?}");
    d.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .next()
        .unwrap_or("")
        .to_string()
}

/// `kvlease.errors.<class>(str(e), variant(e))`.
pub(crate) fn raise<E: Debug + Display>(class: &str, e: E) -> PyErr {
    let (message, reason) = (e.to_string(), variant(&e));
    Python::attach(|py| {
        match py
            .import("kvlease.errors")
            .and_then(|m| m.getattr(class))
            .and_then(|c| c.call1((message.clone(), reason)))
        {
            Ok(exc) => PyErr::from_value(exc),
            // The package is not importable (the native module used
            // alone): a plain ValueError keeps the message.
            Err(_) => PyValueError::new_err(message),
        }
    })
}

/// A `kvlease.errors.ConfigError`.
pub(crate) fn config<E: Debug + Display>(e: E) -> PyErr {
    raise("ConfigError", e)
}

/// A `kvlease.errors.IpcError` (role messages).
pub(crate) fn ipc<E: Debug + Display>(e: E) -> PyErr {
    raise("IpcError", e)
}

/// A `kvlease.errors.WireError` (notifications).
pub(crate) fn wire<E: Debug + Display>(e: E) -> PyErr {
    raise("WireError", e)
}
