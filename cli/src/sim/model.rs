//! The engine around the lease machinery: sizes and timings of the modelled
//! P and D engines, the fleet, and the workload.
//!
//! This module owns every number the simulator *invents* (the library's
//! numbers come from [`kvlease::LeaseConfig`]): how long a forward step
//! takes, how many KV blocks an engine has, how many sequences D decodes at
//! once, how long a READ and the router take, and the request mix. They are
//! plain values with defaults a command line can override; nothing here
//! calls the library.

use std::time::Duration;

/// Sizes and timings of one P and one D engine (every engine of a side is
/// alike).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineModel {
    /// Tokens per KV block (vLLM's `block_size`).
    pub block_tokens: u32,
    /// KV blocks in each P engine's cache.
    pub p_blocks: u32,
    /// P's `max_num_seqs` (feeds the lease-slot default).
    pub p_max_seqs: u32,
    /// Prompt tokens one P step prefills at most (`max_num_batched_tokens`).
    pub p_batch_tokens: u32,
    /// P step: fixed cost ...
    pub p_step_base: Duration,
    /// ... plus this per prefilled token.
    pub p_step_per_token: Duration,
    /// KV blocks in each D engine's cache.
    pub d_blocks: u32,
    /// Sequences one D engine loads or decodes at once (`max_num_seqs`).
    pub d_max_seqs: u32,
    /// D step: fixed cost ...
    pub d_step_base: Duration,
    /// ... plus this per running sequence (one token each) ...
    pub d_step_per_seq: Duration,
    /// ... plus this per token D prefills itself (a failed KV load,
    /// `kv_load_failure_policy = recompute`).
    pub d_step_per_prefill_token: Duration,
    /// How often an idle engine runs its loop (it still polls its leases).
    pub idle_poll: Duration,
    /// Router: P's response to D's request (the proxy hop).
    pub proxy_latency: Duration,
    /// One RDMA READ (the loopback fabric's `read_latency`).
    pub read_latency: Duration,
    /// A READ not complete after this fails (the fabric's transfer timeout).
    pub transfer_timeout: Duration,
}

impl Default for EngineModel {
    fn default() -> Self {
        EngineModel {
            block_tokens: 16,
            p_blocks: 16_384,
            p_max_seqs: 256,
            p_batch_tokens: 8192,
            p_step_base: Duration::from_millis(4),
            p_step_per_token: Duration::from_micros(20),
            d_blocks: 16_384,
            d_max_seqs: 32,
            d_step_base: Duration::from_millis(8),
            d_step_per_seq: Duration::from_micros(500),
            d_step_per_prefill_token: Duration::from_micros(20),
            idle_poll: Duration::from_millis(50),
            proxy_latency: Duration::from_millis(2),
            read_latency: Duration::from_millis(5),
            transfer_timeout: Duration::from_secs(120),
        }
    }
}

impl EngineModel {
    /// KV blocks a prompt of `tokens` occupies.
    pub fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.block_tokens).max(1)
    }

    /// Requests per second one D engine finishes when saturated, for
    /// requests of `output_tokens` on average: `d_max_seqs` sequences, one
    /// token each per step. Used to size the default arrival rate.
    pub fn d_capacity(&self, output_tokens: u32) -> f64 {
        let step = self.d_step_base + self.d_step_per_seq * self.d_max_seqs;
        f64::from(self.d_max_seqs) / (f64::from(output_tokens.max(1)) * step.as_secs_f64())
    }
}

/// How many engines, and their tensor-parallel sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fleet {
    /// P engines.
    pub p_engines: u32,
    /// D engines.
    pub d_engines: u32,
    /// Workers (TP ranks) per P engine.
    pub p_tp: u32,
    /// Workers (TP ranks) per D engine.
    pub d_tp: u32,
}

impl Fleet {
    /// Fabric agents the fleet needs (one per worker).
    pub fn agents(&self) -> u32 {
        self.p_engines * self.p_tp + self.d_engines * self.d_tp
    }
}

/// The request mix and arrival rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Workload {
    /// Mean arrivals per second (Poisson), fleet-wide, outside surges.
    pub rate: f64,
    /// Mean prompt tokens (uniform in [mean/2, 3*mean/2]).
    pub prompt_tokens: u32,
    /// Mean output tokens (uniform in [mean/2, 3*mean/2]).
    pub output_tokens: u32,
    /// Stop arriving after this many requests (fleet runs); `None`: the
    /// scenario's duration alone ends arrivals.
    pub max_requests: Option<u64>,
}
