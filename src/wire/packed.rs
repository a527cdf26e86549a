//! The packed heartbeat (`HBP:`): the compact heartbeat's (slot, nonce)
//! records in 16 bytes of six-bit digits instead of 24 hex digits.
//!
//! This module owns the record's byte format, its SWAR encoder and decoder,
//! the body's validation and [`PackedEntries`]. The message-level rules
//! (prefix, classification, errors) are in the module docs of
//! [`crate::wire`], form 5.
//!
//! Why another form: at 100k leases a P renewing from `HBC:` spent most of
//! its heartbeat step decoding hex (about 9 ns a record: three 8-digit words
//! validated and folded, against about 2 ns for the renewal itself). A
//! six-bit digit is a byte with its top two bits fixed, so a body validates
//! with one fold over its words, and a record decodes with a dozen shifts
//! and masks per word, which LLVM vectorises over a block of records
//! ([`PackedEntries::next_block`]): about 2 ns a record with the validation
//! (`benches/roles.rs`, `roles_heartbeat_round`; docs/vllm.md, "What it
//! costs").
//!
//! # Record layout
//!
//! ```text
//!  byte   0    1    2   ...  15          every byte = 0x40 | d_k, d_k in 0..64
//!         d0   d1   d2  ...  d15         value V = sum d_k << 6k   (96 bits)
//!
//!  V bits  0 ..32   slot   (u32)
//!  V bits 32 ..96   nonce  (u64, never 0)
//!
//!  in two little-endian words:  lo = bytes 0..8  -> V bits  0..48
//!                               hi = bytes 8..16 -> V bits 48..96
//!  slot = lo48 & 0xffff_ffff    nonce = (lo48 >> 32) | (hi48 << 16)
//! ```
//!
//! Every byte is in `0x40..=0x7f` (`@`, `A`-`Z`, `[\]^_`` ` ``, `a`-`z`, `{|}~`
//! and DEL): ASCII, so valid UTF-8 on every transport (the NIXL Rust
//! binding refuses non-UTF-8 notifications), with no NUL, no `,` and no
//! `:`.

use super::{CompactEntry, WireError};
use crate::nonce::Nonce;

/// Prefix of a packed (slot, nonce) heartbeat: `HBP:`.
pub const PACKED_HEARTBEAT_PREFIX: &[u8] = b"HBP:";

/// Bytes of one packed heartbeat record: 16 six-bit digits.
pub const PACKED_RECORD_LEN: usize = 16;

/// The fixed top bits of every digit byte (`0x40` in each lane).
const LANES_40: u64 = 0x4040_4040_4040_4040;
/// The two top bits of each lane (01 in a digit byte).
const LANES_C0: u64 = 0xc0c0_c0c0_c0c0_c0c0;
/// The digit bits of each lane.
const LANES_3F: u64 = 0x3f3f_3f3f_3f3f_3f3f;

/// Eight six-bit digits (byte `k` = `0x40 | digit k`, least significant
/// first) folded into their 48-bit value. Meaningful only for valid digit
/// bytes; for others it returns some value without panicking.
#[inline(always)]
pub(super) fn fold48(x: u64) -> u64 {
    let v = x & LANES_3F;
    // Pairs: 16-bit lane = d0 | d1 << 6.
    let v = (v & 0x003f_003f_003f_003f) | ((v >> 2) & 0x0fc0_0fc0_0fc0_0fc0);
    // Quads: 32-bit lane = 12 bits | 12 bits << 12.
    let v = (v & 0x0000_0fff_0000_0fff) | ((v >> 4) & 0x00ff_f000_00ff_f000);
    // The word: 24 bits | 24 bits << 24.
    (v & 0x00ff_ffff) | ((v >> 8) & 0xffff_ff00_0000)
}

/// The inverse of [`fold48`]: the low 48 bits of `x` as eight digit bytes.
#[inline(always)]
pub(super) fn spread48(x: u64) -> u64 {
    let v = (x & 0x00ff_ffff) | ((x & 0xffff_ff00_0000) << 8);
    let v = (v & 0x0000_0fff_0000_0fff) | ((v & 0x00ff_f000_00ff_f000) << 4);
    let v = (v & 0x003f_003f_003f_003f) | ((v & 0x0fc0_0fc0_0fc0_0fc0) << 2);
    v | LANES_40
}

/// The record's two words (bytes 0..8 and 8..16, little-endian).
#[inline(always)]
fn words(r: &[u8; PACKED_RECORD_LEN]) -> (u64, u64) {
    let (lo, hi) = r.split_at(8);
    let w = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
    (w(lo), w(hi))
}

/// (slot, nonce bits) of a record of valid digit bytes.
#[inline(always)]
pub(super) fn decode_record(r: &[u8; PACKED_RECORD_LEN]) -> (u32, u64) {
    let (lo, hi) = words(r);
    let (lo, hi) = (fold48(lo), fold48(hi));
    (lo as u32, (lo >> 32) | (hi << 16))
}

/// A record's 16 bytes.
#[inline(always)]
pub(super) fn encode_record(e: CompactEntry) -> [u8; PACKED_RECORD_LEN] {
    let nonce = e.nonce.get();
    let lo = u64::from(e.slot) | ((nonce & 0xffff) << 32);
    let hi = nonce >> 16;
    let mut out = [0u8; PACKED_RECORD_LEN];
    let (a, b) = out.split_at_mut(8);
    a.copy_from_slice(&spread48(lo).to_le_bytes());
    b.copy_from_slice(&spread48(hi).to_le_bytes());
    out
}

/// Validates a packed body (after the prefix): at least one record, a whole
/// number of them, every byte a digit, no nonce 0.
pub(super) fn decode_packed(body: &[u8]) -> Result<PackedEntries<'_>, WireError> {
    if body.is_empty() {
        return Err(WireError::NoEntries);
    }
    if body.len() % PACKED_RECORD_LEN != 0 {
        return Err(WireError::Truncated);
    }
    // One branch-free fold over the records: every byte's top bits are 01
    // (`bad`), and no record's nonce (V bits 32..96) is 0 (`zero`). The
    // nonce of a record of valid digits is 0 exactly when digit 5's bits
    // 2..5 and digits 6..15 are 0, i.e. those bytes are 0x40.
    const NONCE_MASK_LO: u64 = 0xffff_3c00_0000_0000;
    const NONCE_ZERO_LO: u64 = 0x4040_0000_0000_0000;
    let (bad, zero) = body
        .chunks_exact(PACKED_RECORD_LEN)
        .filter_map(|r| r.first_chunk::<PACKED_RECORD_LEN>())
        .fold((0u64, false), |(bad, zero), r| {
            let (lo, hi) = words(r);
            let digits = ((lo & LANES_C0) ^ LANES_40) | ((hi & LANES_C0) ^ LANES_40);
            let nonce = ((lo & NONCE_MASK_LO) ^ NONCE_ZERO_LO) | (hi ^ LANES_40);
            (bad | digits, zero | (nonce == 0))
        });
    if bad != 0 {
        return Err(WireError::BadPackedDigit);
    }
    if zero {
        return Err(WireError::ZeroNonce);
    }
    Ok(PackedEntries { records: body })
}

/// The records of a validated packed heartbeat, in message order. Borrowed;
/// each record is decoded as it is yielded.
#[derive(Clone)]
pub struct PackedEntries<'a> {
    /// Records not yet yielded; validated, a multiple of 16 bytes long.
    records: &'a [u8],
}

impl<'a> PackedEntries<'a> {
    /// Records not yet yielded.
    pub fn len_hint(&self) -> usize {
        self.records.len() / PACKED_RECORD_LEN
    }

    /// True once every record has been yielded (a freshly decoded packed
    /// heartbeat is never empty).
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The records not yet yielded, as they appear on the wire.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.records
    }
}

impl PackedEntries<'_> {
    /// Decodes the next [`PackedBlock::CAPACITY`] records (fewer at the
    /// end) into `block`, and returns how many. A block at a time, the
    /// body's words folded in one loop that LLVM vectorises (two words an
    /// instruction on baseline x86-64): a P rank's renewal path takes
    /// records this way, about twice as fast as through the iterator.
    #[inline]
    pub fn next_block(&mut self, block: &mut PackedBlock) -> usize {
        let n = self.len_hint().min(PackedBlock::CAPACITY);
        let (head, rest) = self.records.split_at(n * PACKED_RECORD_LEN);
        for (w, b) in block.words.iter_mut().zip(head.chunks_exact(8)) {
            *w = fold48(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
        }
        self.records = rest;
        block.len = n;
        n
    }
}

/// Up to [`PackedBlock::CAPACITY`] records of a packed heartbeat, decoded
/// by [`PackedEntries::next_block`]. Fixed size, on the caller's stack.
#[derive(Clone, Debug)]
pub struct PackedBlock {
    /// Each record's two words, folded to 48 bits each (`lo`, `hi`).
    words: [u64; 2 * PackedBlock::CAPACITY],
    len: usize,
}

impl Default for PackedBlock {
    fn default() -> Self {
        PackedBlock {
            words: [0; 2 * PackedBlock::CAPACITY],
            len: 0,
        }
    }
}

impl PackedBlock {
    /// Records a block holds at most.
    pub const CAPACITY: usize = 32;

    /// Records decoded into this block.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the block holds no record.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The block's records as (slot, nonce bits), in message order. The
    /// nonces are never 0 (the body was validated).
    #[inline]
    pub fn records(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.words.chunks_exact(2).take(self.len).map(|w| match *w {
            [lo, hi] => (lo as u32, (lo >> 32) | (hi << 16)),
            _ => (0, 0),
        })
    }
}

impl Iterator for PackedEntries<'_> {
    type Item = CompactEntry;

    #[inline]
    fn next(&mut self) -> Option<CompactEntry> {
        let (rec, rest) = self.records.split_first_chunk::<PACKED_RECORD_LEN>()?;
        self.records = rest;
        let (slot, nonce) = decode_record(rec);
        // Validated by `decode_packed`: the nonce is not 0, so `?` only
        // keeps the iterator panic-free were that invariant ever broken.
        Some(CompactEntry {
            slot,
            nonce: Nonce::new(nonce)?,
        })
    }

    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.len_hint();
        (n, Some(n))
    }
}

impl ExactSizeIterator for PackedEntries<'_> {}
impl core::iter::FusedIterator for PackedEntries<'_> {}

impl PartialEq for PackedEntries<'_> {
    /// Equal when the records not yet yielded decode to the same values.
    fn eq(&self, other: &Self) -> bool {
        self.clone().eq(other.clone())
    }
}
impl Eq for PackedEntries<'_> {}

impl core::fmt::Debug for PackedEntries<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_list().entries(self.clone()).finish()
    }
}
