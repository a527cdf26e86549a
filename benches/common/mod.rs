//! What the lease benches share: a deterministic RNG, vLLM-style ids, and the
//! naive baseline's reaper. Included by `benches/wheel.rs` and `benches/book.rs`.
#![allow(dead_code)] // each bench uses part of it

use std::collections::HashMap;

use kvlease::Instant;

/// xorshift64*: deterministic, dependency-free.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

/// A vLLM-style request id, `cmpl-<32 hex>-0` (39 bytes).
pub fn request_id(rng: &mut Rng) -> String {
    format!("cmpl-{:016x}{:016x}-0", rng.next(), rng.next())
}

/// `0..n` shuffled (Fisher-Yates).
pub fn permutation(n: u32, rng: &mut Rng) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
    v
}

/// The baseline's reaper: scan every entry, remove the expired ones, count them.
pub fn map_poll(map: &mut HashMap<String, Instant>, now: Instant) -> u64 {
    let mut expired = 0;
    map.retain(|_, t| {
        let keep = *t > now;
        expired += u64::from(!keep);
        keep
    });
    expired
}
