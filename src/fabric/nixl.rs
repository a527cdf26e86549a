//! [`NixlFabric`]: the real [`Fabric`] over NIXL (`nixl-sys`, UCX backend).
//!
//! Compiled with the cargo feature `nixl`. `nixl-sys` is built with its
//! `stub-api` feature: it needs no NIXL headers at build time and `dlopen`s
//! `libnixl_capi.so` at run time. Without that library every NIXL call would
//! abort the process, so [`NixlFabric::new`] checks first and returns
//! [`NixlInitError::RuntimeNotFound`]; [`runtime_available`] asks the same
//! question without building anything. `.ci/nixl-runtime.sh` provisions the
//! runtime on a machine with no NIXL install (see `shared/notes/nixl.md`).
//!
//! This module owns one NIXL agent per fabric, its UCX backend, the memory it
//! registers, the handshake side channel and the prepared READ requests. It
//! holds no lease logic. An engine that already has an agent builds the
//! fabric over it instead ([`NixlFabric::with_agent`]): then the agent, its
//! backend and its drain are the engine's, peers come from the engine's own
//! handshake ([`Fabric::add_peer`] with a [`LeaseAdvert`]), and the side
//! channel below is optional ([`NixlConfig::side_channel`]).
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
//! Two kinds of background thread, both inside the fabric and neither ever
//! touching the NIXL agent (so every NIXL call happens on the engine thread):
//!
//! - one **listener thread** per fabric, answering handshakes from a
//!   pre-encoded body that the engine thread refreshes after every
//!   registration (each answer takes the clock sample when it is written);
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
//! down: 8 ms notification round trips in `shared/notes/nixl.md`).
//!
//! Measured on this project's machine kind (x86_64, 2 cores, UCX over shared
//! memory, release build, three runs; `measure_progress_modes` and
//! `killed_peer_process_fails_reads_with_a_typed_error` in
//! `tests/nixl_fabric.rs` print them), through this module's API: a round
//! trip is `send_notification` → peer drains → peer sends → we drain; the
//! READ is one 512-byte descriptor over a 64-slot lease array, posted and
//! polled to `Done` (a re-posted, cached request):
//!
//! | mode (UCX error handling `none`)      | notification round trip p50 / p99 | 64-slot READ p50 / p99 |
//! |---------------------------------------|-----------------------------------|------------------------|
//! | engine loop, one process              | 1.2–1.3 µs / 1.5–5.3 µs           | 1.9 µs / 2.5–3.2 µs    |
//! | progress thread (1000 µs), one process| 34–56 µs / 70–132 µs              | 1.9–2.5 µs / 2.1–5.7 µs|
//! | engine loop, two processes            | 3.1–3.2 µs / 7.8–9.8 µs           | —                      |
//!
//! (A debug build of kvlease roughly doubles the engine-loop figures.) The
//! engine-loop mode is the default: it is 30–40 times faster for
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
//! memory. `tests/two_hosts.rs` runs the whole deployment in two network
//! namespaces over `UCX_TLS=tcp`; the README's "Across hosts" gives the
//! settings and the figures. Measured on TCP over loopback
//! (`measure_progress_modes` with `UCX_TLS=tcp`, release): notification round
//! trip 18 µs p50, a 64-slot READ 31 µs p50.
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
//! `none`: after the peer process is killed, the next READ to it fails
//! with `Backend(-2)` within 0.2–0.4 ms (UCX's `cma` copy reports an I/O
//! error). Transports that cannot tell fall back to the transfer timeout
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
//! | `drain_notifications`, `n` messages         | yes: `take_notifs` builds a `HashMap` of `String`s       |
//! | `send_notification`                         | yes: `nixl-sys` makes a `CString` of the peer name      |
//! | `handshake_state` while pending             | no (channel `try_recv`)                                 |
//! | `start_handshake`, handshake completion     | yes (thread, buffers, metadata), once per handshake     |
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
//! Peers are keyed by the exact address string given to `start_handshake`:
//! use one address per remote (`127.0.0.1:p` and `localhost:p` would be two
//! agents sharing one NIXL name, and re-handshaking one drops the other's
//! metadata).
//!
//! The side channel is unauthenticated, like NIXL's own listener: it tells
//! anyone who connects our NIXL metadata and the addresses of our registered
//! regions. Bind it ([`NixlConfig::listen_addr`]) to an interface only the
//! deployment's workers reach. It answers one connection at a time; a client
//! that stalls holds it for at most the 2 s I/O timeouts.
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

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};
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
    PeerRecord, ReadDesc, RegionId, SlotRegion, XferId, XferState,
};
use crate::slots::LeaseSlots;
use crate::sync::{AtomicU32, AtomicU64, Ordering};

use crate::time::{Instant, MonotonicClock};
/// The `nixl-sys` this fabric is built on: an engine that embeds kvlease
/// ([`NixlFabric::with_agent`]) makes its `Agent` with this very crate.
pub use nixl_sys;

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
/// Per-connection I/O timeout of the listener.
const LISTENER_IO_TIMEOUT: Duration = Duration::from_secs(2);
/// "No slot region" in the advertisement.
const NO_REGION: u32 = u32::MAX;

/// Where UCX/NIXL progress happens. See the module docs for the numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// No progress thread: the fabric's own calls progress the UCX worker
    /// (call `drain_notifications` every step). The default.
    EngineLoop,
    /// NIXL's progress thread, sleeping `delay_us` microseconds between
    /// polls. A delay of 0 busy-spins a core; [`NixlFabric::new`] refuses it.
    Thread {
        /// Delay between progress polls, microseconds (> 0).
        delay_us: u64,
    },
}

/// UCX endpoint error handling (`ucx_error_handling_mode` of the UCX backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UcxErrorHandling {
    /// `none`: one-sided operations complete without the target polling. UCX
    /// is not asked to watch peers (shared-memory copies still report a dead
    /// one); the fabric's transfer timeout is the backstop. The default, and
    /// the right choice with [`ProgressMode::EngineLoop`].
    None,
    /// `peer`: UCX detects failed peers, but with [`ProgressMode::EngineLoop`]
    /// a READ against a peer that is not polling can stall until it polls.
    Peer,
}

/// Construction-time settings of a [`NixlFabric`].
#[derive(Clone, Debug)]
pub struct NixlConfig {
    /// The NIXL agent name: unique among the agents that talk to each other,
    /// 1..=255 bytes, no NUL. Peers see it as the notification sender.
    pub agent_name: String,
    /// Where the handshake listener binds. Default `127.0.0.1:0` (any port;
    /// see [`NixlFabric::listen_addr`]).
    pub listen_addr: SocketAddr,
    /// Progress mode. Default [`ProgressMode::EngineLoop`].
    pub progress: ProgressMode,
    /// UCX error handling. Default [`UcxErrorHandling::None`].
    pub error_handling: UcxErrorHandling,
    /// The clock handshake samples are taken with: pass the engine's clock.
    pub clock: MonotonicClock,
    /// A handshake that has not completed this long after `start_handshake`'s
    /// `now` fails with `TimedOut`. Default 5 s.
    pub handshake_timeout: Duration,
    /// A READ in progress this long after `post_read`'s `now` fails with
    /// `TimedOut` (and is aborted). Default 5 s.
    pub transfer_timeout: Duration,
    /// Largest notification sent or attached to a READ. Default 4096 bytes.
    pub max_notification_len: usize,
    /// Most remote agents (handshake addresses). Default 64.
    pub max_agents: usize,
    /// Most READs in flight at once. Default 256.
    pub max_inflight_reads: usize,
    /// Most prepared transfer requests kept for re-posting (raised to at
    /// least `max_inflight_reads`). Default 1024.
    pub max_cached_requests: usize,
    /// Run kvlease's handshake side channel (a listener on
    /// [`NixlConfig::listen_addr`]). Default `true`. An engine that
    /// exchanges metadata itself and registers peers with
    /// [`Fabric::add_peer`] turns it off; [`NixlFabric::listen_addr`] is then
    /// the unspecified address.
    pub side_channel: bool,
}

impl NixlConfig {
    /// Defaults (see each field) for an agent called `agent_name`.
    pub fn new(agent_name: impl Into<String>) -> NixlConfig {
        NixlConfig {
            agent_name: agent_name.into(),
            listen_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            progress: ProgressMode::EngineLoop,
            error_handling: UcxErrorHandling::None,
            clock: MonotonicClock::new(),
            handshake_timeout: Duration::from_secs(5),
            transfer_timeout: Duration::from_secs(5),
            max_notification_len: 4096,
            max_agents: 64,
            max_inflight_reads: 256,
            max_cached_requests: 1024,
            side_channel: true,
        }
    }
}

/// Why a [`NixlFabric`] could not be built.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NixlInitError {
    /// `libnixl_capi.so` could not be loaded (not on `LD_LIBRARY_PATH`; run
    /// `.ci/nixl-runtime.sh`).
    RuntimeNotFound,
    /// The agent name is empty, longer than 255 bytes or contains NUL.
    BadName,
    /// A setting is out of range (which one is named).
    BadConfig(&'static str),
    /// NIXL refused to create the agent (C API status).
    Agent(i32),
    /// The UCX backend (or a NIXL helper object) could not be created.
    Backend(i32),
    /// The handshake listener could not bind or start.
    Listen(io::ErrorKind),
}

impl fmt::Display for NixlInitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NixlInitError::RuntimeNotFound => f.write_str(
                "NIXL runtime not found: libnixl_capi.so is not loadable (run .ci/nixl-runtime.sh and set LD_LIBRARY_PATH)",
            ),
            NixlInitError::BadName => f.write_str("bad NIXL agent name"),
            NixlInitError::BadConfig(what) => write!(f, "bad NIXL fabric setting: {what}"),
            NixlInitError::Agent(code) => write!(f, "NIXL agent creation failed (status {code})"),
            NixlInitError::Backend(code) => {
                write!(f, "NIXL UCX backend creation failed (status {code})")
            }
            NixlInitError::Listen(kind) => write!(f, "handshake listener failed: {kind}"),
        }
    }
}

impl std::error::Error for NixlInitError {}

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
    if config.max_agents == 0 || config.max_agents > u32::MAX as usize {
        return Err(NixlInitError::BadConfig("max_agents"));
    }
    if config.max_inflight_reads == 0 || config.max_inflight_reads > u32::MAX as usize {
        return Err(NixlInitError::BadConfig("max_inflight_reads"));
    }
    Ok(())
}

/// Counters since construction.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NixlStats {
    /// Notifications sent with `send_notification`.
    pub notifications_sent: u64,
    /// Sends NIXL refused with a backend error (a broken endpoint): each
    /// failed its peer ([`FabricError::PeerUnreachable`]).
    pub notifications_failed: u64,
    /// Notifications handed to `drain_notifications` sinks.
    pub notifications_received: u64,
    /// READs posted.
    pub reads_posted: u64,
    /// READs that re-posted a cached request (no allocation).
    pub request_cache_hits: u64,
    /// READs that had to create a request.
    pub request_cache_misses: u64,
    /// READs that failed or timed out.
    pub reads_failed: u64,
    /// Handshakes that reached `Ready`.
    pub handshakes_completed: u64,
    /// Times the notification map had to be replaced because `nixl-sys`
    /// refused to clear it (a notification that is not UTF-8).
    pub notification_map_resets: u64,
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

enum PeerState {
    Pending {
        rx: Receiver<Result<Reply, FabricError>>,
        deadline: Instant,
    },
    Ready {
        info: PeerInfo,
        regions: Vec<(u64, u64)>,
    },
    Failed(FabricError),
}

struct Peer {
    address: String,
    /// Registered from the engine's handshake ([`Fabric::add_peer`]): only
    /// a new `add_peer` revives it, `start_handshake` never dials it.
    registered: bool,
    state: PeerState,
    /// The NIXL name whose metadata is loaded for this peer, if any.
    name: Option<String>,
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
    peer: u32,
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
    posted_at: Instant::ZERO,
    done: false,
    failed: None,
};

/// The handshake listener thread and how to stop it.
struct Listener {
    addr: SocketAddr,
    stop: Arc<AtomicU32>,
    thread: Option<JoinHandle<()>>,
}

/// The real NIXL fabric. See the module docs.
pub struct NixlFabric {
    // Field order is drop order: requests before registrations before the
    // memory they cover; every nixl-sys object before the agent's last Arc.
    cache: Vec<Option<Cached>>,
    cache_index: HashMap<(u32, u64), Vec<usize>>,
    cache_free: Vec<usize>,
    reads: Vec<Inflight>,
    reads_free: Vec<u32>,
    regions: Vec<LocalRegion>,
    slot_arrays: Vec<Arc<LeaseSlots>>,
    /// Shares of the landing buffers registered with `register_landing`,
    /// dropped after the registrations above them.
    landing: Vec<Arc<LandingWords>>,
    slot_advert: Option<(RegionId, u32, bool)>,
    notif_map: NotificationMap,
    opt_plain: OptArgs,
    opt_notif: OptArgs,
    peers: Vec<Peer>,
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
            .field("peers", &self.peers.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl NixlFabric {
    /// Creates the NIXL agent and its UCX backend and starts the handshake
    /// listener. Fails with [`NixlInitError::RuntimeNotFound`] (without
    /// touching NIXL) when `libnixl_capi.so` cannot be loaded.
    pub fn new(config: NixlConfig) -> Result<NixlFabric, NixlInitError> {
        let name = config.agent_name.clone();
        if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
            return Err(NixlInitError::BadName);
        }
        check_config(&config)?;
        if let ProgressMode::Thread { delay_us: 0 } = config.progress {
            return Err(NixlInitError::BadConfig(
                "progress thread delay must be > 0 (0 busy-spins)",
            ));
        }
        if !runtime_available() {
            return Err(NixlInitError::RuntimeNotFound);
        }

        let (prog, delay) = match config.progress {
            ProgressMode::EngineLoop => (false, 0),
            ProgressMode::Thread { delay_us } => (true, delay_us),
        };
        let agent_config = AgentConfig {
            enable_prog_thread: prog,
            enable_listen_thread: false,
            thread_sync: ThreadSync::Default,
            num_workers: 1,
            pthr_delay_us: delay,
            capture_telemetry: false,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(&name, &agent_config)
            .map_err(|e| NixlInitError::Agent(status_of(&e)))?;
        AGENTS_CREATED.fetch_add(1, Ordering::Relaxed);
        let (_mems, defaults) = agent
            .get_plugin_params("UCX")
            .map_err(|e| NixlInitError::Backend(status_of(&e)))?;
        let mut params = defaults
            .clone()
            .map_err(|e| NixlInitError::Backend(status_of(&e)))?;
        let mode = match config.error_handling {
            UcxErrorHandling::None => "none",
            UcxErrorHandling::Peer => "peer",
        };
        params
            .set("ucx_error_handling_mode", mode)
            .map_err(|e| NixlInitError::Backend(status_of(&e)))?;
        // The agent keeps the backend; destroyed with the agent.
        let _backend = agent
            .create_backend("UCX", &params)
            .map_err(|e| NixlInitError::Backend(status_of(&e)))?;
        NixlFabric::build(agent, name, config, false)
    }

    /// A fabric over an agent the engine already owns: kvlease creates no
    /// agent and no backend, registers its lease slots and landing words on
    /// this one, and posts its notifications and slot READs on it, beside
    /// the engine's own KV READs. The agent must already have its backend
    /// (UCX); its name is the fabric's name (`config.agent_name` is
    /// ignored), and its progress and error-handling settings are the
    /// engine's (`config.progress` and `config.error_handling` are ignored).
    ///
    /// **The engine drains.** [`Fabric::drain_notifications`] makes no NIXL
    /// call and returns 0: the engine drains its agent once per step, as it
    /// already does, and hands kvlease's notifications to the roles
    /// ([`PrefillRank::on_notification`](crate::PrefillRank::on_notification)
    /// on P; anything it refuses is the engine's). The engine's drain is
    /// also what progresses the agent in the engine-loop mode, so it must
    /// still happen every step.
    ///
    /// Peers come from the engine's handshake ([`Fabric::add_peer`]), with
    /// [`Fabric::lease_advert`] carried in it; the side channel runs only if
    /// `config.side_channel` is left on.
    ///
    /// `Agent` is not `Send`: build and use the fabric on the thread that
    /// owns the agent. Fails with [`NixlInitError::RuntimeNotFound`] when
    /// `libnixl_capi.so` cannot be loaded.
    pub fn with_agent(agent: &Agent, config: NixlConfig) -> Result<NixlFabric, NixlInitError> {
        check_config(&config)?;
        if !runtime_available() {
            return Err(NixlInitError::RuntimeNotFound);
        }
        let name = agent.name();
        if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
            return Err(NixlInitError::BadName);
        }
        NixlFabric::build(agent.clone(), name, config, true)
    }

    /// The rest of construction, over `agent` (created by us or the engine).
    fn build(
        agent: Agent,
        name: String,
        config: NixlConfig,
        engine_drains: bool,
    ) -> Result<NixlFabric, NixlInitError> {
        let helper = |e: NixlError| NixlInitError::Backend(status_of(&e));
        let notif_map = NotificationMap::new().map_err(helper)?;
        let mut opt_plain = OptArgs::new().map_err(helper)?;
        opt_plain.set_has_notification(false).map_err(helper)?;
        let mut opt_notif = OptArgs::new().map_err(helper)?;
        opt_notif.set_has_notification(true).map_err(helper)?;

        let advert = Arc::new(Mutex::new(Arc::new(Vec::new())));
        let listener = if config.side_channel {
            Some(start_listener(
                config.listen_addr,
                advert.clone(),
                config.clock,
            )?)
        } else {
            None
        };

        let inflight = config.max_inflight_reads;
        let cache_cap = config.max_cached_requests.max(inflight);
        let mut fabric = NixlFabric {
            cache: (0..cache_cap).map(|_| None).collect(),
            cache_index: HashMap::with_capacity(cache_cap),
            cache_free: (0..cache_cap).rev().collect(),
            reads: vec![FREE_READ; inflight],
            reads_free: (0..inflight as u32).rev().collect(),
            regions: Vec::new(),
            slot_arrays: Vec::new(),
            landing: Vec::new(),
            slot_advert: None,
            notif_map,
            opt_plain,
            opt_notif,
            peers: Vec::with_capacity(config.max_agents),
            advert,
            listener,
            engine_drains,
            agent,
            name,
            config,
            read_seq: 0,
            use_counter: 0,
            stats: NixlStats::default(),
        };
        fabric
            .publish_advert()
            .map_err(|e| NixlInitError::Backend(backend_code(e)))?;
        Ok(fabric)
    }

    /// The handshake listener's address: what peers pass to
    /// [`Fabric::start_handshake`] (as `ip:port`).
    pub fn listen_addr(&self) -> SocketAddr {
        self.listener
            .as_ref()
            .map_or(SocketAddr::from(([0, 0, 0, 0], 0)), |l| l.addr)
    }

    /// Whether this fabric runs on an agent the engine owns and drains
    /// ([`NixlFabric::with_agent`]).
    pub fn engine_drains(&self) -> bool {
        self.engine_drains
    }

    /// Counters since construction.
    pub fn stats(&self) -> NixlStats {
        self.stats
    }

    /// Registers `addr..addr+len` with NIXL and records it as the next region.
    fn register_region(
        &mut self,
        addr: usize,
        len: usize,
        kind: RegionKind,
    ) -> Result<RegionId, FabricError> {
        if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
            return Err(FabricError::Backend(STATUS_INVALID_PARAM));
        }
        let id = u32::try_from(self.regions.len()).map_err(|_| FabricError::Full)?;
        if id == NO_REGION {
            return Err(FabricError::Full);
        }
        let registration = self
            .agent
            .register_memory(&DramRange { addr, len }, None)
            .map_err(backend)?;
        self.regions.push(LocalRegion {
            addr,
            len,
            kind,
            _registration: registration,
        });
        Ok(RegionId(id))
    }

    /// Re-encodes what the listener answers: our metadata (which now covers
    /// every registration) and our advertisement.
    fn publish_advert(&mut self) -> Result<(), FabricError> {
        let md = self.agent.get_local_md().map_err(backend)?;
        let (slot_region, slot_count, compact) = match self.slot_advert {
            Some((r, n, c)) => (r.0, n, c),
            None => (NO_REGION, 0, false),
        };
        let mut body = Vec::with_capacity(64 + 16 * self.regions.len() + md.len());
        body.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        body.extend_from_slice(self.name.as_bytes());
        body.extend_from_slice(&slot_region.to_le_bytes());
        body.extend_from_slice(&slot_count.to_le_bytes());
        body.push(u8::from(compact));
        body.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            body.extend_from_slice(&(r.addr as u64).to_le_bytes());
            body.extend_from_slice(&(r.len as u64).to_le_bytes());
        }
        body.extend_from_slice(&(md.len() as u32).to_le_bytes());
        body.extend_from_slice(&md);
        let mut guard = self.advert.lock().unwrap_or_else(|p| p.into_inner());
        *guard = Arc::new(body);
        Ok(())
    }

    fn peer_index(&self, agent: AgentId) -> Result<usize, FabricError> {
        let i = agent.0 as usize;
        if i < self.peers.len() {
            Ok(i)
        } else {
            Err(FabricError::UnknownAgent)
        }
    }

    /// The peer, if its handshake completed and it has not failed since.
    fn ready_peer(&self, agent: AgentId) -> Result<usize, FabricError> {
        let i = self.peer_index(agent)?;
        match self.peers[i].state {
            PeerState::Ready { .. } => Ok(i),
            _ => Err(FabricError::NotConnected),
        }
    }

    /// Turns a handshake answer into a connected peer (engine thread: this is
    /// where NIXL is touched).
    fn complete_handshake(&mut self, i: usize, reply: Reply) -> HandshakeState {
        self.forget_peer_requests(i, FabricError::PeerUnreachable);
        if let Some(old) = self.peers[i].name.take() {
            // Re-handshake: drop the old incarnation's metadata first.
            let _ = self.agent.invalidate_remote_md(&old);
        }
        let agent = &self.agent;
        let loaded = catch_unwind(AssertUnwindSafe(|| agent.load_remote_md(&reply.md)));
        let result = match loaded {
            Err(_) => Err(FabricError::Backend(STATUS_METADATA_REJECTED)),
            Ok(Err(e)) => Err(backend(e)),
            Ok(Ok(name)) if name != reply.name => {
                // The metadata names another agent than the advertisement.
                let _ = self.agent.invalidate_remote_md(&name);
                Err(FabricError::PeerUnreachable)
            }
            Ok(Ok(name)) => match self.agent.make_connection(&name, None) {
                Ok(()) => Ok(name),
                Err(e) => {
                    let _ = self.agent.invalidate_remote_md(&name);
                    Err(backend(e))
                }
            },
        };
        let peer = &mut self.peers[i];
        peer.state = match result {
            Ok(name) => {
                peer.name = Some(name);
                self.stats.handshakes_completed += 1;
                PeerState::Ready {
                    info: PeerInfo {
                        slot_region: reply.slot_region.map(RegionId),
                        slot_count: reply.slot_count,
                        compact_heartbeats: reply.compact,
                        clock: reply.clock,
                    },
                    regions: reply.regions,
                }
            }
            Err(e) => PeerState::Failed(e),
        };
        state_of(&peer.state)
    }

    /// Releases every cached request of peer `i`; READs in flight to it fail
    /// with `err` at their next `read_state`.
    fn forget_peer_requests(&mut self, i: usize, err: FabricError) {
        let peer = i as u32;
        for r in self.reads.iter_mut() {
            if r.id != 0 && r.peer == peer {
                if !r.done && r.failed.is_none() {
                    r.failed = Some(err);
                }
                // Its request is released below; the cache slot may be
                // reused before the READ is reported.
                r.cache = NO_CACHE;
            }
        }
        for ci in 0..self.cache.len() {
            if matches!(&self.cache[ci], Some(c) if c.peer == peer) {
                self.drop_cached(ci);
            }
        }
    }

    /// Marks peer `i` failed after a READ error or timeout.
    fn fail_peer(&mut self, i: usize, err: FabricError) {
        if let Some(p) = self.peers.get_mut(i) {
            if matches!(p.state, PeerState::Ready { .. }) {
                p.state = PeerState::Failed(err);
            }
        }
    }

    /// Releases cached request `ci` (NIXL aborts it if it is in flight).
    fn drop_cached(&mut self, ci: usize) {
        if let Some(c) = self.cache.get_mut(ci).and_then(Option::take) {
            if let Some(list) = self.cache_index.get_mut(&(c.peer, c.hash)) {
                list.retain(|&x| x != ci);
                if list.is_empty() {
                    self.cache_index.remove(&(c.peer, c.hash));
                }
            }
            self.cache_free.push(ci);
            drop(c);
        }
    }

    fn find_idle(&self, peer: u32, hash: u64, descs: &[ReadDesc]) -> Option<usize> {
        let list = self.cache_index.get(&(peer, hash))?;
        list.iter()
            .copied()
            .find(|&ci| matches!(&self.cache[ci], Some(c) if !c.busy && *c.descs == *descs))
    }

    /// Creates and caches a request for `descs` (the allocating path).
    fn create_cached(
        &mut self,
        peer: u32,
        hash: u64,
        descs: &[ReadDesc],
    ) -> Result<usize, FabricError> {
        let ci = match self.cache_free.pop() {
            Some(ci) => ci,
            None => {
                // Evict the least recently used idle request.
                let victim = self
                    .cache
                    .iter()
                    .enumerate()
                    .filter_map(|(i, c)| c.as_ref().filter(|c| !c.busy).map(|c| (c.last_used, i)))
                    .min()
                    .map(|(_, i)| i)
                    .ok_or(FabricError::Full)?;
                self.drop_cached(victim);
                self.cache_free.pop().ok_or(FabricError::Full)?
            }
        };
        let built = self.build_request(peer as usize, descs);
        let req = match built {
            Ok(req) => req,
            Err(e) => {
                self.cache_free.push(ci);
                return Err(e);
            }
        };
        self.cache[ci] = Some(Cached {
            peer,
            hash,
            descs: descs.into(),
            req,
            busy: false,
            last_used: 0,
        });
        self.cache_index.entry((peer, hash)).or_default().push(ci);
        Ok(ci)
    }

    fn build_request(&self, peer: usize, descs: &[ReadDesc]) -> Result<XferRequest, FabricError> {
        let p = &self.peers[peer];
        let (PeerState::Ready { regions, .. }, Some(name)) = (&p.state, &p.name) else {
            return Err(FabricError::NotConnected);
        };
        let mut local = XferDescList::new(MemType::Dram).map_err(backend)?;
        let mut remote = XferDescList::new(MemType::Dram).map_err(backend)?;
        for d in descs {
            // Bounds were checked by post_read; these cannot overflow.
            let l = &self.regions[d.local.0 as usize];
            let (raddr, _) = regions[d.remote.0 as usize];
            local.add_desc(l.addr + d.local_offset as usize, d.len as usize, 0);
            remote.add_desc((raddr + d.remote_offset) as usize, d.len as usize, 0);
        }
        self.agent
            .create_xfer_req(XferOp::Read, &local, &remote, name, None)
            .map_err(backend)
    }

    /// Checks one descriptor against our region table and the peer's.
    fn check_desc(&self, regions: &[(u64, u64)], d: &ReadDesc) -> Result<(), FabricError> {
        let local = self
            .regions
            .get(d.local.0 as usize)
            .filter(|r| r.kind == RegionKind::Raw)
            .ok_or(FabricError::UnknownRegion)?;
        let &(raddr, rlen) = regions
            .get(d.remote.0 as usize)
            .ok_or(FabricError::UnknownRegion)?;
        if d.len == 0 {
            return Err(FabricError::OutOfBounds);
        }
        let local_end = d.local_offset.checked_add(d.len);
        let remote_end = d.remote_offset.checked_add(d.len);
        let local_ok = local_end.is_some_and(|e| e <= local.len as u64);
        let remote_ok = remote_end.is_some_and(|e| e <= rlen)
            && raddr
                .checked_add(d.remote_offset)
                .and_then(|a| a.checked_add(d.len))
                .is_some_and(|e| usize::try_from(e).is_ok());
        if local_ok && remote_ok {
            Ok(())
        } else {
            Err(FabricError::OutOfBounds)
        }
    }

    fn read_index(&self, xfer: XferId) -> Option<usize> {
        let i = (xfer.0 & 0xFFFF_FFFF) as usize;
        match self.reads.get(i) {
            Some(r) if r.id != 0 && r.id == xfer.0 => Some(i),
            _ => None,
        }
    }

    /// Frees READ slot `i`; its cached request becomes idle again (or is
    /// released, when `release`).
    fn finish_read(&mut self, i: usize, release: bool) {
        let r = self.reads[i];
        self.reads[i] = FREE_READ;
        self.reads_free.push(i as u32);
        if release {
            self.drop_cached(r.cache);
        } else if let Some(Some(c)) = self.cache.get_mut(r.cache) {
            c.busy = false;
        }
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

fn desc_hash(descs: &[ReadDesc]) -> u64 {
    let mut h = DefaultHasher::new();
    for d in descs {
        (
            d.local.0,
            d.local_offset,
            d.remote.0,
            d.remote_offset,
            d.len,
        )
            .hash(&mut h);
    }
    h.finish()
}

impl Fabric for NixlFabric {
    fn name(&self) -> &str {
        &self.name
    }

    fn register_slots(
        &mut self,
        slots: Arc<LeaseSlots>,
        compact_heartbeats: bool,
    ) -> Result<RegionId, FabricError> {
        let id =
            self.register_region(slots.as_ptr() as usize, slots.byte_len(), RegionKind::Slots)?;
        self.slot_advert = Some((id, slots.len(), compact_heartbeats));
        // Keeps the registered array alive as long as the registration.
        self.slot_arrays.push(slots);
        self.publish_advert()?;
        Ok(id)
    }

    unsafe fn register_memory(
        &mut self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<RegionId, FabricError> {
        let id = self.register_region(ptr as usize, len, RegionKind::Raw)?;
        self.publish_advert()?;
        Ok(id)
    }

    fn register_landing(&mut self, words: Arc<LandingWords>) -> Result<RegionId, FabricError> {
        let id =
            self.register_region(words.as_ptr() as usize, words.byte_len(), RegionKind::Raw)?;
        self.publish_advert()?;
        // Keeps the words alive as long as the registration (field order).
        self.landing.push(words);
        Ok(id)
    }

    fn max_notification_len(&self) -> usize {
        self.config.max_notification_len
    }

    fn start_handshake(&mut self, address: &str, now: Instant) -> Result<AgentId, FabricError> {
        if address.is_empty() || address.len() > MAX_ADDRESS_LEN {
            return Err(FabricError::BadAddress);
        }
        let existing = self.peers.iter().position(|p| p.address == address);
        let i = match existing {
            Some(i) if self.peers[i].registered => return Ok(AgentId(i as u32)),
            Some(i) if !matches!(self.peers[i].state, PeerState::Failed(_)) => {
                return Ok(AgentId(i as u32));
            }
            Some(i) => i,
            None if self.peers.len() >= self.config.max_agents => return Err(FabricError::Full),
            None => self.peers.len(),
        };
        let (tx, rx) = mpsc::channel();
        let target = address.to_owned();
        let clock = self.config.clock;
        let timeout = self.config.handshake_timeout;
        std::thread::Builder::new()
            .name("kvlease-nixl-hs".into())
            .spawn(move || {
                // The receiver may be gone (fabric dropped): nothing to do.
                let _ = tx.send(exchange(&target, clock, timeout));
            })
            .map_err(|_| FabricError::Backend(STATUS_SPAWN_FAILED))?;
        let state = PeerState::Pending {
            rx,
            deadline: now + timeout,
        };
        if i == self.peers.len() {
            self.peers.push(Peer {
                address: address.to_owned(),
                registered: false,
                state,
                name: None,
            });
        } else {
            self.peers[i].state = state;
        }
        Ok(AgentId(i as u32))
    }

    fn lease_advert(&self) -> LeaseAdvert {
        let slots = self.slot_advert.and_then(|(region, count, _)| {
            let r = self.regions.get(region.0 as usize)?;
            Some(SlotRegion {
                addr: r.addr as u64,
                len: r.len as u64,
                count,
            })
        });
        LeaseAdvert {
            slots,
            compact_heartbeats: self.slot_advert.is_some_and(|(_, _, c)| c),
        }
    }

    fn add_peer(&mut self, record: &PeerRecord<'_>, _now: Instant) -> Result<AgentId, FabricError> {
        let name = record.agent_name;
        if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
            return Err(FabricError::BadAddress);
        }
        // Keyed by the agent's name, so that a sender whose peer address is
        // that name finds it through `start_handshake`.
        let i = match self.peers.iter().position(|p| p.address == name) {
            Some(i) => i,
            None if self.peers.len() >= self.config.max_agents => return Err(FabricError::Full),
            None => {
                self.peers.push(Peer {
                    address: name.to_owned(),
                    registered: true,
                    state: PeerState::Failed(FabricError::NotConnected),
                    name: None,
                });
                self.peers.len() - 1
            }
        };
        self.peers[i].registered = true;
        let advert = record.advert.unwrap_or(LeaseAdvert {
            slots: None,
            compact_heartbeats: false,
        });
        // The remote's slot region is its region 0 here: a registered peer
        // exports nothing else to kvlease (the engine READs its KV itself).
        let (slot_region, slot_count, regions) = match advert.slots {
            Some(s) => (Some(0), s.count, vec![(s.addr, s.len)]),
            None => (None, 0, Vec::new()),
        };
        let reply = Reply {
            name: name.to_owned(),
            slot_region,
            slot_count,
            compact: advert.compact_heartbeats,
            regions,
            md: record.metadata.to_vec(),
            clock: record.clock,
        };
        match self.complete_handshake(i, reply) {
            HandshakeState::Ready(_) => Ok(AgentId(i as u32)),
            HandshakeState::Failed(e) => Err(e),
            HandshakeState::Pending => Err(FabricError::NotConnected),
        }
    }

    fn handshake_state(&mut self, agent: AgentId, now: Instant) -> HandshakeState {
        let i = match self.peer_index(agent) {
            Ok(i) => i,
            Err(e) => return HandshakeState::Failed(e),
        };
        let polled = match &self.peers[i].state {
            PeerState::Pending { rx, deadline } => match rx.try_recv() {
                Ok(answer) => Some(answer),
                Err(TryRecvError::Empty) if now >= *deadline => Some(Err(FabricError::TimedOut)),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => Some(Err(FabricError::PeerUnreachable)),
            },
            _ => None,
        };
        match polled {
            Some(Ok(reply)) => self.complete_handshake(i, reply),
            Some(Err(e)) => {
                self.peers[i].state = PeerState::Failed(e);
                HandshakeState::Failed(e)
            }
            None => state_of(&self.peers[i].state),
        }
    }

    fn send_notification(&mut self, to: AgentId, msg: &[u8]) -> Result<(), FabricError> {
        let i = self.ready_peer(to)?;
        if msg.len() > self.config.max_notification_len {
            return Err(FabricError::MessageTooLarge);
        }
        let name = self.peers[i]
            .name
            .as_deref()
            .ok_or(FabricError::NotConnected)?;
        match self.agent.send_notification(name, msg, None) {
            Ok(()) => {
                self.stats.notifications_sent += 1;
                Ok(())
            }
            Err(NixlError::NotFound) => Err(FabricError::NotConnected),
            Err(_) => {
                // NIXL reports a broken endpoint (the peer's process died,
                // its TCP connection was reset) only as a backend error.
                // Fail the peer, as a failed READ does, so that the sender
                // backs off and handshakes again (a restarted peer has a new
                // agent) instead of retrying a dead endpoint every step.
                self.stats.notifications_failed += 1;
                self.fail_peer(i, FabricError::PeerUnreachable);
                Err(FabricError::PeerUnreachable)
            }
        }
    }

    fn drain_notifications(
        &mut self,
        sink: &mut dyn FnMut(&str, &[u8]),
    ) -> Result<usize, FabricError> {
        if self.engine_drains {
            // The engine drains its own agent and routes kvlease's messages
            // to the roles; draining here would take the engine's.
            return Ok(0);
        }
        self.agent
            .get_notifications(&mut self.notif_map, None)
            .map_err(backend)?;
        if self.notif_map.is_empty().map_err(backend)? {
            return Ok(0);
        }
        let mut n = 0usize;
        match self.notif_map.take_notifs() {
            Ok(all) => {
                for (sender, msgs) in &all {
                    for m in msgs {
                        sink(sender, m.as_bytes());
                        n += 1;
                    }
                }
            }
            Err(_) => {
                // nixl-sys refuses to take (and so to clear) a map holding a
                // notification that is not UTF-8. Hand out the bytes as they
                // are, then replace the map: the only way to empty it.
                for sender in self.notif_map.agents() {
                    let Ok(sender) = sender else { continue };
                    let Ok(msgs) = self.notif_map.get_notifications(sender) else {
                        continue;
                    };
                    for m in msgs.flatten() {
                        sink(sender, &m);
                        n += 1;
                    }
                }
                self.notif_map = NotificationMap::new().map_err(backend)?;
                self.stats.notification_map_resets += 1;
            }
        }
        self.stats.notifications_received += n as u64;
        Ok(n)
    }

    fn post_read(
        &mut self,
        from: AgentId,
        descs: &[ReadDesc],
        notification: Option<&[u8]>,
        now: Instant,
    ) -> Result<XferId, FabricError> {
        let pi = self.ready_peer(from)?;
        if notification.is_some_and(|m| m.len() > self.config.max_notification_len) {
            return Err(FabricError::MessageTooLarge);
        }
        if descs.is_empty() {
            return Err(FabricError::Backend(STATUS_INVALID_PARAM));
        }
        {
            let PeerState::Ready { regions, .. } = &self.peers[pi].state else {
                return Err(FabricError::NotConnected);
            };
            for d in descs {
                self.check_desc(regions, d)?;
            }
        }
        let Some(&slot) = self.reads_free.last() else {
            return Err(FabricError::Full);
        };
        let peer = pi as u32;
        let hash = desc_hash(descs);
        let ci = match self.find_idle(peer, hash, descs) {
            Some(ci) => {
                self.stats.request_cache_hits += 1;
                ci
            }
            None => {
                self.stats.request_cache_misses += 1;
                self.create_cached(peer, hash, descs)?
            }
        };
        let opt = match notification {
            Some(msg) => {
                self.opt_notif
                    .set_notification_message(msg)
                    .map_err(backend)?;
                &self.opt_notif
            }
            None => &self.opt_plain,
        };
        let Some(cached) = self.cache[ci].as_mut() else {
            return Err(FabricError::Backend(STATUS_BACKEND));
        };
        match self.agent.post_xfer_req(&cached.req, Some(opt)) {
            Ok(in_progress) => {
                self.use_counter += 1;
                cached.busy = true;
                cached.last_used = self.use_counter;
                self.reads_free.pop();
                self.read_seq = self.read_seq.wrapping_add(1).max(1);
                let id = (u64::from(self.read_seq) << 32) | u64::from(slot);
                self.reads[slot as usize] = Inflight {
                    id,
                    cache: ci,
                    peer,
                    posted_at: now,
                    done: !in_progress,
                    failed: None,
                };
                self.stats.reads_posted += 1;
                Ok(XferId(id))
            }
            Err(e) => {
                let err = backend(e);
                self.drop_cached(ci);
                self.stats.reads_failed += 1;
                self.fail_peer(pi, err);
                Err(err)
            }
        }
    }

    fn read_state(&mut self, xfer: XferId, now: Instant) -> XferState {
        let Some(i) = self.read_index(xfer) else {
            return XferState::Failed(FabricError::UnknownXfer);
        };
        let r = self.reads[i];
        if let Some(err) = r.failed {
            self.stats.reads_failed += 1;
            self.finish_read(i, true);
            return XferState::Failed(err);
        }
        if r.done {
            self.finish_read(i, false);
            return XferState::Done;
        }
        let status = match self.cache.get(r.cache).and_then(Option::as_ref) {
            Some(c) => self.agent.get_xfer_status(&c.req),
            None => Err(NixlError::BackendError),
        };
        match status {
            Ok(XferStatus::Success) => {
                self.finish_read(i, false);
                XferState::Done
            }
            Ok(XferStatus::InProgress) => {
                if now.saturating_duration_since(r.posted_at) >= self.config.transfer_timeout {
                    self.stats.reads_failed += 1;
                    self.finish_read(i, true);
                    self.fail_peer(r.peer as usize, FabricError::TimedOut);
                    XferState::Failed(FabricError::TimedOut)
                } else {
                    XferState::InProgress
                }
            }
            Err(e) => {
                let err = backend(e);
                self.stats.reads_failed += 1;
                self.finish_read(i, true);
                self.fail_peer(r.peer as usize, err);
                XferState::Failed(err)
            }
        }
    }

    fn cancel_read(&mut self, xfer: XferId) {
        if let Some(i) = self.read_index(xfer) {
            let r = self.reads[i];
            // An unfinished request is released, which makes NIXL abort it.
            self.finish_read(i, !r.done);
        }
    }
}

impl Drop for NixlFabric {
    fn drop(&mut self) {
        let Some(listener) = self.listener.as_mut() else {
            return;
        };
        listener.stop.store(1, Ordering::SeqCst);
        // Wake the accept() with a connection of our own.
        let mut wake = listener.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => [127, 0, 0, 1].into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = listener.thread.take() {
            let _ = t.join();
        }
    }
}

// ---- the handshake side channel ---------------------------------------------

fn start_listener(
    addr: SocketAddr,
    advert: Arc<Mutex<Arc<Vec<u8>>>>,
    clock: MonotonicClock,
) -> Result<Listener, NixlInitError> {
    let socket = TcpListener::bind(addr).map_err(|e| NixlInitError::Listen(e.kind()))?;
    let bound = socket
        .local_addr()
        .map_err(|e| NixlInitError::Listen(e.kind()))?;
    let stop = Arc::new(AtomicU32::new(0));
    let stop_thread = stop.clone();
    let thread = std::thread::Builder::new()
        .name("kvlease-nixl-listen".into())
        .spawn(move || serve(socket, stop_thread, advert, clock))
        .map_err(|e| NixlInitError::Listen(e.kind()))?;
    Ok(Listener {
        addr: bound,
        stop,
        thread: Some(thread),
    })
}

fn serve(
    socket: TcpListener,
    stop: Arc<AtomicU32>,
    advert: Arc<Mutex<Arc<Vec<u8>>>>,
    clock: MonotonicClock,
) {
    loop {
        let conn = socket.accept();
        if stop.load(Ordering::SeqCst) != 0 {
            return;
        }
        match conn {
            // A misbehaving client costs at most the I/O timeouts.
            Ok((stream, _)) => {
                let _ = answer(stream, &advert, clock);
            }
            // E.g. out of file descriptors: do not spin.
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn answer(
    mut stream: TcpStream,
    advert: &Mutex<Arc<Vec<u8>>>,
    clock: MonotonicClock,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(LISTENER_IO_TIMEOUT))?;
    stream.set_write_timeout(Some(LISTENER_IO_TIMEOUT))?;
    let mut req = [0u8; REQUEST_LEN];
    stream.read_exact(&mut req)?;
    if u32::from_le_bytes([req[0], req[1], req[2], req[3]]) != MAGIC
        || u16::from_le_bytes([req[4], req[5]]) != VERSION
    {
        return Ok(());
    }
    let body = advert.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let body_len = u32::try_from(body.len()).map_err(|_| io::ErrorKind::InvalidData)?;
    let mut header = [0u8; HEADER_LEN];
    header[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    header[4..6].copy_from_slice(&VERSION.to_le_bytes());
    header[8..16].copy_from_slice(&clock.now().as_nanos().to_le_bytes());
    header[16..20].copy_from_slice(&body_len.to_le_bytes());
    stream.write_all(&header)?;
    stream.write_all(&body)?;
    stream.flush()
}

fn io_error(e: io::Error) -> FabricError {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => FabricError::TimedOut,
        _ => FabricError::PeerUnreachable,
    }
}

/// The client side, on the handshake thread: connect, ask, read, parse.
fn exchange(address: &str, clock: MonotonicClock, timeout: Duration) -> Result<Reply, FabricError> {
    let start = std::time::Instant::now();
    let remaining = || {
        timeout
            .checked_sub(start.elapsed())
            .filter(|d| !d.is_zero())
            .ok_or(FabricError::TimedOut)
    };
    let addrs: Vec<SocketAddr> = match address.parse::<SocketAddr>() {
        Ok(a) => vec![a],
        Err(_) => address
            .to_socket_addrs()
            .map_err(|_| FabricError::BadAddress)?
            .collect(),
    };
    if addrs.is_empty() {
        return Err(FabricError::BadAddress);
    }
    let mut stream = None;
    let mut last = FabricError::PeerUnreachable;
    for a in &addrs {
        match TcpStream::connect_timeout(a, remaining()?) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = io_error(e),
        }
    }
    let mut stream = stream.ok_or(last)?;
    stream.set_nodelay(true).map_err(io_error)?;
    stream
        .set_write_timeout(Some(remaining()?))
        .map_err(io_error)?;
    let mut req = [0u8; REQUEST_LEN];
    req[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    req[4..6].copy_from_slice(&VERSION.to_le_bytes());
    let local_send = clock.now();
    stream.write_all(&req).map_err(io_error)?;
    stream
        .set_read_timeout(Some(remaining()?))
        .map_err(io_error)?;
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header).map_err(io_error)?;
    let local_recv = clock.now();
    let mut h = Cursor::new(&header);
    if h.u32()? != MAGIC || h.u16()? != VERSION {
        return Err(FabricError::PeerUnreachable);
    }
    let _flags = h.u16()?;
    let remote = Instant::from_nanos(h.u64()?);
    let body_len = h.u32()? as usize;
    if body_len > MAX_BODY_LEN {
        return Err(FabricError::PeerUnreachable);
    }
    let mut body = vec![0u8; body_len];
    stream
        .set_read_timeout(Some(remaining()?))
        .map_err(io_error)?;
    stream.read_exact(&mut body).map_err(io_error)?;
    let clock = ClockSample {
        local_send,
        remote,
        local_recv,
    };
    parse_body(&body, clock)
}

/// Parses an answer body. Every length is bounded; garbage is
/// `PeerUnreachable` ("answered garbage"), never a panic.
fn parse_body(body: &[u8], clock: ClockSample) -> Result<Reply, FabricError> {
    let mut c = Cursor::new(body);
    let name_len = c.u16()? as usize;
    if name_len == 0 || name_len > MAX_NAME_LEN {
        return Err(FabricError::PeerUnreachable);
    }
    let name = std::str::from_utf8(c.bytes(name_len)?)
        .map_err(|_| FabricError::PeerUnreachable)?
        .to_owned();
    if name.contains('\0') {
        return Err(FabricError::PeerUnreachable);
    }
    let slot_region = c.u32()?;
    let slot_count = c.u32()?;
    let compact = match c.u8()? {
        0 => false,
        1 => true,
        _ => return Err(FabricError::PeerUnreachable),
    };
    let region_count = c.u32()? as usize;
    if region_count > MAX_REGIONS || region_count > c.remaining() / 16 {
        return Err(FabricError::PeerUnreachable);
    }
    let mut regions = Vec::with_capacity(region_count);
    for _ in 0..region_count {
        let addr = c.u64()?;
        let len = c.u64()?;
        if addr.checked_add(len).is_none() {
            return Err(FabricError::PeerUnreachable);
        }
        regions.push((addr, len));
    }
    let slot_region = match slot_region {
        NO_REGION => None,
        r if (r as usize) < region_count => Some(r),
        _ => return Err(FabricError::PeerUnreachable),
    };
    if let Some(r) = slot_region {
        // The slot array must hold slot_count words.
        if u64::from(slot_count) * 8 > regions[r as usize].1 {
            return Err(FabricError::PeerUnreachable);
        }
    }
    let md_len = c.u32()? as usize;
    let md = c.bytes(md_len)?.to_vec();
    if md.is_empty() || c.remaining() != 0 {
        return Err(FabricError::PeerUnreachable);
    }
    Ok(Reply {
        name,
        slot_region,
        slot_count: if slot_region.is_some() { slot_count } else { 0 },
        compact,
        regions,
        md,
        clock: Some(clock),
    })
}

/// A bounds-checked little-endian reader.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Cursor<'a> {
        Cursor { buf, pos: 0 }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8], FabricError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(FabricError::PeerUnreachable)?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], FabricError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, FabricError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, FabricError> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, FabricError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, FabricError> {
        self.array().map(u64::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ClockSample {
        ClockSample {
            local_send: Instant::from_nanos(1),
            remote: Instant::from_nanos(2),
            local_recv: Instant::from_nanos(3),
        }
    }

    fn body(name: &[u8], slot_region: u32, slot_count: u32, regions: &[(u64, u64)]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&(name.len() as u16).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&slot_region.to_le_bytes());
        b.extend_from_slice(&slot_count.to_le_bytes());
        b.push(1);
        b.extend_from_slice(&(regions.len() as u32).to_le_bytes());
        for (a, l) in regions {
            b.extend_from_slice(&a.to_le_bytes());
            b.extend_from_slice(&l.to_le_bytes());
        }
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(b"md!");
        b
    }

    #[test]
    fn parses_a_well_formed_answer() {
        let r = parse_body(&body(b"P0", 0, 4, &[(4096, 32), (8192, 100)]), sample()).unwrap();
        assert_eq!(r.name, "P0");
        assert_eq!(r.slot_region, Some(0));
        assert_eq!(r.slot_count, 4);
        assert!(r.compact);
        assert_eq!(r.regions, vec![(4096, 32), (8192, 100)]);
        assert_eq!(r.md, b"md!");
        let none = parse_body(&body(b"P0", NO_REGION, 9, &[]), sample()).unwrap();
        assert_eq!((none.slot_region, none.slot_count), (None, 0));
    }

    #[test]
    fn every_truncation_and_corruption_is_a_typed_error() {
        let good = body(b"P0", 0, 4, &[(4096, 32)]);
        for cut in 0..good.len() {
            assert_eq!(
                parse_body(&good[..cut], sample()).unwrap_err(),
                FabricError::PeerUnreachable
            );
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(parse_body(&trailing, sample()).is_err());
        // Slot region out of the table, slot count larger than the region,
        // non-UTF-8 name, empty name, overflowing region, huge counts.
        assert!(parse_body(&body(b"P0", 1, 4, &[(4096, 32)]), sample()).is_err());
        assert!(parse_body(&body(b"P0", 0, 5, &[(4096, 32)]), sample()).is_err());
        assert!(parse_body(&body(&[0xff, 0xfe], 0, 4, &[(4096, 32)]), sample()).is_err());
        assert!(parse_body(&body(b"", 0, 4, &[(4096, 32)]), sample()).is_err());
        assert!(parse_body(&body(b"P0", 0, 4, &[(u64::MAX, 32)]), sample()).is_err());
        let mut huge = body(b"P0", NO_REGION, 0, &[]);
        let at = 2 + 2 + 4 + 4 + 1;
        huge[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_body(&huge, sample()).is_err());
    }

    #[test]
    fn descriptor_hash_depends_on_every_field() {
        let d = ReadDesc {
            local: RegionId(0),
            local_offset: 8,
            remote: RegionId(1),
            remote_offset: 16,
            len: 8,
        };
        let base = desc_hash(&[d]);
        for changed in [
            ReadDesc {
                local: RegionId(1),
                ..d
            },
            ReadDesc {
                local_offset: 0,
                ..d
            },
            ReadDesc {
                remote: RegionId(0),
                ..d
            },
            ReadDesc {
                remote_offset: 8,
                ..d
            },
            ReadDesc { len: 16, ..d },
        ] {
            assert_ne!(desc_hash(&[changed]), base);
        }
        assert_eq!(desc_hash(&[d, d]), desc_hash(&[d, d]));
    }
}
