//! [`LandingWords`]: local words a READ lands in, owned jointly by the
//! reader and the fabric it is registered with.
//!
//! This module owns only the buffer and its atomic accessors. A reader (the
//! lease verifier) registers one with [`super::Fabric::register_landing`],
//! which hands the fabric a clone of the [`Arc`]: the words stay allocated
//! as long as either the reader or the fabric's registration needs them,
//! and are freed when both are gone. (The alternative, a buffer leaked for
//! the life of the process, is what this replaces.)
//!
//! Every access on the Rust side is atomic (`crate::sync`, so loom can
//! model it), and no Rust reference to a word's plain bytes ever exists, so
//! a READ that writes a word while the reader looks at another is not a
//! data race in Rust's sense. Readers still look at a word only after the
//! READ that writes it has completed.

use std::sync::Arc;

use crate::slots::SLOT_BYTES;
use crate::sync::{AtomicU64, Ordering};

/// Eight-byte words a READ lands in. See the module docs.
#[derive(Debug)]
pub struct LandingWords {
    words: Box<[AtomicU64]>,
}

impl LandingWords {
    /// `len` zeroed words (at least one: fabrics refuse empty regions),
    /// ready to share with a fabric.
    pub fn new(len: usize) -> Arc<LandingWords> {
        Arc::new(LandingWords {
            words: (0..len.max(1)).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Number of words.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// Never true: there is always at least one word.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// Word `i` as a completed READ left it (little-endian on the wire, as
    /// every lease word); 0 when `i` is out of range.
    #[inline]
    pub fn load(&self, i: usize) -> u64 {
        self.words
            .get(i)
            .map_or(0, |w| u64::from_le(w.load(Ordering::Acquire)))
    }

    /// Zeroes word `i` before a READ targets it, so that a fabric that
    /// reports a READ done without writing cannot leave an earlier value to
    /// be compared. Relaxed: the READ's posting orders it.
    #[inline]
    pub fn reset(&self, i: usize) {
        if let Some(w) = self.words.get(i) {
            w.store(0, Ordering::Relaxed);
        }
    }

    /// Start of the words, for registration.
    pub fn as_ptr(&self) -> *const u8 {
        self.words.as_ptr().cast()
    }

    /// Bytes the words span, for registration.
    pub fn byte_len(&self) -> usize {
        self.words.len() * SLOT_BYTES
    }
}
