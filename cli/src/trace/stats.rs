//! What a replay's traffic looks like, before any simulation.
//!
//! Owns the figures computed from the arrivals alone: counts and means,
//! the busiest minute (the most requests arriving, as a request-rate
//! dashboard shows it; ties go to the one with more tokens, then the
//! earlier), the peak load over any 60 s (what [`super::sizing`] sizes the
//! fleet for), and how much of the prompts' prefix blocks an earlier
//! request already had (`hash_ids`; the simulator does not model a prefix
//! cache, so this is reported, not used).

use std::time::Duration;

use serde::Serialize;

use super::TraceRequest;
use crate::sim::replay::Arrival;

/// The window over which peak load is measured.
pub const PEAK_WINDOW: Duration = Duration::from_secs(60);

/// Load over a window, per second.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Load {
    /// Requests per second.
    pub requests_per_s: f64,
    /// Prompt tokens per second.
    pub prompt_tokens_per_s: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
}

/// A replay's traffic.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TraceStats {
    /// Requests replayed.
    pub requests: u64,
    /// Run seconds from the first arrival to the last.
    pub span_s: f64,
    /// Mean prompt tokens.
    pub mean_prompt_tokens: f64,
    /// Mean output tokens.
    pub mean_output_tokens: f64,
    /// Largest prompt, tokens.
    pub max_prompt_tokens: u32,
    /// Largest prompt + output, tokens.
    pub max_request_tokens: u32,
    /// Mean load over the whole replay.
    pub mean: Load,
    /// Highest load over any 60 s (each figure its own 60 s).
    pub peak_60s: Load,
    /// The busiest whole minute of the run (by requests arriving): its
    /// start, run seconds.
    pub busiest_minute_s: f64,
    /// Requests arriving in it.
    pub busiest_minute_requests: u64,
    /// Prompt tokens arriving in it.
    pub busiest_minute_prompt_tokens: u64,
    /// Prefix blocks (`hash_ids`) in the window's prompts, if the trace has them.
    pub prefix_blocks: Option<u64>,
    /// Of those, leading blocks an earlier request of the file had.
    pub shared_prefix_blocks: Option<u64>,
}

impl TraceStats {
    /// The figures of `arrivals` (sorted; not empty), and the prefix
    /// statistics of the window's trace records `records`.
    pub fn of(arrivals: &[Arrival], records: &[TraceRequest], has_prefixes: bool) -> TraceStats {
        let n = arrivals.len().max(1) as f64;
        let first = arrivals.first().map_or(Duration::ZERO, |a| a.at);
        let last = arrivals.last().map_or(Duration::ZERO, |a| a.at);
        let span = last.saturating_sub(first).as_secs_f64();
        let prompt: u64 = arrivals.iter().map(|a| u64::from(a.prompt)).sum();
        let output: u64 = arrivals.iter().map(|a| u64::from(a.output)).sum();
        let per_s = span.max(PEAK_WINDOW.as_secs_f64());
        let mean = Load {
            requests_per_s: arrivals.len() as f64 / per_s,
            prompt_tokens_per_s: prompt as f64 / per_s,
            output_tokens_per_s: output as f64 / per_s,
        };
        let w = PEAK_WINDOW.as_secs_f64();
        let peak_60s = Load {
            requests_per_s: peak(arrivals, |_| 1) / w,
            prompt_tokens_per_s: peak(arrivals, |a| u64::from(a.prompt)) / w,
            output_tokens_per_s: peak(arrivals, |a| u64::from(a.output)) / w,
        };
        // Whole minutes from the run's start: (requests, prompt tokens, all tokens).
        let mut minutes: Vec<(u64, u64, u64)> = Vec::new();
        for a in arrivals {
            let m = (a.at.as_secs() / 60) as usize;
            if minutes.len() <= m {
                minutes.resize(m + 1, (0, 0, 0));
            }
            minutes[m].0 += 1;
            minutes[m].1 += u64::from(a.prompt);
            minutes[m].2 += u64::from(a.prompt) + u64::from(a.output);
        }
        let (busiest, &(b_req, b_tok, _)) = minutes
            .iter()
            .enumerate()
            // max_by_key keeps the last maximum: reversed, the first.
            .rev()
            .max_by_key(|(_, (req, _, all))| (*req, *all))
            .unwrap_or((0, &(0, 0, 0)));
        let (prefix, shared) = if has_prefixes {
            (
                Some(records.iter().map(|r| u64::from(r.prefix_blocks)).sum()),
                Some(records.iter().map(|r| u64::from(r.shared_blocks)).sum()),
            )
        } else {
            (None, None)
        };
        TraceStats {
            requests: arrivals.len() as u64,
            span_s: span,
            mean_prompt_tokens: prompt as f64 / n,
            mean_output_tokens: output as f64 / n,
            max_prompt_tokens: arrivals.iter().map(|a| a.prompt).max().unwrap_or(0),
            max_request_tokens: arrivals
                .iter()
                .map(|a| a.prompt.saturating_add(a.output))
                .max()
                .unwrap_or(0),
            mean,
            peak_60s,
            busiest_minute_s: busiest as f64 * 60.0,
            busiest_minute_requests: b_req,
            busiest_minute_prompt_tokens: b_tok,
            prefix_blocks: prefix,
            shared_prefix_blocks: shared,
        }
    }
}

/// The most `weight` arriving within any [`PEAK_WINDOW`] (sorted arrivals).
fn peak(arrivals: &[Arrival], weight: impl Fn(&Arrival) -> u64) -> f64 {
    let (mut lo, mut sum, mut best) = (0usize, 0u64, 0u64);
    for a in arrivals {
        sum += weight(a);
        while arrivals[lo].at + PEAK_WINDOW <= a.at {
            sum -= weight(&arrivals[lo]);
            lo += 1;
        }
        best = best.max(sum);
    }
    best as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: u64, prompt: u32) -> Arrival {
        Arrival {
            at: Duration::from_secs(s),
            prompt,
            output: 10,
        }
    }

    #[test]
    fn peaks_and_the_busiest_minute() {
        // Minute 0: 3 small (the busiest by requests); minute 2: 2 large;
        // minutes 3 and 4 tie with 3 requests, the one with more tokens wins.
        let a = [
            at(0, 10),
            at(10, 10),
            at(50, 10),
            at(130, 1000),
            at(170, 1000),
            at(180, 10),
            at(181, 10),
            at(182, 10),
            at(240, 10),
            at(241, 10),
            at(242, 11),
        ];
        let s = TraceStats::of(&a, &[], false);
        assert_eq!(s.requests, 11);
        assert_eq!(s.busiest_minute_s, 240.0);
        assert_eq!(s.busiest_minute_requests, 3);
        assert_eq!(s.busiest_minute_prompt_tokens, 31);
        let s = TraceStats::of(&a[..8], &[], false);
        assert_eq!(s.busiest_minute_s, 0.0);
        // Any 60 s: the two large ones are 40 s apart (plus the three
        // small ones at 180-182 s).
        assert_eq!(s.peak_60s.prompt_tokens_per_s, 2030.0 / 60.0);
        assert_eq!(s.peak_60s.requests_per_s, 5.0 / 60.0);
        assert_eq!(s.max_request_tokens, 1010);
        assert_eq!(s.prefix_blocks, None);
    }
}
