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
    let p = LeaseConfig::from_entries([(&z, &one), (&d, &sixty), (&a, &one), (&m, &one)], SHAPE)
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
            e.contains("kv_lease_turn2_safety_margin") || e.contains("kv_lease_clock_drift_ppm"),
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
fn a_number_beyond_a_double_names_its_key() {
    // Python's json reads 1e309 as infinity; serde_json refuses it as "number
    // out of range" at a column. Every key that takes a number must be named.
    for key in KNOWN_KEYS {
        for v in ["1e309", "-1e309", "1E400", "123456789e999"] {
            let input = format!(r#"{{"backends": ["UCX"], "{key}": {v}}}"#);
            let err = parse(&input).unwrap_err();
            assert!(
                matches!(err, ConfigError::OutOfRange { key: k, .. } if k == *key),
                "{input}: {err:?}"
            );
            let msg = err.to_string();
            assert!(msg.contains(key) && msg.contains(v), "{input}: {msg}");
        }
    }
    // Finite huge numbers keep their own (range) errors; unknown keys the JSON one.
    assert!(matches!(
        parse(r#"{"kv_lease_slots": 1e300}"#),
        Err(ConfigError::WrongType { .. })
    ));
    assert!(matches!(
        parse(r#"{"other": 1e309}"#),
        Err(ConfigError::Json { .. })
    ));
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
        let _ = book.on_notification(0, "d0", b"HB:req-a", now);
        book.poll(crate::Instant::MAX);
        assert_eq!(
            book.held(),
            1,
            "a deadline past the end of time never fires"
        );
        let mut tracker = crate::consumer::HeartbeatTracker::new(&c, 1).expect("tracker");
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

#[test]
fn require_verification_parses_and_needs_verification() {
    let c = parse("{}").unwrap().config;
    assert!(!c.require_verification, "off by default (rolling upgrades)");
    let c = parse(r#"{"kv_lease_require_verification": true}"#)
        .unwrap()
        .config;
    assert!(c.require_verification && c.verification);
    for (input, value) in [
        (r#"{"kv_lease_require_verification": "yes"}"#, "\"yes\""),
        (r#"{"kv_lease_require_verification": 1}"#, "1"),
        (r#"{"kv_lease_require_verification": null}"#, "null"),
    ] {
        let e = parse(input).unwrap_err();
        assert!(
            matches!(
                e,
                ConfigError::WrongType {
                    key: "kv_lease_require_verification",
                    ..
                }
            ),
            "{input}: {e}"
        );
        assert!(e.to_string().contains(value), "{input}: {e}");
    }
    // Requiring what is switched off is a contradiction, refused by name.
    let e = parse(r#"{"kv_lease_require_verification": true, "kv_lease_verification": false}"#)
        .unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::OutOfRange {
                key: "kv_lease_require_verification",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        parse(r#"{"kv_lease_require_verification": false, "kv_lease_verification": false}"#)
            .is_ok()
    );
}

#[test]
fn max_peers_parses_within_its_range() {
    assert_eq!(parse("{}").unwrap().config.max_peers, DEFAULT_MAX_PEERS);
    assert_eq!(DEFAULT_MAX_PEERS, 256);
    for n in [1, 17, limits::MAX_PEERS] {
        let c = parse(&format!(r#"{{"kv_lease_max_peers": {n}}}"#))
            .unwrap()
            .config;
        assert_eq!(c.max_peers, n);
    }
    for (input, value) in [
        (r#"{"kv_lease_max_peers": 0}"#, "0"),
        (r#"{"kv_lease_max_peers": 4097}"#, "4097"),
        (r#"{"kv_lease_max_peers": -1}"#, "-1"),
        (r#"{"kv_lease_max_peers": 99999999999}"#, "99999999999"),
    ] {
        let e = parse(input).unwrap_err();
        assert!(
            matches!(
                e,
                ConfigError::OutOfRange {
                    key: "kv_lease_max_peers",
                    ..
                }
            ),
            "{input}: {e}"
        );
        assert!(e.to_string().contains(value), "{input}: {e}");
    }
    let e = parse(r#"{"kv_lease_max_peers": "8"}"#).unwrap_err();
    assert!(matches!(
        e,
        ConfigError::WrongType {
            key: "kv_lease_max_peers",
            ..
        }
    ));
}
