//! Proof of the step contract for the split P roles: after construction,
//! 50,000 engine steps of a scheduler and two ranks that talk only through
//! role-message bytes (directives encoded and decoded, reports encoded and
//! decoded), with assigns, starts, grants, cancels, text, compact and packed
//! heartbeats that reach one rank or both, read-dones, expiries, drains and
//! slot reuse, directive messages lost to rank 1 and the scheduler's
//! backstop probing what they left unanswered, make exactly 0 heap
//! allocations.
//!
//! The counting allocator (tests/support/counting_alloc.rs) counts only on
//! the thread that armed it.

use std::sync::Arc;
use std::time::Duration;

use kvlease::testkit::{p_side_config, SplitMix64};
use kvlease::{
    EngineShape, Instant, LeaseConfig, LeaseSlots, PrefillRank, PrefillScheduler, SlotTicket,
};

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{count_allocs, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const STEPS: u64 = 50_000;
const IDS: usize = 1024;

#[test]
fn split_p_roles_allocate_nothing_after_construction() {
    // --- construction: allowed to allocate ---
    let config = p_side_config(384, 512);
    let mut sched = PrefillScheduler::new(&config, 2, Instant::ZERO).unwrap();
    let mut ranks: Vec<PrefillRank> = (0..2)
        .map(|r| {
            PrefillRank::new(
                &config,
                r,
                Arc::new(LeaseSlots::new(config.lease_slots)),
                Instant::ZERO,
            )
            .unwrap()
        })
        .collect();
    let ids: Vec<String> = (0..IDS).map(|i| format!("cmpl-{i:032x}-0")).collect();
    let mut nonces = vec![None; IDS];
    let mut slots = vec![None; IDS];
    // Heartbeats as they come off the wire: 64 ids each, plus unknown ones
    // and an empty piece. Only the first quarter is heartbeated.
    let heartbeats: Vec<String> = ids[..IDS / 4]
        .chunks(64)
        .map(|c| format!("HB:{},unknown-a,,unknown-b", c.join(",")))
        .collect();
    let mut compact = vec![0u8; 4 + 24 * 64];
    let mut packed = vec![0u8; 4 + 16 * 64];
    let mut dir_buf = vec![0u8; 1 << 20];
    let mut rep_buf = vec![0u8; ranks[0].max_reports_len()];
    let mut read_done = [0u8; 128];
    let mut freed: Vec<SlotTicket> = Vec::with_capacity(4096);
    let mut reported = 0u64;

    // --- steady state: must not allocate ---
    counting_alloc::self_check();
    let ((), counts) = count_allocs(|| {
        let mut now = Instant::ZERO;
        let mut rng_gen = SplitMix64::new(0x2545_f491_4f6c_dd1du64);
        for step in 0..STEPS {
            now = now + Duration::from_millis(40);
            let rng = rng_gen.next_u64();
            let k = (rng % IDS as u64) as usize;
            let id = ids[k].as_str();
            // Scheduler side of the step.
            match step % 6 {
                0 | 1 => {
                    if let Ok(g) = sched.grant(id, now) {
                        nonces[k] = Some(g.nonce);
                        slots[k] = g.fields.map(|f| f.slot);
                    }
                }
                2 => {
                    if let Ok(a) = sched.assign(id, now) {
                        nonces[k] = Some(a.nonce);
                        slots[k] = a.fields.map(|f| f.slot);
                    }
                }
                3 => {
                    let _ = sched.start(id, now);
                }
                4 => {
                    sched.cancel(id);
                }
                _ => {}
            }
            sched.poll(now);
            let n = sched.encode_directives(now, &mut dir_buf).unwrap();
            // One directive message in 64 is lost on its way to rank 1.
            let lost_to_1 = (rng >> 8) % 64 == 0;
            // Worker side: directives, notifications, poll, reports.
            for (r, rank) in ranks.iter_mut().enumerate() {
                if !(r == 1 && lost_to_1) {
                    rank.apply_directives(&dir_buf[..n], now).unwrap();
                }
                // Half the heartbeats are lost on rank 1.
                if r == 0 || rng & 1 == 0 {
                    let hb = &heartbeats[k % heartbeats.len()];
                    let _ = rank.on_notification("d0", hb.as_bytes(), now);
                }
                if let (Some(s), Some(nonce)) = (slots[k], nonces[k]) {
                    compact[..4].copy_from_slice(b"HBC:");
                    let rec = format_compact(s, nonce.get());
                    for c in 0..64 {
                        compact[4 + 24 * c..4 + 24 * (c + 1)].copy_from_slice(&rec);
                    }
                    let _ = rank.on_notification("d0", &compact, now);
                    // The same records packed (`HBP:`), as the vLLM plugin's
                    // D sends them: encoded into a buffer, renewed in blocks.
                    let rec = kvlease::wire::CompactEntry { slot: s, nonce };
                    let max = packed.len();
                    let _ = kvlease::wire::encode_packed_heartbeats(
                        std::iter::repeat_n(rec, 64),
                        max,
                        &mut packed,
                        |m| {
                            let _ = rank.on_notification("d0", m, now);
                        },
                    );
                }
                if step % 7 == 0 {
                    if let Some(nonce) = nonces[k] {
                        let len =
                            kvlease::wire::encode_read_done(id, 1, Some(nonce), &mut read_done)
                                .unwrap();
                        let _ = rank.on_notification("d0", &read_done[..len], now);
                    }
                }
                let _ = rank.on_notification("d0", b"HBC:not-hex", now);
                let _ = rank.on_notification("d0", b"HBP:@@@@@@@@@@@@@@@\xff", now);
                rank.poll(now);
                let m = rank.encode_reports(&mut rep_buf).unwrap();
                sched.apply_reports(r as u32, &rep_buf[..m]).unwrap();
            }
            sched.drain_released(|rel| {
                reported += 1;
                if let Some(t) = rel.slot {
                    freed.push(t);
                }
            });
            if freed.len() > 16 {
                while let Some(t) = freed.pop() {
                    sched.blocks_freed(t);
                }
            }
        }
    });
    let (allocs, bytes) = (counts.allocs, counts.bytes);

    let c = sched.counters();
    let r0 = ranks[0].counters();
    let r1 = ranks[1].counters();
    assert!(c.granted > 5_000, "{c:?}");
    assert!(
        c.released_read > 100 && c.expired > 100 && c.cancelled > 100,
        "{c:?}"
    );
    assert!(c.slots_returned > 1_000, "{c:?}");
    assert!(c.backstop_probes > 10 && c.reports_not_held > 10, "{c:?}");
    assert!(
        r0.renewed > 10_000 && r0.heartbeat_empty_ids > 1_000,
        "{r0:?}"
    );
    assert!(
        r0.renewed > r1.renewed,
        "rank 1 lost heartbeats: {r0:?} {r1:?}"
    );
    assert!(
        r0.read_done > 100 && r0.directives_applied > 10_000,
        "{r0:?}"
    );
    assert_eq!(reported, c.reported);
    println!(
        "roles_alloc: {STEPS} steps of a scheduler and 2 ranks over bytes, {} grants, \
         {} expiries, {} directives, {} backstop probes: {allocs} allocations, {bytes} bytes",
        c.granted, c.expired, c.directives_sent, c.backstop_probes
    );
    assert_eq!((allocs, bytes), (0, 0), "steady-state role steps allocated");
}

/// One compact record, without allocating: 8 hex digits of slot, 16 of nonce.
fn format_compact(slot: u32, nonce: u64) -> [u8; 24] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 24];
    for i in 0..8 {
        out[i] = HEX[((slot >> (28 - 4 * i)) & 0xF) as usize];
    }
    for i in 0..16 {
        out[8 + i] = HEX[((nonce >> (60 - 4 * i)) & 0xF) as usize];
    }
    out
}

/// What `PrefillRank::new` reserves per lease entry (the slope between two
/// sizes, so fixed parts cancel), with 128-byte and 62-byte ids: the
/// figures `docs/embedding.md` gives ("Limits and degraded behaviour").
#[test]
fn rank_memory_per_entry_matches_the_docs() {
    let bytes = |n: u32, max_id_len: u16| {
        let mut c = LeaseConfig::new(EngineShape {
            num_kv_blocks: n,
            max_num_seqs: 0,
        });
        c.max_request_id_len = max_id_len;
        c.validate().unwrap();
        let slots = Arc::new(LeaseSlots::new(c.lease_slots));
        let (rank, counts) = count_allocs(|| PrefillRank::new(&c, 0, slots, Instant::ZERO));
        drop(rank);
        counts.bytes
    };
    // Entries = kv_lease_slots + kv_lease_capacity = 2n here.
    let per_entry = |id_len| (bytes(2 * 65_536, id_len) - bytes(65_536, id_len)) as f64 / 131_072.0;
    let (p128, p62) = (per_entry(128), per_entry(62));
    println!("rank memory: {p128} B/entry (128-byte ids), {p62} B/entry (62-byte ids)");
    // docs/embedding.md, "Limits": about 266 B per entry with 128-byte ids, 200 B with
    // ids of at most 62 bytes (the slot arrays are the engine's, not counted).
    assert!((260.0..=272.0).contains(&p128), "{p128} B per entry");
    assert!((194.0..=206.0).contains(&p62), "{p62} B per entry");
}

/// What `PrefillScheduler::new` reserves per lease entry (the slope between
/// two sizes, two ranks), with 128-byte ids: the figure `docs/embedding.md`
/// gives ("Limits and degraded behaviour"). Its backstop (a timer-wheel
/// entry and a set cell per lease) is part of it.
#[test]
fn scheduler_memory_per_entry_matches_the_docs() {
    let bytes = |n: u32| {
        let c = LeaseConfig::new(EngineShape {
            num_kv_blocks: n,
            max_num_seqs: 0,
        });
        c.validate().unwrap();
        let (sched, counts) = count_allocs(|| PrefillScheduler::new(&c, 2, Instant::ZERO));
        drop(sched);
        counts.bytes
    };
    // Entries = kv_lease_slots + kv_lease_capacity = 2n here.
    let per_entry = (bytes(2 * 65_536) - bytes(65_536)) as f64 / 131_072.0;
    println!("scheduler memory: {per_entry} B/entry (128-byte ids)");
    // docs/embedding.md, "Limits": about 250 B per entry.
    assert!(
        (244.0..=256.0).contains(&per_entry),
        "{per_entry} B per entry"
    );
}
