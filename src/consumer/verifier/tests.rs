use super::*;
use crate::rng::SplitMix64;
use crate::testkit::FakeFabric;

/// Agent `agent` of `f`, with the slot count it exports.
fn target(f: &FakeFabric, agent: u32) -> VerifyTarget {
    VerifyTarget {
        agent: AgentId(agent),
        slot_region: RegionId(0),
        slot_count: f.remotes[agent as usize].len(),
    }
}

fn lf(slot: u32, nonce: u64) -> Option<LeaseFields> {
    LeaseFields::from_params(Some(slot), Some(nonce as i64))
}

fn run(v: &mut LeaseVerifier, f: &mut FakeFabric) -> Vec<(u64, Verdict)> {
    let mut out = Vec::new();
    v.step(f, Instant::ZERO, |t, verdict| out.push((t, verdict)));
    out.sort_by_key(|x| x.0);
    out
}

#[test]
fn matching_nonce_verifies_and_changed_slot_lapses() {
    let mut f = FakeFabric::with_remotes(1, 8);
    f.remotes[0].publish(3, 77);
    f.remotes[0].publish(4, 88);
    let mut v = LeaseVerifier::new(&mut f, &crate::testkit::verifier_config(4, 4)).unwrap();
    v.submit(1, lf(3, 77), &[target(&f, 0)]).unwrap();
    v.submit(2, lf(4, 88), &[target(&f, 0)]).unwrap();
    f.complete = false;
    assert!(run(&mut v, &mut f).is_empty(), "READ still in flight");
    // The lease of token 2 lapses while the slot READ is in flight.
    f.remotes[0].clear(4);
    f.remotes[0].publish(4, 99);
    f.complete = true;
    assert_eq!(
        run(&mut v, &mut f),
        [(1, Verdict::Verified), (2, Verdict::Lapsed)]
    );
    assert_eq!(f.reads.len(), 1, "both checks shared one READ");
    assert_eq!(v.waiting(), 0);
    assert_eq!(
        (
            v.counters().verified,
            v.counters().lapsed,
            v.counters().slot_reads
        ),
        (1, 1, 1)
    );
}

#[test]
fn every_rank_must_hold_the_nonce() {
    let mut f = FakeFabric::with_remotes(3, 4);
    for r in 0..3 {
        f.remotes[r].publish(1, 5);
    }
    f.remotes[2].clear(1);
    let mut v = LeaseVerifier::new(&mut f, &crate::testkit::verifier_config(4, 4)).unwrap();
    v.submit(7, lf(1, 5), &[target(&f, 0), target(&f, 1), target(&f, 2)])
        .unwrap();
    v.submit(8, lf(1, 5), &[target(&f, 0), target(&f, 1)])
        .unwrap();
    assert_eq!(
        run(&mut v, &mut f),
        [(7, Verdict::Lapsed), (8, Verdict::Verified)]
    );
    assert_eq!(f.reads.len(), 3, "one READ per remote rank");
}

#[test]
fn missing_fields_and_failed_reads_fail_closed() {
    let mut f = FakeFabric::with_remotes(1, 4);
    f.remotes[0].publish(0, 5);
    let mut v = LeaseVerifier::new(&mut f, &crate::testkit::verifier_config(4, 4)).unwrap();
    v.submit(1, None, &[]).unwrap();
    v.submit(2, lf(0, 5), &[target(&f, 0)]).unwrap();
    f.fail_next = Some(FabricError::PeerUnreachable);
    assert_eq!(
        run(&mut v, &mut f),
        [
            (1, Verdict::Unverifiable),
            (2, Verdict::ReadFailed(FabricError::PeerUnreachable))
        ]
    );
    // A slot the rank does not export: refused before any READ.
    v.submit(3, lf(1000, 5), &[target(&f, 0)]).unwrap();
    assert_eq!(run(&mut v, &mut f), [(3, Verdict::SlotOutOfRange)]);
    assert_eq!(f.reads.len(), 0, "no READ was posted for it");
    assert_eq!(v.counters().slot_out_of_range, 1);
}

/// Issue 8 item 6. Before the slot was checked against the rank's slot
/// count, the bad slot's descriptor made the fabric refuse the whole
/// READ: both checks came back `ReadFailed(OutOfBounds)`. Slot 100 is
/// within a span window of slot 3 (the shared-span path), slot 5000 is
/// not (the per-slot path).
#[test]
fn a_slot_beyond_the_peer_fails_only_its_own_check() {
    for (bad_slot, coalesced) in [(100u32, 1u64), (5000, 1)] {
        let mut f = FakeFabric::with_remotes(1, 64);
        f.remotes[0].publish(3, 77);
        f.remotes[0].publish(9, 99);
        let mut v = LeaseVerifier::new(&mut f, &crate::testkit::verifier_config(4, 4)).unwrap();
        v.submit(1, lf(3, 77), &[target(&f, 0)]).unwrap();
        v.submit(2, lf(bad_slot, 5), &[target(&f, 0)]).unwrap();
        v.submit(3, lf(9, 99), &[target(&f, 0)]).unwrap();
        assert_eq!(
            run(&mut v, &mut f),
            [
                (1, Verdict::Verified),
                (2, Verdict::SlotOutOfRange),
                (3, Verdict::Verified)
            ],
            "bad slot {bad_slot}"
        );
        assert_eq!(f.reads.len(), 1);
        assert_eq!(v.counters().coalesced_reads, coalesced);
    }
    // The per-slot path proper: the good slots themselves lie further
    // apart than a window, so each is its own descriptor.
    let mut f = FakeFabric::with_remotes(1, 4096);
    f.remotes[0].publish(0, 10);
    f.remotes[0].publish(4000, 40);
    let mut v = LeaseVerifier::new(&mut f, &crate::testkit::verifier_config(4, 4)).unwrap();
    v.submit(1, lf(0, 10), &[target(&f, 0)]).unwrap();
    v.submit(2, lf(4096, 5), &[target(&f, 0)]).unwrap();
    v.submit(3, lf(4000, 40), &[target(&f, 0)]).unwrap();
    assert_eq!(
        run(&mut v, &mut f),
        [
            (1, Verdict::Verified),
            (2, Verdict::SlotOutOfRange),
            (3, Verdict::Verified)
        ]
    );
    assert_eq!(
        f.reads[0].1.len(),
        2,
        "one 8-byte descriptor per good check"
    );
    assert_eq!(v.counters().coalesced_reads, 0);
}

/// With several P ranks the smallest slot count decides: a slot that one
/// rank lacks cannot be verified there, so the check fails as a whole,
/// and nothing is read for it on the other ranks either.
#[test]
fn a_slot_one_rank_lacks_fails_the_check_without_reads() {
    let mut f = FakeFabric::with_remotes(2, 64);
    f.remotes[0].publish(3, 7);
    f.remotes[1].publish(3, 7);
    let mut v = LeaseVerifier::new(&mut f, &crate::testkit::verifier_config(4, 4)).unwrap();
    let small = VerifyTarget {
        slot_count: 3,
        ..target(&f, 1)
    };
    v.submit(1, lf(3, 7), &[target(&f, 0), small]).unwrap();
    assert_eq!(run(&mut v, &mut f), [(1, Verdict::SlotOutOfRange)]);
    assert!(f.reads.is_empty());
    assert_eq!(v.waiting(), 0);
}

#[test]
fn from_peer_takes_the_advertised_region_and_count() {
    let info = PeerInfo {
        slot_region: Some(RegionId(2)),
        slot_count: 48,
        compact_heartbeats: false,
        clock: None,
    };
    assert_eq!(
        VerifyTarget::from_peer(AgentId(5), &info),
        Some(VerifyTarget {
            agent: AgentId(5),
            slot_region: RegionId(2),
            slot_count: 48
        })
    );
    let none = PeerInfo {
        slot_region: None,
        ..info
    };
    assert_eq!(VerifyTarget::from_peer(AgentId(5), &none), None);
}

/// Issue 8 item 8: the landing buffers are shared with the fabric, not
/// leaked. A fabric that keeps its share holds the only one once the
/// verifier is gone, so the buffers die with the fabric.
#[test]
fn landing_buffers_are_shared_with_the_fabric_not_leaked() {
    // The shared fake keeps its share of every landing buffer it registers.
    let mut f = FakeFabric::with_remotes(1, 8);
    f.remotes[0].publish(2, 9);
    let mut v = LeaseVerifier::new(&mut f, &crate::testkit::verifier_config(4, 2)).unwrap();
    assert_eq!(f.kept.len(), 2, "landing cells and span windows");
    assert!(f.kept.iter().all(|w| Arc::strong_count(w) == 2));
    let t = target(&f, 0);
    v.submit(1, lf(2, 9), &[t]).unwrap();
    let mut got = Vec::new();
    v.step(&mut f, Instant::ZERO, |t, verdict| got.push((t, verdict)));
    assert_eq!(got, [(1, Verdict::Verified)]);
    drop(v);
    assert!(
        f.kept.iter().all(|w| Arc::strong_count(w) == 1),
        "the fabric's share is the last: freed with the fabric"
    );
}

#[test]
fn packed_slots_are_read_as_their_aligned_window_and_scattered_ones_per_slot() {
    let mut f = FakeFabric::with_remotes(1, 6000);
    for (slot, nonce) in [(0, 10), (7, 17), (5000, 50)] {
        f.remotes[0].publish(slot, nonce);
    }
    let mut v = LeaseVerifier::new(&mut f, &crate::testkit::verifier_config(8, 2)).unwrap();
    // Slots 0 and 7: one descriptor, the whole first window (1024 slots).
    v.submit(1, lf(0, 10), &[target(&f, 0)]).unwrap();
    v.submit(2, lf(7, 17), &[target(&f, 0)]).unwrap();
    assert_eq!(
        run(&mut v, &mut f),
        [(1, Verdict::Verified), (2, Verdict::Verified)]
    );
    assert_eq!(f.reads[0].1.len(), 1);
    assert_eq!(
        (f.reads[0].1[0].remote_offset, f.reads[0].1[0].len),
        (0, 8 * u64::from(WINDOW_SLOTS))
    );
    // Slots 0 and 5000 lie in different windows: two 8-byte descriptors.
    v.submit(3, lf(0, 10), &[target(&f, 0)]).unwrap();
    v.submit(4, lf(5000, 51), &[target(&f, 0)]).unwrap();
    assert_eq!(
        run(&mut v, &mut f),
        [(3, Verdict::Verified), (4, Verdict::Lapsed)]
    );
    assert_eq!(f.reads[1].1.len(), 2);
    assert_eq!(
        (v.counters().slot_reads, v.counters().coalesced_reads),
        (2, 1)
    );
    // Slot 5000 alone: its window, slots 4096..5120.
    v.submit(5, lf(5000, 50), &[target(&f, 0)]).unwrap();
    assert_eq!(run(&mut v, &mut f), [(5, Verdict::Verified)]);
    assert_eq!(
        (f.reads[2].1[0].remote_offset, f.reads[2].1[0].len),
        (8 * 4096, 8 * 1024)
    );
    // The last window is clipped to the agent's 6000 slots.
    f.remotes[0].publish(5999, 99);
    v.submit(6, lf(5999, 99), &[target(&f, 0)]).unwrap();
    assert_eq!(run(&mut v, &mut f), [(6, Verdict::Verified)]);
    assert_eq!(
        (f.reads[3].1[0].remote_offset, f.reads[3].1[0].len),
        (8 * 5120, 8 * (6000 - 5120))
    );
}

/// Issue 8, item 7: the descriptor of a window READ depends only on the
/// agent and the window, not on which slots are checked, so a fabric with
/// prepared requests (NIXL) re-posts one instead of creating one per batch.
#[test]
fn window_reads_repeat_the_same_descriptor_whatever_the_slots() {
    let mut f = FakeFabric::with_remotes(2, 300);
    for s in 0..300 {
        f.remotes[0].publish(s, u64::from(s) + 1);
        f.remotes[1].publish(s, u64::from(s) + 1);
    }
    let mut v = LeaseVerifier::new(&mut f, &crate::testkit::verifier_config(8, 2)).unwrap();
    let mut rng = SplitMix64::new(7);
    // Under miri each 8 KiB window read is interpreted byte by byte: 8
    // rounds (both agents are hit from round 1) keep the CI step short.
    let rounds: u64 = if cfg!(miri) { 8 } else { 50 };
    for round in 0..rounds {
        // 1 to 3 random live slots per step, on either agent.
        for _ in 0..1 + round % 3 {
            let r = rng.next_u64();
            let slot = ((r >> 33) % 300) as u32;
            let agent = ((r >> 20) & 1) as u32;
            v.submit(round, lf(slot, u64::from(slot) + 1), &[target(&f, agent)])
                .unwrap();
        }
        assert!(run(&mut v, &mut f)
            .iter()
            .all(|(_, v)| *v == Verdict::Verified));
    }
    let mut distinct: Vec<(AgentId, Vec<ReadDesc>)> = Vec::new();
    for (agent, descs, _) in &f.reads {
        let r = (*agent, descs.clone());
        if !distinct.contains(&r) {
            distinct.push(r);
        }
    }
    assert!(f.reads.len() as u64 >= rounds, "{} reads", f.reads.len());
    assert_eq!(
        distinct.len(),
        2,
        "one descriptor set per agent: {distinct:?}"
    );
}

#[test]
fn refusals_are_typed() {
    let mut f = FakeFabric::with_remotes(3, 4);
    let mut v = LeaseVerifier::new(&mut f, &crate::testkit::verifier_config(2, 2)).unwrap();
    assert_eq!(
        v.submit(1, lf(0, 1), &[]),
        Err(VerifyError::BadTargets {
            targets: 0,
            max_fan_out: 16
        })
    );
    assert_eq!(
        v.submit(1, lf(0, 1), &[target(&f, 0); 17]),
        Err(VerifyError::BadTargets {
            targets: 17,
            max_fan_out: 16
        })
    );
    assert_eq!(
        v.submit(1, lf(0, 1), &[target(&f, 0), target(&f, 1), target(&f, 2)]),
        Err(VerifyError::TooManyAgents)
    );
    v.submit(1, lf(0, 1), &[target(&f, 0)]).unwrap();
    v.submit(2, lf(0, 1), &[target(&f, 1)]).unwrap();
    assert_eq!(
        v.submit(3, lf(0, 1), &[target(&f, 0)]),
        Err(VerifyError::Full)
    );
    assert_eq!(v.counters().refused, 4);
    assert_eq!(run(&mut v, &mut f).len(), 2);
    // Agents with nothing waiting are forgotten, so new ones fit.
    v.submit(4, lf(0, 1), &[target(&f, 2)]).unwrap();
}
