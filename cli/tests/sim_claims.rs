//! The claims, asserted on seeded runs of the simulator (the same
//! code `kvlease sim` runs): each test runs one scenario under the policies
//! it compares and checks the measured numbers against the protocol's bounds.

mod common;

use common::{run, sim, verify_and_noverify};

/// An expiry is seen at the next P step (an idle P polls every 50 ms) and
/// the wheel is one tick late at most: the slack on protocol bounds.
const STEP_SLACK_S: f64 = 0.1;

#[test]
fn after_a_decoder_crash_leases_reclaim_within_extension_plus_interval_and_480_s_holds() {
    let out = sim(&[
        "--scenario",
        "decode-crash",
        "--policy",
        "lease+verify,fixed-480",
        "--seed",
        "7",
    ]);
    let r = &out.report;
    let lease = run(r, "decode-crash", "lease+verify");
    let fixed = run(r, "decode-crash", "fixed-480");
    let l = &r.runs[0].lease;
    assert!(
        lease.orphaned > 0 && fixed.orphaned > 0,
        "the crash must orphan leases"
    );
    // Requests D had heartbeated: within extension + one interval.
    let renewed = lease
        .reclaim_renewed_s
        .expect("every heartbeated dead block reclaimed");
    assert!(
        renewed <= l.extension_s + l.interval_s + STEP_SLACK_S,
        "heartbeated dead blocks reclaimed {renewed} s after the crash"
    );
    // Every dead block: no later than the initial lease (a request that
    // reached D in the last interval before the crash was never renewed).
    let all = lease.reclaim_s.expect("every dead block reclaimed");
    assert!(
        all <= l.duration_s.max(l.extension_s + l.interval_s) + STEP_SLACK_S,
        "{all}"
    );
    // The fixed timeout holds dead blocks until 480 s after their grant.
    let held = fixed.reclaim_s.expect("the run outlasts the 480 s timeout");
    assert!(
        held > 400.0 && held <= 480.0 + STEP_SLACK_S,
        "fixed-480 held {held} s"
    );
    assert!(fixed.dead_block_seconds > 10.0 * lease.dead_block_seconds);
    assert_eq!(lease.dead_blocks_at_end, 0);
}

#[test]
fn under_overload_leases_free_nothing_prematurely_and_a_30_s_timeout_does() {
    let out = sim(&["--scenario", "overload", "--seed", "3"]);
    let r = &out.report;
    for p in ["lease+verify", "lease-noverify", "fixed-480"] {
        let x = run(r, "overload", p);
        assert_eq!(x.premature_frees, 0, "{p}");
        assert_eq!(x.silent_corruptions, 0, "{p}");
        assert_eq!(x.failed_loads, 0, "{p}");
    }
    let f = run(r, "overload", "fixed-30");
    assert!(
        f.premature_frees > 0,
        "a 30 s timeout under a long queue frees early"
    );
    assert!(f.stale_reads > 0);
    // Unverified stale reads of reused blocks are accepted: corruption.
    assert!(f.silent_corruptions > 0);
    assert!(f.completed < run(r, "overload", "lease+verify").completed);
}

#[test]
fn with_heartbeat_loss_verification_fails_every_stale_read_and_no_verification_corrupts() {
    let (v, n) = verify_and_noverify("heartbeat-loss", &["--seed", "11"]);
    assert!(v.premature_frees > 0, "leases must lapse while D is alive");
    assert!(v.stale_reads > 0);
    assert_eq!(
        v.stale_caught, v.stale_reads,
        "every stale read is a failed load"
    );
    assert_eq!(v.silent_corruptions, 0);
    assert_eq!(v.verified_but_wrong, 0);
    assert!(v.recomputed >= v.stale_caught);
    assert!(n.stale_reads > 0);
    assert!(
        n.silent_corruptions > 0,
        "without verification reused blocks are accepted"
    );
    assert_eq!(n.stale_caught, 0);
}

#[test]
fn a_lease_lapsing_mid_read_is_caught_and_uncaught_without_verification() {
    let (v, n) = verify_and_noverify("midread-lapse", &[]);
    assert!(
        v.mid_read_frees > 0,
        "P must free blocks while D's READ runs"
    );
    assert_eq!(v.silent_corruptions, 0);
    assert_eq!(v.stale_caught, v.stale_reads);
    assert!(n.mid_read_frees > 0);
    assert!(n.silent_corruptions > 0);
}

#[test]
fn exhausted_slots_make_unverifiable_loads_not_corrupt_ones() {
    let (v, n) = verify_and_noverify("slot-exhaustion", &[]);
    assert!(v.granted_without_slot > 0);
    assert!(
        v.unverifiable > 0,
        "a lease without a slot cannot be verified"
    );
    assert_eq!(v.unverifiable, v.failed_loads);
    assert_eq!(v.silent_corruptions, 0);
    // Verification off: no lease has a slot, and none is checked.
    assert!(n.granted_without_slot >= n.completed);
    assert_eq!(n.unverifiable, 0);
    assert_eq!(n.failed_loads, 0);
}

#[test]
fn a_deaf_rank_fails_loads_closed_without_freeing_blocks_early() {
    let (v, n) = verify_and_noverify("rank-divergence", &[]);
    // The deaf rank zeroes its slots alone: checks fail there...
    assert!(v.failed_loads > 0);
    // ... while the other rank holds, so no block is freed early or read stale.
    assert_eq!(v.premature_frees, 0);
    assert_eq!(v.stale_reads, 0);
    assert_eq!(v.silent_corruptions, 0);
    assert_eq!(n.silent_corruptions, 0, "the blocks were never freed early");
}

#[test]
fn the_happy_path_loses_nothing_and_verification_never_passes_wrong_kv() {
    let out = sim(&["--scenario", "happy", "--duration", "120"]);
    for p in &out.report.runs[0].policies {
        assert!(p.completed > 0, "{}", p.policy);
        assert_eq!(
            p.failed_loads + p.premature_frees + p.silent_corruptions + p.lost,
            0,
            "{}",
            p.policy
        );
        assert!(
            p.completed + 64 >= p.arrived,
            "{}: {} of {}",
            p.policy,
            p.completed,
            p.arrived
        );
    }
    let v = run(&out.report, "happy", "lease+verify");
    assert!(
        v.heartbeat_messages > 0 && v.renewals > 0,
        "heartbeats flowed"
    );
    let f = run(&out.report, "happy", "fixed-480");
    assert_eq!(
        f.heartbeat_messages, 0,
        "a fixed timeout sends no heartbeats"
    );
}

#[test]
fn turn2_reads_across_skewed_clocks_are_verified_or_corrupt() {
    // D's clock is 2 h ahead and drifting: every read the gate accepted
    // completed before D's deadline unless the READ itself was slow; those
    // verification catches, and without it they are silent corruptions.
    let out = sim(&[
        "--scenario",
        "bidirectional-skew",
        "--policy",
        "lease+verify,lease-noverify,fixed-480",
        "--seed",
        "5",
    ]);
    let v = run(&out.report, "bidirectional-skew", "lease+verify");
    let n = run(&out.report, "bidirectional-skew", "lease-noverify");
    let vllm = run(&out.report, "bidirectional-skew", "fixed-480");
    assert!(v.completed > 100, "turn 2s were read: {}", v.completed);
    assert!(v.stale_reads > 0, "the TTL must overtake some READs");
    assert_eq!(v.stale_caught, v.stale_reads);
    assert_eq!((v.silent_corruptions, v.verified_but_wrong), (0, 0));
    assert!(n.silent_corruptions > 0, "without verification: {n:?}");
    assert_eq!(n.stale_caught, 0);
    // The skew is estimated, not ignored: the gate declines only near the
    // deadline (about a quarter of turn 2s come back after it), so most
    // turn 2s are read rather than recomputed.
    assert!(v.recomputed < v.completed, "{v:?}");
    assert!(vllm.silent_corruptions > 0, "vLLM's turn 2 is unverified");
}

#[test]
fn push_guard_hangs_nothing_leaks_nothing_and_takes_no_stray_write() {
    // vLLM's push mode with late, lost and aborted registrations, slow
    // WRITEs, lossy notifications and a P that dies at 150 s: the guard ends
    // every push (loaded or failed) and frees every set, never under a
    // WRITE; stock vLLM (fixed-480) hangs and leaks, a naive D timeout
    // (fixed-30) frees under WRITEs still in flight.
    let out = sim(&["--scenario", "push-faults", "--seed", "3"]);
    let g = run(&out.report, "push-faults", "lease+verify");
    let stock = run(&out.report, "push-faults", "fixed-480");
    let naive = run(&out.report, "push-faults", "fixed-30");
    let (gf, sf, nf) = (
        g.push.clone().unwrap(),
        stock.push.clone().unwrap(),
        naive.push.clone().unwrap(),
    );
    assert_eq!(
        g.arrived, stock.arrived,
        "every policy gets the same pushes"
    );
    assert!(g.completed > 300, "{g:?}");
    assert_eq!(
        (gf.hung, gf.leaked_sets, gf.stray_writes),
        (0, 0, 0),
        "{gf:?}"
    );
    assert_eq!(g.silent_corruptions, 0);
    assert!(
        gf.permits_refused > 0,
        "late registrations are refused at once: {gf:?}"
    );
    assert!(
        gf.permits_lapsed > 0,
        "lost ones and the dead P's end at the fence: {gf:?}"
    );
    assert!(gf.outstanding_at_p_death > 0, "{gf:?}");
    let reclaim = gf
        .reclaim_after_p_death_s
        .expect("the guard frees the dead P's sets");
    assert!(reclaim <= gf.bound_s.unwrap() + 0.1, "{gf:?}");
    assert!(
        sf.hung > 0 && sf.leaked_sets == sf.hung,
        "stock hangs: {sf:?}"
    );
    assert_eq!(
        sf.reclaim_after_p_death_s, None,
        "stock never frees the dead P's sets"
    );
    assert!(
        nf.stray_writes > 0 && naive.silent_corruptions > 0,
        "{nf:?}"
    );
    let check = out
        .report
        .checks
        .iter()
        .find(|c| c.text.starts_with("push-faults"))
        .expect("the push-faults check");
    assert_eq!(check.holds, Some(true), "{}", check.text);
}
