//! The loopback fabric through its public API: handshakes, notifications,
//! READs, every fault kind, limits, crashes, determinism, threads.

use std::sync::Arc;
use std::time::Duration;

use kvlease::fabric::loopback::{
    LoopbackConfig, LoopbackError, LoopbackFabric, LoopbackNetwork, NotificationFaults, ReadFaults,
    UnreachableSends, INJECTED_READ_FAILURE,
};
use kvlease::fabric::{
    AgentId, Fabric, FabricError, HandshakeState, ReadDesc, RegionId, XferId, XferState,
};
use kvlease::{Instant, LeaseSlots};

fn t(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn connect(a: &mut LoopbackFabric, b: &str, now: Instant) -> AgentId {
    let id = a.start_handshake(b, now).unwrap();
    for _ in 0..8 {
        match a.handshake_state(id, now) {
            HandshakeState::Ready(_) => return id,
            HandshakeState::Pending => {}
            HandshakeState::Failed(e) => panic!("handshake with {b} failed: {e}"),
        }
    }
    panic!("handshake with {b} never completed");
}

fn drain(f: &mut LoopbackFabric) -> Vec<(String, Vec<u8>)> {
    let mut got = Vec::new();
    let n = f
        .drain_notifications(&mut |from, msg| got.push((from.to_owned(), msg.to_vec())))
        .unwrap();
    assert_eq!(n, got.len(), "drain's count matches the callbacks");
    got
}

fn texts(got: &[(String, Vec<u8>)]) -> Vec<String> {
    got.iter()
        .map(|(_, m)| String::from_utf8_lossy(m).into_owned())
        .collect()
}

/// Two agents, "P" and "D", connected both ways.
struct Pair {
    net: Arc<LoopbackNetwork>,
    p: LoopbackFabric,
    d: LoopbackFabric,
    to_p: AgentId,
    to_d: AgentId,
}

fn pair(cfg: LoopbackConfig) -> Pair {
    let net = LoopbackNetwork::new(cfg);
    let mut p = LoopbackFabric::join(&net, "P").unwrap();
    let mut d = LoopbackFabric::join(&net, "D").unwrap();
    let to_p = connect(&mut d, "P", t(0));
    let to_d = connect(&mut p, "D", t(0));
    Pair {
        net,
        p,
        d,
        to_p,
        to_d,
    }
}

/// Memory a test registers: a boxed buffer kept alive past the fabric
/// (declare it before the fabrics so it drops after them) and only read
/// between READs.
struct Buf {
    ptr: *mut u8,
    len: usize,
}

impl Buf {
    fn new(bytes: &[u8]) -> Buf {
        let b: Box<[u8]> = bytes.into();
        let len = b.len();
        Buf {
            ptr: Box::into_raw(b).cast(),
            len,
        }
    }

    fn register(&self, f: &mut LoopbackFabric) -> RegionId {
        // SAFETY: the allocation lives until `Buf` drops, after the fabrics
        // (declaration order in each test); tests read it only via `bytes`
        // while no READ into it is in flight.
        unsafe { f.register_memory(self.ptr, self.len) }.unwrap()
    }

    fn bytes(&self) -> Vec<u8> {
        // SAFETY: live allocation of `len` bytes; no READ in flight.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: made by Box::into_raw of a boxed slice of `len` bytes.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

fn desc(local: RegionId, remote: RegionId, len: u64) -> ReadDesc {
    ReadDesc {
        local,
        local_offset: 0,
        remote,
        remote_offset: 0,
        len,
    }
}

/// An 8-byte READ source filled with `fill` (for P) and a zeroed 8-byte
/// destination (for D). Declared by the test before its fabrics, so they
/// outlive them (see [`Buf`]).
fn bufs(fill: u8) -> (Buf, Buf) {
    (Buf::new(&[fill; 8]), Buf::new(&[0; 8]))
}

/// The default config with these READ timings in milliseconds (`None`:
/// the default).
fn timing(read_latency_ms: Option<u64>, transfer_timeout_ms: Option<u64>) -> LoopbackConfig {
    let d = LoopbackConfig::default();
    LoopbackConfig {
        read_latency: read_latency_ms.map_or(d.read_latency, Duration::from_millis),
        transfer_timeout: transfer_timeout_ms.map_or(d.transfer_timeout, Duration::from_millis),
        ..d
    }
}

/// [`pair`] with `src` registered on P, `dst` on D, and the descriptor of a
/// READ of all of `src` into `dst`.
fn read_pair(src: &Buf, dst: &Buf, cfg: LoopbackConfig) -> (Pair, ReadDesc) {
    let mut w = pair(cfg);
    let d = desc(dst.register(&mut w.d), src.register(&mut w.p), 8);
    (w, d)
}

// ---------------------------------------------------------------- handshake

#[test]
fn handshake_completes_on_a_later_poll_and_is_idempotent() {
    let cfg = LoopbackConfig {
        handshake_polls: 3,
        handshake_latency: Duration::from_millis(5),
        ..LoopbackConfig::default()
    };
    let net = LoopbackNetwork::new(cfg);
    let mut p = LoopbackFabric::join(&net, "P").unwrap();
    let mut d = LoopbackFabric::join(&net, "D").unwrap();
    p.register_slots(Arc::new(LeaseSlots::new(16)), false)
        .unwrap();
    let id = d.start_handshake("P", t(10)).unwrap();
    assert_eq!(
        d.start_handshake("P", t(11)),
        Ok(id),
        "same address, same id"
    );
    assert_eq!(
        d.send_notification(id, b"x"),
        Err(FabricError::NotConnected)
    );
    assert_eq!(d.handshake_state(id, t(11)), HandshakeState::Pending);
    assert_eq!(d.handshake_state(id, t(12)), HandshakeState::Pending);
    // Third poll, but only 4 ms in.
    assert_eq!(d.handshake_state(id, t(14)), HandshakeState::Pending);
    let HandshakeState::Ready(info) = d.handshake_state(id, t(15)) else {
        panic!("not ready after 4 polls and 5 ms");
    };
    assert_eq!(info.slot_region, Some(RegionId(0)));
    assert_eq!(info.slot_count, 16);
    assert!(!info.compact_heartbeats);
    let clock = info.clock.unwrap();
    assert_eq!((clock.local_send, clock.local_recv), (t(10), t(15)));
    assert_eq!(
        d.handshake_state(id, t(99)),
        HandshakeState::Ready(info),
        "stays ready"
    );
    assert_eq!(p.name(), "P");
    assert_eq!(d.name(), "D");
}

#[test]
fn clock_sample_shows_the_remote_offset() {
    let net = LoopbackNetwork::new(LoopbackConfig::default());
    let mut d = LoopbackFabric::join(&net, "D").unwrap();
    let p = LoopbackFabric::join(&net, "P").unwrap();
    net.set_clock_offset(p.node(), 3_000_000_000);
    let id = d.start_handshake("P", t(100)).unwrap();
    let HandshakeState::Ready(info) = d.handshake_state(id, t(110)) else {
        panic!("not ready");
    };
    let c = info.clock.unwrap();
    assert_eq!(
        c.remote,
        t(3_105),
        "remote clock = virtual midpoint + offset"
    );
    assert_eq!((c.local_send, c.local_recv), (t(100), t(110)));
}

#[test]
fn bad_addresses_and_unknown_agents_are_typed_errors() {
    let mut w = pair(LoopbackConfig::default());
    assert_eq!(
        w.d.start_handshake("nobody", t(0)),
        Err(FabricError::BadAddress)
    );
    assert_eq!(
        w.d.handshake_state(AgentId(999), t(0)),
        HandshakeState::Failed(FabricError::UnknownAgent)
    );
    assert_eq!(
        w.d.send_notification(AgentId(999), b"x"),
        Err(FabricError::UnknownAgent)
    );
    let third = LoopbackFabric::join(&w.net, "X").unwrap();
    // Never handshaken with: unknown to this fabric.
    assert_eq!(
        w.d.send_notification(AgentId(third.node().index()), b"x"),
        Err(FabricError::UnknownAgent)
    );
    assert_eq!(
        w.d.read_state(XferId(12345), t(0)),
        XferState::Failed(FabricError::UnknownXfer)
    );
    w.d.cancel_read(XferId(12345));
}

#[test]
fn joining_checks_names_and_capacity() {
    let net = LoopbackNetwork::new(LoopbackConfig {
        max_agents: 2,
        ..LoopbackConfig::default()
    });
    let a = LoopbackFabric::join(&net, "a").unwrap();
    assert_eq!(
        LoopbackFabric::join(&net, "a").err(),
        Some(LoopbackError::DuplicateName)
    );
    assert_eq!(
        LoopbackFabric::join(&net, "").err(),
        Some(LoopbackError::BadName)
    );
    let _b = LoopbackFabric::join(&net, "b").unwrap();
    assert_eq!(
        LoopbackFabric::join(&net, "c").err(),
        Some(LoopbackError::TooManyAgents)
    );
    assert_eq!(net.node("a"), Some(a.node()));
    assert_eq!(net.name_of(a.node()), Some("a"));
    assert_eq!(net.agent_count(), 2);
}

// ------------------------------------------------------------ notifications

#[test]
fn notifications_flow_both_ways_in_order_with_sender_names() {
    let mut w = pair(LoopbackConfig::default());
    w.d.send_notification(w.to_p, b"HB:a,b").unwrap();
    w.d.send_notification(w.to_p, b"HB:c").unwrap();
    w.p.send_notification(w.to_d, b"hello D").unwrap();
    let at_p = drain(&mut w.p);
    assert_eq!(
        at_p,
        [
            ("D".to_owned(), b"HB:a,b".to_vec()),
            ("D".to_owned(), b"HB:c".to_vec())
        ]
    );
    assert_eq!(drain(&mut w.d), [("P".to_owned(), b"hello D".to_vec())]);
    assert!(drain(&mut w.p).is_empty());
    assert_eq!(w.p.stats().notifications_delivered, 2);
    assert_eq!(w.d.stats().notifications_sent, 2);
    // Empty messages are messages too.
    w.d.send_notification(w.to_p, b"").unwrap();
    assert_eq!(drain(&mut w.p), [("D".to_owned(), vec![])]);
}

#[test]
fn message_size_limit_is_enforced() {
    let mut w = pair(LoopbackConfig {
        max_notification_len: 16,
        ..LoopbackConfig::default()
    });
    assert_eq!(w.d.max_notification_len(), 16);
    w.d.send_notification(w.to_p, &[7; 16]).unwrap();
    assert_eq!(
        w.d.send_notification(w.to_p, &[7; 17]),
        Err(FabricError::MessageTooLarge)
    );
    assert_eq!(drain(&mut w.p).len(), 1);
}

#[test]
fn a_full_queue_refuses_then_recovers() {
    let mut w = pair(LoopbackConfig {
        queue_capacity: 4,
        ..LoopbackConfig::default()
    });
    for i in 0..4u8 {
        w.d.send_notification(w.to_p, &[i]).unwrap();
    }
    assert_eq!(w.d.send_notification(w.to_p, b"x"), Err(FabricError::Full));
    assert_eq!(w.d.stats().notifications_full, 1);
    assert_eq!(drain(&mut w.p).len(), 4);
    w.d.send_notification(w.to_p, b"x").unwrap();
    assert_eq!(texts(&drain(&mut w.p)), ["x"]);
}

// -------------------------------------------------------------------- READs

#[test]
fn read_copies_bytes_at_completion_and_then_notifies() {
    let src = Buf::new(b"0123456789abcdef");
    let dst = Buf::new(&[0u8; 16]);
    let mut w = pair(LoopbackConfig {
        read_latency: Duration::from_millis(3),
        ..LoopbackConfig::default()
    });
    let remote = src.register(&mut w.p);
    let local = dst.register(&mut w.d);
    let d = ReadDesc {
        local,
        local_offset: 4,
        remote,
        remote_offset: 10,
        len: 6,
    };
    let x =
        w.d.post_read(w.to_p, &[d], Some(b"req-1:1"), t(10))
            .unwrap();
    assert_eq!(w.d.read_state(x, t(12)), XferState::InProgress);
    assert!(
        drain(&mut w.p).is_empty(),
        "no notification before completion"
    );
    assert_eq!(dst.bytes(), [0u8; 16], "nothing copied before completion");
    assert_eq!(w.d.read_state(x, t(13)), XferState::Done);
    assert_eq!(&dst.bytes()[..], b"\0\0\0\0abcdef\0\0\0\0\0\0");
    assert_eq!(drain(&mut w.p), [("D".to_owned(), b"req-1:1".to_vec())]);
    assert_eq!(
        w.d.read_state(x, t(14)),
        XferState::Failed(FabricError::UnknownXfer),
        "reported once, then forgotten"
    );
    let s = w.d.stats();
    assert_eq!((s.reads_posted, s.reads_done), (1, 1));
}

#[test]
fn read_of_a_lease_slot_word() {
    let dst = Buf::new(&[0xFF; 8]);
    let mut w = pair(LoopbackConfig::default());
    let slots = Arc::new(LeaseSlots::new(4));
    let slot_region = w.p.register_slots(slots.clone(), true).unwrap();
    let local = dst.register(&mut w.d);
    let d = ReadDesc {
        local,
        local_offset: 0,
        remote: slot_region,
        remote_offset: LeaseSlots::offset_of(2),
        len: 8,
    };
    let x = w.d.post_read(w.to_p, &[d], None, t(1)).unwrap();
    assert_eq!(w.d.read_state(x, t(1)), XferState::Done);
    assert_eq!(dst.bytes(), 0u64.to_le_bytes(), "a free slot reads as 0");
}

#[test]
fn read_sees_a_lease_book_nonce_and_its_zeroing_on_expiry() {
    use kvlease::{EngineShape, LeaseBook, LeaseConfig};
    let config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 64,
        max_num_seqs: 8,
    });
    let mut book = LeaseBook::new(&config, t(0));
    let dst = Buf::new(&[0u8; 8]);
    let mut w = pair(LoopbackConfig {
        read_latency: Duration::from_millis(10),
        ..LoopbackConfig::default()
    });
    let region =
        w.p.register_slots(book.rank_slots(0).unwrap().clone(), true)
            .unwrap();
    let local = dst.register(&mut w.d);
    let grant = book.grant("req-1", t(0)).unwrap();
    let kvlease::LeaseFields { slot, nonce } = grant.lease_fields().unwrap();
    let d = ReadDesc {
        local,
        local_offset: 0,
        remote: region,
        remote_offset: LeaseSlots::offset_of(slot),
        len: 8,
    };
    let x = w.d.post_read(w.to_p, &[d], None, t(1)).unwrap();
    assert_eq!(w.d.read_state(x, t(11)), XferState::Done);
    assert_eq!(
        u64::from_le_bytes(dst.bytes().try_into().unwrap()),
        nonce.get()
    );
    // A READ that straddles the expiry sees the zeroed word.
    let expiry = book.expiry("req-1").unwrap();
    let x = w.d.post_read(w.to_p, &[d], None, expiry).unwrap();
    book.poll(expiry + Duration::from_secs(1));
    assert_eq!(
        w.d.read_state(x, expiry + Duration::from_secs(1)),
        XferState::Done
    );
    assert_eq!(u64::from_le_bytes(dst.bytes().try_into().unwrap()), 0);
}

#[test]
fn read_descriptor_errors_are_typed() {
    let src = Buf::new(&[1; 32]);
    let dst = Buf::new(&[0; 8]);
    let mut w = pair(LoopbackConfig {
        max_descs_per_read: 2,
        max_notification_len: 8,
        ..LoopbackConfig::default()
    });
    let remote = src.register(&mut w.p);
    let local = dst.register(&mut w.d);
    let post = |w: &mut Pair, d: ReadDesc| w.d.post_read(w.to_p, &[d], None, t(0));
    assert_eq!(
        post(&mut w, desc(local, remote, 9)),
        Err(FabricError::OutOfBounds),
        "longer than the landing buffer"
    );
    assert_eq!(
        post(
            &mut w,
            ReadDesc {
                remote_offset: 30,
                ..desc(local, remote, 4)
            }
        ),
        Err(FabricError::OutOfBounds)
    );
    assert_eq!(
        post(
            &mut w,
            ReadDesc {
                remote_offset: u64::MAX,
                ..desc(local, remote, 4)
            }
        ),
        Err(FabricError::OutOfBounds),
        "offset + len overflows"
    );
    assert_eq!(
        post(&mut w, desc(local, RegionId(7), 4)),
        Err(FabricError::UnknownRegion)
    );
    assert_eq!(
        post(&mut w, desc(RegionId(7), remote, 4)),
        Err(FabricError::UnknownRegion)
    );
    let d = desc(local, remote, 1);
    assert_eq!(
        w.d.post_read(w.to_p, &[d; 3], None, t(0)),
        Err(FabricError::Full)
    );
    assert_eq!(
        w.d.post_read(w.to_p, &[d], Some(&[0; 9]), t(0)),
        Err(FabricError::MessageTooLarge)
    );
    assert_eq!(
        w.d.post_read(AgentId(99), &[d], None, t(0)),
        Err(FabricError::UnknownAgent)
    );
    // SAFETY: a null pointer is refused before anything is recorded.
    let null = unsafe { w.d.register_memory(std::ptr::null_mut(), 4) };
    assert_eq!(null, Err(FabricError::OutOfBounds));
}

#[test]
fn too_many_reads_in_flight_is_full_and_cancel_frees_one() {
    let (src, dst) = bufs(1);
    let (mut w, d) = read_pair(
        &src,
        &dst,
        LoopbackConfig {
            max_reads_in_flight: 2,
            ..timing(Some(5), None)
        },
    );
    let a = w.d.post_read(w.to_p, &[d], None, t(0)).unwrap();
    let _b = w.d.post_read(w.to_p, &[d], None, t(0)).unwrap();
    assert_eq!(
        w.d.post_read(w.to_p, &[d], None, t(0)),
        Err(FabricError::Full)
    );
    w.d.cancel_read(a);
    assert_eq!(
        w.d.read_state(a, t(10)),
        XferState::Failed(FabricError::UnknownXfer)
    );
    let c = w.d.post_read(w.to_p, &[d], None, t(0)).unwrap();
    assert_ne!(a, c, "a recycled entry gets a new id");
    assert_eq!(w.d.stats().reads_cancelled, 1);
}

#[test]
fn read_times_out_when_slower_than_the_timeout() {
    let (src, dst) = bufs(1);
    let (mut w, d) = read_pair(&src, &dst, timing(Some(2000), Some(1000)));
    let x = w.d.post_read(w.to_p, &[d], Some(b"n"), t(0)).unwrap();
    assert_eq!(w.d.read_state(x, t(999)), XferState::InProgress);
    assert_eq!(
        w.d.read_state(x, t(5_000)),
        XferState::Failed(FabricError::TimedOut)
    );
    assert_eq!(dst.bytes(), [0; 8]);
    assert!(drain(&mut w.p).is_empty());
    assert_eq!(w.d.stats().reads_timed_out, 1);
}

// ------------------------------------------------------------------- faults

#[test]
fn drop_next_n_and_drop_probability() {
    let mut w = pair(LoopbackConfig::default());
    w.net.drop_next_notifications(w.d.node(), w.p.node(), 2);
    for m in ["1", "2", "3"] {
        w.d.send_notification(w.to_p, m.as_bytes()).unwrap();
    }
    assert_eq!(texts(&drain(&mut w.p)), ["3"]);
    assert_eq!(w.d.stats().notifications_dropped, 2);
    // Only that direction.
    w.p.send_notification(w.to_d, b"back").unwrap();
    assert_eq!(texts(&drain(&mut w.d)), ["back"]);

    w.net.set_notification_faults(
        w.d.node(),
        w.p.node(),
        NotificationFaults {
            drop_probability: 0.5,
            ..NotificationFaults::default()
        },
    );
    let mut delivered = 0;
    for _ in 0..20 {
        for _ in 0..10 {
            w.d.send_notification(w.to_p, b"hb").unwrap();
        }
        delivered += drain(&mut w.p).len();
    }
    assert!(
        (60..140).contains(&delivered),
        "about half of 200 arrive, got {delivered}"
    );
    w.net.set_notification_faults(
        w.d.node(),
        w.p.node(),
        NotificationFaults {
            drop_probability: 1.0,
            ..NotificationFaults::default()
        },
    );
    w.d.send_notification(w.to_p, b"lost").unwrap();
    assert!(drain(&mut w.p).is_empty());
    w.net.clear_faults();
    w.d.send_notification(w.to_p, b"ok").unwrap();
    assert_eq!(texts(&drain(&mut w.p)), ["ok"]);
}

#[test]
fn delayed_notification_arrives_after_the_delay_without_blocking_others() {
    let mut w = pair(LoopbackConfig::default());
    w.net.advance_to(t(100));
    w.net.set_notification_faults(
        w.d.node(),
        w.p.node(),
        NotificationFaults {
            delay_probability: 1.0,
            delay: Duration::from_millis(50),
            ..NotificationFaults::default()
        },
    );
    w.d.send_notification(w.to_p, b"slow").unwrap();
    w.net.clear_faults();
    w.d.send_notification(w.to_p, b"fast").unwrap();
    assert_eq!(texts(&drain(&mut w.p)), ["fast"]);
    w.net.advance_to(t(149));
    assert!(drain(&mut w.p).is_empty());
    w.net.advance_to(t(150));
    assert_eq!(texts(&drain(&mut w.p)), ["slow"]);
    assert_eq!(w.d.stats().notifications_delayed, 1);
}

#[test]
fn reordered_notification_is_overtaken_by_the_next() {
    let mut w = pair(LoopbackConfig::default());
    w.net.set_notification_faults(
        w.d.node(),
        w.p.node(),
        NotificationFaults {
            reorder_probability: 1.0,
            reorder_max_hold: Duration::from_secs(1),
            ..NotificationFaults::default()
        },
    );
    w.d.send_notification(w.to_p, b"first").unwrap();
    assert!(
        drain(&mut w.p).is_empty(),
        "held until something overtakes it"
    );
    w.net.clear_faults();
    w.d.send_notification(w.to_p, b"second").unwrap();
    assert_eq!(texts(&drain(&mut w.p)), ["second", "first"]);
    // Nothing overtakes: released at the hold limit.
    w.net.set_notification_faults(
        w.d.node(),
        w.p.node(),
        NotificationFaults {
            reorder_probability: 1.0,
            reorder_max_hold: Duration::from_millis(20),
            ..NotificationFaults::default()
        },
    );
    w.d.send_notification(w.to_p, b"lonely").unwrap();
    assert!(drain(&mut w.p).is_empty());
    w.net.advance_to(t(20));
    assert_eq!(texts(&drain(&mut w.p)), ["lonely"]);
}

#[test]
fn read_delay_and_read_failure_faults() {
    let (src, dst) = bufs(5);
    let (mut w, d) = read_pair(&src, &dst, timing(Some(1), None));
    w.net.set_read_faults(
        w.d.node(),
        w.p.node(),
        ReadFaults {
            delay_probability: 1.0,
            delay: Duration::from_millis(9),
            ..ReadFaults::default()
        },
    );
    let x = w.d.post_read(w.to_p, &[d], None, t(0)).unwrap();
    assert_eq!(w.d.read_state(x, t(5)), XferState::InProgress);
    assert_eq!(w.d.read_state(x, t(10)), XferState::Done);

    w.net.clear_faults();
    w.net.fail_next_reads(w.d.node(), w.p.node(), 1);
    let dst2 = Buf::new(&[0; 8]);
    let d2 = desc(dst2.register(&mut w.d), d.remote, 8);
    let x = w.d.post_read(w.to_p, &[d2], Some(b"n"), t(20)).unwrap();
    assert_eq!(w.d.read_state(x, t(20)), XferState::InProgress);
    assert_eq!(
        w.d.read_state(x, t(21)),
        XferState::Failed(INJECTED_READ_FAILURE)
    );
    assert_eq!(dst2.bytes(), [0; 8], "a failed READ copies nothing");
    assert!(drain(&mut w.p).is_empty(), "and notifies nobody");
    let x = w.d.post_read(w.to_p, &[d2], None, t(30)).unwrap();
    assert_eq!(
        w.d.read_state(x, t(31)),
        XferState::Done,
        "only the next one"
    );

    w.net.set_read_faults(
        w.d.node(),
        w.p.node(),
        ReadFaults {
            fail_probability: 1.0,
            fail_with: FabricError::Backend(-42),
            ..ReadFaults::default()
        },
    );
    let x = w.d.post_read(w.to_p, &[d2], None, t(40)).unwrap();
    assert_eq!(
        w.d.read_state(x, t(41)),
        XferState::Failed(FabricError::Backend(-42))
    );
    assert_eq!(w.d.stats().reads_failed, 2);
}

#[test]
fn crash_makes_everything_fail_or_time_out_and_restart_is_a_new_life() {
    let (src, dst) = bufs(9);
    let (mut w, d) = read_pair(&src, &dst, timing(Some(1), Some(100)));
    w.d.send_notification(w.to_p, b"before crash").unwrap();
    let x = w.d.post_read(w.to_p, &[d], None, t(0)).unwrap();
    w.net.crash(w.p.node());
    assert!(w.net.is_crashed(w.p.node()));

    assert_eq!(
        w.d.send_notification(w.to_p, b"hb"),
        Err(FabricError::PeerUnreachable)
    );
    assert_eq!(w.d.read_state(x, t(50)), XferState::InProgress, "hangs");
    assert_eq!(
        w.d.read_state(x, t(100)),
        XferState::Failed(FabricError::TimedOut)
    );
    assert_eq!(dst.bytes(), [0; 8]);
    // The crashed agent drains nothing.
    assert!(drain(&mut w.p).is_empty());
    // New handshakes to it fail (and so do its own).
    let mut e = LoopbackFabric::join(&w.net, "E").unwrap();
    let id = e.start_handshake("P", t(0)).unwrap();
    assert_eq!(
        e.handshake_state(id, t(0)),
        HandshakeState::Failed(FabricError::PeerUnreachable)
    );
    let id = w.p.start_handshake("E", t(0)).unwrap();
    assert_eq!(
        w.p.handshake_state(id, t(0)),
        HandshakeState::Failed(FabricError::PeerUnreachable)
    );

    w.net.restart(w.p.node());
    // What was queued for the old life is gone; the old handshake is stale.
    assert!(drain(&mut w.p).is_empty());
    assert_eq!(w.p.stats().notifications_discarded_stale, 1);
    assert_eq!(
        w.d.send_notification(w.to_p, b"hb"),
        Err(FabricError::PeerUnreachable)
    );
    assert_eq!(
        w.d.handshake_state(w.to_p, t(200)),
        HandshakeState::Failed(FabricError::PeerUnreachable)
    );
    // Re-handshake (a retry restarts it) and carry on.
    let to_p = connect(&mut w.d, "P", t(200));
    assert_eq!(to_p, w.to_p);
    w.d.send_notification(to_p, b"after restart").unwrap();
    assert_eq!(texts(&drain(&mut w.p)), ["after restart"]);
    // The restarted P forgot its handshake with D.
    assert_eq!(
        w.p.send_notification(w.to_d, b"x"),
        Err(FabricError::UnknownAgent)
    );
    let x = w.d.post_read(to_p, &[d], None, t(300)).unwrap();
    assert_eq!(w.d.read_state(x, t(301)), XferState::Done);
    assert_eq!(dst.bytes(), [9; 8]);
}

#[test]
fn read_against_an_agent_that_restarted_fails() {
    let (src, dst) = bufs(9);
    let (mut w, d) = read_pair(&src, &dst, timing(Some(10), None));
    let x = w.d.post_read(w.to_p, &[d], None, t(0)).unwrap();
    w.net.crash(w.p.node());
    w.net.restart(w.p.node());
    assert_eq!(
        w.d.read_state(x, t(20)),
        XferState::Failed(FabricError::PeerUnreachable)
    );
    assert_eq!(dst.bytes(), [0; 8]);
}

#[test]
fn a_removed_peer_is_unknown_and_its_reads_are_cancelled() {
    let (src, dst) = bufs(7);
    let (mut w, d) = read_pair(&src, &dst, timing(Some(10), None));
    let x = w.d.post_read(w.to_p, &[d], None, t(0)).unwrap();
    assert_eq!(w.d.remove_peer(w.to_p), Ok(()));
    // The READ in flight ends without copying; the id is unknown everywhere.
    assert_eq!(
        w.d.read_state(x, t(20)),
        XferState::Failed(FabricError::Cancelled)
    );
    assert_eq!(dst.bytes(), [0; 8]);
    assert_eq!(
        w.d.handshake_state(w.to_p, t(20)),
        HandshakeState::Failed(FabricError::UnknownAgent)
    );
    assert_eq!(
        w.d.send_notification(w.to_p, b"x"),
        Err(FabricError::UnknownAgent)
    );
    assert_eq!(
        w.d.post_read(w.to_p, &[d], None, t(20)),
        Err(FabricError::UnknownAgent)
    );
    assert_eq!(w.d.remove_peer(w.to_p), Err(FabricError::UnknownAgent));
    assert_eq!(w.d.stats().reads_failed, 1);
    // The other direction is untouched, and a new handshake starts afresh.
    w.p.send_notification(w.to_d, b"still here").unwrap();
    assert_eq!(texts(&drain(&mut w.d)), ["still here"]);
    let again = connect(&mut w.d, "P", t(30));
    let x = w.d.post_read(again, &[d], None, t(30)).unwrap();
    assert_eq!(w.d.read_state(x, t(40)), XferState::Done);
    assert_eq!(dst.bytes(), [7; 8]);
}

#[test]
fn partition_cuts_both_directions_until_healed() {
    let (src, dst) = bufs(3);
    let (mut w, d) = read_pair(&src, &dst, timing(Some(1), Some(100)));
    let mut e = LoopbackFabric::join(&w.net, "E").unwrap();
    let e_to_p = connect(&mut e, "P", t(0));
    w.net.partition(w.p.node(), w.d.node());
    assert_eq!(
        w.d.send_notification(w.to_p, b"x"),
        Err(FabricError::PeerUnreachable)
    );
    assert_eq!(
        w.p.send_notification(w.to_d, b"x"),
        Err(FabricError::PeerUnreachable)
    );
    // Other links are untouched.
    e.send_notification(e_to_p, b"from E").unwrap();
    assert_eq!(drain(&mut w.p), [("E".to_owned(), b"from E".to_vec())]);
    let x = w.d.post_read(w.to_p, &[d], None, t(0)).unwrap();
    assert_eq!(w.d.read_state(x, t(50)), XferState::InProgress);
    w.net.heal(w.p.node(), w.d.node());
    assert_eq!(
        w.d.read_state(x, t(60)),
        XferState::Done,
        "a READ stalled by a partition completes once healed in time"
    );
    w.d.send_notification(w.to_p, b"healed").unwrap();
    assert_eq!(texts(&drain(&mut w.p)), ["healed"]);
}

#[test]
fn silent_drop_mode_loses_sends_over_a_down_link() {
    let mut w = pair(LoopbackConfig {
        unreachable_sends: UnreachableSends::SilentDrop,
        ..LoopbackConfig::default()
    });
    w.net.partition(w.p.node(), w.d.node());
    assert_eq!(w.d.send_notification(w.to_p, b"x"), Ok(()));
    w.net.heal(w.p.node(), w.d.node());
    assert!(drain(&mut w.p).is_empty());
    assert_eq!(w.d.stats().notifications_unreachable, 1);
}

#[test]
fn dropping_a_fabric_is_a_crash_that_never_restarts() {
    let (src, dst) = bufs(1);
    let (mut w, d) = read_pair(&src, &dst, timing(None, Some(10)));
    let p_node = w.p.node();
    let x = w.d.post_read(w.to_p, &[d], None, t(0)).unwrap();
    // Swap P out and drop it.
    let replacement = LoopbackFabric::join(&w.net, "P2").unwrap();
    drop(std::mem::replace(&mut w.p, replacement));
    w.net.restart(p_node);
    assert!(w.net.is_crashed(p_node));
    assert_eq!(
        w.d.read_state(x, t(10)),
        XferState::Failed(FabricError::TimedOut)
    );
    assert_eq!(
        w.d.send_notification(w.to_p, b"x"),
        Err(FabricError::PeerUnreachable)
    );
}

// ------------------------------------------------------------- determinism

/// A fixed scenario under heavy faults; returns what P received, in order,
/// at each step.
fn faulty_run(seed: u64) -> Vec<Vec<String>> {
    let mut w = pair(LoopbackConfig {
        seed,
        ..LoopbackConfig::default()
    });
    let mut e = LoopbackFabric::join(&w.net, "E").unwrap();
    let e_to_p = connect(&mut e, "P", t(0));
    let faults = NotificationFaults {
        drop_probability: 0.2,
        delay_probability: 0.2,
        delay: Duration::from_millis(3),
        reorder_probability: 0.2,
        reorder_max_hold: Duration::from_millis(5),
    };
    w.net
        .set_notification_faults(kvlease::fabric::loopback::Nodes::All, w.p.node(), faults);
    let mut log = Vec::new();
    for step in 0..50u64 {
        w.net.advance_to(t(step));
        w.d.send_notification(w.to_p, format!("d{step}").as_bytes())
            .unwrap();
        e.send_notification(e_to_p, format!("e{step}").as_bytes())
            .unwrap();
        log.push(
            drain(&mut w.p)
                .into_iter()
                .map(|(from, m)| format!("{from}:{}", String::from_utf8_lossy(&m)))
                .collect(),
        );
    }
    log
}

#[test]
fn same_seed_same_delivery_order() {
    let a = faulty_run(42);
    assert_eq!(a, faulty_run(42));
    assert_ne!(a, faulty_run(43), "the seed matters");
    let delivered: usize = a.iter().map(Vec::len).sum();
    assert!(
        delivered > 40 && delivered < 100,
        "faults applied: {delivered}"
    );
    let in_order: Vec<&String> = a.iter().flatten().collect();
    let mut sorted = in_order.clone();
    sorted.sort_by_key(|s| s[3..].parse::<u32>().unwrap_or(0));
    assert_ne!(in_order, sorted, "some messages were reordered or delayed");
}

// ----------------------------------------------------------------- threads

#[test]
fn agents_on_threads_exchange_everything_exactly_once() {
    const N: u32 = 5_000;
    let net = LoopbackNetwork::new(LoopbackConfig {
        queue_capacity: 32,
        ..LoopbackConfig::default()
    });
    let mut p = LoopbackFabric::join(&net, "P").unwrap();
    let senders: Vec<LoopbackFabric> = (0..3)
        .map(|i| LoopbackFabric::join(&net, &format!("D{i}")).unwrap())
        .collect();
    std::thread::scope(|s| {
        for mut d in senders {
            s.spawn(move || {
                let to_p = connect(&mut d, "P", t(0));
                for i in 0..N {
                    loop {
                        match d.send_notification(to_p, &i.to_le_bytes()) {
                            Ok(()) => break,
                            Err(FabricError::Full) => std::thread::yield_now(),
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            });
        }
        let mut next = [0u32; 3];
        let mut got = 0;
        while got < 3 * N {
            p.drain_notifications(&mut |from, msg| {
                let who = (from.as_bytes()[1] - b'0') as usize;
                let i = u32::from_le_bytes(msg.try_into().unwrap());
                assert_eq!(i, next[who], "per-sender FIFO, no loss, no dup");
                next[who] += 1;
                got += 1;
            })
            .unwrap();
            std::thread::yield_now();
        }
        assert_eq!(next, [N; 3]);
    });
}
