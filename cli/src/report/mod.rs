//! What an invocation reports: one structure, shown four ways.
//!
//! This module owns the [`Report`] (settings echoed, then one
//! [`ScenarioReport`] per sweep value and scenario, each with one
//! [`RunReport`] per policy) and building it from the runs. Its
//! submodules render it: [`table`] for the terminal, [`plot`] the SVG,
//! [`sweep`] the trade-off table, [`checks`] the claims the run's numbers
//! support (or not), [`trace`] a replay's own figures; [`columns`] is the
//! alignment their tables share. `--json` is
//! `serde_json` on [`Report`].

pub mod checks;
pub mod columns;
pub mod plot;
pub mod sweep;
pub mod table;
pub mod trace;

use serde::Serialize;

use crate::runner::Job;
use crate::settings::Settings;
use crate::sim::metrics::RunReport;
use crate::sim::policy::Policy;
use crate::sim::scenario::Scenario;
use crate::sim::RunOutput;

/// The fleet, echoed.
#[derive(Clone, Debug, Serialize)]
pub struct FleetReport {
    /// P engines.
    pub p_engines: u32,
    /// D engines.
    pub d_engines: u32,
    /// P TP.
    pub p_tp: u32,
    /// D TP.
    pub d_tp: u32,
}

/// Engine sizes, echoed.
#[derive(Clone, Debug, Serialize)]
pub struct ModelReport {
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// KV blocks per P engine.
    pub p_blocks: u32,
    /// KV blocks per D engine.
    pub d_blocks: u32,
    /// D's max_num_seqs.
    pub d_max_seqs: u32,
}

/// The workload, echoed.
#[derive(Clone, Debug, Serialize)]
pub struct WorkloadReport {
    /// Mean arrivals per second outside surges.
    pub rate: f64,
    /// Mean prompt tokens.
    pub prompt_tokens: u32,
    /// Mean output tokens.
    pub output_tokens: u32,
    /// Request count of a request-bounded run.
    pub requests: Option<u64>,
}

/// The lease settings of the lease policies, echoed.
#[derive(Clone, Debug, Serialize)]
pub struct LeaseReport {
    /// kv_lease_duration, seconds.
    pub duration_s: f64,
    /// Heartbeat interval, seconds.
    pub interval_s: f64,
    /// Extension per heartbeat, seconds.
    pub extension_s: f64,
    /// kv_lease_slots per P worker.
    pub slots: u32,
}

impl LeaseReport {
    fn of(c: &kvlease::LeaseConfig) -> LeaseReport {
        LeaseReport {
            duration_s: c.lease_duration().as_secs_f64(),
            interval_s: c.heartbeat_interval().as_secs_f64(),
            extension_s: c.lease_extension().as_secs_f64(),
            slots: c.lease_slots,
        }
    }
}

/// One scenario (at one sweep value), every policy.
#[derive(Clone, Debug, Serialize)]
pub struct ScenarioReport {
    /// The sweep value, when sweeping.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sweep_value: Option<String>,
    /// The lease settings of this point (the sweep changes them).
    pub lease: LeaseReport,
    /// The scenario.
    pub scenario: Scenario,
    /// What happens in it.
    pub description: String,
    /// One report per policy.
    pub policies: Vec<RunReport>,
    /// Blocks held per second, per policy (the plot's data; not in JSON).
    #[serde(skip)]
    pub series: Vec<(Policy, Vec<u64>)>,
}

/// The sweep, echoed.
#[derive(Clone, Debug, Serialize)]
pub struct SweepReport {
    /// The key.
    pub key: String,
    /// Its values.
    pub values: Vec<String>,
}

/// Everything an invocation reports.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// The fleet.
    pub fleet: FleetReport,
    /// Engine sizes.
    pub model: ModelReport,
    /// The workload.
    pub workload: WorkloadReport,
    /// The operator's lease settings (before sweep, scenario and policy).
    pub lease: LeaseReport,
    /// The sweep, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sweep: Option<SweepReport>,
    /// The trace replayed, if any: file, window, traffic, faults, sizing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<crate::trace::TraceInfo>,
    /// Per sweep value and scenario.
    pub runs: Vec<ScenarioReport>,
    /// The claims these numbers support (see [`checks`]).
    pub checks: Vec<checks::Check>,
}

impl Report {
    /// Builds the report of `jobs` and their `outputs` (same order).
    /// `timings` puts the measured lease CPU into every [`RunReport`].
    pub fn build(s: &Settings, jobs: &[Job], outputs: &[RunOutput], timings: bool) -> Report {
        let mut runs: Vec<ScenarioReport> = Vec::new();
        for (job, out) in jobs.iter().zip(outputs) {
            let value = s
                .sweep
                .as_ref()
                .and_then(|sw| sw.points.get(job.point))
                .map(|(v, _)| v.clone());
            let same = runs
                .last()
                .is_some_and(|r| r.scenario == job.scenario && r.sweep_value == value);
            if !same {
                runs.push(ScenarioReport {
                    sweep_value: value,
                    lease: LeaseReport::of(&job.spec.config),
                    scenario: job.scenario,
                    description: job.spec.plan().description,
                    policies: Vec::new(),
                    series: Vec::new(),
                });
            }
            let Some(r) = runs.last_mut() else {
                continue;
            };
            let mut rep = out.metrics.report(job.policy.name(), out.seconds);
            if timings {
                rep.timings = Some(out.metrics.timings());
            }
            r.policies.push(rep);
            r.series.push((job.policy, out.metrics.held_series.clone()));
        }
        let mut report = Report {
            seed: s.seed,
            fleet: FleetReport {
                p_engines: s.fleet.p_engines,
                d_engines: s.fleet.d_engines,
                p_tp: s.fleet.p_tp,
                d_tp: s.fleet.d_tp,
            },
            model: ModelReport {
                block_tokens: s.model.block_tokens,
                p_blocks: s.model.p_blocks,
                d_blocks: s.model.d_blocks,
                d_max_seqs: s.model.d_max_seqs,
            },
            workload: WorkloadReport {
                rate: (s.workload.rate * 1000.0).round() / 1000.0,
                prompt_tokens: s.workload.prompt_tokens,
                output_tokens: s.workload.output_tokens,
                requests: s.workload.max_requests,
            },
            lease: LeaseReport::of(&s.config),
            sweep: s.sweep.as_ref().map(|sw| SweepReport {
                key: sw.key.clone(),
                values: sw.points.iter().map(|(v, _)| v.clone()).collect(),
            }),
            trace: s.trace.as_ref().map(|t| t.info.clone()),
            runs,
            checks: Vec::new(),
        };
        report.checks = checks::checks(&report);
        report
    }
}
