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
//!
//! One engine step of a P engine with two workers, the bytes carried by
//! hand where an engine would ship them between processes:
//!
//! ```
//! use std::sync::Arc;
//! use kvlease::{EngineShape, Instant, LeaseConfig, LeaseSlots, PrefillRank, PrefillScheduler};
//!
//! let config = LeaseConfig::new(EngineShape { num_kv_blocks: 64, max_num_seqs: 8 });
//! let t0 = Instant::ZERO;
//! // The scheduler process.
//! let mut sched = PrefillScheduler::new(&config, 2, t0)?;
//! // Each worker process: its own slot array (registered with its own agent).
//! let mut ranks: Vec<PrefillRank> = (0..2)
//!     .map(|r| PrefillRank::new(&config, r, Arc::new(LeaseSlots::new(config.lease_slots)), t0))
//!     .collect::<Result<_, _>>()?;
//!
//! // build_connector_meta: the prefill is scheduled; its nonce goes to the workers.
//! let a = sched.assign("req-1", t0)?;
//! let mut meta = vec![0u8; sched.directives_len(t0)];
//! let n = sched.encode_directives(t0, &mut meta)?;
//! for rank in &mut ranks {
//!     rank.apply_directives(&meta[..n], t0)?; // start_load_kv, in each worker
//! }
//! let fields = a.fields.expect("a free slot");
//! assert!(ranks.iter().all(|r| r.slots().load(fields.slot) == Some(fields.nonce.get())));
//!
//! // request_finished: the lease starts; kv_transfer_params carry `fields`.
//! sched.start("req-1", t0)?;
//! let n = sched.encode_directives(t0, &mut meta)?;
//! let mut out = vec![0u8; ranks[0].max_reports_len()];
//! let later = Instant::from_secs(60); // no heartbeat came: every rank expires
//! for (r, rank) in ranks.iter_mut().enumerate() {
//!     rank.apply_directives(&meta[..n], t0)?;
//!     rank.poll(later); // get_finished: zeroes the slot, then reports
//!     let m = rank.encode_reports(&mut out)?;
//!     sched.apply_reports(r as u32, &out[..m])?; // update_connector_output
//! }
//! let mut freed = Vec::new();
//! sched.drain_released(|rel| freed.push((rel.request_id.to_owned(), rel.nonce, rel.slot)));
//! assert_eq!(freed.len(), 1);
//! for (_, _, ticket) in freed {
//!     if let Some(t) = ticket {
//!         sched.blocks_freed(t); // the engine freed the blocks: the slot may be reused
//!     }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod book;
mod counters;
mod inbox;
mod layout;
mod lease_line;
mod outcomes;
mod rank;
mod scheduler;

pub use crate::release_reason::ReleaseReason;
pub use book::{BookError, LeaseBook};
pub use counters::{BookCounters, RankCounters, SchedulerCounters};
pub use inbox::InboxSummary;
pub use layout::EntryLayout;
pub use outcomes::{ReadDoneOutcome, Renewal, ShareOutcome};
pub use rank::{DirectiveOutcome, DirectiveSummary, PrefillRank, RankError};
pub use scheduler::{
    Assignment, Grant, GrantError, LeaseStatus, PrefillScheduler, Released, ReportOutcome,
    ReportSummary, SchedulerError, StartError, MAX_RANKS,
};
