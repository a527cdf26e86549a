//! The protocol suite (`tests/it/protocol/mod.rs`) over two loopback agents in
//! virtual time: deterministic, no sleeps, bounds to one step. Plus the
//! decode-side end-to-end test of a request that waits in D's queue for ten
//! lease durations (loopback only: ten leases of real time are too long for
//! a test over NIXL).

use crate::protocol;
use std::sync::Arc;
use std::time::Duration;

use kvlease::fabric::loopback::{LoopbackConfig, LoopbackFabric, LoopbackNetwork, NodeId};
use kvlease::{EngineShape, Instant, LeaseConfig, ReleaseReason};

use crate::protocol::{DSender, Decode, Pair, Prefill, STEP};

const P_HOST: &str = "10.0.0.1";
const P_PORT: u16 = 5600;

/// P and D on one loopback network; P's agent is named by its endpoint, so
/// D's `{host}:{port}` address finds it as it would find a NIXL listener.
struct LoopbackPair {
    net: Arc<LoopbackNetwork>,
    now: Instant,
    tick: Duration,
    p: LoopbackFabric,
    d: DSender<LoopbackFabric>,
    d_node: NodeId,
}

impl LoopbackPair {
    fn new(config: &LeaseConfig) -> LoopbackPair {
        let net = LoopbackNetwork::new(LoopbackConfig {
            // A handshake and a READ take a step or two, as on a real fabric.
            handshake_polls: 2,
            read_latency: Duration::from_millis(1),
            ..LoopbackConfig::default()
        });
        let now = Instant::from_secs(100);
        net.advance_to(now);
        let p = LoopbackFabric::join(&net, &format!("{P_HOST}:{P_PORT}")).unwrap();
        let d = LoopbackFabric::join(&net, "decode-0").unwrap();
        let d_node = d.node();
        let d = protocol::d_sender(d, config);
        LoopbackPair {
            net,
            now,
            tick: config.wheel_tick(),
            p,
            d,
            d_node,
        }
    }
}

impl Pair for LoopbackPair {
    type F = LoopbackFabric;

    fn p(&mut self) -> &mut LoopbackFabric {
        &mut self.p
    }

    fn d(&mut self) -> &mut DSender<LoopbackFabric> {
        &mut self.d
    }

    fn p_endpoint(&self) -> (String, u16) {
        (P_HOST.to_owned(), P_PORT)
    }

    fn now(&self) -> Instant {
        self.now
    }

    fn advance(&mut self, dt: Duration) {
        self.now = self.now + dt;
        self.net.advance_to(self.now);
    }

    fn crash_d(&mut self) {
        self.net.crash(self.d_node);
    }

    fn slack(&self) -> Duration {
        STEP + self.tick
    }
}

fn pair() -> LoopbackPair {
    LoopbackPair::new(&protocol::lease_config())
}

#[test]
fn handshake_carries_p_slot_region() {
    protocol::handshake_carries_p_slot_region(&mut pair());
}

#[test]
fn heartbeats_renew_leases() {
    protocol::heartbeats_renew_leases(&mut pair());
}

#[test]
fn block_read_copies_p_blocks() {
    protocol::block_read_copies_p_blocks(&mut pair());
}

#[test]
fn verifier_tells_held_from_lapsed() {
    protocol::verifier_tells_held_from_lapsed(&mut pair());
}

#[test]
fn read_done_with_nonce_releases_only_its_lease() {
    protocol::read_done_with_nonce_releases_only_its_lease(&mut pair());
}

#[test]
fn crashed_decoder_leases_are_reclaimed() {
    let mut h = pair();
    protocol::crashed_decoder_leases_are_reclaimed(&mut h);
    assert!(h.net.is_crashed(h.d_node));
}

/// Virtual time makes a body a function of its inputs: two runs hear the
/// same notifications at the same instants and release at the same instants.
#[test]
fn a_body_replays_identically() {
    let run = || {
        let mut h = pair();
        let config = protocol::lease_config();
        let mut p = Prefill::setup(&mut h, &config);
        let mut d = Decode::new(&config);
        let g = p.book.grant("cmpl-r", h.now()).unwrap();
        d.route(&h, "d-r", "cmpl-r", &g);
        let limit = h.now() + Duration::from_secs(20);
        protocol::run_until(&mut h, &mut p, Some(&mut d), limit, |_| false);
        h.crash_d();
        let limit = h.now() + Duration::from_secs(10);
        protocol::run_until(&mut h, &mut p, None, limit, |p| !p.released.is_empty());
        let heard: Vec<_> = p.heard.iter().map(|x| (x.msg.clone(), x.at)).collect();
        (heard, p.released)
    };
    let (a, b) = (run(), run());
    assert!(a.0.len() >= 19, "{} heartbeats in 20 s", a.0.len());
    assert_eq!(a.1.len(), 1);
    assert_eq!(a, b);
}

// ---- decode side, end to end: a request waiting in D's queue -----------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// D's process dies.
    Crash,
    /// The request finished (or was aborted) on D without a KV transfer.
    Finished,
}

/// A request waits in D's queue for ten lease durations (default 30 s lease:
/// five minutes) while D heartbeats it; P holds its blocks all along. Then D
/// stops heartbeating it and P releases them within extension + interval.
fn waiting_request_then(stop: Stop) {
    let config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 256,
        max_num_seqs: 16,
    });
    assert_eq!(config.lease_duration(), Duration::from_secs(30));
    let (interval, extension) = (config.heartbeat_interval(), config.lease_extension());
    let mut h = LoopbackPair::new(&config);
    let mut p = Prefill::setup(&mut h, &config);
    let mut d = Decode::new(&config);
    let now = h.now();
    let g = p.book.grant("cmpl-q", now).unwrap();
    let kvlease::LeaseFields { slot, nonce } = g.lease_fields().unwrap();
    // Routed to D at once: D's scheduler tracks it from arrival, not from
    // when it is scheduled.
    d.route(&h, "d-q", "cmpl-q", &g);

    let wait = 10 * config.lease_duration();
    let until = now + wait;
    let lost = protocol::run_until(&mut h, &mut p, Some(&mut d), until, |p| p.book.held() != 1);
    assert!(!lost, "P let go of the waiting request: {:?}", p.released);
    assert_eq!(p.released, Vec::new());
    assert_eq!(
        p.slot_word(slot),
        nonce.get(),
        "the slot still holds the lease"
    );
    let hb = p.heartbeats().count() as u64;
    let per_interval = wait.as_secs() / interval.as_secs();
    assert!(
        (per_interval - 1..=per_interval + 1).contains(&hb),
        "{hb} heartbeats in {wait:?}"
    );
    let last = p.last_heartbeat().unwrap();
    assert_eq!(p.book.expiry("cmpl-q"), Some(last + extension));
    assert!(last + extension > h.now());
    assert_eq!(d.step_errors, 0);

    let stopped = h.now();
    let alive = match stop {
        Stop::Crash => {
            h.crash_d();
            None
        }
        Stop::Finished => {
            assert!(d.tracker.on_request_finished("d-q"));
            assert!(d.tracker.is_empty());
            Some(&mut d)
        }
    };
    let limit = stopped + extension + interval + h.slack();
    assert!(
        protocol::run_until(&mut h, &mut p, alive, limit, |p| !p.released.is_empty()),
        "P still holds the blocks {:?} after D stopped ({stop:?})",
        h.now().saturating_duration_since(stopped)
    );
    let r = &p.released[0];
    assert_eq!(
        (r.id.as_str(), r.reason),
        ("cmpl-q", ReleaseReason::Expired)
    );
    assert!(
        r.at >= last + extension,
        "released before the expiry: {r:?}"
    );
    assert!(r.at <= stopped + extension + interval, "{r:?}");
    assert!(r.at >= now + wait, "held for the whole wait: {r:?}");
    assert_eq!(r.slot_word, Some(0));
    assert_eq!(
        p.heartbeats().count() as u64,
        hb,
        "no heartbeat after D stopped"
    );
    if stop == Stop::Finished {
        assert_eq!(d.step_errors, 0);
        assert_eq!(d.tracker.counters().stopped_finished, 1);
    } else {
        assert!(h.net.is_crashed(h.d_node));
    }
    assert_eq!(p.book.counters().slots_returned, 1);
}

#[test]
fn waiting_request_outlives_ten_leases_then_d_crashes() {
    waiting_request_then(Stop::Crash);
}

#[test]
fn waiting_request_outlives_ten_leases_then_finishes_without_transfer() {
    waiting_request_then(Stop::Finished);
}
