//! The simulator's error: something a run cannot go on from.
//!
//! Owns the one error type of [`super`]: a run that meets a library error
//! it did not expect (a role message that does not decode, a fabric that
//! refuses a registration) stops with a message naming where, instead of
//! panicking. Bad flags and configs are caught earlier, by the CLI.

use std::fmt;

/// Why a run stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimError(pub String);

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SimError {}

/// Wraps an error with what was being done.
pub trait Context<T> {
    /// `Err(e)` becomes `SimError("{what}: {e}")`.
    fn context(self, what: &str) -> Result<T, SimError>;
}

impl<T, E: fmt::Display> Context<T> for Result<T, E> {
    fn context(self, what: &str) -> Result<T, SimError> {
        self.map_err(|e| SimError(format!("{what}: {e}")))
    }
}
