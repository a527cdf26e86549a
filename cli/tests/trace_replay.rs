//! Replaying traces: deterministic for a seed, every request of the window
//! accounted for, block counts from the trace's token lengths, the window,
//! speed and load scale applied, faults laid over the replay, the fleet
//! sized for it, and the sweep on it.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{run, sim};
use kvlease_cli::trace::{load, CsvColumns};

const CONVERSATION: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../data/traces/mooncake_conversation.jsonl"
);

/// A temporary trace file with `text`, removed when dropped.
struct TempTrace(PathBuf);

impl TempTrace {
    fn new(name: &str, text: &str) -> TempTrace {
        let path = std::env::temp_dir().join(format!("kvlease-{}-{name}", std::process::id()));
        std::fs::write(&path, text).expect("write a temp trace");
        TempTrace(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
}

impl Drop for TempTrace {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn json(args: &[&str]) -> Vec<u8> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .arg("sim")
        .args(args)
        .output()
        .expect("run kvlease");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn a_replay_is_deterministic_for_a_seed() {
    // A fractional load scale draws which requests are copied, and where.
    let args = [
        "--trace",
        CONVERSATION,
        "--from",
        "30m",
        "--to",
        "33m",
        "--rate-scale",
        "1.5",
        "--fault",
        "decode-crash@busiest",
        "--fault",
        "heartbeat-loss@31m+60",
        "--json",
        "--seed",
        "9",
    ];
    let a = json(&args);
    let b = json(&[&args[..], &["--jobs", "1"]].concat());
    assert!(!a.is_empty());
    assert_eq!(a, b, "two replays with seed 9 differ");
    let v: serde_json::Value = serde_json::from_slice(&a).expect("valid JSON");
    assert_eq!(v["trace"]["rate_scale"], 1.5);
    assert_eq!(v["runs"][0]["scenario"], "trace");
    assert_eq!(v["runs"][0]["policies"].as_array().map(Vec::len), Some(4));
    let c = json(&[&args[..12], &["--json", "--seed", "10"]].concat());
    assert_ne!(a, c, "another seed copies other requests");
}

#[test]
fn every_request_of_the_window_is_done_lost_or_in_flight() {
    let trace = load(
        std::path::Path::new(CONVERSATION),
        None,
        &CsvColumns::default(),
    )
    .expect("the shipped trace");
    let (from, to) = (20 * 60, 24 * 60);
    let in_window = trace
        .requests
        .iter()
        .filter(|r| (from..to).contains(&r.at.as_secs()))
        .count() as u64;
    assert!(in_window > 500, "{in_window}");
    // To the end: a crash loses requests, the rest complete. Cut short
    // 5 s after the window's last arrival: some are still in flight. Both
    // add up.
    for cap in [None, Some("245")] {
        let mut args = vec![
            "--trace",
            CONVERSATION,
            "--from",
            "20m",
            "--to",
            "24m",
            "--fault",
            "decode-crash@22m",
        ];
        if let Some(c) = cap {
            args.extend(["--duration", c]);
        }
        let out = sim(&args);
        for p in &out.report.runs[0].policies {
            assert_eq!(p.arrived, in_window, "{} {cap:?}", p.policy);
            assert_eq!(
                p.completed + p.completed_corrupt + p.lost + p.in_flight_at_end,
                p.arrived,
                "{}: {p:?}",
                p.policy
            );
            assert!(p.lost > 0, "{}: the crash loses D 0's requests", p.policy);
            match cap {
                None => assert_eq!(p.in_flight_at_end, 0, "{}", p.policy),
                Some(_) => assert!(p.in_flight_at_end > 0, "{}", p.policy),
            }
        }
        let acct = out
            .report
            .checks
            .iter()
            .find(|c| c.text.contains("every request accounted for"))
            .expect("the accounting check");
        assert_eq!(acct.holds, Some(true), "{}", acct.text);
    }
}

#[test]
fn block_counts_come_from_the_token_lengths() {
    // One request of 1025 prompt tokens: 3 blocks of 512, 65 of 16.
    let t = TempTrace::new(
        "one.jsonl",
        "{\"timestamp\": 0, \"input_length\": 1025, \"output_length\": 4}\n",
    );
    let out = sim(&["--trace", t.path(), "--policy", "fixed-480"]);
    let r = run(&out.report, "trace", "fixed-480");
    assert_eq!((r.arrived, r.completed), (1, 1));
    assert_eq!(r.peak_blocks_held, 3);
    let out = sim(&[
        "--trace",
        t.path(),
        "--policy",
        "fixed-480",
        "--block-tokens",
        "16",
    ]);
    assert_eq!(run(&out.report, "trace", "fixed-480").peak_blocks_held, 65);
    // The run ends once the request has settled, not at the 600 s cap.
    assert!(r.seconds < 5.0, "{}", r.seconds);
}

#[test]
fn speed_and_load_scale_reshape_the_replay() {
    let base = sim(&[
        "--trace",
        CONVERSATION,
        "--from",
        "10m",
        "--to",
        "14m",
        "--policy",
        "fixed-480",
    ]);
    let fast = sim(&[
        "--trace",
        CONVERSATION,
        "--from",
        "10m",
        "--to",
        "14m",
        "--policy",
        "fixed-480",
        "--speed",
        "2",
    ]);
    let double = sim(&[
        "--trace",
        CONVERSATION,
        "--from",
        "10m",
        "--to",
        "14m",
        "--policy",
        "fixed-480",
        "--rate-scale",
        "2",
    ]);
    let (b, f, d) = (
        base.report.trace.as_ref().expect("trace info"),
        fast.report.trace.as_ref().expect("trace info"),
        double.report.trace.as_ref().expect("trace info"),
    );
    assert_eq!(f.stats.requests, b.stats.requests);
    assert!((f.stats.span_s - b.stats.span_s / 2.0).abs() < 0.01);
    assert_eq!(d.stats.requests, 2 * b.stats.requests);
    assert!(d.stats.span_s <= b.stats.span_s + 1.0);
    for out in [&base, &fast, &double] {
        let r = run(&out.report, "trace", "fixed-480");
        assert_eq!(
            r.arrived,
            out.report.trace.as_ref().map_or(0, |t| t.stats.requests)
        );
    }
}

#[test]
fn faults_laid_over_a_trace_act_at_their_times() {
    // A crash at the window's busiest minute: D 0's requests are lost;
    // under fixed-480 the crash leaves dead blocks for much longer than
    // under a renewed lease, whenever it orphans any.
    let out = sim(&[
        "--trace",
        CONVERSATION,
        "--from",
        "50m",
        "--to",
        "54m",
        "--rate-scale",
        "2",
        "--engines",
        "2:2",
        "--p-tp",
        "4",
        "--d-tp",
        "8",
        "--p-blocks",
        "568",
        "--d-blocks",
        "1128",
        "--fault",
        "decode-crash@busiest",
    ]);
    let info = out.report.trace.as_ref().expect("trace info");
    assert_eq!(info.faults.len(), 1);
    assert_eq!(info.faults[0].from_s, info.stats.busiest_minute_s + 30.0);
    let l = run(&out.report, "trace", "lease+verify");
    let f = run(&out.report, "trace", "fixed-480");
    assert!(l.lost > 0 && f.lost > 0);
    assert!(f.orphaned > 0, "the crash must find queued requests: {f:?}");
    let lease_bound = out.report.runs[0].lease.duration_s + 0.1;
    assert!(l.reclaim_s.is_none_or(|x| x <= lease_bound), "{l:?}");
    assert!(f.reclaim_s.is_none_or(|x| x > 400.0), "{f:?}");
    assert!(f.dead_block_seconds > 10.0 * l.dead_block_seconds.max(1.0));
    // A heartbeat loss with slow READs (midread-lapse) under lease+verify:
    // whatever lapses is caught, never accepted.
    let out = sim(&[
        "--trace",
        CONVERSATION,
        "--from",
        "40m",
        "--to",
        "43m",
        "--fault",
        "midread-lapse@40m30s+90",
        "--policy",
        "lease+verify,lease-noverify",
    ]);
    let v = run(&out.report, "trace", "lease+verify");
    assert_eq!(v.silent_corruptions, 0);
    assert_eq!(v.stale_caught, v.stale_reads);
    assert_eq!(v.verified_but_wrong, 0);
}

#[test]
fn a_csv_trace_replays_end_to_end() {
    let t = TempTrace::new(
        "azure.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n\
         2023-11-16 18:15:46.68,4808,10\n\
         2023-11-16 18:15:47.10,3180,8\n\
         2023-11-16 18:15:49.00,110,27\n",
    );
    let out = sim(&["--trace", t.path()]);
    let info = out.report.trace.as_ref().expect("trace info");
    assert_eq!(info.format.name(), "csv");
    for p in &out.report.runs[0].policies {
        assert_eq!((p.arrived, p.completed), (3, 3), "{}", p.policy);
    }
}

#[test]
fn auto_size_prints_the_fleet_it_chose_and_runs_on_it() {
    let out = sim(&[
        "--trace",
        CONVERSATION,
        "--from",
        "36m",
        "--to",
        "39m",
        "--auto-size",
        "--utilisation",
        "0.6",
        "--policy",
        "lease+verify",
    ]);
    let s = out
        .report
        .trace
        .as_ref()
        .and_then(|t| t.sizing.clone())
        .expect("the sizing");
    assert_eq!(s.utilisation, 0.6);
    let f = &out.report.fleet;
    assert_eq!(
        (f.p_engines, f.d_engines, f.p_tp, f.d_tp),
        (s.p_engines, s.d_engines, s.p_tp, s.d_tp)
    );
    assert_eq!(out.report.model.p_blocks, s.p_blocks);
    // The measured peak fills 60% of the pool (rounded up).
    assert!(f64::from(s.p_blocks) * 0.6 >= s.p_blocks_measured as f64);
    assert!(f64::from(s.p_blocks - 1) * 0.6 < s.p_blocks_measured as f64);
    assert!(s.p_busy_at_peak / f64::from(s.p_engines) <= 0.6);
    assert!(s.d_busy_at_peak / f64::from(s.d_engines) <= 0.6);
    assert!(out.stdout.contains(&format!(
        "auto-size at 60% utilisation of the peak 60 s: {} P x TP{} + {} D x TP{}",
        s.p_engines, s.p_tp, s.d_engines, s.d_tp
    )));
}

#[test]
fn a_sweep_on_a_trace_gives_its_trade_off_curve() {
    let out = sim(&[
        "--trace",
        CONVERSATION,
        "--from",
        "50m",
        "--to",
        "53m",
        "--fault",
        "decode-crash@busiest",
        "--policy",
        "lease+verify",
        "--sweep",
        "kv_lease_duration=10,60",
    ]);
    assert_eq!(out.report.runs.len(), 2);
    assert!(out.stdout.contains("trade-off over kv_lease_duration"));
    let table: Vec<&str> = out
        .stdout
        .lines()
        .skip_while(|l| !l.starts_with("trade-off over"))
        .collect();
    let row = |v: &str| {
        table
            .iter()
            .find(|l| l.starts_with(&format!("{v} ")))
            .unwrap_or_else(|| panic!("no row {v}: {}", out.stdout))
            .to_string()
    };
    assert!(
        row("10").split_whitespace().nth(1) == Some("1"),
        "{}",
        row("10")
    );
    assert!(
        row("60").split_whitespace().nth(1) == Some("10"),
        "{}",
        row("60")
    );
}

#[test]
fn trace_flags_are_checked() {
    let refused = |args: &[&str], want: &str| {
        let mut argv = vec!["sim"];
        argv.extend_from_slice(args);
        let out = Command::new(env!("CARGO_BIN_EXE_kvlease"))
            .args(&argv)
            .output()
            .expect("run kvlease");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!err.contains("panicked"), "{err}");
        assert!(
            err.contains(want),
            "{args:?}: {err:?} does not mention {want:?}"
        );
    };
    let t = ["--trace", CONVERSATION];
    refused(&[&t[..], &["--speed", "0"]].concat(), "--speed");
    refused(&[&t[..], &["--rate-scale=-1"]].concat(), "--rate-scale");
    refused(
        &[&t[..], &["--rate-scale", "1000"]].concat(),
        "--rate-scale",
    );
    refused(
        &[&t[..], &["--from", "30m", "--to", "10m"]].concat(),
        "--to",
    );
    refused(&[&t[..], &["--from", "2h"]].concat(), "no request");
    refused(&[&t[..], &["--from", "soon"]].concat(), "not a time");
    refused(
        &[&t[..], &["--fault", "decode-crash@2h"]].concat(),
        "outside the replayed window",
    );
    refused(
        &[&t[..], &["--fault", "meteor@5m"]].concat(),
        "unknown fault",
    );
    refused(&[&t[..], &["--scenario", "happy"]].concat(), "--scenario");
    refused(&[&t[..], &["--rate", "3"]].concat(), "--rate");
    refused(
        &[&t[..], &["--auto-size", "--engines", "2:2"]].concat(),
        "--engines",
    );
    refused(
        &[&t[..], &["--auto-size", "--utilisation", "1.5"]].concat(),
        "--utilisation",
    );
    refused(&[&t[..], &["--p-blocks", "100"]].concat(), "--p-blocks");
    refused(&["--fault", "decode-crash@5m"], "--trace");
    refused(&["--speed", "2"], "--trace");
}
