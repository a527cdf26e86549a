//! [`SplitMix64`]: the crate's one seeded generator, for the loopback
//! fabric's fault draws and for every randomised unit test, so that a
//! failure reproduces from its seed.
//!
//! SplitMix64 (Steele, Lea, Flood 2014) is tiny, fast and good enough to
//! pick faults and test inputs. It is not for anything adversarial (nonces
//! come from `nonce.rs`, keyed from the OS).
//!
//! Integration tests, benches and the fuzz harnesses reach it as
//! `kvlease::testkit::SplitMix64` (feature `testkit`), so the whole tree
//! has one test generator.

/// A SplitMix64 stream. See the module docs.
#[derive(Clone, Copy, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A stream starting from `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// A draw in `0..n` (`n > 0`; the modulo bias is irrelevant at test
    /// sizes).
    #[cfg_attr(not(any(test, feature = "testkit")), allow(dead_code))]
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        self.next_u64() % n.max(1)
    }

    /// Folds `v` into the state: a keyed stream for (seed, v1, v2, ...).
    pub fn absorb(mut self, v: u64) -> SplitMix64 {
        self.0 = mix64(self.0 ^ mix64(v.wrapping_add(0xD1B5_4A32_D192_ED03)));
        self
    }
}

/// SplitMix64's finaliser.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_reproduce_and_differ_by_seed_and_key() {
        let draw = |mut r: SplitMix64| (0..4).map(|_| r.next_u64()).collect::<Vec<_>>();
        assert_eq!(draw(SplitMix64::new(7)), draw(SplitMix64::new(7)));
        assert_ne!(draw(SplitMix64::new(7)), draw(SplitMix64::new(8)));
        assert_ne!(
            draw(SplitMix64::new(7).absorb(1)),
            draw(SplitMix64::new(7).absorb(2))
        );
        let mut r = SplitMix64::new(3);
        assert!((0..1000).all(|_| r.below(10) < 10));
    }
}
