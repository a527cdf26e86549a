//! Proof that the loopback fabric allocates nothing after construction:
//! 10,000 steady-state cycles of notifications both ways (with drops,
//! delays and reorders, so the pen is exercised), drains, handshake polls,
//! and READs (64 slot words as 64 descriptors, a 512-byte raw descriptor,
//! with an attached notification), polled to completion, plus a cancelled
//! READ, make exactly 0 heap allocations.
//!
//! A counting global allocator counts only on the thread that armed it, so
//! the test harness's own threads cannot disturb the count.

use std::sync::Arc;
use std::time::Duration;

use kvlease::fabric::loopback::{
    LoopbackConfig, LoopbackFabric, LoopbackNetwork, NotificationFaults,
};
use kvlease::fabric::{Fabric, HandshakeState, ReadDesc, XferState};
use kvlease::{Instant, LeaseSlots};

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{count_allocs, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const CYCLES: u64 = 10_000;

#[test]
fn steady_state_send_drain_read_allocates_nothing() {
    // Landing buffers live (leaked, so no Rust reference aliases them) for
    // the whole test; the fabrics are dropped first at the end of scope.
    let raw_src: &'static mut [u8] = Box::leak(vec![7u8; 512].into_boxed_slice());
    let landing: &'static mut [u8] = Box::leak(vec![0u8; 1024].into_boxed_slice());
    let (src_ptr, landing_ptr) = (raw_src.as_mut_ptr(), landing.as_mut_ptr());

    let net = LoopbackNetwork::new(LoopbackConfig {
        read_latency: Duration::from_micros(10),
        seed: 7,
        ..LoopbackConfig::default()
    });
    let mut p = LoopbackFabric::join(&net, "P").unwrap();
    let mut d = LoopbackFabric::join(&net, "D").unwrap();
    let slots = Arc::new(LeaseSlots::new(64));
    let slot_region = p.register_slots(slots, true).unwrap();
    // SAFETY: both buffers are leaked (never freed, never referenced again
    // except through the fabric).
    let (src_region, landing_region) = unsafe {
        (
            p.register_memory(src_ptr, 512).unwrap(),
            d.register_memory(landing_ptr, 1024).unwrap(),
        )
    };
    let to_p = d.start_handshake("P", Instant::ZERO).unwrap();
    let to_d = p.start_handshake("D", Instant::ZERO).unwrap();
    assert!(matches!(
        d.handshake_state(to_p, Instant::ZERO),
        HandshakeState::Ready(_)
    ));
    assert!(matches!(
        p.handshake_state(to_d, Instant::ZERO),
        HandshakeState::Ready(_)
    ));
    net.set_notification_faults(
        d.node(),
        p.node(),
        NotificationFaults {
            drop_probability: 0.1,
            delay_probability: 0.2,
            delay: Duration::from_micros(30),
            reorder_probability: 0.1,
            reorder_max_hold: Duration::from_micros(50),
        },
    );
    let word_descs = kvlease::testkit::slot_word_descs(landing_region, 0, slot_region, 64);
    let block_desc = [ReadDesc {
        local: landing_region,
        local_offset: 512,
        remote: src_region,
        remote_offset: 0,
        len: 512,
    }];

    let mut received = 0u64;
    let mut bytes = 0u64;
    let mut sink = |_: &str, msg: &[u8]| {
        received += 1;
        bytes += msg.len() as u64;
    };

    counting_alloc::self_check();
    let ((), counts) = count_allocs(|| {
        for cycle in 0..CYCLES {
            let now = Instant::from_micros_for_test(cycle * 100);
            net.advance_to(now);
            d.send_notification(to_p, b"HB:req-1,req-2,req-3").unwrap();
            p.send_notification(to_d, b"ack").unwrap();
            p.drain_notifications(&mut sink).unwrap();
            d.drain_notifications(&mut sink).unwrap();
            assert!(matches!(
                d.handshake_state(to_p, now),
                HandshakeState::Ready(_)
            ));

            let descs: &[ReadDesc] = if cycle % 2 == 0 {
                &word_descs
            } else {
                &block_desc
            };
            let x = d.post_read(to_p, descs, Some(b"req-1:1"), now).unwrap();
            assert_eq!(d.read_state(x, now), XferState::InProgress);
            let later = Instant::from_micros_for_test(cycle * 100 + 50);
            assert_eq!(d.read_state(x, later), XferState::Done);
            if cycle % 16 == 0 {
                let y = d.post_read(to_p, &block_desc, None, later).unwrap();
                d.cancel_read(y);
            }
        }
    });

    let allocs = counts.allocs;
    assert_eq!(
        allocs, 0,
        "{allocs} heap allocations in {CYCLES} steady-state cycles"
    );
    // The workload really ran: most notifications arrived, some were held.
    assert!(received > CYCLES * 2, "received {received}");
    assert!(bytes > 0);
    let ps = p.stats();
    assert!(ps.notifications_delivered > 0);
    let ds = d.stats();
    assert_eq!(ds.reads_done, CYCLES);
    assert!(ds.notifications_delayed > 0 && ds.notifications_reordered > 0);
    assert_eq!(ps.pen_overflow, 0);
}

/// `Instant` in microseconds (the crate offers ms and ns constructors).
trait FromMicros {
    fn from_micros_for_test(us: u64) -> Instant;
}

impl FromMicros for Instant {
    fn from_micros_for_test(us: u64) -> Instant {
        Instant::from_nanos(us * 1_000)
    }
}
