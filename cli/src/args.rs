//! The command line: flags, their help, and the settings they yield.
//!
//! This module owns turning flags into a [`Settings`]: parsing `P:D`,
//! `KEY=V1,V2`, the operator's `--kv-transfer-config` JSON (through the
//! library's own parser, so the sim accepts exactly what an engine
//! accepts), and refusing anything unusable with a message that names the
//! flag. It runs nothing.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvlease::topology::TpMapping;
use kvlease::{EngineShape, LeaseConfig};
use serde_json::{Map, Value};

use crate::sim::model::{EngineModel, Fleet, Workload};
use crate::sim::policy::Policy;
use crate::sim::scenario::Scenario;

/// KV-cache leases for disaggregated prefill/decode serving.
#[derive(Debug, Parser)]
#[command(name = "kvlease", version, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Simulate a P/D deployment in virtual time on the real lease machinery
    /// (P scheduler and ranks, D tracker, sender and verifier, the wire
    /// codec and the role messages, over the loopback fabric) and compare
    /// lease policies under failures.
    ///
    /// Every scenario runs every policy on the same seed: lease renewal with
    /// verification (lease+verify), without (lease-noverify), and vLLM's
    /// fixed timeouts before leases, 480 s and 30 s (fixed-480, fixed-30:
    /// unrenewed, unverified leases of that length). `bidirectional-skew`
    /// runs turn-2 reads from D's cache across skewed clocks instead, in a
    /// small world of its own.
    Sim(SimArgs),
}

/// Which scenarios to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScenarioSel {
    /// Every scenario below.
    All,
    /// Steady traffic, nothing fails.
    Happy,
    /// D engine 0 dies at 90 s during a surge; the run lasts until a 480 s
    /// timeout has run out.
    DecodeCrash,
    /// A x4 surge keeps requests in D's queue far longer than the lease.
    Overload,
    /// D engine 0's notifications to P are lost for 90 s while its queue is long.
    HeartbeatLoss,
    /// D engine 0's READs take +45 s while its heartbeats are lost: leases
    /// lapse mid-READ and P reuses the blocks.
    MidreadLapse,
    /// kv_lease_slots = 64 per P worker during a surge.
    SlotExhaustion,
    /// One P rank hears no notification for 140 s while its peer does.
    RankDivergence,
    /// Turn 2 of multi-turn conversations pulled from D's cache, D's clock
    /// 2 h ahead and 80 ppm fast, slow READs.
    BidirectionalSkew,
}

/// Which policies to compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PolicySel {
    /// Every policy below.
    All,
    /// Lease renewal by heartbeats, D verifies after its READ.
    #[value(name = "lease+verify")]
    LeaseVerify,
    /// Lease renewal by heartbeats, no verification.
    #[value(name = "lease-noverify")]
    LeaseNoVerify,
    /// A fixed 480 s timeout (vLLM before leases).
    #[value(name = "fixed-480")]
    Fixed480,
    /// A fixed 30 s timeout.
    #[value(name = "fixed-30")]
    Fixed30,
}

/// `kvlease sim` flags.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Scenarios to run, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "all")]
    pub scenario: Vec<ScenarioSel>,

    /// Policies to compare, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "all")]
    pub policy: Vec<PolicySel>,

    /// Seed of every random draw (arrivals, request sizes, nonces, fault
    /// draws). The same seed gives the same run, byte for byte in --json.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// The fleet: P engines and D engines, as P:D (e.g. 64:64).
    #[arg(long, default_value = "2:2", value_parser = parse_engines)]
    pub engines: (u32, u32),

    /// Tensor-parallel size (workers) of every P engine.
    #[arg(long, default_value_t = 2)]
    pub p_tp: u32,

    /// Tensor-parallel size (workers) of every D engine. P TP and D TP must
    /// divide one another; a D worker reads from at most 8 P ranks.
    #[arg(long, default_value_t = 1)]
    pub d_tp: u32,

    /// Mean request arrivals per second, fleet-wide, outside surges
    /// (Poisson). Default: 45% of what the D engines can decode.
    #[arg(long)]
    pub rate: Option<f64>,

    /// Mean prompt tokens per request (uniform in [mean/2, 3*mean/2]).
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: u32,

    /// Mean output tokens per request (uniform in [mean/2, 3*mean/2]).
    #[arg(long, default_value_t = 256)]
    pub output_tokens: u32,

    /// Stop arrivals after this many requests and run until every one is
    /// settled (fleet-scale runs). Without it each scenario runs for its
    /// own duration.
    #[arg(long)]
    pub requests: Option<u64>,

    /// Run each scenario for this many virtual seconds instead of its own
    /// duration (with --requests: a cap).
    #[arg(long)]
    pub duration: Option<u64>,

    /// KV blocks per P engine (16 tokens each).
    #[arg(long, default_value_t = 16_384)]
    pub p_blocks: u32,

    /// KV blocks per D engine.
    #[arg(long, default_value_t = 16_384)]
    pub d_blocks: u32,

    /// Sequences one D engine loads or decodes at once (max_num_seqs).
    #[arg(long, default_value_t = 32)]
    pub d_max_seqs: u32,

    /// The engine's --kv-transfer-config JSON: the whole object or just its
    /// kv_connector_extra_config (kv_lease_duration, kv_lease_slots, ...),
    /// parsed by the library exactly as an engine parses it. Policies then
    /// set kv_lease_verification (and the fixed ones the duration);
    /// slot-exhaustion sets kv_lease_slots. Unknown keys are reported.
    #[arg(long, value_name = "JSON")]
    pub kv_transfer_config: Option<String>,

    /// Run everything once per value of a kv_connector_extra_config key and
    /// print the trade-off table (reclaim time after a crash versus
    /// premature frees), e.g. kv_lease_duration=10,30,60,120.
    #[arg(long, value_name = "KEY=V1,V2,...", value_parser = parse_sweep)]
    pub sweep: Option<(String, Vec<Value>)>,

    /// Print the report as JSON on stdout instead of the table. Deterministic:
    /// the same flags and seed give the same bytes (no wall-clock timings).
    #[arg(long)]
    pub json: bool,

    /// Include the measured lease CPU per engine step in --json (these vary
    /// from run to run, so the JSON is then no longer byte-identical).
    #[arg(long, requires = "json")]
    pub json_timings: bool,

    /// Write an SVG of the blocks P holds over time, one line per policy,
    /// one panel per scenario (and per sweep value).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,

    /// Runs simulated in parallel (default: the machine's cores).
    #[arg(long)]
    pub jobs: Option<usize>,
}

fn parse_engines(s: &str) -> Result<(u32, u32), String> {
    let (p, d) = s
        .split_once(':')
        .ok_or_else(|| format!("expected P:D (e.g. 2:2), got {s:?}"))?;
    let num = |x: &str, what: &str| -> Result<u32, String> {
        let n: u32 = x
            .trim()
            .parse()
            .map_err(|_| format!("{what} engines must be a whole number, got {x:?}"))?;
        if n == 0 {
            return Err(format!("{what} engines must be at least 1"));
        }
        Ok(n)
    };
    Ok((num(p, "P")?, num(d, "D")?))
}

fn parse_sweep(s: &str) -> Result<(String, Vec<Value>), String> {
    let (key, values) = s.split_once('=').ok_or_else(|| {
        format!("expected KEY=V1,V2,... (e.g. kv_lease_duration=10,30,60), got {s:?}")
    })?;
    let key = key.trim();
    if key.is_empty() {
        return Err("the sweep key is empty".into());
    }
    let mut out = Vec::new();
    for v in values.split(',') {
        let v = v.trim();
        if v.is_empty() {
            return Err(format!("empty value in sweep {s:?}"));
        }
        // Each value is JSON (30, 45.5, true); anything else is a string.
        out.push(serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_string())));
    }
    Ok((key.to_string(), out))
}

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
}

/// Most agents the loopback network takes.
const MAX_AGENTS: u32 = kvlease::fabric::loopback::MAX_AGENTS;

impl SimArgs {
    /// Checks the flags and builds the settings; the error names the flag.
    pub fn settings(&self) -> Result<Settings, String> {
        let (p_engines, d_engines) = self.engines;
        if self.p_tp == 0 || self.d_tp == 0 || self.p_tp > 64 || self.d_tp > 64 {
            return Err("--p-tp and --d-tp must be 1..=64".into());
        }
        let mapping = TpMapping::new(self.d_tp, self.p_tp)
            .map_err(|e| format!("--p-tp {} / --d-tp {}: {e}", self.p_tp, self.d_tp))?;
        // The simulator runs with the default kv_lease_max_fan_out.
        let max_fan_out = kvlease::config::DEFAULT_MAX_FAN_OUT;
        if mapping.fan_out() > max_fan_out {
            return Err(format!(
                "--p-tp {} / --d-tp {}: a D worker would read from {} P ranks; at most {max_fan_out} (kv_lease_max_fan_out) are supported",
                self.p_tp,
                self.d_tp,
                mapping.fan_out(),
            ));
        }
        let fleet = Fleet {
            p_engines,
            d_engines,
            p_tp: self.p_tp,
            d_tp: self.d_tp,
        };
        if u64::from(p_engines) * u64::from(self.p_tp) + u64::from(d_engines) * u64::from(self.d_tp)
            > u64::from(MAX_AGENTS)
        {
            return Err(format!(
                "--engines {p_engines}:{d_engines} with TP {}/{} needs more than {MAX_AGENTS} workers (the loopback fabric's limit)",
                self.p_tp, self.d_tp
            ));
        }
        let model = EngineModel {
            p_blocks: self.p_blocks,
            d_blocks: self.d_blocks,
            d_max_seqs: self.d_max_seqs,
            ..EngineModel::default()
        };
        if self.prompt_tokens == 0 || self.prompt_tokens > 65_536 {
            return Err("--prompt-tokens must be 1..=65536".into());
        }
        if self.output_tokens == 0 || self.output_tokens > 65_536 {
            return Err("--output-tokens must be 1..=65536".into());
        }
        if self.d_max_seqs == 0 || self.d_max_seqs > 4096 {
            return Err("--d-max-seqs must be 1..=4096".into());
        }
        let biggest = self.prompt_tokens + self.prompt_tokens / 2;
        let need_p = model.blocks_for(biggest);
        if self.p_blocks < need_p || self.p_blocks > 1 << 24 {
            return Err(format!(
                "--p-blocks must be {need_p}..=16777216 (the largest prompt needs {need_p} blocks)"
            ));
        }
        let need_d = model.blocks_for(biggest + self.output_tokens + self.output_tokens / 2);
        if self.d_blocks < need_d || self.d_blocks > 1 << 24 {
            return Err(format!(
                "--d-blocks must be {need_d}..=16777216 (the largest request needs {need_d} blocks)"
            ));
        }
        let rate = match self.rate {
            Some(r) if r.is_finite() && r > 0.0 && r <= 1e6 => r,
            Some(r) => {
                return Err(format!(
                "--rate must be a positive number of requests per second (at most 1e6), got {r}"
            ))
            }
            None => 0.45 * f64::from(d_engines) * model.d_capacity(self.output_tokens),
        };
        let workload = Workload {
            rate,
            prompt_tokens: self.prompt_tokens,
            output_tokens: self.output_tokens,
            max_requests: self.requests,
        };
        if self.requests == Some(0) {
            return Err("--requests must be at least 1".into());
        }
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
        let extra = extra_config(self.kv_transfer_config.as_deref())?;
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
        let scenarios = if self.scenario.contains(&ScenarioSel::All) {
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
        })
    }
}

impl ScenarioSel {
    fn scenario(self) -> Option<Scenario> {
        Some(match self {
            ScenarioSel::All => return None,
            ScenarioSel::Happy => Scenario::Happy,
            ScenarioSel::DecodeCrash => Scenario::DecodeCrash,
            ScenarioSel::Overload => Scenario::Overload,
            ScenarioSel::HeartbeatLoss => Scenario::HeartbeatLoss,
            ScenarioSel::MidreadLapse => Scenario::MidreadLapse,
            ScenarioSel::SlotExhaustion => Scenario::SlotExhaustion,
            ScenarioSel::RankDivergence => Scenario::RankDivergence,
            ScenarioSel::BidirectionalSkew => Scenario::BidirectionalSkew,
        })
    }
}

impl PolicySel {
    fn policy(self) -> Option<Policy> {
        Some(match self {
            PolicySel::All => return None,
            PolicySel::LeaseVerify => Policy::LeaseVerify,
            PolicySel::LeaseNoVerify => Policy::LeaseNoVerify,
            PolicySel::Fixed480 => Policy::Fixed480,
            PolicySel::Fixed30 => Policy::Fixed30,
        })
    }
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
