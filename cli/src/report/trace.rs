//! A trace replay's own figures: the traffic replayed, the fleet it ran
//! on, and per policy the numbers an operator compares settings by.
//!
//! Owns the text around a `--trace` run's table: the traffic block above it
//! (window, rates, the busiest minute, prefix sharing, the auto-sized
//! fleet) and the per-trace figures below it: peak P blocks held (fleet
//! and one engine), dead-block-seconds after a crash, premature frees,
//! stale reads caught and corrupt, how long requests waited in D's queue
//! (what the trace file cannot say), their latency, and where every request ended up (done,
//! lost, in flight), per policy and sweep value. Every number comes from
//! the report; none is computed here beyond formatting.

use std::fmt::Write;

use super::columns::write_aligned;
use super::Report;
use crate::trace::TraceInfo;

/// Thousands separators, for counts people read.
fn n(x: u64) -> String {
    let s = x.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Minutes and seconds of a time in seconds.
fn mmss(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    format!("{}:{:02}", s / 60, s % 60)
}

/// The traffic block: what was replayed, and the fleet (and why, when
/// `--auto-size` chose it).
pub fn header(info: &TraceInfo) -> String {
    let st = &info.stats;
    let mut out = String::new();
    let window = format!(
        "trace time {}-{}",
        mmss(info.from_s),
        info.to_s.map_or("end".into(), mmss)
    );
    let _ = writeln!(
        out,
        "trace {} ({}): {} requests, {window}, speed x{}, load x{}",
        info.file,
        info.format.name(),
        n(st.requests),
        info.speed,
        info.rate_scale
    );
    let blocks = st.mean_prompt_tokens / f64::from(info.block_tokens);
    let _ = writeln!(
        out,
        "  {:.2} req/s over {} of run time ({:.2} at the peak 60 s); prompt {} tokens mean \
         ({blocks:.1} blocks of {}), {} max; output {} mean",
        st.mean.requests_per_s,
        mmss(st.span_s),
        st.peak_60s.requests_per_s,
        n(st.mean_prompt_tokens.round() as u64),
        info.block_tokens,
        n(u64::from(st.max_prompt_tokens)),
        n(st.mean_output_tokens.round() as u64)
    );
    let _ = writeln!(
        out,
        "  busiest minute: run time {}-{} ({} requests, {} prompt tokens)",
        mmss(st.busiest_minute_s),
        mmss(st.busiest_minute_s + 60.0),
        st.busiest_minute_requests,
        n(st.busiest_minute_prompt_tokens)
    );
    if let (Some(all), Some(shared)) = (st.prefix_blocks, st.shared_prefix_blocks) {
        let _ = writeln!(
            out,
            "  prefix blocks an earlier request already had: {} of {} ({:.1}%); not modelled: \
             P prefills and holds every prompt in full",
            n(shared),
            n(all),
            100.0 * shared as f64 / all.max(1) as f64
        );
    }
    if let Some(s) = &info.sizing {
        out.push_str(&s.explain());
        out.push('\n');
    }
    out
}

/// The per-trace figures, one row per policy (per sweep value).
pub fn figures(report: &Report) -> String {
    let Some(info) = &report.trace else {
        return String::new();
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "per-trace figures ({} requests replayed; done + corrupt + lost + in flight = arrived):",
        n(info.stats.requests)
    );
    let sweeping = report.sweep.is_some();
    let mut headers = vec![
        "policy",
        "peak P blocks",
        "peak/engine",
        "dead blk*s",
        "premature",
        "stale caught",
        "stale corrupt",
        "D wait p99/max",
        "latency p50/p99",
        "done",
        "corrupt",
        "lost",
        "in flight",
    ];
    if sweeping {
        headers.insert(0, "sweep value");
    }
    let mut rows = Vec::new();
    for r in &report.runs {
        for p in &r.policies {
            let mut row = vec![
                p.policy.clone(),
                n(p.peak_blocks_held),
                n(p.peak_engine_blocks_held),
                format!("{:.0}", p.dead_block_seconds),
                n(p.premature_frees),
                n(p.stale_caught),
                n(p.silent_corruptions),
                match (p.d_wait_p99_s, p.d_wait_max_s) {
                    (Some(a), Some(b)) => format!("{a:.1} / {b:.1} s"),
                    _ => "-".into(),
                },
                match (p.latency_p50_s, p.latency_p99_s) {
                    (Some(a), Some(b)) => format!("{a:.1} / {b:.1} s"),
                    _ => "-".into(),
                },
                n(p.completed),
                n(p.completed_corrupt),
                n(p.lost),
                n(p.in_flight_at_end),
            ];
            if sweeping {
                row.insert(0, r.sweep_value.clone().unwrap_or_default());
            }
            rows.push(row);
        }
    }
    write_aligned(&mut out, &headers, &rows);
    out
}
