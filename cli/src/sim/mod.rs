//! `kvlease sim`: a whole P/D deployment in virtual time, on the library's
//! real lease machinery.
//!
//! This module tree owns the simulated deployment. What is **real** (the
//! library, unchanged, with the bytes an engine's processes exchange): the P
//! scheduler and rank roles ([`kvlease::PrefillScheduler`],
//! [`kvlease::PrefillRank`]) and their directive/report messages; D's
//! [`kvlease::consumer::HeartbeatTracker`], plan bytes,
//! [`kvlease::consumer::HeartbeatSender`], [`kvlease::consumer::LeaseVerifier`]
//! and outcome messages; the notification wire codec (`HB:`, `HBC:`,
//! read-done with nonce); the loopback fabric with its READs that copy on
//! completion and its fault injection. What is **modelled**: the engines
//! around it (queues, KV block pools, step durations, decode batches),
//! the router, the workload, and the faults' timing.
//!
//! - [`model`]: the invented numbers (engine sizes, timings, workload);
//! - [`scenario`], [`policy`]: what happens, and what is compared;
//! - [`prefill`], [`decode`], [`decode_worker`]: the engines;
//! - [`router`], [`world`]: arrivals, routing, the event loop;
//! - [`spec`]: what decides a run and what it gives back;
//! - [`replay`]: a trace's arrivals and faults as a run's input;
//! - [`bidir`]: the `bidirectional-skew` scenario's own small world;
//! - [`push`]: the `push-faults` scenario's (vLLM's push mode, the guard);
//! - [`ledger`], [`metrics`]: what is measured, and how;
//! - [`blocks`], [`kv`], [`rng`], [`error`]: small parts.

pub mod bidir;
pub mod blocks;
pub mod decode;
pub mod decode_worker;
pub mod error;
pub mod kv;
pub mod ledger;
pub mod metrics;
pub mod model;
pub mod policy;
pub mod prefill;
pub mod push;
pub mod replay;
pub mod rng;
pub mod router;
pub mod scenario;
pub mod spec;
pub mod world;

pub use error::SimError;
pub use spec::{RunOutput, RunSpec};
pub use world::run;
