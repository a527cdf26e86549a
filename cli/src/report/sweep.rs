//! `--sweep KEY=V1,V2,...`: the trade-off table, one row per value.
//!
//! Owns the sweep's summary: for each value, under lease renewal with
//! verification, how long a crashed decoder's blocks stay dead (reclaim
//! time and dead-block-seconds in decode-crash, or in a trace replay with a
//! decode-crash laid over it) against how many leases
//! lapse on decoders that are alive (premature frees, summed over the
//! other scenarios, and what they cost: recomputed prefills). The fixed
//! timeouts do not depend on lease settings; their rows are the same
//! reference at every value. A trace replay adds D's longest wait, the
//! 99th-percentile latency and the heartbeat messages sent.

use std::fmt::Write;

use super::Report;
use crate::sim::scenario::Scenario;

/// The trade-off table of a sweep report (empty without a sweep).
pub fn render(report: &Report) -> String {
    let Some(sweep) = &report.sweep else {
        return String::new();
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "trade-off over {} (policy lease+verify; premature frees and recomputes summed over the scenarios run)",
        sweep.key
    );
    let mut headers = vec![
        sweep.key.as_str(),
        "interval",
        "extension",
        "reclaim (crash)",
        "dead blk*s",
        "premature",
        "stale caught",
        "recomputed",
        "corrupt",
        "goodput",
    ];
    // A replay's trade-off is often in time, not in frees: how long D
    // waited, the slowest requests, and what the heartbeats cost.
    let trace = report.trace.is_some();
    if trace {
        headers.extend(["D wait max", "latency p99", "heartbeats"]);
    }
    let mut rows: Vec<Vec<String>> = Vec::new();
    for v in &sweep.values {
        let runs: Vec<_> = report
            .runs
            .iter()
            .filter(|r| r.sweep_value.as_deref() == Some(v.as_str()))
            .collect();
        let lease = |r: &&super::ScenarioReport| {
            r.policies
                .iter()
                .find(|p| p.policy == "lease+verify")
                .cloned()
        };
        // The crash: the decode-crash scenario, or a replay (with or
        // without a decode-crash laid over it: "-" when nothing was orphaned).
        let crash = runs
            .iter()
            .find(|r| matches!(r.scenario, Scenario::DecodeCrash | Scenario::Trace))
            .and_then(lease);
        let all: Vec<_> = runs.iter().filter_map(lease).collect();
        let Some(first) = runs.first() else {
            continue;
        };
        let sum = |f: fn(&crate::sim::metrics::RunReport) -> u64| {
            all.iter().map(f).sum::<u64>().to_string()
        };
        let mut row = vec![
            v.clone(),
            format!("{}", first.lease.interval_s),
            format!("{}", first.lease.extension_s),
            crash
                .as_ref()
                .filter(|c| c.orphaned > 0)
                .map(|c| c.reclaim_s.map_or(">run".into(), |x| format!("{x:.1} s")))
                .unwrap_or_else(|| "-".into()),
            crash
                .as_ref()
                .filter(|c| c.orphaned > 0)
                .map(|c| format!("{:.0}", c.dead_block_seconds))
                .unwrap_or_else(|| "-".into()),
            sum(|p| p.premature_frees),
            sum(|p| p.stale_caught),
            sum(|p| p.recomputed),
            sum(|p| p.silent_corruptions),
            format!(
                "{:.2}",
                all.iter().map(|p| p.goodput_rps).sum::<f64>() / all.len().max(1) as f64
            ),
        ];
        if trace {
            let worst = |f: fn(&crate::sim::metrics::RunReport) -> Option<f64>| {
                all.iter()
                    .filter_map(f)
                    .reduce(f64::max)
                    .map_or("-".into(), |x| format!("{x:.1} s"))
            };
            row.push(worst(|p| p.d_wait_max_s));
            row.push(worst(|p| p.latency_p99_s));
            row.push(sum(|p| p.heartbeat_messages));
        }
        rows.push(row);
    }
    super::columns::write_aligned(&mut out, &headers, &rows);
    let _ = writeln!(
        out,
        "(goodput: mean over the scenarios, requests per second)"
    );
    out
}
