//! [`LeaseConfig`]: every setting and capacity of the lease machinery, and
//! parsing it from vLLM's `kv_connector_extra_config`.
//!
//! This module owns the names, defaults, limits and derived values of the
//! settings. It runs once at construction and may allocate; nothing here is on
//! a step path.
//!
//! # Keys
//!
//! | key (in `kv_connector_extra_config`) | default | meaning |
//! |---|---|---|
//! | `kv_lease_duration` | 30 | initial lease on P, seconds (any number, e.g. `45.5`), at least 6 |
//! | `decoder_kv_blocks_ttl` | 480 | fixed TTL of blocks cached on D (bidirectional mode), seconds (any positive number) |
//! | `kv_lease_verification` | `true` | D uses pulled KV only after verifying the lease slot |
//! | `kv_lease_slots` | KV blocks + max_num_seqs | lease slots exported by each P worker |
//! | `kv_lease_require_verification` | `false` | D also fails the loads it cannot verify because P advertises no lease slots (a stock P); needs `kv_lease_verification` |
//! | `kv_lease_capacity` | `kv_lease_slots` | leases one P lease book can hold at once |
//! | `kv_lease_max_request_id_len` | 128 | longest request id, in bytes (ids are stored inline) |
//! | `kv_lease_wheel_tick_ms` | 10 | timer-wheel resolution: expiry is late by at most one tick |
//! | `kv_lease_max_hold` | off | ceiling on how long heartbeats can keep one lease alive, whole seconds (`600` or `600.0`) |
//! | `kv_lease_max_pin` | 480 | longest a lease may stay assigned but not started (its prefill running) before the ranks let it go, seconds (any positive number); the safety net for an engine that aborts a request without cancelling its lease |
//! | `kv_lease_max_tracked_requests` | 65,536 | requests D heartbeats at once (waiting ones included) |
//! | `kv_lease_max_remote_engines` | 64 | distinct P engines D heartbeats at once |
//! | `kv_lease_max_peers` | 256 | P ranks one D worker checks against at once (1..=4096; 8 KiB of landing window each) |
//! | `kv_lease_max_fan_out` | 16 | most P ranks one D rank reads from, heartbeats and verifies for one request (P TP / D TP × P PP), 1..=64; the sender and the verifier both take this one number |
//! | `kv_lease_turn2_safety_margin` | 5 | P declines a turn-2 read this close to D's deadline (plus the clock bound), seconds (any positive number); vLLM's `_KV_BLOCKS_EXPIRY_SAFETY_MARGIN` |
//! | `kv_lease_clock_drift_ppm` | 100 | how fast P assumes two hosts' clocks drift apart, ppm (0..=1,000,000): a clock sample's bound grows by this much of its age |
//! | `kv_lease_push_write_bound` | 10 | push mode: the longest a posted WRITE may stay in flight, seconds (any positive number) |
//! | `kv_lease_push_capacity` | 1,024 | push mode: registrations one worker holds at once (D: permits; P: registrations), 1..=2^30 |
//!
//! The first four are vLLM's names and meanings; the rest are ours and carry
//! the `kv_lease_` prefix.
//!
//! # Durations as vLLM reads them
//!
//! vLLM uses `kv_lease_duration` and `decoder_kv_blocks_ttl` as given, so a
//! JSON float (`30.0`, `3e1`, `45.5`) works there and works here. The initial
//! lease is the exact value (45.5 s); the heartbeat interval and the extension
//! are derived exactly as vLLM derives them with Python's floor division on
//! the number, which gives whole seconds: `interval = duration // 6`,
//! `extension = duration * 2 // 3` (45.5 gives 7 s and 30 s): one rule,
//! [`heartbeat_interval_of`] and [`lease_extension_of`], which push mode's
//! permits take too (`PushConfig::from_lease_config` in the `push` module
//! reads them and the two push keys). A float is
//! taken to the nanosecond rounding *down*, which keeps both floors equal to
//! the floors of the number itself. A duration under 6 s would make the
//! interval 0 (a heartbeat every step), so it is an error rather than a
//! silent busy loop; zero, negative, NaN and infinite values are errors that
//! name the key (JSON has no NaN or Infinity, but Python's `json.dumps`
//! writes them, so the parser recognises those tokens to say which key holds
//! one). `kv_lease_max_hold` is ours and takes whole seconds; `600.0` is
//! accepted as 600, `600.5` is refused.
//!
//! # Errors and unknown keys
//!
//! A bad value is a [`ConfigError`] that names the key and quotes the value.
//! A key this crate does not know is not an error (the same object carries
//! the rest of the connector's settings) but it is never silently dropped
//! either: [`ParsedConfig::unknown_keys`] lists every one, and the engine
//! should log them, since a misspelt `kv_lease_duraton` would otherwise leave
//! the default in force unnoticed.
//!
//! ```
//! use kvlease::{EngineShape, LeaseConfig};
//! use std::time::Duration;
//!
//! let shape = EngineShape { num_kv_blocks: 4096, max_num_seqs: 256 };
//! let parsed = LeaseConfig::from_extra_config_json(
//!     r#"{"kv_lease_duration": 60, "backends": ["UCX"]}"#,
//!     shape,
//! )?;
//! assert_eq!(parsed.config.heartbeat_interval(), Duration::from_secs(10));
//! assert_eq!(parsed.config.lease_extension(), Duration::from_secs(40));
//! assert_eq!(parsed.config.lease_slots, 4096 + 256);
//! assert_eq!(parsed.unknown_keys, vec!["backends".to_string()]);
//!
//! let err = LeaseConfig::from_extra_config_json(r#"{"kv_lease_duration": 5}"#, shape)
//!     .unwrap_err();
//! assert!(err.to_string().contains("kv_lease_duration"));
//! # Ok::<(), kvlease::ConfigError>(())
//! ```

use core::time::Duration;

use serde_json::Value;

/// The engine facts that some defaults derive from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineShape {
    /// KV blocks in the engine's cache (vLLM's `num_gpu_blocks`).
    pub num_kv_blocks: u32,
    /// Most sequences scheduled at once (vLLM's `max_num_seqs`).
    pub max_num_seqs: u32,
}

/// Every setting and capacity of the lease machinery. Build it with
/// [`LeaseConfig::new`] or [`LeaseConfig::from_extra_config_json`]; a value
/// built by hand should go through [`LeaseConfig::validate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    /// `kv_lease_duration`: initial lease on P. Not necessarily whole
    /// seconds (vLLM accepts `45.5`); the derived interval and extension are.
    pub lease_duration: Duration,
    /// `decoder_kv_blocks_ttl`: TTL of blocks cached on D.
    pub decoder_kv_blocks_ttl: Duration,
    /// `kv_lease_verification`: grant leases with a slot and nonce, and have
    /// D check them after its READ.
    pub verification: bool,
    /// `kv_lease_require_verification`: D fails a load from a P that
    /// advertises no lease slots (a stock P) as well, instead of using it
    /// unverified. Off by default so that a D upgraded before its P's keeps
    /// serving during a rolling upgrade; needs `verification`.
    pub require_verification: bool,
    /// `kv_lease_slots`: lease slots each P worker exports.
    pub lease_slots: u32,
    /// `kv_lease_capacity`: leases one lease book holds at once.
    pub lease_capacity: u32,
    /// `kv_lease_max_request_id_len`: longest request id in bytes.
    pub max_request_id_len: u16,
    /// `kv_lease_wheel_tick_ms`: timer-wheel resolution in milliseconds.
    pub wheel_tick_ms: u32,
    /// `kv_lease_max_hold`: heartbeats cannot keep a lease past
    /// grant + this many seconds. `None`: no ceiling (vLLM's behaviour).
    pub max_hold_secs: Option<u64>,
    /// `kv_lease_max_pin`: a lease assigned at the start of its prefill and
    /// not started within this long is let go by every rank (reason
    /// `Expired`), so an aborted request whose engine never called
    /// `cancel` does not keep its entry and slot forever. 480 s, vLLM's
    /// old `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`: no prefill runs that long.
    pub max_pin: Duration,
    /// `kv_lease_max_tracked_requests`: requests D heartbeats at once,
    /// [`DEFAULT_MAX_TRACKED_REQUESTS`] unless set.
    pub max_tracked_requests: u32,
    /// `kv_lease_max_remote_engines`: P engines D heartbeats at once.
    pub max_remote_engines: u32,
    /// `kv_lease_max_peers`: P ranks (remote agents) one D worker checks
    /// against at once, [`DEFAULT_MAX_PEERS`] unless set. The engine lets
    /// idle ones go to make room for new ones.
    pub max_peers: u32,
    /// `kv_lease_max_fan_out`: most P ranks one D rank reads from for one
    /// request (`P TP / D TP` when P's TP is larger, times P's PP size). The
    /// heartbeat sender and the lease verifier are sized by this one number;
    /// a remote engine beyond it is refused by both alike.
    pub max_fan_out: u32,
    /// `kv_lease_turn2_safety_margin`: P declines a turn-2 read that would
    /// start this close to D's deadline (plus the clock bound).
    pub turn2_safety_margin: Duration,
    /// `kv_lease_clock_drift_ppm`: the drift allowance of clock samples.
    pub clock_drift_ppm: u32,
    /// `kv_lease_push_write_bound`: push mode's longest WRITE in flight
    /// (the guard's `write_bound`).
    pub push_write_bound: Duration,
    /// `kv_lease_push_capacity`: push mode's registrations per worker (the
    /// guard's `capacity`).
    pub push_capacity: u32,
}

/// How often D heartbeats under a lease of `duration`: `duration // 6` in
/// whole seconds, Python's floor division as vLLM computes it. The one rule
/// for the pull side's heartbeats and push mode's `PHB:`/`PRV:`.
pub fn heartbeat_interval_of(duration: Duration) -> Duration {
    // u128 nanoseconds: exact, and no Duration (even Duration::MAX) can overflow it.
    floor_secs(duration.as_nanos(), 6)
}

/// How far a heartbeat moves a deadline past `now` under a lease of
/// `duration`: `duration * 2 // 3` in whole seconds, as vLLM computes it.
/// The one rule for the pull side's leases and push mode's permits.
pub fn lease_extension_of(duration: Duration) -> Duration {
    // Duration::MAX is under 2^64 * 10^9 < 2^94 ns, so doubling fits in u128.
    floor_secs(duration.as_nanos() * 2, 3)
}

/// Default `kv_lease_max_tracked_requests`: how many requests D heartbeats
/// at once.
///
/// Not derived from the engine: D starts heartbeating a request when it
/// *arrives* (vLLM's `on_new_request`), a waiting request holds no KV block
/// on D, and vLLM's waiting queue is unbounded, so D's blocks + max_num_seqs
/// (1,088 on a small engine) is no bound on what it must track. 65,536 covers
/// a deep queue toward several P engines; the tracker reserves about 383
/// bytes per request with 128-byte ids (25.2 MB in all; 191 bytes per request
/// when `kv_lease_max_request_id_len` <= 64), measured in
/// `tests/consumer_alloc.rs`. A request beyond it is refused with
/// [`crate::consumer::TrackError::RequestsFull`] and counted in
/// [`crate::consumer::TrackerCounters::not_heartbeated`].
pub const DEFAULT_MAX_TRACKED_REQUESTS: u32 = 1 << 16;

/// Default `kv_lease_max_peers`: 256 P ranks checked by one D worker at once
/// (32 P engines of TP 8), 2 MiB of landing windows.
pub const DEFAULT_MAX_PEERS: u32 = 256;

/// Default `kv_lease_max_fan_out`: P TP 16 read by D TP 1, or P TP 4 × PP 4.
pub const DEFAULT_MAX_FAN_OUT: u32 = 16;

/// Upper limits on capacities, so that a typo cannot ask for terabytes at
/// construction. Each is far above any engine we know of.
pub mod limits {
    /// Most leases (and slots, and tracked requests) one structure holds.
    pub const MAX_CAPACITY: u32 = 1 << 26;
    /// Longest request id we store inline.
    pub const MAX_REQUEST_ID_LEN: u16 = 1024;
    /// Most remote engines one decoder heartbeats.
    pub const MAX_REMOTE_ENGINES: u32 = 1 << 16;
    /// Most P ranks one D worker checks against at once
    /// (`kv_lease_max_peers`): the verifier keeps an 8 KiB landing window
    /// per peer, 32 MiB at this limit.
    pub const MAX_PEERS: u32 = 4096;
    /// Most P ranks one D rank reads from for one request
    /// (`kv_lease_max_fan_out`): a check's pending ranks are one `u64` mask.
    pub const MAX_FAN_OUT: u32 = 64;
    /// Coarsest wheel tick: one second.
    pub const MAX_WHEEL_TICK_MS: u32 = 1000;
    /// Shortest lease: anything shorter makes vLLM's interval `duration // 6` zero.
    pub const MIN_LEASE_DURATION_SECS: u64 = 6;
    /// Longest duration setting: 10 years keeps every deadline far from overflow.
    pub const MAX_DURATION_SECS: u64 = 10 * 365 * 24 * 3600;
}

/// The result of parsing: the configuration and the keys it did not know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedConfig {
    /// The validated configuration.
    pub config: LeaseConfig,
    /// Keys of the object that are not kvlease settings, sorted.
    /// Log them: a misspelt key leaves its default in force.
    pub unknown_keys: Vec<String>,
}

/// Why a configuration was refused. Every variant names the key at fault.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The text is not JSON at all.
    #[error("kv_connector_extra_config is not valid JSON: {message}")]
    Json {
        /// serde_json's message, with line and column.
        message: String,
    },
    /// The JSON is valid but not an object (or its `kv_connector_extra_config` is not).
    #[error("kv_connector_extra_config must be a JSON object, found {found}")]
    NotAnObject {
        /// What was found instead, e.g. `array`.
        found: &'static str,
    },
    /// A key holds a value of the wrong JSON type.
    #[error("{key} must be {expected}, got {value}")]
    WrongType {
        /// The key.
        key: &'static str,
        /// What the key takes.
        expected: &'static str,
        /// The value as it appeared in the input.
        value: String,
    },
    /// A key holds a value of the right type but outside its range.
    #[error("{key} = {value} is out of range: {rule}")]
    OutOfRange {
        /// The key.
        key: &'static str,
        /// The value as it appeared in the input.
        value: String,
        /// The rule it breaks.
        rule: &'static str,
    },
}

/// The keys this crate reads.
const KNOWN_KEYS: &[&str] = &[
    "kv_lease_duration",
    "decoder_kv_blocks_ttl",
    "kv_lease_verification",
    "kv_lease_require_verification",
    "kv_lease_slots",
    "kv_lease_capacity",
    "kv_lease_max_request_id_len",
    "kv_lease_wheel_tick_ms",
    "kv_lease_max_hold",
    "kv_lease_max_pin",
    "kv_lease_max_tracked_requests",
    "kv_lease_max_remote_engines",
    "kv_lease_max_peers",
    "kv_lease_max_fan_out",
    "kv_lease_turn2_safety_margin",
    "kv_lease_clock_drift_ppm",
    "kv_lease_push_write_bound",
    "kv_lease_push_capacity",
];

impl LeaseConfig {
    /// vLLM's defaults, with slot and lease capacities derived from the engine
    /// (`kv_lease_slots` = KV blocks + max_num_seqs: every request holds at
    /// least one block, plus one per running sequence of slack). Saturates at
    /// [`limits::MAX_CAPACITY`]; a zero shape yields a config that
    /// [`LeaseConfig::validate`] refuses.
    pub fn new(shape: EngineShape) -> LeaseConfig {
        let slots = shape
            .num_kv_blocks
            .saturating_add(shape.max_num_seqs)
            .min(limits::MAX_CAPACITY);
        LeaseConfig {
            lease_duration: Duration::from_secs(30),
            decoder_kv_blocks_ttl: Duration::from_secs(480),
            verification: true,
            require_verification: false,
            lease_slots: slots,
            lease_capacity: slots,
            max_request_id_len: 128,
            wheel_tick_ms: 10,
            max_hold_secs: None,
            max_pin: Duration::from_secs(480),
            max_tracked_requests: DEFAULT_MAX_TRACKED_REQUESTS,
            max_remote_engines: 64,
            max_peers: DEFAULT_MAX_PEERS,
            max_fan_out: DEFAULT_MAX_FAN_OUT,
            turn2_safety_margin: Duration::from_secs(5),
            clock_drift_ppm: 100,
            push_write_bound: Duration::from_secs(10),
            push_capacity: 1024,
        }
    }

    /// The initial lease P grants: `kv_lease_duration` exactly.
    pub fn lease_duration(&self) -> Duration {
        self.lease_duration
    }

    /// How often D heartbeats an engine: `duration // 6` (vLLM's floor
    /// division, whole seconds), 5 s by default.
    pub fn heartbeat_interval(&self) -> Duration {
        heartbeat_interval_of(self.lease_duration)
    }

    /// How far a heartbeat pushes the expiry past `now`: `duration * 2 // 3`
    /// (vLLM's floor division, whole seconds), 20 s by default.
    pub fn lease_extension(&self) -> Duration {
        lease_extension_of(self.lease_duration)
    }

    /// The TTL of blocks cached on D in bidirectional mode.
    pub fn decoder_kv_blocks_ttl(&self) -> Duration {
        self.decoder_kv_blocks_ttl
    }

    /// The settings of P's clock-offset estimators (bidirectional mode):
    /// `kv_lease_turn2_safety_margin` and `kv_lease_clock_drift_ppm`.
    pub fn clock_offset_config(&self) -> crate::clock_offset::ClockOffsetConfig {
        crate::clock_offset::ClockOffsetConfig {
            safety_margin: self.turn2_safety_margin,
            drift_ppm: self.clock_drift_ppm,
            ..crate::clock_offset::ClockOffsetConfig::default()
        }
    }

    /// The ceiling on one lease's life under heartbeats, if any.
    pub fn max_hold(&self) -> Option<Duration> {
        self.max_hold_secs.map(Duration::from_secs)
    }

    /// The timer-wheel tick.
    pub fn wheel_tick(&self) -> Duration {
        Duration::from_millis(u64::from(self.wheel_tick_ms))
    }

    /// Checks every value against its documented range. A hand-built value
    /// with an absurd duration (say `Duration::MAX`) is refused here; the
    /// accessors above saturate rather than overflow, so even an unvalidated
    /// config cannot make them panic.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn range(
            key: &'static str,
            v: u64,
            lo: u64,
            hi: u64,
            rule: &'static str,
        ) -> Result<(), ConfigError> {
            if v < lo || v > hi {
                return Err(ConfigError::OutOfRange {
                    key,
                    value: v.to_string(),
                    rule,
                });
            }
            Ok(())
        }
        fn duration_range(
            key: &'static str,
            v: Duration,
            lo: Duration,
            rule: &'static str,
        ) -> Result<(), ConfigError> {
            if v < lo || v > Duration::from_secs(limits::MAX_DURATION_SECS) {
                return Err(ConfigError::OutOfRange {
                    key,
                    value: secs_text(v),
                    rule,
                });
            }
            Ok(())
        }
        use limits::*;
        let cap = u64::from(MAX_CAPACITY);
        duration_range(
            "kv_lease_duration",
            self.lease_duration,
            Duration::from_secs(MIN_LEASE_DURATION_SECS),
            RULE_LEASE_DURATION,
        )?;
        duration_range(
            "decoder_kv_blocks_ttl",
            self.decoder_kv_blocks_ttl,
            Duration::from_nanos(1),
            RULE_TTL,
        )?;
        duration_range(
            "kv_lease_max_pin",
            self.max_pin,
            Duration::from_nanos(1),
            RULE_TTL,
        )?;
        duration_range(
            "kv_lease_turn2_safety_margin",
            self.turn2_safety_margin,
            Duration::from_nanos(1),
            RULE_MARGIN,
        )?;
        range(
            "kv_lease_clock_drift_ppm",
            u64::from(self.clock_drift_ppm),
            0,
            1_000_000,
            "must be 0..=1000000",
        )?;
        range(
            "kv_lease_slots",
            u64::from(self.lease_slots),
            1,
            cap,
            "must be 1..=67108864",
        )?;
        range(
            "kv_lease_capacity",
            u64::from(self.lease_capacity),
            1,
            cap,
            "must be 1..=67108864",
        )?;
        range(
            "kv_lease_max_request_id_len",
            u64::from(self.max_request_id_len),
            1,
            u64::from(MAX_REQUEST_ID_LEN),
            "must be 1..=1024 bytes",
        )?;
        range(
            "kv_lease_wheel_tick_ms",
            u64::from(self.wheel_tick_ms),
            1,
            u64::from(MAX_WHEEL_TICK_MS),
            "must be 1..=1000 ms",
        )?;
        if let Some(h) = self.max_hold_secs {
            // Compared as durations: kv_lease_duration may have a fraction (45.5 s).
            duration_range(
                "kv_lease_max_hold",
                Duration::from_secs(h),
                self.lease_duration,
                "must be at least kv_lease_duration and at most 315360000 seconds",
            )?;
        }
        range(
            "kv_lease_max_tracked_requests",
            u64::from(self.max_tracked_requests),
            1,
            cap,
            "must be 1..=67108864",
        )?;
        range(
            "kv_lease_max_remote_engines",
            u64::from(self.max_remote_engines),
            1,
            u64::from(MAX_REMOTE_ENGINES),
            "must be 1..=65536",
        )?;
        range(
            "kv_lease_max_peers",
            u64::from(self.max_peers),
            1,
            u64::from(MAX_PEERS),
            "must be 1..=4096 P ranks per D worker",
        )?;
        if self.require_verification && !self.verification {
            // Nothing would be verified, so nothing could be required: the
            // operator asked for two opposite things.
            return Err(ConfigError::OutOfRange {
                key: "kv_lease_require_verification",
                value: "true".to_string(),
                rule: "needs kv_lease_verification: true",
            });
        }
        range(
            "kv_lease_max_fan_out",
            u64::from(self.max_fan_out),
            1,
            u64::from(MAX_FAN_OUT),
            "must be 1..=64 P ranks per D rank",
        )?;
        duration_range(
            "kv_lease_push_write_bound",
            self.push_write_bound,
            Duration::from_nanos(1),
            RULE_TTL,
        )?;
        range(
            "kv_lease_push_capacity",
            u64::from(self.push_capacity),
            1,
            1 << 30,
            "must be 1..=1073741824",
        )?;
        Ok(())
    }
}

mod parse;
use parse::*;

#[cfg(test)]
mod tests;
