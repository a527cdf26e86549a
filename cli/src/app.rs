//! One `kvlease sim` invocation: settings in, text (table, JSON) out, the
//! plot written.
//!
//! Owns the order of things and where output goes: the report on stdout
//! (table, then the sweep's trade-off table and the checks; or JSON), the
//! unknown-config-key warnings on stderr, the SVG to its file. Errors come
//! back as text for `main` to print with a non-zero exit.

use std::fmt::Write;

use crate::args::SimArgs;
use crate::report::{checks, plot, sweep, table, Report};
use crate::runner::{jobs, run_all};
use crate::settings::Settings;

/// What an invocation produced.
#[derive(Debug)]
pub struct Output {
    /// For stdout.
    pub stdout: String,
    /// For stderr (warnings).
    pub stderr: String,
    /// The report (for callers that want the numbers).
    pub report: Report,
}

/// Runs `args`; `Err` is a message for the user.
pub fn sim(args: &SimArgs) -> Result<Output, String> {
    let settings: Settings = args.settings()?;
    let mut stderr = String::new();
    for k in &settings.unknown_keys {
        let _ = writeln!(
            stderr,
            "warning: unknown kv_connector_extra_config key {k:?} (ignored)"
        );
    }
    let jobs = jobs(&settings);
    let threads = args.jobs.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(usize::from)
            .unwrap_or(1)
    });
    let started = std::time::Instant::now();
    let outputs = run_all(&jobs, threads).map_err(|e| format!("simulation failed: {e}"))?;
    let wall = started.elapsed();
    let timings = !args.json || args.json_timings;
    let report = Report::build(&settings, &jobs, &outputs, timings);
    if let Some(path) = &args.plot {
        let svg = plot::render(&report).map_err(|e| format!("--plot: {e}"))?;
        std::fs::write(path, svg).map_err(|e| format!("--plot {}: {e}", path.display()))?;
    }
    let stdout = if args.json {
        let mut s = serde_json::to_string_pretty(&report).map_err(|e| format!("--json: {e}"))?;
        s.push('\n');
        s
    } else {
        let mut s = table::render(&report);
        let sw = sweep::render(&report);
        if !sw.is_empty() {
            s.push('\n');
            s.push_str(&sw);
        }
        if !report.checks.is_empty() {
            s.push_str("\nchecks (from the numbers above):\n");
            s.push_str(&checks::render(&report.checks));
        }
        let _ = writeln!(
            s,
            "\n{} runs, {} threads, {:.1} s wall",
            jobs.len(),
            threads,
            wall.as_secs_f64()
        );
        s
    };
    Ok(Output {
        stdout,
        stderr,
        report,
    })
}
