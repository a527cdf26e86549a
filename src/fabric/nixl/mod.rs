//! [`NixlFabric`]: the real [`Fabric`] over NIXL (`nixl-sys`, UCX backend).
//!
//! Compiled with the cargo feature `nixl`. `nixl-sys` is built with its
//! `stub-api` feature: it needs no NIXL headers at build time and `dlopen`s
//! `libnixl_capi.so` at run time. Without that library every NIXL call would
//! abort the process, so [`NixlFabric::new`] checks first and returns
//! [`NixlInitError::RuntimeNotFound`]; [`runtime_available`] asks the same
//! question without building anything. `.ci/nixl-runtime.sh` provisions the
//! runtime on a machine with no NIXL install (the wheel `nixl-cu12`'s
//! libraries, no Python install; see `docs/across-hosts.md`).
//!
//! This module owns one NIXL agent per fabric, its UCX backend, the memory it
//! registers, the handshake side channel, the peer table and the prepared
//! READ requests. It holds no lease logic. An engine that already has an
//! agent builds the fabric over it instead ([`NixlFabric::with_agent`]):
//! then the agent, its backend and its drain are the engine's, peers come
//! from the engine's own handshake ([`Fabric::add_peer`] with a
//! [`LeaseAdvert`]), and the side channel below is optional
//! ([`NixlConfig::side_channel`]).
//!
//! # Embedding against peers that do not speak kvlease
//!
//! - **Draining.** [`drain_raw_notifications`] drains an agent the engine
//!   owns and hands out every notification as bytes, per sender name.
//!   `nixl-sys`'s own `take_notifs` fails on a message that is not UTF-8 and
//!   leaves it (and everything behind it) queued; the fabric's own
//!   [`Fabric::drain_notifications`] uses the same helper.
//! - **Reading a foreign P's KV.** [`PeerRecord::regions`] lists the P's KV
//!   regions (address and length, as its engine's handshake describes them);
//!   [`Fabric::add_peer`] registers them as the peer's regions `0..n` (its
//!   slot region, if it advertises one, is `n`), so [`Fabric::post_read`]
//!   serves the KV pull, prepared and re-posted like any READ, and not only
//!   the slot check.
//! - **Being read by one.** [`NixlFabric::local_metadata`] is this agent's
//!   NIXL metadata and [`NixlFabric::local_region`] a registered region's
//!   address and length: what a peer that never speaks kvlease's side
//!   channel loads (`load_remote_md`) and names in its READs.
//!
//! # Handshake: our own side channel
//!
//! Each fabric listens on a TCP socket of its own ([`NixlConfig::listen_addr`],
//! `127.0.0.1:0` by default; [`NixlFabric::listen_addr`] tells the port). The
//! address a peer passes to [`Fabric::start_handshake`] is that socket's
//! `ip:port` (a `host:port` is resolved on the handshake thread). We use this
//! instead of NIXL's own listener (`enable_listen_thread` + `fetch_remote_md`)
//! because the handshake must carry our advertisement next to NIXL's metadata
//! and take a clock sample, and NIXL's listener can do neither.
//!
//! ```text
//!  D (start_handshake)                          P (listener thread)
//!  handshake thread: connect ───── "KVLH" v1 ──▶ accept, read 8 bytes
//!    local_send = clock.now()                     remote = clock.now()
//!                  ◀── header(remote clock) + body ──
//!    local_recv = clock.now()       body: agent name, slot region, slot count,
//!    parse (bounded, no panics)           compact flag, region table, NIXL md
//!  engine loop (handshake_state): load_remote_md + make_connection ─▶ Ready
//! ```
//!
//! Three kinds of background thread, all inside the fabric and none ever
//! touching the NIXL agent (so every NIXL call happens on the engine thread):
//!
//! - one **listener thread** per fabric, accepting side-channel clients;
//! - one short-lived **client thread** per accepted client (at most
//!   [`NixlConfig::max_side_channel_clients`] at once, 64 KiB of stack
//!   each), answering from a pre-encoded body that the engine thread
//!   refreshes after every registration (each answer takes the clock sample
//!   when it is written) and gone within 2 s;
//! - one short-lived **handshake thread** per [`Fabric::start_handshake`],
//!   doing the blocking connect/write/read with the handshake timeout and
//!   handing the parsed answer to the engine loop over a channel.
//!
//! [`Fabric::handshake_state`] polls that channel; when the answer is there it
//! loads the remote metadata and makes the connection (tens of microseconds,
//! once per handshake) and reports `Ready`. The handshake is one-sided: the
//! listener does not load the client's metadata (a target needs none to be
//! READ from or to receive notifications). A side that wants to send to the
//! other, or READ from it, starts its own handshake. Memory registered after
//! a handshake is unknown to that peer until it handshakes again: register
//! the lease slots and the KV regions first.
//!
//! The clock sample uses [`NixlConfig::clock`]; pass the engine's own
//! [`MonotonicClock`] there so that the sample and the engine's `now` agree.
//!
//! # Progress mode and UCX error handling
//!
//! [`ProgressMode::EngineLoop`] (the default): no NIXL progress thread. Every
//! NIXL call made by the fabric progresses the UCX worker, so the engine loop
//! must call [`Fabric::drain_notifications`] every step (a P worker that
//! never drains receives nothing). It is paired with
//! `ucx_error_handling_mode = none` ([`UcxErrorHandling::None`]): in `peer`
//! mode a READ against a peer that is not polling stalls. The price is that
//! UCX is not asked to watch peers: on shared memory it still notices a dead
//! one (below); elsewhere the fabric's transfer timeout does
//! ([`NixlConfig::transfer_timeout`]), and the lease covers the rest.
//!
//! [`ProgressMode::Thread`] runs NIXL's progress thread with a non-zero delay
//! between polls (a zero delay busy-spins and, on two cores, slows everything
//! down; `docs/across-hosts.md` gives the measured round trips).
//!
//! `measure_progress_modes` and
//! `killed_peer_process_fails_reads_with_a_typed_error` in
//! `tests/it/nixl_fabric.rs` measure, through this module's API, a notification
//! round trip (`send_notification` → peer drains → peer sends → we drain) and
//! a 512-byte READ of a 64-slot lease array (a re-posted, cached request), in
//! each progress mode, in one process and in two; `docs/across-hosts.md`
//! has the figures. The engine-loop mode is the default: it is
//! 30–40 times faster for
//! notifications, costs no extra core, and the engine loop polls every step
//! anyway. Over shared memory a READ is one-sided in both modes and costs
//! the same; over TCP it is not (next section).
//!
//! # Across hosts: UCX over TCP
//!
//! Between hosts without RDMA, UCX speaks TCP, and there nothing is
//! one-sided: UCX emulates a READ with messages that the *target's* UCX
//! worker answers, and a notification leaves the *sender* only as its
//! worker is progressed. In the engine-loop mode a worker progresses only
//! inside its own NIXL calls, so over TCP:
//!
//! - a READ completes only while the target (P) calls the fabric: a P
//!   worker that drains every step serves READs at its step rate;
//! - a notification is delivered only after the sender's next fabric calls:
//!   D's next drain pushes out the heartbeat it queued this step.
//!
//! Both hold for any engine that drains every step, which this module
//! already requires; a test that drives only one side (the READ's initiator,
//! the notification's receiver) hangs on TCP while it passes on shared
//! memory. `tests/it/two_hosts.rs` runs the whole deployment in two network
//! namespaces over `UCX_TLS=tcp`; `docs/across-hosts.md` gives the
//! settings and the figures (`measure_progress_modes` with `UCX_TLS=tcp`
//! measures the fabric itself over TCP).
//!
//! A dead peer over TCP: when its process dies, its kernel resets the
//! connection and the next READ fails at once (`Backend`), and a
//! notification to it fails too: NIXL reports that as a backend error, which
//! fails the peer ([`FabricError::PeerUnreachable`]) so that a sender backs
//! off and handshakes again (a restarted peer is a new agent) rather than
//! retrying every step. A partitioned or stopped peer says nothing: READs end
//! at [`NixlConfig::transfer_timeout`], and the lease covers the rest.
//!
//! Over shared memory, a dead peer is detected even with error handling
//! `none`: after the peer process is killed, the next READ to it fails at
//! once with `Backend(-2)` (UCX's `cma` copy reports an I/O error; the
//! `docs/across-hosts.md` gives the measured delay). Transports that cannot tell fall back to the transfer timeout
//! (tested with a READ held in flight by error handling `peer` against a
//! target that does not poll: `Failed(TimedOut)`, request aborted, peer
//! failed, re-handshake and READ again). A notification to a dead peer is
//! accepted (`Ok`) and lost there (over TCP it fails the peer, above).
//!
//! Notifications to a receiver that does not poll are buffered by UCX: bursts
//! of 4096 to an idle receiver all arrived once it drained. A flood of 200 000
//! did not: UCX cancelled most sends (NIXL logs one error line per message)
//! while `send_notification` still returned `Ok`. Heartbeats are repeated and
//! a lost read-done is covered by lease expiry, but a receiver must drain
//! every step.
//!
//! The agent uses NIXL's default thread synchronization (none): every NIXL
//! call of a fabric comes from the one thread that owns it, and NIXL's UCX
//! backend makes its workers multi-threaded by itself when the progress
//! thread is on.
//!
//! # READs: prepared requests, re-posted
//!
//! `create_xfer_req` allocates (descriptor lists, the request, a `CString`),
//! so each distinct (peer, descriptor set) gets one NIXL transfer request,
//! created on first use and cached ([`NixlConfig::max_cached_requests`],
//! least-recently-used idle entries are evicted). A later READ of the same
//! set re-posts it with `post_xfer_req`; the attached notification, if any, is
//! passed at post time through a reused `OptArgs`, so one cached request
//! serves READs with and without notifications. A request that is still in
//! flight is never re-posted: a second concurrent READ of the same set gets a
//! second cached request. The lease-slot READs of a verifying decoder (one
//! 8-byte descriptor per slot) therefore stop allocating after warm-up. A
//! request whose READ failed, timed out or was cancelled is released (NIXL
//! aborts it) rather than re-used.
//!
//! # Allocation per step
//!
//! Rust-side heap allocations (the C++ side allocates as it sees fit; the
//! counting-allocator test cannot see it):
//!
//! | call                                        | allocates?                                              |
//! |---------------------------------------------|---------------------------------------------------------|
//! | `post_read`, cached descriptor set          | no (`post_xfer_req`; notification copied by C++)        |
//! | `post_read`, new descriptor set             | yes: descriptor lists, `CString`, request, cache index  |
//! | `read_state`, `cancel_read`                 | no (`get_xfer_status`; cancel releases the request, so  |
//! |                                             | the set's next READ creates one again)                  |
//! | `drain_notifications`, nothing pending      | no (`get_notifications` + map size)                     |
//! | `drain_notifications`, `n` messages         | yes: `take_notifs` builds a `HashMap` of `String`s (not |
//! |                                             | UTF-8: a `Vec` per message and a new map)               |
//! | `send_notification`                         | yes: `nixl-sys` makes a `CString` of the peer name      |
//! | `handshake_state` while pending             | no (channel `try_recv`)                                 |
//! | `start_handshake`, handshake completion     | yes (thread, buffers, metadata), once per handshake     |
//! | `add_peer`                                  | yes (name, region table, metadata), once per peer       |
//! | `remove_peer`, eviction                     | `nixl-sys`'s `CString` for `invalidate_remote_md`       |
//! | registration                                | yes (once, at construction time)                        |
//!
//! # Failure model
//!
//! Every error a peer can cause is a [`FabricError`]; nothing here panics on
//! peer input. The handshake answer is parsed with bounds on every length.
//! `nixl-sys`'s `load_remote_md` unwraps the remote agent's name as UTF-8; it
//! runs under `catch_unwind` and a panic there is
//! `Failed(Backend(`[`STATUS_METADATA_REJECTED`]`))`. A READ or a post that
//! fails, or a READ past the transfer timeout, marks its peer failed:
//! `handshake_state` then reports `Failed`, sends and READs to it return
//! `NotConnected`, and `start_handshake` with the same address starts over
//! under the same [`AgentId`] (a restarted peer has new metadata and new
//! memory addresses).
//!
//! Peers are keyed by the exact address string given to `start_handshake`
//! (or the agent name given to `add_peer`): use one address per remote
//! (`127.0.0.1:p` and `localhost:p` would be two entries sharing one NIXL
//! agent; removing either keeps the agent's metadata for the other, but
//! each holds a table entry).
//!
//! # Peers: removal and eviction
//!
//! The peer table has [`NixlConfig::max_agents`] entries, allocated at
//! construction. Every P restart is a new agent (vLLM names each worker's
//! agent with a fresh uuid, and a side-channel address with port 0 is new
//! too), so without forgetting, the table would fill after as many
//! restarts and D could no longer heartbeat or verify a new P. Two ways
//! out:
//!
//! - [`Fabric::remove_peer`] forgets a peer the engine knows is gone.
//! - **Eviction.** When a new peer needs an entry and none is free, the
//!   fabric evicts one: never a peer with a READ not yet reported by
//!   `read_state` (that READ's result is still owed to someone); among the
//!   rest a failed peer first (its handshake failed, or a READ or send to it
//!   did), then the least recently used (handshake started or registered,
//!   notification sent, READ posted). Counted in [`NixlStats::peers_evicted`].
//!   When every peer has a READ in flight, the new peer is refused with
//!   [`FabricError::Full`].
//!
//! Either way the peer is released in NIXL: its prepared transfer requests
//! are released (NIXL aborts any still in flight; `read_state` reports its
//! READs not yet reported `Failed(Cancelled)`), and its metadata is
//! invalidated (`invalidate_remote_md`) unless another entry loaded the same
//! agent. A pending handshake's thread finds its channel closed and ends.
//!
//! [`AgentId`]s carry their entry's generation, bumped whenever the entry is
//! emptied: an id held past its peer's removal or eviction (by a heartbeat
//! sender, a verifier, the engine) is [`FabricError::UnknownAgent`] from then
//! on, never the entry's next peer. The heartbeat sender answers that by
//! handshaking again (`crate::consumer::HeartbeatSender`). An evicted peer
//! that is still alive is simply met again: a new handshake, or a new
//! `add_peer` from the engine (a registered peer is never dialled).
//!
//! Cost: removal and eviction are not step paths. Evicting scans the peer
//! table and the READ table once; releasing a peer scans the request cache
//! and makes one `invalidate_remote_md` call (a `CString` in `nixl-sys`).
//! Adding a peer allocates its address string, its region table and, on
//! completion, NIXL's metadata. `tests/it/nixl_fabric/peers.rs` runs 200 P
//! restarts in a row against an 8-entry table: every round handshakes
//! (alternately by side channel and by `add_peer`), heartbeats and reads a
//! lease slot, and afterwards NIXL holds the metadata of the last eight P
//! agents only.
//!
//! The side channel is unauthenticated, like NIXL's own listener: it tells
//! anyone who connects our NIXL metadata and the addresses of our registered
//! regions. Bind it ([`NixlConfig::listen_addr`]) to an interface only the
//! deployment's workers reach. Each client is answered on a thread of its
//! own and gets 2 s for its whole exchange (request in, answer out, however
//! the bytes trickle), so a client that connects and says nothing delays no
//! other handshake; at most [`NixlConfig::max_side_channel_clients`] are
//! served at once, and a client beyond them is disconnected at once (it
//! fails its handshake and retries) rather than queued behind stalled ones.
//! `tests/it/nixl_fabric/side_channel.rs` holds a handshake behind four
//! silent clients and a trickling one to a few milliseconds.
//!
//! `Backend(code)` carries the NIXL C API status where there is one
//! ([`STATUS_INVALID_PARAM`], [`STATUS_BACKEND`], [`STATUS_NOT_FOUND`]) and a
//! kvlease code at or below -100 otherwise.
//!
//! # Threads
//!
//! A `NixlFabric` is not `Send`: `nixl-sys`'s notification map and option
//! arguments are not, and the UCX workers of the engine-loop mode are
//! single-threaded. Build it on the thread that runs the engine loop.

use std::fmt;
use std::hash::{Hash, Hasher};

use rustc_hash::{FxHashMap, FxHasher};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nixl_sys::{
    Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap, OptArgs,
    RegistrationHandle, ThreadSync, XferDescList, XferOp, XferRequest, XferStatus,
};

use super::{
    AgentId, ClockSample, Fabric, FabricError, HandshakeState, LandingWords, LeaseAdvert, PeerInfo,
    PeerRecord, ReadDesc, RegionId, RemoteRegion, SlotRegion, XferId, XferState,
};
use crate::collections::FreeStack;
use crate::slots::LeaseSlots;
use crate::sync::{AtomicU32, AtomicU64, Ordering};

use crate::time::{Instant, MonotonicClock};
/// The `nixl-sys` this fabric is built on: an engine that embeds kvlease
/// ([`NixlFabric::with_agent`]) makes its `Agent` with this very crate.
pub use nixl_sys;

mod config;
mod fabric_api;
mod peers;
mod raw_drain;
mod request_cache;
mod setup;
mod side_channel;
#[cfg(test)]
mod tests;

pub use config::{NixlConfig, NixlInitError, NixlStats, ProgressMode, UcxErrorHandling};
use peers::{Peer, PeerState, PeerTable, MAX_PEER_TABLE};
pub use raw_drain::{drain_raw_notifications, RawDrain};
use request_cache::desc_hash;
use side_channel::{exchange, start_listener};

/// NIXL C API status: invalid parameter (`NIXL_CAPI_ERROR_INVALID_PARAM`).
pub const STATUS_INVALID_PARAM: i32 = -1;
/// NIXL C API status: backend error (`NIXL_CAPI_ERROR_BACKEND`).
pub const STATUS_BACKEND: i32 = -2;
/// NIXL C API status: not found, e.g. no metadata loaded for the agent
/// (`NIXL_CAPI_ERROR_NOT_FOUND`).
pub const STATUS_NOT_FOUND: i32 = -6;
/// kvlease: `nixl-sys` refused the remote metadata by panicking (a remote
/// agent name that is not UTF-8); caught, the handshake failed.
pub const STATUS_METADATA_REJECTED: i32 = -100;
/// kvlease: the handshake thread could not be spawned.
pub const STATUS_SPAWN_FAILED: i32 = -101;

/// Side-channel magic, "KVLH".
const MAGIC: u32 = 0x4B56_4C48;
/// Side-channel protocol version.
const VERSION: u16 = 1;
/// Request: magic, version, reserved.
const REQUEST_LEN: usize = 8;
/// Answer header: magic, version, flags, remote clock, body length.
const HEADER_LEN: usize = 20;
/// Largest answer body we accept (NIXL metadata is ~0.5 KiB per backend).
const MAX_BODY_LEN: usize = 8 << 20;
/// Largest region table we accept.
const MAX_REGIONS: usize = 1 << 16;
/// Longest agent name (ours and a peer's).
const MAX_NAME_LEN: usize = 255;
/// Longest handshake address string.
const MAX_ADDRESS_LEN: usize = 512;
/// How long the listener gives one client for its whole exchange (request
/// in, answer out); a client still at it then is cut off.
const LISTENER_CLIENT_DEADLINE: Duration = Duration::from_secs(2);
/// Stack of a side-channel client thread: it copies one answer, nothing more.
const CLIENT_THREAD_STACK: usize = 64 << 10;
/// "No slot region" in the advertisement.
const NO_REGION: u32 = u32::MAX;

/// True when `libnixl_capi.so` can be loaded, i.e. [`NixlFabric::new`] will
/// not fail with [`NixlInitError::RuntimeNotFound`].
pub fn runtime_available() -> bool {
    !nixl_sys::is_stub()
}

/// NIXL agents this process's fabrics created ([`NixlFabric::new`]; never
/// [`NixlFabric::with_agent`], which uses the engine's).
static AGENTS_CREATED: AtomicU64 = AtomicU64::new(0);

/// How many NIXL agents kvlease has created in this process: an engine that
/// embeds kvlease with [`NixlFabric::with_agent`] can check that it is 0,
/// i.e. that its own agent is the only one.
pub fn agents_created() -> u64 {
    AGENTS_CREATED.load(Ordering::Relaxed)
}

/// The capacity settings every constructor checks.
fn check_config(config: &NixlConfig) -> Result<(), NixlInitError> {
    if config.max_agents == 0 || config.max_agents > MAX_PEER_TABLE {
        return Err(NixlInitError::BadConfig("max_agents"));
    }
    if config.max_side_channel_clients == 0 {
        return Err(NixlInitError::BadConfig("max_side_channel_clients"));
    }
    if config.max_inflight_reads == 0 || config.max_inflight_reads > u32::MAX as usize {
        return Err(NixlInitError::BadConfig("max_inflight_reads"));
    }
    if config.max_cached_requests > u32::MAX as usize {
        return Err(NixlInitError::BadConfig("max_cached_requests"));
    }
    Ok(())
}

/// Maps a `nixl-sys` error to the C API status it came from.
fn status_of(e: &NixlError) -> i32 {
    match e {
        NixlError::InvalidParam | NixlError::StringConversionError(_) => STATUS_INVALID_PARAM,
        NixlError::NotFound => STATUS_NOT_FOUND,
        _ => STATUS_BACKEND,
    }
}

fn backend(e: NixlError) -> FabricError {
    FabricError::Backend(status_of(&e))
}

/// A DRAM range handed to `nixl-sys` for registration.
#[derive(Debug)]
struct DramRange {
    addr: usize,
    len: usize,
}

impl MemoryRegion for DramRange {
    // No unsafe operation here: nixl-sys only reads the address to describe
    // the range it registers; the range's validity is register_memory's (or
    // LeaseSlots') contract.
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for DramRange {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RegionKind {
    /// The lease-slot array: read remotely, never a READ's landing region.
    Slots,
    /// Caller memory: KV blocks or landing buffers.
    Raw,
}

struct LocalRegion {
    addr: usize,
    len: usize,
    kind: RegionKind,
    /// Deregisters on drop.
    _registration: RegistrationHandle,
}

/// What a peer's handshake answer told us.
#[derive(Debug)]
struct Reply {
    name: String,
    slot_region: Option<u32>,
    slot_count: u32,
    compact: bool,
    regions: Vec<(u64, u64)>,
    md: Vec<u8>,
    clock: Option<ClockSample>,
}

/// A prepared transfer request for one (peer, descriptor set).
struct Cached {
    peer: u32,
    hash: u64,
    descs: Box<[ReadDesc]>,
    req: XferRequest,
    busy: bool,
    last_used: u64,
}

#[derive(Clone, Copy)]
struct Inflight {
    /// 0: slot free.
    id: u64,
    cache: usize,
    /// The peer's entry in the table.
    peer: u32,
    /// The peer's id: a later peer in the same entry is not this READ's.
    agent: AgentId,
    posted_at: Instant,
    /// Completed inside `post_xfer_req`.
    done: bool,
    /// Failed before `read_state` saw it (re-handshake of its peer).
    failed: Option<FabricError>,
}

/// `Inflight::cache` of a READ whose request was already released.
const NO_CACHE: usize = usize::MAX;

const FREE_READ: Inflight = Inflight {
    id: 0,
    cache: NO_CACHE,
    peer: 0,
    agent: AgentId(u32::MAX),
    posted_at: Instant::ZERO,
    done: false,
    failed: None,
};

/// The handshake listener thread and how to stop it.
struct Listener {
    addr: SocketAddr,
    stop: Arc<AtomicU32>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<side_channel::ClientCounters>,
}

/// The real NIXL fabric. See the module docs.
pub struct NixlFabric {
    // Field order is drop order: requests before registrations before the
    // memory they cover; every nixl-sys object before the agent's last Arc.
    cache: Vec<Option<Cached>>,
    /// Keys are our own descriptor hashes, not attacker-chosen: FxHash, not
    /// SipHash (`benches/fabric.rs`, the 64-descriptor READ).
    cache_index: FxHashMap<(u32, u64), Vec<usize>>,
    cache_free: FreeStack,
    reads: Vec<Inflight>,
    reads_free: FreeStack,
    regions: Vec<LocalRegion>,
    slot_arrays: Vec<Arc<LeaseSlots>>,
    /// Shares of the landing buffers registered with `register_landing`,
    /// dropped after the registrations above them.
    landing: Vec<Arc<LandingWords>>,
    slot_advert: Option<(RegionId, u32, bool)>,
    notif_map: NotificationMap,
    opt_plain: OptArgs,
    opt_notif: OptArgs,
    peers: PeerTable,
    advert: Arc<Mutex<Arc<Vec<u8>>>>,
    listener: Option<Listener>,
    /// The engine owns the agent and drains it ([`NixlFabric::with_agent`]).
    engine_drains: bool,
    agent: Agent,
    name: String,
    config: NixlConfig,
    read_seq: u32,
    use_counter: u64,
    stats: NixlStats,
}

impl fmt::Debug for NixlFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlFabric")
            .field("name", &self.name)
            .field("listen_addr", &self.listen_addr())
            .field("engine_drains", &self.engine_drains)
            .field("regions", &self.regions.len())
            .field("peers", &self.peers.live())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

fn backend_code(e: FabricError) -> i32 {
    match e {
        FabricError::Backend(code) => code,
        _ => STATUS_BACKEND,
    }
}

fn state_of(state: &PeerState) -> HandshakeState {
    match state {
        PeerState::Pending { .. } => HandshakeState::Pending,
        PeerState::Ready { info, .. } => HandshakeState::Ready(*info),
        PeerState::Failed(e) => HandshakeState::Failed(*e),
    }
}
