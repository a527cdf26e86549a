//! Which vLLM read-done semantics we match, end to end over the wire: each D
//! rank sends `<id>:<n>:nonce=...` to every P rank it read from, with
//! `n = TpMapping::consumers_per_p_rank()` (current vLLM's
//! `plan.local_consumers`: 1 when D TP <= P TP, D TP / P TP otherwise), and
//! the P lease book releases the lease with the very last of them, not
//! before. Also what happens with an older D that sends its world size.

use std::sync::Arc;

use kvlease::producer::ReadDoneOutcome;
use kvlease::topology::TpMapping;
use kvlease::wire;
use kvlease::{
    EngineShape, Instant, LeaseBook, LeaseConfig, LeaseSlots, Nonce, NonceSource, SlotPool,
};

/// A P engine with `p_tp` worker ranks, one lease book over all of them.
fn p_engine(p_tp: usize) -> LeaseBook {
    let config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 8,
        max_num_seqs: 8,
    });
    let arrays = (0..p_tp).map(|_| Arc::new(LeaseSlots::new(16))).collect();
    LeaseBook::with_parts(
        &config,
        arrays,
        Arc::new(SlotPool::new(16)),
        NonceSource::from_seed(4, 5, 6),
        Instant::ZERO,
    )
    .unwrap()
}

/// Every (D rank, P rank) read-done of one request, in D rank order, as
/// bytes, with the sending D worker's agent name.
fn read_dones(p_tp: u32, d_tp: u32, n: u32, id: &str, nonce: Nonce) -> Vec<(u32, String, Vec<u8>)> {
    let m = TpMapping::new(d_tp, p_tp).unwrap();
    let mut out = Vec::new();
    for d_rank in 0..d_tp {
        for p_rank in m.targets(d_rank).unwrap() {
            let mut buf = vec![0u8; id.len() + wire::MAX_READ_DONE_SUFFIX_LEN];
            let len = wire::encode_read_done(id, n, Some(nonce), &mut buf).unwrap();
            buf.truncate(len);
            out.push((p_rank, format!("decode-{d_rank}"), buf));
        }
    }
    out
}

#[test]
fn read_done_counts_match_current_vllm_for_p2_d2_p4_d2_p2_d4() {
    // (P TP, D TP, plan.local_consumers in current vLLM)
    for (p_tp, d_tp, local_consumers) in [(2u32, 2u32, 1u32), (4, 2, 1), (2, 4, 2)] {
        let m = TpMapping::new(d_tp, p_tp).unwrap();
        assert_eq!(m.consumers_per_p_rank(), local_consumers);
        let mut book = p_engine(p_tp as usize);
        let nonce = book.grant("cmpl-1-0", Instant::ZERO).unwrap().nonce;
        let msgs = read_dones(p_tp, d_tp, m.consumers_per_p_rank(), "cmpl-1-0", nonce);
        // Every P rank hears from exactly local_consumers D ranks.
        assert_eq!(msgs.len(), (p_tp * local_consumers) as usize);
        let last = msgs.len() - 1;
        for (i, (p_rank, from, msg)) in msgs.iter().enumerate() {
            let s = book
                .on_notification(*p_rank, from, msg, Instant::from_secs(1))
                .unwrap();
            let want = if i == last {
                ReadDoneOutcome::Released
            } else {
                ReadDoneOutcome::Counted
            };
            assert_eq!(s.read_done, Some(want), "P {p_tp} D {d_tp}, message {i}");
        }
        assert_eq!(book.held(), 0, "P {p_tp} D {d_tp}");
    }
}

/// An older vLLM D sent its world size: whenever that exceeds the per-rank
/// count, P waits for read-dones that never come and the lease is left to
/// expire (blocks freed late, never early).
#[test]
fn an_older_d_sending_its_world_size_leaves_the_lease_to_expire() {
    for (p_tp, d_tp) in [(4u32, 2u32), (2, 4)] {
        let mut book = p_engine(p_tp as usize);
        let nonce = book.grant("cmpl-1-0", Instant::ZERO).unwrap().nonce;
        for (p_rank, from, msg) in read_dones(p_tp, d_tp, d_tp, "cmpl-1-0", nonce) {
            let s = book
                .on_notification(p_rank, &from, &msg, Instant::from_secs(1))
                .unwrap();
            assert_eq!(s.read_done, Some(ReadDoneOutcome::Counted));
        }
        assert_eq!(book.held(), 1, "P {p_tp} D {d_tp}");
        book.poll(Instant::from_secs(31));
        assert_eq!(book.held(), 0, "expired after the 30 s lease");
        assert_eq!(book.counters().expired, 1);
    }
}

/// Issue 19 item 3. P TP 2 read by D TP 4: each P rank waits for two D
/// workers. Before, read-dones were counted per rank, so worker 0's
/// read-done arriving twice (a retried send) freed P rank 0's share while
/// worker 1 was still reading it; now each (sender, lease) counts once.
#[test]
fn a_duplicated_read_done_does_not_stand_in_for_another_reader() {
    let (p_tp, d_tp) = (2u32, 4u32);
    let mut book = p_engine(p_tp as usize);
    let nonce = book.grant("cmpl-1-0", Instant::ZERO).unwrap().nonce;
    let msgs = read_dones(p_tp, d_tp, 2, "cmpl-1-0", nonce);
    let (rank, from, msg) = &msgs[0];
    assert_eq!((*rank, from.as_str()), (0, "decode-0"));
    let at = Instant::from_secs(1);
    let first = book.on_notification(0, from, msg, at).unwrap();
    assert_eq!(first.read_done, Some(ReadDoneOutcome::Counted));
    let again = book.on_notification(0, from, msg, at).unwrap();
    assert_eq!(again.read_done, Some(ReadDoneOutcome::DuplicateSender));
    assert!(
        book.rank(0).unwrap().expiry("cmpl-1-0").is_some(),
        "rank 0 still holds"
    );
    assert_eq!(book.counters().read_done_duplicate_sender, 1);
    // The second reader of rank 0, then both of rank 1: released.
    let mut last = None;
    for (rank, from, msg) in &msgs[1..] {
        last = book
            .on_notification(*rank, from, msg, at)
            .unwrap()
            .read_done;
    }
    assert_eq!(last, Some(ReadDoneOutcome::Released));
    assert_eq!(book.held(), 0);
}
