//! [`Nonce`]s and the [`NonceSource`] that makes them.
//!
//! A nonce names one lease for its whole life: P writes it into the lease
//! slot at grant, D reads it back after its READ and compares, and the
//! read-done notification carries it so that P can tell a late notification
//! for an earlier request with the same id from one for the current lease.
//!
//! Guarantees ([`crate::design`] invariant 2):
//! - **never 0**: 0 is what a free slot holds;
//! - **never repeated within one source's life**: the source walks a counter
//!   through a bijection of `u64`, so two draws differ until 2^64 draws;
//! - **unpredictable across restarts**: the bijection is keyed by 128 bits
//!   drawn from the OS (through std's `RandomState`, so no extra dependency),
//!   and the counter starts at a random offset, so a restarted P does not
//!   re-issue the nonces of its previous life (collision chance per pair of
//!   nonces is 2^-64).
//!
//! The bijection is `x -> mix(x ^ k0) ^ k1` where `mix` is the invertible
//! splitmix64 finaliser: every step of it (xor-shift, multiply by an odd
//! constant) is a bijection, so their composition is one too. It is not a
//! cryptographic PRP; an attacker who sees many nonces could in principle
//! learn the key. Nonces defend against stale reads, not against a malicious
//! peer on the fabric, which could read the slot array anyway.

use core::fmt;
use core::num::NonZeroU64;

/// A lease nonce: never zero.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Nonce(NonZeroU64);

impl Nonce {
    /// The smallest nonce; a placeholder for entries that hold no lease.
    pub const ONE: Nonce = match NonZeroU64::new(1) {
        Some(n) => Nonce(n),
        None => unreachable!(),
    };

    /// A nonce from its raw value; `None` for 0, which no lease ever has.
    pub const fn new(raw: u64) -> Option<Nonce> {
        match NonZeroU64::new(raw) {
            Some(n) => Some(Nonce(n)),
            None => None,
        }
    }

    /// The raw value, as written into a lease slot and onto the wire.
    pub const fn get(self) -> u64 {
        self.0.get()
    }
}

impl fmt::Debug for Nonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Nonce({:016x})", self.get())
    }
}

impl fmt::Display for Nonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.get())
    }
}

/// Issues nonces; one per lease book. See the module docs for the guarantees.
#[derive(Clone, Debug)]
pub struct NonceSource {
    counter: u64,
    k0: u64,
    k1: u64,
}

impl NonceSource {
    /// A source keyed from OS randomness: distinct on every construction.
    pub fn from_entropy() -> NonceSource {
        NonceSource::from_seed(entropy_u64(), entropy_u64(), entropy_u64())
    }

    /// A deterministic source (tests and the simulator). Distinct seeds do
    /// not guarantee disjoint outputs; only one source's own draws are
    /// guaranteed distinct.
    pub fn from_seed(start: u64, k0: u64, k1: u64) -> NonceSource {
        NonceSource {
            counter: start,
            k0,
            k1,
        }
    }

    /// The next nonce. O(1), no allocation.
    #[inline]
    pub fn next_nonce(&mut self) -> Nonce {
        loop {
            let x = self.counter;
            self.counter = self.counter.wrapping_add(1);
            // Exactly one counter value in 2^64 maps to 0; skip it.
            if let Some(n) = Nonce::new(mix(x ^ self.k0) ^ self.k1) {
                return n;
            }
        }
    }
}

/// splitmix64's finaliser: a bijection on u64.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 64 bits of OS randomness, via std's randomly keyed SipHash.
pub(crate) fn entropy_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x006b_766c_6561_7365); // any constant; the key is what is random
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn zero_is_not_a_nonce() {
        assert!(Nonce::new(0).is_none());
        assert_eq!(Nonce::new(7).map(Nonce::get), Some(7));
    }

    #[test]
    fn mix_is_injective_on_a_sample() {
        let mut seen = HashSet::new();
        for x in 0..200_000u64 {
            assert!(seen.insert(mix(x.wrapping_mul(0x9e37_79b9_7f4a_7c15))));
        }
    }

    #[test]
    fn a_source_never_repeats_and_never_yields_zero() {
        let mut s = NonceSource::from_seed(u64::MAX - 1000, 1, 2);
        let mut seen = HashSet::new();
        for _ in 0..100_000 {
            let n = s.next_nonce();
            assert_ne!(n.get(), 0);
            assert!(seen.insert(n), "repeated {n:?}");
        }
    }

    #[test]
    fn the_one_counter_value_that_maps_to_zero_is_skipped() {
        // mix(x ^ k0) ^ k1 == 0  <=>  x == inv_mix(k1) ^ k0. Choose k1 = mix(5), k0 = 0:
        // counter 5 would give 0.
        let mut s = NonceSource::from_seed(4, 0, mix(5));
        let a = s.next_nonce();
        let b = s.next_nonce();
        assert_eq!(a.get(), mix(4) ^ mix(5));
        assert_eq!(b.get(), mix(6) ^ mix(5), "counter 5 skipped");
    }

    #[test]
    fn entropy_sources_differ() {
        let a = NonceSource::from_entropy().next_nonce();
        let b = NonceSource::from_entropy().next_nonce();
        assert_ne!(a, b);
    }
}
