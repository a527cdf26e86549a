//! The settings a `kvlease sim` invocation runs, from its flags.
//!
//! This module owns turning [`SimArgs`] into [`Settings`]: the operator's
//! `--kv-transfer-config` JSON (through the library's own parser, so the
//! sim accepts exactly what an engine accepts), reading a `--trace` and
//! laying its `--fault`s over it, and refusing anything unusable with a
//! message that names the flag. It runs nothing, except `--auto-size`'s
//! sizing replay ([`crate::trace::sizing`]). The flags themselves are
//! [`crate::args`]'s.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvlease::topology::TpMapping;
use kvlease::{EngineShape, LeaseConfig};
use serde_json::{Map, Value};

use crate::sim::model::{EngineModel, Fleet, Workload};
use crate::sim::policy::Policy;
use crate::sim::replay::{Arrival, TraceRun};
use crate::sim::scenario::{Scenario, ScenarioPlan};
use crate::sim::RunSpec;
use crate::trace::sizing::{self, GpuModel, Sizing};
use crate::trace::stats::TraceStats;
use crate::trace::window::{self, Window};
use crate::trace::{CsvColumns, Format, TraceInfo};

use crate::args::{PolicySel, ScenarioSel, SimArgs};

/// A sweep: the key and, per value, the lease settings it gives.
#[derive(Clone, Debug)]
pub struct Sweep {
    /// The key.
    pub key: String,
    /// (value as written, settings).
    pub points: Vec<(String, LeaseConfig)>,
}

/// Everything a `kvlease sim` invocation runs.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Scenarios, in table order.
    pub scenarios: Vec<Scenario>,
    /// Policies, in table order.
    pub policies: Vec<Policy>,
    /// The seed.
    pub seed: u64,
    /// The fleet.
    pub fleet: Fleet,
    /// Engine sizes and timings.
    pub model: EngineModel,
    /// The workload.
    pub workload: Workload,
    /// A duration override.
    pub duration: Option<Duration>,
    /// The operator's lease settings.
    pub config: LeaseConfig,
    /// Keys of the config the library did not know.
    pub unknown_keys: Vec<String>,
    /// A sweep, if asked.
    pub sweep: Option<Sweep>,
    /// A trace replay, if asked.
    pub trace: Option<TraceSettings>,
}

/// A `--trace` invocation's replay and what the report says about it.
#[derive(Clone, Debug)]
pub struct TraceSettings {
    /// What every run replays.
    pub run: Arc<TraceRun>,
    /// The trace, window, traffic, faults and sizing, for the report.
    pub info: TraceInfo,
}

/// A trace read and windowed, before the fleet is known.
struct TraceInput {
    path: PathBuf,
    format: Format,
    window: Window,
    arrivals: Vec<Arrival>,
    stats: TraceStats,
}

/// Most agents the loopback network takes.
const MAX_AGENTS: u32 = kvlease::fabric::loopback::MAX_AGENTS;

impl SimArgs {
    /// Checks the flags and builds the settings; the error names the flag.
    pub fn settings(&self) -> Result<Settings, String> {
        let input = match &self.trace {
            Some(path) => Some(self.trace_input(path)?),
            None => None,
        };
        let block_tokens = self
            .block_tokens
            .unwrap_or(if input.is_some() { 512 } else { 16 });
        if block_tokens == 0 || block_tokens > 65_536 {
            return Err("--block-tokens must be 1..=65536".into());
        }
        if self.d_max_seqs == 0 || self.d_max_seqs > 4096 {
            return Err("--d-max-seqs must be 1..=4096".into());
        }
        let extra = extra_config(self.kv_transfer_config.as_deref())?;
        let base_model = EngineModel {
            block_tokens,
            p_blocks: self.p_blocks,
            d_blocks: self.d_blocks,
            d_max_seqs: self.d_max_seqs,
            ..EngineModel::default()
        };
        let (fleet, model, sizing) = match &input {
            Some(t) if self.auto_size => {
                let s = self.auto_size(t, &base_model, &extra)?;
                let model = EngineModel {
                    p_blocks: s.p_blocks,
                    d_blocks: s.d_blocks,
                    ..base_model
                };
                (s.fleet(), model, Some(s))
            }
            _ => {
                let (p_engines, d_engines) = self.engines;
                let fleet = Fleet {
                    p_engines,
                    d_engines,
                    p_tp: self.p_tp,
                    d_tp: self.d_tp,
                };
                (fleet, base_model, None)
            }
        };
        check_fleet(&fleet)?;
        if input.is_none() {
            if self.prompt_tokens == 0 || self.prompt_tokens > 65_536 {
                return Err("--prompt-tokens must be 1..=65536".into());
            }
            if self.output_tokens == 0 || self.output_tokens > 65_536 {
                return Err("--output-tokens must be 1..=65536".into());
            }
        }
        // The largest prompt must fit a P engine and the largest request a
        // D engine, or the engine would wait for it forever.
        let (biggest_prompt, biggest_request, what) = match &input {
            Some(t) => (
                t.stats.max_prompt_tokens,
                t.stats.max_request_tokens,
                "the trace's largest",
            ),
            None => {
                let p = self.prompt_tokens + self.prompt_tokens / 2;
                (
                    p,
                    p + self.output_tokens + self.output_tokens / 2,
                    "the largest",
                )
            }
        };
        let need_p = model.blocks_for(biggest_prompt);
        if model.p_blocks < need_p || model.p_blocks > 1 << 24 {
            return Err(format!(
                "--p-blocks must be {need_p}..=16777216 ({what} prompt needs {need_p} blocks of {block_tokens} tokens)"
            ));
        }
        let need_d = model.blocks_for(biggest_request);
        if model.d_blocks < need_d || model.d_blocks > 1 << 24 {
            return Err(format!(
                "--d-blocks must be {need_d}..=16777216 ({what} request needs {need_d} blocks of {block_tokens} tokens)"
            ));
        }
        let workload = match &input {
            Some(t) => Workload {
                rate: t.stats.mean.requests_per_s,
                prompt_tokens: t.stats.mean_prompt_tokens.round() as u32,
                output_tokens: t.stats.mean_output_tokens.round() as u32,
                max_requests: None,
            },
            None => {
                let rate = match self.rate {
                    Some(r) if r.is_finite() && r > 0.0 && r <= 1e6 => r,
                    Some(r) => {
                        return Err(format!(
                            "--rate must be a positive number of requests per second (at most 1e6), got {r}"
                        ))
                    }
                    None => 0.45 * f64::from(fleet.d_engines) * model.d_capacity(self.output_tokens),
                };
                if self.requests == Some(0) {
                    return Err("--requests must be at least 1".into());
                }
                Workload {
                    rate,
                    prompt_tokens: self.prompt_tokens,
                    output_tokens: self.output_tokens,
                    max_requests: self.requests,
                }
            }
        };
        let duration = match self.duration {
            Some(0) => return Err("--duration must be at least 1 second".into()),
            Some(s) if s > 10 * 24 * 3600 => {
                return Err("--duration is at most 864000 seconds (10 days)".into())
            }
            Some(s) => Some(Duration::from_secs(s)),
            None => None,
        };
        let shape = EngineShape {
            num_kv_blocks: model.p_blocks,
            max_num_seqs: model.p_max_seqs,
        };
        let (config, unknown_keys) = lease_config(&extra, shape, &fleet)?;
        let sweep = match &self.sweep {
            None => None,
            Some((key, values)) => {
                let mut points = Vec::new();
                for v in values {
                    let mut e = extra.clone();
                    e.insert(key.clone(), v.clone());
                    let (c, unknown) = lease_config(&e, shape, &fleet)
                        .map_err(|err| format!("--sweep {key}={v}: {err}"))?;
                    if unknown.iter().any(|k| k == key) {
                        return Err(format!(
                            "--sweep {key}: not a kv_connector_extra_config key the library reads"
                        ));
                    }
                    points.push((v.to_string(), c));
                }
                Some(Sweep {
                    key: key.clone(),
                    points,
                })
            }
        };
        let scenarios = if input.is_some() {
            vec![Scenario::Trace]
        } else if self.scenario.contains(&ScenarioSel::All) {
            Scenario::ALL.to_vec()
        } else {
            let mut v: Vec<Scenario> = self.scenario.iter().filter_map(|s| s.scenario()).collect();
            v.sort();
            v.dedup();
            v
        };
        let policies = if self.policy.contains(&PolicySel::All) {
            Policy::ALL.to_vec()
        } else {
            let mut v: Vec<Policy> = self.policy.iter().filter_map(|s| s.policy()).collect();
            v.sort();
            v.dedup();
            v
        };
        if self.jobs == Some(0) {
            return Err("--jobs must be at least 1".into());
        }
        let trace = match input {
            None => None,
            Some(t) => Some(self.trace_settings(t, &fleet, &model, sizing)?),
        };
        Ok(Settings {
            scenarios,
            policies,
            seed: self.seed,
            fleet,
            model,
            workload,
            duration,
            config,
            unknown_keys,
            sweep,
            trace,
        })
    }

    /// Reads `--trace` and applies the window, speed and load scale.
    fn trace_input(&self, path: &std::path::Path) -> Result<TraceInput, String> {
        let speed = self.speed.unwrap_or(1.0);
        if !(speed.is_finite() && speed > 0.0 && speed <= 1000.0) {
            return Err(format!(
                "--speed must be above 0 and at most 1000, got {speed}"
            ));
        }
        let rate_scale = self.rate_scale.unwrap_or(1.0);
        if !(rate_scale.is_finite() && rate_scale > 0.0 && rate_scale <= 100.0) {
            return Err(format!(
                "--rate-scale must be above 0 and at most 100, got {rate_scale}"
            ));
        }
        let from = self.from.unwrap_or(Duration::ZERO);
        if let Some(to) = self.to {
            if to <= from {
                return Err(format!(
                    "--to ({} s) must be after --from ({} s)",
                    to.as_secs_f64(),
                    from.as_secs_f64()
                ));
            }
        }
        let csv = CsvColumns {
            timestamp: self.csv_timestamp.clone(),
            input: self.csv_input.clone(),
            output: self.csv_output.clone(),
            time_unit: self.csv_time_unit.unwrap_or_default(),
        };
        let trace = crate::trace::load(path, self.trace_format, &csv)?;
        let window = Window {
            from,
            to: self.to,
            speed,
            rate_scale,
        };
        let arrivals = window::arrivals(&trace, &window, self.seed)?;
        let last = arrivals.last().map_or(Duration::ZERO, |a| a.at);
        if last > crate::trace::MAX_SPAN {
            return Err(format!(
                "--speed {speed}: the replay would last {:.0} s of run time, more than 10 days",
                last.as_secs_f64()
            ));
        }
        let stats = TraceStats::of(&arrivals, window.requests(&trace), trace.has_prefixes);
        Ok(TraceInput {
            path: path.to_path_buf(),
            format: trace.format,
            window,
            arrivals,
            stats,
        })
    }

    /// `--auto-size`: engine counts and D blocks from the peak load, P
    /// blocks from a sizing replay, TP from the GPU memory model.
    fn auto_size(
        &self,
        t: &TraceInput,
        model: &EngineModel,
        extra: &Map<String, Value>,
    ) -> Result<Sizing, String> {
        let u = self.utilisation.unwrap_or(0.7);
        if !(u.is_finite() && u > 0.0 && u <= 1.0) {
            return Err(format!(
                "--utilisation must be above 0 and at most 1, got {u}"
            ));
        }
        let (p_engines, d_engines, p_busy, d_busy) = sizing::engines(&t.stats, model, u);
        let d_blocks = sizing::d_blocks(&t.arrivals, model, u);
        let mut room = sizing::p_blocks_room(&t.stats, model, p_engines);
        // The sizing replay: TP 1 on both sides (P's blocks do not depend on
        // TP, and fewer workers make it cheaper), nothing failing.
        let fleet = Fleet {
            p_engines,
            d_engines,
            p_tp: 1,
            d_tp: 1,
        };
        check_fleet(&fleet).map_err(|e| format!("--auto-size: {e}"))?;
        let last = t.arrivals.last().map_or(Duration::ZERO, |a| a.at);
        let run = Arc::new(TraceRun {
            arrivals: t.arrivals.clone(),
            plan: ScenarioPlan {
                duration: last + sizing::SIZING_DRAIN,
                surge: None,
                faults: Vec::new(),
                lease_slots: None,
                description: "sizing replay".into(),
            },
        });
        let mut replays = 0;
        let measured = loop {
            replays += 1;
            let m = EngineModel {
                p_blocks: room,
                d_blocks,
                ..model.clone()
            };
            let shape = EngineShape {
                num_kv_blocks: room,
                max_num_seqs: m.p_max_seqs,
            };
            let (config, _) = lease_config(extra, shape, &fleet)?;
            let spec = RunSpec {
                scenario: Scenario::Trace,
                policy: Policy::LeaseVerify,
                config,
                fleet,
                model: m,
                workload: Workload {
                    rate: t.stats.mean.requests_per_s,
                    prompt_tokens: 1,
                    output_tokens: 1,
                    max_requests: None,
                },
                seed: self.seed,
                duration: None,
                trace: Some(Arc::clone(&run)),
            };
            let out = crate::sim::run(&spec, &|_| {})
                .map_err(|e| format!("--auto-size: the sizing replay failed: {e}"))?;
            let peak = out.metrics.peak_engine_blocks_held;
            // A pool the replay (nearly) filled may have held P back: retry
            // with twice the room, a few times at most.
            if (peak as f64) < 0.9 * f64::from(room) || replays == 4 || room >= 1 << 23 {
                break peak;
            }
            room = room.saturating_mul(2).min(1 << 23);
        };
        let p_blocks = sizing::p_blocks(measured, &t.stats, model, u);
        let gpu = GpuModel::default();
        let tp = |blocks: u32, side: &str| {
            gpu.tp_for(blocks, model.block_tokens).ok_or_else(|| {
                format!(
                    "--auto-size: {blocks} {side} blocks of {} tokens need more KV memory than TP 8                      gives under the sizing's GPU model; choose the fleet by hand (--engines, --p-tp,                      --d-tp, --p-blocks, --d-blocks)",
                    model.block_tokens
                )
            })
        };
        Ok(Sizing {
            utilisation: u,
            p_engines,
            d_engines,
            p_tp: tp(p_blocks, "P")?,
            d_tp: tp(d_blocks, "D")?,
            p_blocks,
            d_blocks,
            block_tokens: model.block_tokens,
            p_busy_at_peak: p_busy,
            d_busy_at_peak: d_busy,
            p_blocks_measured: measured,
            sizing_replays: replays,
            gpu,
        })
    }

    /// The replay every run gets: the arrivals and the faults laid over them.
    fn trace_settings(
        &self,
        t: TraceInput,
        fleet: &Fleet,
        model: &EngineModel,
        sizing: Option<Sizing>,
    ) -> Result<TraceSettings, String> {
        let drain = self.drain.unwrap_or(Duration::from_secs(600));
        let last = t.arrivals.last().map_or(Duration::ZERO, |a| a.at);
        let (plan, faults) =
            crate::trace::overlay::plan(&self.fault, &t.window, &t.stats, fleet, last, drain)?;
        let info = TraceInfo {
            file: t.path.display().to_string(),
            format: t.format,
            from_s: t.window.from.as_secs_f64(),
            to_s: t.window.to.map(|d| d.as_secs_f64()),
            speed: t.window.speed,
            rate_scale: t.window.rate_scale,
            block_tokens: model.block_tokens,
            stats: t.stats,
            faults,
            sizing,
        };
        Ok(TraceSettings {
            run: Arc::new(TraceRun {
                arrivals: t.arrivals,
                plan,
            }),
            info,
        })
    }
}

/// Checks a fleet the engines can be built for; the error names the flags.
fn check_fleet(fleet: &Fleet) -> Result<(), String> {
    let (p_tp, d_tp) = (fleet.p_tp, fleet.d_tp);
    if p_tp == 0 || d_tp == 0 || p_tp > 64 || d_tp > 64 {
        return Err("--p-tp and --d-tp must be 1..=64".into());
    }
    let mapping =
        TpMapping::new(d_tp, p_tp).map_err(|e| format!("--p-tp {p_tp} / --d-tp {d_tp}: {e}"))?;
    // The simulator runs with the default kv_lease_max_fan_out.
    let max_fan_out = kvlease::config::DEFAULT_MAX_FAN_OUT;
    if mapping.fan_out() > max_fan_out {
        return Err(format!(
            "--p-tp {p_tp} / --d-tp {d_tp}: a D worker would read from {} P ranks; at most {max_fan_out} (kv_lease_max_fan_out) are supported",
            mapping.fan_out(),
        ));
    }
    if u64::from(fleet.p_engines) * u64::from(p_tp) + u64::from(fleet.d_engines) * u64::from(d_tp)
        > u64::from(MAX_AGENTS)
    {
        return Err(format!(
            "--engines {}:{} with TP {p_tp}/{d_tp} needs more than {MAX_AGENTS} workers (the loopback fabric's limit)",
            fleet.p_engines, fleet.d_engines
        ));
    }
    Ok(())
}

/// The kv_connector_extra_config object of `--kv-transfer-config` (the
/// whole object's member, or the object itself).
fn extra_config(json: Option<&str>) -> Result<Map<String, Value>, String> {
    let Some(json) = json else {
        return Ok(Map::new());
    };
    // The library's parser gives the precise message for bad JSON and bad
    // values; this only finds the object to layer the sim's sizes under.
    let value: Value = serde_json::from_str(json).map_err(|e| {
        match LeaseConfig::from_extra_config_json(
            json,
            EngineShape {
                num_kv_blocks: 1,
                max_num_seqs: 1,
            },
        ) {
            Err(lib) => format!("--kv-transfer-config: {lib}"),
            Ok(_) => format!("--kv-transfer-config: not valid JSON: {e}"),
        }
    })?;
    let obj = match &value {
        Value::Object(o) => match o.get("kv_connector_extra_config") {
            Some(Value::Object(inner)) => inner.clone(),
            Some(_) => {
                return Err(
                    "--kv-transfer-config: kv_connector_extra_config must be a JSON object".into(),
                )
            }
            None => o.clone(),
        },
        _ => return Err("--kv-transfer-config must be a JSON object".into()),
    };
    Ok(obj)
}

/// Parses `extra` with the library, under the simulator's capacity defaults
/// for keys the operator did not set (ids are short here, D queues are
/// bounded by the run, and a 64-engine fleet needs 64 remote engines).
fn lease_config(
    extra: &Map<String, Value>,
    shape: EngineShape,
    fleet: &Fleet,
) -> Result<(LeaseConfig, Vec<String>), String> {
    let mut obj = extra.clone();
    let defaults = [
        ("kv_lease_max_request_id_len", Value::from(32)),
        ("kv_lease_max_tracked_requests", Value::from(8192)),
        (
            "kv_lease_max_remote_engines",
            Value::from(fleet.p_engines.max(64)),
        ),
    ];
    for (k, v) in defaults {
        obj.entry(k).or_insert(v);
    }
    let text = Value::Object(obj).to_string();
    let parsed = LeaseConfig::from_extra_config_json(&text, shape)
        .map_err(|e| format!("--kv-transfer-config: {e}"))?;
    if parsed.config.max_remote_engines < fleet.p_engines {
        return Err(format!(
            "--kv-transfer-config: kv_lease_max_remote_engines = {} is below the {} P engines",
            parsed.config.max_remote_engines, fleet.p_engines
        ));
    }
    Ok((parsed.config, parsed.unknown_keys))
}
