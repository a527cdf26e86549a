//! [`Ring`]: a fixed-capacity FIFO of `Copy` values.
//!
//! Owns only the order of what was pushed. The lease roles queue releases
//! and reports here between the event that caused them and the drain that
//! hands them on; each caller bounds what it can push (an entry is queued at
//! most once between its grant and its drain), so a ring as large as the
//! caller's entry count never overflows.

/// FIFO of up to `capacity` values. See the module docs.
#[derive(Debug)]
pub(crate) struct Ring<T: Copy> {
    items: Box<[T]>,
    head: usize,
    len: usize,
}

impl<T: Copy> Ring<T> {
    /// An empty ring of `capacity` values, filled with `fill` (never read).
    pub(crate) fn new(capacity: u32, fill: T) -> Ring<T> {
        Ring {
            items: vec![fill; capacity as usize].into_boxed_slice(),
            head: 0,
            len: 0,
        }
    }

    /// Appends `v`; false (and `v` dropped) when the ring is full, which its
    /// callers rule out by construction (a debug panic).
    pub(crate) fn push(&mut self, v: T) -> bool {
        debug_assert!(self.len < self.items.len(), "ring overflow");
        if self.len == self.items.len() {
            return false;
        }
        let tail = (self.head + self.len) % self.items.len();
        self.items[tail] = v;
        self.len += 1;
        true
    }

    /// The oldest value, removed.
    pub(crate) fn pop(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        let v = self.items[self.head];
        self.head = (self.head + 1) % self.items.len();
        self.len -= 1;
        Some(v)
    }

    /// The `k`-th oldest value, if there are more than `k`.
    // Part of the ring's interface; no step path needs it yet.
    #[allow(dead_code)]
    pub(crate) fn get(&self, k: usize) -> Option<T> {
        (k < self.len).then(|| self.items[(self.head + k) % self.items.len()])
    }

    /// Values queued.
    // Part of the ring's interface; no step path needs it yet.
    #[allow(dead_code)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_with_wraparound_and_refusal_when_full() {
        let mut q = Ring::new(3, 0u32);
        for round in 0..5 {
            assert!(q.push(round));
            assert!(q.push(round + 100));
            assert_eq!(q.len(), 2);
            assert_eq!(q.get(1), Some(round + 100));
            assert_eq!(q.pop(), Some(round));
            assert_eq!(q.pop(), Some(round + 100));
            assert_eq!(q.pop(), None);
            assert_eq!(q.len(), 0);
        }
        let mut empty = Ring::new(0, 0u8);
        assert_eq!(empty.pop(), None);
    }
}
