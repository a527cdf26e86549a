//! [`HeartbeatTracker`]: which P-side requests D must keep alive, grouped by
//! the remote engine that holds them, and when each engine is due.
//!
//! This module owns D's scheduler-side heartbeat bookkeeping (the seed's
//! "Scheduler-side tracking (D)"): it starts tracking a request the moment it
//! arrives with `do_remote_prefill` (not when it is scheduled: a request may
//! wait in the queue far longer than P's initial lease), stops on KV transfer
//! complete or on finish/abort, and each step says which engines are due and
//! which P-side ids (and lease slots) to renew. It does not encode or send
//! anything (that is [`crate::wire`] and the heartbeat sender's business),
//! never reads a clock (`now` is an argument) and never touches the network.
//!
//! # Fixed capacity, no allocation after construction
//!
//! Everything is sized from [`LeaseConfig`] in [`HeartbeatTracker::new`]:
//!
//! ```text
//!  requests (max_tracked_requests = R)
//!    d_ids:  IdTable                   D-side id -> request   (the reverse map)
//!    links:  [Link; R]                 request -> (engine, position)
//!  engines (max_remote_engines = E)
//!    keys:    IdTable                  encoded EngineKey -> engine
//!    engines: [Engine; E]              chunk list, due time, generation
//!    live:    DenseSet                 engines with at least one request
//!  members, by position (C = ceil(R / 16) + E chunks of 16 positions)
//!    members: [Member; C * 16]         request, slot, nonce, P-id length
//!    inline:  IdArena, C*16 x 64 B     P-side ids of up to 64 bytes
//!    chunk_next / chunk_prev: [u32; C]
//!  overflow:  IdArena, R x max_id_len  longer P-side ids, by request
//! ```
//!
//! What a heartbeat reads (P-side id, slot, nonce) is stored by *position*
//! in the engine's member list, not by request: an engine's members fill its
//! chunks front to back, so a due engine is read 16 contiguous members (and
//! 16 contiguous ids) at a time, one dependent load per chunk. (Stored by
//! request, the same walk touched a scattered cache line or two per request
//! and cost about twice as much.) Removal moves the engine's last member,
//! id included, into the hole, so every chunk but the tail is full and the
//! chunks in use never exceed `ceil(R / 16) + E`: the chunk pool cannot run
//! out before the request or engine capacity does.
//!
//! When a capacity is exhausted, [`HeartbeatTracker::on_new_request`] returns
//! a [`TrackError`] and bumps a counter in [`TrackerCounters`]: the request
//! is then **not heartbeated**, so P keeps its blocks only for the initial
//! lease ([`TrackerCounters::not_heartbeated`] is the number to alert on).
//! The request capacity counts *waiting* requests too (tracking starts on
//! arrival, and vLLM's queue is unbounded), which is why its default,
//! [`crate::config::DEFAULT_MAX_TRACKED_REQUESTS`] (65,536, about 375 bytes
//! each), is not derived from D's KV blocks.
//!
//! # Grouping and due times
//!
//! Requests are grouped by [`EngineKey`]: engine id, host, port and TP size,
//! the fields vLLM's heartbeat metadata carries per engine. An engine appears
//! with its first request and disappears with its last. A new engine is due
//! at once (its first heartbeat goes out at the first step after tracking
//! starts); after each time it is reported due it is throttled for
//! [`LeaseConfig::heartbeat_interval`].
//!
//! # Scheduler and workers apart
//!
//! The same selection goes out two ways (`tracker/plan.rs`):
//! [`HeartbeatTracker::due`] hands the engines to a sender in this process,
//! [`HeartbeatTracker::encode_plan`] writes them as a heartbeat plan
//! ([`crate::ipc::plan`]) for workers in others. Engines a worker still owes a
//! heartbeat come back ([`HeartbeatTracker::request_engines`]) and are
//! planned again, whatever their throttle, until served; a worker's verify
//! outcomes ([`HeartbeatTracker::apply_outcomes`], `tracker/outcomes.rs`)
//! end tracking: received once every worker verified the request, failed at
//! the first that did not.
//!
//! # P-side ids
//!
//! Ids are handed out as `&str` (what [`crate::wire`] encodes), from
//! `String` arenas that need neither `unsafe` nor UTF-8 re-validation (see
//! `id_arena.rs`). An id of up to [`INLINE_ID_LEN`] (64) bytes, which covers
//! vLLM's (`cmpl-<uuid>-0` is 43, `chatcmpl-<uuid>` 45), lives inline at its
//! member position, one cache line each, and moves with its member. A longer
//! one (up to `max_request_id_len`) lives in the overflow arena, by request,
//! and never moves. With the default 128-byte limit, a 128-byte stride for
//! every id measured about twice the cost per request of this split: the
//! walk of 10k ids then spans 1.3 MB (the adjacent-line prefetcher pulls both
//! halves of each 128-byte slot) and leaves the L2 cache.

//!
//! # Cost
//!
//! `benches/tracker.rs` measures a step with every engine due (10,000
//! requests over 16 engines): `due` over ids and over (slot, nonce) pairs,
//! against a naive `HashMap<String, Vec<String>>` rebuilt each step, and the
//! scheduler/worker split (`encode_plan`, then decode plus the sender's
//! walk). The split costs about four `due` walks: the plan is written once,
//! checked in full on decode (outside input: every id's bounds, UTF-8 and
//! commas), and walked again by the sender. Engines are due once per
//! interval (5 s by default), so a plan is that large only once per interval
//! per engine; in between it is a 32-byte header plus any owed engine. The
//! medians are in `docs/benchmarks.md`.

use core::fmt;
use core::time::Duration;

use super::id_arena::IdArena;
use crate::collections::{DenseSet, FreeStack};
use crate::config::LeaseConfig;
use crate::heartbeat_batch::{sealed, BatchReason, HeartbeatBatch, TrackedRemote};
use crate::ids::IdTable;
use crate::lease_fields::LeaseFields;
use crate::nonce::Nonce;
use crate::remote_engine::{decode_key, encode_key, encoded_key_capacity};
pub use crate::remote_engine::{EngineHandle, EngineKey, MAX_HOST_LEN};
use crate::time::Instant;
use crate::wire::{self, CompactEntry};

mod counters;
mod engine_batch;
mod outcomes;
mod params;
mod plan;
#[cfg(test)]
mod tests;
mod tracking;

pub use counters::TrackerCounters;
pub use engine_batch::EngineBatch;
pub use outcomes::ApplyReport;
use params::{bad, check_str};
pub use params::{ParamProblem, RemotePrefillParams, TrackError, TrackOutcome};

/// P-side ids up to this many bytes are stored inline at their member
/// position (one cache line); longer ones in the overflow arena.
pub const INLINE_ID_LEN: usize = 64;

/// Request indices per member-list chunk: 16 `u32`s, one cache line.
const CHUNK: usize = 16;
const NIL: u32 = u32::MAX;

/// Where a tracked request lives.
#[derive(Clone, Copy, Debug)]
struct Link {
    /// Position in the engine's member list: `chunk * CHUNK + offset`.
    pos: u32,
    engine: u32,
}

/// What a heartbeat needs of one member, stored by position.
#[derive(Clone, Copy, Debug)]
struct Member {
    /// The raw nonce; meaningful only when `leased` (then non-zero).
    nonce: u64,
    /// The request (index into `links` and `d_ids`).
    req: u32,
    slot: u32,
    p_len: u16,
    leased: bool,
}

const NO_MEMBER: Member = Member {
    nonce: 0,
    req: NIL,
    slot: 0,
    p_len: 0,
    leased: false,
};

#[derive(Clone, Copy, Debug)]
struct Engine {
    head: u32,
    tail: u32,
    /// Members; 0 means the slot is free.
    len: u32,
    /// Members without a lease (slot, nonce).
    unleased: u32,
    /// Sum of the members' P-side id lengths (sizes a plan in O(1)).
    id_bytes: u32,
    next_due: Instant,
    generation: u32,
    pp_size: u32,
    dcp_size: u32,
    /// A worker owes a P rank of this engine a heartbeat: plan it at the
    /// next step whatever its throttle says.
    requested: bool,
}

/// Why a tracker could not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TrackerError {
    /// The D worker count is 0 or more than 64.
    #[error("a tracker aggregates 1..=64 D workers, got {0}")]
    BadWorkerCount(u32),
}

/// D's scheduler-side heartbeat bookkeeping. See the module docs.
#[derive(Debug)]
pub struct HeartbeatTracker {
    interval: Duration,
    max_id_len: usize,
    d_ids: IdTable,
    links: Box<[Link]>,
    free_reqs: FreeStack,
    tracked: u32,
    keys: IdTable,
    engines: Box<[Engine]>,
    free_engines: FreeStack,
    live: DenseSet,
    members: Box<[Member]>,
    /// P-side ids of up to `inline.stride()` bytes, by member position; see
    /// "Request ids as `&str`" in the module docs.
    inline: IdArena,
    /// Longer P-side ids, by request (empty when `max_id_len` <= 64).
    overflow: IdArena,
    chunk_next: Box<[u32]>,
    chunk_prev: Box<[u32]>,
    free_chunks: FreeStack,
    key_buf: Box<[u8]>,
    /// Engine slots whose (stale) handle a worker still owes: the next plan
    /// tells the workers to drop them. By index; the generation beside.
    gone: DenseSet,
    gone_generation: Box<[u32]>,
    /// The next plan's message number.
    plan_seq: u32,
    /// D workers whose verify outcomes make up one request's verdict.
    workers: u32,
    /// Per request: the workers that reported its share usable (bit = rank).
    verified_by: Box<[u64]>,
    /// One bit per request: some worker accepted its share unchecked.
    unchecked: Box<[u64]>,
    counters: TrackerCounters,
}

impl HeartbeatTracker {
    /// A tracker sized from `config` (`max_tracked_requests`,
    /// `max_remote_engines`, `max_request_id_len`, `heartbeat_interval()`)
    /// for a D engine of `workers` workers (its TP size, `1..=64`): a
    /// request counts as received only once every one of them verified its
    /// share. Allocates everything it will ever use. Capacities outside
    /// [`LeaseConfig::validate`]'s ranges are brought into them (zero
    /// capacities to 1, the id length to at most 1024) rather than refused;
    /// a worker count outside `1..=64` is refused, since guessing it could
    /// make a request received with a share unverified.
    pub fn new(config: &LeaseConfig, workers: u32) -> Result<HeartbeatTracker, TrackerError> {
        if workers == 0 || workers > outcomes::MAX_WORKERS {
            return Err(TrackerError::BadWorkerCount(workers));
        }
        let r = config.max_tracked_requests.max(1);
        let e = config.max_remote_engines.max(1);
        // Clamped to the validated range even for a hand-built config: the id
        // arenas hold ids of at most MAX_REQUEST_ID_LEN bytes.
        let max_id_len = config
            .max_request_id_len
            .clamp(1, crate::config::limits::MAX_REQUEST_ID_LEN);
        let chunks = r.div_ceil(CHUNK as u32).saturating_add(e);
        let key_len = encoded_key_capacity(usize::from(max_id_len));
        let no_link = Link {
            pos: NIL,
            engine: NIL,
        };
        let positions = chunks as usize * CHUNK;
        let empty_engine = Engine {
            head: NIL,
            tail: NIL,
            len: 0,
            unleased: 0,
            id_bytes: 0,
            next_due: Instant::ZERO,
            generation: 0,
            pp_size: 1,
            dcp_size: 1,
            requested: false,
        };
        Ok(HeartbeatTracker {
            interval: config.heartbeat_interval(),
            max_id_len: usize::from(max_id_len),
            d_ids: IdTable::new(r, max_id_len),
            links: vec![no_link; r as usize].into_boxed_slice(),
            free_reqs: FreeStack::full(r),
            tracked: 0,
            // key_len <= 2 + 1024 + 2 + 255 + 6: fits a u16.
            keys: IdTable::new(e, u16::try_from(key_len).unwrap_or(u16::MAX)),
            engines: vec![empty_engine; e as usize].into_boxed_slice(),
            free_engines: FreeStack::full(e),
            live: DenseSet::new(e),
            members: vec![NO_MEMBER; positions].into_boxed_slice(),
            inline: IdArena::new(positions, usize::from(max_id_len).min(INLINE_ID_LEN)),
            overflow: if usize::from(max_id_len) > INLINE_ID_LEN {
                IdArena::new(r as usize, usize::from(max_id_len))
            } else {
                IdArena::new(0, 0)
            },
            chunk_next: vec![NIL; chunks as usize].into_boxed_slice(),
            chunk_prev: vec![NIL; chunks as usize].into_boxed_slice(),
            free_chunks: FreeStack::full(chunks),
            key_buf: vec![0; key_len].into_boxed_slice(),
            gone: DenseSet::new(e),
            gone_generation: vec![0; e as usize].into_boxed_slice(),
            plan_seq: 0,
            workers,
            verified_by: vec![0; r as usize].into_boxed_slice(),
            unchecked: vec![0; (r as usize).div_ceil(64)].into_boxed_slice(),
            counters: TrackerCounters::default(),
        })
    }

    /// The counters; a borrow, read them every step if you like.
    pub fn counters(&self) -> TrackerCounters {
        self.counters
    }

    /// Requests tracked now.
    pub fn len(&self) -> u32 {
        self.tracked
    }

    /// Whether no request is tracked.
    pub fn is_empty(&self) -> bool {
        self.tracked == 0
    }

    /// Engines with at least one tracked request.
    pub fn engine_count(&self) -> u32 {
        self.live.len()
    }

    /// The throttle between two heartbeats of one engine.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Whether an id of `len` bytes is stored inline.
    #[inline]
    fn is_inline(&self, len: u16) -> bool {
        usize::from(len) <= self.inline.stride()
    }

    /// The live engine behind `handle`, if it still exists (for a send that
    /// was deferred past the step that reported the engine due).
    pub fn batch(&self, handle: EngineHandle) -> Option<EngineBatch<'_>> {
        let eng = self.engines.get(handle.index as usize)?;
        (eng.len > 0 && eng.generation == handle.generation).then_some(EngineBatch {
            tracker: self,
            engine: handle.index,
            reason: BatchReason::Due,
        })
    }

    /// The engine a tracked request (D-side id) belongs to: the reverse map.
    pub fn engine_of(&self, request_id: &str) -> Option<EngineBatch<'_>> {
        let r = self.d_ids.get(request_id.as_bytes())?;
        Some(EngineBatch {
            tracker: self,
            engine: self.links[r as usize].engine,
            reason: BatchReason::Due,
        })
    }

    /// What a tracked request (D-side id) heartbeats: its P-side id and lease.
    pub fn remote_of(&self, request_id: &str) -> Option<TrackedRemote<'_>> {
        let r = self.d_ids.get(request_id.as_bytes())?;
        Some(self.remote(self.links[r as usize].pos))
    }

    /// Every live engine, due or not (inspection and tests).
    pub fn engines(&self) -> impl Iterator<Item = EngineBatch<'_>> + '_ {
        (0..self.live.len()).filter_map(move |k| {
            self.live.get(k).map(|e| EngineBatch {
                tracker: self,
                engine: e,
                reason: BatchReason::Due,
            })
        })
    }

    /// The P-side id of the member at `pos`.
    #[inline]
    fn remote_id(&self, pos: u32) -> &str {
        let m = &self.members[pos as usize];
        if self.is_inline(m.p_len) {
            self.inline.get(pos, m.p_len)
        } else {
            self.overflow.get(m.req, m.p_len)
        }
    }

    #[inline]
    fn remote(&self, pos: u32) -> TrackedRemote<'_> {
        TrackedRemote {
            remote_request_id: self.remote_id(pos),
            lease: self.lease(pos),
        }
    }

    /// The lease of the member at `pos`, if it has one.
    #[inline]
    fn lease(&self, pos: u32) -> Option<LeaseFields> {
        let m = &self.members[pos as usize];
        if !m.leased {
            return None;
        }
        Nonce::new(m.nonce).map(|nonce| LeaseFields {
            slot: m.slot,
            nonce,
        })
    }
}
