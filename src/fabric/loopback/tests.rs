//! Unit tests of the loopback fabric that need crate internals (writing lease
//! words). The public-API tests are in `tests/it/loopback_fabric.rs`.

use super::*;

fn t(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn connect(a: &mut LoopbackFabric, b_name: &str, now: Instant) -> AgentId {
    let id = a.start_handshake(b_name, now).unwrap();
    match a.handshake_state(id, now) {
        HandshakeState::Ready(_) => id,
        other => panic!("handshake with {b_name}: {other:?}"),
    }
}

/// A P agent exporting `slots`, a D agent with a 512-byte landing buffer;
/// D is connected to P.
struct World {
    p: LoopbackFabric,
    d: LoopbackFabric,
    slots: Arc<LeaseSlots>,
    slot_region: RegionId,
    /// Declared after `d`, so it is freed after the fabric that writes it.
    landing: Landing,
    landing_region: RegionId,
    to_p: AgentId,
}

/// A registered buffer, touched only through the raw pointer it was
/// registered with. Holding it as a `Box<[u8]>` (as these tests first did)
/// breaks `register_memory`'s contract: moving the box asserts unique
/// access, which invalidates the pointer the fabric writes through (Miri,
/// Stacked Borrows).
struct Landing {
    ptr: *mut u8,
    len: usize,
}

impl Landing {
    fn new(len: usize, fill: u8) -> Landing {
        let ptr = Box::into_raw(vec![fill; len].into_boxed_slice()).cast::<u8>();
        Landing { ptr, len }
    }

    /// A copy of the bytes; call only between READs.
    fn bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: `ptr` is a live allocation of `len` bytes, and no READ is
        // in flight while a test looks at it.
        unsafe { core::ptr::copy_nonoverlapping(self.ptr, out.as_mut_ptr(), self.len) };
        out
    }

    fn fill(&self, b: u8) {
        // SAFETY: as for `bytes`.
        unsafe { core::ptr::write_bytes(self.ptr, b, self.len) };
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice, and
        // the fabric that had it registered is dropped first (`World`'s
        // field order).
        drop(unsafe { Box::from_raw(core::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

fn world(cfg: LoopbackConfig) -> World {
    // Under Miri (.ci/run's bounded step) zero-filling the default rings and
    // READ tables (16 agents, 256 cells of 4 KiB, 64 x 256 descriptors)
    // costs seconds a test; two small agents exercise the same READ copy.
    let cfg = if cfg!(miri) {
        LoopbackConfig {
            max_agents: 2,
            queue_capacity: 4,
            max_notification_len: 64,
            pen_capacity: 4,
            max_reads_in_flight: 4,
            max_descs_per_read: 64,
            ..cfg
        }
    } else {
        cfg
    };
    let net = LoopbackNetwork::new(cfg);
    let mut p = LoopbackFabric::join(&net, "P").unwrap();
    let mut d = LoopbackFabric::join(&net, "D").unwrap();
    let slots = Arc::new(LeaseSlots::new(64));
    let slot_region = p.register_slots(slots.clone(), true).unwrap();
    let landing = Landing::new(512, 0xEE);
    // SAFETY: `landing` outlives `d` (World drops fabrics first: field order),
    // is only accessed through this pointer, and only between READs.
    let landing_region = unsafe { d.register_memory(landing.ptr, landing.len) }.unwrap();
    let to_p = connect(&mut d, "P", t(0));
    World {
        p,
        d,
        slots,
        slot_region,
        landing,
        landing_region,
        to_p,
    }
}

fn slot_desc(w: &World, slot: u32, landing_offset: u64) -> ReadDesc {
    ReadDesc {
        local: w.landing_region,
        local_offset: landing_offset,
        remote: w.slot_region,
        remote_offset: LeaseSlots::offset_of(slot),
        len: 8,
    }
}

fn word_at(landing: &[u8], offset: usize) -> u64 {
    u64::from_le_bytes(landing[offset..offset + 8].try_into().unwrap())
}

#[test]
fn handshake_advertises_the_slot_region() {
    let w = world(LoopbackConfig::default());
    let mut d = w.d;
    match d.handshake_state(w.to_p, t(1)) {
        HandshakeState::Ready(info) => {
            assert_eq!(info.slot_region, Some(w.slot_region));
            assert_eq!(info.slot_count, 64);
            assert!(info.compact_heartbeats);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn read_sees_the_nonce_in_the_slot() {
    let mut w = world(LoopbackConfig::default());
    w.slots.publish(5, 0xABCD_EF01_2345_6789);
    let desc = slot_desc(&w, 5, 16);
    let x = w.d.post_read(w.to_p, &[desc], None, t(1)).unwrap();
    assert_eq!(w.d.read_state(x, t(1)), XferState::Done);
    assert_eq!(word_at(&w.landing.bytes(), 16), 0xABCD_EF01_2345_6789);
}

#[test]
fn slot_cleared_mid_read_is_observed_as_zero() {
    let cfg = LoopbackConfig {
        read_latency: Duration::from_millis(10),
        ..LoopbackConfig::default()
    };
    let mut w = world(cfg);
    w.slots.publish(3, 42);
    let desc = slot_desc(&w, 3, 0);
    let x = w.d.post_read(w.to_p, &[desc], None, t(100)).unwrap();
    assert_eq!(w.d.read_state(x, t(105)), XferState::InProgress);
    // P's lease expires while the READ is in flight.
    w.slots.clear(3);
    assert_eq!(w.d.read_state(x, t(110)), XferState::Done);
    assert_eq!(
        word_at(&w.landing.bytes(), 0),
        0,
        "the copy happens at completion"
    );
    // And the other way round: published mid-read is seen.
    w.slots.publish(3, 7);
    let x = w.d.post_read(w.to_p, &[desc], None, t(200)).unwrap();
    w.slots.clear(3);
    w.slots.publish(3, 8);
    assert_eq!(w.d.read_state(x, t(210)), XferState::Done);
    assert_eq!(word_at(&w.landing.bytes(), 0), 8);
}

#[test]
fn sixty_four_slots_as_one_descriptor_or_sixty_four() {
    let mut w = world(LoopbackConfig::default());
    for s in 0..64 {
        w.slots.publish(s, 1000 + u64::from(s));
    }
    let one = ReadDesc {
        local: w.landing_region,
        local_offset: 0,
        remote: w.slot_region,
        remote_offset: 0,
        len: 512,
    };
    let x = w.d.post_read(w.to_p, &[one], None, t(1)).unwrap();
    assert_eq!(w.d.read_state(x, t(1)), XferState::Done);
    for s in 0..64usize {
        assert_eq!(word_at(&w.landing.bytes(), 8 * s), 1000 + s as u64);
    }
    w.landing.fill(0);
    let many: Vec<ReadDesc> = (0..64)
        .map(|s| slot_desc(&w, s, 8 * (63 - u64::from(s))))
        .collect();
    let x = w.d.post_read(w.to_p, &many, None, t(1)).unwrap();
    assert_eq!(w.d.read_state(x, t(1)), XferState::Done);
    for s in 0..64usize {
        assert_eq!(word_at(&w.landing.bytes(), 8 * (63 - s)), 1000 + s as u64);
    }
}

#[test]
fn unaligned_slot_read_copies_the_right_bytes() {
    let mut w = world(LoopbackConfig::default());
    w.slots.publish(0, 0x0807_0605_0403_0201);
    w.slots.publish(1, 0x100F_0E0D_0C0B_0A09);
    let desc = ReadDesc {
        local: w.landing_region,
        local_offset: 1,
        remote: w.slot_region,
        remote_offset: 3,
        len: 10,
    };
    let x = w.d.post_read(w.to_p, &[desc], None, t(1)).unwrap();
    assert_eq!(w.d.read_state(x, t(1)), XferState::Done);
    assert_eq!(
        &w.landing.bytes()[..12],
        &[0xEE, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0xEE]
    );
}

#[test]
fn a_slot_array_is_not_a_landing_region() {
    let mut w = world(LoopbackConfig::default());
    let d_slots =
        w.d.register_slots(Arc::new(LeaseSlots::new(1)), false)
            .unwrap();
    let desc = ReadDesc {
        local: d_slots,
        ..slot_desc(&w, 0, 0)
    };
    assert_eq!(
        w.d.post_read(w.to_p, &[desc], None, t(1)),
        Err(FabricError::UnknownRegion)
    );
    let _ = &w.p;
}

#[test]
fn clock_sample_carries_the_offsets() {
    let cfg = LoopbackConfig {
        handshake_latency: Duration::from_millis(4),
        ..LoopbackConfig::default()
    };
    let net = LoopbackNetwork::new(cfg);
    let mut a = LoopbackFabric::join(&net, "a").unwrap();
    let b = LoopbackFabric::join(&net, "b").unwrap();
    net.set_clock_offset(a.node(), -1_000_000);
    net.set_clock_offset(b.node(), 5_000_000_000);
    let id = a.start_handshake("b", t(10)).unwrap();
    assert_eq!(a.handshake_state(id, t(12)), HandshakeState::Pending);
    let HandshakeState::Ready(info) = a.handshake_state(id, t(14)) else {
        panic!("not ready");
    };
    let clock = info.clock.unwrap();
    assert_eq!(clock.local_send, t(9));
    assert_eq!(clock.local_recv, t(13));
    assert_eq!(clock.remote, t(5_012));
    assert_eq!(info.slot_region, None);
    drop(b);
}
