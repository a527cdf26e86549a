//! D's cache of finished turns over the P roles run in reverse: a fixed
//! `decoder_kv_blocks_ttl` term that no heartbeat extends, the exported
//! deadline, release by P's read-done or by expiry on every rank, and the
//! slot zeroed before the blocks are freed.

use std::sync::Arc;
use std::time::Duration;

use crate::support::free_released;
use kvlease::decoder_cache::{self, DecoderCacheScheduler};
use kvlease::{EngineShape, Instant, LeaseConfig, LeaseSlots, PrefillRank, ReleaseReason};

fn config(ttl: Duration) -> LeaseConfig {
    let mut c = LeaseConfig::new(EngineShape {
        num_kv_blocks: 16,
        max_num_seqs: 0,
    });
    c.decoder_kv_blocks_ttl = ttl;
    c
}

struct DSide {
    sched: DecoderCacheScheduler,
    ranks: Vec<PrefillRank>,
    meta: Vec<u8>,
    out: Vec<u8>,
    freed: Vec<(String, ReleaseReason)>,
}

impl DSide {
    fn new(ttl: Duration, ranks: u32) -> DSide {
        let c = config(ttl);
        let sched = DecoderCacheScheduler::new(&c, ranks, Instant::ZERO).unwrap();
        let ranks: Vec<PrefillRank> = (0..ranks)
            .map(|r| {
                decoder_cache::new_cache_rank(
                    &c,
                    r,
                    Arc::new(LeaseSlots::new(c.lease_slots)),
                    Instant::ZERO,
                )
                .unwrap()
            })
            .collect();
        let out = vec![0u8; ranks[0].max_reports_len()];
        DSide {
            sched,
            ranks,
            meta: vec![0u8; 1 << 16],
            out,
            freed: Vec::new(),
        }
    }

    /// One engine step: directives out, each worker applies and polls, reports back, drain.
    fn step(&mut self, now: Instant) {
        let n = self
            .sched
            .scheduler_mut()
            .encode_directives(now, &mut self.meta)
            .unwrap();
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            rank.apply_directives(&self.meta[..n], now).unwrap();
            rank.poll(now);
            let m = rank.encode_reports(&mut self.out).unwrap();
            self.sched
                .scheduler_mut()
                .apply_reports(r as u32, &self.out[..m])
                .unwrap();
        }
        free_released(self.sched.scheduler_mut(), &mut self.freed);
    }
}

#[test]
fn blocks_are_kept_for_exactly_the_ttl_and_no_heartbeat_extends_them() {
    let ttl = Duration::from_millis(2_500);
    let mut d = DSide::new(ttl, 2);
    let t0 = Instant::from_secs(100);
    let kept = d.sched.keep("turn-1", t0).unwrap();
    assert_eq!(kept.expiry, t0 + ttl);
    assert_eq!(
        decoder_cache::expiry_time_param(kept.expiry),
        102.5,
        "remote_blocks_expiry_time in D's clock, float seconds"
    );
    let fields = kept.fields.expect("verification on, a slot free");
    d.step(t0);
    for rank in &d.ranks {
        assert_eq!(rank.slots().load(fields.slot), Some(fields.nonce.get()));
    }
    // A heartbeat (nobody should send one, but a peer might) renews nothing
    // past the fixed term.
    let hb = Instant::from_secs(102);
    for rank in &mut d.ranks {
        rank.on_notification("d0", b"HB:turn-1", hb).unwrap();
        assert_eq!(rank.expiry("turn-1"), Some(t0 + ttl));
    }
    d.step(t0 + Duration::from_millis(2_490));
    assert!(d.freed.is_empty());
    d.step(t0 + ttl + Duration::from_millis(10));
    assert_eq!(d.freed, [("turn-1".to_owned(), ReleaseReason::Expired)]);
    for rank in &d.ranks {
        assert_eq!(
            rank.slots().load(fields.slot),
            Some(0),
            "zeroed before freed"
        );
    }
    // The slot went back to the pool once the blocks were freed.
    assert_eq!(d.sched.scheduler().held(), 0);
}

#[test]
fn read_done_from_p_frees_early_and_a_stale_nonce_does_not() {
    let mut d = DSide::new(Duration::from_secs(480), 2);
    let t0 = Instant::from_secs(1);
    let kept = d.sched.keep("turn-1", t0).unwrap();
    let nonce = kept.fields.unwrap().nonce;
    d.step(t0);
    let stale = format!("turn-1:1:nonce={:016x}", nonce.get() ^ 1);
    let done = format!("turn-1:1:nonce={:016x}", nonce.get());
    for rank in &mut d.ranks {
        rank.on_notification("d0", stale.as_bytes(), t0).unwrap();
    }
    d.step(t0 + Duration::from_secs(1));
    assert!(d.freed.is_empty(), "a stale read-done frees nothing");
    // P's reader on rank 0 finished; rank 1's has not: still held.
    d.ranks[0]
        .on_notification("d0", done.as_bytes(), t0)
        .unwrap();
    d.step(t0 + Duration::from_secs(2));
    assert!(d.freed.is_empty(), "freed only when every rank let go");
    d.ranks[1]
        .on_notification("d0", done.as_bytes(), t0)
        .unwrap();
    d.step(t0 + Duration::from_secs(3));
    assert_eq!(d.freed, [("turn-1".to_owned(), ReleaseReason::ReadDone)]);
}

#[test]
fn without_verification_the_deadline_is_still_exported() {
    let mut c = config(Duration::from_secs(480));
    c.verification = false;
    let mut sched = DecoderCacheScheduler::new(&c, 1, Instant::ZERO).unwrap();
    let kept = sched.keep("turn-1", Instant::from_secs(3)).unwrap();
    assert_eq!(kept.fields, None);
    assert_eq!(kept.expiry, Instant::from_secs(483));
    assert_eq!(sched.ttl(), Duration::from_secs(480));
    // A second keep of the same id while held is refused, never a panic.
    assert!(sched.keep("turn-1", Instant::from_secs(4)).is_err());
}

#[test]
fn a_clock_message_reaching_a_rank_is_a_counted_no_op() {
    let mut d = DSide::new(Duration::from_secs(480), 1);
    let t0 = Instant::from_secs(1);
    let nonce = d.sched.keep("turn-1", t0).unwrap().fields.unwrap().nonce;
    d.step(t0);
    let rank = &mut d.ranks[0];
    for msg in [
        &b"CLKPING:00000000000000ff"[..],
        b"CLKPONG:00000000000000ff0000000000000001",
        b"CLKPING:garbage",
    ] {
        assert_eq!(rank.on_notification("d0", msg, t0), Ok(Default::default()));
    }
    assert_eq!(rank.counters().clock_messages, 3);
    assert_eq!(rank.counters().malformed_notifications, 0);
    assert_eq!(rank.held(), 1);
    // Other traffic is unaffected: P's read-done still releases.
    let done = format!("turn-1:1:nonce={:016x}", nonce.get());
    rank.on_notification("d0", done.as_bytes(), t0).unwrap();
    d.step(t0 + Duration::from_secs(1));
    assert_eq!(d.freed, [("turn-1".to_owned(), ReleaseReason::ReadDone)]);
}

#[test]
fn the_lease_book_counts_clock_messages_too() {
    let config = config(Duration::from_secs(480));
    let mut book = kvlease::LeaseBook::new(&config, Instant::ZERO);
    let msg = b"CLKPING:0000000000000001";
    assert!(book.on_notification(0, "d0", msg, Instant::ZERO).is_ok());
    assert_eq!(book.counters().clock_messages, 1);
    assert_eq!(book.counters().malformed_notifications, 0);
}
