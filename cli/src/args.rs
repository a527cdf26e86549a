//! The command line: the flags and their help.
//!
//! This module owns what clap parses: the commands, every flag with its
//! help and default, and the values a single flag carries (`P:D`,
//! `KEY=V1,V2`, a scenario or policy name). Checking the flags together and
//! turning them into the [`Settings`](crate::settings::Settings) a run needs
//! is [`crate::settings`]'s.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::Value;

use crate::sim::policy::Policy;
use crate::sim::scenario::Scenario;
use crate::trace::overlay::{parse_fault, FaultSpec};
use crate::trace::window::parse_time;
use crate::trace::{Format, TimeUnit};

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
    /// small world of its own; `push-faults` runs vLLM's push mode, where
    /// the lease policies run kvlease's push guard, fixed-480 stock vLLM (D
    /// frees only on P's report) and fixed-30 a naive D timeout.
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
    /// vLLM's push mode: late, lost and aborted registrations, slow WRITEs,
    /// lossy notifications, and P dies at 150 s.
    PushFaults,
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
    /// divide one another; a D worker reads from at most 16 P ranks (the
    /// default kv_lease_max_fan_out).
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

    /// Replay this request trace instead of Poisson arrivals: Mooncake's
    /// JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`)
    /// or a CSV with a header row (see --csv-timestamp). The four policies
    /// run on the same replay; faults are laid over it with --fault.
    /// data/traces/ has two Mooncake traces.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with_all = ["scenario", "rate", "prompt_tokens", "output_tokens", "requests"]
    )]
    pub trace: Option<PathBuf>,

    /// The trace's format [default: from the extension (.jsonl, .csv), else
    /// from the first character].
    #[arg(long, value_enum, requires = "trace")]
    pub trace_format: Option<Format>,

    /// CSV: the arrival-time column [default: TIMESTAMP, time, arrival_time
    /// (the first the header has, any case)]. Numbers are in
    /// --csv-time-unit; date-times (YYYY-MM-DD HH:MM:SS[.frac], UTC) are read
    /// as such.
    #[arg(long, value_name = "COLUMN", requires = "trace")]
    pub csv_timestamp: Option<String>,

    /// CSV: the prompt-token column [default: ContextTokens, "Request
    /// tokens", input_length, input_tokens, prompt_tokens].
    #[arg(long, value_name = "COLUMN", requires = "trace")]
    pub csv_input: Option<String>,

    /// CSV: the output-token column [default: GeneratedTokens, "Response
    /// tokens", output_length, output_tokens, completion_tokens].
    #[arg(long, value_name = "COLUMN", requires = "trace")]
    pub csv_output: Option<String>,

    /// CSV: the unit of numeric timestamps [default: s].
    #[arg(long, value_enum, requires = "trace")]
    pub csv_time_unit: Option<TimeUnit>,

    /// Replay from this trace time (seconds since the trace's first request,
    /// or 36m, 1h5m, 36m30s).
    #[arg(long, value_name = "TIME", value_parser = parse_time, requires = "trace")]
    pub from: Option<Duration>,

    /// Replay up to this trace time (exclusive) [default: the end].
    #[arg(long, value_name = "TIME", value_parser = parse_time, requires = "trace")]
    pub to: Option<Duration>,

    /// Time scale: trace seconds per simulated second (2 replays an hour in
    /// 30 minutes) [default: 1].
    #[arg(long, value_name = "X", requires = "trace")]
    pub speed: Option<f64>,

    /// Replay at this multiple of the recorded load over the same time (1.5:
    /// each request once, half of them twice; 0.5: half of them) [default: 1].
    #[arg(long, value_name = "K", requires = "trace")]
    pub rate_scale: Option<f64>,

    /// A fault laid over the trace, `KIND@WHEN[+LENGTH][/ENGINE]` (repeatable):
    /// KIND is decode-crash, heartbeat-loss (default 90 s), midread-lapse
    /// (60 s), rank-divergence (140 s), or slot-exhaustion (no time: the
    /// whole replay); WHEN a trace time (20m, 1200) or `busiest` (the middle
    /// of the busiest minute); LENGTH in seconds (+90, +2m); ENGINE d1 (a D
    /// engine; p1 for rank-divergence), engine 0 by default.
    #[arg(long, value_name = "KIND@WHEN[+LENGTH][/ENGINE]", value_parser = parse_fault, requires = "trace")]
    pub fault: Vec<FaultSpec>,

    /// Keep simulating this long after the last arrival (or fault) for
    /// requests to settle; the run ends earlier once all have [default: 600,
    /// longer than a 480 s timeout].
    #[arg(long, value_name = "TIME", value_parser = parse_time, requires = "trace")]
    pub drain: Option<Duration>,

    /// Choose the fleet (P and D engines, TP, blocks per engine) so that the
    /// trace's peak 60 s of load fits at --utilisation, and print it.
    #[arg(
        long,
        requires = "trace",
        conflicts_with_all = ["engines", "p_tp", "d_tp", "p_blocks", "d_blocks"]
    )]
    pub auto_size: bool,

    /// The utilisation --auto-size sizes the peak load to [default: 0.7].
    #[arg(long, value_name = "U", requires = "auto_size")]
    pub utilisation: Option<f64>,

    /// Tokens per KV block [default: 16; with --trace 512, the trace's
    /// prefix block, about 24 blocks per Mooncake request].
    #[arg(long, value_name = "N")]
    pub block_tokens: Option<u32>,
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

impl ScenarioSel {
    pub(crate) fn scenario(self) -> Option<Scenario> {
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
            ScenarioSel::PushFaults => Scenario::PushFaults,
        })
    }
}

impl PolicySel {
    pub(crate) fn policy(self) -> Option<Policy> {
        Some(match self {
            PolicySel::All => return None,
            PolicySel::LeaseVerify => Policy::LeaseVerify,
            PolicySel::LeaseNoVerify => Policy::LeaseNoVerify,
            PolicySel::Fixed480 => Policy::Fixed480,
            PolicySel::Fixed30 => Policy::Fixed30,
        })
    }
}
