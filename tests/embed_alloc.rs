//! Proof of the step contract when kvlease is embedded in an engine's agent
//! (issue 12): the engine drains its agent once per step and routes each
//! notification to the P rank (`PrefillRank::on_notification`), keeping the
//! ones kvlease refuses. After construction, 20,000 such steps, with compact
//! and text heartbeats for every lease, the engine's own notifications mixed
//! in, and expiries polled, make exactly 0 heap allocations on the loopback
//! fabric. The peer was registered with `add_peer` from the engine's own
//! handshake message (the advert's bytes), not through a handshake of ours.
//!
//! (On NIXL the engine's drain itself allocates inside nixl-sys; the routing
//! into kvlease is this same code.)

use std::sync::Arc;
use std::time::Duration;

use kvlease::fabric::loopback::{LoopbackConfig, LoopbackFabric, LoopbackNetwork};
use kvlease::fabric::{Fabric, LeaseAdvert, PeerRecord};
use kvlease::wire::{self, CompactEntry};
use kvlease::{EngineShape, Instant, LeaseConfig, LeaseSlots, PrefillRank, PrefillScheduler};

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{count_allocs, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const STEPS: u64 = 20_000;
const LEASES: usize = 64;

#[test]
fn routing_the_engines_drain_into_kvlease_allocates_nothing() {
    counting_alloc::self_check();
    // --- construction: allowed to allocate ---
    let mut config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 256,
        max_num_seqs: 0,
    });
    config.lease_duration = Duration::from_secs(6);
    config.validate().unwrap();
    let net = LoopbackNetwork::new(LoopbackConfig::default());
    let mut now = Instant::from_secs(10);
    net.advance_to(now);
    let mut p = LoopbackFabric::join(&net, "p-engine").unwrap();
    let mut d = LoopbackFabric::join(&net, "d-engine").unwrap();
    let slots = Arc::new(LeaseSlots::new(config.lease_slots));
    p.register_slots(slots.clone(), true).unwrap();
    let mut sched = PrefillScheduler::new(&config, 1, now).unwrap();
    let mut rank = PrefillRank::new(&config, 0, slots, now).unwrap();
    // The engine's handshake message carries the advert's bytes.
    let advert_bytes = p.lease_advert().encode();
    let advert = LeaseAdvert::decode(&advert_bytes).unwrap();
    let to_p = d
        .add_peer(
            &PeerRecord {
                agent_name: "p-engine",
                metadata: &[],
                advert: Some(advert),
                clock: None,
                regions: &[],
            },
            now,
        )
        .unwrap();
    let ids: Vec<String> = (0..LEASES).map(|i| format!("req-{i:04}")).collect();
    let mut leases = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    for id in &ids {
        let g = sched.grant(id, now).unwrap();
        leases.push(g.lease_fields().unwrap());
    }
    let n = sched.encode_directives(now, &mut buf).unwrap();
    rank.apply_directives(&buf[..n], now).unwrap();
    let mut compact = Vec::new();
    wire::encode_compact_heartbeats(
        leases.iter().map(|l| CompactEntry {
            slot: l.slot,
            nonce: l.nonce,
        }),
        4096,
        &mut buf,
        |m| compact.push(m.to_vec()),
    )
    .unwrap();
    let text = format!("HB:{}", ids.join(","));
    let own: &[u8] = b"engine:block-table-update";

    // --- the steps: counted ---
    let (mut ours, mut engines, mut renewed) = (0u64, 0u64, 0u64);
    let (_, counts) = count_allocs(|| {
        for step in 0..STEPS {
            now = now + Duration::from_millis(10);
            net.advance_to(now);
            // D: one heartbeat per step (compact or text) and, now and then,
            // one of the engine's own notifications.
            let hb: &[u8] = if step % 2 == 0 {
                &compact[0]
            } else {
                text.as_bytes()
            };
            d.send_notification(to_p, hb).unwrap();
            if step % 7 == 0 {
                d.send_notification(to_p, own).unwrap();
            }
            // P's engine: one drain, each message routed to kvlease first.
            p.drain_notifications(
                &mut |_from, msg| match rank.on_notification("d0", msg, now) {
                    Ok(s) => {
                        ours += 1;
                        renewed += u64::from(s.renewed);
                    }
                    Err(_) => engines += 1,
                },
            )
            .unwrap();
            rank.poll(now);
            // D drains too, every step (nothing arrives).
            d.drain_notifications(&mut |_, _| {}).unwrap();
        }
    });
    assert_eq!(counts.allocs, 0, "{counts:?}");
    assert_eq!(counts.bytes, 0);
    assert_eq!(ours, STEPS);
    assert_eq!(engines, STEPS.div_ceil(7));
    assert_eq!(
        renewed,
        STEPS * LEASES as u64,
        "every heartbeat renewed every lease"
    );
    assert_eq!(
        rank.pending_reports(),
        0,
        "no lease expired while heartbeated"
    );
}
