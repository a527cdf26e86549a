//! Time as the core sees it: an [`Instant`] the caller passes in.
//!
//! Ground rule: nothing in the core reads a clock. Every call that needs the
//! time takes `now: Instant`, so the lease book, the wheel and the tracker are
//! deterministic functions of their inputs and their tests never sleep.
//! Engines get a monotonic `now` from [`MonotonicClock`], the one place in the
//! crate that touches `std::time`; the simulator and the tests make their own
//! instants with [`Instant::from_nanos`].
//!
//! Durations are plain [`core::time::Duration`]s. Instants are nanoseconds
//! since an arbitrary origin (the clock's creation), in a `u64`: that covers
//! 584 years, and all arithmetic saturates rather than wrapping, so a huge
//! configured duration can only make a deadline later, never earlier.

use core::time::Duration;

/// A point on the caller's monotonic clock, in nanoseconds since its origin.
///
/// Two instants are only comparable when they come from the same clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(u64);

impl Instant {
    /// The clock's origin.
    pub const ZERO: Instant = Instant(0);
    /// The latest representable instant; used as "never".
    pub const MAX: Instant = Instant(u64::MAX);

    /// An instant `nanos` nanoseconds after the origin.
    pub const fn from_nanos(nanos: u64) -> Instant {
        Instant(nanos)
    }

    /// An instant `secs` seconds after the origin (saturating).
    pub const fn from_secs(secs: u64) -> Instant {
        Instant(secs.saturating_mul(1_000_000_000))
    }

    /// An instant `ms` milliseconds after the origin (saturating).
    pub const fn from_millis(ms: u64) -> Instant {
        Instant(ms.saturating_mul(1_000_000))
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// `self + d`, saturating at [`Instant::MAX`].
    pub fn saturating_add(self, d: Duration) -> Instant {
        Instant(self.0.saturating_add(duration_nanos(d)))
    }

    /// `self - d`, saturating at [`Instant::ZERO`].
    pub fn saturating_sub(self, d: Duration) -> Instant {
        Instant(self.0.saturating_sub(duration_nanos(d)))
    }

    /// How long after `earlier` this instant is; zero when it is not later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl core::ops::Add<Duration> for Instant {
    type Output = Instant;
    /// Saturating: a deadline past the end of time is "never", not a wrap.
    fn add(self, d: Duration) -> Instant {
        self.saturating_add(d)
    }
}

impl core::ops::Sub<Duration> for Instant {
    type Output = Instant;
    /// Saturating: "a lease ago" before the clock's origin is the origin,
    /// not a wrap to the far future.
    fn sub(self, d: Duration) -> Instant {
        self.saturating_sub(d)
    }
}

impl core::ops::Sub<Instant> for Instant {
    type Output = Duration;
    /// How long after `earlier` this instant is, zero when it is not later
    /// (as `std::time::Instant` does): [`Instant::saturating_duration_since`].
    ///
    /// ```
    /// use kvlease::Instant;
    /// use std::time::Duration;
    /// assert_eq!(Instant::from_secs(5) - Instant::from_secs(2), Duration::from_secs(3));
    /// assert_eq!(Instant::from_secs(2) - Instant::from_secs(5), Duration::ZERO);
    /// ```
    fn sub(self, earlier: Instant) -> Duration {
        self.saturating_duration_since(earlier)
    }
}

/// A duration in whole nanoseconds, saturating at `u64::MAX`.
pub(crate) fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The engine's monotonic clock: the only reader of real time in the crate.
///
/// Call [`MonotonicClock::now`] once per engine step and pass the result to
/// every component, so that all of them agree on what "now" is this step.
///
/// ```
/// let clock = kvlease::MonotonicClock::new();
/// let a = clock.now();
/// let b = clock.now();
/// assert!(b >= a);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock {
    origin: std::time::Instant,
}

impl MonotonicClock {
    /// A clock whose origin is the moment of this call.
    pub fn new() -> MonotonicClock {
        MonotonicClock {
            origin: std::time::Instant::now(),
        }
    }

    /// The current instant on this clock.
    pub fn now(&self) -> Instant {
        Instant(duration_nanos(self.origin.elapsed()))
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        MonotonicClock::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_instead_of_wrapping() {
        let late = Instant::from_nanos(u64::MAX - 5);
        assert_eq!(late + Duration::from_secs(1), Instant::MAX);
        assert_eq!(
            Instant::from_nanos(3).saturating_sub(Duration::from_nanos(10)),
            Instant::ZERO
        );
        assert_eq!(
            Instant::from_secs(1).saturating_duration_since(Instant::from_secs(2)),
            Duration::ZERO
        );
        assert_eq!(Instant::from_secs(u64::MAX), Instant::MAX);
        assert_eq!(duration_nanos(Duration::MAX), u64::MAX);
    }

    #[test]
    fn instant_minus_duration_saturates() {
        let t = Instant::from_secs(30);
        assert_eq!(t - Duration::from_secs(20), Instant::from_secs(10));
        assert_eq!(t - Duration::ZERO, t);
        assert_eq!(t - Duration::from_secs(31), Instant::ZERO);
        assert_eq!(Instant::MAX - Duration::MAX, Instant::ZERO);
        assert_eq!(Instant::ZERO - Duration::from_nanos(1), Instant::ZERO);
        // The inverse of `+` wherever neither saturates.
        assert_eq!(
            (t + Duration::from_millis(1500)) - Duration::from_millis(1500),
            t
        );
    }

    #[test]
    fn unit_constructors_agree() {
        assert_eq!(Instant::from_secs(2), Instant::from_millis(2000));
        assert_eq!(Instant::from_millis(3).as_nanos(), 3_000_000);
    }
}
