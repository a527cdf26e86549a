//! The P roles (one scheduler, one to three ranks, role messages as bytes)
//! against their reference model (src/testkit.rs) over long random operation
//! sequences: grants, assigns and starts, heartbeats lost on some ranks,
//! compact renewals with right and wrong nonces, stale and duplicate
//! read-dones, ids never granted, over-long ids, capacity and slot
//! exhaustion, cancels, expiry at irregular steps, ranks that diverge.
//! Deterministic: the seeds are fixed, so a failure names its seed.

use kvlease::testkit::{RolesHarness, RolesOp, SplitMix64};

fn program(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    (0..len).map(|_| (rng.next_u64() >> 24) as u8).collect()
}

fn run(seed: u64) -> RolesHarness {
    let bytes = program(seed, 20_000);
    let mut h = RolesHarness::new(bytes[0]);
    for op in RolesOp::decode(&bytes[1..]) {
        h.apply(op);
    }
    h
}

#[test]
fn roles_match_model_over_random_programs() {
    let mut total = 0;
    for seed in 0..64u64 {
        total += run(seed).ops;
    }
    assert_eq!(total, 64 * 9_999, "every decoded op was applied");
}

#[test]
fn exhaustion_reuse_and_divergence_happen_in_the_random_programs() {
    // Guard against a generator that never reaches the interesting states.
    let (mut full, mut stale, mut expired, mut returned, mut diverged, mut multi) =
        (0, 0, 0, 0, 0, 0);
    for seed in 0..32u64 {
        let h = run(seed);
        let c = h.scheduler().counters();
        full += c.grant_refused_full;
        expired += c.expired;
        returned += c.slots_returned;
        stale += h
            .ranks()
            .iter()
            .map(|r| r.counters().read_done_stale_nonce)
            .sum::<u64>();
        diverged += h.divergences;
        multi += u64::from(h.ranks().len() > 1);
    }
    assert!(
        full > 0 && stale > 0 && expired > 0 && returned > 0 && diverged > 0 && multi > 0,
        "full {full} stale {stale} expired {expired} returned {returned} diverged {diverged} multi-rank runs {multi}"
    );
}
