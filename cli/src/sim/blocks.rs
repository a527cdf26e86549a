//! A KV block pool with a real capacity.
//!
//! Owns which block ids are free. Freed blocks go on top of the free stack
//! and are handed out first (LIFO), so a block P frees is typically reused
//! by the very next prefill: the worst case for a decoder that reads after
//! the lease lapsed, and the case lease verification exists for.

/// Free block ids of one engine's KV cache.
#[derive(Clone, Debug)]
pub struct BlockPool {
    free: Vec<u32>,
    total: u32,
    /// The fewest blocks ever free (the pool's high-water mark of use).
    low_free: u32,
}

impl BlockPool {
    /// A pool of `total` blocks, all free.
    pub fn new(total: u32) -> BlockPool {
        BlockPool {
            // Reversed so that block 0 is handed out first.
            free: (0..total).rev().collect(),
            total,
            low_free: total,
        }
    }

    /// Blocks free now.
    pub fn free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Blocks in the pool.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// Most blocks ever in use at once.
    pub fn peak_used(&self) -> u32 {
        self.total - self.low_free
    }

    /// `n` blocks, or `None` (nothing taken) if fewer are free.
    pub fn take(&mut self, n: u32) -> Option<Vec<u32>> {
        let n = n as usize;
        if n > self.free.len() {
            return None;
        }
        let at = self.free.len() - n;
        let mut blocks = self.free.split_off(at);
        self.low_free = self.low_free.min(at as u32);
        // Popping order: the most recently freed first.
        blocks.reverse();
        Some(blocks)
    }

    /// Returns blocks to the pool.
    pub fn give_back(&mut self, blocks: &[u32]) {
        self.free.extend(blocks.iter().rev());
    }
}

#[cfg(test)]
mod tests {
    use super::BlockPool;

    #[test]
    fn freed_blocks_are_reused_first_and_capacity_holds() {
        let mut p = BlockPool::new(8);
        let a = p.take(3).expect("free");
        assert_eq!(a, vec![0, 1, 2]);
        assert!(p.take(6).is_none());
        assert_eq!(p.free(), 5);
        p.give_back(&a);
        assert_eq!(p.take(3).expect("free"), vec![0, 1, 2]);
        assert_eq!(p.total(), 8);
        assert_eq!(p.peak_used(), 3);
    }
}
