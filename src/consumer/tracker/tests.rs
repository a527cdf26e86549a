use super::*;
use crate::rng::SplitMix64;
use crate::testkit::{d_side_config, remote_prefill};

fn config(requests: u32, engines: u32) -> LeaseConfig {
    d_side_config(64, 8, requests, engines, 32)
}

#[test]
fn chunks_stay_packed_under_churn() {
    let cfg = config(100, 3);
    let mut t = HeartbeatTracker::new(&cfg, 1).expect("tracker");
    let mut live: Vec<String> = Vec::new();
    let mut rng_gen = SplitMix64::new(0x9e37_79b9_7f4a_7c15u64);
    for i in 0..20_000u32 {
        let rng = rng_gen.next_u64();
        if rng % 3 != 0 && live.len() < 100 {
            let d = format!("d{i}");
            let p = format!("p{i}");
            let eng = format!("e{}", rng % 3);
            let params = remote_prefill(&eng, &p, "h", 1, 1);
            t.on_new_request(&d, &params, Instant::ZERO).unwrap();
            live.push(d);
        } else if !live.is_empty() {
            let d = live.swap_remove((rng >> 20) as usize % live.len());
            assert!(t.on_request_finished(&d));
        }
        assert_eq!(t.len() as usize, live.len());
        let total: usize = t.engines().map(|b| b.len()).sum();
        assert_eq!(total, live.len());
        for b in t.engines() {
            assert_eq!(b.positions().count(), b.len());
            assert_eq!(b.remotes().count(), b.len());
        }
        let used_chunks = (t.free_chunks.capacity() - t.free_chunks.len()) as usize;
        let want: usize = t.engines().map(|b| b.len().div_ceil(CHUNK)).sum();
        assert_eq!(used_chunks, want);
        // Ids move with their members: every request still finds its own.
        for d in &live {
            let p = t.remote_of(d).unwrap().remote_request_id;
            assert_eq!(&p[1..], &d[1..]);
        }
    }
    for d in &live {
        let p = t.remote_of(d).unwrap().remote_request_id;
        assert_eq!(&p[1..], &d[1..]);
    }
}
