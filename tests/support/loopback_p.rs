//! P on the loopback network, as the D-side end-to-end tests deploy it:
//! one lease book over one slot array per P rank, and one agent per rank
//! (`prefill-a/{rank}`) that exports its rank's slots. What the tests do
//! with them (heartbeats, verification) stays in the tests.

use std::sync::Arc;

use kvlease::fabric::loopback::{LoopbackFabric, LoopbackNetwork};
use kvlease::fabric::Fabric;
use kvlease::slot_pool::SlotPool;
use kvlease::{Instant, LeaseBook, LeaseConfig, LeaseSlots, NonceSource};

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
