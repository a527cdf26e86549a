//! What the lease benches share: inputs drawn from the crate's one seeded
//! test generator ([`SplitMix64`], `kvlease::testkit`), vLLM-style ids, a
//! book granted every id, and the naive baseline's reaper. Included with
//! `mod common;` by the benches that need part of it; all of it runs
//! outside the timed loops.
#![allow(dead_code)] // each bench uses part of it

use std::collections::HashMap;

use kvlease::testkit::SplitMix64;
use kvlease::{Instant, LeaseBook, LeaseConfig, LeaseFields};

/// A vLLM-style request id, `cmpl-<32 hex>-0` (39 bytes).
pub fn request_id(rng: &mut SplitMix64) -> String {
    format!("cmpl-{:016x}{:016x}-0", rng.next_u64(), rng.next_u64())
}

/// `<prefix>-xxxxxxxx-xxxx-4xxx-yxxx-xxxxxxxxxxxx-0`, a UUID-shaped id like
/// vLLM's, built from the 128 bits `a`, `b` (43 bytes with `cmpl`).
pub fn uuid_request_id(prefix: &str, a: u64, b: u64) -> String {
    format!(
        "{prefix}-{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}-0",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        (b >> 48) | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

/// `0..n` shuffled (Fisher-Yates).
pub fn permutation(n: u32, rng: &mut SplitMix64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
    v
}

/// Room for `n` leases, each with a slot (`n` blocks: as many slots).
pub fn lease_config(n: u32) -> LeaseConfig {
    kvlease::testkit::p_side_config(n, n)
}

/// A book that granted every id at `t0`, the baseline map holding the same
/// expiries, and each lease's fields (every lease gets a slot).
pub fn granted_book(
    cfg: &LeaseConfig,
    ids: &[String],
    t0: Instant,
) -> (LeaseBook, HashMap<String, Instant>, Vec<LeaseFields>) {
    let mut book = LeaseBook::new(cfg, t0);
    let mut map = HashMap::with_capacity(ids.len());
    let mut fields = Vec::with_capacity(ids.len());
    for id in ids {
        let g = book.grant(id, t0).expect("grant");
        fields.push(g.lease_fields().expect("a slot for every lease"));
        map.insert(id.clone(), g.expiry);
    }
    (book, map, fields)
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
