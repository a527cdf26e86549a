//! The claims a run's numbers support: each is computed from the report
//! and printed with the numbers behind it, pass or fail. Nothing is
//! asserted here that the run did not measure.
//!
//! - after a D crash, lease renewal reclaims the leases that heartbeats had
//!   carried past their initial length within extension + one interval,
//!   and every dead block within max(kv_lease_duration, extension +
//!   interval) (plus one engine step of slack each), while the 480 s
//!   timeout holds dead blocks for minutes;
//! - under overload, lease renewal frees nothing prematurely, while the
//!   30 s timeout does;
//! - with heartbeat loss, verification turns every stale read into a failed
//!   load (0 silent corruptions), while without it corruptions are counted;
//! - in bidirectional-skew, the same holds for turn-2 reads that D's TTL
//!   overtakes mid-READ;
//! - in push-faults, the push guard leaves no push hanging and no set
//!   leaked, lets no WRITE land in a freed set, and reclaims a dead P's
//!   sets within its bound, while stock vLLM hangs and leaks and a naive D
//!   timeout takes stray WRITEs.

use std::fmt::Write;

use super::{Report, ScenarioReport};
use crate::sim::metrics::RunReport;
use crate::sim::scenario::Scenario;
use crate::trace::overlay::FaultKind;

/// One claim and whether the numbers bear it out.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Check {
    /// The claim, with its numbers.
    pub text: String,
    /// Whether it holds; `None` when the run never got to test it (the
    /// crash orphaned nothing, no queue outlasted a 30 s timeout).
    pub holds: Option<bool>,
}

/// Slack on the reclaim bound: an expiry is noticed at the next P step
/// (one idle poll at most) plus one wheel tick.
const STEP_SLACK_S: f64 = 0.1;

/// Slack on the reclaim bound of a run whose P steps can be long (a trace's
/// 126k-token prompt is a 2.5 s prefill): the longest step, plus the tick.
fn slack(longest_p_step_s: f64) -> f64 {
    STEP_SLACK_S.max(longest_p_step_s + STEP_SLACK_S / 2.0)
}

fn policy<'a>(r: &'a ScenarioReport, name: &str) -> Option<&'a RunReport> {
    r.policies.iter().find(|p| p.policy == name)
}

/// The checks that `report`'s scenarios and policies allow.
pub fn checks(report: &Report) -> Vec<Check> {
    let mut out = Vec::new();
    for r in &report.runs {
        let at = r
            .sweep_value
            .as_ref()
            .map(|v| format!(" [sweep {v}]"))
            .unwrap_or_default();
        let faults: Vec<FaultKind> = report
            .trace
            .as_ref()
            .map(|t| t.faults.iter().map(|f| f.kind).collect())
            .unwrap_or_default();
        let trace = r.scenario == Scenario::Trace;
        if r.scenario == Scenario::DecodeCrash
            || (trace && faults.contains(&FaultKind::DecodeCrash))
        {
            out.extend(crash_check(r, &at));
        }
        if r.scenario == Scenario::HeartbeatLoss
            || (trace && faults.contains(&FaultKind::HeartbeatLoss))
        {
            out.extend(heartbeat_loss_check(r, &at));
        }
        if trace {
            out.push(accounting_check(r, &at));
        }
        match r.scenario {
            Scenario::BidirectionalSkew => {
                if let (Some(v), Some(n)) = (policy(r, "lease+verify"), policy(r, "lease-noverify"))
                {
                    out.push(Check {
                        text: format!(
                            "bidirectional-skew{at}: with verification {} of {} turn-2 READs overtaken by D's TTL \
                             were caught and {} loads were corrupt ({} verified but wrong); without it {} of {} \
                             were accepted with another conversation's KV",
                            v.stale_caught,
                            v.stale_reads,
                            v.silent_corruptions,
                            v.verified_but_wrong,
                            n.silent_corruptions,
                            n.stale_reads
                        ),
                        holds: (v.stale_reads > 0 && n.stale_reads > 0).then_some(
                            v.silent_corruptions == 0
                                && v.verified_but_wrong == 0
                                && v.stale_caught == v.stale_reads
                                && n.silent_corruptions > 0,
                        ),
                    });
                }
            }
            Scenario::PushFaults => out.extend(push_check(r, &at)),
            Scenario::Overload => {
                if let (Some(l), Some(f)) = (policy(r, "lease+verify"), policy(r, "fixed-30")) {
                    out.push(Check {
                        text: format!(
                            "overload{at}: lease+verify freed {} requests' blocks prematurely, fixed-30 {} \
                             ({} of its loads accepted reused blocks)",
                            l.premature_frees, f.premature_frees, f.silent_corruptions
                        ),
                        // Nothing to show if no request waited past 30 s.
                        holds: (l.premature_frees + f.premature_frees > 0)
                            .then_some(l.premature_frees == 0 && f.premature_frees > 0),
                    });
                }
            }
            _ => {}
        }
        for p in &r.policies {
            if p.verified_but_wrong > 0 {
                out.push(Check {
                    text: format!(
                        "{}{at} {}: {} loads passed verification with another request's KV",
                        r.scenario.name(),
                        p.policy,
                        p.verified_but_wrong
                    ),
                    holds: Some(false),
                });
            }
        }
    }
    out
}

fn fmt(x: Option<f64>) -> String {
    x.map_or_else(|| "(no such lease)".into(), |v| format!("{v:.1} s"))
}

/// The checks as text.
pub fn render(checks: &[Check]) -> String {
    let mut out = String::new();
    for c in checks {
        let tag = match c.holds {
            Some(true) => "ok",
            Some(false) => "FAILED",
            None => "n/a",
        };
        let _ = writeln!(out, "[{tag}] {}", c.text);
    }
    out
}

/// After a D crash: lease reclaim within its bounds, fixed-480 holding.
fn crash_check(r: &ScenarioReport, at: &str) -> Option<Check> {
    let (l, f) = (policy(r, "lease+verify")?, policy(r, "fixed-480")?);
    let bound = r.lease.extension_s + r.lease.interval_s;
    let all_bound = bound.max(r.lease.duration_s);
    let slack = slack(l.longest_p_step_s);
    let renewed_ok = l.reclaim_renewed_s.is_none_or(|x| x <= bound + slack);
    let all_ok = l.reclaim_s.is_some_and(|x| x <= all_bound + slack);
    Some(Check {
        text: format!(
            "{}{at}: lease+verify reclaimed the renewed dead leases {} after the crash \
             (bound: extension {} + interval {} = {bound} s) and every dead block by {} \
             (bound: max(lease, extension + interval) = {all_bound} s); \
             fixed-480 held dead blocks {} ({} vs {} dead-block-seconds)",
            crash_name(r),
            fmt(l.reclaim_renewed_s),
            r.lease.extension_s,
            r.lease.interval_s,
            fmt(l.reclaim_s),
            fmt(f.reclaim_s),
            f.dead_block_seconds.round(),
            l.dead_block_seconds.round()
        ),
        holds: (l.orphaned > 0 || f.orphaned > 0)
            .then_some(renewed_ok && all_ok && f.reclaim_s.is_none_or(|x| x > all_bound)),
    })
}

/// "decode-crash", or "trace (decode-crash)" for a replay.
fn crash_name(r: &ScenarioReport) -> String {
    match r.scenario {
        Scenario::Trace => "trace (decode-crash)".into(),
        s => s.name().into(),
    }
}

/// With D's notifications lost: verification catches every stale read.
fn heartbeat_loss_check(r: &ScenarioReport, at: &str) -> Option<Check> {
    let (v, n) = (policy(r, "lease+verify")?, policy(r, "lease-noverify")?);
    let name = match r.scenario {
        Scenario::Trace => "trace (heartbeat-loss)",
        s => s.name(),
    };
    let text = if v.stale_reads == 0 {
        format!(
            "{name}{at}: no lease lapsed under lease+verify at this setting \
             (nothing to catch); without verification {} silent corruptions",
            n.silent_corruptions
        )
    } else {
        format!(
            "{name}{at}: with verification {} of {} stale reads failed the load, {} silent \
             corruptions; without it {} stale reads, {} silent corruptions",
            v.stale_caught,
            v.stale_reads,
            v.silent_corruptions,
            n.stale_reads,
            n.silent_corruptions
        )
    };
    Some(Check {
        text,
        holds: (v.stale_reads > 0).then_some(
            v.stale_caught == v.stale_reads
                && v.silent_corruptions == 0
                && n.silent_corruptions > 0,
        ),
    })
}

/// A replay loses no request: each one that arrived is done (own KV or
/// not), lost to a crash, or still in flight at the end.
fn accounting_check(r: &ScenarioReport, at: &str) -> Check {
    let mut parts = Vec::new();
    let mut holds = true;
    for p in &r.policies {
        let sum = p.completed + p.completed_corrupt + p.lost + p.in_flight_at_end;
        holds &= sum == p.arrived;
        parts.push(format!(
            "{} {} = {} done + {} corrupt + {} lost + {} in flight",
            p.policy, p.arrived, p.completed, p.completed_corrupt, p.lost, p.in_flight_at_end
        ));
    }
    Check {
        text: format!(
            "{}{at}: every request accounted for: {}",
            r.scenario.name(),
            parts.join("; ")
        ),
        holds: Some(holds),
    }
}

/// Slack on the push guard's reclaim bound: one D step (50 ms) plus the
/// longest notification latency (30 ms) of the push world.
const PUSH_SLACK_S: f64 = 0.1;

fn push_check(r: &ScenarioReport, at: &str) -> Option<Check> {
    let (g, stock, naive) = (
        policy(r, "lease+verify").or_else(|| policy(r, "lease-noverify"))?,
        policy(r, "fixed-480"),
        policy(r, "fixed-30"),
    );
    let gf = g.push.clone()?;
    let bound = gf.bound_s?;
    let guard_ok = gf.hung == 0
        && gf.leaked_sets == 0
        && gf.stray_writes == 0
        && g.silent_corruptions == 0
        && gf
            .reclaim_after_p_death_s
            .is_some_and(|s| s <= bound + PUSH_SLACK_S);
    let mut text = format!(
        "push-faults{at}: the guard left {} pushes hung and {} sets leaked, took {} stray WRITEs, \
         and freed the dead P's last set {} s after its death (bound {bound:.1} s)",
        gf.hung,
        gf.leaked_sets,
        gf.stray_writes,
        gf.reclaim_after_p_death_s
            .map_or_else(|| "never".to_string(), |s| format!("{s:.1}"))
    );
    let mut controls_show_it = true;
    if let Some(f) = stock.and_then(|p| p.push.clone()) {
        text += &format!(
            "; stock vLLM left {} hung, {} sets leaked",
            f.hung, f.leaked_sets
        );
        controls_show_it &= f.hung > 0;
    }
    if let Some(n) = naive {
        let f = n.push.clone().unwrap_or_default();
        text += &format!(
            "; a naive 30 s timeout took {} stray WRITEs ({} requests decoded on overwritten KV)",
            f.stray_writes, n.silent_corruptions
        );
        controls_show_it &= f.stray_writes > 0;
    }
    Some(Check {
        text,
        holds: Some(guard_ok && controls_show_it),
    })
}
