//! The scenarios: what goes wrong, when, in a run.
//!
//! This module owns each scenario's timeline (how long the run lasts, when
//! traffic surges, which fault starts and ends when) and the lease settings
//! a scenario pins (slot exhaustion needs few slots). It does not apply the
//! faults: [`super::world`] does, through the loopback network's own fault
//! controls (crash, dropped notifications, slow READs), so the library sees
//! exactly what a real network would show it.

use std::time::Duration;

use clap::ValueEnum;
use serde::Serialize;

use super::model::Fleet;

// The `bidirectional-skew` scenario's conditions ([`super::bidir`] runs it).

/// D's clock is this far ahead of P's.
pub const D_AHEAD: Duration = Duration::from_secs(2 * 3600);
/// D's clock runs this fast against P's (the estimate allows 100 ppm).
pub const D_DRIFT_PPM: u64 = 80;
/// The extra latency of a slow READ.
pub const SLOW_READ: Duration = Duration::from_secs(8);
/// Percent of READs that are slow.
pub const SLOW_READ_PERCENT: u32 = 25;

// The `push-faults` scenario's ([`super::push`] runs it).

/// When P dies, from the run's start.
pub const P_DEATH: Duration = Duration::from_secs(150);

/// A scenario from the lease spec. `bidirectional-skew` (turn-2 reads from
/// D's cache across skewed clocks) is run by [`super::bidir`] in a small
/// world of its own; [`Scenario::ALL`], the default run, has every one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// Steady traffic, nothing fails.
    Happy,
    /// D engine 0 dies mid-stream while requests wait in its queue.
    DecodeCrash,
    /// A surge keeps requests in D's queue far longer than the lease.
    Overload,
    /// D engine 0's notifications to P are lost for 90 s while it is alive
    /// and its queue is long, so leases lapse.
    HeartbeatLoss,
    /// D engine 0's READs slow down and its heartbeats are lost: leases
    /// lapse while READs are in flight and P reuses the blocks.
    MidreadLapse,
    /// Few lease slots (64 per P worker) during a surge: leases without a
    /// slot cannot be verified.
    SlotExhaustion,
    /// One P rank (the last of P engine 0) hears no notification for 140 s
    /// while its peer rank does.
    RankDivergence,
    /// Multi-turn conversations: P pulls turn 2 from the blocks D cached,
    /// with D's clock 2 h ahead and 80 ppm fast, and slow READs that outlast
    /// the safety margin.
    BidirectionalSkew,
    /// vLLM's push mode: registrations that reach P late or never, D aborts
    /// while P's WRITE is in flight, slow WRITEs, lossy notifications, and P
    /// dies at 150 s.
    PushFaults,
    /// A trace replay (`--trace`): the faults laid over it come from
    /// `--fault`, its timeline from [`super::replay::TraceRun`].
    #[value(skip)]
    Trace,
}

impl Scenario {
    /// Every scenario, in table order.
    pub const ALL: [Scenario; 9] = [
        Scenario::Happy,
        Scenario::DecodeCrash,
        Scenario::Overload,
        Scenario::HeartbeatLoss,
        Scenario::MidreadLapse,
        Scenario::SlotExhaustion,
        Scenario::RankDivergence,
        Scenario::BidirectionalSkew,
        Scenario::PushFaults,
    ];

    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Happy => "happy",
            Scenario::DecodeCrash => "decode-crash",
            Scenario::Overload => "overload",
            Scenario::HeartbeatLoss => "heartbeat-loss",
            Scenario::MidreadLapse => "midread-lapse",
            Scenario::SlotExhaustion => "slot-exhaustion",
            Scenario::RankDivergence => "rank-divergence",
            Scenario::BidirectionalSkew => "bidirectional-skew",
            Scenario::PushFaults => "push-faults",
            Scenario::Trace => "trace",
        }
    }

    /// The scenario's timeline for `fleet`.
    pub fn plan(self, fleet: &Fleet) -> ScenarioPlan {
        let s = Duration::from_secs;
        let mut plan = ScenarioPlan {
            duration: s(300),
            surge: None,
            faults: Vec::new(),
            lease_slots: None,
            description: String::new(),
        };
        let last_rank = fleet.p_tp.saturating_sub(1);
        match self {
            Scenario::Happy => {
                plan.description = "steady traffic, nothing fails".into();
            }
            Scenario::Trace => {
                // The replay's own plan (RunSpec::plan) replaces this one.
                plan.description = "a trace replay".into();
            }
            Scenario::DecodeCrash => {
                // The crash comes during a surge, so D 0 has a queue to lose;
                // the run lasts until a 480 s timeout has run out after it.
                plan.duration = s(90 + 480 + 60);
                plan.surge = Some(Surge {
                    start: s(40),
                    end: s(100),
                    factor: 4.0,
                });
                plan.faults.push((s(90), Fault::CrashDecode { d: 0 }));
                plan.description = "D 0 crashes at 90 s during a surge (40-100 s, x4)".into();
            }
            Scenario::Overload => {
                plan.duration = s(420);
                plan.surge = Some(Surge {
                    start: s(60),
                    end: s(150),
                    factor: 4.0,
                });
                plan.description =
                    "surge x4 from 60 s to 150 s: D queues grow past the lease".into();
            }
            Scenario::HeartbeatLoss => {
                plan.duration = s(420);
                plan.surge = Some(Surge {
                    start: s(60),
                    end: s(150),
                    factor: 4.0,
                });
                plan.faults
                    .push((s(90), Fault::DecodeNotifications { d: 0, lost: true }));
                plan.faults
                    .push((s(180), Fault::DecodeNotifications { d: 0, lost: false }));
                plan.description =
                    "surge x4 (60-150 s); D 0's notifications to P lost 90-180 s".into();
            }
            Scenario::MidreadLapse => {
                plan.surge = Some(Surge {
                    start: s(50),
                    end: s(120),
                    factor: 2.0,
                });
                plan.faults.push((
                    s(60),
                    Fault::SlowReads {
                        d: 0,
                        extra: Some(s(45)),
                    },
                ));
                plan.faults
                    .push((s(60), Fault::DecodeNotifications { d: 0, lost: true }));
                plan.faults
                    .push((s(120), Fault::SlowReads { d: 0, extra: None }));
                plan.faults
                    .push((s(120), Fault::DecodeNotifications { d: 0, lost: false }));
                plan.description =
                    "D 0's READs take +45 s and its notifications are lost 60-120 s".into();
            }
            Scenario::SlotExhaustion => {
                plan.surge = Some(Surge {
                    start: s(60),
                    end: s(150),
                    factor: 3.0,
                });
                plan.lease_slots = Some(64);
                plan.description = "kv_lease_slots = 64 per P worker; surge x3 (60-150 s)".into();
            }
            Scenario::BidirectionalSkew => {
                // Long enough for turn 2s that come back after 1.1 TTLs
                // (480 s by default); a longer TTL lengthens the run.
                plan.duration = s(660);
                plan.description = format!(
                    "turn 2 pulled from D's cache; D's clock {} h ahead and {} ppm fast; \
                     {} % of READs take +{} s",
                    D_AHEAD.as_secs() / 3600,
                    D_DRIFT_PPM,
                    SLOW_READ_PERCENT,
                    SLOW_READ.as_secs()
                );
            }
            Scenario::PushFaults => {
                plan.description = format!(
                    "push mode: late, lost and aborted registrations, slow WRITEs, 2 % of \
                     notifications lost and 2 % doubled; P dies at {} s",
                    P_DEATH.as_secs()
                );
            }
            Scenario::RankDivergence => {
                plan.surge = Some(Surge {
                    start: s(60),
                    end: s(150),
                    factor: 4.0,
                });
                plan.faults.push((
                    s(60),
                    Fault::RankDeaf {
                        p: 0,
                        rank: last_rank,
                        deaf: true,
                    },
                ));
                plan.faults.push((
                    s(200),
                    Fault::RankDeaf {
                        p: 0,
                        rank: last_rank,
                        deaf: false,
                    },
                ));
                plan.description = format!(
                    "P 0 rank {last_rank} hears no notification 60-200 s; surge x4 (60-150 s)"
                );
            }
        }
        plan
    }
}

/// A window of raised arrivals.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Surge {
    /// From (since the run's start).
    pub start: Duration,
    /// Until.
    pub end: Duration,
    /// Arrival rate multiplier inside the window.
    pub factor: f64,
}

/// A fault, applied through the loopback network's controls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// D engine `d` dies: its workers' agents crash, its queue is lost.
    CrashDecode {
        /// The D engine.
        d: u32,
    },
    /// Every notification from D engine `d`'s workers is lost (or no more).
    DecodeNotifications {
        /// The D engine.
        d: u32,
        /// Lost from now on (true) or delivered again (false).
        lost: bool,
    },
    /// READs by D engine `d`'s workers take `extra` longer (None: normal again).
    SlowReads {
        /// The D engine.
        d: u32,
        /// The added latency.
        extra: Option<Duration>,
    },
    /// Every notification to P engine `p`'s rank `rank` is lost (or no more).
    RankDeaf {
        /// The P engine.
        p: u32,
        /// Its rank.
        rank: u32,
        /// Deaf from now on (true) or hearing again (false).
        deaf: bool,
    },
}

/// What one scenario does over a run.
#[derive(Clone, Debug, PartialEq)]
pub struct ScenarioPlan {
    /// Virtual length of the run.
    pub duration: Duration,
    /// Raised arrivals, if any.
    pub surge: Option<Surge>,
    /// Faults, by time since the start.
    pub faults: Vec<(Duration, Fault)>,
    /// `kv_lease_slots` this scenario pins (capacity then stays at the
    /// engine default, so leases beyond the slots are granted unslotted).
    pub lease_slots: Option<u32>,
    /// One line for the report.
    pub description: String,
}
