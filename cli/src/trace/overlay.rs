//! Faults laid over a trace replay (`--fault KIND@WHEN[+LENGTH][/ENGINE]`).
//!
//! This module owns the overlay syntax and turning it into the run's
//! timeline ([`ScenarioPlan`]): the same faults the scenarios use, at trace
//! times the operator picks. WHEN is a trace time (`1200`, `20m`, `36m30s`)
//! or `busiest`: the middle of the replay's busiest minute. LENGTH is in run
//! seconds (a 90 s heartbeat loss lasts 90 s whatever `--speed` is). ENGINE
//! is `dN` (a D engine) or, for rank-divergence, `pN` (a P engine; its last
//! rank goes deaf); by default engine 0, as in the scenarios.
//!
//! | kind | what happens | default length |
//! |---|---|---|
//! | `decode-crash` | D engine N dies | (none: it stays down) |
//! | `heartbeat-loss` | D engine N's notifications to P are lost | 90 s |
//! | `midread-lapse` | D engine N's READs take +45 s and its notifications are lost | 60 s |
//! | `rank-divergence` | P engine N's last rank hears no notification | 140 s |
//! | `slot-exhaustion` | `kv_lease_slots` = 64 per P worker (the whole replay: slots are sized when an engine starts) | - |

use std::fmt::Write;
use std::time::Duration;

use serde::Serialize;

use super::stats::TraceStats;
use super::window::{parse_time, Window};
use crate::sim::model::Fleet;
use crate::sim::scenario::{Fault, ScenarioPlan};

/// A fault kind of the overlay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// D engine 0 dies.
    DecodeCrash,
    /// D engine 0's notifications are lost.
    HeartbeatLoss,
    /// D engine 0's READs slow down and its notifications are lost.
    MidreadLapse,
    /// P engine 0's last rank is deaf.
    RankDivergence,
    /// 64 lease slots per P worker.
    SlotExhaustion,
}

impl FaultKind {
    const ALL: [FaultKind; 5] = [
        FaultKind::DecodeCrash,
        FaultKind::HeartbeatLoss,
        FaultKind::MidreadLapse,
        FaultKind::RankDivergence,
        FaultKind::SlotExhaustion,
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::DecodeCrash => "decode-crash",
            FaultKind::HeartbeatLoss => "heartbeat-loss",
            FaultKind::MidreadLapse => "midread-lapse",
            FaultKind::RankDivergence => "rank-divergence",
            FaultKind::SlotExhaustion => "slot-exhaustion",
        }
    }

    fn default_length(self) -> Option<Duration> {
        match self {
            FaultKind::HeartbeatLoss => Some(Duration::from_secs(90)),
            FaultKind::MidreadLapse => Some(Duration::from_secs(60)),
            FaultKind::RankDivergence => Some(Duration::from_secs(140)),
            FaultKind::DecodeCrash | FaultKind::SlotExhaustion => None,
        }
    }
}

/// Slots per P worker under `slot-exhaustion` (as the scenario).
pub const EXHAUSTED_SLOTS: u32 = 64;

/// Extra READ latency under `midread-lapse` (as the scenario).
pub const MIDREAD_EXTRA: Duration = Duration::from_secs(45);

/// When a fault starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum When {
    /// The middle of the replay's busiest minute.
    Busiest,
    /// A trace time.
    At(Duration),
}

/// One `--fault`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FaultSpec {
    /// What.
    pub kind: FaultKind,
    /// When (`None` for `slot-exhaustion`).
    pub when: Option<When>,
    /// How long (`None`: the kind's default).
    pub length: Option<Duration>,
    /// The engine: a D engine, or a P engine for rank-divergence.
    pub engine: u32,
}

/// Parses `KIND@WHEN[+LENGTH][/ENGINE]` (or `slot-exhaustion`).
pub fn parse_fault(s: &str) -> Result<FaultSpec, String> {
    let (kind_s, rest) = match s.split_once('@') {
        Some((k, r)) => (k.trim(), Some(r)),
        None => (s.trim(), None),
    };
    let kind = FaultKind::ALL
        .into_iter()
        .find(|k| k.name() == kind_s)
        .ok_or_else(|| {
            format!(
                "unknown fault {kind_s:?}: one of {}",
                FaultKind::ALL.map(FaultKind::name).join(", ")
            )
        })?;
    if kind == FaultKind::SlotExhaustion {
        return match rest {
            None => Ok(FaultSpec {
                kind,
                when: None,
                length: None,
                engine: 0,
            }),
            Some(_) => Err(
                "slot-exhaustion takes no time: lease slots are sized when an engine starts, \
                 so it covers the whole replay"
                    .into(),
            ),
        };
    }
    let rest = rest.ok_or_else(|| {
        format!("{kind_s}: when? e.g. {kind_s}@busiest or {kind_s}@20m (trace time)")
    })?;
    let (rest, engine) = match rest.rsplit_once('/') {
        None => (rest, 0),
        Some((r, e)) => {
            let side = if kind == FaultKind::RankDivergence {
                'p'
            } else {
                'd'
            };
            let n = e
                .trim()
                .strip_prefix(side)
                .and_then(|n| n.parse::<u32>().ok())
                .ok_or_else(|| format!("{kind_s}: engine {e:?} is not {side}N (e.g. /{side}1)"))?;
            (r, n)
        }
    };
    let (when_s, len_s) = match rest.split_once('+') {
        Some((w, l)) => (w, Some(l)),
        None => (rest, None),
    };
    let when = match when_s.trim() {
        "busiest" => When::Busiest,
        t => When::At(parse_time(t).map_err(|e| format!("{kind_s}@: {e}"))?),
    };
    let length = match len_s {
        None => None,
        Some(_) if kind == FaultKind::DecodeCrash => {
            return Err("decode-crash takes no length: the engine stays down".into())
        }
        Some(l) => {
            let d = parse_time(l).map_err(|e| format!("{kind_s} length: {e}"))?;
            if d.is_zero() {
                return Err(format!("{kind_s}: the length must be above 0"));
            }
            Some(d)
        }
    };
    Ok(FaultSpec {
        kind,
        when: Some(when),
        length,
        engine,
    })
}

/// One fault of the overlay as placed on the run (for the report).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlacedFault {
    /// What.
    pub kind: FaultKind,
    /// From, run seconds.
    pub from_s: f64,
    /// Until, run seconds (`None`: for good).
    pub until_s: Option<f64>,
    /// The engine (D, or P for rank-divergence).
    pub engine: u32,
}

/// The run's timeline: `faults` placed on the replay `w` of traffic
/// `stats`; the run lasts until `drain` after the last arrival or fault end.
pub fn plan(
    faults: &[FaultSpec],
    w: &Window,
    stats: &TraceStats,
    fleet: &Fleet,
    last_arrival: Duration,
    drain: Duration,
) -> Result<(ScenarioPlan, Vec<PlacedFault>), String> {
    let mut plan = ScenarioPlan {
        duration: Duration::ZERO,
        surge: None,
        faults: Vec::new(),
        lease_slots: None,
        description: String::new(),
    };
    let mut placed = Vec::new();
    let mut last = last_arrival;
    let last_rank = fleet.p_tp.saturating_sub(1);
    for f in faults {
        let at = match f.when {
            None => None,
            Some(When::Busiest) => Some(Duration::from_secs_f64(stats.busiest_minute_s + 30.0)),
            Some(When::At(t)) => {
                if !w.contains(t) || w.to_run(t) > last_arrival {
                    return Err(format!(
                        "--fault {}@{} s: outside the replayed window (trace time {} s to its last request at {:.0} s)",
                        f.kind.name(),
                        t.as_secs_f64(),
                        w.from.as_secs_f64(),
                        w.to_trace(last_arrival).as_secs_f64()
                    ));
                }
                Some(w.to_run(t))
            }
        };
        let until = match (at, f.length.or(f.kind.default_length())) {
            (Some(a), Some(l)) => Some(a + l),
            _ => None,
        };
        let (d, engines, side) = match f.kind {
            FaultKind::RankDivergence => (f.engine, fleet.p_engines, "P"),
            _ => (f.engine, fleet.d_engines, "D"),
        };
        if f.kind != FaultKind::SlotExhaustion && d >= engines {
            return Err(format!(
                "--fault {}: {side} engine {d} does not exist (the fleet has {engines})",
                f.kind.name()
            ));
        }
        match (f.kind, at, until) {
            (FaultKind::SlotExhaustion, _, _) => plan.lease_slots = Some(EXHAUSTED_SLOTS),
            (FaultKind::DecodeCrash, Some(a), _) => plan.faults.push((a, Fault::CrashDecode { d })),
            (FaultKind::HeartbeatLoss, Some(a), Some(u)) => {
                plan.faults
                    .push((a, Fault::DecodeNotifications { d, lost: true }));
                plan.faults
                    .push((u, Fault::DecodeNotifications { d, lost: false }));
            }
            (FaultKind::MidreadLapse, Some(a), Some(u)) => {
                plan.faults.push((
                    a,
                    Fault::SlowReads {
                        d,
                        extra: Some(MIDREAD_EXTRA),
                    },
                ));
                plan.faults
                    .push((a, Fault::DecodeNotifications { d, lost: true }));
                plan.faults.push((u, Fault::SlowReads { d, extra: None }));
                plan.faults
                    .push((u, Fault::DecodeNotifications { d, lost: false }));
            }
            (FaultKind::RankDivergence, Some(a), Some(u)) => {
                plan.faults.push((
                    a,
                    Fault::RankDeaf {
                        p: d,
                        rank: last_rank,
                        deaf: true,
                    },
                ));
                plan.faults.push((
                    u,
                    Fault::RankDeaf {
                        p: d,
                        rank: last_rank,
                        deaf: false,
                    },
                ));
            }
            _ => {}
        }
        if let Some(a) = at {
            last = last.max(until.unwrap_or(a));
        }
        placed.push(PlacedFault {
            kind: f.kind,
            from_s: at.map_or(0.0, |a| a.as_secs_f64()),
            until_s: until.map(|u| u.as_secs_f64()),
            engine: f.engine,
        });
    }
    // Faults in time order (stable: a window's start before its end).
    plan.faults.sort_by_key(|(t, _)| *t);
    plan.duration = last + drain;
    plan.description = describe(&placed, stats, last_rank);
    Ok((plan, placed))
}

fn describe(placed: &[PlacedFault], stats: &TraceStats, last_rank: u32) -> String {
    if placed.is_empty() {
        return "the trace, nothing fails".into();
    }
    let mut parts = Vec::new();
    for p in placed {
        let mut s = String::new();
        let until = p.until_s.unwrap_or(p.from_s);
        let e = p.engine;
        let _ = match p.kind {
            FaultKind::DecodeCrash => {
                let busiest = (p.from_s - stats.busiest_minute_s - 30.0).abs() < 1e-6;
                write!(
                    s,
                    "D {e} crashes at {:.0} s{}",
                    p.from_s,
                    if busiest { " (the busiest minute)" } else { "" }
                )
            }
            FaultKind::HeartbeatLoss => write!(
                s,
                "D {e}'s notifications to P lost {:.0}-{until:.0} s",
                p.from_s
            ),
            FaultKind::MidreadLapse => write!(
                s,
                "D {e}'s READs take +{} s and its notifications are lost {:.0}-{until:.0} s",
                MIDREAD_EXTRA.as_secs(),
                p.from_s
            ),
            FaultKind::RankDivergence => write!(
                s,
                "P {e} rank {last_rank} hears no notification {:.0}-{until:.0} s",
                p.from_s
            ),
            FaultKind::SlotExhaustion => {
                write!(s, "kv_lease_slots = {EXHAUSTED_SLOTS} per P worker")
            }
        };
        parts.push(s);
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_specs_parse_and_bad_ones_say_why() {
        let f = parse_fault("heartbeat-loss@20m+90").unwrap();
        assert_eq!(f.kind, FaultKind::HeartbeatLoss);
        assert_eq!(f.when, Some(When::At(Duration::from_secs(1200))));
        assert_eq!(f.length, Some(Duration::from_secs(90)));
        let f = parse_fault("decode-crash@busiest").unwrap();
        assert_eq!(f.when, Some(When::Busiest));
        assert_eq!(f.length, None);
        assert!(parse_fault("slot-exhaustion").is_ok());
        assert_eq!(parse_fault("heartbeat-loss@37m/d1").unwrap().engine, 1);
        assert_eq!(parse_fault("rank-divergence@5m+60/p2").unwrap().engine, 2);
        assert_eq!(parse_fault("decode-crash@5m").unwrap().engine, 0);
        for (bad, why) in [
            ("power-cut@5m", "unknown fault"),
            ("decode-crash", "when?"),
            ("decode-crash@5m+30", "no length"),
            ("slot-exhaustion@5m", "takes no time"),
            ("heartbeat-loss@soon", "not a time"),
            ("heartbeat-loss@5m+0", "above 0"),
            ("heartbeat-loss@5m/p1", "not dN"),
            ("rank-divergence@5m/d1", "not pN"),
        ] {
            let e = parse_fault(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
