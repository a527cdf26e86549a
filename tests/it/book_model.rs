//! The P roles (one scheduler, one to three ranks, role messages as bytes)
//! against their reference model (src/testkit.rs) over long random operation
//! sequences: grants, assigns and starts, heartbeats lost on some ranks,
//! compact renewals with right and wrong nonces, stale and duplicate
//! read-dones, ids never granted, over-long ids, capacity and slot
//! exhaustion, cancels, expiry at irregular steps, ranks that diverge, and
//! the scheduler's backstop (its `poll`, once per step: probes and cancels).
//! Deterministic: the seeds are fixed, so a failure names its seed.

use kvlease::testkit::{RolesHarness, RolesOp, SplitMix64};

fn program(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    (0..len).map(|_| (rng.next_u64() >> 24) as u8).collect()
}

/// About 10,000 operations (an operation draws about six bytes).
const PROGRAM_BYTES: usize = 60_000;

/// Runs the program of `seed` and returns the harness and how many
/// operations the program had.
fn run_counted(seed: u64) -> (RolesHarness, u64) {
    let bytes = program(seed, PROGRAM_BYTES);
    let mut h = RolesHarness::new(bytes[0]);
    let mut decoded = 0;
    for op in RolesOp::decode(&bytes[1..]) {
        h.apply(op);
        decoded += 1;
    }
    (h, decoded)
}

fn run(seed: u64) -> RolesHarness {
    run_counted(seed).0
}

#[test]
fn roles_match_model_over_random_programs() {
    let (mut applied, mut decoded) = (0, 0);
    for seed in 0..64u64 {
        let (h, n) = run_counted(seed);
        applied += h.ops;
        decoded += n;
    }
    assert_eq!(applied, decoded, "every decoded op was applied");
    assert!(decoded > 64 * 5_000, "programs too short: {decoded} ops");
}

#[test]
fn exhaustion_reuse_and_divergence_happen_in_the_random_programs() {
    // Guard against a generator that never reaches the interesting states.
    let (mut full, mut stale, mut expired, mut returned, mut diverged, mut multi) =
        (0, 0, 0, 0, 0, 0);
    let (mut probes, mut backstop_cancels) = (0, 0);
    for seed in 0..32u64 {
        let h = run(seed);
        let c = h.scheduler().counters();
        full += c.grant_refused_full;
        expired += c.expired;
        returned += c.slots_returned;
        probes += c.backstop_probes;
        backstop_cancels += c.backstop_cancels;
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
    // The scheduler's backstop (polled at every Step) probes and cancels.
    assert!(
        probes > 0 && backstop_cancels > 0,
        "backstop probes {probes}, cancels {backstop_cancels}"
    );
}
