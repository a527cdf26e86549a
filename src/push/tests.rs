//! The push guard's roles, driven together through their wire bytes: each
//! fault case of the module docs, the gate's clock arithmetic, and the codec.

use core::time::Duration;

use super::wire::{self, PushMessage};
use super::*;
use crate::clock_offset::{ClockOffset, ClockOffsetConfig};
use crate::fabric::ClockSample;
use crate::nonce::NonceSource;
use crate::time::Instant;

const D: u16 = 3; // P's name for the D peer
const P: u16 = 5; // D's name for the P peer

fn secs(s: f64) -> Instant {
    Instant::from_nanos((s * 1e9) as u64)
}

fn config() -> PushConfig {
    PushConfig {
        capacity: 8,
        ..PushConfig::with_duration(Duration::from_secs(12))
    }
}

/// P's estimate of D's clock: D's clock reads 1000 s more than P's, 2 ms
/// round trip, taken at P's `at`.
fn clock_at(at: f64) -> ClockOffset {
    let mut c = ClockOffset::new(ClockOffsetConfig::default());
    c.observe(ClockSample {
        local_send: secs(at - 0.002),
        remote: secs(at + 1000.0 - 0.001),
        local_recv: secs(at),
    });
    c
}

/// D's clock for P's `t`.
fn on_d(t: f64) -> Instant {
    secs(t + 1000.0)
}

struct Pair {
    d: PushPermits,
    p: PushWrites,
    clock: ClockOffset,
    /// Messages in flight, as (to P?, bytes).
    to_p: Vec<Vec<u8>>,
    to_d: Vec<Vec<u8>>,
    ends: Vec<PermitEnd>,
}

impl Pair {
    fn new() -> Pair {
        Pair {
            d: PushPermits::new(config(), NonceSource::from_seed(0, 1, 2)).unwrap(),
            p: PushWrites::new(config(), 7).unwrap(),
            clock: clock_at(1.0),
            to_p: Vec::new(),
            to_d: Vec::new(),
            ends: Vec::new(),
        }
    }

    /// One step of both sides at P's time `t` (D's time is `t + 1000`).
    fn step(&mut self, t: f64) {
        let clock = &self.clock;
        let to_d = &mut self.to_d;
        self.p.poll(
            |peer| (peer == D).then_some(clock),
            secs(t),
            |peer, m| {
                assert_eq!(peer, D);
                to_d.push(m.to_vec())
            },
        );
        let to_p = &mut self.to_p;
        let ends = &mut self.ends;
        self.d.poll(
            on_d(t),
            |peer, m| {
                assert_eq!(peer, P);
                to_p.push(m.to_vec())
            },
            |e| ends.push(e),
        );
    }

    fn p_config(&self) -> PushConfig {
        config()
    }

    fn deliver_to_d(&mut self, t: f64) {
        for m in std::mem::take(&mut self.to_d) {
            let ends = &mut self.ends;
            self.d.on_message(P, &m, on_d(t), |e| ends.push(e)).unwrap();
        }
    }

    fn deliver_to_p(&mut self) {
        for m in std::mem::take(&mut self.to_p) {
            self.p.on_message(D, &m).unwrap();
        }
    }

    fn register(&mut self, t: f64, live: bool) -> (PermitFields, Result<WriteHandle, Refusal>) {
        let f = self.d.register(P, on_d(t)).unwrap();
        let r = self.p.register(D, f, live, &self.clock, secs(t));
        (f, r)
    }
}

#[test]
fn happy_path_write_lands_and_d_uses_the_blocks() {
    let mut x = Pair::new();
    let (f, h) = x.register(1.0, true);
    let h = h.unwrap();
    x.p.begin_write(h, &x.clock, secs(2.0)).unwrap();
    assert!(x.p.write_done(h, true, secs(2.1)));
    x.step(2.1);
    x.deliver_to_d(2.2);
    assert_eq!(x.ends.len(), 1);
    assert_eq!(
        (x.ends[0].slot, x.ends[0].nonce, x.ends[0].end),
        (f.slot, f.nonce, PushEnd::Written)
    );
    assert!(x.ends[0].end.loaded());
    assert_eq!(x.d.live(), 0);
}

#[test]
fn late_registration_is_answered_at_once_and_frees_the_blocks() {
    let mut x = Pair::new();
    let (f, r) = x.register(1.0, false);
    assert_eq!(r, Err(Refusal::RequestGone));
    x.step(1.0);
    x.deliver_to_d(1.01);
    assert_eq!(x.ends.len(), 1);
    assert_eq!(
        (x.ends[0].nonce, x.ends[0].end),
        (f.nonce, PushEnd::Refused)
    );
    // P remembers: the same registration again is answered the same way.
    assert_eq!(
        x.p.register(D, f, true, &x.clock, secs(1.5)),
        Err(Refusal::AlreadyEnded(EndCode::Refused))
    );
}

#[test]
fn dead_p_lapses_at_the_fence_not_before() {
    let mut x = Pair::new();
    let f = x.d.register(P, on_d(0.0)).unwrap();
    let fence = x.d.fence(f.deadline);
    // 12 s + 10 s + 10 s * 100 ppm.
    assert_eq!(fence, on_d(22.001));
    x.d.poll(on_d(22.0), |_, _| {}, |e| x.ends.push(e));
    assert!(x.ends.is_empty(), "ended before the fence");
    x.d.poll(on_d(22.001), |_, _| {}, |e| x.ends.push(e));
    assert_eq!(x.ends.len(), 1);
    assert_eq!(x.ends[0].end, PushEnd::Lapsed);
}

#[test]
fn heartbeats_renew_the_permit_and_p_sees_the_later_deadline() {
    let mut x = Pair::new();
    let (f, h) = x.register(1.0, true);
    let h = h.unwrap();
    // P holds it 30 s (a long prefill queue) heartbeating; D renews.
    let mut t = 1.0;
    while t < 31.0 {
        x.step(t);
        x.deliver_to_d(t + 0.01);
        x.step(t + 0.01);
        x.deliver_to_p();
        t += 1.0;
    }
    assert!(x.ends.is_empty(), "{:?}", x.ends);
    assert!(x.d.counters().renewed > 10);
    assert!(x.p.counters().renewed > 10);
    // Far past the first deadline (13 s), P may still write.
    x.p.begin_write(h, &x.clock, secs(31.0)).unwrap();
    assert!(x.p.write_done(h, true, secs(31.5)));
    x.step(31.5);
    x.deliver_to_d(31.6);
    assert_eq!(x.ends[0].nonce, f.nonce);
    assert_eq!(x.ends[0].end, PushEnd::Written);
}

#[test]
fn without_renewals_p_closes_its_gate_before_d_deadline() {
    let mut x = Pair::new();
    let (f, h) = x.register(1.0, true);
    let h = h.unwrap();
    // D's deadline is P's 13.0 (estimate); the gate closes a post margin
    // (1 s) and the bound (1 ms and drift) earlier.
    assert_eq!(f.deadline, on_d(13.0));
    assert_eq!(
        x.p.begin_write(h, &x.clock, secs(12.1)),
        Err(PostRefused::Closed)
    );
    let mut y = Pair::new();
    let (_, h) = y.register(1.0, true);
    y.p.begin_write(h.unwrap(), &y.clock, secs(11.9)).unwrap();
}

#[test]
fn abort_while_the_write_is_in_flight_waits_for_it() {
    let mut x = Pair::new();
    let (f, h) = x.register(1.0, true);
    let h = h.unwrap();
    x.p.begin_write(h, &x.clock, secs(2.0)).unwrap();
    x.d.revoke(f.slot, f.nonce).unwrap();
    x.step(2.0);
    x.deliver_to_p();
    x.step(2.1);
    x.deliver_to_d(2.1);
    assert!(x.ends.is_empty(), "D freed under a WRITE in flight");
    // The WRITE ends (it landed): P answers, D frees.
    assert!(x.p.write_done(h, true, secs(2.5)));
    x.step(2.5);
    x.deliver_to_d(2.5);
    assert_eq!(x.ends.len(), 1);
    assert_eq!(x.ends[0].end, PushEnd::Revoked);
}

#[test]
fn abort_before_the_write_ends_at_once_and_p_never_posts() {
    let mut x = Pair::new();
    let (f, h) = x.register(1.0, true);
    let h = h.unwrap();
    x.d.revoke(f.slot, f.nonce).unwrap();
    x.step(1.5);
    x.deliver_to_p();
    assert_eq!(
        x.p.begin_write(h, &x.clock, secs(1.6)),
        Err(PostRefused::Closed)
    );
    x.step(1.6);
    x.deliver_to_d(1.6);
    assert_eq!(x.ends.len(), 1);
    assert_eq!(x.ends[0].end, PushEnd::Revoked);
}

#[test]
fn revoke_reaching_p_before_the_registration_is_not_answered() {
    let mut x = Pair::new();
    let f = x.d.register(P, on_d(1.0)).unwrap();
    x.d.revoke(f.slot, f.nonce).unwrap();
    x.step(1.0);
    x.deliver_to_p(); // PRV: first: P knows nothing, says nothing
    assert_eq!(x.p.counters().stale_records, 1);
    let h = x.p.register(D, f, true, &x.clock, secs(1.1)).unwrap();
    // The late registration is still good until its deadline: D must wait.
    x.step(1.2);
    x.deliver_to_d(1.2);
    assert!(x.ends.is_empty());
    // PRV: again (resent each interval) now ends it.
    x.step(3.5);
    x.deliver_to_p();
    assert_eq!(
        x.p.begin_write(h, &x.clock, secs(3.6)),
        Err(PostRefused::Closed)
    );
    x.step(3.6);
    x.deliver_to_d(3.6);
    assert_eq!(x.ends.len(), 1);
    assert_eq!(x.ends[0].end, PushEnd::Revoked);
}

#[test]
fn p_without_a_clock_estimate_refuses() {
    let mut x = Pair::new();
    x.clock = ClockOffset::new(ClockOffsetConfig::default());
    let (_, r) = x.register(1.0, true);
    assert_eq!(r, Err(Refusal::NoClock));
}

#[test]
fn exhausted_permits_are_a_typed_error() {
    let mut d = PushPermits::new(config(), NonceSource::from_seed(0, 1, 2)).unwrap();
    for _ in 0..8 {
        d.register(P, on_d(0.0)).unwrap();
    }
    assert_eq!(d.register(P, on_d(0.0)), Err(PushError::Exhausted));
    assert_eq!(d.counters().exhausted, 1);
}

#[test]
fn stale_and_duplicate_ends_change_nothing() {
    let mut x = Pair::new();
    let (f, h) = x.register(1.0, true);
    let h = h.unwrap();
    x.p.begin_write(h, &x.clock, secs(1.5)).unwrap();
    assert!(x.p.write_done(h, true, secs(1.6)));
    x.step(1.6);
    let dup = x.to_d.clone();
    x.deliver_to_d(1.6);
    x.to_d = dup;
    x.deliver_to_d(1.7); // duplicated PEND:W
    assert_eq!(x.ends.len(), 1);
    assert!(x.d.counters().stale_records >= 1);
    // A new permit in the same slot is not ended by the old nonce.
    let g = x.d.register(P, on_d(2.0)).unwrap();
    assert_eq!(g.slot, f.slot);
    assert_ne!(g.nonce, f.nonce);
    let mut buf = [0u8; 64];
    let mut w = wire::MessageWriter::new(&mut buf, wire::END_PREFIX);
    let mut old = Vec::new();
    w.end(f.slot, f.nonce, EndCode::Ended, &mut |m: &[u8]| {
        old.push(m.to_vec())
    })
    .unwrap();
    w.flush(&mut |m: &[u8]| old.push(m.to_vec()));
    x.d.on_message(P, &old[0], on_d(2.1), |e| x.ends.push(e))
        .unwrap();
    assert_eq!(x.ends.len(), 1);
    assert_eq!(x.d.live(), 1);
}

#[test]
fn a_late_write_is_counted() {
    let mut x = Pair::new();
    let (_, h) = x.register(1.0, true);
    let h = h.unwrap();
    x.p.begin_write(h, &x.clock, secs(1.5)).unwrap();
    assert!(x.p.write_done(h, true, secs(12.0)));
    assert_eq!(x.p.counters().late_writes, 1);
}

#[test]
fn p_forgets_an_ended_registration_once_its_deadline_surely_passed() {
    let mut x = Pair::new();
    let (f, h) = x.register(1.0, true);
    x.p.cancel(h.unwrap());
    x.step(1.5);
    assert_eq!(x.p.held(), 1);
    // The gate of deadline 13.0 closed at ~12.0, but the deadline itself
    // has not surely passed: P still answers a duplicate the same way.
    x.step(12.5);
    assert_eq!(x.p.held(), 1);
    assert_eq!(
        x.p.register(D, f, true, &x.clock, secs(12.6)),
        Err(Refusal::AlreadyEnded(EndCode::Ended))
    );
    x.step(13.1); // answers the duplicate
    x.step(13.2); // then forgets
    assert_eq!(x.p.held(), 0);
    assert_eq!(
        x.p.register(D, f, true, &x.clock, secs(13.3)),
        Err(Refusal::PastDeadline)
    );
}

/// The model check's counterexample (model/src/push.rs, `PushBound::RESAMPLE`):
/// P refuses a registration for want of a clock sample, then gets one; a
/// duplicate of the registration must still be refused, never written.
#[test]
fn a_first_clock_sample_does_not_reopen_a_refused_registration() {
    let mut x = Pair::new();
    let real_clock =
        std::mem::replace(&mut x.clock, ClockOffset::new(ClockOffsetConfig::default()));
    let (f, r) = x.register(1.0, true);
    assert_eq!(r, Err(Refusal::NoClock));
    x.step(3.0); // P's scan: with no estimate it keeps the entry
    assert_eq!(x.p.held(), 1);
    x.clock = real_clock;
    assert_eq!(
        x.p.register(D, f, true, &x.clock, secs(3.1)),
        Err(Refusal::AlreadyEnded(EndCode::Refused))
    );
}

#[test]
fn codec_round_trips_and_refuses_bad_bytes() {
    let f = PermitFields {
        slot: 7,
        nonce: crate::Nonce::new(0xff).unwrap(),
        deadline: Instant::from_nanos(0x1234),
    };
    let field = f.encode();
    assert_eq!(&field, b"0000000700000000000000ff0000000000001234");
    assert_eq!(PermitFields::decode(&field), Ok(f));
    assert_eq!(wire::decode(b"PRN:"), Err(PushWireError::NoRecords));
    assert_eq!(wire::decode(b"PHB:00000007"), Err(PushWireError::Truncated));
    assert_eq!(
        wire::decode(b"PHB:000000070000000000000000"),
        Err(PushWireError::ZeroNonce)
    );
    assert_eq!(
        wire::decode(b"PEND:0000000700000000000000ffQ"),
        Err(PushWireError::BadCode)
    );
    assert_eq!(
        wire::decode(b"PRV:0000000g00000000000000ff"),
        Err(PushWireError::BadHex)
    );
    assert_eq!(wire::decode(b"HB:x"), Err(PushWireError::UnknownPrefix));
    match wire::decode(b"PEND:0000000700000000000000ffW00000008000000000000000aX") {
        Ok(PushMessage::End(r)) => {
            let v: Vec<_> = r.collect();
            assert_eq!(v.len(), 2);
            assert_eq!(v[1].2, EndCode::Ended);
        }
        other => panic!("{other:?}"),
    }
    assert!(wire::is_push_message(b"PHB:"));
    assert!(!wire::is_push_message(b"HBC:"));
}

#[test]
fn messages_split_at_max_len_and_name_the_right_peer() {
    let cfg = PushConfig {
        capacity: 64,
        max_message_len: 4 + 24 * 3,
        ..config()
    };
    let mut p = PushWrites::new(cfg, 1).unwrap();
    let clock = clock_at(1.0);
    let mut d = PushPermits::new(cfg, NonceSource::from_seed(0, 3, 4)).unwrap();
    for i in 0..10u16 {
        let f = d.register(P, on_d(1.0)).unwrap();
        p.register(i % 2, f, true, &clock, secs(1.0)).unwrap();
    }
    let mut msgs = Vec::new();
    p.poll(
        |_| Some(&clock),
        secs(1.0),
        |peer, m| msgs.push((peer, m.to_vec())),
    );
    let records: usize = msgs.iter().map(|(_, m)| (m.len() - 4) / 24).sum();
    assert_eq!(records, 10);
    assert!(msgs
        .iter()
        .all(|(_, m)| m.len() <= 4 + 24 * 3 && m.starts_with(b"PHB:")));
    // Every record went to its own peer: D accepts all ten from the right one.
    let mut renewed = 0;
    for (peer, m) in &msgs {
        let before = d.counters().renewed;
        let Ok(PushMessage::Alive(r)) = wire::decode(m) else {
            panic!()
        };
        let n = r.len() as u64;
        d.on_message(P, m, on_d(2.0), |_| {}).unwrap();
        renewed += d.counters().renewed - before;
        let _ = (peer, n);
    }
    assert_eq!(renewed, 10);
}

#[test]
fn bad_configs_are_refused() {
    let bad = [
        PushConfig {
            capacity: 0,
            ..config()
        },
        PushConfig {
            heartbeat_interval: Duration::from_secs(9),
            ..config()
        },
        PushConfig {
            post_margin: Duration::from_secs(9),
            ..config()
        },
        PushConfig {
            max_message_len: 10,
            ..config()
        },
    ];
    for c in bad {
        assert!(matches!(c.validate(), Err(PushError::Config(_))), "{c:?}");
        assert!(PushWrites::new(c, 0).is_err());
    }
}

#[test]
fn peer_messages_carry_one_peer_each_and_split_when_full() {
    // Room for the prefix and two 24-byte records.
    let mut buf = [0u8; 4 + 2 * 24];
    let mut w = wire::PeerMessages::new(&mut buf, wire::ALIVE_PREFIX);
    let mut sent: Vec<(u16, usize)> = Vec::new();
    let mut emit = |peer: u16, m: &[u8]| {
        assert!(m.starts_with(wire::ALIVE_PREFIX));
        sent.push((peer, (m.len() - wire::ALIVE_PREFIX.len()) / 24))
    };
    let n = |k: u64| crate::Nonce::new(k).unwrap();
    for (peer, slot) in [(7, 1), (7, 2), (7, 3), (9, 4), (7, 5)] {
        w.permit(peer, slot, n(u64::from(slot)), &mut emit).unwrap();
    }
    w.finish(&mut emit);
    // Peer 7's three records split at the buffer; each peer change flushes.
    assert_eq!(sent, [(7, 2), (7, 1), (9, 1), (7, 1)]);
}

/// A peer's id may go to another engine only once no live state names it:
/// both roles say which peers their live entries name, until the last one
/// ended (D: the permit's end; P: the ended entry forgotten after its
/// deadline surely passed).
#[test]
fn peers_in_use_name_live_entries_until_they_end() {
    let in_use = |it: &mut dyn Iterator<Item = u16>| {
        let mut v: Vec<u16> = it.collect();
        v.sort_unstable();
        v
    };
    let mut x = Pair::new();
    assert!(in_use(&mut x.d.peers_in_use()).is_empty());
    assert!(in_use(&mut x.p.peers_in_use()).is_empty());
    let (_, h) = x.register(1.0, true);
    let other = x.d.register(P + 1, on_d(1.0)).unwrap();
    assert_eq!(in_use(&mut x.d.peers_in_use()), vec![P, P + 1]);
    assert_eq!(in_use(&mut x.p.peers_in_use()), vec![D]);
    // Written and answered: D's permit for P ends; P keeps the ended entry
    // (a duplicate must be answered the same) until its deadline passed.
    let h = h.unwrap();
    x.p.begin_write(h, &x.clock, secs(2.0)).unwrap();
    assert!(x.p.write_done(h, true, secs(2.1)));
    x.step(2.1);
    x.deliver_to_d(2.2);
    assert_eq!(in_use(&mut x.d.peers_in_use()), vec![P + 1]);
    assert_eq!(in_use(&mut x.p.peers_in_use()), vec![D]);
    x.step(13.2);
    assert!(in_use(&mut x.p.peers_in_use()).is_empty());
    // The other permit ends at its fence (no P answers it).
    x.d.revoke(other.slot, other.nonce).unwrap();
    assert_eq!(in_use(&mut x.d.peers_in_use()), vec![P + 1]);
    x.d.poll(on_d(40.0), |_, _| {}, |_| {});
    assert!(in_use(&mut x.d.peers_in_use()).is_empty());
}

/// A WRITE stuck in flight (it never reaches a terminal state): P stops
/// naming it in `PHB:` once it is `write_bound` old, so D's permit lapses
/// at its fence, and that comes before `hold_bound` after the post, when
/// the engine ends P's own hold of its blocks.
#[test]
fn a_stuck_write_is_heartbeated_until_write_bound_then_d_fences_within_the_hold_bound() {
    let mut x = Pair::new();
    let (_, h) = x.register(1.0, true);
    let posted = 2.0;
    x.p.begin_write(h.unwrap(), &x.clock, secs(posted)).unwrap();
    let hold_end = posted + x.p_config().hold_bound().as_secs_f64();
    // 12 s permits: extension 8 s, heartbeat every 2 s, write bound 10 s.
    assert!((hold_end - (posted + 38.0038)).abs() < 1e-6, "{hold_end}");
    let mut renewed_after_bound = false;
    let mut lapsed_at = None;
    let mut t = posted;
    while t < hold_end + 5.0 && lapsed_at.is_none() {
        t += 0.5;
        let before = x.to_d.len();
        x.step(t);
        if t > posted + 10.0 + 1e-9 && x.to_d.len() > before {
            renewed_after_bound = true;
        }
        x.deliver_to_d(t);
        x.deliver_to_p();
        if let Some(e) = x.ends.first() {
            assert_eq!(e.end, PushEnd::Lapsed);
            lapsed_at = Some(t);
        }
    }
    assert!(
        !renewed_after_bound,
        "P vouched for a WRITE past write_bound"
    );
    let lapsed_at = lapsed_at.expect("D never fenced the stuck WRITE");
    assert!(
        lapsed_at > posted + 10.0 && lapsed_at <= hold_end,
        "{lapsed_at}"
    );
}

/// vLLM's `kv_connector_extra_config`, parsed as the engine parses it.
fn parse(s: &str) -> Result<crate::ParsedConfig, crate::ConfigError> {
    let shape = crate::EngineShape {
        num_kv_blocks: 1024,
        max_num_seqs: 64,
    };
    crate::LeaseConfig::from_extra_config_json(s, shape)
}

#[test]
fn push_keys_are_parsed_with_the_rest_and_refused_by_name() {
    let c = parse(
        r#"{"kv_lease_duration": 12, "kv_lease_push_write_bound": 4.5, "kv_lease_push_capacity": 64}"#,
    )
    .unwrap();
    assert!(c.unknown_keys.is_empty(), "{:?}", c.unknown_keys);
    let push = PushConfig::from_lease_config(&c.config);
    assert_eq!(push.write_bound, Duration::from_millis(4500));
    assert_eq!(push.capacity, 64);
    assert_eq!(push.validate(), Ok(()));
    // The defaults, when the keys are absent: 10 s and 1,024.
    let d = PushConfig::from_lease_config(&parse("{}").unwrap().config);
    assert_eq!((d.write_bound, d.capacity), (Duration::from_secs(10), 1024));
    for (bad, key) in [
        (
            r#"{"kv_lease_push_write_bound": 0}"#,
            "kv_lease_push_write_bound",
        ),
        (
            r#"{"kv_lease_push_write_bound": "ten"}"#,
            "kv_lease_push_write_bound",
        ),
        (
            r#"{"kv_lease_push_write_bound": -1}"#,
            "kv_lease_push_write_bound",
        ),
        (r#"{"kv_lease_push_capacity": 0}"#, "kv_lease_push_capacity"),
        (
            r#"{"kv_lease_push_capacity": 1073741825}"#,
            "kv_lease_push_capacity",
        ),
        (
            r#"{"kv_lease_push_capacity": 2.5}"#,
            "kv_lease_push_capacity",
        ),
    ] {
        let e = parse(bad).unwrap_err().to_string();
        assert!(e.contains(key), "{bad}: {e}");
    }
}

#[test]
fn push_permits_take_the_pull_sides_one_derivation() {
    // One rule for both sides: Python's floor division on the number, as
    // vLLM derives the pull side's interval and extension (45.5 s: 7 and 30).
    for d in ["6", "6.5", "10", "11.99", "12", "18", "45.5", "3600"] {
        let c = parse(&format!(r#"{{"kv_lease_duration": {d}}}"#))
            .unwrap()
            .config;
        let push = PushConfig::from_lease_config(&c);
        assert_eq!(push.duration, c.lease_duration(), "{d}");
        assert_eq!(push.heartbeat_interval, c.heartbeat_interval(), "{d}");
        assert_eq!(push.extension, c.lease_extension(), "{d}");
        assert_eq!(
            PushConfig::with_duration(c.lease_duration()).extension,
            c.lease_extension(),
            "{d}"
        );
        assert_eq!(push.validate(), Ok(()), "{d}");
    }
}
