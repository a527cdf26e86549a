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
//! | `kv_lease_capacity` | `kv_lease_slots` | leases one P lease book can hold at once |
//! | `kv_lease_max_request_id_len` | 128 | longest request id, in bytes (ids are stored inline) |
//! | `kv_lease_wheel_tick_ms` | 10 | timer-wheel resolution: expiry is late by at most one tick |
//! | `kv_lease_max_hold` | off | ceiling on how long heartbeats can keep one lease alive, whole seconds (`600` or `600.0`) |
//! | `kv_lease_max_tracked_requests` | 65,536 | requests D heartbeats at once (waiting ones included) |
//! | `kv_lease_max_remote_engines` | 64 | distinct P engines D heartbeats at once |
//! | `kv_lease_turn2_safety_margin` | 5 | P declines a turn-2 read this close to D's deadline (plus the clock bound), seconds (any positive number); vLLM's `_KV_BLOCKS_EXPIRY_SAFETY_MARGIN` |
//! | `kv_lease_clock_drift_ppm` | 100 | how fast P assumes two hosts' clocks drift apart, ppm (0..=1,000,000): a clock sample's bound grows by this much of its age |
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
//! `extension = duration * 2 // 3` (45.5 gives 7 s and 30 s). A float is
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

use core::fmt;
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
    /// `kv_lease_max_tracked_requests`: requests D heartbeats at once,
    /// [`DEFAULT_MAX_TRACKED_REQUESTS`] unless set.
    pub max_tracked_requests: u32,
    /// `kv_lease_max_remote_engines`: P engines D heartbeats at once.
    pub max_remote_engines: u32,
    /// `kv_lease_turn2_safety_margin`: P declines a turn-2 read that would
    /// start this close to D's deadline (plus the clock bound).
    pub turn2_safety_margin: Duration,
    /// `kv_lease_clock_drift_ppm`: the drift allowance of clock samples.
    pub clock_drift_ppm: u32,
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

/// Upper limits on capacities, so that a typo cannot ask for terabytes at
/// construction. Each is far above any engine we know of.
pub mod limits {
    /// Most leases (and slots, and tracked requests) one structure holds.
    pub const MAX_CAPACITY: u32 = 1 << 26;
    /// Longest request id we store inline.
    pub const MAX_REQUEST_ID_LEN: u16 = 1024;
    /// Most remote engines one decoder heartbeats.
    pub const MAX_REMOTE_ENGINES: u32 = 1 << 16;
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
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigError {
    /// The text is not JSON at all.
    Json {
        /// serde_json's message, with line and column.
        message: String,
    },
    /// The JSON is valid but not an object (or its `kv_connector_extra_config` is not).
    NotAnObject {
        /// What was found instead, e.g. `array`.
        found: &'static str,
    },
    /// A key holds a value of the wrong JSON type.
    WrongType {
        /// The key.
        key: &'static str,
        /// What the key takes.
        expected: &'static str,
        /// The value as it appeared in the input.
        value: String,
    },
    /// A key holds a value of the right type but outside its range.
    OutOfRange {
        /// The key.
        key: &'static str,
        /// The value as it appeared in the input.
        value: String,
        /// The rule it breaks.
        rule: &'static str,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Json { message } => {
                write!(f, "kv_connector_extra_config is not valid JSON: {message}")
            }
            ConfigError::NotAnObject { found } => {
                write!(
                    f,
                    "kv_connector_extra_config must be a JSON object, found {found}"
                )
            }
            ConfigError::WrongType {
                key,
                expected,
                value,
            } => {
                write!(f, "{key} must be {expected}, got {value}")
            }
            ConfigError::OutOfRange { key, value, rule } => {
                write!(f, "{key} = {value} is out of range: {rule}")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// The keys this crate reads.
const KNOWN_KEYS: &[&str] = &[
    "kv_lease_duration",
    "decoder_kv_blocks_ttl",
    "kv_lease_verification",
    "kv_lease_slots",
    "kv_lease_capacity",
    "kv_lease_max_request_id_len",
    "kv_lease_wheel_tick_ms",
    "kv_lease_max_hold",
    "kv_lease_max_tracked_requests",
    "kv_lease_max_remote_engines",
    "kv_lease_turn2_safety_margin",
    "kv_lease_clock_drift_ppm",
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
            lease_slots: slots,
            lease_capacity: slots,
            max_request_id_len: 128,
            wheel_tick_ms: 10,
            max_hold_secs: None,
            max_tracked_requests: DEFAULT_MAX_TRACKED_REQUESTS,
            max_remote_engines: 64,
            turn2_safety_margin: Duration::from_secs(5),
            clock_drift_ppm: 100,
        }
    }

    /// The initial lease P grants: `kv_lease_duration` exactly.
    pub fn lease_duration(&self) -> Duration {
        self.lease_duration
    }

    /// How often D heartbeats an engine: `duration // 6` (vLLM's floor
    /// division, whole seconds), 5 s by default.
    pub fn heartbeat_interval(&self) -> Duration {
        // u128 nanoseconds: exact, and no Duration (even Duration::MAX) can overflow it.
        floor_secs(self.lease_duration.as_nanos(), 6)
    }

    /// How far a heartbeat pushes the expiry past `now`: `duration * 2 // 3`
    /// (vLLM's floor division, whole seconds), 20 s by default.
    pub fn lease_extension(&self) -> Duration {
        // Duration::MAX is under 2^64 * 10^9 < 2^94 ns, so doubling fits in u128.
        floor_secs(self.lease_duration.as_nanos() * 2, 3)
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
        Ok(())
    }

    /// Parses `kv_connector_extra_config` (or a whole `--kv-transfer-config`
    /// object, whose `kv_connector_extra_config` member is then used) on top
    /// of [`LeaseConfig::new`]'s defaults, and validates the result.
    pub fn from_extra_config_json(
        json: &str,
        shape: EngineShape,
    ) -> Result<ParsedConfig, ConfigError> {
        let value: Value = serde_json::from_str(json).map_err(|e| {
            // serde_json refuses Python's NaN / Infinity tokens as a syntax error at a
            // column; say which of our keys holds one instead.
            non_finite_value(json).unwrap_or_else(|| ConfigError::Json {
                message: e.to_string(),
            })
        })?;
        LeaseConfig::from_extra_config_value(&value, shape)
    }

    /// As [`LeaseConfig::from_extra_config_json`], from a parsed JSON value.
    pub fn from_extra_config_value(
        value: &Value,
        shape: EngineShape,
    ) -> Result<ParsedConfig, ConfigError> {
        let mut obj = value.as_object().ok_or(ConfigError::NotAnObject {
            found: json_kind(value),
        })?;
        if let Some(inner) = obj.get("kv_connector_extra_config") {
            obj = inner.as_object().ok_or(ConfigError::NotAnObject {
                found: json_kind(inner),
            })?;
        }
        LeaseConfig::from_entries(obj, shape)
    }

    /// Applies the (key, value) pairs of a `kv_connector_extra_config`
    /// object, in whatever order the map yields them.
    fn from_entries<'a>(
        entries: impl IntoIterator<Item = (&'a String, &'a Value)>,
        shape: EngineShape,
    ) -> Result<ParsedConfig, ConfigError> {
        let mut c = LeaseConfig::new(shape);
        let mut capacity_set = false;
        let mut unknown_keys = Vec::new();
        for (key, v) in entries {
            match key.as_str() {
                "kv_lease_duration" => {
                    c.lease_duration = secs(
                        "kv_lease_duration",
                        v,
                        limits::MIN_LEASE_DURATION_SECS as f64,
                        RULE_LEASE_DURATION,
                    )?
                }
                "decoder_kv_blocks_ttl" => {
                    c.decoder_kv_blocks_ttl = secs("decoder_kv_blocks_ttl", v, 0.0, RULE_TTL)?
                }
                "kv_lease_verification" => {
                    c.verification = v
                        .as_bool()
                        .ok_or_else(|| wrong("kv_lease_verification", "true or false", v))?
                }
                "kv_lease_slots" => c.lease_slots = u32_key("kv_lease_slots", v)?,
                "kv_lease_capacity" => {
                    c.lease_capacity = u32_key("kv_lease_capacity", v)?;
                    capacity_set = true;
                }
                "kv_lease_max_request_id_len" => {
                    let n = uint("kv_lease_max_request_id_len", v)?;
                    c.max_request_id_len =
                        u16::try_from(n).map_err(|_| too_big("kv_lease_max_request_id_len", v))?;
                }
                "kv_lease_wheel_tick_ms" => c.wheel_tick_ms = u32_key("kv_lease_wheel_tick_ms", v)?,
                "kv_lease_max_hold" => {
                    c.max_hold_secs = if v.is_null() {
                        None
                    } else {
                        Some(whole_secs("kv_lease_max_hold", v)?)
                    }
                }
                "kv_lease_max_tracked_requests" => {
                    c.max_tracked_requests = u32_key("kv_lease_max_tracked_requests", v)?
                }
                "kv_lease_max_remote_engines" => {
                    c.max_remote_engines = u32_key("kv_lease_max_remote_engines", v)?
                }
                "kv_lease_turn2_safety_margin" => {
                    c.turn2_safety_margin =
                        secs("kv_lease_turn2_safety_margin", v, 0.0, RULE_MARGIN)?
                }
                "kv_lease_clock_drift_ppm" => {
                    c.clock_drift_ppm = u32_key("kv_lease_clock_drift_ppm", v)?
                }
                other => unknown_keys.push(other.to_string()),
            }
        }
        // Capacities that default to the slot count follow an explicit kv_lease_slots.
        if !capacity_set {
            c.lease_capacity = c.lease_slots;
        }
        debug_assert!(unknown_keys
            .iter()
            .all(|k| !KNOWN_KEYS.contains(&k.as_str())));
        // Sorted here, not by the map: serde_json's map is a BTreeMap only
        // until some crate in the build enables its `preserve_order` feature
        // (features unify), and the documented order must not hinge on that.
        unknown_keys.sort_unstable();
        c.validate()?;
        Ok(ParsedConfig {
            config: c,
            unknown_keys,
        })
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong(key: &'static str, expected: &'static str, v: &Value) -> ConfigError {
    ConfigError::WrongType {
        key,
        expected,
        value: v.to_string(),
    }
}

fn too_big(key: &'static str, v: &Value) -> ConfigError {
    ConfigError::OutOfRange {
        key,
        value: v.to_string(),
        rule: "too large",
    }
}

/// A non-negative whole number (vLLM's durations are integer seconds).
fn uint(key: &'static str, v: &Value) -> Result<u64, ConfigError> {
    if let Some(n) = v.as_u64() {
        return Ok(n);
    }
    if v.as_i64().is_some() || v.as_f64().is_some_and(|f| f < 0.0) {
        return Err(ConfigError::OutOfRange {
            key,
            value: v.to_string(),
            rule: "must not be negative",
        });
    }
    Err(wrong(key, "a non-negative integer", v))
}

fn u32_key(key: &'static str, v: &Value) -> Result<u32, ConfigError> {
    u32::try_from(uint(key, v)?).map_err(|_| too_big(key, v))
}

const RULE_LEASE_DURATION: &str =
    "must be 6..=315360000 seconds (under 6 the heartbeat interval duration // 6 is 0)";
const RULE_TTL: &str = "must be more than 0 and at most 315360000 seconds";
const RULE_MARGIN: &str = RULE_TTL;

/// A duration in seconds as vLLM takes it: any JSON number (`30`, `30.0`,
/// `3e1`, `45.5`) that is at least `min` (and more than 0), at most
/// [`limits::MAX_DURATION_SECS`].
fn secs(
    key: &'static str,
    v: &Value,
    min: f64,
    rule: &'static str,
) -> Result<Duration, ConfigError> {
    let out = |rule| ConfigError::OutOfRange {
        key,
        value: v.to_string(),
        rule,
    };
    // u64 first: exact for integers past 2^53, where f64 would round.
    let f = match (v.as_u64(), v.as_f64()) {
        (Some(n), _) => n as f64,
        (None, Some(f)) => f,
        (None, None) => return Err(wrong(key, "a number of seconds", v)),
    };
    // serde_json never yields NaN or infinities, but a Value built by hand
    // (from_extra_config_value) is not ours to trust.
    if !f.is_finite() {
        return Err(out("must be a finite number of seconds"));
    }
    if f < 0.0 || (f == 0.0 && f.is_sign_negative()) {
        return Err(out("must not be negative"));
    }
    if f == 0.0 {
        return Err(out("must be more than 0 seconds"));
    }
    if f < min || f > limits::MAX_DURATION_SECS as f64 {
        return Err(out(rule));
    }
    if let Some(n) = v.as_u64() {
        return Ok(Duration::from_secs(n));
    }
    Ok(duration_floor_from_secs_f64(f))
}

/// Whole seconds (ours, not vLLM's): a non-negative integer, or a float with
/// no fraction (`600.0`, `6e2`), which JSON writers produce for integers.
fn whole_secs(key: &'static str, v: &Value) -> Result<u64, ConfigError> {
    if v.as_f64() == Some(0.0) {
        // Quote the input (`0.0`, `-0.0`) rather than let validate() quote `0`.
        return Err(ConfigError::OutOfRange {
            key,
            value: v.to_string(),
            rule: "must be more than 0 seconds",
        });
    }
    if let Some(n) = v.as_u64() {
        return Ok(n);
    }
    match v.as_f64() {
        Some(f) if f.is_finite() && f >= 0.0 && f.fract() == 0.0 => {
            if f > limits::MAX_DURATION_SECS as f64 {
                return Err(too_big(key, v));
            }
            // Whole and in range, so the cast is exact.
            Ok(f as u64)
        }
        Some(f) if f.is_finite() && f >= 0.0 => Err(ConfigError::OutOfRange {
            key,
            value: v.to_string(),
            rule: "must be whole seconds",
        }),
        _ => uint(key, v),
    }
}

/// `secs` seconds as a [`Duration`], rounded *down* to the nanosecond: then
/// `floor(d / 6 s)` and `floor(d * 2 / 3 s)` equal Python's `secs // 6` and
/// `secs * 2 // 3` (a floor of a floor by a whole divisor is the floor, and
/// `2 * floor(x)` can only miss `floor(2x)` by an odd count of nanoseconds,
/// never a multiple of 3 s). `Duration::from_secs_f64` rounds to nearest,
/// which could lift 5.9999999999 s to 6 s. Callers pass a finite
/// `0 <= secs <= MAX_DURATION_SECS`.
fn duration_floor_from_secs_f64(secs: f64) -> Duration {
    let whole = secs.trunc();
    // `secs - whole` is exact; the product can round up to 1e9 only for a
    // fraction within 1e-16 of 1, which a value of at least 1 s cannot hold.
    let nanos = ((secs - whole) * 1e9).floor().clamp(0.0, 999_999_999.0);
    Duration::new(whole as u64, nanos as u32)
}

/// `nanos / (div seconds)` rounded down to whole seconds, saturating.
fn floor_secs(nanos: u128, div: u128) -> Duration {
    let s = nanos / (div * 1_000_000_000);
    Duration::from_secs(u64::try_from(s).unwrap_or(u64::MAX))
}

/// A duration as seconds for an error message: `30`, `45.5`.
fn secs_text(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        return d.as_secs().to_string();
    }
    let frac = format!("{:09}", d.subsec_nanos());
    format!("{}.{}", d.as_secs(), frac.trim_end_matches('0'))
}

/// On a JSON syntax error: if one of our keys holds Python's `NaN`,
/// `Infinity` or `-Infinity` (which `json.dumps` writes and JSON lacks), the
/// error naming that key. A small scan outside strings; error path only.
fn non_finite_value(json: &str) -> Option<ConfigError> {
    let b = json.as_bytes();
    let mut i = 0;
    // The last string literal and whether only whitespace and one ':' followed it.
    let mut last_str: Option<(usize, usize)> = None;
    let mut colon_after = false;
    while i < b.len() {
        match b[i] {
            b'"' => {
                let start = i + 1;
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                last_str = Some((start, i.min(b.len())));
                colon_after = false;
            }
            b':' if last_str.is_some() && !colon_after => colon_after = true,
            c if c.is_ascii_whitespace() => {}
            _ => {
                let rest = &json[i..];
                let token = ["NaN", "Infinity", "-Infinity"]
                    .into_iter()
                    .find(|t| rest.starts_with(t));
                if let (Some(token), true, Some((s, e))) = (token, colon_after, last_str) {
                    // An unknown key with NaN is not ours to name: keep scanning.
                    if let Some(key) = KNOWN_KEYS.iter().find(|k| k.as_bytes() == &b[s..e]) {
                        return Some(ConfigError::OutOfRange {
                            key,
                            value: token.to_string(),
                            rule: "must be a finite number (JSON has no NaN or Infinity)",
                        });
                    }
                }
                last_str = None;
                colon_after = false;
            }
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: EngineShape = EngineShape {
        num_kv_blocks: 1000,
        max_num_seqs: 24,
    };

    fn parse(s: &str) -> Result<ParsedConfig, ConfigError> {
        LeaseConfig::from_extra_config_json(s, SHAPE)
    }

    #[test]
    fn defaults_match_vllm() {
        let c = parse("{}").unwrap().config;
        assert_eq!(c.lease_duration(), Duration::from_secs(30));
        assert_eq!(c.heartbeat_interval(), Duration::from_secs(5));
        assert_eq!(c.lease_extension(), Duration::from_secs(20));
        assert_eq!(c.decoder_kv_blocks_ttl(), Duration::from_secs(480));
        assert!(c.verification);
        assert_eq!(c.lease_slots, 1024);
        assert_eq!(c.lease_capacity, 1024);
        assert_eq!(c.max_hold(), None);
        assert_eq!(c.max_tracked_requests, DEFAULT_MAX_TRACKED_REQUESTS);
        // D's tracking capacity does not follow P's slots (waiting requests hold none).
        let c = parse(r#"{"kv_lease_slots": 7}"#).unwrap().config;
        assert_eq!(c.max_tracked_requests, 65_536);
        let c = parse(r#"{"kv_lease_max_tracked_requests": 9}"#)
            .unwrap()
            .config;
        assert_eq!(c.max_tracked_requests, 9);
    }

    #[test]
    fn derived_values_use_integer_division_like_vllm() {
        for (d, interval, ext) in [(6, 1, 4), (7, 1, 4), (11, 1, 7), (60, 10, 40), (61, 10, 40)] {
            let c = parse(&format!(r#"{{"kv_lease_duration": {d}}}"#))
                .unwrap()
                .config;
            assert_eq!(
                c.heartbeat_interval(),
                Duration::from_secs(interval),
                "duration {d}"
            );
            assert_eq!(
                c.lease_extension(),
                Duration::from_secs(ext),
                "duration {d}"
            );
        }
    }

    #[test]
    fn whole_transfer_config_is_accepted() {
        let p = parse(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer",
                "kv_connector_extra_config":{"kv_lease_duration":60,"kv_lease_slots":7}}"#,
        )
        .unwrap();
        assert_eq!(p.config.lease_duration, Duration::from_secs(60));
        assert_eq!(p.config.lease_slots, 7);
        assert_eq!(
            p.config.lease_capacity, 7,
            "capacity follows explicit slots"
        );
        assert!(p.unknown_keys.is_empty());
    }

    #[test]
    fn unknown_keys_are_reported_sorted() {
        let p = parse(r#"{"kv_lease_duraton": 60, "backends": ["UCX"]}"#).unwrap();
        assert_eq!(p.unknown_keys, ["backends", "kv_lease_duraton"]);
        assert_eq!(p.config.lease_duration, Duration::from_secs(30));
    }

    #[test]
    fn unknown_keys_are_sorted_whatever_the_map_order() {
        // The order serde_json's `preserve_order` would give: as written.
        let (z, a, m, d) = (
            "zeta".to_string(),
            "alpha".to_string(),
            "mu".to_string(),
            "kv_lease_duration".to_string(),
        );
        let (one, sixty) = (Value::from(1), Value::from(60));
        let p =
            LeaseConfig::from_entries([(&z, &one), (&d, &sixty), (&a, &one), (&m, &one)], SHAPE)
                .unwrap();
        assert_eq!(p.unknown_keys, ["alpha", "mu", "zeta"]);
        assert_eq!(p.config.lease_duration, Duration::from_secs(60));
    }

    #[test]
    fn bad_values_name_key_and_value() {
        let cases = [
            (r#"{"kv_lease_duration": 5}"#, "kv_lease_duration", "5"),
            (r#"{"kv_lease_duration": 0}"#, "kv_lease_duration", "0"),
            (r#"{"kv_lease_duration": -30}"#, "kv_lease_duration", "-30"),
            (
                r#"{"kv_lease_duration": "30"}"#,
                "kv_lease_duration",
                "\"30\"",
            ),
            (r#"{"kv_lease_duration": 5.5}"#, "kv_lease_duration", "5.5"),
            (
                r#"{"kv_lease_max_hold": 600.5}"#,
                "kv_lease_max_hold",
                "600.5",
            ),
            (
                r#"{"kv_lease_duration": true}"#,
                "kv_lease_duration",
                "true",
            ),
            (
                r#"{"kv_lease_verification": "yes"}"#,
                "kv_lease_verification",
                "\"yes\"",
            ),
            (r#"{"kv_lease_slots": 0}"#, "kv_lease_slots", "0"),
            (
                r#"{"kv_lease_slots": 99999999999}"#,
                "kv_lease_slots",
                "99999999999",
            ),
            (
                r#"{"decoder_kv_blocks_ttl": 0}"#,
                "decoder_kv_blocks_ttl",
                "0",
            ),
            (
                r#"{"kv_lease_max_request_id_len": 0}"#,
                "kv_lease_max_request_id_len",
                "0",
            ),
            (
                r#"{"kv_lease_max_request_id_len": 70000}"#,
                "kv_lease_max_request_id_len",
                "70000",
            ),
            (
                r#"{"kv_lease_wheel_tick_ms": 0}"#,
                "kv_lease_wheel_tick_ms",
                "0",
            ),
            (r#"{"kv_lease_max_hold": 10}"#, "kv_lease_max_hold", "10"),
            (
                r#"{"kv_lease_capacity": null}"#,
                "kv_lease_capacity",
                "null",
            ),
        ];
        for (input, key, value) in cases {
            let msg = parse(input).unwrap_err().to_string();
            assert!(msg.contains(key) && msg.contains(value), "{input}: {msg}");
        }
    }

    #[test]
    fn not_json_or_not_object_is_an_error() {
        assert!(matches!(parse("{"), Err(ConfigError::Json { .. })));
        assert_eq!(
            parse("[1]"),
            Err(ConfigError::NotAnObject { found: "an array" })
        );
        assert_eq!(
            parse(r#"{"kv_connector_extra_config": 3}"#),
            Err(ConfigError::NotAnObject { found: "a number" })
        );
    }

    #[test]
    fn zero_engine_shape_is_refused() {
        let c = LeaseConfig::new(EngineShape {
            num_kv_blocks: 0,
            max_num_seqs: 0,
        });
        assert!(matches!(
            c.validate(),
            Err(ConfigError::OutOfRange {
                key: "kv_lease_slots",
                ..
            })
        ));
    }

    #[test]
    fn max_hold_parses_and_null_turns_it_off() {
        assert_eq!(
            parse(r#"{"kv_lease_max_hold": 600}"#)
                .unwrap()
                .config
                .max_hold(),
            Some(Duration::from_secs(600))
        );
        assert_eq!(
            parse(r#"{"kv_lease_max_hold": null}"#)
                .unwrap()
                .config
                .max_hold(),
            None
        );
    }

    #[test]
    fn turn2_clock_settings_parse_and_feed_the_estimator() {
        let d = parse("{}").unwrap().config.clock_offset_config();
        assert_eq!(
            (d.safety_margin, d.drift_ppm),
            (Duration::from_secs(5), 100)
        );
        let c = parse(r#"{"kv_lease_turn2_safety_margin": 2.5, "kv_lease_clock_drift_ppm": 0}"#)
            .unwrap()
            .config
            .clock_offset_config();
        assert_eq!(
            (c.safety_margin, c.drift_ppm),
            (Duration::from_millis(2_500), 0)
        );
        for bad in [
            r#"{"kv_lease_turn2_safety_margin": 0}"#,
            r#"{"kv_lease_turn2_safety_margin": -1}"#,
            r#"{"kv_lease_turn2_safety_margin": "5"}"#,
            r#"{"kv_lease_clock_drift_ppm": 1000001}"#,
            r#"{"kv_lease_clock_drift_ppm": -3}"#,
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(
                e.contains("kv_lease_turn2_safety_margin")
                    || e.contains("kv_lease_clock_drift_ppm"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn config_accepts_float_durations_like_vllm() {
        // (input, lease, interval = d // 6, extension = d * 2 // 3), as Python computes them.
        for (d, lease_ms, interval, ext) in [
            ("30.0", 30_000, 5, 20),
            ("3e1", 30_000, 5, 20),
            ("45.5", 45_500, 7, 30),
            ("6.5", 6_500, 1, 4),
            ("11.99", 11_990, 1, 7),
            ("12.0", 12_000, 2, 8),
        ] {
            let c = parse(&format!(r#"{{"kv_lease_duration": {d}}}"#))
                .unwrap_or_else(|e| panic!("{d}: {e}"))
                .config;
            assert_eq!(c.lease_duration(), Duration::from_millis(lease_ms), "{d}");
            assert_eq!(c.heartbeat_interval(), Duration::from_secs(interval), "{d}");
            assert_eq!(c.lease_extension(), Duration::from_secs(ext), "{d}");
        }
        let c = parse(r#"{"decoder_kv_blocks_ttl": 480.25, "kv_lease_max_hold": 6e2}"#)
            .unwrap()
            .config;
        assert_eq!(c.decoder_kv_blocks_ttl(), Duration::from_millis(480_250));
        assert_eq!(c.max_hold(), Some(Duration::from_secs(600)));
        // Rounding down to the nanosecond: just under 6 s stays under the minimum.
        assert!(parse(r#"{"kv_lease_duration": 5.9999999999}"#).is_err());
        // A max_hold must cover the (fractional) lease it caps.
        assert!(parse(r#"{"kv_lease_duration": 45.5, "kv_lease_max_hold": 45}"#).is_err());
        assert!(parse(r#"{"kv_lease_duration": 45.5, "kv_lease_max_hold": 46}"#).is_ok());
    }

    #[test]
    fn config_refuses_nan_inf_zero_negative() {
        for key in [
            "kv_lease_duration",
            "decoder_kv_blocks_ttl",
            "kv_lease_max_hold",
        ] {
            for v in [
                "NaN",
                "Infinity",
                "-Infinity",
                "0",
                "0.0",
                "-0.0",
                "-1",
                "-30.5",
                "1e+300",
            ] {
                // Python's json.dumps writes NaN and Infinity; serde_json refuses the
                // syntax, and the error must still say which key.
                let input = format!(r#"{{"backends": ["UCX"], "{key}": {v}}}"#);
                let err = parse(&input).unwrap_err();
                let msg = err.to_string();
                assert!(
                    matches!(err, ConfigError::OutOfRange { key: k, .. } if k == key),
                    "{input}: {err:?}"
                );
                assert!(msg.contains(key) && msg.contains(v), "{input}: {msg}");
            }
        }
        // Not a known key: nothing to name, the JSON error stands.
        assert!(matches!(
            parse(r#"{"other": NaN}"#),
            Err(ConfigError::Json { .. })
        ));
        // A hand-built Value cannot hold NaN either, but the check does not rely on it.
        assert!(secs("kv_lease_duration", &Value::from(f64::NAN), 6.0, "").is_err());
    }

    #[test]
    fn hand_built_config_with_huge_duration_never_panics() {
        for huge in [
            Duration::MAX,
            Duration::from_secs(u64::MAX),
            Duration::from_secs(u64::MAX / 2 + 1),
        ] {
            let mut c = LeaseConfig::new(SHAPE);
            c.lease_duration = huge;
            c.decoder_kv_blocks_ttl = huge;
            c.max_hold_secs = Some(u64::MAX);
            assert_eq!(c.lease_duration(), huge);
            assert_eq!(c.heartbeat_interval().as_secs(), huge.as_secs() / 6);
            assert_eq!(
                u128::from(c.lease_extension().as_secs()),
                u128::from(huge.as_secs()) * 2 / 3
            );
            assert_eq!(c.max_hold(), Some(Duration::from_secs(u64::MAX)));
            assert!(matches!(
                c.validate(),
                Err(ConfigError::OutOfRange {
                    key: "kv_lease_duration",
                    ..
                })
            ));
            // An unvalidated config still drives both sides without a panic.
            let now = crate::Instant::from_secs(1);
            let mut book = crate::LeaseBook::new(&c, now);
            book.grant("req-a", now).unwrap();
            let _ = book.on_notification(0, b"HB:req-a", now);
            book.poll(crate::Instant::MAX);
            assert_eq!(
                book.held(),
                1,
                "a deadline past the end of time never fires"
            );
            let mut tracker = crate::consumer::HeartbeatTracker::new(&c);
            let params = crate::consumer::RemotePrefillParams {
                do_remote_prefill: true,
                remote_engine_id: Some("p0"),
                remote_request_id: Some("req-a"),
                remote_host: Some("p0.local"),
                remote_port: Some(5600),
                tp_size: Some(1),
                ..Default::default()
            };
            tracker.on_new_request("d-a", &params, now).unwrap();
            assert_eq!(tracker.due(now, |_| {}), 1);
            assert_eq!(tracker.due(crate::Instant::MAX, |_| {}), 1);
        }
    }
}
