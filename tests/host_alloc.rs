#![cfg(not(loom))]
//! The host fabric's steady step makes no heap allocation: the lease
//! verifier posting one slot READ per P rank, the host taking the READs,
//! performing them (here: a copy from the P's slot array, what NIXL does)
//! and reporting them, and the verdicts coming back. Counted by the
//! counting global allocator on this thread, hence a binary of its own.

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use kvlease::consumer::{LeaseVerifier, Verdict, VerifyTarget};
use kvlease::fabric::host::{HostConfig, HostFabric};
use kvlease::fabric::{Fabric, LeaseAdvert, PeerRecord, ReadDesc, RegionId, SlotRegion, XferId};
use kvlease::testkit::{publish_slot, verifier_config};
use kvlease::{Instant, LeaseFields, LeaseSlots};

#[global_allocator]
static ALLOC: counting_alloc::CountingAlloc = counting_alloc::CountingAlloc;

#[test]
fn a_steady_host_verifier_step_allocates_nothing() {
    let t0 = Instant::from_secs(1);
    let remotes: Vec<LeaseSlots> = (0..2).map(|_| LeaseSlots::new(256)).collect();
    let mut f = HostFabric::new("decode-0", HostConfig::for_verifier(64, 4, 16));
    let names = ["p0", "p1"];
    let agents: Vec<_> = names
        .iter()
        .zip(&remotes)
        .map(|(name, slots)| {
            let advert = LeaseAdvert {
                slots: Some(SlotRegion {
                    addr: 0,
                    len: slots.byte_len() as u64,
                    count: slots.len(),
                }),
                compact_heartbeats: false,
                packed_heartbeats: false,
            };
            let record = PeerRecord {
                agent_name: name,
                metadata: &[],
                advert: Some(advert),
                clock: None,
                regions: &[],
            };
            f.add_peer(&record, t0).unwrap()
        })
        .collect();
    let mut v = LeaseVerifier::new(&mut f, &verifier_config(64, 4)).unwrap();
    let targets: Vec<VerifyTarget> = agents
        .iter()
        .map(|&a| VerifyTarget::new(a, RegionId(0), 256))
        .collect();
    let mut posted: Vec<(XferId, usize, ReadDesc)> = Vec::with_capacity(64);
    let mut verified = 0u64;
    let mut step = |v: &mut LeaseVerifier, f: &mut HostFabric, round: u64| {
        let slot = (round % 200) as u32;
        let nonce = round + 1;
        for r in &remotes {
            publish_slot(r, slot, nonce);
        }
        let fields = LeaseFields::from_params(Some(slot), Some(nonce as i64));
        v.submit(round, fields, &targets).unwrap();
        v.step(f, t0, |_, _| {});
        posted.clear();
        f.take_posted(|r| {
            let who = usize::from(f_name_index(r.agent, &agents));
            for d in r.descs {
                posted.push((r.xfer, who, *d));
            }
        });
        for &(xfer, who, d) in &posted {
            let (addr, _) = f.local_region(d.local).unwrap();
            // SAFETY: in bounds of both registered regions (the verifier
            // built the descriptor from them); single-threaded, as NIXL's
            // completion is ordered before `complete`.
            unsafe {
                core::ptr::copy_nonoverlapping(
                    remotes[who].as_ptr().add(d.remote_offset as usize),
                    (addr as *mut u8).add(d.local_offset as usize),
                    d.len as usize,
                );
            }
            f.complete(xfer, Ok(()));
        }
        v.step(f, t0, |_, verdict| {
            assert_eq!(verdict, Verdict::Verified);
            verified += 1;
        });
    };
    for round in 0..100 {
        step(&mut v, &mut f, round);
    }
    let ((), counts) = counting_alloc::count_allocs(|| {
        for round in 100..10_100 {
            step(&mut v, &mut f, round);
        }
    });
    assert_eq!(
        (counts.allocs, counts.bytes),
        (0, 0),
        "steady host verifier steps allocated"
    );
    assert_eq!(verified, 10_100);
}

fn f_name_index(agent: kvlease::fabric::AgentId, agents: &[kvlease::fabric::AgentId]) -> u8 {
    agents.iter().position(|&a| a == agent).unwrap_or(0) as u8
}
