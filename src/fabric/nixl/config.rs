//! The settings a [`NixlFabric`] is built with, its construction errors and
//! its counters.

use super::*;

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
    /// Entries of the peer table: remote agents known at once (handshake
    /// addresses and registered names), 1..=2^20. When it is full, a new
    /// peer evicts a stale one (see the module docs, "Peers: removal and
    /// eviction"). Default 64.
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
    /// Side-channel clients served at once, each on a thread of its own for
    /// at most 2 s; a client beyond them is disconnected at once (it sees a
    /// failed handshake and retries). At least 1. Default 32.
    pub max_side_channel_clients: usize,
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
            max_side_channel_clients: 32,
        }
    }
}

/// Why a [`NixlFabric`] could not be built.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NixlInitError {
    /// `libnixl_capi.so` could not be loaded (not on `LD_LIBRARY_PATH`; run
    /// `.ci/nixl-runtime.sh`).
    #[error("NIXL runtime not found: libnixl_capi.so is not loadable (run .ci/nixl-runtime.sh and set LD_LIBRARY_PATH)")]
    RuntimeNotFound,
    /// The agent name is empty, longer than 255 bytes or contains NUL.
    #[error("bad NIXL agent name")]
    BadName,
    /// A setting is out of range (which one is named).
    #[error("bad NIXL fabric setting: {0}")]
    BadConfig(&'static str),
    /// NIXL refused to create the agent (C API status).
    #[error("NIXL agent creation failed (status {0})")]
    Agent(i32),
    /// The UCX backend (or a NIXL helper object) could not be created.
    #[error("NIXL UCX backend creation failed (status {0})")]
    Backend(i32),
    /// The handshake listener could not bind or start.
    #[error("handshake listener failed: {0}")]
    Listen(io::ErrorKind),
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
    /// Peers in the table now (at most [`NixlConfig::max_agents`]).
    pub peers: u64,
    /// Peers forgotten through [`Fabric::remove_peer`].
    pub peers_removed: u64,
    /// Peers evicted to make room for a new one.
    pub peers_evicted: u64,
    /// Prepared transfer requests held now.
    pub cached_requests: u64,
    /// Side-channel clients answered.
    pub side_channel_answered: u64,
    /// Side-channel clients disconnected because
    /// [`NixlConfig::max_side_channel_clients`] were being served.
    pub side_channel_refused: u64,
}
