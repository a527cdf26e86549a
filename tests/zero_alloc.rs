//! Proof of the step contract on the P side: after construction, 100,000
//! steady-state engine steps (grants, heartbeats by id and by slot,
//! read-dones with and without nonce, stale and unknown notifications,
//! expiries, cancels, drains and slot reuse) make exactly 0 heap allocations.
//!
//! The counting allocator (tests/support/counting_alloc.rs) counts only on
//! the thread that armed it, so the harness's own threads cannot disturb it.

use std::time::Duration;

use kvlease::testkit::{p_side_config, SplitMix64};
use kvlease::{Instant, LeaseBook, SlotTicket};

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{count_allocs, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const STEPS: u64 = 100_000;
const LIVE: usize = 512;

#[test]
fn p_side_steps_allocate_nothing_after_construction() {
    // --- construction: allowed to allocate ---
    let config = p_side_config(384, 1024);
    let mut book = LeaseBook::new(&config, Instant::ZERO);
    let ids: Vec<String> = (0..LIVE * 2).map(|i| format!("cmpl-{i:032x}-0")).collect();
    let mut nonces = vec![None; ids.len()];
    let mut slots = vec![None; ids.len()];
    let mut freed: Vec<SlotTicket> = Vec::with_capacity(2048);
    // Heartbeats as they come off the wire: 64 ids each, plus unknown ones.
    // Only the first half of the ids is heartbeated; the rest expire.
    let heartbeats: Vec<String> = ids[..LIVE / 2]
        .chunks(64)
        .map(|c| format!("HB:{},unknown-a,unknown-b", c.join(",")))
        .collect();
    // Compact heartbeats naming slots 0..64 with nonces that mostly do not match.
    let compact: String = std::iter::once("HBC:".to_string())
        .chain((0..64u32).map(|s| format!("{s:08x}{:016x}", u64::from(s) + 1)))
        .collect();
    let mut reported = 0u64;

    // --- steady state: must not allocate ---
    counting_alloc::self_check();
    let ((), counts) = count_allocs(|| {
        let mut now = Instant::ZERO;
        let mut rng_gen = SplitMix64::new(0x2545_f491_4f6c_dd1du64);
        for step in 0..STEPS {
            now = now + Duration::from_millis(20);
            // A pseudo-random walk over the ids, so every operation meets held and free ids.
            let rng = rng_gen.next_u64();
            let k = (rng % ids.len() as u64) as usize;
            let id = &ids[k];
            match step % 8 {
                // Grants: fail as Duplicate when held, or Full when the book is.
                0 | 1 => {
                    if let Ok(g) = book.grant(id, now) {
                        nonces[k] = Some(g.nonce);
                        slots[k] = g.fields.map(|f| f.slot);
                    }
                }
                2 => {
                    let _ = book.renew(id.as_bytes(), now);
                    let _ = book.renew(b"never-granted", now);
                }
                3 => {
                    if let (Some(s), Some(n)) = (slots[k], nonces[k]) {
                        let _ = book.renew_slot(s, n, now);
                    }
                }
                4 => {
                    book.read_done(0, "d0", id.as_bytes(), 1, nonces[k], now);
                }
                5 => {
                    book.read_done(0, "d0", id.as_bytes(), 2, None, now);
                    book.read_done(0, "d0", b"unknown", 1, None, now);
                }
                6 => {
                    book.cancel(id);
                }
                _ => {
                    let msg = &heartbeats[k % heartbeats.len()];
                    let _ = book.on_notification(0, "d0", msg.as_bytes(), now);
                    let _ = book.on_notification(0, "d0", b"HBC:not-hex", now);
                    let _ = book.on_notification(0, "d0", compact.as_bytes(), now);
                }
            }
            book.poll(now);
            book.drain_released(|r| {
                reported += 1;
                if let Some(t) = r.slot {
                    freed.push(t);
                }
            });
            // The engine frees blocks a few steps later; then the slot returns.
            if freed.len() > 16 {
                while let Some(t) = freed.pop() {
                    book.blocks_freed(t);
                }
            }
            let _ = book.counters().expired;
        }
    });
    let (allocs, bytes) = (counts.allocs, counts.bytes);

    // The run exercised every path it claims to.
    let c = book.counters();
    assert!(c.granted > 10_000, "{c:?}");
    assert!(c.renewed > 1_000 && c.renew_unknown > 1_000, "{c:?}");
    assert!(
        c.released_read > 100 && c.expired > 100 && c.cancelled > 100,
        "{c:?}"
    );
    assert!(
        c.slots_returned > 1_000 && c.grant_refused_duplicate > 0,
        "{c:?}"
    );
    assert_eq!(reported, c.reported);
    println!(
        "zero_alloc: {STEPS} P steps, {} grants, {} expiries: {allocs} allocations, {bytes} bytes",
        c.granted, c.expired
    );
    assert_eq!((allocs, bytes), (0, 0), "steady-state P steps allocated");
}
