//! [`Field`]: one bit field of a packed `u64`, the crate's one packing
//! helper (after sharded-slab's `Pack`, smaller).
//!
//! This module owns the arithmetic of packing; the layouts themselves live
//! with their words, each with its diagram in [`crate::design`] ("Packed
//! words"): the slot pool's head (`slot_pool`), an id-index cell (`ids`), a
//! loopback agent's advert word (`fabric::loopback`) and an [`XferId`]
//! (`fabric`).
//!
//! A field is `width` bits starting at bit `shift`. Everything is `const`
//! and inlines to one shift and one mask, so a layout written with fields
//! compiles to the same instructions as the hand-written shifts it replaced.
//!
//! [`XferId`]: crate::fabric::XferId

/// `width` bits of a `u64` starting at bit `shift`. See the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Field {
    shift: u32,
    width: u32,
}

impl Field {
    /// The field of `width` bits at bit `shift`. Panics at compile time
    /// (every layout is a `const`) if it does not fit in 64 bits.
    pub(crate) const fn new(shift: u32, width: u32) -> Field {
        assert!(
            width >= 1 && shift + width <= 64,
            "a field must fit in a u64"
        );
        Field { shift, width }
    }

    /// The field of `width` bits just above `below`.
    pub(crate) const fn above(below: Field, width: u32) -> Field {
        Field::new(below.shift + below.width, width)
    }

    /// Its bits, unshifted (`width` ones).
    #[inline]
    pub(crate) const fn max(self) -> u64 {
        u64::MAX >> (64 - self.width)
    }

    /// Its bits in place in the word.
    #[cfg(test)]
    pub(crate) const fn mask(self) -> u64 {
        self.max() << self.shift
    }

    /// The field's value in `word`.
    #[inline]
    pub(crate) const fn get(self, word: u64) -> u64 {
        (word >> self.shift) & self.max()
    }

    /// `v` (its low `width` bits) in place, the other bits 0.
    #[inline]
    pub(crate) const fn put(self, v: u64) -> u64 {
        (v & self.max()) << self.shift
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    /// Every layout the crate packs, as its fields from low to high bits.
    fn layouts() -> Vec<(&'static str, Vec<Field>)> {
        vec![
            ("slot pool head", crate::slot_pool::LAYOUT.to_vec()),
            ("id index cell", crate::ids::LAYOUT.to_vec()),
            ("XferId", crate::fabric::XFER_LAYOUT.to_vec()),
            (
                "loopback advert",
                crate::fabric::loopback::ADVERT_LAYOUT.to_vec(),
            ),
        ]
    }

    #[test]
    fn fields_round_trip_and_keep_to_their_bits() {
        let mut rng = SplitMix64::new(0x9ac4);
        for shift in 0..64 {
            for width in 1..=(64 - shift) {
                let f = Field::new(shift, width);
                assert_eq!(f.mask().count_ones(), width);
                assert_eq!(f.mask().trailing_zeros(), shift);
                for _ in 0..8 {
                    let v = rng.next_u64();
                    let word = rng.next_u64();
                    assert_eq!(f.get(f.put(v)), v & f.max());
                    assert_eq!(f.put(v) & !f.mask(), 0);
                    // Writing a field leaves the rest of a word alone.
                    let set = (word & !f.mask()) | f.put(v);
                    assert_eq!(set & !f.mask(), word & !f.mask());
                    assert_eq!(f.get(set), v & f.max());
                }
            }
        }
    }

    #[test]
    fn every_layout_tiles_its_word_without_overlap() {
        let mut rng = SplitMix64::new(7);
        for (name, fields) in layouts() {
            let mut covered = 0u64;
            for (i, f) in fields.iter().enumerate() {
                assert_eq!(covered & f.mask(), 0, "{name}: field {i} overlaps");
                if i > 0 {
                    assert_eq!(*f, Field::above(fields[i - 1], f.width), "{name}: gap");
                }
                covered |= f.mask();
            }
            assert_eq!(covered, u64::MAX, "{name}: the fields cover all 64 bits");
            // Packing every field and reading each back is the identity.
            for _ in 0..1000 {
                let vals: Vec<u64> = fields.iter().map(|f| rng.next_u64() & f.max()).collect();
                let word = fields.iter().zip(&vals).fold(0, |w, (f, v)| w | f.put(*v));
                for (f, v) in fields.iter().zip(&vals) {
                    assert_eq!(f.get(word), *v, "{name}");
                }
            }
        }
    }
}
