//! P on the loopback network, as the D-side end-to-end tests deploy it:
//! one lease book over one slot array per P rank, and one agent per rank
//! (`prefill-a/{rank}`) that exports its rank's slots. What the tests do
//! with them (heartbeats, verification) stays in the tests.

use std::sync::Arc;

use kvlease::fabric::loopback::{LoopbackFabric, LoopbackNetwork};
use kvlease::fabric::Fabric;
use kvlease::slot_pool::SlotPool;
use kvlease::{Instant, LeaseBook, LeaseConfig, LeaseSlots, NonceSource, ReleaseReason};

/// The P engine's id (its agents are `{ENGINE}/{rank}`).
pub const ENGINE: &str = "prefill-a";

/// A book over `p_tp` ranks' slot arrays drawing from `nonces`, and the
/// ranks' agents on `net`, exporting their slots (`compact`: advertising
/// compact heartbeats).
pub fn loopback_p(
    net: &Arc<LoopbackNetwork>,
    config: &LeaseConfig,
    p_tp: u32,
    compact: bool,
    nonces: NonceSource,
    now: Instant,
) -> (LeaseBook, Vec<LoopbackFabric>) {
    let slots: Vec<_> = (0..p_tp)
        .map(|_| Arc::new(LeaseSlots::new(config.lease_slots)))
        .collect();
    let pool = Arc::new(SlotPool::new(config.lease_slots));
    let book = LeaseBook::with_parts(config, slots.clone(), pool, nonces, now).unwrap();
    let agents = slots
        .into_iter()
        .enumerate()
        .map(|(rank, s)| {
            let mut f = LoopbackFabric::join(net, &format!("{ENGINE}/{rank}")).unwrap();
            f.register_slots(s, compact).unwrap();
            f
        })
        .collect();
    (book, agents)
}

/// One P step at `now`: every rank's agent drains its notifications into
/// the book (`heard(rank, msg)` sees each one first; with `strict` the book
/// must accept every one), the book expires what is due, and each release
/// is recorded in `released` while the "engine" frees its blocks at once.
pub fn p_step(
    book: &mut LeaseBook,
    agents: &mut [LoopbackFabric],
    now: Instant,
    strict: bool,
    released: &mut Vec<(String, ReleaseReason, Instant)>,
    mut heard: impl FnMut(usize, &[u8]),
) {
    for (rank, agent) in agents.iter_mut().enumerate() {
        agent
            .drain_notifications(&mut |_from, msg| {
                heard(rank, msg);
                let applied = book.on_notification(rank as u32, _from, msg, now);
                if strict {
                    applied.unwrap();
                }
            })
            .unwrap();
    }
    book.poll(now);
    let mut tickets = Vec::new();
    book.drain_released(|r| {
        released.push((r.request_id.to_string(), r.reason, now));
        tickets.extend(r.slot);
    });
    for t in tickets {
        book.blocks_freed(t);
    }
}
