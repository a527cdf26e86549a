//! [`LeaseLines`]: a P rank's per-lease state, one cache line per lease,
//! laid out for the renewal path.
//!
//! A text heartbeat renews by request id: hash, one index cell, then the
//! lease. A compact heartbeat renews by (slot, nonce), and slot == entry
//! (see `layout.rs`). So everything a renewal reads or writes sits in one
//! 64-byte line per entry: the deadline it raises, the nonce a compact
//! renewal must match, and the id bytes a lookup compares. At 100k leases
//! each renewal is then one cache miss for the line (plus one for the index
//! cell by id), instead of the three of the first lease book (index cell, id
//! arena, wheel entry).
//!
//! ```text
//!  LeaseLine (64 bytes, 64-aligned)
//!   offset  0  deadline  u64   ns on the rank's clock; the lease lapses at it
//!           8  nonce     u64   0 = the entry is free
//!          16  len_state u16   bits 15..14 state (FREE, PINNED, HELD),
//!                              bits 13..0 id length (at most 1024)
//!          18  id        [u8; 46]  the id's first 46 bytes
//!
//!  tails: [u8; entries * (max_len - 46)]   bytes 46.. of longer ids
//! ```
//!
//! 46 inline bytes hold vLLM's ids (`cmpl-<uuid>-0` is 43 bytes,
//! `chatcmpl-<uuid>` 45); a longer id costs a second line for its tail. The
//! deadline is authoritative here, not in the timing wheel: a renewal writes
//! only this line, and the rank re-places an entry whose wheel slot fires
//! before its deadline (lazy renewal, as `wheel/mod.rs` describes).

/// Id bytes stored in the line itself.
pub(crate) const INLINE_ID: usize = 46;

/// The entry holds no lease.
pub(crate) const FREE: u8 = 0;
/// Granted with its nonce published, lease not started (prefill running):
/// held, not on the wheel.
pub(crate) const PINNED: u8 = 1;
/// Held and timed.
pub(crate) const HELD: u8 = 2;

const LEN_BITS: u16 = 0x3FFF;

/// One lease's line. See the module docs.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct LeaseLine {
    /// Nanoseconds on the rank's clock. PINNED: the floor renewals raised.
    pub(crate) deadline: u64,
    /// The lease's nonce; 0 when free.
    pub(crate) nonce: u64,
    len_state: u16,
    id: [u8; INLINE_ID],
}

const _: () = assert!(core::mem::size_of::<LeaseLine>() == 64);

impl LeaseLine {
    const EMPTY: LeaseLine = LeaseLine {
        deadline: 0,
        nonce: 0,
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

/// Every entry's line plus the tails of long ids.
#[derive(Debug)]
pub(crate) struct LeaseLines {
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

    /// Entry `e`'s line, mutably, if `e` is in range.
    #[inline]
    pub(crate) fn get_mut(&mut self, e: u32) -> Option<&mut LeaseLine> {
        self.lines.get_mut(e as usize)
    }

    /// Starts loading entry `e`'s line without waiting for it.
    #[inline]
    pub(crate) fn prefetch(&self, e: u32) {
        if let Some(l) = self.lines.get(e as usize) {
            crate::prefetch::prefetch(l);
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
        line.id[..head] == id[..head]
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
        let line = &mut self.lines[e as usize];
        line.deadline = deadline;
        line.nonce = nonce;
        line.len_state = (u16::from(state) << 14) | id.len() as u16;
        line.id[..head].copy_from_slice(&id[..head]);
        true
    }

    /// Frees entry `e`.
    pub(crate) fn clear(&mut self, e: u32) {
        if let Some(line) = self.lines.get_mut(e as usize) {
            line.nonce = 0;
            line.deadline = 0;
            line.len_state = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        l.clear(0);
        assert!(!l.id_is(0, b"chatcmpl-0123456789abcdef0123456789abcdef0123"));
        assert!(!l.get(0).unwrap().is_held());
    }

    #[test]
    fn state_bits_leave_the_length_alone() {
        let mut l = LeaseLines::new(1, 1024);
        let id = vec![b'a'; 1024];
        assert!(l.fill(0, &id, 1, PINNED, 0));
        l.get_mut(0).unwrap().set_state(HELD);
        assert!(l.id_is(0, &id));
        assert_eq!(l.get(0).unwrap().state(), HELD);
    }
}
