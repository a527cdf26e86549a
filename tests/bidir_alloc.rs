//! Proof of the step contract for bidirectional mode: after construction,
//! the clock-offset estimator (samples folded in, deadlines checked), the
//! clock ping/pong (encode, decode, match) and D's
//! cache of finished turns (keep, directives, expiry on the ranks, P's
//! read-dones, reports, drain, slot reuse) make exactly 0 heap allocations.
//!
//! The counting allocator (tests/support/counting_alloc.rs) counts only on
//! the thread that armed it, so the harness's own threads cannot disturb it.

use core::time::Duration;

use std::sync::Arc;

use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig, ReadGate};
use kvlease::clock_ping::{self, ClockMessage, ClockPinger};
use kvlease::decoder_cache::{self, DecoderCacheScheduler};
use kvlease::fabric::ClockSample;
use kvlease::testkit::SplitMix64;
use kvlease::{EngineShape, Instant, LeaseConfig, LeaseSlots, PrefillRank, SlotTicket};

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{count_allocs, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const STEPS: u64 = 100_000;

#[test]
fn offset_estimator_allocates_nothing() {
    let mut est = ClockOffset::new(ClockOffsetConfig::default());
    let mut pinger = ClockPinger::new(42, Duration::from_secs(1));
    let (mut ping, mut pong) = ([0u8; clock_ping::PING_LEN], [0u8; clock_ping::PONG_LEN]);
    counting_alloc::self_check();
    let ((reads, declines), counts) = count_allocs(|| {
        let mut rng_gen = SplitMix64::new(0x2545_f491_4f6c_dd1du64);
        let (mut reads, mut declines) = (0u64, 0u64);
        for step in 0..STEPS {
            let rng = rng_gen.next_u64();
            let now = Instant::from_millis(10_000 + step * 20);
            if step % 64 == 0 {
                let rtt = 1 + rng % 5_000_000;
                est.observe(ClockSample {
                    local_send: now - Duration::from_nanos(rtt),
                    remote: now + Duration::from_secs(1_000),
                    local_recv: now,
                });
            } else if pinger.due(now) {
                // A re-sample over the fabric: ping, D answers, pong folded in.
                let n = pinger.ping(now, &mut ping).unwrap();
                let Some(Ok(ClockMessage::Ping { token })) = clock_ping::decode(&ping[..n]) else {
                    panic!("ping does not decode");
                };
                let d_now = now + Duration::from_secs(1_000) + Duration::from_micros(rng % 900);
                let m = clock_ping::encode_pong(token, d_now, &mut pong).unwrap();
                if let Some(Ok(ClockMessage::Pong { token, remote })) =
                    clock_ping::decode(&pong[..m])
                {
                    if let Some(sample) =
                        pinger.on_pong(token, remote, now + Duration::from_millis(1))
                    {
                        est.observe(sample);
                    }
                }
            }
            // Deadlines from already past to 30 s away, on D's clock.
            let deadline = now + Duration::from_secs(1_000) + Duration::from_millis(rng % 30_000)
                - Duration::from_secs(5);
            match est.check_read(Some(deadline), now) {
                ReadGate::Read => reads += 1,
                _ => declines += 1,
            }
        }
        (reads, declines)
    });
    assert!(reads > 10_000 && declines > 10_000, "{reads} {declines}");
    assert!(est.counters().adopted > 10, "{:?}", est.counters());
    assert!(pinger.counters().samples > 1_000, "{:?}", pinger.counters());
    println!(
        "bidir_alloc: {STEPS} estimator steps: {} allocations, {} bytes",
        counts.allocs, counts.bytes
    );
    assert_eq!((counts.allocs, counts.bytes), (0, 0));
}

#[test]
fn decoder_ttl_steps_allocate_nothing() {
    const RANKS: u32 = 2;
    let mut config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 512,
        max_num_seqs: 0,
    });
    config.decoder_kv_blocks_ttl = Duration::from_secs(8);
    let mut sched = DecoderCacheScheduler::new(&config, RANKS, Instant::ZERO).unwrap();
    let mut ranks: Vec<PrefillRank> = (0..RANKS)
        .map(|r| {
            let slots = Arc::new(LeaseSlots::new(config.lease_slots));
            decoder_cache::new_cache_rank(&config, r, slots, Instant::ZERO).unwrap()
        })
        .collect();
    let ids: Vec<String> = (0..1024).map(|i| format!("chatcmpl-{i:032x}")).collect();
    // P's read-done for each id, filled in when the id is kept (nonce known).
    let mut done: Vec<Vec<u8>> = ids.iter().map(|id| vec![0u8; id.len() + 64]).collect();
    let mut done_len = vec![0usize; ids.len()];
    let mut meta = vec![0u8; 1 << 20];
    let mut out = vec![0u8; ranks[0].max_reports_len()];
    let mut tickets: Vec<SlotTicket> = Vec::with_capacity(2048);
    let (mut expired, mut read) = (0u64, 0u64);

    counting_alloc::self_check();
    let ((), counts) = count_allocs(|| {
        let mut rng_gen = SplitMix64::new(0x9e37_79b9_7f4a_7c15u64);
        for step in 0..STEPS {
            let now = Instant::from_millis(step * 20);
            let rng = rng_gen.next_u64();
            let i = (rng % ids.len() as u64) as usize;
            // Request i finished decoding: keep its blocks (refused while held).
            if let Ok(kept) = sched.keep(&ids[i], now) {
                if let Some(f) = kept.fields {
                    done_len[i] =
                        kvlease::wire::encode_read_done(&ids[i], 1, Some(f.nonce), &mut done[i])
                            .unwrap();
                }
            }
            // P read another one on every rank (half of what was kept).
            let j = ((rng >> 20) % ids.len() as u64) as usize;
            let n = sched
                .scheduler_mut()
                .encode_directives(now, &mut meta)
                .unwrap();
            for (r, rank) in ranks.iter_mut().enumerate() {
                rank.apply_directives(&meta[..n], now).unwrap();
                if j % 2 == 0 && done_len[j] > 0 {
                    let _ = rank.on_notification("d0", &done[j][..done_len[j]], now);
                }
                rank.poll(now);
                let m = rank.encode_reports(&mut out).unwrap();
                sched
                    .scheduler_mut()
                    .apply_reports(r as u32, &out[..m])
                    .unwrap();
            }
            sched.scheduler_mut().drain_released(|rel| {
                match rel.reason {
                    kvlease::ReleaseReason::Expired => expired += 1,
                    _ => read += 1,
                }
                if let Some(t) = rel.slot {
                    tickets.push(t);
                }
            });
            while let Some(t) = tickets.pop() {
                sched.scheduler_mut().blocks_freed(t);
            }
        }
    });
    assert!(expired > 1_000 && read > 1_000, "{expired} {read}");
    println!(
        "bidir_alloc: {STEPS} D cache steps ({expired} expired, {read} read): {} allocations, {} bytes",
        counts.allocs, counts.bytes
    );
    assert_eq!((counts.allocs, counts.bytes), (0, 0));
}
