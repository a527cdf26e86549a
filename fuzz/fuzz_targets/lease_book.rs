//! Drives the P roles (a scheduler and its ranks exchanging role-message
//! bytes) with arbitrary operation sequences against their reference model
//! (kvlease::testkit), then feeds the rest of the input to a lease book as
//! raw notifications. Any panic is a bug: a broken invariant in the model
//! check, or a panic reachable from bytes off the wire.
//!
//! The input is drawn with `arbitrary`: a shape byte, the operation
//! program, then the rest of the bytes as `\n`-separated notifications.
#![no_main]

use arbitrary::Arbitrary;
use kvlease::testkit::{RolesHarness, RolesOp};
use kvlease::{EngineShape, Instant, LeaseBook, LeaseConfig};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input<'a> {
    /// Picks the harness's settings (see `RolesHarness::new`).
    shape: u8,
    program: Vec<RolesOp>,
    /// Raw notification bytes, as they would come off the wire.
    notifications: &'a [u8],
}

fuzz_target!(|input: Input<'_>| {
    let Input {
        shape,
        program,
        notifications,
    } = input;
    let mut h = RolesHarness::new(shape);
    for op in program {
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
    // Senders from a small set, so that duplicates from one sender happen.
    let senders = ["d0", "d1", "d2"];
    for (k, msg) in notifications.split(|&b| b == b'\n').enumerate() {
        let before = book.held();
        let from = senders[(k + usize::from(shape)) % senders.len()];
        if let Ok(s) = book.on_notification(u32::from(shape % 2), from, msg, now) {
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
