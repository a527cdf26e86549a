//! [`LeaseLines`]: a P rank's per-lease state, laid out for the renewal
//! paths: a 16-byte head per lease for what every renewal touches, and a
//! 64-byte line for the id a lookup by id compares.
//!
//! A text heartbeat renews by request id: hash, one index cell, the line
//! (to compare the id), then the head. A compact or packed heartbeat renews
//! by (slot, nonce), and slot == entry (see `layout.rs`): the head alone, its
//! nonce compared and its deadline raised. Heads are four to a cache line,
//! so a heartbeat naming every lease streams through a quarter of the
//! memory a 64-byte line per lease would (at 100k leases, 1.6 MB instead of
//! 6.4 MB; when all of it was in one line, the renewal of a packed record
//! measured 2.2 ns, bound by that traffic). A renewal by id pays a second
//! miss instead (the head beside the line), which its pipeline prefetches
//! with the line.
//!
//! ```text
//!  LeaseHead (16 bytes, 16-aligned)             LeaseLine (64 bytes, 64-aligned)
//!   offset 0  deadline u64  ns on the rank's      offset 0  len_state u16  bits 15..14 state
//!                           clock; the lease                               (FREE, PINNED, HELD),
//!                           lapses at it                                   bits 13..0 id length
//!          8  nonce    u64  0 = the entry is free        2  id [u8; 62]    the id's first 62 bytes
//!
//!  tails: [u8; entries * (max_len - 62)]   bytes 62.. of longer ids
//! ```
//!
//! A head's nonce is 0 exactly when its line's state is FREE (`fill` and
//! `clear` write both), so the (slot, nonce) path never reads the line. 62
//! inline bytes hold vLLM's ids (`cmpl-<uuid>-0` is 43 bytes,
//! `chatcmpl-<uuid>` 45); a longer id costs a second line for its tail. The
//! deadline is authoritative here, not in the timing wheel: a renewal writes
//! only the head, and the rank re-places an entry whose wheel slot fires
//! before its deadline (lazy renewal, as `wheel/mod.rs` describes).

/// Id bytes stored in the line itself.
pub(crate) const INLINE_ID: usize = 62;

/// The entry holds no lease.
pub(crate) const FREE: u8 = 0;
/// Granted with its nonce published, lease not started (prefill running):
/// held, not on the wheel.
pub(crate) const PINNED: u8 = 1;
/// Held and timed.
pub(crate) const HELD: u8 = 2;

const LEN_BITS: u16 = 0x3FFF;

/// What every renewal of a lease reads and writes. See the module docs.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct LeaseHead {
    /// Nanoseconds on the rank's clock. PINNED: the floor renewals raised.
    pub(crate) deadline: u64,
    /// The lease's nonce; 0 when free (and only then).
    pub(crate) nonce: u64,
}

const _: () = assert!(core::mem::size_of::<LeaseHead>() == 16);

impl LeaseHead {
    const EMPTY: LeaseHead = LeaseHead {
        deadline: 0,
        nonce: 0,
    };
}

/// One lease's id and state. See the module docs.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct LeaseLine {
    len_state: u16,
    id: [u8; INLINE_ID],
}

const _: () = assert!(core::mem::size_of::<LeaseLine>() == 64);

impl LeaseLine {
    const EMPTY: LeaseLine = LeaseLine {
        len_state: 0,
        id: [0; INLINE_ID],
    };

    #[inline]
    pub(crate) fn state(&self) -> u8 {
        (self.len_state >> 14) as u8
    }

    #[inline]
    pub(crate) fn is_held(&self) -> bool {
        self.state() != FREE
    }

    #[inline]
    fn id_len(&self) -> usize {
        usize::from(self.len_state & LEN_BITS)
    }

    #[inline]
    pub(crate) fn set_state(&mut self, state: u8) {
        self.len_state = (self.len_state & LEN_BITS) | (u16::from(state) << 14);
    }
}

/// Every entry's head and line, plus the tails of long ids.
#[derive(Debug)]
pub(crate) struct LeaseLines {
    heads: Box<[LeaseHead]>,
    lines: Box<[LeaseLine]>,
    tails: Box<[u8]>,
    tail_len: usize,
}

impl LeaseLines {
    /// `entries` free lines, with room for ids of up to `max_len` bytes
    /// (at most 1024, what [`crate::config::limits`] allows).
    pub(crate) fn new(entries: u32, max_len: usize) -> LeaseLines {
        let max_len = max_len.min(usize::from(LEN_BITS));
        let tail_len = max_len.saturating_sub(INLINE_ID);
        LeaseLines {
            heads: vec![LeaseHead::EMPTY; entries as usize].into_boxed_slice(),
            lines: vec![LeaseLine::EMPTY; entries as usize].into_boxed_slice(),
            tails: vec![0; entries as usize * tail_len].into_boxed_slice(),
            tail_len,
        }
    }

    /// Lines in all.
    pub(crate) fn len(&self) -> u32 {
        self.lines.len() as u32
    }

    /// Entry `e`'s line, if `e` is in range.
    #[inline]
    pub(crate) fn get(&self, e: u32) -> Option<&LeaseLine> {
        self.lines.get(e as usize)
    }

    /// Entry `e`'s head, if `e` is in range.
    #[inline]
    pub(crate) fn head(&self, e: u32) -> Option<&LeaseHead> {
        self.heads.get(e as usize)
    }

    /// Entry `e`'s head, mutably, if `e` is in range.
    #[inline]
    pub(crate) fn head_mut(&mut self, e: u32) -> Option<&mut LeaseHead> {
        self.heads.get_mut(e as usize)
    }

    /// Entry `e`'s line and head, the head mutably (a Start directive reads
    /// the state and raises the deadline).
    #[inline]
    pub(crate) fn line_and_head_mut(&mut self, e: u32) -> Option<(&mut LeaseLine, &mut LeaseHead)> {
        Some((
            self.lines.get_mut(e as usize)?,
            self.heads.get_mut(e as usize)?,
        ))
    }

    /// Starts loading entry `e`'s line and head without waiting for them
    /// (the renewal by id, which compares the id and writes the deadline).
    #[inline]
    pub(crate) fn prefetch(&self, e: u32) {
        if let Some(l) = self.lines.get(e as usize) {
            crate::prefetch::prefetch(l);
        }
        self.prefetch_head(e);
    }

    /// Starts loading entry `e`'s head without waiting for it (the renewal
    /// by (slot, nonce), which touches nothing else).
    #[inline]
    pub(crate) fn prefetch_head(&self, e: u32) {
        if let Some(h) = self.heads.get(e as usize) {
            crate::prefetch::prefetch(h);
        }
    }

    /// Whether entry `e` holds a lease with exactly this id.
    #[inline]
    pub(crate) fn id_is(&self, e: u32, id: &[u8]) -> bool {
        let Some(line) = self.lines.get(e as usize) else {
            return false;
        };
        if line.id_len() != id.len() || !line.is_held() {
            return false;
        }
        let head = id.len().min(INLINE_ID);
        same_bytes(&line.id[..head], &id[..head])
            && (id.len() <= INLINE_ID || self.tail(e, id.len()) == &id[INLINE_ID..])
    }

    fn tail(&self, e: u32, len: usize) -> &[u8] {
        let start = e as usize * self.tail_len;
        self.tails
            .get(start..start + len.saturating_sub(INLINE_ID))
            .unwrap_or(&[])
    }

    /// Whether an id of `len` bytes fits.
    pub(crate) fn fits(&self, len: usize) -> bool {
        len <= INLINE_ID + self.tail_len
    }

    /// Makes entry `e` hold a lease: id (which must fit), nonce, state,
    /// deadline. Returns false when `e` is out of range or the id does not fit.
    pub(crate) fn fill(&mut self, e: u32, id: &[u8], nonce: u64, state: u8, deadline: u64) -> bool {
        if !self.fits(id.len()) || e >= self.len() {
            return false;
        }
        let head = id.len().min(INLINE_ID);
        if id.len() > INLINE_ID {
            let start = e as usize * self.tail_len;
            self.tails[start..start + id.len() - INLINE_ID].copy_from_slice(&id[INLINE_ID..]);
        }
        debug_assert!(nonce != 0 && state != FREE, "a held entry has a nonce");
        let line = &mut self.lines[e as usize];
        line.len_state = (u16::from(state) << 14) | id.len() as u16;
        line.id[..head].copy_from_slice(&id[..head]);
        self.heads[e as usize] = LeaseHead { deadline, nonce };
        true
    }

    /// Frees entry `e`.
    pub(crate) fn clear(&mut self, e: u32) {
        if let Some(line) = self.lines.get_mut(e as usize) {
            line.len_state = 0;
        }
        if let Some(head) = self.heads.get_mut(e as usize) {
            *head = LeaseHead::EMPTY;
        }
    }
}

/// `a == b` for two slices of the same length, up to [`INLINE_ID`] bytes
/// (an id's inline part), compared a word at a time: the last word overlaps
/// the one before it instead of ending in a byte loop. The slice `==` calls
/// `bcmp`, which cost the renewal by id a call per id.
#[inline(always)]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n < 8 {
        return a == b;
    }
    let word = |s: &[u8], at: usize| {
        let mut w = [0u8; 8];
        if let Some(b) = s.get(at..at + 8) {
            w.copy_from_slice(b);
        }
        u64::from_ne_bytes(w)
    };
    let mut at = 0;
    while at + 8 < n {
        if word(a, at) != word(b, at) {
            return false;
        }
        at += 8;
    }
    word(a, n - 8) == word(b, n - 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_bytes_is_slice_equality() {
        let a: Vec<u8> = (0..INLINE_ID as u8).map(|b| b.wrapping_mul(37)).collect();
        for n in 0..=INLINE_ID {
            assert!(same_bytes(&a[..n], &a[..n]), "{n}");
            for at in 0..n {
                let mut b = a[..n].to_vec();
                b[at] ^= 0x80;
                assert!(!same_bytes(&a[..n], &b), "{n}: byte {at}");
            }
            if n > 0 {
                assert!(!same_bytes(&a[..n], &a[..n - 1]), "{n}: lengths");
            }
        }
    }

    #[test]
    fn short_and_long_ids_round_trip() {
        let mut l = LeaseLines::new(3, 128);
        let long: Vec<u8> = (0..100u8).collect();
        assert!(l.fill(
            0,
            b"chatcmpl-0123456789abcdef0123456789abcdef0123",
            7,
            HELD,
            5
        ));
        assert!(l.fill(2, &long, 9, PINNED, 0));
        assert!(l.id_is(0, b"chatcmpl-0123456789abcdef0123456789abcdef0123"));
        assert!(!l.id_is(0, b"chatcmpl-0123456789abcdef0123456789abcdef012"));
        assert!(l.id_is(2, &long));
        let mut other = long.clone();
        other[99] = 0;
        assert!(!l.id_is(2, &other), "tails are compared");
        assert_eq!(l.get(2).map(LeaseLine::state), Some(PINNED));
        assert!(!l.fill(1, &[1; 129], 1, HELD, 0), "too long");
        assert!(!l.fill(3, b"x", 1, HELD, 0), "out of range");
        assert_eq!(l.head(0).map(|h| (h.deadline, h.nonce)), Some((5, 7)));
        assert_eq!(l.head(2).map(|h| h.nonce), Some(9));
        l.clear(0);
        assert!(!l.id_is(0, b"chatcmpl-0123456789abcdef0123456789abcdef0123"));
        assert!(!l.get(0).unwrap().is_held());
        assert_eq!(l.head(0).map(|h| h.nonce), Some(0), "free: nonce 0");
    }

    #[test]
    fn state_bits_leave_the_length_alone() {
        let mut l = LeaseLines::new(1, 1024);
        let id = vec![b'a'; 1024];
        assert!(l.fill(0, &id, 1, PINNED, 0));
        l.line_and_head_mut(0).unwrap().0.set_state(HELD);
        assert!(l.id_is(0, &id));
        assert_eq!(l.get(0).unwrap().state(), HELD);
    }
}
