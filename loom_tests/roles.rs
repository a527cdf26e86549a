//! loom model of the split P roles across threads, standing in for
//! processes: a P rank (its own thread) releases a lease and reports it over
//! "IPC" (a mutex cell carrying the real report bytes); the P scheduler
//! (another thread) applies the report, drains the release, and the engine
//! reuses the blocks and the slot; a decoder (a third thread) reads the
//! block, then the slot. In every interleaving, a decoder that sees its
//! nonce must have read the old block: the rank zeroes its slot *before*
//! the report can leave. `.ci/mutants.sh` runs this model with the
//! `zero_after_report` mutant and requires it to fail.
//!
//! Without `--cfg loom` the bodies run once on std threads (see
//! `support.rs`).
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --release --test loom_roles`

// Without loom, support.rs gives the std atomics (fine in tests: clippy.toml's
// rule is for the library; see src/sync.rs).
#![allow(clippy::disallowed_types)]

mod support;

use std::sync::Arc as StdArc;

use kvlease::{EngineShape, Instant, LeaseConfig, LeaseSlots, PrefillRank, PrefillScheduler};
use support::{model, thread, Arc, AtomicU64, Mutex, Ordering};

const OLD: u64 = 0xaaaa;
const NEW: u64 = 0xbbbb;

#[test]
fn verified_read_implies_the_rank_held_the_blocks() {
    model(|| {
        let mut config = LeaseConfig::new(EngineShape {
            num_kv_blocks: 1,
            max_num_seqs: 0,
        });
        config.lease_capacity = 2;
        let mut sched = PrefillScheduler::new(&config, 1, Instant::ZERO).unwrap();
        let slots = StdArc::new(LeaseSlots::new(config.lease_slots));
        let mut rank = PrefillRank::new(&config, 0, slots.clone(), Instant::ZERO).unwrap();
        let mut buf = vec![0u8; 4096];

        // The prefill ran: lease granted, the directive applied on the rank.
        let g = sched.grant("req-a", Instant::ZERO).unwrap();
        let lease = g.lease_fields().unwrap();
        let n = sched.encode_directives(Instant::ZERO, &mut buf).unwrap();
        rank.apply_directives(&buf[..n], Instant::ZERO).unwrap();
        let block = Arc::new(AtomicU64::new(OLD));

        // D: the block READ, then the slot READ.
        let decoder = {
            let block = block.clone();
            let slots = slots.clone();
            thread::spawn(move || {
                let kv = block.load(Ordering::Acquire);
                if slots.load(lease.slot) == Some(lease.nonce.get()) {
                    assert_eq!(kv, OLD, "verified a READ of reused blocks");
                }
            })
        };

        // The P rank's process: the last reader is done; release and report.
        let ipc: Arc<Mutex<Option<Vec<u8>>>> = Arc::new(Mutex::new(None));
        let worker = {
            let ipc = ipc.clone();
            thread::spawn(move || {
                rank.read_done(b"d0", b"req-a", 1, Some(lease.nonce));
                let mut out = vec![0u8; rank.max_reports_len()];
                let n = rank.encode_reports(&mut out).unwrap();
                out.truncate(n);
                *ipc.lock().unwrap() = Some(out);
                // A rank that zeroed late would do it here, after the report left.
                rank.poll(Instant::ZERO);
            })
        };

        // The P scheduler's process: the report arrives, the blocks are freed
        // and reused, the slot goes to the next request.
        let report = loop {
            if let Some(b) = ipc.lock().unwrap().take() {
                break b;
            }
            thread::yield_now();
        };
        sched.apply_reports(0, &report).unwrap();
        let mut ticket = None;
        sched.drain_released(|r| ticket = r.slot);
        block.store(NEW, Ordering::Release);
        sched.blocks_freed(ticket.expect("a verifiable lease has a slot"));
        let g2 = sched.grant("req-b", Instant::ZERO).unwrap();
        assert_eq!(
            g2.fields.map(|f| f.slot),
            Some(lease.slot),
            "the slot is reused"
        );

        worker.join().unwrap();
        decoder.join().unwrap();
    });
}

/// Two decoder workers read one P rank (D TP 2, P TP 1: two consumers), and
/// the first one's read-done arrives twice (a retried send). In every
/// interleaving the second decoder finds its nonce: the rank lets go only
/// after *each* reader reported, so a duplicate cannot stand in for a reader
/// still reading. `.ci/mutants.sh` runs this model with the
/// `count_per_rank` mutant (read-dones counted per rank) and requires it to
/// fail.
#[test]
fn a_duplicated_read_done_never_frees_under_a_second_reader() {
    model(|| {
        let mut config = LeaseConfig::new(EngineShape {
            num_kv_blocks: 1,
            max_num_seqs: 0,
        });
        config.lease_capacity = 1;
        let slots = StdArc::new(LeaseSlots::new(config.lease_slots));
        let mut rank = PrefillRank::new(&config, 0, slots.clone(), Instant::ZERO).unwrap();
        let mut sched = PrefillScheduler::new(&config, 1, Instant::ZERO).unwrap();
        let mut buf = vec![0u8; 4096];
        let g = sched.grant("req-a", Instant::ZERO).unwrap();
        let lease = g.lease_fields().unwrap();
        let n = sched.encode_directives(Instant::ZERO, &mut buf).unwrap();
        rank.apply_directives(&buf[..n], Instant::ZERO).unwrap();
        let block = Arc::new(AtomicU64::new(OLD));
        // The read-dones on their way to the P rank, by sender.
        let inbox: Arc<Mutex<Vec<&'static [u8]>>> = Arc::new(Mutex::new(Vec::new()));

        // Decoder 0 finished long ago: its read-done, sent twice.
        inbox.lock().unwrap().push(b"d0");
        // Decoder 1: block READ, slot READ, then its read-done.
        let d1 = {
            let (block, slots, inbox) = (block.clone(), slots.clone(), inbox.clone());
            thread::spawn(move || {
                let kv = block.load(Ordering::Acquire);
                let held = slots.load(lease.slot) == Some(lease.nonce.get());
                assert!(held, "the lease was let go while decoder 1 was reading");
                assert_eq!(kv, OLD);
                inbox.lock().unwrap().push(b"d1");
            })
        };
        let dup = {
            let inbox = inbox.clone();
            thread::spawn(move || inbox.lock().unwrap().push(b"d0"))
        };

        // The P rank: apply the three notifications as they come, then report.
        let mut seen = 0;
        while seen < 3 {
            let next = inbox.lock().unwrap().pop();
            match next {
                Some(sender) => {
                    rank.read_done(sender, b"req-a", 2, Some(lease.nonce));
                    seen += 1;
                }
                None => thread::yield_now(),
            }
            if rank.pending_reports() > 0 {
                let mut out = vec![0u8; rank.max_reports_len()];
                let n = rank.encode_reports(&mut out).unwrap();
                sched.apply_reports(0, &out[..n]).unwrap();
                sched.drain_freed(|_| block.store(NEW, Ordering::Release));
            }
        }
        d1.join().unwrap();
        dup.join().unwrap();
        assert_eq!(sched.held(), 0, "released once both readers reported");
    });
}
