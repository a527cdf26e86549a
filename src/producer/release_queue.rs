//! [`ReleaseQueue`]: the lease book's fixed ring of released, unreported leases.
//!
//! Owns only the order in which releases are reported. An entry is queued at
//! most once between its grant and its report, and is not reused before it
//! is reported, so a ring as large as the book can never overflow.

const NIL: u32 = u32::MAX;

#[derive(Debug)]
pub(crate) struct ReleaseQueue {
    ring: Box<[u32]>,
    head: usize,
    len: usize,
}

impl ReleaseQueue {
    pub(crate) fn new(capacity: u32) -> ReleaseQueue {
        ReleaseQueue {
            ring: vec![NIL; capacity as usize].into_boxed_slice(),
            head: 0,
            len: 0,
        }
    }

    pub(crate) fn push(&mut self, entry: u32) {
        debug_assert!(
            self.len < self.ring.len(),
            "release queue overflow: an entry was queued twice"
        );
        if self.len == self.ring.len() {
            return;
        }
        let tail = (self.head + self.len) % self.ring.len();
        self.ring[tail] = entry;
        self.len += 1;
    }

    pub(crate) fn pop(&mut self) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let e = self.ring[self.head];
        self.head = (self.head + 1) % self.ring.len();
        self.len -= 1;
        Some(e)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_with_wraparound() {
        let mut q = ReleaseQueue::new(3);
        for round in 0..5 {
            q.push(round);
            q.push(round + 100);
            assert_eq!(q.len(), 2);
            assert_eq!(q.pop(), Some(round));
            assert_eq!(q.pop(), Some(round + 100));
            assert_eq!(q.pop(), None);
        }
    }
}
