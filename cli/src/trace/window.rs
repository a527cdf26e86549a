//! Which part of a trace is replayed, how fast, and at what load.
//!
//! This module owns turning a [`Trace`] into a run's arrivals: the window
//! (`--from`, `--to`, trace time), the time scale (`--speed`: 2 replays an
//! hour in 30 minutes, so arrivals come twice as fast) and the load scale
//! (`--rate-scale`: the recorded arrivals times k over the same time).
//! Load scaling keeps the trace's burst structure: each request is replayed
//! floor(k) times, plus once more with probability frac(k) (k < 1 thins
//! the trace); the first copy arrives when the request did, the others at
//! a uniform point of the gap before the next recorded arrival, so a burst
//! stays a burst and a quiet minute stays quiet. The draws come from the
//! seed. It also owns the time syntax the trace flags share
//! ([`parse_time`]).

use std::time::Duration;

use super::{Trace, TraceRequest};
use crate::sim::replay::Arrival;
use crate::sim::rng::SimRng;

/// The replayed part of a trace.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Window {
    /// From this trace time (inclusive).
    pub from: Duration,
    /// To this trace time (exclusive); `None`: the end.
    pub to: Option<Duration>,
    /// Trace seconds per run second.
    pub speed: f64,
    /// Load multiplier.
    pub rate_scale: f64,
}

impl Default for Window {
    fn default() -> Self {
        Window {
            from: Duration::ZERO,
            to: None,
            speed: 1.0,
            rate_scale: 1.0,
        }
    }
}

impl Window {
    /// Run time of trace time `t` (at or after `from`).
    pub fn to_run(&self, t: Duration) -> Duration {
        Duration::from_secs_f64(t.saturating_sub(self.from).as_secs_f64() / self.speed)
    }

    /// Trace time of run time `t`.
    pub fn to_trace(&self, t: Duration) -> Duration {
        self.from + Duration::from_secs_f64(t.as_secs_f64() * self.speed)
    }

    /// Whether trace time `t` is inside the window.
    pub fn contains(&self, t: Duration) -> bool {
        t >= self.from && self.to.is_none_or(|to| t < to)
    }

    /// The requests of `trace` inside the window (the trace is sorted).
    pub fn requests<'a>(&self, trace: &'a Trace) -> &'a [TraceRequest] {
        let r = &trace.requests;
        let lo = r.partition_point(|q| q.at < self.from);
        let hi = match self.to {
            Some(to) => r.partition_point(|q| q.at < to),
            None => r.len(),
        };
        &r[lo..hi.max(lo)]
    }
}

/// The arrivals of `trace` under `w`, sorted by run time; draws (for a
/// fractional `rate_scale`, and the copies' offsets) come from `seed`.
pub fn arrivals(trace: &Trace, w: &Window, seed: u64) -> Result<Vec<Arrival>, String> {
    let reqs = w.requests(trace);
    if reqs.is_empty() {
        return Err(format!(
            "--from/--to: no request of the trace arrives in [{}, {}) (it spans 0-{} s)",
            show(w.from),
            w.to.map_or("the end".into(), show),
            trace.span().as_secs_f64().ceil()
        ));
    }
    let mut rng = SimRng::new(seed, 11);
    let whole = w.rate_scale.floor();
    let frac = w.rate_scale - whole;
    let scaled = w.rate_scale != 1.0;
    let mut out = Vec::with_capacity((reqs.len() as f64 * w.rate_scale.max(1.0)) as usize + 1);
    for (i, q) in reqs.iter().enumerate() {
        let copies = if scaled {
            whole as u64 + u64::from(rng.unit() < frac)
        } else {
            1
        };
        let gap = reqs
            .get(i + 1)
            .map_or(Duration::ZERO, |n| n.at.saturating_sub(q.at));
        for c in 0..copies {
            let at = if c == 0 {
                q.at
            } else {
                q.at + gap.mul_f64(rng.unit())
            };
            out.push(Arrival {
                at: w.to_run(at),
                prompt: q.input,
                output: q.output,
            });
        }
    }
    // Stable: equal times keep the trace's order.
    out.sort_by_key(|a| a.at);
    debug_assert!(out.windows(2).all(|p| p[0].at <= p[1].at));
    if out.is_empty() {
        return Err(format!(
            "--rate-scale {}: no request of the window was kept",
            w.rate_scale
        ));
    }
    Ok(out)
}

fn show(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// A time or length on the command line: seconds (`90`, `1.5`), or
/// `h`/`m`/`s` parts (`36m`, `1h5m`, `36m30s`, `2.5m`).
pub fn parse_time(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("an empty time".into());
    }
    let bad = || format!("{s:?} is not a time (e.g. 90, 90s, 36m, 1h5m, 36m30s)");
    if let Ok(x) = t.parse::<f64>() {
        return secs(x).ok_or_else(bad);
    }
    let mut total = 0.0;
    let mut num = String::new();
    let mut last_unit = 4;
    for c in t.chars() {
        let (unit, scale) = match c {
            'h' => (0, 3600.0),
            'm' => (1, 60.0),
            's' => (2, 1.0),
            c if c.is_ascii_digit() || c == '.' => {
                num.push(c);
                continue;
            }
            _ => return Err(bad()),
        };
        // Units in order (h, m, s), each once.
        if num.is_empty() || (last_unit != 4 && unit <= last_unit) {
            return Err(bad());
        }
        last_unit = unit;
        total += num.parse::<f64>().map_err(|_| bad())? * scale;
        num.clear();
    }
    if !num.is_empty() {
        return Err(bad());
    }
    secs(total).ok_or_else(bad)
}

fn secs(x: f64) -> Option<Duration> {
    (x.is_finite() && (0.0..=super::MAX_SPAN.as_secs_f64()).contains(&x))
        .then(|| Duration::from_secs_f64(x))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Format;

    fn trace(times: &[u64]) -> Trace {
        Trace {
            format: Format::Mooncake,
            has_prefixes: false,
            requests: times
                .iter()
                .enumerate()
                .map(|(i, &t)| TraceRequest {
                    at: Duration::from_secs(t),
                    input: 100 + i as u32,
                    output: 10,
                    prefix_blocks: 0,
                    shared_blocks: 0,
                    line: i + 1,
                })
                .collect(),
        }
    }

    #[test]
    fn times_parse_in_seconds_and_units() {
        let s = Duration::from_secs;
        assert_eq!(parse_time("90").unwrap(), s(90));
        assert_eq!(parse_time("36m").unwrap(), s(2160));
        assert_eq!(parse_time("1h5m").unwrap(), s(3900));
        assert_eq!(parse_time("36m30s").unwrap(), s(2190));
        assert_eq!(parse_time("1.5").unwrap(), Duration::from_millis(1500));
        for bad in ["", "-5", "5x", "m", "5s5m", "1h1h", "nan", "1e30"] {
            assert!(parse_time(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_window_speed_and_scale_shape_the_arrivals() {
        let t = trace(&[0, 10, 20, 30, 40]);
        let w = Window {
            from: Duration::from_secs(10),
            to: Some(Duration::from_secs(40)),
            speed: 2.0,
            rate_scale: 1.0,
        };
        let a = arrivals(&t, &w, 1).unwrap();
        let at: Vec<u64> = a.iter().map(|x| x.at.as_secs()).collect();
        assert_eq!(at, vec![0, 5, 10]);
        assert_eq!(a[0].prompt, 101);
        // x3: three copies of each, the extra ones inside the gap after it.
        let w3 = Window {
            rate_scale: 3.0,
            ..Window::default()
        };
        let a = arrivals(&t, &w3, 1).unwrap();
        assert_eq!(a.len(), 15);
        assert!(a.windows(2).all(|p| p[0].at <= p[1].at));
        assert_eq!(a.iter().filter(|x| x.prompt == 100).count(), 3);
        assert!(a
            .iter()
            .filter(|x| x.prompt == 100)
            .all(|x| x.at < Duration::from_secs(10)));
        // x0.5 keeps about half; the same seed keeps the same ones.
        let big = trace(&(0..2000).collect::<Vec<_>>());
        let half = Window {
            rate_scale: 0.5,
            ..Window::default()
        };
        let n = arrivals(&big, &half, 3).unwrap();
        assert!((900..1100).contains(&n.len()), "{}", n.len());
        assert_eq!(n, arrivals(&big, &half, 3).unwrap());
        assert_ne!(n, arrivals(&big, &half, 4).unwrap());
        let empty = Window {
            from: Duration::from_secs(41),
            ..Window::default()
        };
        assert!(arrivals(&t, &empty, 1).unwrap_err().contains("no request"));
    }
}
