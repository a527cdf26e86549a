//! The invariants of DESIGN.md "Lifecycle of one lease", one named test each,
//! through the public API only.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kvlease::producer::ReadDoneOutcome;
use kvlease::testkit::p_side_config;
use kvlease::{
    Instant, LeaseBook, LeaseConfig, LeaseSlots, NonceSource, ReleaseReason, Renewal, SlotPool,
};

fn config(slots: u32, capacity: u32) -> LeaseConfig {
    p_side_config(slots, capacity)
}

fn book_with_ranks(slots: u32, capacity: u32, ranks: usize) -> LeaseBook {
    let arrays = (0..ranks)
        .map(|_| Arc::new(LeaseSlots::new(slots)))
        .collect();
    let pool = Arc::new(SlotPool::new(slots));
    LeaseBook::with_parts(
        &config(slots, capacity),
        arrays,
        pool,
        NonceSource::from_seed(1, 2, 3),
        Instant::ZERO,
    )
    .unwrap()
}

const T0: Instant = Instant::ZERO;

fn secs(s: u64) -> Instant {
    Instant::from_secs(s)
}

#[test]
fn invariant_1_slot_holds_nonce_only_while_blocks_are_held() {
    let mut book = book_with_ranks(2, 8, 3);
    let g = book.grant("req-a", T0).unwrap();
    let kvlease::LeaseFields { slot, nonce } = g.lease_fields().expect("verifiable lease");
    for r in 0..3 {
        assert_eq!(
            book.rank_slots(r).unwrap().load(slot),
            Some(nonce.get()),
            "rank {r} holds the nonce"
        );
    }
    // Rank 0 and 1 done, rank 2 not yet: still held, slot still set.
    assert_eq!(
        book.read_done(0, "d0", b"req-a", 1, Some(nonce), secs(1)),
        ReadDoneOutcome::Counted
    );
    assert_eq!(
        book.read_done(1, "d0", b"req-a", 1, Some(nonce), secs(1)),
        ReadDoneOutcome::Counted
    );
    assert_eq!(book.rank_slots(2).unwrap().load(slot), Some(nonce.get()));
    assert_eq!(
        book.read_done(2, "d0", b"req-a", 1, Some(nonce), secs(1)),
        ReadDoneOutcome::Released
    );

    // Zeroed on every rank before the release is reported.
    let arrays: Vec<_> = (0..3)
        .map(|r| book.rank_slots(r).unwrap().clone())
        .collect();
    let mut ticket = None;
    book.drain_released(|rel| {
        assert_eq!(rel.request_id, "req-a");
        assert_eq!(rel.reason, ReleaseReason::ReadDone);
        for a in &arrays {
            assert_eq!(a.load(slot), Some(0), "slot zeroed before the report");
        }
        ticket = rel.slot;
    });
    let ticket = ticket.expect("the report carries the slot");

    // Not reusable until the engine says the blocks are freed.
    let other = book
        .grant("req-b", secs(2))
        .unwrap()
        .fields
        .expect("the second slot")
        .slot;
    assert_ne!(other, slot);
    let starved = book.grant("req-c", secs(2)).unwrap();
    assert_eq!(
        starved.lease_fields(),
        None,
        "pool empty: granted without slot"
    );
    assert_eq!(book.counters().granted_without_slot, 1);
    book.blocks_freed(ticket);
    let again = book.grant("req-d", secs(3)).unwrap();
    assert_eq!(
        again.fields.map(|f| f.slot),
        Some(slot),
        "reused only after blocks_freed"
    );
    assert_ne!(again.nonce, nonce);
    assert_eq!(book.counters().slots_returned, 1);
}

#[test]
fn invariant_1_expiry_also_zeroes_before_report() {
    let mut book = book_with_ranks(1, 1, 1);
    let slot = book
        .grant("req-a", T0)
        .unwrap()
        .fields
        .map(|f| f.slot)
        .unwrap();
    book.poll(secs(30));
    let arr = book.rank_slots(0).unwrap().clone();
    let mut reasons = vec![];
    book.drain_released(|rel| {
        assert_eq!(arr.load(slot), Some(0));
        reasons.push(rel.reason);
        leak_slot(rel.slot);
    });
    assert_eq!(reasons, [ReleaseReason::Expired]);
}

/// Dropping a ticket leaks its slot by design; tests that do not reuse the
/// slot drop it here, so the intent is visible.
fn leak_slot(t: Option<kvlease::SlotTicket>) {
    let _leaked = t;
}

#[test]
fn invariant_2_nonces_are_never_zero_and_never_repeat() {
    let mut book = LeaseBook::new(&config(64, 64), T0);
    let mut seen = HashSet::new();
    let mut now = T0;
    for i in 0..50_000u32 {
        let id = format!("req-{}", i % 100);
        let g = book.grant(&id, now).unwrap();
        assert_ne!(g.nonce.get(), 0);
        assert!(seen.insert(g.nonce), "nonce repeated at grant {i}");
        book.read_done(0, "d0", id.as_bytes(), 1, Some(g.nonce), now);
        let mut tickets = vec![];
        book.drain_released(|r| tickets.extend(r.slot));
        for t in tickets {
            book.blocks_freed(t);
        }
        now = now + Duration::from_millis(1);
    }
    // Two instances (two restarts) do not start from the same nonce.
    let a = LeaseBook::new(&config(1, 1), T0)
        .grant("x", T0)
        .unwrap()
        .nonce;
    let b = LeaseBook::new(&config(1, 1), T0)
        .grant("x", T0)
        .unwrap()
        .nonce;
    assert_ne!(a, b);
}

#[test]
fn invariant_3_renewal_never_shortens() {
    let mut book = book_with_ranks(4, 4, 1);
    book.grant("req-a", T0).unwrap();
    assert_eq!(book.expiry("req-a"), Some(secs(30)));
    // now + extension (20 s) = 21 s < 30 s: expiry stays 30 s.
    assert_eq!(book.renew(b"req-a", secs(1)), Renewal::Renewed);
    assert_eq!(book.expiry("req-a"), Some(secs(30)));
    assert_eq!(book.renew(b"req-a", secs(15)), Renewal::Renewed);
    assert_eq!(book.expiry("req-a"), Some(secs(35)));
    // A heartbeat that arrives "from the past" (earlier now) changes nothing.
    let _ = book.renew(b"req-a", secs(2));
    assert_eq!(book.expiry("req-a"), Some(secs(35)));
}

#[test]
fn invariant_3_stale_read_done_changes_nothing() {
    let mut book = book_with_ranks(4, 4, 1);
    let old = book.grant("req-a", T0).unwrap().nonce;
    book.poll(secs(30)); // expires
    let mut tickets = vec![];
    book.drain_released(|r| tickets.extend(r.slot));
    for t in tickets {
        book.blocks_freed(t);
    }
    // Same id, new lease.
    let new = book.grant("req-a", secs(31)).unwrap();
    assert_ne!(new.nonce, old);
    assert_eq!(
        book.read_done(0, "d0", b"req-a", 1, Some(old), secs(32)),
        ReadDoneOutcome::StaleNonce
    );
    assert_eq!(book.held(), 1);
    assert_eq!(
        book.rank_slots(0).unwrap().load(new.fields.unwrap().slot),
        Some(new.nonce.get())
    );
    assert_eq!(book.counters().read_done_stale_nonce, 1);
    assert_eq!(
        book.read_done(0, "d0", b"req-a", 1, Some(new.nonce), secs(32)),
        ReadDoneOutcome::Released
    );
}

#[test]
fn invariant_4_expiry_never_early_and_at_most_a_tick_plus_a_step_late() {
    let tick = Duration::from_millis(10);
    for step_ms in [1u64, 7, 10, 33, 250] {
        let mut book = book_with_ranks(8, 8, 1);
        let grants: Vec<Instant> = (0..8).map(|i| Instant::from_millis(i * 1234 + 3)).collect();
        let mut granted = 0;
        let mut now = T0;
        let mut released = [None; 8];
        while released.iter().any(Option::is_none) {
            while granted < 8 && grants[granted] <= now {
                book.grant(&format!("r{granted}"), now).unwrap();
                granted += 1;
            }
            book.poll(now);
            book.drain_released(|r| {
                let i: usize = r.request_id[1..].parse().unwrap();
                released[i] = Some(now);
                leak_slot(r.slot);
            });
            now = now + Duration::from_millis(step_ms);
        }
        for (i, at) in released.iter().enumerate() {
            let at = at.unwrap();
            // Granted at the first step at or after grants[i].
            let granted_at =
                Instant::from_millis(grants[i].as_nanos().div_ceil(step_ms * 1_000_000) * step_ms);
            let expiry = granted_at + Duration::from_secs(30);
            assert!(at >= expiry, "step {step_ms} ms: r{i} released early");
            assert!(
                at <= expiry + tick + Duration::from_millis(step_ms),
                "step {step_ms} ms: r{i} released {:?} late",
                at.saturating_duration_since(expiry)
            );
        }
    }
}

#[test]
fn invariant_5_bad_input_is_counted_never_a_panic_or_a_lost_block() {
    let mut c = config(2, 2);
    c.max_request_id_len = 8;
    let mut book = LeaseBook::new(&c, T0);
    assert!(book.grant("", T0).is_err());
    assert!(book.grant("123456789", T0).is_err());
    assert_eq!(book.counters().grant_refused_bad_id, 2);
    let g = book.grant("a", T0).unwrap();
    assert!(book.grant("a", T0).is_err());
    assert_eq!(book.counters().grant_refused_duplicate, 1);
    book.grant("b", T0).unwrap();
    assert_eq!(book.grant("c", T0), Err(kvlease::GrantError::Full));
    assert_eq!(book.counters().grant_refused_full, 1);

    assert_eq!(book.renew(b"never-granted", T0), Renewal::Unknown);
    assert_eq!(
        book.renew(b"way-too-long-to-be-an-id", T0),
        Renewal::Unknown
    );
    assert_eq!(book.renew_slot(99, g.nonce, T0), Renewal::Unknown);
    assert_eq!(
        book.read_done(0, "d0", b"nope", 1, None, T0),
        ReadDoneOutcome::Unknown
    );
    assert_eq!(
        book.read_done(5, "d0", b"a", 1, None, T0),
        ReadDoneOutcome::BadRank
    );
    assert_eq!(
        book.read_done(0, "d0", b"a", 0, Some(g.nonce), T0),
        ReadDoneOutcome::Released,
        "0 consumers counts as 1"
    );
    // Duplicate / late read-done after release: unknown, nothing released twice.
    assert_eq!(
        book.read_done(0, "d0", b"a", 1, Some(g.nonce), T0),
        ReadDoneOutcome::Unknown
    );
    let mut reports = 0;
    book.drain_released(|r| {
        reports += 1;
        leak_slot(r.slot);
    });
    assert_eq!(reports, 1);
    assert_eq!(
        book.read_done(0, "d0", b"a", 1, Some(g.nonce), T0),
        ReadDoneOutcome::Unknown
    );
    assert_eq!(book.counters().read_done_unknown, 3);
    assert!(!book.cancel("a"));
    assert!(book.cancel("b"));
    assert_eq!(book.counters().cancelled, 1);
}

#[test]
fn consumers_are_counted_per_rank_once_per_sender() {
    // P TP 1, D TP 2: two decoder ranks read from the one P rank.
    let mut book = book_with_ranks(2, 2, 1);
    let n = book.grant("req", T0).unwrap().nonce;
    assert_eq!(
        book.read_done(0, "d0", b"req", 2, Some(n), T0),
        ReadDoneOutcome::Counted
    );
    assert_eq!(
        book.read_done(0, "d0", b"req", 2, None, T0),
        ReadDoneOutcome::DuplicateSender
    );
    assert_eq!(
        book.read_done(0, "d1", b"req", 2, None, T0),
        ReadDoneOutcome::Released
    );
    assert_eq!(book.counters().read_done_without_nonce, 2);
}

#[test]
fn compact_renewal_needs_the_matching_nonce() {
    let mut book = book_with_ranks(2, 2, 1);
    let g = book.grant("req", T0).unwrap();
    let kvlease::LeaseFields { slot, nonce } = g.lease_fields().unwrap();
    let wrong = kvlease::Nonce::new(nonce.get() ^ 1).unwrap();
    assert_eq!(book.renew_slot(slot, wrong, secs(20)), Renewal::Unknown);
    assert_eq!(book.counters().renew_nonce_mismatch, 1);
    assert_eq!(book.expiry("req"), Some(secs(30)));
    assert_eq!(book.renew_slot(slot, nonce, secs(20)), Renewal::Renewed);
    assert_eq!(book.expiry("req"), Some(secs(40)));
}

#[test]
fn max_hold_caps_renewal() {
    let mut c = config(2, 2);
    c.max_hold_secs = Some(60);
    let mut book = LeaseBook::new(&c, T0);
    book.grant("req", T0).unwrap();
    assert_eq!(book.renew(b"req", secs(30)), Renewal::Renewed); // 50 s
    assert_eq!(book.renew(b"req", secs(45)), Renewal::Capped); // wants 65, gets 60
    assert_eq!(book.expiry("req"), Some(secs(60)));
    assert_eq!(book.renew(b"req", secs(59)), Renewal::Capped);
    assert_eq!(book.counters().renew_capped, 2);
    book.poll(secs(60));
    assert_eq!(book.held(), 0);
    assert_eq!(book.counters().expired, 1);
}

#[test]
fn verification_off_grants_without_slot() {
    let mut c = config(2, 2);
    c.verification = false;
    let mut book = LeaseBook::new(&c, T0);
    let g = book.grant("req", T0).unwrap();
    assert_eq!(g.lease_fields(), None);
    let untouched: Vec<u32> = std::iter::from_fn(|| book.slot_pool().take())
        .map(|t| t.slot())
        .collect();
    assert_eq!(untouched.len(), 2, "no slot taken from the pool");
}

#[test]
fn mismatched_slot_arrays_are_refused() {
    let c = config(4, 4);
    let pool = Arc::new(SlotPool::new(4));
    let small = Arc::new(LeaseSlots::new(2));
    let err = LeaseBook::with_parts(
        &c,
        vec![small],
        pool.clone(),
        NonceSource::from_seed(0, 0, 0),
        T0,
    )
    .unwrap_err();
    assert!(err.to_string().contains("2 slots"));
    assert!(LeaseBook::with_parts(&c, vec![], pool, NonceSource::from_seed(0, 0, 0), T0).is_err());
}

#[test]
fn heartbeat_renews_held_ids_and_ignores_unknown_ones() {
    // vLLM's test: HB:req-a,req-b,req-unknown — a renewed, b keeps its later
    // expiry, unknown not added.
    let mut book = book_with_ranks(4, 4, 1);
    book.grant("req-a", T0).unwrap();
    book.grant("req-b", secs(25)).unwrap(); // expires at 55 s
    let s = book
        .on_notification(0, "d0", b"HB:req-a,req-b,req-unknown", secs(20))
        .unwrap();
    assert_eq!((s.renewed, s.ignored), (2, 1));
    assert_eq!(book.expiry("req-a"), Some(secs(40)));
    assert_eq!(
        book.expiry("req-b"),
        Some(secs(55)),
        "a renewal never shortens"
    );
    assert_eq!(book.expiry("req-unknown"), None);
    assert_eq!(book.held(), 2);
}

#[test]
fn read_done_notifications_release_through_the_inbox() {
    let mut book = book_with_ranks(4, 4, 1);
    let g = book.grant("cmpl-1:0", T0).unwrap();
    let msg = format!("cmpl-1:0:1:nonce={}", g.nonce);
    let s = book
        .on_notification(0, "d0", msg.as_bytes(), secs(1))
        .unwrap();
    assert_eq!(s.read_done, Some(ReadDoneOutcome::Released));
    // The same notification again: the lease is gone.
    let s = book
        .on_notification(0, "d0", msg.as_bytes(), secs(1))
        .unwrap();
    assert_eq!(s.read_done, Some(ReadDoneOutcome::Unknown));
    // Malformed bytes: an error, counted, nothing changes.
    assert!(book.on_notification(0, "d0", b"HBC:zz", secs(1)).is_err());
    assert!(book.on_notification(0, "d0", b"", secs(1)).is_err());
    assert_eq!(book.counters().malformed_notifications, 2);
}

/// Issue 8, item 1: vLLM's D can send `HB:a,,b` (an empty remote id from a
/// router); vLLM's P renews what it holds. One bad piece must not lapse the
/// leases of every other request of that D.
#[test]
fn one_empty_id_does_not_cost_the_whole_heartbeat() {
    let mut book = book_with_ranks(4, 8, 1);
    book.grant("req-a", T0).unwrap();
    book.grant("req-b", T0).unwrap();
    for (msg, empty) in [
        (&b"HB:req-a,,req-b"[..], 1),
        (b"HB:,req-a,req-b", 1),
        (b"HB:req-a,req-b,", 1),
    ] {
        let before = book.counters().heartbeat_empty_ids;
        let s = book
            .on_notification(0, "d0", msg, secs(20))
            .expect("a heartbeat");
        assert_eq!((s.renewed, s.ignored), (2, 0), "{msg:?}");
        assert_eq!(
            book.counters().heartbeat_empty_ids - before,
            empty,
            "{msg:?}"
        );
    }
    // Renewed at 20 s to 20 + extension (20 s): not expired at 39 s.
    book.poll(secs(39));
    assert_eq!(book.held(), 2);
    assert_eq!(book.expiry("req-a"), Some(secs(40)));
}

/// Issue 8, item 5: an id granted again before its old release is drained
/// would make `Released` ambiguous (an engine freeing blocks by id frees the
/// new request's blocks while the new slot still verifies). The re-grant is
/// refused until the drain, and the report names its lease by nonce.
#[test]
fn regrant_before_drain_is_refused_and_the_release_names_its_lease() {
    let mut book = book_with_ranks(4, 8, 1);
    let first = book.grant("X", T0).unwrap();
    book.poll(secs(30));
    assert_eq!(book.pending_releases(), 1, "X expired at 30 s");
    assert_eq!(
        book.grant("X", secs(30)),
        Err(kvlease::GrantError::ReleasePending)
    );
    assert_eq!(book.counters().grant_refused_release_pending, 1);
    let mut drained = Vec::new();
    let mut tickets = Vec::new();
    book.drain_released(|r| {
        drained.push((r.request_id.to_string(), r.reason, r.nonce));
        tickets.extend(r.slot);
    });
    // The engine frees the blocks, then gives the slot back.
    for t in tickets {
        book.blocks_freed(t);
    }
    assert_eq!(
        drained,
        [("X".to_string(), ReleaseReason::Expired, first.nonce)]
    );
    let second = book.grant("X", secs(30)).expect("granted after the drain");
    assert_ne!(second.nonce, first.nonce);
    assert_eq!(book.expiry("X"), Some(secs(60)));
}

/// Issue 8, item 8: an engine that frees blocks in the drain callback gets
/// the slots back to the pool without collecting tickets.
#[test]
fn drain_freed_returns_slots_without_collecting_tickets() {
    let mut book = book_with_ranks(2, 8, 1);
    let a = book.grant("a", T0).unwrap().fields.map(|f| f.slot).unwrap();
    let b = book.grant("b", T0).unwrap().fields.map(|f| f.slot).unwrap();
    assert!(
        book.grant("c", T0)
            .unwrap()
            .fields
            .map(|f| f.slot)
            .is_none(),
        "pool empty"
    );
    book.poll(secs(31));
    let mut freed = Vec::new();
    book.drain_freed(|r| freed.push((r.request_id.to_string(), r.slot.as_ref().map(|t| t.slot()))));
    freed.sort();
    assert_eq!(
        freed,
        [
            ("a".to_string(), Some(a)),
            ("b".to_string(), Some(b)),
            ("c".to_string(), None)
        ]
    );
    assert_eq!(book.counters().slots_returned, 2);
    assert!(
        book.grant("d", secs(31))
            .unwrap()
            .fields
            .map(|f| f.slot)
            .is_some(),
        "slots back in the pool"
    );
}

/// A compact heartbeat of many records (longer than the renewal pipeline's
/// look-ahead) gives every record the outcome it gets alone: renewed,
/// capped at the hold ceiling, a stale nonce, a slot out of range or one
/// holding no lease, a record repeated; the same deadlines and counters as
/// `renew_slot` record by record on a twin book.
#[test]
fn a_batch_of_compact_renewals_is_each_record_renewed_alone() {
    let mut c = config(64, 64);
    c.max_hold_secs = Some(45);
    let twin = || {
        let mut book = LeaseBook::with_parts(
            &c,
            vec![Arc::new(LeaseSlots::new(64))],
            Arc::new(SlotPool::new(64)),
            NonceSource::from_seed(1, 2, 3),
            T0,
        )
        .unwrap();
        let mut fields = Vec::new();
        for i in 0..48u32 {
            // Half granted at 0 s (ceiling 45 s), half at 20 s (65 s).
            let at = if i % 2 == 0 { T0 } else { secs(20) };
            let g = book.grant(&format!("req-{i}"), at).unwrap();
            fields.push(g.lease_fields().unwrap());
        }
        (book, fields)
    };
    let (mut batch, fields) = twin();
    let (mut alone, same) = twin();
    assert_eq!(fields, same, "the twins drew the same slots and nonces");
    let mut records = Vec::new();
    for (i, f) in fields.iter().enumerate() {
        let nonce = match i % 5 {
            3 => kvlease::Nonce::new(f.nonce.get() ^ 0x10).unwrap(), // stale
            _ => f.nonce,
        };
        records.push((f.slot, nonce));
        if i % 7 == 0 {
            records.push((f.slot, f.nonce)); // repeated
        }
        if i % 11 == 0 {
            records.push((64 + i as u32, f.nonce)); // out of range
            records.push((u32::MAX, f.nonce));
        }
    }
    // Slots no lease holds (48..64 were never granted).
    records.extend((48..64).map(|s| (s, fields[0].nonce)));
    assert!(records.len() > 64);
    let now = secs(30); // wants 50 s: capped at 45 s for the leases granted at 0 s
    let (renewed, ignored) = batch.renew_slots_all(records.iter().copied(), now);
    let (mut want_renewed, mut want_ignored) = (0, 0);
    for &(slot, nonce) in &records {
        match alone.renew_slot(slot, nonce, now) {
            Renewal::Unknown => want_ignored += 1,
            Renewal::Renewed | Renewal::Capped => want_renewed += 1,
        }
    }
    assert_eq!((renewed, ignored), (want_renewed, want_ignored));
    assert_eq!(batch.counters(), alone.counters());
    let (b, a) = (batch.counters(), alone.counters());
    assert!(
        b.renewed > 0 && b.renew_capped > 0 && b.renew_nonce_mismatch > 0 && b.renew_unknown > 0
    );
    assert_eq!((a.renewed, a.renew_capped), (b.renewed, b.renew_capped));
    for i in 0..48 {
        let id = format!("req-{i}");
        assert_eq!(batch.expiry(&id), alone.expiry(&id), "{id}");
    }
}
