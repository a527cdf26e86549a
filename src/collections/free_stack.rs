//! [`FreeStack`]: a fixed-capacity stack of free indices.
//!
//! Owns only which indices of a range are free. A structure that numbers its
//! entries keeps their free ones here: pop to take one, push to give it back.
//! Indices come out lowest first from a fresh stack, and the most recently
//! freed first afterwards, which keeps live entries packed low (warm in the
//! cache, and within one span for the verifier's coalesced slot READs).

/// Free indices of `lo..hi`. See the module docs.
#[derive(Debug)]
pub(crate) struct FreeStack {
    items: Box<[u32]>,
    len: u32,
}

impl FreeStack {
    /// Every index of `0..n` free.
    pub(crate) fn full(n: u32) -> FreeStack {
        FreeStack::range(0, n)
    }

    /// Every index of `lo..hi` free (empty when `hi <= lo`), lowest on top.
    pub(crate) fn range(lo: u32, hi: u32) -> FreeStack {
        let items: Box<[u32]> = (lo..hi.max(lo)).rev().collect();
        FreeStack {
            len: items.len() as u32,
            items,
        }
    }

    /// Takes a free index, or `None` when none is left.
    pub(crate) fn pop(&mut self) -> Option<u32> {
        self.len = self.len.checked_sub(1)?;
        self.items.get(self.len as usize).copied()
    }

    /// The index [`FreeStack::pop`] would take, left in place.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))] // the NIXL fabric's
    pub(crate) fn peek(&self) -> Option<u32> {
        let top = self.len.checked_sub(1)?;
        self.items.get(top as usize).copied()
    }

    /// Gives an index back. Callers push only what they popped, so there is
    /// always room; a push beyond capacity is ignored (and a debug panic).
    pub(crate) fn push(&mut self, i: u32) {
        debug_assert!(
            (self.len as usize) < self.items.len(),
            "free stack overflow: {i} pushed twice"
        );
        if let Some(cell) = self.items.get_mut(self.len as usize) {
            *cell = i;
            self.len += 1;
        }
    }

    /// Free indices left.
    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    /// Indices the stack manages (free or taken).
    pub(crate) fn capacity(&self) -> u32 {
        self.items.len() as u32
    }

    /// True when every index is taken.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_first_then_most_recently_freed() {
        let mut s = FreeStack::range(10, 13);
        assert_eq!(s.len(), 3);
        assert_eq!(s.pop(), Some(10));
        assert_eq!(s.pop(), Some(11));
        s.push(10);
        assert_eq!(s.pop(), Some(10));
        assert_eq!(s.pop(), Some(12));
        assert!(s.is_empty());
        assert_eq!(s.pop(), None);
        assert!(FreeStack::range(5, 2).is_empty());
        assert_eq!(FreeStack::full(2).pop(), Some(0));
    }
}
