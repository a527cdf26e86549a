//! Bad flags and bad config: a clear message and a non-zero exit, never a
//! panic. Runs the built binary, as a user would.

use std::process::{Command, Output};

fn kvlease(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(args)
        .output()
        .expect("run kvlease")
}

/// Runs `kvlease sim ARGS`, expects failure with a message containing `want`.
fn refused(args: &[&str], want: &str) {
    let mut argv = vec!["sim"];
    argv.extend_from_slice(args);
    let out = kvlease(&argv);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert_ne!(out.status.code(), Some(101), "{args:?} panicked: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(
        err.contains(want),
        "{args:?}: message {err:?} does not mention {want:?}"
    );
    assert!(out.stdout.is_empty(), "{args:?} printed a report");
}

#[test]
fn bad_fleet_flags_are_refused() {
    refused(&["--engines", "2"], "expected P:D");
    refused(&["--engines", "0:2"], "at least 1");
    refused(&["--engines", "a:b"], "whole number");
    refused(&["--engines", "600:600"], "workers");
    refused(&["--p-tp", "3", "--d-tp", "2"], "--p-tp 3 / --d-tp 2");
    refused(&["--p-tp", "32", "--d-tp", "1"], "at most 16");
    refused(&["--p-tp", "0"], "--p-tp");
    refused(&["--p-blocks", "2"], "--p-blocks");
    refused(&["--d-max-seqs", "0"], "--d-max-seqs");
    refused(&["--jobs", "0"], "--jobs");
}

#[test]
fn bad_workload_flags_are_refused() {
    refused(&["--rate=-1"], "--rate");
    refused(&["--rate", "nan"], "--rate");
    refused(&["--rate", "fast"], "--rate");
    refused(&["--requests", "0"], "--requests");
    refused(&["--duration", "0"], "--duration");
    refused(&["--prompt-tokens", "0"], "--prompt-tokens");
    refused(&["--scenario", "sideways"], "sideways");
    refused(&["--policy", "forever"], "forever");
    refused(&["--json-timings"], "--json");
    refused(&["--no-such-flag"], "--no-such-flag");
}

#[test]
fn bad_config_is_refused_with_the_key_named() {
    refused(&["--kv-transfer-config", "{"], "--kv-transfer-config");
    refused(&["--kv-transfer-config", "[1]"], "JSON object");
    refused(
        &["--kv-transfer-config", r#"{"kv_lease_duration": 5}"#],
        "kv_lease_duration",
    );
    refused(
        &["--kv-transfer-config", r#"{"kv_lease_duration": "long"}"#],
        "kv_lease_duration",
    );
    refused(
        &[
            "--kv-transfer-config",
            r#"{"kv_connector": "NixlConnector", "kv_connector_extra_config": 3}"#,
        ],
        "kv_connector_extra_config",
    );
    refused(
        &["--kv-transfer-config", r#"{"kv_lease_slots": -4}"#],
        "kv_lease_slots",
    );
    refused(
        &[
            "--kv-transfer-config",
            r#"{"kv_lease_max_remote_engines": 1}"#,
        ],
        "kv_lease_max_remote_engines",
    );
}

#[test]
fn bad_sweeps_are_refused() {
    refused(&["--sweep", "kv_lease_duration"], "KEY=V1,V2");
    refused(&["--sweep", "=1,2"], "key is empty");
    refused(&["--sweep", "kv_lease_duration=10,,30"], "empty value");
    refused(&["--sweep", "kv_lease_duration=5,30"], "kv_lease_duration");
    refused(&["--sweep", "no_such_key=1,2"], "no_such_key");
}

#[test]
fn an_unwritable_plot_path_is_an_error() {
    refused(
        &[
            "--scenario",
            "happy",
            "--policy",
            "fixed-30",
            "--duration",
            "2",
            "--plot",
            "/nonexistent-dir/x.svg",
        ],
        "--plot",
    );
}

#[test]
fn no_subcommand_is_an_error_and_help_explains_every_flag() {
    let out = kvlease(&[]);
    assert!(!out.status.success());
    let out = kvlease(&["sim", "--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--scenario",
        "--policy",
        "--seed",
        "--engines",
        "--p-tp",
        "--d-tp",
        "--rate",
        "--prompt-tokens",
        "--output-tokens",
        "--requests",
        "--duration",
        "--p-blocks",
        "--d-blocks",
        "--d-max-seqs",
        "--kv-transfer-config",
        "--sweep",
        "--json",
        "--json-timings",
        "--plot",
        "--jobs",
        "--trace",
        "--trace-format",
        "--csv-timestamp",
        "--csv-input",
        "--csv-output",
        "--csv-time-unit",
        "--from",
        "--to",
        "--speed",
        "--rate-scale",
        "--fault",
        "--drain",
        "--auto-size",
        "--utilisation",
        "--block-tokens",
    ] {
        assert!(help.contains(flag), "--help does not mention {flag}");
    }
    assert!(
        help.contains("bidirectional"),
        "--help says bidirectional-skew is not there yet"
    );
}

#[test]
fn unknown_config_keys_are_reported_not_fatal() {
    let out = kvlease(&[
        "sim",
        "--scenario",
        "happy",
        "--policy",
        "lease+verify",
        "--duration",
        "5",
        "--kv-transfer-config",
        r#"{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"kv_lease_duraton": 60}}"#,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown kv_connector_extra_config key \"kv_lease_duraton\""),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("scenario happy"));
}
