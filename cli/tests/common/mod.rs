//! Shared by the CLI's integration tests: run `kvlease sim` in process
//! (through the same entry point as the binary) and find numbers in its report.

#![allow(dead_code)] // each test binary uses part of it

use clap::Parser;
use kvlease_cli::app;
use kvlease_cli::args::{Cli, Command};
use kvlease_cli::report::Report;
use kvlease_cli::sim::metrics::RunReport;

/// Runs `kvlease sim ARGS` in process; panics (the test fails) on an error.
pub fn sim(args: &[&str]) -> app::Output {
    let mut argv = vec!["kvlease", "sim"];
    argv.extend_from_slice(args);
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("flags {argv:?}: {e}"));
    let Command::Sim(a) = cli.command;
    app::sim(&a).unwrap_or_else(|e| panic!("kvlease sim {args:?}: {e}"))
}

/// The report of `policy` in `scenario`.
pub fn run<'a>(report: &'a Report, scenario: &str, policy: &str) -> &'a RunReport {
    report
        .runs
        .iter()
        .find(|r| r.scenario.name() == scenario)
        .unwrap_or_else(|| panic!("no scenario {scenario}"))
        .policies
        .iter()
        .find(|p| p.policy == policy)
        .unwrap_or_else(|| panic!("no policy {policy} in {scenario}"))
}

/// Runs `scenario` (plus `extra` flags) under lease+verify and
/// lease-noverify, the pair most claims compare; returns their reports in
/// that order.
pub fn verify_and_noverify(scenario: &str, extra: &[&str]) -> (RunReport, RunReport) {
    let mut args = vec![
        "--scenario",
        scenario,
        "--policy",
        "lease+verify,lease-noverify",
    ];
    args.extend_from_slice(extra);
    let out = sim(&args);
    (
        run(&out.report, scenario, "lease+verify").clone(),
        run(&out.report, scenario, "lease-noverify").clone(),
    )
}
