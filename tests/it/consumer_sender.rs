//! D worker-side heartbeat sending over a recording fake fabric:
//! heterogeneous TP fan-out, handshake deferral, failure backoff, text vs
//! compact, splitting, owed heartbeats, engine slot reuse.

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use kvlease::consumer::{
    DefaultPeerAddress, EngineKey, HeartbeatSender, HeartbeatTracker, PeerAddress, PeerStatus,
    RemotePrefillParams, SenderConfig, SenderError, StepError,
};
use kvlease::fabric::{Fabric, FabricError, HandshakeState};
use kvlease::testkit::{d_side_config, remote_prefill, FakeFabric, Policy, SplitMix64};
use kvlease::topology::TopologyError;
use kvlease::wire::{self, Notification};
use kvlease::{Instant, LeaseConfig};

fn lease_config() -> LeaseConfig {
    d_side_config(1024, 64, 256, 8, 64)
}

fn params<'a>(engine: &'a str, p_id: &'a str, p_tp: u32) -> RemotePrefillParams<'a> {
    remote_prefill(engine, p_id, "p0", 5600, p_tp)
}

fn leased<'a>(engine: &'a str, p_id: &'a str, slot: u32, nonce: i64) -> RemotePrefillParams<'a> {
    RemotePrefillParams {
        remote_lease_slot: Some(slot),
        remote_lease_nonce: Some(nonce),
        ..params(engine, p_id, 1)
    }
}

fn fabric() -> FakeFabric {
    FakeFabric::new(4096, 64, 4096, 1 << 20)
}

fn sender(
    fabric: FakeFabric,
    local_tp: u32,
    rank: u32,
) -> HeartbeatSender<FakeFabric, DefaultPeerAddress> {
    let cfg = SenderConfig::new(&lease_config(), local_tp, rank);
    HeartbeatSender::new(fabric, DefaultPeerAddress, cfg).unwrap()
}

/// The ids of a text heartbeat, sorted.
fn ids(msg: &str) -> Vec<String> {
    match wire::decode(msg.as_bytes()).unwrap() {
        Notification::Heartbeat(ids) => {
            let mut v: Vec<String> = ids.map(str::to_string).collect();
            v.sort();
            v
        }
        other => panic!("not a text heartbeat: {other:?}"),
    }
}

const T0: Instant = Instant::from_secs(50);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Two steps: the first starts the handshakes, the second sends.
fn connect(
    s: &mut HeartbeatSender<FakeFabric, DefaultPeerAddress>,
    t: &mut HeartbeatTracker,
) -> Instant {
    s.step(t, T0);
    s.step(t, T0 + ms(10));
    T0 + ms(10)
}

#[test]
fn p_tp4_d_tp2_each_d_rank_heartbeats_two_p_ranks() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 4), T0).unwrap();
    t.on_new_request("d2", &params("eng", "p2", 4), T0).unwrap();
    let s0 = sender(fabric(), 2, 0);
    let s1 = sender(fabric(), 2, 1);
    // Two D ranks served by one scheduler-side tracker: both fed from the
    // same due pass (due throttles, so it is called once per step).
    let mut senders = [s0, s1];
    for now in [T0, T0 + ms(10)] {
        let r = HeartbeatSender::step_all(&mut senders, &mut t, now);
        assert_eq!(r.last_error, None);
    }
    let [s0, s1] = senders;
    for (s, ranks) in [(&s0, [0, 1]), (&s1, [2, 3])] {
        let f = s.fabric();
        let addrs: BTreeSet<&str> = f.sent().map(|(a, _)| a).collect();
        let want: BTreeSet<String> = ranks.iter().map(|r| format!("p0:5600/eng/{r}")).collect();
        assert_eq!(
            addrs,
            want.iter().map(String::as_str).collect::<BTreeSet<_>>()
        );
        for a in &want {
            let msgs = f.sent_to(a);
            assert_eq!(msgs.len(), 1, "one batched message per P rank");
            assert_eq!(ids(&msgs[0]), ["p1", "p2"]);
        }
        assert_eq!(s.counters().messages_sent, 2);
    }
}

#[test]
fn p_tp2_d_tp4_each_d_rank_heartbeats_one_p_rank() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 2), T0).unwrap();
    let mut senders: Vec<_> = (0..4).map(|r| sender(fabric(), 4, r)).collect();
    for now in [T0, T0 + ms(10)] {
        let r = HeartbeatSender::step_all(&mut senders, &mut t, now);
        assert_eq!(r.last_error, None);
    }
    for (r, s) in senders.iter().enumerate() {
        let p_rank = r / 2;
        let sent: Vec<(&str, &[u8])> = s.fabric().sent().collect();
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].0, format!("p0:5600/eng/{p_rank}"));
        assert_eq!(sent[0].1, b"HB:p1");
    }
}

#[test]
fn equal_tp_each_d_rank_heartbeats_its_own_p_rank() {
    for rank in 0..2 {
        let mut s = sender(fabric(), 2, rank);
        // A fresh tracker per rank keeps this simple: each is due at once.
        let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
        t.on_new_request("d1", &params("eng", "p1", 2), T0).unwrap();
        connect(&mut s, &mut t);
        let sent: Vec<(&str, &[u8])> = s.fabric().sent().collect();
        assert_eq!(
            sent,
            [(format!("p0:5600/eng/{rank}").as_str(), &b"HB:p1"[..])]
        );
    }
}

#[test]
fn handshake_first_then_send_at_the_first_step_it_is_ready() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 1), T0).unwrap();
    let mut f = fabric();
    f.set_default_policy(Policy {
        ready_after_polls: 3,
        ..Policy::default()
    });
    let mut s = sender(f, 1, 0);
    let handle = t.engine_of("d1").unwrap().handle();

    // Step 1: due; the handshake starts and is not polled in this step.
    let r = s.step(&mut t, T0);
    assert_eq!((r.engines_due, r.messages_sent, r.peers_owed), (1, 0, 1));
    assert!(matches!(
        s.peer_status(handle, 0),
        Some(PeerStatus::Pending(_))
    ));
    assert_eq!(s.fabric().agents()[0].polls, 0);
    // Steps 2 and 3: not due any more, but the owed peer is polled.
    let r = s.step(&mut t, T0 + ms(10));
    assert_eq!((r.engines_due, r.messages_sent, r.peers_owed), (0, 0, 1));
    let r = s.step(&mut t, T0 + ms(20));
    assert_eq!((r.engines_due, r.messages_sent, r.peers_owed), (0, 0, 1));
    // Step 4: the third poll answers Ready: the heartbeat goes out now,
    // not an interval later.
    let r = s.step(&mut t, T0 + ms(30));
    assert_eq!((r.engines_due, r.messages_sent, r.peers_owed), (0, 1, 0));
    assert!(matches!(
        s.peer_status(handle, 0),
        Some(PeerStatus::Ready { compact: false, .. })
    ));
    // Nothing more until the interval has passed since the due step.
    let r = s.step(&mut t, T0 + ms(4000));
    assert_eq!(r.messages_sent, 0);
    let r = s.step(&mut t, T0 + Duration::from_secs(5));
    assert_eq!((r.engines_due, r.messages_sent), (1, 1));
    let c = s.counters();
    assert_eq!((c.deferred, c.deferred_sent), (1, 1));
    assert_eq!((c.handshakes_started, c.handshakes_ready), (1, 1));
    assert_eq!(s.fabric().sent_to("p0:5600/eng/0"), ["HB:p1", "HB:p1"]);
}

#[test]
fn a_failed_handshake_backs_off_exponentially_up_to_the_cap() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 1), T0).unwrap();
    let mut f = fabric();
    f.set_default_policy(Policy {
        fail_attempts: 6,
        ..Policy::default()
    });
    let mut cfg = SenderConfig::new(&lease_config(), 1, 0);
    cfg.backoff_initial = ms(100);
    cfg.backoff_max = ms(1000);
    let mut s = HeartbeatSender::new(f, DefaultPeerAddress, cfg).unwrap();
    let handle = t.engine_of("d1").unwrap().handle();
    // Drive steps every 10 ms for 5 s and record when attempts start.
    let mut starts = Vec::new();
    let mut now = T0;
    let mut last_attempts = 0;
    let mut saw_error = false;
    while now < T0 + Duration::from_secs(5) {
        let r = s.step(&mut t, now);
        if let Some(StepError::Fabric { error, rank, .. }) = r.last_error {
            assert_eq!((error, rank), (FabricError::PeerUnreachable, 0));
            saw_error = true;
        }
        let a = s.fabric().agents()[0].attempts;
        if a != last_attempts {
            starts.push(now.saturating_duration_since(T0).as_millis() as u64);
            last_attempts = a;
        }
        now = now + ms(10);
    }
    assert!(saw_error);
    // Attempt n fails at its first poll (one step after it started), then
    // waits 100, 200, 400, 800, 1000, 1000 ms; the retry starts at the end
    // of the step in which the wait ran out, from the engine's kept key,
    // without waiting for a plan to carry the engine again.
    let mut want = vec![0u64];
    let mut at = 0;
    for wait in [100, 200, 400, 800, 1000, 1000] {
        at += 10 + wait;
        want.push(at);
    }
    assert_eq!(starts, want);
    // The seventh attempt succeeded; the heartbeat was sent right after.
    assert!(matches!(
        s.peer_status(handle, 0),
        Some(PeerStatus::Ready { .. })
    ));
    let c = s.counters();
    assert_eq!(c.handshakes_failed, 6);
    assert_eq!(c.handshakes_started, 7);
    assert_eq!(c.handshakes_redialled, 6, "every retry from the kept key");
    assert!(c.messages_sent >= 1);
    assert_eq!(s.fabric().sent_to("p0:5600/eng/0")[0], "HB:p1");
}

#[test]
fn compact_form_only_when_the_peer_takes_it_and_every_request_is_leased() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &leased("eng", "p1", 7, 0xff), T0)
        .unwrap();
    t.on_new_request("d2", &leased("eng", "p2", 9, 0x1234), T0)
        .unwrap();
    let mut f = fabric();
    f.set_default_policy(Policy::compact());
    let mut s = sender(f, 1, 0);
    let now = connect(&mut s, &mut t);
    let msgs = s.fabric().sent_to("p0:5600/eng/0");
    assert_eq!(msgs.len(), 1);
    let Notification::CompactHeartbeat(entries) = wire::decode(msgs[0].as_bytes()).unwrap() else {
        panic!("{}", msgs[0]);
    };
    let mut got: Vec<(u32, u64)> = entries.map(|e| (e.slot, e.nonce.get())).collect();
    got.sort();
    assert_eq!(got, [(7, 0xff), (9, 0x1234)]);
    assert_eq!(s.counters().compact_messages_sent, 1);

    // One request without a lease: the whole engine falls back to text.
    t.on_new_request("d3", &params("eng", "p3", 1), now)
        .unwrap();
    let later = now + Duration::from_secs(5);
    s.step(&mut t, later);
    let msgs = s.fabric().sent_to("p0:5600/eng/0");
    assert_eq!(msgs.len(), 2);
    assert_eq!(ids(&msgs[1]), ["p1", "p2", "p3"]);
}

#[test]
fn a_peer_without_compact_support_gets_text_even_when_all_are_leased() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &leased("eng", "p1", 7, 0xff), T0)
        .unwrap();
    let mut s = sender(fabric(), 1, 0);
    connect(&mut s, &mut t);
    assert_eq!(s.fabric().sent_to("p0:5600/eng/0"), ["HB:p1"]);
}

#[test]
fn a_large_batch_is_split_to_the_fabric_limit() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    let ids_in: Vec<String> = (0..100).map(|i| format!("cmpl-{i:04}-abcdef")).collect();
    for (i, p) in ids_in.iter().enumerate() {
        t.on_new_request(&format!("d{i}"), &params("eng", p, 1), T0)
            .unwrap();
    }
    let mut s = sender(FakeFabric::new(64, 8, 1024, 1 << 16), 1, 0);
    connect(&mut s, &mut t);
    let msgs = s.fabric().sent_to("p0:5600/eng/0");
    assert!(msgs.len() > 1);
    let mut all = Vec::new();
    for m in &msgs {
        assert!(m.len() <= 64, "{m}");
        all.extend(ids(m));
    }
    all.sort();
    let mut want = ids_in.clone();
    want.sort();
    assert_eq!(all, want);
    assert_eq!(s.counters().messages_sent, msgs.len() as u64);
}

#[test]
fn an_owed_heartbeat_is_dropped_when_its_engine_disappears() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 1), T0).unwrap();
    let mut f = fabric();
    f.set_default_policy(Policy {
        ready_after_polls: 2,
        ..Policy::default()
    });
    let mut s = sender(f, 1, 0);
    let r = s.step(&mut t, T0);
    assert_eq!(r.peers_owed, 1);
    assert!(t.on_transfer_complete("d1"));
    let r = s.step(&mut t, T0 + ms(10));
    assert_eq!(r.peers_owed, 0);
    assert_eq!(s.counters().deferred_dropped, 1);
    for i in 2..10 {
        s.step(&mut t, T0 + ms(10 * i));
    }
    assert_eq!(s.fabric().total_messages, 0);
}

#[test]
fn a_send_that_loses_the_connection_goes_back_through_the_handshake() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 1), T0).unwrap();
    let mut f = fabric();
    f.set_default_policy(Policy {
        send_error: Some(FabricError::PeerUnreachable),
        ..Policy::default()
    });
    let mut s = sender(f, 1, 0);
    let handle = t.engine_of("d1").unwrap().handle();
    s.step(&mut t, T0);
    let r = s.step(&mut t, T0 + ms(10));
    assert_eq!(r.messages_sent, 0);
    assert_eq!(r.peers_owed, 1);
    assert!(matches!(
        r.last_error,
        Some(StepError::Fabric {
            error: FabricError::PeerUnreachable,
            ..
        })
    ));
    assert!(matches!(
        s.peer_status(handle, 0),
        Some(PeerStatus::Failed { failures: 1, .. })
    ));
    assert_eq!(s.counters().send_failed, 1);
}

#[test]
fn a_peer_the_fabric_forgot_is_handshaken_again_without_backoff() {
    let cfg = lease_config();
    let mut t = HeartbeatTracker::new(&cfg, 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 1), T0).unwrap();
    let mut s = sender(fabric(), 1, 0);
    let handle = t.engine_of("d1").unwrap().handle();
    let now = connect(&mut s, &mut t);
    let Some(PeerStatus::Ready { agent, .. }) = s.peer_status(handle, 0) else {
        panic!("not ready: {:?}", s.peer_status(handle, 0));
    };
    assert_eq!(s.fabric().total_messages, 1);
    // The fabric forgets the peer (a NIXL fabric evicts it to make room for
    // a restarted worker, or the engine removes it).
    s.fabric_mut().remove_peer(agent).unwrap();
    // Its next heartbeat is refused: the peer is forgotten, not backed off,
    // and its handshake starts again at the end of that very step, from
    // the engine's kept key (no plan needed)...
    let due = now + cfg.heartbeat_interval();
    let r = s.step(&mut t, due);
    assert_eq!((r.messages_sent, r.peers_owed), (0, 1));
    assert!(matches!(
        s.peer_status(handle, 0),
        Some(PeerStatus::Pending(_))
    ));
    assert_eq!(s.counters().peers_forgotten, 1);
    assert_eq!(s.counters().handshakes_redialled, 1);
    // ... so the next step finds it ready and the one after sends, well
    // inside the 250 ms a failed peer would wait.
    s.step(&mut t, due + ms(1));
    let r = s.step(&mut t, due + ms(2));
    assert_eq!((r.messages_sent, r.peers_owed), (1, 0));
    let Some(PeerStatus::Ready { agent: again, .. }) = s.peer_status(handle, 0) else {
        panic!("not ready again: {:?}", s.peer_status(handle, 0));
    };
    assert_ne!(again, agent, "a forgotten agent's id is not reissued");
    assert_eq!(s.fabric().total_messages, 2);
    assert_eq!(s.counters().handshakes_failed, 0);
}

#[test]
fn a_full_queue_keeps_the_peer_and_retries_next_step() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 1), T0).unwrap();
    let mut f = fabric();
    f.set_default_policy(Policy {
        send_error: Some(FabricError::Full),
        ..Policy::default()
    });
    let mut s = sender(f, 1, 0);
    let handle = t.engine_of("d1").unwrap().handle();
    s.step(&mut t, T0);
    let r = s.step(&mut t, T0 + ms(10));
    assert_eq!(r.peers_owed, 1);
    assert!(matches!(
        s.peer_status(handle, 0),
        Some(PeerStatus::Ready { .. })
    ));
    // Still full: retried every step, never a panic.
    s.step(&mut t, T0 + ms(20));
    assert_eq!(s.counters().send_failed, 2);
}

#[test]
fn unmappable_tp_and_excess_fan_out_are_typed_and_counted() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &params("odd", "p1", 3), T0).unwrap();
    t.on_new_request("d2", &params("wide", "p2", 64), T0)
        .unwrap();
    let mut s = sender(fabric(), 2, 0);
    let mut errors = Vec::new();
    t.due(T0, |b| {
        if let Err(e) = s.send_due(&b, T0) {
            errors.push((b.key().engine_id.to_string(), e));
        }
    });
    errors.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        errors,
        [
            (
                "odd".to_string(),
                SenderError::Topology(TopologyError::NotDivisible {
                    local_tp: 2,
                    remote_tp: 3
                })
            ),
            (
                "wide".to_string(),
                SenderError::FanOutTooLarge {
                    fan_out: 32,
                    max: 16
                }
            ),
        ]
    );
    assert_eq!(s.counters().engines_refused, 2);
    assert_eq!(s.fabric().handshake_calls, 0);
}

#[test]
fn a_bad_local_rank_is_refused_at_construction() {
    let cfg = SenderConfig::new(&lease_config(), 2, 2);
    let err = HeartbeatSender::new(fabric(), DefaultPeerAddress, cfg).unwrap_err();
    assert_eq!(
        err,
        SenderError::Topology(TopologyError::RankOutOfRange {
            rank: 2,
            local_tp: 2
        })
    );
}

#[test]
fn the_engine_supplies_the_address_format() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 2), T0).unwrap();
    let addr = |k: &EngineKey<'_>, rank: u32, out: &mut dyn fmt::Write| {
        write!(out, "agent-{}-{}", k.engine_id, rank)
    };
    let cfg = SenderConfig::new(&lease_config(), 2, 1);
    let mut s = HeartbeatSender::new(fabric(), addr, cfg).unwrap();
    s.step(&mut t, T0);
    s.step(&mut t, T0 + ms(1));
    assert_eq!(s.fabric().sent_to("agent-eng-1"), ["HB:p1"]);
}

#[test]
fn an_address_that_does_not_fit_backs_off_instead_of_panicking() {
    struct Long;
    impl PeerAddress for Long {
        fn write_address(
            &self,
            _: &EngineKey<'_>,
            _: u32,
            out: &mut dyn fmt::Write,
        ) -> fmt::Result {
            for _ in 0..100 {
                out.write_str("0123456789")?;
            }
            Ok(())
        }
    }
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 1), T0).unwrap();
    let cfg = SenderConfig::new(&lease_config(), 1, 0);
    let mut s = HeartbeatSender::new(fabric(), Long, cfg).unwrap();
    let r = s.step(&mut t, T0);
    assert!(matches!(
        r.last_error,
        Some(StepError::Fabric {
            error: FabricError::BadAddress,
            ..
        })
    ));
    assert_eq!(s.counters().address_errors, 1);
    assert_eq!(s.fabric().handshake_calls, 0);
}

#[test]
fn a_reused_engine_slot_starts_over_with_the_new_engine() {
    let mut cfg = lease_config();
    cfg.max_remote_engines = 1;
    let mut t = HeartbeatTracker::new(&cfg, 1).expect("tracker");
    let scfg = SenderConfig::new(&cfg, 1, 0);
    let mut s = HeartbeatSender::new(fabric(), DefaultPeerAddress, scfg).unwrap();
    t.on_new_request("d1", &params("engA", "p1", 1), T0)
        .unwrap();
    connect(&mut s, &mut t);
    assert!(t.on_request_finished("d1"));
    let mut b = params("engB", "p2", 1);
    b.remote_host = Some("p9");
    t.on_new_request("d2", &b, T0).unwrap();
    let now = T0 + ms(20);
    s.step(&mut t, now);
    s.step(&mut t, now + ms(10));
    assert_eq!(s.fabric().sent_to("p0:5600/engA/0"), ["HB:p1"]);
    assert_eq!(s.fabric().sent_to("p9:5600/engB/0"), ["HB:p2"]);
}

#[test]
fn the_fake_fabric_agrees_with_the_handshake_contract() {
    // Guard for the fake itself: an unknown agent is Failed, not a panic.
    let mut f = fabric();
    use kvlease::fabric::{AgentId, Fabric};
    assert_eq!(
        f.handshake_state(AgentId(9), T0),
        HandshakeState::Failed(FabricError::UnknownAgent)
    );
}

/// Random engines (odd and huge TP sizes, failing, slow and refusing peers,
/// tiny message limits), random churn and a `now` that jumps around: no
/// panic, and every owed peer belongs to a live engine.
#[test]
fn hostile_fabrics_and_engines_never_panic() {
    let mut rng = SplitMix64::new(0xdead_beef_cafe_f00du64);
    let mut next = move || rng.next_u64();
    for round in 0..20u64 {
        let max_len = [3, 4, 27, 28, 40, 4096][(round % 6) as usize];
        let mut f = FakeFabric::new(max_len, 64, 16, 4096);
        f.set_policy(
            "p0:5600/e1/",
            Policy {
                fail_attempts: 3,
                ..Policy::default()
            },
        );
        f.set_policy(
            "p0:5600/e2/",
            Policy {
                ready_after_polls: 4,
                ..Policy::compact()
            },
        );
        f.set_policy(
            "p0:5600/e3/",
            Policy {
                send_error: Some(FabricError::NotConnected),
                ..Policy::default()
            },
        );
        f.set_default_policy(Policy {
            compact: round % 2 == 0,
            ..Policy::default()
        });
        let mut cfg = lease_config();
        cfg.max_remote_engines = 4;
        let mut t = HeartbeatTracker::new(&cfg, 1).expect("tracker");
        let local_tp = [1, 2, 4][(round % 3) as usize];
        let scfg = SenderConfig::new(&cfg, local_tp, (round % local_tp as u64) as u32);
        let mut s = HeartbeatSender::new(f, DefaultPeerAddress, scfg).unwrap();
        let mut now = T0;
        for i in 0..3_000u64 {
            let r = next();
            now = if r % 101 == 0 {
                Instant::from_nanos(next() % 1_000_000_000_000)
            } else {
                now + Duration::from_millis(r % 900)
            };
            let d = format!("d{}", r % 40);
            if r % 3 == 0 {
                let _ = t.on_request_finished(&d);
            } else {
                let e = format!("e{}", (r >> 8) % 6);
                let p = format!("p{i}");
                let tp = [1, 2, 3, 4, 8, 64, u32::MAX][(r >> 16) as usize % 7];
                let mut params = params(&e, &p, tp);
                if (r >> 24) % 3 != 0 {
                    params.remote_lease_slot = Some((r >> 32) as u32);
                    params.remote_lease_nonce = Some((r | 1) as i64);
                }
                let _ = t.on_new_request(&d, &params, now);
            }
            let _ = s.step(&mut t, now);
            // Nothing owed for an engine the tracker no longer has, after
            // the step that noticed.
            let live: u32 = t.engines().count() as u32;
            assert!(s.peers_owed() <= live * scfg.max_fan_out);
        }
        let c = s.counters();
        assert!(c.engines_due > 0);
    }
}

#[test]
fn port_per_rank_address_is_the_rank_listener() {
    use kvlease::consumer::PortPerRankAddress;
    let key = EngineKey {
        engine_id: "prefill-0",
        host: "10.0.0.7",
        port: 5600,
        tp_size: 4,
    };
    let mut out = String::new();
    PortPerRankAddress.write_address(&key, 3, &mut out).unwrap();
    assert_eq!(out, "10.0.0.7:5603");
    // The last port plus a rank does not wrap: it is an address the fabric refuses.
    let high = EngineKey {
        port: u16::MAX,
        ..key
    };
    out.clear();
    PortPerRankAddress
        .write_address(&high, 1, &mut out)
        .unwrap();
    assert_eq!(out, "10.0.0.7:65536");
}

#[test]
fn step_errors_display_and_chain_their_source() {
    use std::error::Error;
    let e = StepError::Fabric {
        engine: kvlease::consumer::EngineHandle {
            index: 2,
            generation: 7,
        },
        rank: 3,
        error: FabricError::PeerUnreachable,
    };
    assert_eq!(
        e.to_string(),
        "heartbeat to P rank 3 of engine slot 2 (generation 7): peer unreachable"
    );
    assert_eq!(
        e.source().map(ToString::to_string),
        Some("peer unreachable".to_string())
    );
    let e = StepError::Sender(SenderError::FanOutTooLarge {
        fan_out: 32,
        max: 16,
    });
    assert!(e.to_string().starts_with("engine not heartbeated: "));
    assert!(e.source().is_some());
}

#[test]
fn a_gone_notice_drops_only_that_engines_debt() {
    let mut t = HeartbeatTracker::new(&lease_config(), 1).expect("tracker");
    t.on_new_request("d1", &params("eng", "p1", 1), T0).unwrap();
    let mut f = fabric();
    f.set_default_policy(Policy {
        ready_after_polls: 5,
        ..Policy::default()
    });
    let mut s = sender(f, 1, 0);
    let handle = t.engine_of("d1").unwrap().handle();
    let r = s.step(&mut t, T0);
    assert_eq!(r.peers_owed, 1);
    assert_eq!(s.owed_engines().collect::<Vec<_>>(), [handle]);
    // A notice for another generation of the slot: not this debt.
    s.engine_gone(kvlease::consumer::EngineHandle {
        generation: handle.generation + 1,
        ..handle
    });
    assert_eq!(s.peers_owed(), 1);
    s.engine_gone(handle);
    assert_eq!((s.peers_owed(), s.counters().deferred_dropped), (0, 1));
    assert_eq!(s.owed_engines().len(), 0);
}
