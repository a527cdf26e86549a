#![cfg(feature = "nixl")]
//! The protocol suite (`tests/it/protocol/mod.rs`) over two real NIXL agents in
//! one process, in real time, plus a two-process crash test: a child process
//! (this test binary, re-executed) plays D and heartbeats P's leases over
//! real NIXL until the parent (P) kills it.
//!
//! Needs `libnixl_capi.so` on `LD_LIBRARY_PATH`:
//!
//! ```text
//! eval "$(.ci/nixl-runtime.sh | tail -1)"
//! KVLEASE_REQUIRE_NIXL=1 cargo test --features nixl --test it -- protocol_nixl::
//! ```
//!
//! Without the runtime every test prints `SKIPPED: NIXL runtime not found`
//! and passes, unless `KVLEASE_REQUIRE_NIXL=1` makes the absence a failure.
//!
//! Leases are the shortest the config accepts (6 s: interval 1 s, extension
//! 4 s), so a test that must outlive a lease runs for seconds. Every wait is
//! a poll loop with a deadline; timing assertions are bounds with 2 s of
//! slack for scheduling on a loaded 2-core machine. The tests hold one lock
//! and run one at a time.
// Std atomics are fine in tests (clippy.toml's rule is for the library; see src/sync.rs).
#![allow(clippy::disallowed_types)]

use crate::protocol;
use crate::support::child::{every_line, spawn_test_child, wait_for, KillOnDrop};
use crate::support::exact_test_name;
use crate::support::pipes;
use std::io::Write;
use std::process::ChildStdin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::support::nixl_gate::{nixl_or_skip, nixl_parent_or_child, say};
use kvlease::fabric::nixl::{NixlConfig, NixlFabric};
use kvlease::{Instant, MonotonicClock, Nonce, ReleaseReason};

use crate::protocol::{DSender, Decode, Pair, Prefill};

/// Scheduling slack of real time.
const SLACK: Duration = Duration::from_secs(2);

fn fabric(role: &str, clock: MonotonicClock) -> NixlFabric {
    static N: AtomicU32 = AtomicU32::new(0);
    let mut cfg = NixlConfig::new(format!(
        "kvl-proto-{role}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    cfg.clock = clock;
    NixlFabric::new(cfg).expect("NIXL fabric")
}

/// P and D as two NIXL agents of this process, on one monotonic clock.
struct NixlPair {
    clock: MonotonicClock,
    p: NixlFabric,
    /// `None` once D crashed (its agent dropped).
    d: Option<DSender<NixlFabric>>,
}

impl NixlPair {
    fn new() -> NixlPair {
        let clock = MonotonicClock::new();
        let p = fabric("p", clock);
        let d = protocol::d_sender(fabric("d", clock), &protocol::lease_config());
        NixlPair {
            clock,
            p,
            d: Some(d),
        }
    }
}

impl Pair for NixlPair {
    type F = NixlFabric;

    fn p(&mut self) -> &mut NixlFabric {
        &mut self.p
    }

    fn d(&mut self) -> &mut DSender<NixlFabric> {
        self.d.as_mut().expect("D used after it crashed")
    }

    fn p_endpoint(&self) -> (String, u16) {
        let a = self.p.listen_addr();
        (a.ip().to_string(), a.port())
    }

    fn now(&self) -> Instant {
        self.clock.now()
    }

    fn advance(&mut self, dt: Duration) {
        std::thread::sleep(dt.min(Duration::from_millis(2)));
    }

    fn crash_d(&mut self) {
        // The agent goes away mid-conversation: no goodbye, nothing drained.
        self.d = None;
    }

    fn slack(&self) -> Duration {
        SLACK
    }
}

/// Runs one shared body over a fresh NIXL pair, timed.
fn run(name: &str, body: fn(&mut NixlPair)) {
    let Some(_g) = nixl_or_skip() else { return };
    let start = std::time::Instant::now();
    let mut pair = NixlPair::new();
    body(&mut pair);
    say(&format!(
        "protocol over nixl: {name}: {:.2} s",
        start.elapsed().as_secs_f64()
    ));
}

#[test]
fn handshake_carries_p_slot_region() {
    run(
        "handshake_carries_p_slot_region",
        protocol::handshake_carries_p_slot_region,
    );
}

#[test]
fn heartbeats_renew_leases() {
    run("heartbeats_renew_leases", protocol::heartbeats_renew_leases);
}

#[test]
fn block_read_copies_p_blocks() {
    run(
        "block_read_copies_p_blocks",
        protocol::block_read_copies_p_blocks,
    );
}

#[test]
fn verifier_tells_held_from_lapsed() {
    run(
        "verifier_tells_held_from_lapsed",
        protocol::verifier_tells_held_from_lapsed,
    );
}

#[test]
fn read_done_with_nonce_releases_only_its_lease() {
    run(
        "read_done_with_nonce_releases_only_its_lease",
        protocol::read_done_with_nonce_releases_only_its_lease,
    );
}

#[test]
fn crashed_decoder_leases_are_reclaimed() {
    run("crashed_decoder_leases_are_reclaimed", |h| {
        protocol::crashed_decoder_leases_are_reclaimed(h);
        assert!(h.d.is_none(), "D's agent is gone");
    });
}

// ---- two processes: P here, D in a child process that is killed ---------------------

/// Environment switch: this test binary runs as the D child.
const CHILD_ENV: &str = "KVLEASE_PROTOCOL_D_CHILD";
/// What the child prints once its NIXL agent is up.
const READY_LINE: &str = "KVLEASE_D_READY";
/// The two-process test; the child re-executes exactly this test.
/// The child gives up after this long, whatever happens.
const CHILD_LIFETIME: Duration = Duration::from_secs(60);

/// The D child: reads `p <host> <port>` and `lease <d_id> <p_id> <slot>
/// <nonce>` lines on stdin, tracks each lease and heartbeats P over NIXL
/// every step until it is killed, its stdin closes, or [`CHILD_LIFETIME`].
fn d_child() {
    let clock = MonotonicClock::new();
    let config = protocol::lease_config();
    let mut sender = protocol::d_sender(fabric("d-child", clock), &config);
    let mut d = Decode::new(&config);
    let rx = pipes::stdin_lines();
    println!("{READY_LINE}");
    std::io::stdout().flush().unwrap();
    let mut endpoint: Option<(String, u16)> = None;
    let start = std::time::Instant::now();
    while start.elapsed() < CHILD_LIFETIME {
        while let Ok(msg) = rx.try_recv() {
            let Some(line) = msg else { return };
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["p", host, port] => endpoint = Some((host.to_string(), port.parse().unwrap())),
                ["lease", d_id, p_id, slot, nonce] => {
                    let (host, port) = endpoint.as_ref().expect("P's endpoint first");
                    let lease = (
                        slot.parse().unwrap(),
                        Nonce::new(nonce.parse().unwrap()).unwrap(),
                    );
                    d.route_to(host, *port, d_id, p_id, Some(lease), clock.now());
                }
                _ => panic!("D child: bad line {line:?}"),
            }
        }
        d.step_on(&mut sender, clock.now());
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Starts the D child and waits until its NIXL agent is up.
fn spawn_d() -> (KillOnDrop, ChildStdin) {
    let child = spawn_test_child(
        &exact_test_name!(p_reclaims_the_leases_of_a_killed_d_process),
        &[(CHILD_ENV, "1")],
        true,
        every_line,
    );
    wait_for(&child.lines, READY_LINE, Duration::from_secs(30))
        .expect("the D child did not come up");
    (child.process, child.stdin.expect("piped"))
}

#[test]
fn p_reclaims_the_leases_of_a_killed_d_process() {
    let Some(_g) = nixl_parent_or_child(CHILD_ENV, d_child) else {
        return;
    };
    let t0 = std::time::Instant::now();
    let clock = MonotonicClock::new();
    let config = protocol::lease_config();
    let (interval, extension) = (config.heartbeat_interval(), config.lease_extension());
    let mut pf = fabric("p", clock);
    let mut p = Prefill::on(&mut pf, &config, clock.now());
    let (mut child, mut stdin) = spawn_d();

    // Prefill done for two requests; the router hands both to the child D.
    let addr = pf.listen_addr();
    let mut lines = format!("p {} {}\n", addr.ip(), addr.port());
    let now = clock.now();
    let mut initial = now;
    for (k, id) in ["cmpl-1", "cmpl-2"].into_iter().enumerate() {
        let g = p.book.grant(id, now).unwrap();
        let kvlease::LeaseFields { slot, nonce } = g.lease_fields().unwrap();
        lines += &format!("lease d-{k} {id} {slot} {}\n", nonce.get());
        initial = g.expiry;
    }
    stdin.write_all(lines.as_bytes()).unwrap();
    stdin.flush().unwrap();

    // P's engine loop while the child lives on, well past the initial lease.
    // Half an interval off the heartbeat phase, so the kill does not race one.
    let alive_until = initial + 2 * interval + interval / 2;
    while clock.now() < alive_until {
        p.step_on(&mut pf, clock.now());
        assert_eq!(p.released, Vec::new(), "P released a heartbeated lease");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "the D child exited by itself"
    );
    assert_eq!(p.book.held(), 2);
    let hbs = p.heartbeats().count();
    assert!(hbs >= 3, "{hbs} heartbeats from the child");
    let child_name = p.heard[0].from.clone();
    assert!(child_name.starts_with("kvl-proto-d-child-"), "{child_name}");
    for x in p.heartbeats() {
        assert_eq!(x.from, child_name);
        assert_eq!(x.outcome.expect("well-formed").renewed, 2);
    }
    for id in ["cmpl-1", "cmpl-2"] {
        assert!(p.book.expiry(id).unwrap() > initial, "{id} never renewed");
    }

    // Kill D. P must let go within extension + interval (+ slack).
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let killed = clock.now();
    let bound = killed + extension + interval + SLACK;
    while p.released.len() < 2 && clock.now() <= bound + Duration::from_secs(5) {
        p.step_on(&mut pf, clock.now());
        std::thread::sleep(Duration::from_millis(2));
    }
    let last = p.last_heartbeat().unwrap();
    let took = |at: Instant| at.saturating_duration_since(killed);
    say(&format!(
        "protocol over nixl: killed D process: last heartbeat {:.2} s before the kill, \
         releases {:?} s after it",
        killed.saturating_duration_since(last).as_secs_f64(),
        p.released
            .iter()
            .map(|r| took(r.at).as_secs_f64())
            .collect::<Vec<_>>()
    ));
    assert_eq!(p.released.len(), 2, "P still holds the killed D's leases");
    assert!(last <= killed + SLACK, "heartbeats after the kill");
    for r in &p.released {
        assert_eq!(r.reason, ReleaseReason::Expired, "{r:?}");
        assert!(
            r.at >= last + extension,
            "released before the expiry: {r:?}"
        );
        assert!(
            r.at <= bound,
            "released {:?} after the kill, bound {:?}",
            took(r.at),
            extension + interval + SLACK
        );
        assert_eq!(r.slot_word, Some(0));
    }
    assert_eq!(p.book.held(), 0);
    drop(stdin);
    say(&format!(
        "protocol over nixl: {}: {:.2} s",
        exact_test_name!(p_reclaims_the_leases_of_a_killed_d_process),
        t0.elapsed().as_secs_f64()
    ));
}
