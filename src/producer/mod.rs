//! The prefill side (P): who holds which lease, split the way engines are.
//!
//! An engine runs one scheduler process and one worker process per GPU, and
//! so does this side:
//!
//! - [`PrefillScheduler`] (one per engine): entries, slots and nonces,
//!   directives for the workers, aggregation of their reports, the slot
//!   pool. Frees nothing until every rank has let go.
//! - [`PrefillRank`] (one per worker): its slot array, its timers, its
//!   heartbeats and read-dones, its expiry on its own clock.
//! - [`LeaseBook`]: both in one process, wired directly (tests, the
//!   simulator, engines whose ranks share a process).
//!
//! The roles talk through [`crate::ipc`] messages that the engine ships
//! over its own IPC. Decoding notifications is [`crate::wire`]'s job; this
//! side only consumes decoded values.

mod book;
mod counters;
mod inbox;
mod layout;
mod lease_line;
mod outcomes;
mod rank;
mod scheduler;

pub use book::{BookError, LeaseBook};
pub use counters::{BookCounters, RankCounters, SchedulerCounters};
pub use inbox::InboxSummary;
pub use layout::EntryLayout;
pub use outcomes::{ReadDoneOutcome, ReleaseReason, Renewal};
pub use rank::{DirectiveOutcome, DirectiveSummary, PrefillRank, RankError};
pub use scheduler::{
    Assignment, Grant, GrantError, LeaseStatus, PrefillScheduler, Released, ReportOutcome,
    ReportSummary, SchedulerError, StartError, MAX_RANKS,
};
