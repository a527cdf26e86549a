//! What decides a run ([`RunSpec`]) and what a run gives back
//! ([`RunOutput`]).
//!
//! This module owns only those two shapes and what follows from a spec
//! alone (its timeline, its largest prompt, the engines' lease settings).
//! Both worlds take a spec and return an output: the main one
//! ([`super::world`]) and the `bidirectional-skew` one ([`super::bidir`]),
//! which the main one hands that scenario to; so the shapes live apart from
//! both, and neither world imports the other's.

use std::sync::Arc;
use std::time::Duration;

use kvlease::LeaseConfig;

use super::metrics::Metrics;
use super::model::{EngineModel, Fleet, Workload};
use super::policy::Policy;
use super::replay::TraceRun;
use super::scenario::{Scenario, ScenarioPlan};

/// Everything that decides a run.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// The scenario.
    pub scenario: Scenario,
    /// The policy.
    pub policy: Policy,
    /// The operator's lease settings (before the scenario and policy).
    pub config: LeaseConfig,
    /// The engines.
    pub fleet: Fleet,
    /// Engine sizes and timings.
    pub model: EngineModel,
    /// The request mix and rate.
    pub workload: Workload,
    /// The seed.
    pub seed: u64,
    /// Run this long instead of the scenario's duration.
    pub duration: Option<Duration>,
    /// A trace replay instead of the workload's arrivals (the scenario is
    /// then [`Scenario::Trace`], its timeline the replay's).
    pub trace: Option<Arc<TraceRun>>,
}

impl RunSpec {
    /// The run's timeline: the replay's faults, or the scenario's.
    pub fn plan(&self) -> ScenarioPlan {
        match &self.trace {
            Some(t) => t.plan.clone(),
            None => self.scenario.plan(&self.fleet),
        }
    }

    /// The largest prompt a run can see, in tokens.
    pub fn largest_prompt(&self) -> u32 {
        match &self.trace {
            Some(t) => t.largest_prompt(),
            None => self.workload.prompt_tokens + self.workload.prompt_tokens / 2,
        }
    }

    /// The lease settings the run's engines get: the operator's, the
    /// scenario's pins, then the policy.
    pub fn effective_config(&self, plan: &ScenarioPlan) -> LeaseConfig {
        let mut c = self.config.clone();
        if let Some(slots) = plan.lease_slots {
            c.lease_slots = slots;
        }
        self.policy.realise(&c).config
    }
}

/// What a run produced.
#[derive(Clone, Debug)]
pub struct RunOutput {
    /// The counters.
    pub metrics: Metrics,
    /// Virtual seconds simulated.
    pub seconds: f64,
}
