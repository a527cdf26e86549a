//! D and P end to end over the loopback fabric, in virtual time: D's
//! `HeartbeatTracker` + `HeartbeatSender` keep P's `LeaseBook` leases alive
//! while D holds the request (far past the initial lease), P reclaims soon
//! after D stops heartbeating (transfer complete, or D crashed), compact
//! heartbeats renew by (slot, nonce), and with P TP 2 / D TP 1 both P ranks
//! are heartbeated.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::support::loopback_p::{loopback_p, p_step, ENGINE};
use kvlease::consumer::{
    EngineKey, HeartbeatSender, HeartbeatTracker, RemotePrefillParams, SenderConfig,
};
use kvlease::fabric::loopback::{LoopbackConfig, LoopbackFabric, LoopbackNetwork};
use kvlease::testkit::remote_prefill;
use kvlease::{EngineShape, Instant, LeaseBook, LeaseConfig, NonceSource, ReleaseReason};

/// Loopback agents are named `{engine_id}/{rank}`; that is the address.
fn address(k: &EngineKey<'_>, rank: u32, out: &mut dyn fmt::Write) -> fmt::Result {
    write!(out, "{}/{}", k.engine_id, rank)
}

type Sender =
    HeartbeatSender<LoopbackFabric, fn(&EngineKey<'_>, u32, &mut dyn fmt::Write) -> fmt::Result>;

struct Deployment {
    net: Arc<LoopbackNetwork>,
    config: LeaseConfig,
    /// P: one book over `p_tp` ranks, one agent per rank.
    book: LeaseBook,
    p_agents: Vec<LoopbackFabric>,
    /// D: one rank.
    tracker: HeartbeatTracker,
    sender: Sender,
    released: Vec<(String, ReleaseReason, Instant)>,
    now: Instant,
}

impl Deployment {
    fn new(p_tp: u32, compact: bool) -> Deployment {
        let net = LoopbackNetwork::new(LoopbackConfig {
            handshake_polls: 2,
            ..LoopbackConfig::default()
        });
        let config = LeaseConfig::new(EngineShape {
            num_kv_blocks: 256,
            max_num_seqs: 16,
        });
        let now = Instant::from_secs(10);
        let nonces = NonceSource::from_seed(1, 2, 3);
        let (book, p_agents) = loopback_p(&net, &config, p_tp, compact, nonces, now);
        let d = LoopbackFabric::join(&net, "decode-0").unwrap();
        let sender = HeartbeatSender::new(
            d,
            address as fn(&EngineKey<'_>, u32, &mut dyn fmt::Write) -> fmt::Result,
            SenderConfig::new(&config, 1, 0),
        )
        .unwrap();
        Deployment {
            net,
            tracker: HeartbeatTracker::new(&config, 1).expect("tracker"),
            config,
            book,
            p_agents,
            sender,
            released: Vec::new(),
            now,
        }
    }

    /// P grants a lease for `p_id`; D receives the request with P's
    /// kv_transfer_params as `d_id`.
    fn prefill_then_route(&mut self, p_id: &str, d_id: &str, p_tp: u32) {
        let grant = self.book.grant(p_id, self.now).unwrap();
        let lease = grant.lease_fields().map(|f| (f.slot, f.nonce));
        let params = RemotePrefillParams {
            remote_lease_slot: lease.map(|l| l.0),
            remote_lease_nonce: lease.map(|l| l.1.as_int64()),
            ..remote_prefill(ENGINE, p_id, "10.0.0.1", 5600, p_tp)
        };
        self.tracker
            .on_new_request(d_id, &params, self.now)
            .unwrap();
    }

    /// Advances virtual time by `dt` in 100 ms engine steps of both sides.
    /// Returns heartbeats received per P rank.
    fn run(&mut self, dt: Duration) -> Vec<u32> {
        let end = self.now + dt;
        let mut received = vec![0u32; self.p_agents.len()];
        while self.now < end {
            self.now = self.now + Duration::from_millis(100);
            self.net.advance_to(self.now);
            // D step.
            self.sender.step(&mut self.tracker, self.now);
            // P step: every rank drains, the book applies, then expires.
            let now = self.now;
            // The "engine" frees the blocks at once: slots back to the pool.
            let (book, agents) = (&mut self.book, &mut self.p_agents);
            p_step(book, agents, now, true, &mut self.released, |rank, msg| {
                if msg.starts_with(b"HB") {
                    received[rank] += 1;
                }
            });
        }
        received
    }
}

#[test]
fn heartbeats_keep_a_waiting_request_alive_and_p_reclaims_after_transfer() {
    let mut d = Deployment::new(1, false);
    d.prefill_then_route("cmpl-1", "d-1", 1);
    let start = d.now;
    // D holds the request in its queue for 3 minutes, six initial leases.
    let hb = d.run(Duration::from_secs(180));
    assert!(d.released.is_empty(), "{:?}", d.released);
    assert_eq!(d.book.held(), 1);
    // One heartbeat per 5 s interval (the first deferred by the handshake).
    assert!((35..=37).contains(&hb[0]), "{hb:?}");
    assert!(d.book.expiry("cmpl-1").unwrap() > d.now);
    // Transfer complete on D: heartbeats stop; P (which in this test gets
    // no read-done) lets the lease lapse within one extension.
    assert!(d.tracker.on_transfer_complete("d-1"));
    let stopped = d.now;
    d.run(Duration::from_secs(30));
    assert_eq!(d.released.len(), 1);
    let (id, reason, at) = &d.released[0];
    assert_eq!((id.as_str(), *reason), ("cmpl-1", ReleaseReason::Expired));
    let extension = d.config.lease_extension();
    assert!(*at <= stopped + extension + Duration::from_millis(200));
    assert!(*at >= start + Duration::from_secs(180));
    assert_eq!(d.sender.counters().messages_sent, u64::from(hb[0]));
}

#[test]
fn p_reclaims_within_the_extension_when_d_crashes() {
    let mut d = Deployment::new(1, false);
    d.prefill_then_route("cmpl-1", "d-1", 1);
    d.run(Duration::from_secs(60));
    assert!(d.released.is_empty());
    let d_node = d.net.node("decode-0").unwrap();
    d.net.crash(d_node);
    let crashed = d.now;
    d.run(Duration::from_secs(40));
    assert_eq!(d.released.len(), 1);
    let at = d.released[0].2;
    // Not the 480 s of the old fixed timeout: within one extension (+ one
    // interval of slack for the last heartbeat's timing).
    assert!(at <= crashed + d.config.lease_extension() + d.config.heartbeat_interval());
    // D's sender saw its sends fail and is backing off, without panicking.
    assert!(d.sender.counters().send_failed > 0 || d.sender.counters().handshakes_failed > 0);
}

#[test]
fn compact_heartbeats_renew_by_slot_and_nonce() {
    let mut d = Deployment::new(1, true);
    d.prefill_then_route("cmpl-1", "d-1", 1);
    d.prefill_then_route("cmpl-2", "d-2", 1);
    d.run(Duration::from_secs(100));
    assert!(d.released.is_empty());
    let c = d.sender.counters();
    assert!(c.compact_messages_sent > 0);
    assert_eq!(c.compact_messages_sent, c.messages_sent);
    assert!(d.book.counters().renewed >= 2 * c.compact_messages_sent);
}

#[test]
fn p_tp2_d_tp1_heartbeats_reach_both_p_ranks() {
    let mut d = Deployment::new(2, false);
    d.prefill_then_route("cmpl-1", "d-1", 2);
    let hb = d.run(Duration::from_secs(60));
    assert!(d.released.is_empty());
    assert_eq!(hb.len(), 2);
    assert!(hb[0] >= 10 && hb[0] == hb[1], "{hb:?}");
}
