//! Drives the P roles (a scheduler and its ranks exchanging role-message
//! bytes) with arbitrary operation sequences against their reference model
//! (kvlease::testkit), then feeds the rest of the input to a lease book as
//! raw notifications. Any panic is a bug: a broken invariant in the model
//! check, or a panic reachable from bytes off the wire.
//!
//! Input: `[shape byte][program bytes] 0x00 [notification] 0x0a [notification] ...`
#![no_main]

use kvlease::testkit::{RolesHarness, RolesOp};
use kvlease::{EngineShape, Instant, LeaseBook, LeaseConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&shape, rest)) = data.split_first() else {
        return;
    };
    let (program, notifications) = match rest.iter().position(|&b| b == 0) {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };

    let mut h = RolesHarness::new(shape);
    for op in RolesOp::decode(program) {
        h.apply(op);
    }

    // Raw bytes off the wire: never a panic, and only held leases change.
    let mut config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 8,
        max_num_seqs: 0,
    });
    config.lease_capacity = 8;
    let mut book = LeaseBook::new(&config, Instant::ZERO);
    for id in ["a", "b", "req:1", "HBx"] {
        let _ = book.grant(id, Instant::ZERO);
    }
    let mut now = Instant::from_secs(1);
    for msg in notifications.split(|&b| b == b'\n') {
        let before = book.held();
        if let Ok(s) = book.on_notification(u32::from(shape % 2), msg, now) {
            assert!(s.renewed as usize + s.ignored as usize <= msg.len());
        }
        assert!(book.held() <= before, "a notification created a lease");
        now = now + std::time::Duration::from_millis(u64::from(shape));
        book.poll(now);
        let mut freed = Vec::new();
        book.drain_released(|r| freed.extend(r.slot));
        for t in freed {
            book.blocks_freed(t);
        }
    }
});
