//! The simulated KV memory of one P worker, registered with its loopback
//! agent so that D's block READs copy real words.
//!
//! This module owns the one `unsafe` registration in the simulator. Each
//! block is one 8-byte word holding a tag of the request whose prefill last
//! wrote it ([`kv_tag`]); a D that reads a block after P reused it lands
//! another request's tag, which is how the simulator tells a silent
//! corruption from a good load without trusting any lease bookkeeping.

use std::sync::atomic::{AtomicU64, Ordering};

use kvlease::fabric::loopback::LoopbackFabric;
use kvlease::fabric::{Fabric, FabricError, RegionId};

/// The word a prefill of request `serial` writes into each of its blocks
/// on P rank `rank`: distinct per request and rank, never 0.
pub fn kv_tag(serial: u64, rank: u32) -> u64 {
    ((serial + 1) << 12) | u64::from(rank & 0xFFF)
}

/// A P worker's agent and the KV words registered with it.
///
/// Field order matters: `fabric` is dropped before `words`, and dropping a
/// loopback agent retires it (waiting out any copy in progress) so no READ
/// can touch the words once they are freed.
pub struct KvAgent {
    /// The worker's agent.
    pub fabric: LoopbackFabric,
    words: Box<[AtomicU64]>,
}

impl KvAgent {
    /// Registers `blocks` words (all 0) with `fabric` as its next region.
    pub fn new(
        mut fabric: LoopbackFabric,
        blocks: u32,
    ) -> Result<(KvAgent, RegionId), FabricError> {
        let words: Box<[AtomicU64]> = (0..blocks.max(1)).map(|_| AtomicU64::new(0)).collect();
        // SAFETY: the words are a boxed slice, so they never move; they stay
        // allocated until this KvAgent is dropped, and its `fabric` field is
        // dropped first (declaration order), which retires the agent before
        // the memory goes. Every Rust-side access is atomic, and words are
        // written only for blocks the engine just allocated, which no lease
        // covers and so no decoder may read (what a lease guarantees).
        let region = unsafe {
            fabric.register_memory(
                words.as_ptr() as *mut u8,
                std::mem::size_of_val::<[AtomicU64]>(&words),
            )?
        };
        Ok((KvAgent { fabric, words }, region))
    }

    /// The prefill of request `serial` wrote `blocks` on rank `rank`.
    pub fn write(&self, blocks: &[u32], serial: u64, rank: u32) {
        let tag = kv_tag(serial, rank).to_le();
        for &b in blocks {
            if let Some(w) = self.words.get(b as usize) {
                w.store(tag, Ordering::Release);
            }
        }
    }
}
