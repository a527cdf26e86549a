//! Arbitrary bytes into every P role-message decoder, as the receiving role
//! gets them from the engine's IPC: directives into a rank, reports into a
//! scheduler. Never a panic; whatever decodes re-encodes to the same bytes;
//! and a rank or scheduler fed garbage keeps its invariants (no lease is
//! created by a report, a refused message changes nothing, the backstop
//! that follows only queues directives).
//!
//! Input: `[selector byte][message bytes]`.
#![no_main]

use std::sync::Arc;

use kvlease::ipc::directive::{self, DirectiveMsg};
use kvlease::ipc::report::{self, ReportMsg};
use kvlease::{EngineShape, Instant, LeaseConfig, LeaseSlots, PrefillRank, PrefillScheduler};
use libfuzzer_sys::fuzz_target;

fn config() -> LeaseConfig {
    let mut c = LeaseConfig::new(EngineShape {
        num_kv_blocks: 8,
        max_num_seqs: 0,
    });
    c.lease_capacity = 8;
    c.max_request_id_len = 16;
    c
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, msg)) = data.split_first() else {
        return;
    };
    let config = config();
    let now = Instant::from_secs(1);
    if sel & 1 == 0 {
        // Directives into a rank.
        if let Ok(d) = DirectiveMsg::decode(msg) {
            let all: Vec<_> = d.iter().collect();
            assert_eq!(all.len() as u32, d.len());
            let mut again = vec![0u8; directive::encoded_len(all.iter().copied())];
            let n = directive::encode(&mut again, d.seq(), all.iter().copied())
                .expect("a decoded message re-encodes");
            assert_eq!(&again[..n], msg, "directives re-encode to the same bytes");
        }
        let slots = Arc::new(LeaseSlots::new(config.lease_slots));
        let mut rank = PrefillRank::new(&config, 0, slots.clone(), Instant::ZERO).unwrap();
        let held_before = rank.held();
        match rank.apply_directives(msg, now) {
            Ok(s) => assert!(rank.held() as u64 <= u64::from(held_before) + u64::from(s.applied)),
            Err(_) => assert_eq!(
                rank.held(),
                held_before,
                "a refused message changed the rank"
            ),
        }
        rank.poll(now + std::time::Duration::from_secs(3600));
        // Whatever was granted has expired or was never timed; pinned ones
        // still hold their slot, every other slot is zero.
        let mut buf = vec![0u8; rank.max_reports_len()];
        rank.encode_reports(&mut buf).expect("sized buffer");
    } else {
        // Reports into a scheduler with live leases.
        if let Ok(r) = ReportMsg::decode(msg) {
            let all: Vec<_> = r.iter().collect();
            let mut again = vec![0u8; report::encoded_len(r.len())];
            let n = report::encode(&mut again, r.rank(), r.seq(), all)
                .expect("a decoded message re-encodes");
            assert_eq!(&again[..n], msg, "reports re-encode to the same bytes");
        }
        let mut s = PrefillScheduler::new(&config, 2, Instant::ZERO).unwrap();
        for id in ["a", "b", "c"] {
            s.grant(id, Instant::ZERO).unwrap();
        }
        let mut buf = vec![0u8; 4096];
        s.encode_directives(Instant::ZERO, &mut buf).unwrap();
        let held = s.held();
        let _ = s.apply_reports(u32::from(sel >> 1) % 3, msg);
        assert!(s.held() <= held, "a report created a lease");
        assert_eq!(
            held - s.held(),
            s.pending_releases() as u32,
            "every lease that left was queued for the drain"
        );
        let mut n = 0;
        s.drain_released(|_| n += 1);
        assert_eq!(n as u32, held - s.held());
        // The backstop after garbage reports (the first poll stamps their
        // let-gos, the second is past every deadline): it may only queue
        // directives (every lease here was announced), never end a lease.
        let live = s.held();
        s.poll(now);
        let fired = s.poll(Instant::from_secs(1 << 20));
        assert_eq!(s.held(), live, "the backstop ended a lease by itself");
        assert!(fired <= live && (fired == 0 || s.pending_directives() > 0));
    }
});
