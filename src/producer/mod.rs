//! The prefill side (P): the lease book and what it reports.
//!
//! Owns everything P decides about leases. Decoding notifications is `wire`'s
//! job; this side only consumes decoded values.

mod book;
mod counters;
mod inbox;
mod release_queue;

pub use book::{
    BookError, Grant, GrantError, LeaseBook, ReadDoneOutcome, ReleaseReason, Released, Renewal,
};
pub use counters::BookCounters;
pub use inbox::InboxSummary;
