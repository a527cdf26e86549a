//! The simulator's one source of randomness: a small seeded generator.
//!
//! Owns determinism of the workload: every random draw of a run (arrival
//! gaps, prompt and output lengths, the loopback fabric's fault seed) comes
//! from one [`SimRng`] built from `--seed`, so the same seed replays the
//! same run. SplitMix64: tiny, fast, good enough for a workload, and no
//! dependency (the `rand` crate would add a tree for three functions).

/// A seeded SplitMix64 generator.
#[derive(Clone, Debug)]
pub struct SimRng {
    state: u64,
}

impl SimRng {
    /// A generator for `seed`; `stream` separates independent uses of one seed.
    pub fn new(seed: u64, stream: u64) -> SimRng {
        let mut r = SimRng {
            state: seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03),
        };
        // Burn one draw so that nearby seeds do not start on nearby states.
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` (53 random bits).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An exponential draw with mean `mean` (Poisson inter-arrival gaps).
    pub fn exponential(&mut self, mean: f64) -> f64 {
        // 1 - unit() is in (0, 1]: the log is finite.
        -mean * (1.0 - self.unit()).ln()
    }

    /// Uniform integer in `[lo, hi]` (inclusive; `lo` when `hi < lo`).
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::SimRng;

    #[test]
    fn same_seed_same_stream_and_streams_differ() {
        let a: Vec<u64> = (0..8)
            .scan(SimRng::new(7, 0), |r, _| Some(r.next_u64()))
            .collect();
        let b: Vec<u64> = (0..8)
            .scan(SimRng::new(7, 0), |r, _| Some(r.next_u64()))
            .collect();
        let c: Vec<u64> = (0..8)
            .scan(SimRng::new(7, 1), |r, _| Some(r.next_u64()))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn exponential_mean_is_close() {
        let mut r = SimRng::new(1, 2);
        let n = 200_000;
        let mean = (0..n).map(|_| r.exponential(0.25)).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.005, "mean {mean}");
        assert!((0..1000).all(|_| {
            let x = r.between(3, 9);
            (3..=9).contains(&x)
        }));
    }
}
