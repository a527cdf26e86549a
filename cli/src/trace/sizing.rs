//! `--auto-size`: a fleet for a trace's peak load at a stated utilisation.
//!
//! This module owns the sizing rules; every figure they use is printed
//! with the fleet they choose (see [`Sizing::explain`]). It runs nothing:
//! the sizing replay that measures P's blocks is run by [`crate::args`]
//! with these rules' inputs.
//!
//! - **P engines**: the peak 60 s of prompt tokens, at the model's prefill
//!   cost (`p_step_per_token` per token, `p_step_base` per request, an upper
//!   bound: a large prompt is a step of its own), is at most `utilisation` of
//!   the P engines' time.
//! - **D engines**: the peak 60 s of output tokens, one per sequence per
//!   decode step, with full batches (`d_max_seqs` sequences in a step of
//!   `d_step_base + d_max_seqs * d_step_per_seq`), is at most `utilisation`
//!   of the D engines' time.
//! - **D blocks per engine**: `d_max_seqs` requests of the replay's mean
//!   size (prompt + output, in blocks) fill `utilisation` of the pool; at
//!   least the largest request fits.
//! - **P blocks per engine**: measured, not guessed: how long P holds a
//!   prompt's blocks depends on D's queues, which only a run shows. A
//!   replay of the window with nothing failing (lease+verify) runs with
//!   room for a peak minute of prompts per engine (doubled while the run
//!   fills it); the most any P engine held is then `utilisation` of the pool.
//! - **TP**: the smallest of 1, 2, 4, 8 whose KV memory holds the engine's
//!   blocks, under [`GpuModel`] (a 70B model with 16-bit weights on 80 GB
//!   GPUs). The step timings do not change with TP: TP buys memory here.

use std::time::Duration;

use serde::Serialize;

use super::stats::TraceStats;
use crate::sim::model::{EngineModel, Fleet};
use crate::sim::replay::Arrival;

/// The memory of the GPUs the sizing assumes (invented numbers, like the
/// rest of [`EngineModel`]; the trace says nothing about its model).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct GpuModel {
    /// Memory per GPU, bytes (an 80 GB H100/A100).
    pub gpu_bytes: u64,
    /// Kept back per GPU for activations, CUDA graphs and the runtime.
    pub reserve_bytes: u64,
    /// Model weights, bytes, split over the TP ranks (70B parameters at 16 bits).
    pub weights_bytes: u64,
    /// KV cache per token, bytes, over all ranks (a 70B model with grouped
    /// query attention: 80 layers x 8 KV heads x 128 dims x K and V x 2 bytes).
    pub kv_bytes_per_token: u64,
}

impl Default for GpuModel {
    fn default() -> Self {
        GpuModel {
            gpu_bytes: 80_000_000_000,
            reserve_bytes: 8_000_000_000,
            weights_bytes: 140_000_000_000,
            kv_bytes_per_token: 80 * 8 * 128 * 2 * 2,
        }
    }
}

impl GpuModel {
    /// KV tokens an engine of `tp` GPUs holds (0 if the weights do not fit).
    pub fn kv_tokens(&self, tp: u32) -> u64 {
        let free = (self.gpu_bytes.saturating_sub(self.reserve_bytes) * u64::from(tp))
            .saturating_sub(self.weights_bytes);
        free / self.kv_bytes_per_token.max(1)
    }

    /// The smallest TP (1, 2, 4, 8) whose KV memory holds `blocks` of
    /// `block_tokens`; `None` if even 8 does not.
    pub fn tp_for(&self, blocks: u32, block_tokens: u32) -> Option<u32> {
        let tokens = u64::from(blocks) * u64::from(block_tokens);
        [1, 2, 4, 8]
            .into_iter()
            .find(|&tp| self.kv_tokens(tp) >= tokens)
    }
}

/// The sizing's choices and the figures behind them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sizing {
    /// The utilisation the peak load is sized to.
    pub utilisation: f64,
    /// The fleet.
    pub p_engines: u32,
    /// D engines.
    pub d_engines: u32,
    /// P TP.
    pub p_tp: u32,
    /// D TP.
    pub d_tp: u32,
    /// KV blocks per P engine.
    pub p_blocks: u32,
    /// KV blocks per D engine.
    pub d_blocks: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// P engine-seconds of prefill per second at the peak.
    pub p_busy_at_peak: f64,
    /// D engine-seconds of decode per second at the peak.
    pub d_busy_at_peak: f64,
    /// Most blocks one P engine held in the sizing replay.
    pub p_blocks_measured: u64,
    /// Sizing replays run (a replay that filled its P pools is run again
    /// with twice the room).
    pub sizing_replays: u32,
    /// The GPU memory model.
    pub gpu: GpuModel,
}

impl Sizing {
    /// The fleet it chose.
    pub fn fleet(&self) -> Fleet {
        Fleet {
            p_engines: self.p_engines,
            d_engines: self.d_engines,
            p_tp: self.p_tp,
            d_tp: self.d_tp,
        }
    }

    /// The chosen fleet and why, for the terminal.
    pub fn explain(&self) -> String {
        let u = self.utilisation * 100.0;
        let gb = |b: u64| b as f64 / 1e9;
        format!(
            "auto-size at {u:.0}% utilisation of the peak 60 s: {} P x TP{} + {} D x TP{}, \
             {} P blocks and {} D blocks per engine ({} tokens each)\n\
             \x20 P: prefill needs {:.2} engine-s/s at the peak -> {} engines; \
             a replay with nothing failing held at most {} blocks on one P engine -> {} blocks\n\
             \x20 D: decode needs {:.2} engine-s/s at the peak -> {} engines; \
             {} blocks hold d_max_seqs mean-size requests at {u:.0}%\n\
             \x20 TP: the smallest of 1/2/4/8 whose KV memory holds the blocks \
             ({:.0} GB GPUs, {:.0} GB reserved each, {:.0} GB of weights, {} KiB of KV per token)",
            self.p_engines,
            self.p_tp,
            self.d_engines,
            self.d_tp,
            self.p_blocks,
            self.d_blocks,
            self.block_tokens,
            self.p_busy_at_peak,
            self.p_engines,
            self.p_blocks_measured,
            self.p_blocks,
            self.d_busy_at_peak,
            self.d_engines,
            self.d_blocks,
            gb(self.gpu.gpu_bytes),
            gb(self.gpu.reserve_bytes),
            gb(self.gpu.weights_bytes),
            self.gpu.kv_bytes_per_token / 1024,
        )
    }
}

/// Engine counts for the peak load (see the module docs): (P engines,
/// D engines, P busy at the peak, D busy at the peak).
pub fn engines(stats: &TraceStats, model: &EngineModel, utilisation: f64) -> (u32, u32, f64, f64) {
    let peak = &stats.peak_60s;
    let p_busy = peak.prompt_tokens_per_s * model.p_step_per_token.as_secs_f64()
        + peak.requests_per_s * model.p_step_base.as_secs_f64();
    let full_step = model.d_step_base + model.d_step_per_seq * model.d_max_seqs;
    let d_busy = peak.output_tokens_per_s * full_step.as_secs_f64() / f64::from(model.d_max_seqs);
    let count = |busy: f64| (ceil(busy / utilisation) as u32).max(1);
    (count(p_busy), count(d_busy), p_busy, d_busy)
}

/// D blocks per engine (see the module docs).
pub fn d_blocks(arrivals: &[Arrival], model: &EngineModel, utilisation: f64) -> u32 {
    let blocks = |a: &Arrival| model.blocks_for(a.prompt.saturating_add(a.output));
    let mean =
        arrivals.iter().map(|a| f64::from(blocks(a))).sum::<f64>() / arrivals.len().max(1) as f64;
    let largest = arrivals.iter().map(blocks).max().unwrap_or(1);
    let full = ceil(f64::from(model.d_max_seqs) * mean / utilisation) as u32;
    full.max(largest)
}

/// Room for the sizing replay's P pools: a peak minute of prompts per engine.
pub fn p_blocks_room(stats: &TraceStats, model: &EngineModel, p_engines: u32) -> u32 {
    let minute_tokens = stats.peak_60s.prompt_tokens_per_s * 60.0;
    let per_engine = minute_tokens / f64::from(p_engines.max(1)) / f64::from(model.block_tokens);
    (per_engine.ceil() as u32).max(model.blocks_for(stats.max_prompt_tokens))
}

/// P blocks per engine from the sizing replay's measured peak.
pub fn p_blocks(measured_peak: u64, stats: &TraceStats, model: &EngineModel, u: f64) -> u32 {
    let sized = ceil(measured_peak as f64 / u).min(f64::from(u32::MAX)) as u32;
    sized.max(model.blocks_for(stats.max_prompt_tokens))
}

/// `x` rounded up, forgiving the last bits of a division (70 / 0.7 is
/// 100.00000000000001 in binary: 100 blocks, not 101).
fn ceil(x: f64) -> f64 {
    (x - 1e-9).ceil()
}

/// The sizing replay's cap after its last arrival: long enough for D's
/// queues to drain, short enough to stay cheap.
pub const SIZING_DRAIN: Duration = Duration::from_secs(120);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::stats::Load;

    #[test]
    fn tp_is_the_smallest_that_holds_the_blocks() {
        let g = GpuModel::default();
        // 70B at 16 bits does not fit one 80 GB GPU; TP 2 leaves 4 GB.
        assert_eq!(g.kv_tokens(1), 0);
        assert_eq!(g.kv_tokens(2), 4_000_000_000 / 327_680);
        assert_eq!(g.tp_for(20, 512), Some(2));
        assert_eq!(g.tp_for(800, 512), Some(4));
        assert_eq!(g.tp_for(2000, 512), Some(8));
        assert_eq!(g.tp_for(5000, 512), None);
    }

    #[test]
    fn engine_counts_follow_the_peak_and_the_utilisation() {
        let model = EngineModel::default();
        let stats = TraceStats {
            requests: 0,
            span_s: 0.0,
            mean_prompt_tokens: 0.0,
            mean_output_tokens: 0.0,
            max_prompt_tokens: 1000,
            max_request_tokens: 1000,
            mean: Load::default(),
            // 50,000 prompt tokens/s at 20 us = 1.0 s/s (+ 4 ms x 4 req/s);
            // 1,600 output tokens/s at 24 ms per 32 = 1.2 s/s.
            peak_60s: Load {
                requests_per_s: 4.0,
                prompt_tokens_per_s: 50_000.0,
                output_tokens_per_s: 1600.0,
            },
            busiest_minute_s: 0.0,
            busiest_minute_requests: 0,
            busiest_minute_prompt_tokens: 0,
            prefix_blocks: None,
            shared_prefix_blocks: None,
        };
        let (p, d, pb, db) = engines(&stats, &model, 0.7);
        assert!((pb - 1.016).abs() < 1e-9, "{pb}");
        assert!((db - 1.2).abs() < 1e-9, "{db}");
        assert_eq!((p, d), (2, 2));
        let (p, d, _, _) = engines(&stats, &model, 0.5);
        assert_eq!((p, d), (3, 3));
        assert_eq!(p_blocks(70, &stats, &model, 0.7), 100);
    }
}
