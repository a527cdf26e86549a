//! Running every (sweep value, scenario, policy) of an invocation, in
//! parallel, with a progress bar.
//!
//! This module owns the fan-out over threads and the progress display.
//! Runs are independent and each is deterministic, so the results (kept in
//! job order) do not depend on the thread count; only the measured lease
//! CPU does. The bar (indicatif, on stderr) appears once the work has taken
//! a second, and never when stderr is not a terminal.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvlease::LeaseConfig;

use crate::settings::Settings;
use crate::sim::policy::Policy;
use crate::sim::scenario::Scenario;
use crate::sim::{run, RunOutput, RunSpec, SimError};

/// One run to do.
#[derive(Clone, Debug)]
pub struct Job {
    /// Index into the sweep's values (0 without a sweep).
    pub point: usize,
    /// The scenario.
    pub scenario: Scenario,
    /// The policy.
    pub policy: Policy,
    /// Its spec.
    pub spec: RunSpec,
    /// Progress units it will report.
    pub units: u64,
}

/// Every job of `s`, in report order (sweep value, scenario, policy).
pub fn jobs(s: &Settings) -> Vec<Job> {
    let points: Vec<LeaseConfig> = match &s.sweep {
        Some(sw) => sw.points.iter().map(|(_, c)| c.clone()).collect(),
        None => vec![s.config.clone()],
    };
    let mut out = Vec::new();
    for (point, config) in points.iter().enumerate() {
        for &scenario in &s.scenarios {
            for &policy in &s.policies {
                let spec = RunSpec {
                    scenario,
                    policy,
                    config: config.clone(),
                    fleet: s.fleet,
                    model: s.model.clone(),
                    workload: s.workload,
                    seed: s.seed,
                    duration: s.duration,
                    trace: s.trace.as_ref().map(|t| Arc::clone(&t.run)),
                };
                let units = match (s.workload.max_requests, s.duration) {
                    (Some(n), _) => n,
                    (None, Some(d)) => d.as_secs(),
                    (None, None) => spec.plan().duration.as_secs(),
                };
                out.push(Job {
                    point,
                    scenario,
                    policy,
                    spec,
                    units,
                });
            }
        }
    }
    out
}

/// Runs `jobs` on `threads` threads; results in job order.
pub fn run_all(jobs: &[Job], threads: usize) -> Result<Vec<RunOutput>, SimError> {
    let total: u64 = jobs.iter().map(|j| j.units).sum();
    let done = AtomicU64::new(0);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<RunOutput, SimError>>>> =
        Mutex::new(jobs.iter().map(|_| None).collect());
    let finished = AtomicUsize::new(0);
    let threads = threads.clamp(1, jobs.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(k) else {
                    break;
                };
                let tick = |n: u64| {
                    done.fetch_add(n, Ordering::Relaxed);
                };
                let r = run(&job.spec, &tick);
                if let Ok(mut all) = results.lock() {
                    all[k] = Some(r);
                }
                finished.fetch_add(1, Ordering::Release);
            });
        }
        // The bar: hidden for the first second, and for good when stderr
        // is not a terminal.
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden());
        bar.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        // Units: virtual seconds, or settled requests with --requests.
        bar.set_message("simulated");
        let start = std::time::Instant::now();
        let mut shown = false;
        while finished.load(Ordering::Acquire) < jobs.len() {
            std::thread::sleep(Duration::from_millis(50));
            if !shown
                && start.elapsed() >= Duration::from_secs(1)
                && std::io::stderr().is_terminal()
            {
                bar.set_draw_target(ProgressDrawTarget::stderr());
                shown = true;
            }
            bar.set_position(done.load(Ordering::Relaxed).min(total));
        }
        bar.finish_and_clear();
    });
    let results = results
        .into_inner()
        .map_err(|_| SimError("a simulation thread panicked".into()))?;
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(SimError("a run did not finish".into()))))
        .collect()
}
