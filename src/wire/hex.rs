//! SWAR hex and comma search over 8-byte words, for the decoders and
//! encoders of [`crate::wire`].
//!
//! The comma search stays ours rather than `memchr`'s: on 40-byte ids
//! memchr's setup costs more than it saves (heartbeat encoding +25 %,
//! decoding within noise, `benches/wire.rs`; `docs/benchmarks.md`).

use super::*;

// ---------------------------------------------------------------------------
// SWAR hex
//
// A hex field is processed 8 digits (one u64, loaded little-endian) at a time.
// Each byte is classified with carry-free range tests: on lanes whose high bit
// is clear, adding `0x80 - lo` sets the lane's high bit exactly when the lane
// is >= lo, and adding `0x7f - hi` leaves it clear exactly when the lane is
// <= hi; neither sum can exceed 0xff, so no lane carries into its neighbour.
// Bytes >= 0x80 are masked to 7 bits for the tests and rejected separately.
// The unit tests check every byte value in every lane against a scalar
// decoder.
// ---------------------------------------------------------------------------

pub(super) const LANES_01: u64 = 0x0101_0101_0101_0101;
pub(super) const LANES_80: u64 = 0x8080_8080_8080_8080;
/// Eight ASCII '0' digits, as loaded little-endian.
pub(super) const ASCII_ZEROS: u64 = LANES_01 * b'0' as u64;

pub(super) const fn splat(b: u8) -> u64 {
    LANES_01 * b as u64
}

/// The three 8-digit words of a record: slot, nonce high half, nonce low half.
#[inline(always)]
pub(super) fn record_words(r: &[u8; COMPACT_RECORD_LEN]) -> (u64, u64, u64) {
    (word::<0, 24>(r), word::<8, 24>(r), word::<16, 24>(r))
}

#[inline(always)]
pub(super) fn nonce_words(r: &[u8; NONCE_HEX_LEN]) -> (u64, u64) {
    (word::<0, 16>(r), word::<8, 16>(r))
}

/// Bytes `OFF..OFF+8` of `r`, little-endian. `OFF` is a constant, so the
/// indices are checked at compile time.
#[inline(always)]
pub(super) fn word<const OFF: usize, const N: usize>(r: &[u8; N]) -> u64 {
    u64::from_le_bytes([
        r[OFF],
        r[OFF + 1],
        r[OFF + 2],
        r[OFF + 3],
        r[OFF + 4],
        r[OFF + 5],
        r[OFF + 6],
        r[OFF + 7],
    ])
}

/// The index of the first `,` in `b`. Eight bytes a step: a lane of
/// `x ^ ",,,,,,,,"` is zero exactly where `x` has a comma, and
/// `(y - 0x01..) & !y & 0x80..` flags the lowest zero lane exactly (lanes
/// above a zero lane may be flagged spuriously by the borrow, but only the
/// lowest flag is used; little-endian, so lowest is first in memory).
#[inline]
pub(super) fn find_comma(b: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(chunk) = b.get(i..).and_then(<[u8]>::first_chunk::<8>) {
        let y = u64::from_le_bytes(*chunk) ^ splat(b',');
        let hit = y.wrapping_sub(LANES_01) & !y & LANES_80;
        if hit != 0 {
            return Some(i + (hit.trailing_zeros() / 8) as usize);
        }
        i += 8;
    }
    let tail = b.get(i..).unwrap_or_default();
    tail.iter().position(|&c| c == b',').map(|p| i + p)
}

/// Whether `b` contains a `,`. Unlike [`find_comma`] it needs no position,
/// so it ORs the flags of all words without a branch per word (the flag
/// formula is exact for "some lane is zero"), and covers a ragged tail by
/// re-reading the last 8 bytes. Twice as fast as `contains` on 40-byte ids.
#[inline]
pub(super) fn has_comma(b: &[u8]) -> bool {
    let flags = |w: &[u8; 8]| {
        let y = u64::from_le_bytes(*w) ^ splat(b',');
        y.wrapping_sub(LANES_01) & !y & LANES_80
    };
    let Some(last) = b.last_chunk::<8>() else {
        return b.contains(&b',');
    };
    let mut hit = flags(last);
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        if let Some(w) = w.first_chunk::<8>() {
            hit |= flags(w);
        }
    }
    hit != 0
}

/// Whether all 8 bytes of `x` are hex digits (either case).
#[inline(always)]
pub(super) fn hex8_valid(x: u64) -> bool {
    let ascii = !x & LANES_80;
    let v = x & !LANES_80;
    let ge = |v: u64, lo: u8| (v + splat(0x80 - lo)) & LANES_80;
    let le = |v: u64, hi: u8| !(v + splat(0x7f - hi)) & LANES_80;
    let digit = ge(v, b'0') & le(v, b'9');
    let folded = v | splat(0x20); // 'A'..'F' -> 'a'..'f'; digits unchanged
    let letter = ge(folded, b'a') & le(folded, b'f');
    (digit | letter) & ascii == LANES_80
}

/// The value of 8 hex digits (first byte most significant). Meaningful only
/// when [`hex8_valid`] holds; for other input it returns some value without
/// panicking.
#[inline(always)]
pub(super) fn hex8_value(x: u64) -> u32 {
    // Among hex digits, bit 6 is set exactly for the letters ('0'-'9' are
    // 0x30-0x39, 'A'-'F' 0x41-0x46, 'a'-'f' 0x61-0x66). Digit lanes: the low
    // nibble is the value. Letter lanes: the low nibble is 1..6, the value is
    // that + 9. Lanes stay below 0x20, so nothing carries.
    let letter = (x >> 6) & LANES_01;
    let nib = (x & splat(0x0f)) + letter * 9;
    // Pair up nibbles: byte 2k becomes (digit 2k << 4) | digit 2k+1.
    let pairs = ((nib << 4) | (nib >> 8)) & 0x00ff_00ff_00ff_00ff;
    // Gather bytes 0, 2, 4, 6 into the low 32 bits.
    let quads = (pairs | (pairs >> 8)) & 0x0000_ffff_0000_ffff;
    let le = (quads | (quads >> 16)) as u32;
    // Byte 0 holds the most significant digits.
    le.swap_bytes()
}

/// `v` as 8 lowercase hex digits, most significant first.
#[inline(always)]
pub(crate) fn encode_u32_hex(v: u32) -> [u8; 8] {
    // Spread the nibbles so that byte k holds nibble k (least significant
    // first), then reverse the bytes so that the most significant comes first.
    let mut x = u64::from(v);
    x = (x | (x << 16)) & 0x0000_ffff_0000_ffff;
    x = (x | (x << 8)) & 0x00ff_00ff_00ff_00ff;
    x = (x | (x << 4)) & 0x0f0f_0f0f_0f0f_0f0f;
    x = x.swap_bytes();
    // Lanes >= 10 get 'a' - 10 - '0' = 0x27 more on top of '0'.
    let letters = ((x + splat(0x06)) & splat(0x10)) >> 4;
    (x + splat(b'0') + letters * 0x27).to_le_bytes()
}

/// `v` as 16 lowercase hex digits, most significant first.
#[inline(always)]
pub(crate) fn encode_u64_hex(v: u64) -> [u8; NONCE_HEX_LEN] {
    let hi = encode_u32_hex((v >> 32) as u32);
    let lo = encode_u32_hex(v as u32);
    let mut out = [0u8; NONCE_HEX_LEN];
    let (a, b) = out.split_at_mut(8);
    a.copy_from_slice(&hi);
    b.copy_from_slice(&lo);
    out
}

/// The value of up to 16 hex digits (either case), scalar: for the short
/// fields of the rarer messages (clock pings, push records), where the SWAR
/// word decoders' fixed width does not fit. `None` on any other byte.
pub(crate) fn scalar_hex(digits: &[u8]) -> Option<u64> {
    digits.iter().try_fold(0u64, |acc, &c| {
        let v = (c as char).to_digit(16)?;
        Some((acc << 4) | u64::from(v))
    })
}
