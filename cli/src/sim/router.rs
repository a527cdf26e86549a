//! The router (vLLM's P/D proxy): request arrivals and where each goes.
//!
//! This module owns the arrival process (Poisson, with the scenario's surge
//! window; the rate is piecewise constant, so a gap that crosses a rate
//! change is redrawn from the change, which memorylessness makes exact),
//! the request mix, and the routing rules: a new request goes to the P
//! engine with the shortest prefill queue; a prefilled request goes to the
//! alive D engine with the fewest outstanding requests (a proxy whose hop
//! to a dead D fails at once tries the next). Ties go to the lowest index.

use std::time::Duration;

use super::model::Workload;
use super::rng::SimRng;
use super::scenario::Surge;

/// The arrival process of one run.
#[derive(Clone, Debug)]
pub struct Arrivals {
    rng: SimRng,
    workload: Workload,
    surge: Option<Surge>,
}

impl Arrivals {
    /// Arrivals for `workload` with `surge`, drawn from `rng`.
    pub fn new(rng: SimRng, workload: Workload, surge: Option<Surge>) -> Arrivals {
        Arrivals {
            rng,
            workload,
            surge,
        }
    }

    fn rate_at(&self, t: Duration) -> (f64, Option<Duration>) {
        let base = self.workload.rate;
        match self.surge {
            Some(s) if t < s.start => (base, Some(s.start)),
            Some(s) if t < s.end => (base * s.factor, Some(s.end)),
            _ => (base, None),
        }
    }

    /// The next arrival after `t` (since the run's start); `None` when the
    /// rate is zero from `t` on.
    pub fn next_after(&mut self, mut t: Duration) -> Option<Duration> {
        loop {
            let (rate, change) = self.rate_at(t);
            if rate <= 0.0 {
                t = change?;
                continue;
            }
            let gap = Duration::from_secs_f64(self.rng.exponential(1.0 / rate));
            match change {
                Some(c) if t + gap >= c => t = c,
                _ => return Some(t + gap),
            }
        }
    }

    /// A new request's (prompt, output) tokens: uniform in [mean/2, 3*mean/2].
    pub fn sizes(&mut self) -> (u32, u32) {
        let draw = |rng: &mut SimRng, mean: u32| {
            let m = u64::from(mean.max(1));
            rng.between((m / 2).max(1), m + m / 2) as u32
        };
        let prompt = draw(&mut self.rng, self.workload.prompt_tokens);
        let output = draw(&mut self.rng, self.workload.output_tokens);
        (prompt, output)
    }
}

/// The index of the smallest `load`, first on ties; `None` if all are `None`.
pub fn least_loaded(loads: impl Iterator<Item = Option<usize>>) -> Option<usize> {
    let mut best: Option<(usize, usize)> = None;
    for (i, l) in loads.enumerate() {
        if let Some(l) = l {
            if best.is_none_or(|(_, b)| l < b) {
                best = Some((i, l));
            }
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn surge_raises_the_arrival_rate() {
        let w = Workload {
            rate: 2.0,
            prompt_tokens: 100,
            output_tokens: 10,
            max_requests: None,
        };
        let surge = Surge {
            start: Duration::from_secs(100),
            end: Duration::from_secs(200),
            factor: 5.0,
        };
        let mut a = Arrivals::new(SimRng::new(3, 0), w, Some(surge));
        let mut t = Duration::ZERO;
        let (mut before, mut during) = (0, 0);
        while let Some(n) = a.next_after(t) {
            if n >= Duration::from_secs(200) {
                break;
            }
            if n < Duration::from_secs(100) {
                before += 1;
            } else {
                during += 1;
            }
            t = n;
        }
        // 200 and 1000 expected.
        assert!((150..250).contains(&before), "{before}");
        assert!((850..1150).contains(&during), "{during}");
        let (p, o) = a.sizes();
        assert!((50..=150).contains(&p) && (5..=15).contains(&o));
    }

    #[test]
    fn least_loaded_skips_the_dead_and_breaks_ties_low() {
        assert_eq!(
            least_loaded([Some(3), None, Some(1), Some(1)].into_iter()),
            Some(2)
        );
        assert_eq!(least_loaded([None, None].into_iter()), None);
    }
}
