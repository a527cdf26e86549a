//! Reading `kv_connector_extra_config` the way vLLM does: numbers as vLLM
//! takes them (floats included), every refusal a typed [`ConfigError`].

use super::*;

impl LeaseConfig {
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
    pub(super) fn from_entries<'a>(
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
                "kv_lease_require_verification" => {
                    c.require_verification = v
                        .as_bool()
                        .ok_or_else(|| wrong("kv_lease_require_verification", "true or false", v))?
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
                "kv_lease_max_pin" => c.max_pin = secs("kv_lease_max_pin", v, 0.0, RULE_TTL)?,
                "kv_lease_max_tracked_requests" => {
                    c.max_tracked_requests = u32_key("kv_lease_max_tracked_requests", v)?
                }
                "kv_lease_max_remote_engines" => {
                    c.max_remote_engines = u32_key("kv_lease_max_remote_engines", v)?
                }
                "kv_lease_max_peers" => c.max_peers = u32_key("kv_lease_max_peers", v)?,
                "kv_lease_max_fan_out" => c.max_fan_out = u32_key("kv_lease_max_fan_out", v)?,
                "kv_lease_turn2_safety_margin" => {
                    c.turn2_safety_margin =
                        secs("kv_lease_turn2_safety_margin", v, 0.0, RULE_MARGIN)?
                }
                "kv_lease_clock_drift_ppm" => {
                    c.clock_drift_ppm = u32_key("kv_lease_clock_drift_ppm", v)?
                }
                "kv_lease_push_write_bound" => {
                    c.push_write_bound = secs("kv_lease_push_write_bound", v, 0.0, RULE_TTL)?
                }
                "kv_lease_push_capacity" => c.push_capacity = u32_key("kv_lease_push_capacity", v)?,
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

pub(super) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(super) fn wrong(key: &'static str, expected: &'static str, v: &Value) -> ConfigError {
    ConfigError::WrongType {
        key,
        expected,
        value: v.to_string(),
    }
}

pub(super) fn too_big(key: &'static str, v: &Value) -> ConfigError {
    ConfigError::OutOfRange {
        key,
        value: v.to_string(),
        rule: "too large",
    }
}

/// A non-negative whole number (vLLM's durations are integer seconds).
pub(super) fn uint(key: &'static str, v: &Value) -> Result<u64, ConfigError> {
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

pub(super) fn u32_key(key: &'static str, v: &Value) -> Result<u32, ConfigError> {
    u32::try_from(uint(key, v)?).map_err(|_| too_big(key, v))
}

pub(super) const RULE_LEASE_DURATION: &str =
    "must be 6..=315360000 seconds (under 6 the heartbeat interval duration // 6 is 0)";
pub(super) const RULE_TTL: &str = "must be more than 0 and at most 315360000 seconds";
pub(super) const RULE_MARGIN: &str = RULE_TTL;

/// A duration in seconds as vLLM takes it: any JSON number (`30`, `30.0`,
/// `3e1`, `45.5`) that is at least `min` (and more than 0), at most
/// [`limits::MAX_DURATION_SECS`].
pub(super) fn secs(
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
pub(super) fn whole_secs(key: &'static str, v: &Value) -> Result<u64, ConfigError> {
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
pub(super) fn duration_floor_from_secs_f64(secs: f64) -> Duration {
    let whole = secs.trunc();
    // `secs - whole` is exact; the product can round up to 1e9 only for a
    // fraction within 1e-16 of 1, which a value of at least 1 s cannot hold.
    let nanos = ((secs - whole) * 1e9).floor().clamp(0.0, 999_999_999.0);
    Duration::new(whole as u64, nanos as u32)
}

/// `nanos / (div seconds)` rounded down to whole seconds, saturating.
pub(super) fn floor_secs(nanos: u128, div: u128) -> Duration {
    let s = nanos / (div * 1_000_000_000);
    Duration::from_secs(u64::try_from(s).unwrap_or(u64::MAX))
}

/// A duration as seconds for an error message: `30`, `45.5`.
pub(super) fn secs_text(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        return d.as_secs().to_string();
    }
    let frac = format!("{:09}", d.subsec_nanos());
    format!("{}.{}", d.as_secs(), frac.trim_end_matches('0'))
}

/// On a JSON syntax error: if one of our keys holds Python's `NaN`,
/// `Infinity` or `-Infinity` (which `json.dumps` writes and JSON lacks), the
/// error naming that key. A small scan outside strings; error path only.
pub(super) fn non_finite_value(json: &str) -> Option<ConfigError> {
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
                let problem = non_finite_token(rest);
                if let (Some((token, rule)), true, Some((s, e))) = (problem, colon_after, last_str)
                {
                    // An unknown key with NaN is not ours to name: keep scanning.
                    if let Some(key) = KNOWN_KEYS.iter().find(|k| k.as_bytes() == &b[s..e]) {
                        return Some(ConfigError::OutOfRange {
                            key,
                            value: token.to_string(),
                            rule,
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

/// The value token at the start of `rest` when it is one that serde_json
/// refuses for not being a finite double: Python's `NaN` / `Infinity` /
/// `-Infinity`, or a number literal beyond a double's range (`1e309`,
/// which Python's `json` reads as infinity), with the rule to quote.
fn non_finite_token(rest: &str) -> Option<(&str, &'static str)> {
    if let Some(t) = ["NaN", "Infinity", "-Infinity"]
        .into_iter()
        .find(|t| rest.starts_with(t))
    {
        return Some((t, "must be a finite number (JSON has no NaN or Infinity)"));
    }
    let len = rest
        .bytes()
        .take_while(|c| c.is_ascii_digit() || matches!(c, b'-' | b'+' | b'.' | b'e' | b'E'))
        .count();
    let token = &rest[..len];
    let starts_number = token
        .bytes()
        .next()
        .is_some_and(|c| c == b'-' || c.is_ascii_digit());
    match token.parse::<f64>() {
        Ok(f) if starts_number && f.is_infinite() => Some((
            token,
            "must be a finite number (beyond a double's range; Python reads it as infinity)",
        )),
        _ => None,
    }
}
