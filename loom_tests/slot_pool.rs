//! loom models of the lease-slot machinery: the lock-free slot pool under
//! concurrent take/give-back (including the ABA interleaving), and a decoder
//! reading a slot while P zeroes and re-grants it.
//!
//! Without `--cfg loom` the bodies run once on std threads (see
//! `support.rs`).
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --release --test loom_slots`

// Without loom, support.rs gives the std atomics (fine in tests: clippy.toml's
// rule is for the library; see src/sync.rs).
#![allow(clippy::disallowed_types)]

mod support;

use std::sync::Arc as StdArc;

use kvlease::{EngineShape, Instant, LeaseBook, LeaseConfig, SlotPool};
use support::{model, thread, Arc, AtomicU64, Ordering};

/// Every slot comes back exactly once, whatever the interleaving.
fn assert_pool_intact(pool: &SlotPool) {
    let mut got: Vec<u32> = std::iter::from_fn(|| pool.take())
        .map(|t| t.slot())
        .collect();
    got.sort_unstable();
    assert_eq!(
        got,
        (0..pool.capacity()).collect::<Vec<_>>(),
        "slot lost or duplicated"
    );
}

#[test]
fn concurrent_take_and_give_back() {
    model(|| {
        let pool = Arc::new(SlotPool::new(2));
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                thread::spawn(move || {
                    if let Some(t) = pool.take() {
                        pool.give_back(t);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        assert_pool_intact(&pool);
    });
}

/// The ABA interleaving: A reads head = x and next[x] = y; meanwhile B takes
/// x, takes y and gives x back. A's CAS must fail (the tag moved), or y
/// would be handed out twice.
#[test]
fn aba_cannot_hand_out_a_slot_twice() {
    model(|| {
        let pool = Arc::new(SlotPool::new(3));
        let a = {
            let pool = pool.clone();
            thread::spawn(move || pool.take())
        };
        let x = pool.take();
        let y = pool.take();
        if let Some(x) = x {
            pool.give_back(x);
        }
        let a_got = a.join().unwrap();
        if let (Some(a), Some(y)) = (&a_got, &y) {
            assert_ne!(a.slot(), y.slot(), "slot {} held twice", a.slot());
        }
        for t in [a_got, y].into_iter().flatten() {
            pool.give_back(t);
        }
        assert_pool_intact(&pool);
    });
}

/// D reads the block, then the slot. P meanwhile releases the lease (zeroes
/// the slot), lets the engine reuse the block, frees it and grants the slot
/// to the next request. If D sees the old nonce, it must have read the old
/// block contents: a matching nonce proves P held the blocks for the read.
#[test]
fn reader_sees_old_nonce_only_with_old_block() {
    const OLD: u64 = 0xaaaa;
    const NEW: u64 = 0xbbbb;
    model(|| {
        let mut config = LeaseConfig::new(EngineShape {
            num_kv_blocks: 1,
            max_num_seqs: 0,
        });
        config.lease_capacity = 2;
        let mut book = LeaseBook::new(&config, Instant::ZERO);
        let block = Arc::new(AtomicU64::new(OLD)); // prefill wrote the KV
        let g = book.grant("req-a", Instant::ZERO).unwrap();
        let kvlease::LeaseFields { slot, nonce } = g.lease_fields().unwrap();
        let slots: StdArc<_> = book.rank_slots(0).unwrap().clone();

        let reader = {
            let block = block.clone();
            thread::spawn(move || {
                let kv = block.load(Ordering::Acquire); // the block READ
                let seen = slots.load(slot); // then the slot READ
                if seen == Some(nonce.get()) {
                    assert_eq!(kv, OLD, "verified a READ of reused blocks");
                }
            })
        };

        // P: the lease ends (read-done from another reader, or expiry).
        book.read_done(0, "d0", b"req-a", 1, Some(nonce), Instant::ZERO);
        let mut ticket = None;
        book.drain_released(|r| ticket = r.slot);
        // The engine reuses the blocks for another request...
        block.store(NEW, Ordering::Release);
        // ...frees them, and the slot is granted again.
        book.blocks_freed(ticket.unwrap());
        let g2 = book.grant("req-b", Instant::ZERO).unwrap();
        assert_eq!(g2.fields.map(|f| f.slot), Some(slot));

        reader.join().unwrap();
    });
}
