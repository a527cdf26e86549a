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
//! | `kv_lease_duration` | 30 | initial lease on P, whole seconds, at least 6 |
//! | `decoder_kv_blocks_ttl` | 480 | fixed TTL of blocks cached on D (bidirectional mode), seconds |
//! | `kv_lease_verification` | `true` | D uses pulled KV only after verifying the lease slot |
//! | `kv_lease_slots` | KV blocks + max_num_seqs | lease slots exported by each P worker |
//! | `kv_lease_capacity` | `kv_lease_slots` | leases one P lease book can hold at once |
//! | `kv_lease_max_request_id_len` | 128 | longest request id, in bytes (ids are stored inline) |
//! | `kv_lease_wheel_tick_ms` | 10 | timer-wheel resolution: expiry is late by at most one tick |
//! | `kv_lease_max_hold` | off | ceiling on how long heartbeats can keep one lease alive, seconds |
//! | `kv_lease_max_tracked_requests` | `kv_lease_capacity` | requests D heartbeats at once |
//! | `kv_lease_max_remote_engines` | 64 | distinct P engines D heartbeats at once |
//!
//! The first four are vLLM's names and meanings; the rest are ours and carry
//! the `kv_lease_` prefix. The heartbeat interval and the extension are derived
//! exactly as vLLM derives them, in integer seconds:
//! `interval = duration // 6`, `extension = duration * 2 // 3`. A duration
//! under 6 s would make the interval 0 (a heartbeat every step), so it is an
//! error rather than a silent busy loop.
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
    /// `kv_lease_duration`: initial lease on P, whole seconds.
    pub lease_duration_secs: u64,
    /// `decoder_kv_blocks_ttl`: TTL of blocks cached on D, whole seconds.
    pub decoder_kv_blocks_ttl_secs: u64,
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
    /// `kv_lease_max_tracked_requests`: requests D heartbeats at once.
    pub max_tracked_requests: u32,
    /// `kv_lease_max_remote_engines`: P engines D heartbeats at once.
    pub max_remote_engines: u32,
}

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
            lease_duration_secs: 30,
            decoder_kv_blocks_ttl_secs: 480,
            verification: true,
            lease_slots: slots,
            lease_capacity: slots,
            max_request_id_len: 128,
            wheel_tick_ms: 10,
            max_hold_secs: None,
            max_tracked_requests: slots,
            max_remote_engines: 64,
        }
    }

    /// The initial lease P grants.
    pub fn lease_duration(&self) -> Duration {
        Duration::from_secs(self.lease_duration_secs)
    }

    /// How often D heartbeats an engine: `duration // 6` (vLLM), 5 s by default.
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_secs(self.lease_duration_secs / 6)
    }

    /// How far a heartbeat pushes the expiry past `now`: `duration * 2 // 3`
    /// (vLLM), 20 s by default.
    pub fn lease_extension(&self) -> Duration {
        Duration::from_secs(self.lease_duration_secs * 2 / 3)
    }

    /// The TTL of blocks cached on D in bidirectional mode.
    pub fn decoder_kv_blocks_ttl(&self) -> Duration {
        Duration::from_secs(self.decoder_kv_blocks_ttl_secs)
    }

    /// The ceiling on one lease's life under heartbeats, if any.
    pub fn max_hold(&self) -> Option<Duration> {
        self.max_hold_secs.map(Duration::from_secs)
    }

    /// The timer-wheel tick.
    pub fn wheel_tick(&self) -> Duration {
        Duration::from_millis(u64::from(self.wheel_tick_ms))
    }

    /// Checks every value against its documented range.
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
        use limits::*;
        let cap = u64::from(MAX_CAPACITY);
        range(
            "kv_lease_duration",
            self.lease_duration_secs,
            MIN_LEASE_DURATION_SECS,
            MAX_DURATION_SECS,
            "must be 6..=315360000 seconds (under 6 the heartbeat interval duration // 6 is 0)",
        )?;
        range(
            "decoder_kv_blocks_ttl",
            self.decoder_kv_blocks_ttl_secs,
            1,
            MAX_DURATION_SECS,
            "must be 1..=315360000 seconds",
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
            range(
                "kv_lease_max_hold",
                h,
                self.lease_duration_secs,
                MAX_DURATION_SECS,
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
        let value: Value = serde_json::from_str(json).map_err(|e| ConfigError::Json {
            message: e.to_string(),
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
        let mut c = LeaseConfig::new(shape);
        let mut capacity_set = false;
        let mut tracked_set = false;
        let mut unknown_keys = Vec::new();
        for (key, v) in obj {
            match key.as_str() {
                "kv_lease_duration" => c.lease_duration_secs = uint("kv_lease_duration", v)?,
                "decoder_kv_blocks_ttl" => {
                    c.decoder_kv_blocks_ttl_secs = uint("decoder_kv_blocks_ttl", v)?
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
                        Some(uint("kv_lease_max_hold", v)?)
                    }
                }
                "kv_lease_max_tracked_requests" => {
                    c.max_tracked_requests = u32_key("kv_lease_max_tracked_requests", v)?;
                    tracked_set = true;
                }
                "kv_lease_max_remote_engines" => {
                    c.max_remote_engines = u32_key("kv_lease_max_remote_engines", v)?
                }
                other => unknown_keys.push(other.to_string()),
            }
        }
        // Capacities that default to the slot count follow an explicit kv_lease_slots.
        if !capacity_set {
            c.lease_capacity = c.lease_slots;
        }
        if !tracked_set {
            c.max_tracked_requests = c.lease_capacity;
        }
        debug_assert!(unknown_keys
            .iter()
            .all(|k| !KNOWN_KEYS.contains(&k.as_str())));
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
        assert_eq!(p.config.lease_duration_secs, 60);
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
        assert_eq!(p.config.lease_duration_secs, 30);
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
            (
                r#"{"kv_lease_duration": 30.5}"#,
                "kv_lease_duration",
                "30.5",
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
}
