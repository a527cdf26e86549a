//! The terminal table: one block per scenario, one row per policy.
//!
//! Owns the column set and formatting. Every cell is a number from the
//! report; a `-` means "not applicable" (no crash in the scenario) and
//! `>run` a dead block still held when the run ended.

use std::fmt::Write;

use super::columns::write_aligned;
use super::{Report, ScenarioReport};

/// Column headers and what they mean (printed under the tables).
pub const LEGEND: &str = "\
done: requests completed on their own KV; goodput: done per second;
dead blk*s: P blocks held for a crashed D's requests, integrated from the crash until freed;
reclaim: crash -> last dead block freed (renewed: over leases heartbeats had carried past their initial length);
peak held: most P blocks held at once, fleet-wide;
premature: P freed blocks a live D still had to read (mid-read: during its READ);
stale: READs that completed after P freed the blocks; caught: those verification failed;
corrupt: loads accepted with another request's KV (reused blocks); failed: failed KV loads
(unverifiable: no lease slot); recomp: prefills D recomputed;
lease us/step: measured wall time of the kvlease calls per engine step (P / D).";

fn secs(x: Option<f64>, dead_left: u64, crash: bool) -> String {
    match x {
        _ if !crash => "-".into(),
        Some(v) => format!("{v:.1}"),
        None if dead_left > 0 => ">run".into(),
        None => "-".into(),
    }
}

/// The `push-faults` scenario's columns (legend: [`PUSH_LEGEND`]).
fn push_rows(r: &ScenarioReport) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let headers = vec![
        "policy",
        "pushes",
        "done",
        "failed",
        "hung",
        "leaked sets",
        "stray WRITEs",
        "corrupt",
        "P death: waiting",
        "reclaim",
        "bound",
    ];
    let rows = r
        .policies
        .iter()
        .map(|p| {
            let f = p.push.clone().unwrap_or_default();
            vec![
                p.policy.clone(),
                p.arrived.to_string(),
                p.completed.to_string(),
                p.failed_loads.to_string(),
                f.hung.to_string(),
                f.leaked_sets.to_string(),
                f.stray_writes.to_string(),
                p.silent_corruptions.to_string(),
                f.outstanding_at_p_death.to_string(),
                match f.reclaim_after_p_death_s {
                    Some(v) => format!("{v:.1}"),
                    None if f.outstanding_at_p_death > 0 => "never".into(),
                    None => "-".into(),
                },
                f.bound_s.map_or_else(|| "-".into(), |b| format!("{b:.1}")),
            ]
        })
        .collect();
    (headers, rows)
}

/// What the `push-faults` columns mean (printed under its table).
pub const PUSH_LEGEND: &str = "\
push-faults: lease+verify and lease-noverify run kvlease's push guard (the same run: a push has no READ
to verify), fixed-480 stock vLLM (D frees only on P's report), fixed-30 a naive D (frees on abort, and
30 s after registering without P's report); hung: pushes still waiting for P at the end (their sets
leaked); stray WRITEs: landed in a set after D freed it; corrupt: decoded on a set a stray WRITE
overwrote; reclaim: P's death -> D freed the last set registered with it (never: held at the end);
bound: the guard's, max(duration, extension + interval) + write_bound.";

/// One scenario's block.
pub fn scenario_table(r: &ScenarioReport) -> String {
    let mut out = String::new();
    let value = r
        .sweep_value
        .as_ref()
        .map(|v| format!(" [sweep value {v}]"))
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "scenario {}{value}: {} (lease {} s, heartbeat every {} s, extension {} s)",
        r.scenario.name(),
        r.description,
        r.lease.duration_s,
        r.lease.interval_s,
        r.lease.extension_s
    );
    if r.scenario == crate::sim::scenario::Scenario::PushFaults {
        let (headers, rows) = push_rows(r);
        write_aligned(&mut out, &headers, &rows);
        out.push_str(PUSH_LEGEND);
        out.push('\n');
        return out;
    }
    let headers = [
        "policy",
        "done",
        "goodput",
        "lost",
        "dead blk*s",
        "reclaim",
        "renewed",
        "peak held",
        "premature",
        "mid-read",
        "stale",
        "caught",
        "corrupt",
        "failed",
        "unverif",
        "recomp",
        "lease us/step P/D",
    ];
    let crash = r.policies.iter().any(|p| p.orphaned > 0);
    let rows: Vec<Vec<String>> = r
        .policies
        .iter()
        .map(|p| {
            vec![
                p.policy.clone(),
                p.completed.to_string(),
                format!("{:.2}", p.goodput_rps),
                p.lost.to_string(),
                if crash {
                    format!("{:.0}", p.dead_block_seconds)
                } else {
                    "-".into()
                },
                secs(p.reclaim_s, p.dead_blocks_at_end, crash),
                secs(p.reclaim_renewed_s, p.dead_blocks_at_end, crash),
                p.peak_blocks_held.to_string(),
                p.premature_frees.to_string(),
                p.mid_read_frees.to_string(),
                p.stale_reads.to_string(),
                p.stale_caught.to_string(),
                p.silent_corruptions.to_string(),
                p.failed_loads.to_string(),
                p.unverifiable.to_string(),
                p.recomputed.to_string(),
                p.timings
                    .map(|t| format!("{:.1} / {:.1}", t.p_us_per_step, t.d_us_per_step))
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    write_aligned(&mut out, &headers, &rows);
    out
}

/// The whole report as text.
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let f = &report.fleet;
    let w = &report.workload;
    if let Some(info) = &report.trace {
        let _ = writeln!(
            out,
            "kvlease sim: seed {}, {} P x TP{} + {} D x TP{}, {} P blocks and {} D blocks per engine of {} tokens",
            report.seed,
            f.p_engines,
            f.p_tp,
            f.d_engines,
            f.d_tp,
            report.model.p_blocks,
            report.model.d_blocks,
            report.model.block_tokens
        );
        out.push_str(&super::trace::header(info));
        out.push('\n');
        for r in &report.runs {
            out.push_str(&scenario_table(r));
            out.push('\n');
        }
        out.push_str(&super::trace::figures(report));
        out.push('\n');
        out.push_str(LEGEND);
        out.push('\n');
        return out;
    }
    let _ = writeln!(
        out,
        "kvlease sim: seed {}, {} P x TP{} + {} D x TP{}, {:.2} req/s (prompt ~{} tok, output ~{} tok){}",
        report.seed,
        f.p_engines,
        f.p_tp,
        f.d_engines,
        f.d_tp,
        w.rate,
        w.prompt_tokens,
        w.output_tokens,
        w.requests
            .map(|n| format!(", {n} requests per run"))
            .unwrap_or_default()
    );
    out.push('\n');
    for r in &report.runs {
        out.push_str(&scenario_table(r));
        out.push('\n');
    }
    out.push_str(LEGEND);
    out.push('\n');
    out
}
