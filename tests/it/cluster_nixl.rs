#![cfg(feature = "nixl")]
// Std atomics are fine in tests (clippy.toml's rule is for the library; see src/sync.rs).
#![allow(clippy::disallowed_types)]
//! The engine-shaped deployment of `tests/it/cluster/mod.rs` as five
//! processes on this host over real NIXL: the P scheduler, P workers 0 and
//! 1, the D scheduler and the D worker are each this test binary
//! re-executed with a role; the test process is the hub that routes their
//! role messages (`tests/it/cluster/process.rs`).
//!
//! Needs `libnixl_capi.so` on `LD_LIBRARY_PATH` (see `tests/it/protocol_nixl.rs`);
//! without it every test prints `SKIPPED` and passes, unless
//! `KVLEASE_REQUIRE_NIXL=1`. `KVLEASE_CLUSTER_DEBUG=1` echoes every line the
//! hub reads to stderr.

use crate::cluster;
use crate::support::exact_test_name;
use std::time::Duration;

use crate::cluster::process::{
    heartbeat_latencies, local_launcher, percentile_ms, run_child_if_asked, ProcessCluster,
};
use crate::support::nixl_gate::{nixl_or_skip, say};

/// Scheduling slack of real time on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(2);

/// Runs one scenario: as a child when the hub started this process as a
/// node, else as the hub of five fresh processes.
fn run(test: &str, body: fn(&mut ProcessCluster)) {
    if run_child_if_asked() {
        return;
    }
    let Some(_g) = nixl_or_skip() else { return };
    let t0 = std::time::Instant::now();
    let mut c = ProcessCluster::start(test, local_launcher(), SLACK);
    let start = cluster::Cluster::now(&c);
    body(&mut c);
    let mut hb = heartbeat_latencies(&c, start, cluster::Cluster::now(&c));
    say(&format!(
        "cluster over nixl (5 processes): {test}: {:.1} s, {} events; heartbeat delivery p50 {:.2} ms p99 {:.2} ms ({} heartbeats)",
        t0.elapsed().as_secs_f64(),
        cluster::Cluster::events(&c).len(),
        percentile_ms(&mut hb, 50),
        percentile_ms(&mut hb, 99),
        hb.len()
    ));
}

#[test]
fn happy_path_verified_end_to_end() {
    run(
        &exact_test_name!(happy_path_verified_end_to_end),
        cluster::happy_path_verified_end_to_end,
    );
}

#[test]
fn deaf_rank_expires_alone_and_the_load_fails() {
    run(
        &exact_test_name!(deaf_rank_expires_alone_and_the_load_fails),
        cluster::deaf_rank_expires_alone_and_the_load_fails,
    );
}

#[test]
fn killed_d_worker_is_reclaimed_by_both_ranks() {
    run(
        &exact_test_name!(killed_d_worker_is_reclaimed_by_both_ranks),
        cluster::killed_d_worker_is_reclaimed_by_both_ranks,
    );
}

#[test]
fn killed_p_rank_fails_the_load() {
    run(
        &exact_test_name!(killed_p_rank_fails_the_load),
        cluster::killed_p_rank_fails_the_load,
    );
}
