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
//! `benches/tracker.rs`, release build, medians on a shared 2-core EPYC VM
//! (noisy: other builds ran alongside), 10,000 requests over 16 engines, all
//! due every step, every request visited:
//!
//! | step | per step | per request |
//! |---|---|---|
//! | `due`, every P-side id read | 27.9 µs | 2.8 ns |
//! | `due`, every (slot, nonce) read | 14.9 µs | 1.5 ns |
//! | naive `HashMap<String, Vec<String>>` rebuilt and iterated | 873 µs | 87 ns |
//! | naive map kept, only iterated (a floor, not a design) | 10.7 µs | 1.1 ns |
//! | `encode_plan`, every id and lease written | 90.3 µs | 9.0 ns |
//! | `HeartbeatPlan::decode` + the sender's walk of every id and lease | 125.9 µs | 12.6 ns |
//! | both (what the split adds per request over `due`) | 177.3 µs | 17.7 ns |
//!
//! (The plan rows come from a later, equally noisy run, in which `due` over
//! ids took 38.0 µs.) The split costs about four `due` walks: the plan is
//! written once, checked in full on decode (outside input: every id's
//! bounds, UTF-8 and commas), and walked again by the sender. Engines are due
//! once per interval (5 s by default), so a plan is that large only once per
//! interval per engine; in between it is a 32-byte header plus any owed
//! engine.
//!
//! `on_new_request` plus `on_request_finished` with 10k tracked: ~0.5 µs
//! (mostly hashing the ids into the two `IdTable`s and three equal-length
//! `replace_range`s).

use core::fmt;
use core::time::Duration;

use super::batch::{sealed, BatchReason, HeartbeatBatch};
use super::id_arena::IdArena;
use crate::collections::{DenseSet, FreeStack};
use crate::config::LeaseConfig;
use crate::ids::IdTable;
use crate::lease_fields::LeaseFields;
use crate::nonce::Nonce;
use crate::time::Instant;
use crate::wire::{self, CompactEntry};

mod outcomes;
mod plan;

pub use outcomes::ApplyReport;

/// Longest `remote_host` accepted, in bytes (a DNS name is at most 253).
pub const MAX_HOST_LEN: usize = 255;

/// P-side ids up to this many bytes are stored inline at their member
/// position (one cache line); longer ones in the overflow arena.
pub const INLINE_ID_LEN: usize = 64;

/// Request indices per member-list chunk: 16 `u32`s, one cache line.
const CHUNK: usize = 16;
const NIL: u32 = u32::MAX;

/// The part of vLLM's `kv_transfer_params` the tracker reads, borrowed from
/// wherever the engine parsed it. Field names are vLLM's; `None` is "absent".
///
/// `remote_block_ids` and `remote_blocks_expiry_time` are not here: the
/// tracker renews leases, it does not read blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemotePrefillParams<'a> {
    /// The request's KV was prefilled remotely and must be pulled (D side).
    /// Only such requests are heartbeated.
    pub do_remote_prefill: bool,
    /// The request is prefilled here for a remote decoder (P side); ignored.
    pub do_remote_decode: bool,
    /// The P engine holding the KV.
    pub remote_engine_id: Option<&'a str>,
    /// The request's id on P: what a heartbeat names.
    pub remote_request_id: Option<&'a str>,
    /// P's handshake host.
    pub remote_host: Option<&'a str>,
    /// P's handshake port.
    pub remote_port: Option<u16>,
    /// P's tensor-parallel size.
    pub tp_size: Option<u32>,
    /// P's pipeline-parallel size (1 when absent).
    pub pp_size: Option<u32>,
    /// P's decode-context-parallel size (1 when absent).
    pub dcp_size: Option<u32>,
    /// Tokens P computed; not used by the tracker, carried for completeness.
    pub remote_num_tokens: Option<u64>,
    /// The lease slot P exported for the request (the seed's addition).
    pub remote_lease_slot: Option<u32>,
    /// The nonce P wrote into that slot (0 is treated as absent).
    pub remote_lease_nonce: Option<u64>,
}

impl RemotePrefillParams<'_> {
    /// `remote_lease_slot` and `remote_lease_nonce` as one value: `None`
    /// when either is absent or the nonce is 0 (no lease has it).
    pub fn lease_fields(&self) -> Option<LeaseFields> {
        LeaseFields::from_params(self.remote_lease_slot, self.remote_lease_nonce)
    }
}

/// What [`HeartbeatTracker::on_new_request`] did with a request it did not
/// refuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrackOutcome {
    /// Tracked: its engine heartbeats it from the next due step on.
    Started,
    /// `do_remote_prefill` is not set: not D's business, not tracked.
    NotRemotePrefill,
    /// `do_remote_prefill` is set but a field heartbeats need is absent
    /// (vLLM skips such requests too): not tracked, counted.
    MissingParam {
        /// The first absent field, by its vLLM name.
        field: &'static str,
    },
}

/// What is wrong with a present parameter.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamProblem {
    /// The string is empty.
    Empty,
    /// The string is longer than the limit.
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The P-side id contains `,`, which a text heartbeat cannot carry.
    ContainsComma,
    /// A size is 0.
    Zero,
}

/// Why a remote-prefill request was refused. The request is not
/// heartbeated; each variant bumps a [`TrackerCounters`] field.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrackError {
    /// `max_tracked_requests` (`kv_lease_max_tracked_requests`) requests are
    /// tracked already. Counted in [`TrackerCounters::refused_requests_full`]
    /// and [`TrackerCounters::not_heartbeated`]. Degraded behaviour: the
    /// request still runs, but P frees its blocks when the initial lease
    /// runs out; if D reads later, lease verification fails the KV load
    /// (`kv_load_failure_policy` applies). Log it and raise the capacity.
    RequestsFull {
        /// The capacity.
        capacity: u32,
    },
    /// The request names a new engine and `max_remote_engines` are tracked.
    EnginesFull {
        /// The capacity.
        capacity: u32,
    },
    /// A request with this D-side id is already tracked.
    Duplicate,
    /// A parameter (or the D-side request id) is unusable.
    BadParam {
        /// The field, by its vLLM name (`request_id` for the D-side id).
        field: &'static str,
        /// What is wrong with it.
        problem: ParamProblem,
    },
}

impl fmt::Display for TrackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrackError::RequestsFull { capacity } => write!(
                f,
                "heartbeat tracker full ({capacity} requests, kv_lease_max_tracked_requests)"
            ),
            TrackError::EnginesFull { capacity } => write!(
                f,
                "heartbeat tracker tracks {capacity} remote engines already (kv_lease_max_remote_engines)"
            ),
            TrackError::Duplicate => f.write_str("request id already tracked"),
            TrackError::BadParam { field, problem } => match problem {
                ParamProblem::Empty => write!(f, "{field} is empty"),
                ParamProblem::TooLong { len, max } => {
                    write!(f, "{field} is {len} bytes, the limit is {max}")
                }
                ParamProblem::ContainsComma => write!(f, "{field} contains ','"),
                ParamProblem::Zero => write!(f, "{field} is 0"),
            },
        }
    }
}

impl std::error::Error for TrackError {}

/// What the tracker has seen, as plain monotonic counts since construction.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackerCounters {
    /// Requests tracked.
    pub started: u64,
    /// Of those, requests without lease slot and nonce: their engine can only
    /// be heartbeated in text form.
    pub started_without_lease: u64,
    /// Requests without `do_remote_prefill`: ignored (normal).
    pub ignored_not_remote_prefill: u64,
    /// Remote-prefill requests lacking a field heartbeats need.
    pub missing_params: u64,
    /// Refused: `max_tracked_requests` reached.
    pub refused_requests_full: u64,
    /// Refused: `max_remote_engines` reached.
    pub refused_engines_full: u64,
    /// Refused: the D-side id is tracked already.
    pub refused_duplicate: u64,
    /// Refused: an empty, over-long or comma-bearing id or host, or TP size 0.
    pub refused_bad_param: u64,
    /// Remote-prefill requests that are not heartbeated at all (missing
    /// params plus every refusal). P holds their blocks for the initial
    /// lease only: alert on this.
    pub not_heartbeated: u64,
    /// Requests whose `pp_size`/`dcp_size` differ from their engine's first
    /// request (tracked anyway, under the engine's first values).
    pub engine_shape_mismatch: u64,
    /// Tracking stopped because the KV transfer completed.
    pub stopped_transfer_complete: u64,
    /// Tracking stopped because the request finished or was aborted.
    pub stopped_finished: u64,
    /// Stop calls for ids not tracked (normal: every finished request is
    /// reported, tracked or not, and a completed transfer is reported again
    /// when the request finishes).
    pub stop_untracked: u64,
    /// Engines reported due.
    pub engines_due: u64,
    /// Requests in the engines reported due.
    pub requests_due: u64,
    /// Engines planned again before their interval because a worker still
    /// owed a P rank of them a heartbeat ([`BatchReason::Owed`]).
    pub engines_owed: u64,
    /// Owed-engine reports from workers that named a live engine.
    pub owed_requests: u64,
    /// Owed-engine reports that named an engine no longer tracked (its
    /// requests all finished): answered with a "gone" notice so the worker
    /// drops what it owes.
    pub owed_stale: u64,
    /// Heartbeat plans encoded.
    pub plans_encoded: u64,
    /// Verify outcomes applied (one per request per worker message).
    pub outcomes: u64,
    /// Outcomes for requests the tracker does not track (finished, already
    /// failed, refused at arrival, or a duplicate): counted, otherwise no-ops.
    pub outcomes_untracked: u64,
    /// Requests whose KV every worker verified: received, tracking stopped.
    pub loads_verified: u64,
    /// Requests whose KV load failed verification on some worker: tracking
    /// stopped, `kv_load_failure_policy` applies.
    pub loads_failed: u64,
}

/// A P engine as heartbeats see it: the grouping key of the tracker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineKey<'a> {
    /// `remote_engine_id`.
    pub engine_id: &'a str,
    /// `remote_host`.
    pub host: &'a str,
    /// `remote_port`.
    pub port: u16,
    /// `tp_size` (P's).
    pub tp_size: u32,
}

/// A live engine's slot in the tracker plus the generation that slot had when
/// the handle was taken: a handle to an engine that has since disappeared
/// (and whose slot may hold another engine now) resolves to nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineHandle {
    /// Slot index, `0..max_remote_engines`.
    pub index: u32,
    /// Bumped each time the slot takes a new engine.
    pub generation: u32,
}

/// One tracked request as a heartbeat needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrackedRemote<'t> {
    /// The id P knows the request by.
    pub remote_request_id: &'t str,
    /// Its lease slot and nonce, when P exported them.
    pub lease: Option<LeaseFields>,
}

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
    /// P-side ids by position; see "Request ids as `&str`" in the module docs.
    /// P-side ids of up to `inline.stride()` bytes, by member position.
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
    /// Per request: the workers that reported it verified (bit = rank).
    verified_by: Box<[u64]>,
    counters: TrackerCounters,
}

impl HeartbeatTracker {
    /// A tracker sized from `config` (`max_tracked_requests`,
    /// `max_remote_engines`, `max_request_id_len`, `heartbeat_interval()`).
    /// Allocates everything it will ever use. Values outside
    /// [`LeaseConfig::validate`]'s ranges are brought into them (zero
    /// capacities to 1, the id length to at most 1024) rather than refused.
    pub fn new(config: &LeaseConfig) -> HeartbeatTracker {
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
        HeartbeatTracker {
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
            workers: 1,
            verified_by: vec![0; r as usize].into_boxed_slice(),
            counters: TrackerCounters::default(),
        }
    }

    /// The counters; a borrow, read them every step if you like.
    pub fn counters(&self) -> &TrackerCounters {
        &self.counters
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

    /// vLLM's `on_new_request`: starts tracking `request_id` (the D-side id)
    /// if `params` ask for a remote prefill and carry everything a heartbeat
    /// needs. `now` is recorded only through the engine's due time: a new
    /// engine is due at once.
    ///
    /// Nothing is changed when this returns anything but
    /// `Ok(TrackOutcome::Started)`.
    pub fn on_new_request(
        &mut self,
        request_id: &str,
        params: &RemotePrefillParams<'_>,
        now: Instant,
    ) -> Result<TrackOutcome, TrackError> {
        let _ = now; // Due times start at "now or earlier": Instant::ZERO.
        if !params.do_remote_prefill {
            self.counters.ignored_not_remote_prefill += 1;
            return Ok(TrackOutcome::NotRemotePrefill);
        }
        let (engine_id, p_id, host, port, tp_size) = match (
            params.remote_engine_id,
            params.remote_request_id,
            params.remote_host,
            params.remote_port,
            params.tp_size,
        ) {
            (Some(e), Some(r), Some(h), Some(p), Some(t)) => (e, r, h, p, t),
            (e, r, h, p, _) => {
                let field = if e.is_none() {
                    "remote_engine_id"
                } else if r.is_none() {
                    "remote_request_id"
                } else if h.is_none() {
                    "remote_host"
                } else if p.is_none() {
                    "remote_port"
                } else {
                    "tp_size"
                };
                self.counters.missing_params += 1;
                self.counters.not_heartbeated += 1;
                return Ok(TrackOutcome::MissingParam { field });
            }
        };
        match self.start(request_id, engine_id, p_id, host, port, tp_size, params) {
            Ok(()) => Ok(TrackOutcome::Started),
            Err(err) => {
                let c = &mut self.counters;
                match err {
                    TrackError::RequestsFull { .. } => c.refused_requests_full += 1,
                    TrackError::EnginesFull { .. } => c.refused_engines_full += 1,
                    TrackError::Duplicate => c.refused_duplicate += 1,
                    TrackError::BadParam { .. } => c.refused_bad_param += 1,
                }
                c.not_heartbeated += 1;
                Err(err)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        request_id: &str,
        engine_id: &str,
        p_id: &str,
        host: &str,
        port: u16,
        tp_size: u32,
        params: &RemotePrefillParams<'_>,
    ) -> Result<(), TrackError> {
        // Every check first: a refused request changes nothing.
        check_str("request_id", request_id, self.max_id_len)?;
        check_str("remote_request_id", p_id, self.max_id_len)?;
        if wire::check_heartbeat_id(p_id).is_err() {
            return Err(bad("remote_request_id", ParamProblem::ContainsComma));
        }
        check_str("remote_engine_id", engine_id, self.max_id_len)?;
        check_str("remote_host", host, MAX_HOST_LEN)?;
        if tp_size == 0 {
            return Err(bad("tp_size", ParamProblem::Zero));
        }
        if self.d_ids.get(request_id.as_bytes()).is_some() {
            return Err(TrackError::Duplicate);
        }
        if self.free_reqs.is_empty() {
            return Err(TrackError::RequestsFull {
                capacity: self.links.len() as u32,
            });
        }
        let key_len = encode_key(&mut self.key_buf, engine_id, host, port, tp_size);
        let key = &self.key_buf[..key_len];
        let existing = self.keys.get(key);
        let needs_chunk = match existing {
            Some(e) => self.engines[e as usize].len as usize % CHUNK == 0,
            None => true,
        };
        if existing.is_none() && self.free_engines.is_empty() {
            return Err(TrackError::EnginesFull {
                capacity: self.engines.len() as u32,
            });
        }
        // The chunk pool is sized so that this cannot fail (module docs);
        // refuse rather than corrupt if that reasoning is ever wrong.
        debug_assert!(!needs_chunk || !self.free_chunks.is_empty());
        if needs_chunk && self.free_chunks.is_empty() {
            return Err(TrackError::RequestsFull {
                capacity: self.links.len() as u32,
            });
        }

        // Commit. None of the pops below can fail: checked above.
        let pp = params.pp_size.unwrap_or(1);
        let dcp = params.dcp_size.unwrap_or(1);
        let e = match existing {
            Some(e) => {
                let eng = &self.engines[e as usize];
                if eng.pp_size != pp || eng.dcp_size != dcp {
                    self.counters.engine_shape_mismatch += 1;
                }
                e
            }
            None => {
                let Some(e) = self.free_engines.pop() else {
                    return Err(TrackError::EnginesFull {
                        capacity: self.engines.len() as u32,
                    });
                };
                if self.keys.insert(key, e).is_err() {
                    // Unreachable: the key was checked absent and is within
                    // the table's length limit by construction.
                    debug_assert!(false, "engine key insert failed");
                    self.free_engines.push(e);
                    return Err(bad("remote_engine_id", ParamProblem::Empty));
                }
                let eng = &mut self.engines[e as usize];
                debug_assert_eq!(eng.len, 0);
                eng.generation = eng.generation.wrapping_add(1);
                // Due at once: the first step after tracking starts sends.
                eng.next_due = Instant::ZERO;
                eng.pp_size = pp;
                eng.dcp_size = dcp;
                eng.unleased = 0;
                eng.id_bytes = 0;
                eng.requested = false;
                eng.head = NIL;
                eng.tail = NIL;
                self.live.insert(e);
                e
            }
        };
        let Some(r) = self.free_reqs.pop() else {
            return Err(TrackError::RequestsFull {
                capacity: self.links.len() as u32,
            });
        };
        if self.d_ids.insert(request_id.as_bytes(), r).is_err() {
            // Unreachable: checked valid and absent above.
            debug_assert!(false, "request id insert failed");
            self.free_reqs.push(r);
            self.drop_engine_if_empty(e);
            return Err(TrackError::Duplicate);
        }
        let lease = params.lease_fields();
        let pos = self.push_member(e);
        self.members[pos as usize] = Member {
            nonce: lease.map_or(0, |l| l.nonce.get()),
            req: r,
            slot: lease.map_or(0, |l| l.slot),
            // check_str bounded the length by max_id_len <= u16::MAX.
            p_len: p_id.len() as u16,
            leased: lease.is_some(),
        };
        // check_str bounded the length by max_id_len, the overflow stride.
        let written = if p_id.len() <= self.inline.stride() {
            self.inline.write(pos, p_id)
        } else {
            self.overflow.write(r, p_id)
        };
        debug_assert!(written);
        self.links[r as usize] = Link { pos, engine: e };
        self.verified_by[r as usize] = 0;
        // p_id.len() <= max_id_len <= 1024 and at most R members: no overflow
        // below 4 million requests; saturate rather than wrap beyond.
        let eng = &mut self.engines[e as usize];
        eng.id_bytes = eng.id_bytes.saturating_add(p_id.len() as u32);
        if lease.is_none() {
            self.engines[e as usize].unleased += 1;
            self.counters.started_without_lease += 1;
        }
        self.tracked += 1;
        self.counters.started += 1;
        Ok(())
    }

    /// Appends a member to engine `e`'s list; returns its (empty) position.
    fn push_member(&mut self, e: u32) -> u32 {
        let eng = &mut self.engines[e as usize];
        let off = eng.len as usize % CHUNK;
        if off == 0 {
            // Checked by the caller: a chunk is free.
            let c = self.free_chunks.pop().unwrap_or(NIL);
            debug_assert_ne!(c, NIL);
            self.chunk_next[c as usize] = NIL;
            self.chunk_prev[c as usize] = eng.tail;
            if eng.tail == NIL {
                eng.head = c;
            } else {
                self.chunk_next[eng.tail as usize] = c;
            }
            eng.tail = c;
        }
        let pos = eng.tail as usize * CHUNK + off;
        debug_assert_eq!(self.members[pos].req, NIL);
        eng.len += 1;
        pos as u32
    }

    /// Frees engine `e` when it has no members left. A worker that owes it
    /// a heartbeat is told, in the next plan, to drop that debt.
    fn drop_engine_if_empty(&mut self, e: u32) {
        let eng = &mut self.engines[e as usize];
        if eng.len != 0 {
            return;
        }
        if eng.requested {
            eng.requested = false;
            let generation = eng.generation;
            self.note_gone(EngineHandle {
                index: e,
                generation,
            });
        }
        let removed = self.keys.remove(e);
        debug_assert!(removed);
        self.live.remove(e);
        self.free_engines.push(e);
    }

    /// vLLM's `update_connector_output` path: the KV of `request_id` (D-side
    /// id) arrived, stop heartbeating it. Returns whether it was tracked.
    pub fn on_transfer_complete(&mut self, request_id: &str) -> bool {
        let stopped = self.stop(request_id);
        if stopped {
            self.counters.stopped_transfer_complete += 1;
        }
        stopped
    }

    /// vLLM's `request_finished`: the request finished or was aborted, stop
    /// heartbeating it. Returns whether it was tracked.
    pub fn on_request_finished(&mut self, request_id: &str) -> bool {
        let stopped = self.stop(request_id);
        if stopped {
            self.counters.stopped_finished += 1;
        }
        stopped
    }

    fn stop(&mut self, request_id: &str) -> bool {
        let Some(r) = self.d_ids.get(request_id.as_bytes()) else {
            self.counters.stop_untracked += 1;
            return false;
        };
        self.stop_request(r);
        true
    }

    /// Stops tracking request `r` (tracked).
    fn stop_request(&mut self, r: u32) {
        let Link {
            pos: hole,
            engine: e,
        } = self.links[r as usize];
        let gone = self.members[hole as usize];
        debug_assert_eq!(gone.req, r);
        let eng = &mut self.engines[e as usize];
        debug_assert!(eng.len > 0);
        let last_off = (eng.len as usize - 1) % CHUNK;
        let last = (eng.tail as usize * CHUNK + last_off) as u32;
        eng.len -= 1;
        eng.id_bytes = eng.id_bytes.saturating_sub(u32::from(gone.p_len));
        if !gone.leased {
            eng.unleased -= 1;
        }
        // Move the engine's last member, inline id included, into the hole
        // and erase what is left behind (an overflow id stays where it is,
        // by request).
        let gone_inline = self.is_inline(gone.p_len);
        if !gone_inline {
            self.overflow.erase(r, gone.p_len);
        }
        // The inline bytes now at `hole` that nobody owns any more.
        let stale = if gone_inline { gone.p_len } else { 0 };
        if last == hole {
            self.inline.erase(hole, stale);
        } else {
            let moved = self.members[last as usize];
            if self.is_inline(moved.p_len) {
                self.inline.copy(last, moved.p_len, hole, stale);
                self.inline.erase(last, moved.p_len);
            } else {
                self.inline.erase(hole, stale);
            }
            self.members[hole as usize] = moved;
            self.links[moved.req as usize].pos = hole;
        }
        self.members[last as usize] = NO_MEMBER;
        let eng = &mut self.engines[e as usize];
        if last_off == 0 {
            // The tail chunk is empty now.
            let c = eng.tail;
            eng.tail = self.chunk_prev[c as usize];
            if eng.tail == NIL {
                eng.head = NIL;
            } else {
                self.chunk_next[eng.tail as usize] = NIL;
            }
            self.free_chunks.push(c);
        }
        self.drop_engine_if_empty(e);
        let removed = self.d_ids.remove(r);
        debug_assert!(removed);
        self.links[r as usize] = Link {
            pos: NIL,
            engine: NIL,
        };
        self.free_reqs.push(r);
        self.tracked -= 1;
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

/// One engine and its tracked requests, borrowed from the tracker.
///
/// From [`HeartbeatTracker::due`] it says why it was handed over
/// ([`EngineBatch::reason`]); from the inspection methods
/// ([`HeartbeatTracker::batch`], [`HeartbeatTracker::engine_of`],
/// [`HeartbeatTracker::engines`]) the reason is [`BatchReason::Due`].
#[derive(Clone, Copy)]
pub struct EngineBatch<'t> {
    tracker: &'t HeartbeatTracker,
    engine: u32,
    reason: BatchReason,
}

impl<'t> EngineBatch<'t> {
    fn engine(&self) -> &'t Engine {
        &self.tracker.engines[self.engine as usize]
    }

    /// A handle that finds this engine again in a later step
    /// ([`HeartbeatTracker::batch`]) unless it disappeared meanwhile.
    pub fn handle(&self) -> EngineHandle {
        EngineHandle {
            index: self.engine,
            generation: self.engine().generation,
        }
    }

    /// The engine's identity.
    pub fn key(&self) -> EngineKey<'t> {
        decode_key(self.tracker.keys.id(self.engine))
    }

    /// Why the engine was handed over this step.
    pub fn reason(&self) -> BatchReason {
        self.reason
    }

    /// P's pipeline-parallel size, from the engine's first request.
    pub fn pp_size(&self) -> u32 {
        self.engine().pp_size
    }

    /// P's decode-context-parallel size, from the engine's first request.
    pub fn dcp_size(&self) -> u32 {
        self.engine().dcp_size
    }

    /// Requests tracked for this engine (never 0 for a live engine).
    pub fn len(&self) -> usize {
        self.engine().len as usize
    }

    /// Whether the engine has no requests (only for a stale batch).
    pub fn is_empty(&self) -> bool {
        self.engine().len == 0
    }

    /// Whether every request has a lease slot and nonce, so that the engine
    /// can be heartbeated in compact form.
    pub fn all_leased(&self) -> bool {
        self.engine().unleased == 0
    }

    /// The member positions of the engine, in list order.
    fn positions(&self) -> Positions<'t> {
        let eng = self.engine();
        Positions {
            tracker: self.tracker,
            chunk: eng.head,
            off: 0,
            left: eng.len,
        }
    }

    /// The P-side ids to renew (for [`wire::encode_heartbeats`]), in no
    /// particular order.
    pub fn remote_request_ids(&self) -> impl ExactSizeIterator<Item = &'t str> + Clone + 't {
        let t = self.tracker;
        self.positions().map(move |p| t.remote_id(p))
    }

    /// The (slot, nonce) pairs of the requests that have them (for
    /// [`wire::encode_compact_heartbeats`]; complete only when
    /// [`EngineBatch::all_leased`]).
    pub fn leases(&self) -> impl Iterator<Item = CompactEntry> + Clone + 't {
        let t = self.tracker;
        self.positions()
            .filter_map(move |p| t.lease(p).map(CompactEntry::from))
    }

    /// Each request's P-side id and lease together, in no particular order.
    pub fn remotes(&self) -> impl ExactSizeIterator<Item = TrackedRemote<'t>> + Clone + 't {
        let t = self.tracker;
        self.positions().map(move |p| t.remote(p))
    }
}

impl sealed::Sealed for EngineBatch<'_> {}

impl HeartbeatBatch for EngineBatch<'_> {
    fn handle(&self) -> EngineHandle {
        EngineBatch::handle(self)
    }

    fn key(&self) -> EngineKey<'_> {
        EngineBatch::key(self)
    }

    fn pp_size(&self) -> u32 {
        EngineBatch::pp_size(self)
    }

    fn dcp_size(&self) -> u32 {
        EngineBatch::dcp_size(self)
    }

    fn reason(&self) -> BatchReason {
        self.reason
    }

    fn len(&self) -> usize {
        EngineBatch::len(self)
    }

    fn all_leased(&self) -> bool {
        EngineBatch::all_leased(self)
    }

    fn id_bytes(&self) -> usize {
        self.engine().id_bytes as usize
    }

    fn remotes(&self) -> impl Iterator<Item = TrackedRemote<'_>> + Clone + '_ {
        EngineBatch::remotes(self)
    }

    fn remote_request_ids(&self) -> impl Iterator<Item = &str> + Clone + '_ {
        EngineBatch::remote_request_ids(self)
    }

    fn leases(&self) -> impl Iterator<Item = CompactEntry> + Clone + '_ {
        EngineBatch::leases(self)
    }
}

impl fmt::Debug for EngineBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineBatch")
            .field("key", &self.key())
            .field("handle", &self.handle())
            .field("reason", &self.reason)
            .field("len", &self.len())
            .finish()
    }
}

/// The member positions of one engine, chunk by chunk.
#[derive(Clone, Debug)]
struct Positions<'t> {
    tracker: &'t HeartbeatTracker,
    chunk: u32,
    off: u32,
    left: u32,
}

impl Iterator for Positions<'_> {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        if self.left == 0 {
            return None;
        }
        if self.off as usize == CHUNK {
            self.chunk = self.tracker.chunk_next[self.chunk as usize];
            self.off = 0;
        }
        let pos = self.chunk * CHUNK as u32 + self.off;
        self.off += 1;
        self.left -= 1;
        Some(pos)
    }

    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

impl ExactSizeIterator for Positions<'_> {}

fn bad(field: &'static str, problem: ParamProblem) -> TrackError {
    TrackError::BadParam { field, problem }
}

fn check_str(field: &'static str, s: &str, max: usize) -> Result<(), TrackError> {
    if s.is_empty() {
        Err(bad(field, ParamProblem::Empty))
    } else if s.len() > max {
        Err(bad(field, ParamProblem::TooLong { len: s.len(), max }))
    } else {
        Ok(())
    }
}

/// Bytes an encoded key can take with ids of up to `max_id_len` bytes.
fn encoded_key_capacity(max_id_len: usize) -> usize {
    2 + max_id_len + 2 + MAX_HOST_LEN + 2 + 4
}

/// `[len u16][engine_id][len u16][host][port u16][tp u32]`, little endian:
/// unambiguous for any strings. The caller checked the lengths against
/// `encoded_key_capacity`. Returns the length written.
fn encode_key(buf: &mut [u8], engine_id: &str, host: &str, port: u16, tp: u32) -> usize {
    let mut at = 0;
    let mut put = |bytes: &[u8]| {
        if let Some(dst) = buf.get_mut(at..at + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
        at += bytes.len();
    };
    put(&(engine_id.len() as u16).to_le_bytes());
    put(engine_id.as_bytes());
    put(&(host.len() as u16).to_le_bytes());
    put(host.as_bytes());
    put(&port.to_le_bytes());
    put(&tp.to_le_bytes());
    debug_assert!(at <= buf.len());
    at.min(buf.len())
}

/// Inverse of [`encode_key`]. Keys are written only by `encode_key`, so the
/// fallbacks (empty strings, zeros) are unreachable.
fn decode_key(b: &[u8]) -> EngineKey<'_> {
    fn take<'b>(b: &mut &'b [u8], n: usize) -> &'b [u8] {
        let n = n.min(b.len());
        let (head, rest) = b.split_at(n);
        *b = rest;
        head
    }
    fn u16_of(x: &[u8]) -> u16 {
        x.try_into().map(u16::from_le_bytes).unwrap_or(0)
    }
    let mut b = b;
    let elen = usize::from(u16_of(take(&mut b, 2)));
    let engine_id = core::str::from_utf8(take(&mut b, elen)).unwrap_or("");
    let hlen = usize::from(u16_of(take(&mut b, 2)));
    let host = core::str::from_utf8(take(&mut b, hlen)).unwrap_or("");
    let port = u16_of(take(&mut b, 2));
    let tp_size = take(&mut b, 4)
        .try_into()
        .map(u32::from_le_bytes)
        .unwrap_or(0);
    debug_assert!(b.is_empty() && tp_size != 0);
    EngineKey {
        engine_id,
        host,
        port,
        tp_size,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EngineShape;

    fn config(requests: u32, engines: u32) -> LeaseConfig {
        let mut c = LeaseConfig::new(EngineShape {
            num_kv_blocks: 64,
            max_num_seqs: 8,
        });
        c.max_tracked_requests = requests;
        c.max_remote_engines = engines;
        c.max_request_id_len = 32;
        c.validate().unwrap();
        c
    }

    #[test]
    fn key_round_trips() {
        let mut buf = [0u8; 64];
        let n = encode_key(&mut buf, "eng", "10.0.0.1", 5600, 4);
        let k = decode_key(&buf[..n]);
        assert_eq!(
            k,
            EngineKey {
                engine_id: "eng",
                host: "10.0.0.1",
                port: 5600,
                tp_size: 4
            }
        );
    }

    #[test]
    fn chunks_stay_packed_under_churn() {
        let cfg = config(100, 3);
        let mut t = HeartbeatTracker::new(&cfg);
        let mut live: Vec<String> = Vec::new();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..20_000u32 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            if rng % 3 != 0 && live.len() < 100 {
                let d = format!("d{i}");
                let p = format!("p{i}");
                let eng = format!("e{}", rng % 3);
                let params = RemotePrefillParams {
                    do_remote_prefill: true,
                    remote_engine_id: Some(&eng),
                    remote_request_id: Some(&p),
                    remote_host: Some("h"),
                    remote_port: Some(1),
                    tp_size: Some(1),
                    ..Default::default()
                };
                t.on_new_request(&d, &params, Instant::ZERO).unwrap();
                live.push(d);
            } else if !live.is_empty() {
                let d = live.swap_remove((rng >> 20) as usize % live.len());
                assert!(t.on_request_finished(&d));
            }
            assert_eq!(t.len() as usize, live.len());
            let total: usize = t.engines().map(|b| b.len()).sum();
            assert_eq!(total, live.len());
            for b in t.engines() {
                assert_eq!(b.positions().count(), b.len());
                assert_eq!(b.remotes().count(), b.len());
            }
            let used_chunks = (t.free_chunks.capacity() - t.free_chunks.len()) as usize;
            let want: usize = t.engines().map(|b| b.len().div_ceil(CHUNK)).sum();
            assert_eq!(used_chunks, want);
            // Ids move with their members: every request still finds its own.
            for d in &live {
                let p = t.remote_of(d).unwrap().remote_request_id;
                assert_eq!(&p[1..], &d[1..]);
            }
        }
        for d in &live {
            let p = t.remote_of(d).unwrap().remote_request_id;
            assert_eq!(&p[1..], &d[1..]);
        }
    }
}
