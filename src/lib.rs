//! # kvlease: KV-cache leases for disaggregated prefill/decode serving
//!
//! In disaggregated serving the prefill instance (P) holds a request's KV
//! blocks after prefill until the decode instance (D) has read them over
//! RDMA. kvlease decides how long: P grants a short **lease**, D
//! **heartbeats** while the request waits or runs, P reclaims within seconds
//! when D dies, and D **verifies** after its READ that P still held the
//! blocks, so a lapsed lease becomes a failed KV load instead of silently
//! decoding another request's KV. Wire formats and config names are
//! vLLM NixlConnector's.
//!
//! ## Engine-shaped roles
//!
//! An engine runs one scheduler process and one worker process per GPU, so
//! each side splits the same way, and the halves exchange [`ipc`] messages
//! (bytes the engine carries over the IPC it already has):
//!
//! ```text
//!  P: PrefillScheduler ──directives──▶ PrefillRank (one per worker) ──reports──▶ PrefillScheduler
//!  D: HeartbeatTracker ──plan────────▶ HeartbeatSender + LeaseVerifier ──outcomes──▶ HeartbeatTracker
//! ```
//!
//! [`LeaseBook`] is a [`PrefillScheduler`] plus every [`PrefillRank`] in
//! one process, wired directly; `HeartbeatSender::step` does the same for
//! D. No lease logic is written twice.
//!
//! ## Lifecycle of one lease (P side)
//!
//! ```text
//!  prefill done ──grant──▶ HELD on every rank (expiry = now + kv_lease_duration, slot <- nonce)
//!  HELD on rank r ──heartbeat to r──▶ HELD (r's expiry = max(expiry, now + extension))
//!  HELD on rank r ──read-done × r's consumers──▶ r lets go (read): zeroes its slot, reports
//!  HELD on rank r ──r's expiry <= now at poll──▶ r lets go (expired): zeroes its slot, reports
//!  every rank let go ──drain_released──▶ engine frees the blocks
//!  engine freed the blocks ──SlotTicket given back──▶ slot reusable
//! ```
//!
//! ## The step contract
//!
//! Everything is polled from the engine's forward loop, once per step, with
//! the step's `now` (the core never reads a clock; [`MonotonicClock`] gives
//! engines one). Capacities are fixed by [`LeaseConfig`] at construction;
//! after that no step allocates (`tests/zero_alloc.rs`, `tests/roles_alloc.rs`
//! and `tests/d_roles_alloc.rs` prove it with a counting allocator), and exhaustion is a typed error with a documented
//! degraded behaviour, never a silent drop. Nothing reachable from bytes off
//! the wire or from another process panics (`fuzz/`).
//!
//! ```
//! use kvlease::{EngineShape, LeaseBook, LeaseConfig, MonotonicClock};
//!
//! let shape = EngineShape { num_kv_blocks: 4096, max_num_seqs: 256 };
//! let config = LeaseConfig::from_extra_config_json(r#"{"kv_lease_duration": 30}"#, shape)?.config;
//! let clock = MonotonicClock::new();
//! let mut book = LeaseBook::new(&config, clock.now());
//!
//! // Prefill of "req-1" finished: lease its blocks, export slot and nonce.
//! let grant = book.grant("req-1", clock.now())?;
//! if let Some(fields) = grant.lease_fields() {
//!     // kv_transfer_params: remote_lease_slot = fields.slot,
//!     //                     remote_lease_nonce = fields.nonce
//!     # let _ = fields;
//! }
//!
//! // Each engine step:
//! let now = clock.now();
//! // Notifications drained from the fabric, with their sender's agent name.
//! for (from, msg) in [("decode-0", &b"HB:req-1"[..])] {
//!     let _ = book.on_notification(0, from, msg, now); // errors are counted and returned for logging
//! }
//! book.poll(now);                             // expire what is due: O(levels + expired + re-placed)
//! book.drain_released(|released| {
//!     // finished_sending: free the blocks of released.request_id, then
//!     // give released.slot back (book.blocks_freed or the pool, any thread).
//!     # std::mem::forget(released.slot);
//! });
//! assert_eq!(book.held(), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Modules
//!
//! - [`design`]: the design itself: roles, the life of a lease, the
//!   invariants, the step contract, the packed words (documentation only).
//! - [`config`]: settings, vLLM-compatible parsing, derived heartbeat interval and extension.
//! - [`producer`]: the P side: [`PrefillScheduler`], [`PrefillRank`], and
//!   [`LeaseBook`] (both in one process).
//! - [`consumer`]: the D side: [`consumer::HeartbeatTracker`] (scheduler),
//!   [`consumer::HeartbeatSender`] (worker) and [`consumer::LeaseVerifier`]
//!   (the post-READ slot check that fails closed).
//! - [`ipc`]: the bytes a scheduler and its workers exchange each step (P:
//!   directives and rank reports; D: heartbeat plans and verify outcomes).
//! - `wheel`: the fixed-capacity timing wheel behind expiry (internal).
//! - [`slots`], [`slot_pool`], [`nonce`]: the exported lease words, their lock-free pool, nonces.
//! - `ids`: inline request ids and their preallocated index (internal).
//! - [`wire`]: the notification codec (`HB:`, read-done with nonce, compact `HBC:`).
//! - [`topology`]: heterogeneous TP rank mapping.
//! - [`fabric`]: the one trait to the network; loopback and NIXL implementations.
//! - [`clock_offset`]: the offset to a remote engine's clock from handshake
//!   round trips, and the turn-2 read gate (bidirectional mode).
//! - [`clock_ping`]: the `CLKPING:`/`CLKPONG:` notifications that re-sample a
//!   peer's clock without a new handshake.
//! - [`turn2_read`]: P's decision on one turn-2 read: decline, read as vLLM
//!   does, or read and verify.
//! - [`decoder_cache`]: D's cache of finished turns for P's turn-2 reads: the
//!   P roles run in reverse with a fixed `decoder_kv_blocks_ttl` term.
//!
//! ## Features
//!
//! - `nixl`: the real NIXL fabric over `nixl-sys` (stub API: loads `libnixl_capi.so` at run time).
//! - `testkit`: the lease book's reference model, for tests and fuzzing; not a supported API.
#![deny(missing_docs)]
#![forbid(unsafe_op_in_unsafe_fn)]
// clippy.toml forbids std atomics in the library (loom discipline, see
// src/sync.rs); unit tests may use them. The non-test build is still checked.
#![cfg_attr(test, allow(clippy::disallowed_types))]

// ---- the design (docs only) ------------------------------------------------
pub mod design;

// ---- settings ---------------------------------------------------------------
pub mod config;
pub use config::{ConfigError, EngineShape, LeaseConfig, ParsedConfig};

// ---- the P side: scheduler and worker roles ------------------------------------
pub mod producer;
pub use producer::{
    BookCounters, Grant, GrantError, LeaseBook, PrefillRank, PrefillScheduler, ReleaseReason,
    Released, Renewal,
};

// ---- the D side: tracker, sender, verifier ---------------------------------------
pub mod consumer;

// ---- bidirectional mode (turn-2 reads from D's cache) ------------------------------
pub mod clock_offset;
pub mod clock_ping;
pub mod decoder_cache;
pub mod turn2_read;

// ---- push mode (P WRITEs into blocks D registered): the guard ---------------------
pub mod push;

// ---- between processes: role messages, notifications, the network ---------------
pub mod fabric;
pub use fabric::{Fabric, FabricError};
pub mod ipc;
pub mod topology;
pub mod wire;

// ---- what the roles and their messages share: below both, so each imports it downward --
mod heartbeat_batch;
mod release_reason;
mod remote_engine;
mod verdict;

// ---- the lease words and their values ------------------------------------------------
pub mod lease_fields;
pub mod nonce;
pub mod slot_pool;
pub mod slots;
pub mod time;
pub use lease_fields::LeaseFields;
pub use nonce::{Nonce, NonceSource};
pub use slot_pool::{SlotPool, SlotTicket};
pub use slots::LeaseSlots;
pub use time::{Instant, MonotonicClock};

// ---- internals: users never touch these; public only for benches and loom --------
#[doc(hidden)]
pub mod ids;
#[doc(hidden)]
pub mod wheel;

mod collections;
mod pack;
mod prefetch;
mod rng;
mod sync;

#[cfg(any(test, feature = "testkit"))]
#[doc(hidden)]
pub mod testkit;
