//! A trace replay as a run's arrival process.
//!
//! This module owns what a run needs from a trace: the arrivals (run time,
//! prompt and output tokens; already windowed, sped up and load-scaled by
//! [`crate::trace::window`]), the timeline of faults laid over them, and
//! how long the run may last. It neither reads files nor draws random
//! numbers: a replay is a fixed list, so every policy sees the same one.

use std::time::Duration;

use super::scenario::ScenarioPlan;

/// One request of a replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// When it reaches the router, since the run's start.
    pub at: Duration,
    /// Prompt tokens.
    pub prompt: u32,
    /// Output tokens.
    pub output: u32,
}

/// Everything a trace run replays.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRun {
    /// The arrivals, sorted by time.
    pub arrivals: Vec<Arrival>,
    /// The faults laid over the replay, and the slots they pin;
    /// `plan.duration` is the run's cap: the run ends there, or earlier once
    /// every request has settled after the last arrival.
    pub plan: ScenarioPlan,
}

impl TraceRun {
    /// The largest prompt, in tokens (sizes the fabric's READs).
    pub fn largest_prompt(&self) -> u32 {
        self.arrivals.iter().map(|a| a.prompt).max().unwrap_or(1)
    }

    /// The largest prompt plus output, in tokens (D's biggest request).
    pub fn largest_request(&self) -> u32 {
        self.arrivals
            .iter()
            .map(|a| a.prompt.saturating_add(a.output))
            .max()
            .unwrap_or(1)
    }
}

/// The replay cursor of one run.
#[derive(Clone, Debug)]
pub struct Replay<'a> {
    arrivals: &'a [Arrival],
    next: usize,
}

impl<'a> Replay<'a> {
    /// A cursor at the first arrival.
    pub fn new(arrivals: &'a [Arrival]) -> Replay<'a> {
        Replay { arrivals, next: 0 }
    }

    /// When the next request arrives; `None` when the replay is over.
    pub fn next_at(&self) -> Option<Duration> {
        self.arrivals.get(self.next).map(|a| a.at)
    }

    /// The request arriving now (prompt, output); the cursor moves on.
    pub fn take(&mut self) -> Option<(u32, u32)> {
        let a = self.arrivals.get(self.next)?;
        self.next += 1;
        Some((a.prompt, a.output))
    }
}
