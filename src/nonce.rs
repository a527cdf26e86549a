//! [`Nonce`]s and the [`NonceSource`] that makes them.
//!
//! A nonce names one lease for its whole life: P writes it into the lease
//! slot at grant, D reads it back after its READ and compares, and the
//! read-done notification carries it so that P can tell a late notification
//! for an earlier request with the same id from one for the current lease.
//!
//! Guarantees ([`crate::design`] invariant 2):
//! - **never 0**: 0 is what a free slot holds;
//! - **below 2^53**: `remote_lease_nonce` travels in `kv_transfer_params`
//!   through the router, and routers that decode JSON numbers as float64
//!   (llm-d's Go sidecar decodes the dict into `map[string]any`; JavaScript
//!   proxies do the same) hand D the nearest double, which differs from an
//!   integer of 2^53 or more; every check of such a lease would then fail
//!   and every read-done be ignored as stale. Every integer below 2^53 is a
//!   double exactly, so drawn nonces (`1..2^53`) survive that round trip.
//!   Below 2^63 as well, so the seed's `int64` slot cell and a Python
//!   decoder's integer agree (signed and unsigned views are the same);
//! - **never repeated within one source's life**: the source walks a counter
//!   through a bijection of the 53-bit range, so two draws differ until 2^53
//!   draws (about 9 * 10^15: 285 years at a million leases a second);
//! - **unpredictable across restarts**: the bijection is keyed by 106 bits
//!   drawn from the OS (through std's `RandomState`, so no extra dependency),
//!   and the counter starts at a random offset, so a restarted P does not
//!   re-issue the nonces of its previous life (collision chance per pair of
//!   nonces is 2^-53; a stale read-done needs the same request id as well).
//!
//! The bijection is `x -> mix53(x ^ k0) ^ k1` on 53-bit values, where
//! `mix53` is splitmix64's finaliser rebuilt for 53 bits: a right xor-shift
//! of a 53-bit value stays in 53 bits and is invertible, and multiplying by
//! an odd constant is invertible modulo 2^53, so the composition is a
//! bijection of `0..2^53` (the shifts are scaled to the width; the test
//! `the_mix_structure_is_a_bijection_exhaustively` checks the same
//! construction on 16 bits, every input). It is not a cryptographic PRP; an
//! attacker who sees many nonces could in principle learn the key. Nonces
//! defend against stale reads, not against a malicious peer on the fabric,
//! which could read the slot array anyway.
//!
//! # Signedness on the wire
//!
//! A nonce is a 64-bit word: the slot cell holds it, `HBC:` and the
//! read-done's `nonce=<16 hex>` carry its bits. `remote_lease_nonce` in
//! `kv_transfer_params` is the seed's **signed int64**: kvlease writes only
//! positive values (below 2^53), and accepts any non-zero int64 from a
//! foreign P, taking its two's-complement bits ([`Nonce::from_int64`]), which
//! are exactly what that P's int64 slot cell holds. (A foreign P's nonce of
//! 2^53 or more is accepted too; whether it survives the router is that P's
//! concern.)

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

    /// A nonce from the seed's int64 form (`remote_lease_nonce`, or a P's
    /// int64 slot cell): its two's-complement bits. `None` for 0. A negative
    /// value from a foreign P is a valid nonce: its slot cell holds the same
    /// bits.
    pub const fn from_int64(v: i64) -> Option<Nonce> {
        Nonce::new(v as u64)
    }

    /// The seed's int64 form, for `remote_lease_nonce`: positive, and exact
    /// as a double, for every nonce a [`NonceSource`] draws (they are below
    /// 2^53).
    pub const fn as_int64(self) -> i64 {
        self.get() as i64
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
    /// guaranteed distinct. Only the low 53 bits of each seed count.
    pub fn from_seed(start: u64, k0: u64, k1: u64) -> NonceSource {
        NonceSource {
            counter: start & LOW53,
            k0: k0 & LOW53,
            k1: k1 & LOW53,
        }
    }

    /// The next nonce, in `1..2^53`. O(1), no allocation.
    #[inline]
    pub fn next_nonce(&mut self) -> Nonce {
        loop {
            let x = self.counter;
            self.counter = self.counter.wrapping_add(1) & LOW53;
            // Exactly one counter value in 2^53 maps to 0; skip it.
            if let Some(n) = Nonce::new(mix53(x ^ self.k0) ^ self.k1) {
                debug_assert!(n.get() <= LOW53);
                return n;
            }
        }
    }
}

/// The 53 bits a drawn nonce may use: every integer up to 2^53 is exactly a
/// double (module docs).
const LOW53: u64 = (1 << 53) - 1;

/// The xor-shifts of [`mix53`]: splitmix64's 30, 27 and 31, scaled from 64
/// to 53 bits. Any shift from 1 to 52 keeps the step invertible; these keep
/// the finaliser's mixing.
const SHIFTS53: [u32; 3] = [25, 22, 26];

/// splitmix64's finaliser modulo 2^53: a bijection on `0..2^53` (module
/// docs). The input must be below 2^53.
#[inline]
fn mix53(z: u64) -> u64 {
    debug_assert!(z <= LOW53);
    mix(z, LOW53, SHIFTS53)
}

/// The finaliser's structure on the low bits `mask` selects: xor-shift
/// right, multiply by an odd constant modulo the width, twice, then a last
/// xor-shift. Each step is a bijection of `0..=mask` for a `mask` of the form
/// `2^w - 1` and shifts in `1..w`.
#[inline]
fn mix(mut z: u64, mask: u64, [s0, s1, s2]: [u32; 3]) -> u64 {
    z = (z ^ (z >> s0)).wrapping_mul(0xbf58_476d_1ce4_e5b9) & mask;
    z = (z ^ (z >> s1)).wrapping_mul(0x94d0_49bb_1331_11eb) & mask;
    z ^ (z >> s2)
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
    fn the_mix_structure_is_a_bijection_exhaustively() {
        // mix53's construction on 16 bits, every input: a mask or a shift in
        // the wrong place loses bits and collides here.
        const MASK16: u64 = (1 << 16) - 1;
        let mut seen = vec![false; 1 << 16];
        for x in 0..=MASK16 {
            let y = mix(x, MASK16, [8, 7, 9]);
            assert!(y <= MASK16);
            assert!(!seen[y as usize], "{x} collides");
            seen[y as usize] = true;
        }
    }

    #[test]
    fn mix53_is_injective_on_a_sample_and_stays_in_53_bits() {
        let mut seen = HashSet::new();
        for x in 0..200_000u64 {
            let y = mix53(x.wrapping_mul(0x9e37_79b9_7f4a_7c15) & LOW53);
            assert!(y <= LOW53);
            assert!(seen.insert(y));
        }
    }

    #[test]
    fn mix53_is_a_bijection_on_a_small_window_of_high_bits() {
        // Inputs that differ only in bit 52 and the low bits: a finaliser that
        // dropped bit 52 on the way (a mask in the wrong place) collides here.
        let mut seen = HashSet::new();
        for hi in [0u64, 1 << 52] {
            for lo in 0..50_000u64 {
                assert!(seen.insert(mix53(hi | lo)));
            }
        }
    }

    #[test]
    fn a_source_never_repeats_never_yields_zero_and_stays_below_2_53() {
        // Starts next to the counter's wrap at 2^53.
        let mut s = NonceSource::from_seed(LOW53 - 1000, 1, 2);
        let mut seen = HashSet::new();
        for _ in 0..100_000 {
            let n = s.next_nonce();
            assert_ne!(n.get(), 0);
            assert!(n.get() < 1 << 53, "{n:?} is 2^53 or more");
            assert!(n.as_int64() > 0, "{n:?} is negative as int64");
            assert!(seen.insert(n), "repeated {n:?}");
        }
    }

    #[test]
    fn seeds_beyond_53_bits_draw_below_2_53() {
        let mut s = NonceSource::from_seed(u64::MAX, u64::MAX, u64::MAX);
        for _ in 0..1000 {
            assert!(s.next_nonce().get() <= LOW53);
        }
    }

    #[test]
    fn every_drawn_nonce_survives_a_float64_round_trip() {
        // What a router that decodes JSON numbers as float64 does to
        // remote_lease_nonce (llm-d's Go sidecar, JavaScript proxies): the
        // integer becomes the nearest double, then an integer again. Before
        // the 53-bit range, 2^63-range nonces came back changed (checked by
        // the second half).
        let mut s = NonceSource::from_entropy();
        for _ in 0..100_000 {
            let n = s.next_nonce();
            let through_f64 = n.as_int64() as f64;
            assert_eq!(
                through_f64 as i64,
                n.as_int64(),
                "{n:?} changed through f64"
            );
            assert_eq!(Nonce::from_int64(through_f64 as i64), Some(n));
        }
        // The hazard, shown: an integer above 2^53 does not survive.
        let big: i64 = (1 << 62) + 1;
        assert_ne!((big as f64) as i64, big);
    }

    #[test]
    fn entropy_nonces_fit_an_int64_slot_cell() {
        // The measurement: 10 of 16 exported nonces were >= 2^63.
        // Every one must now read back positive from an int64 cell.
        let mut s = NonceSource::from_entropy();
        for _ in 0..10_000 {
            let n = s.next_nonce();
            assert!(n.get() < 1 << 53);
            assert_eq!(Nonce::from_int64(n.as_int64()), Some(n));
        }
    }

    #[test]
    fn the_int64_form_takes_negative_values_by_their_bits() {
        let n = Nonce::from_int64(-5).unwrap();
        assert_eq!(n.get(), (-5i64) as u64);
        assert_eq!(n.as_int64(), -5);
        assert_eq!(Nonce::from_int64(0), None);
        assert_eq!(Nonce::from_int64(i64::MIN).map(Nonce::get), Some(1 << 63));
        // A foreign P's int64 beyond 2^53 is a nonce as well (reading side).
        let big = Nonce::from_int64(i64::MAX).unwrap();
        assert_eq!(big.as_int64(), i64::MAX);
    }

    #[test]
    fn the_one_counter_value_that_maps_to_zero_is_skipped() {
        // mix53(x ^ k0) ^ k1 == 0  <=>  x == inv(k1) ^ k0. Choose k1 = mix53(5),
        // k0 = 0: counter 5 would give 0.
        let mut s = NonceSource::from_seed(4, 0, mix53(5));
        let a = s.next_nonce();
        let b = s.next_nonce();
        assert_eq!(a.get(), mix53(4) ^ mix53(5));
        assert_eq!(b.get(), mix53(6) ^ mix53(5), "counter 5 skipped");
    }

    #[test]
    fn entropy_sources_differ() {
        let a = NonceSource::from_entropy().next_nonce();
        let b = NonceSource::from_entropy().next_nonce();
        assert_ne!(a, b);
    }
}
