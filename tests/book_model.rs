//! The lease book against its reference model (src/testkit.rs) over long
//! random operation sequences: renewals, compact renewals with right and
//! wrong nonces, stale and duplicate read-dones, ids never granted, over-long
//! ids, capacity and slot exhaustion, cancels, expiry at irregular steps.
//! Deterministic: the seeds are fixed, so a failure names its seed.

use kvlease::testkit::{BookHarness, BookOp};

fn program(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

#[test]
fn book_matches_model_over_random_programs() {
    let mut total = 0;
    for seed in 0..64u64 {
        let bytes = program(seed, 20_000);
        let mut h = BookHarness::new(bytes[0]);
        for op in BookOp::decode(&bytes[1..]) {
            h.apply(op);
        }
        total += h.ops;
    }
    assert_eq!(total, 64 * 9_999, "every decoded op was applied");
}

#[test]
fn exhaustion_and_reuse_happen_in_the_random_programs() {
    // Guard against a generator that never reaches the interesting states.
    let mut full = 0;
    let mut stale = 0;
    let mut expired = 0;
    let mut returned = 0;
    for seed in 0..16u64 {
        let bytes = program(seed, 20_000);
        let mut h = BookHarness::new(bytes[0]);
        for op in BookOp::decode(&bytes[1..]) {
            h.apply(op);
        }
        let c = h.book().counters();
        full += c.grant_refused_full;
        stale += c.read_done_stale_nonce;
        expired += c.expired;
        returned += c.slots_returned;
    }
    assert!(
        full > 0 && stale > 0 && expired > 0 && returned > 0,
        "{full} {stale} {expired} {returned}"
    );
}
