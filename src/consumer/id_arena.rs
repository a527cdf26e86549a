//! [`IdArena`]: fixed-size slots of text, each holding one id, in a single
//! preallocated `String`.
//!
//! This module owns only the bytes of the ids and the rule that keeps them
//! valid UTF-8 without `unsafe`; which slot holds which request is the
//! tracker's business.
//!
//! Why a `String` and not `[u8]`: the tracker hands ids out as `&str` on its
//! hottest path, and re-validating UTF-8 there (std's `from_utf8`) cost
//! several times the whole per-request budget (measured with
//! `benches/tracker.rs`; figure in `docs/benchmarks.md`).
//! A `str` slice costs two char-boundary checks instead.
//!
//! The rule: the arena is full of NUL characters at construction, and a slot
//! always holds one whole id followed by NULs (or only NULs). Every write is
//! a `String::replace_range` whose range is `[slot start, end of the current
//! id or a point in its NUL padding)` and whose replacement has exactly that
//! length, so both ends are char boundaries, the string's length never
//! changes and it never reallocates (`tests/consumer_alloc.rs` checks the
//! latter under load).

use crate::config::limits::MAX_REQUEST_ID_LEN;

/// NUL characters to erase with: ids are at most `MAX_REQUEST_ID_LEN` bytes.
const NULS: &str = match core::str::from_utf8(&[0; MAX_REQUEST_ID_LEN as usize]) {
    Ok(s) => s,
    Err(_) => panic!("NUL bytes are UTF-8"),
};

/// `slots` slots of `stride` bytes. See the module docs.
#[derive(Debug)]
pub(crate) struct IdArena {
    text: String,
    stride: usize,
    /// Holds one id while it moves between two slots of `text`.
    tmp: String,
}

impl IdArena {
    /// Room for `slots` ids of up to `stride` bytes (`stride` at most
    /// `MAX_REQUEST_ID_LEN`; larger values are clamped). Allocates now.
    pub(crate) fn new(slots: usize, stride: usize) -> IdArena {
        let stride = stride.min(MAX_REQUEST_ID_LEN as usize);
        IdArena {
            text: "\0".repeat(slots * stride),
            stride,
            tmp: String::with_capacity(stride),
        }
    }

    /// The longest id a slot holds.
    pub(crate) fn stride(&self) -> usize {
        self.stride
    }

    /// The id of `len` bytes in `slot` (empty when out of range).
    #[inline]
    pub(crate) fn get(&self, slot: u32, len: u16) -> &str {
        let base = slot as usize * self.stride;
        self.text
            .get(base..base + usize::from(len))
            .unwrap_or_default()
    }

    /// Writes `id` into the empty (all-NUL) `slot`. An id longer than the
    /// stride or a slot out of range is refused (false); callers check both.
    pub(crate) fn write(&mut self, slot: u32, id: &str) -> bool {
        let base = slot as usize * self.stride;
        if id.len() > self.stride || base + self.stride > self.text.len() {
            debug_assert!(false, "id arena write out of bounds");
            return false;
        }
        debug_assert!(self.text.as_bytes()[base..base + self.stride]
            .iter()
            .all(|&b| b == 0));
        self.text.replace_range(base..base + id.len(), id);
        true
    }

    /// Erases the `len`-byte id in `slot`, leaving it all NUL.
    pub(crate) fn erase(&mut self, slot: u32, len: u16) {
        let base = slot as usize * self.stride;
        let len = usize::from(len).min(self.stride);
        if base + self.stride > self.text.len() {
            debug_assert!(false, "id arena erase out of bounds");
            return;
        }
        self.text.replace_range(base..base + len, &NULS[..len]);
    }

    /// Replaces the `old_len`-byte id in `to` with the `len`-byte id in
    /// `from` (which stays; erase it separately).
    pub(crate) fn copy(&mut self, from: u32, len: u16, to: u32, old_len: u16) {
        let (len, old_len) = (usize::from(len), usize::from(old_len));
        let dst = to as usize * self.stride;
        if len > self.stride || old_len > self.stride || dst + self.stride > self.text.len() {
            debug_assert!(false, "id arena copy out of bounds");
            return;
        }
        // Through `tmp` (capacity stride, and len <= stride: no allocation),
        // since both slots live in `text`. Padding with NULs up to the old
        // length keeps the replaced range ending on the old id's end or in
        // the padding after it.
        self.tmp.clear();
        let base = from as usize * self.stride;
        let src = self.text.get(base..base + len).unwrap_or_default();
        self.tmp.push_str(src);
        if old_len > len {
            self.tmp.push_str(&NULS[..old_len - len]);
        }
        let n = self.tmp.len();
        self.text.replace_range(dst..dst + n, &self.tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_copy_erase_keep_slots_whole() {
        let mut a = IdArena::new(3, 8);
        assert!(a.write(0, "héllo"));
        assert!(a.write(2, "🦀"));
        assert_eq!(a.get(0, 6), "héllo");
        a.copy(2, 4, 1, 0);
        assert_eq!(a.get(1, 4), "🦀");
        // A shorter id over a longer one leaves only NULs behind it.
        a.copy(1, 4, 0, 6);
        assert_eq!(a.get(0, 8), "🦀\0\0\0\0");
        a.erase(0, 4);
        assert_eq!(a.get(0, 8), "\0\0\0\0\0\0\0\0");
        assert!(a.write(0, "12345678"), "an id of exactly the stride fits");
    }
}
