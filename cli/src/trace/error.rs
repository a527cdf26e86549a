//! A trace file that cannot be replayed: where, which field, and why.
//!
//! Owns the one error type of [`super`]. A trace is outside input: every
//! way it can be wrong (a truncated line, a string where a number goes, a
//! negative or absurd length, timestamps out of order, no requests at all)
//! ends here, as a message naming the line and the field, never a panic.

use std::fmt;

/// Why a trace was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceError {
    /// The 1-based line the problem is on (`None`: the file as a whole).
    pub line: Option<usize>,
    /// The field (JSON key or CSV column), when one is to blame.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl TraceError {
    /// A problem with the file as a whole.
    pub fn file(message: impl Into<String>) -> TraceError {
        TraceError {
            line: None,
            field: None,
            message: message.into(),
        }
    }

    /// A problem on line `line` (1-based), not tied to a field.
    pub fn line(line: usize, message: impl Into<String>) -> TraceError {
        TraceError {
            line: Some(line),
            field: None,
            message: message.into(),
        }
    }

    /// A problem with `field` on line `line` (1-based).
    pub fn field(line: usize, field: &str, message: impl Into<String>) -> TraceError {
        TraceError {
            line: Some(line),
            field: Some(field.to_string()),
            message: message.into(),
        }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(line) = self.line {
            write!(f, "line {line}: ")?;
        }
        if let Some(field) = &self.field {
            write!(f, "field {field:?}: ")?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for TraceError {}
