//! [`TimerWheel`]: a fixed-capacity timing wheel with a wide near level and
//! coarse far levels.
//!
//! This module owns *when* entries fire. It does not know what an entry is:
//! the caller numbers its entries `0..capacity` (the lease book uses its
//! lease index) and gets those numbers back from [`TimerWheel::pop_expired`].
//!
//! # Ground rules
//!
//! - Time is in ticks of a configured length; `now` comes from the caller.
//!   A deadline is rounded *up* to a tick and `now` *down*, so an entry never
//!   fires before its deadline, and fires at the first poll at least one tick
//!   after it at the latest (DESIGN.md invariant 4).
//! - Nothing allocates after [`TimerWheel::new`].
//! - Insert and cancel are O(1). Renewal ([`TimerWheel::extend`]) is O(1)
//!   and does not touch the lists: it only raises the entry's deadline.
//!   When the entry's old slot comes due, the entry is found not to be due
//!   and is placed again (lazy renewal). So a heartbeat for 256 requests
//!   costs 256 stores, and a lease renewed every few seconds is moved once
//!   per expiry period, not once per heartbeat.
//! - Finding the next due slot is O(levels): occupancy bitmaps and
//!   `trailing_zeros`. A poll costs that plus the entries it fires or moves.
//!
//! # Layout
//!
//! ```text
//!  near level: N slots of one tick (N a power of two, 4096..=2^20, sized at
//!              construction to cover twice the longest lease); bitmap of N
//!              bits plus a summary word per 64 bitmap words.
//!              Holds every entry due within N ticks, at its exact tick.
//!  far level j (j = 0..5): 64 slots of W_j = N * 64^j ticks each.
//!              Holds entries due in (W_j, 64 * W_j] ticks, by window.
//!
//!  entry:      deadline (ticks), next, prev (u32 links), where it is linked
//! ```
//!
//! Placement is by *distance*, `d = deadline - elapsed` (`elapsed` = the
//! last tick fully processed): `d <= N` goes to near slot `deadline mod N`;
//! otherwise far level `j` with `W_j < d <= 64 W_j`, slot
//! `(deadline / W_j) mod 64`. A far slot is emptied at the start of its
//! window, when every entry in it is within `W_j` ticks and moves to a lower
//! level. An entry placed at distance `d` is at most one window ahead of its
//! lap, so a far slot never mixes laps.
//!
//! # Why not a classic hierarchical wheel
//!
//! The first version placed entries tokio-style, by the highest 6-bit group
//! in which deadline and `elapsed` differ. Every lease that is renewed across
//! a level boundary then lands in the *same* upper slot, and the whole book
//! cascades in one poll when that boundary passes: measured 152 ms at 1M
//! leases, 1.5 ms at 100k (benches/wheel.rs, steady state). With placement
//! by distance and a near level that covers the lease horizon, a lease is
//! placed at its exact tick, and the work of a poll is the leases that expire
//! or were renewed at that tick: spread as evenly as the grants were.
//! Deadlines past `N` ticks (the bidirectional 480 s TTL, `kv_lease_max_hold`)
//! still cascade, one far window at a time.
//!
//! # Entry links
//!
//! Each entry has `next`/`prev` u32 links (`NIL` = none) into a doubly linked
//! list per slot, plus one list of entries taken from a due slot and not yet
//! handed out (`pending`), so that [`TimerWheel::pop_expired`] can return one
//! entry at a time and a caller may cancel entries in between.

use core::time::Duration;

use crate::time::{duration_nanos, Instant};

const FAR_LEVELS: usize = 6;
const FAR_BITS: u32 = 6;
const FAR_SLOTS: usize = 1 << FAR_BITS;
const MIN_NEAR_BITS: u32 = 12;
const MAX_NEAR_BITS: u32 = 20;
const NIL: u32 = u32::MAX;

/// Where an entry is linked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loc {
    /// Not scheduled.
    Idle,
    /// In that slot's list.
    In(Slot),
    /// Taken from a due slot, waiting in `pending`.
    Pending,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// Deadline in nanoseconds, exact (ticks are derived where needed, so a
    /// renewal is one `max` and a store). May be later than where it is placed.
    deadline: u64,
    next: u32,
    prev: u32,
    loc: Loc,
}

/// The near level: one slot per tick, a two-level occupancy bitmap.
#[derive(Debug)]
struct Near {
    heads: Box<[u32]>,
    /// Bit `s % 64` of word `s / 64`: slot `s` is occupied.
    bits: Box<[u64]>,
    /// Bit `w % 64` of word `w / 64`: bitmap word `w` is non-zero.
    summary: Box<[u64]>,
}

impl Near {
    fn new(bits: u32) -> Near {
        let n = 1usize << bits;
        let words = n / 64;
        Near {
            heads: vec![NIL; n].into_boxed_slice(),
            bits: vec![0; words].into_boxed_slice(),
            summary: vec![0; words.div_ceil(64)].into_boxed_slice(),
        }
    }

    fn set(&mut self, s: usize) {
        self.bits[s / 64] |= 1 << (s % 64);
        self.summary[s / 4096] |= 1 << ((s / 64) % 64);
    }

    fn clear(&mut self, s: usize) {
        let w = s / 64;
        self.bits[w] &= !(1 << (s % 64));
        if self.bits[w] == 0 {
            self.summary[w / 64] &= !(1 << (w % 64));
        }
    }

    /// The first occupied slot at or after `from`, not wrapping.
    fn first_from(&self, from: usize) -> Option<usize> {
        let w = from / 64;
        if w >= self.bits.len() {
            return None;
        }
        let here = self.bits[w] & (!0u64 << (from % 64));
        if here != 0 {
            return Some(w * 64 + here.trailing_zeros() as usize);
        }
        // Next non-empty bitmap word after w, through the summary.
        let first_word = w + 1;
        let mut sw = first_word / 64;
        let mut mask = if first_word % 64 == 0 {
            !0u64
        } else {
            !0u64 << (first_word % 64)
        };
        while sw < self.summary.len() {
            let m = self.summary[sw] & mask;
            if m != 0 {
                let word = sw * 64 + m.trailing_zeros() as usize;
                return Some(word * 64 + self.bits[word].trailing_zeros() as usize);
            }
            sw += 1;
            mask = !0;
        }
        None
    }
}

#[derive(Debug)]
struct Far {
    occupied: u64,
    heads: [u32; FAR_SLOTS],
}

/// Why a wheel call was refused.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WheelError {
    /// The entry index is not below the capacity.
    OutOfRange,
    /// The entry is already scheduled; cancel it or extend it instead.
    AlreadyScheduled,
}

impl core::fmt::Display for WheelError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            WheelError::OutOfRange => "timer-wheel entry index is not below the capacity",
            WheelError::AlreadyScheduled => "timer-wheel entry is already scheduled",
        })
    }
}

impl std::error::Error for WheelError {}

/// Work counts since construction, for tests and benches.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WheelStats {
    /// Entries handed out as expired.
    pub fired: u64,
    /// Entries placed again: renewed since placement, or moved down from a far level.
    pub moved: u64,
}

/// A fixed-capacity timing wheel. See the module docs.
#[derive(Debug)]
pub struct TimerWheel {
    tick_ns: u64,
    /// log2 of the near level's slot count.
    near_bits: u32,
    /// The last tick fully processed: every scheduled entry is due after it.
    elapsed: u64,
    near: Near,
    far: Box<[Far; FAR_LEVELS]>,
    entries: Box<[Entry]>,
    /// Head of the list of entries taken from a due slot.
    pending: u32,
    scheduled: u32,
    stats: WheelStats,
}

impl TimerWheel {
    /// A wheel for entries `0..capacity` with the given tick (at least 1 ns),
    /// whose time starts at `start`, and whose near level covers `horizon`
    /// (at least 4096 ticks, at most 2^20): deadlines within the horizon are
    /// placed at their exact tick and never moved unless renewed.
    pub fn new(capacity: u32, tick: Duration, horizon: Duration, start: Instant) -> TimerWheel {
        let tick_ns = duration_nanos(tick).max(1);
        let horizon_ticks = duration_nanos(horizon).div_ceil(tick_ns).max(1);
        let near_bits =
            (64 - (horizon_ticks - 1).leading_zeros()).clamp(MIN_NEAR_BITS, MAX_NEAR_BITS);
        let empty = Entry {
            deadline: 0,
            next: NIL,
            prev: NIL,
            loc: Loc::Idle,
        };
        TimerWheel {
            tick_ns,
            near_bits,
            elapsed: start.as_nanos() / tick_ns,
            near: Near::new(near_bits),
            far: Box::new(core::array::from_fn(|_| Far {
                occupied: 0,
                heads: [NIL; FAR_SLOTS],
            })),
            entries: vec![empty; capacity as usize].into_boxed_slice(),
            pending: NIL,
            scheduled: 0,
            stats: WheelStats::default(),
        }
    }

    /// Number of entries the wheel can hold.
    pub fn capacity(&self) -> u32 {
        self.entries.len() as u32
    }

    /// Number of entries scheduled.
    pub fn len(&self) -> u32 {
        self.scheduled
    }

    /// True when no entry is scheduled.
    pub fn is_empty(&self) -> bool {
        self.scheduled == 0
    }

    /// Whether `entry` is scheduled.
    pub fn is_scheduled(&self, entry: u32) -> bool {
        self.entries
            .get(entry as usize)
            .is_some_and(|e| e.loc != Loc::Idle)
    }

    /// The wheel's tick length.
    pub fn tick(&self) -> Duration {
        Duration::from_nanos(self.tick_ns)
    }

    /// The span the near level covers (deadlines within it never cascade).
    pub fn horizon(&self) -> Duration {
        Duration::from_nanos(self.tick_ns.saturating_mul(1 << self.near_bits))
    }

    /// Work counts since construction.
    pub fn stats(&self) -> WheelStats {
        self.stats
    }

    /// Schedules `entry` to fire at the first poll at or after `deadline`.
    /// A deadline already past fires at the next poll one tick on.
    pub fn insert(&mut self, entry: u32, deadline: Instant) -> Result<(), WheelError> {
        let e = self
            .entries
            .get_mut(entry as usize)
            .ok_or(WheelError::OutOfRange)?;
        if e.loc != Loc::Idle {
            return Err(WheelError::AlreadyScheduled);
        }
        e.deadline = deadline.as_nanos();
        self.scheduled += 1;
        self.place(entry);
        Ok(())
    }

    /// Raises `entry`'s deadline to `deadline` if that is later; never lowers
    /// it. O(1): the entry stays where it is until its old slot comes due.
    /// Returns false (and does nothing) when the entry is not scheduled.
    #[inline]
    pub fn extend(&mut self, entry: u32, deadline: Instant) -> bool {
        match self.entries.get_mut(entry as usize) {
            Some(e) if e.loc != Loc::Idle => {
                e.deadline = e.deadline.max(deadline.as_nanos());
                true
            }
            _ => false,
        }
    }

    /// `entry`'s deadline as given (it fires at the first poll in the tick
    /// after), or `None` when it is not scheduled.
    #[inline]
    pub fn deadline(&self, entry: u32) -> Option<Instant> {
        let e = self.entries.get(entry as usize)?;
        (e.loc != Loc::Idle).then_some(Instant::from_nanos(e.deadline))
    }

    /// Loads `entry`'s deadline into the cache ahead of an [`TimerWheel::extend`]
    /// (batched renewals overlap their cache misses this way).
    #[inline]
    pub fn warm(&self, entry: u32) {
        if let Some(e) = self.entries.get(entry as usize) {
            core::hint::black_box(e.deadline);
        }
    }

    /// Unschedules `entry`. Returns whether it was scheduled.
    pub fn cancel(&mut self, entry: u32) -> bool {
        if !self.is_scheduled(entry) {
            return false;
        }
        self.unlink(entry);
        self.scheduled -= 1;
        true
    }

    /// Takes the next entry whose deadline is at or before `now`, unscheduled,
    /// or `None` when nothing more is due. Call until `None` each step.
    pub fn pop_expired(&mut self, now: Instant) -> Option<u32> {
        let now_t = now.as_nanos() / self.tick_ns;
        loop {
            if self.pending != NIL {
                let idx = self.pending;
                self.unlink(idx);
                if ceil_ticks(self.entries[idx as usize].deadline, self.tick_ns) <= now_t {
                    self.scheduled -= 1;
                    self.stats.fired += 1;
                    return Some(idx);
                }
                // Renewed since it was placed, or moved down from a far
                // level: place it again.
                self.stats.moved += 1;
                self.place(idx);
                continue;
            }
            match self.next_event() {
                Some((at, slot)) if at <= now_t => {
                    debug_assert!(at > self.elapsed);
                    // Every tick before `at` is processed; a far window
                    // opening at `at` is emptied before near slot `at`.
                    self.elapsed = at - 1;
                    self.take(slot);
                    if let Slot::Near(_) = slot {
                        self.elapsed = at;
                    }
                }
                _ => {
                    self.elapsed = self.elapsed.max(now_t);
                    return None;
                }
            }
        }
    }

    /// A lower bound on when the next entry fires: no entry fires before it.
    /// It may belong to an entry that was renewed and will be placed again.
    pub fn next_deadline(&self) -> Option<Instant> {
        let t = if self.pending != NIL {
            self.elapsed
        } else {
            self.next_event()?.0
        };
        Some(Instant::from_nanos(t.saturating_mul(self.tick_ns)))
    }

    fn near_len(&self) -> u64 {
        1 << self.near_bits
    }

    /// Window width of far level `j`, in ticks.
    fn far_width(&self, j: usize) -> u64 {
        1u64 << (self.near_bits as usize + FAR_BITS as usize * j)
    }

    /// Links a scheduled entry into the slot its deadline maps to, by its
    /// distance from `elapsed`.
    fn place(&mut self, idx: u32) {
        let deadline = ceil_ticks(self.entries[idx as usize].deadline, self.tick_ns);
        let max_span = self.far_width(FAR_LEVELS - 1) << FAR_BITS;
        // A past deadline goes to the next tick; one past the last far level
        // to its furthest window (it fires late by design, never early).
        let when = deadline.clamp(self.elapsed + 1, self.elapsed + max_span);
        let dist = when - self.elapsed;
        let slot = if dist <= self.near_len() {
            Slot::Near((when & (self.near_len() - 1)) as u32)
        } else {
            let mut j = 0;
            while dist > self.far_width(j) << FAR_BITS {
                j += 1;
            }
            debug_assert!(j < FAR_LEVELS);
            Slot::Far {
                level: j as u8,
                slot: ((when / self.far_width(j)) & (FAR_SLOTS as u64 - 1)) as u8,
            }
        };
        let head = self.swap_head(slot, idx);
        if head != NIL {
            self.entries[head as usize].prev = idx;
        }
        let e = &mut self.entries[idx as usize];
        e.next = head;
        e.prev = NIL;
        e.loc = Loc::In(slot);
    }

    /// Removes an entry from whatever list it is on (it stays counted).
    fn unlink(&mut self, idx: u32) {
        let Entry {
            next, prev, loc, ..
        } = self.entries[idx as usize];
        if prev != NIL {
            self.entries[prev as usize].next = next;
        } else {
            match loc {
                Loc::In(slot) => {
                    self.swap_head(slot, next);
                }
                Loc::Pending => self.pending = next,
                Loc::Idle => debug_assert!(false, "unlink of idle entry {idx}"),
            }
        }
        if next != NIL {
            self.entries[next as usize].prev = prev;
        }
        let e = &mut self.entries[idx as usize];
        e.next = NIL;
        e.prev = NIL;
        e.loc = Loc::Idle;
    }

    /// Makes `head` the first entry of `slot`'s list (NIL: the list is now
    /// empty) and keeps the occupancy bitmaps in step; returns the old head.
    fn swap_head(&mut self, slot: Slot, head: u32) -> u32 {
        match slot {
            Slot::Near(s) => {
                let old = core::mem::replace(&mut self.near.heads[s as usize], head);
                if head == NIL {
                    self.near.clear(s as usize);
                } else {
                    self.near.set(s as usize);
                }
                old
            }
            Slot::Far { level, slot } => {
                let f = &mut self.far[level as usize];
                let old = core::mem::replace(&mut f.heads[slot as usize], head);
                if head == NIL {
                    f.occupied &= !(1 << slot);
                } else {
                    f.occupied |= 1 << slot;
                }
                old
            }
        }
    }

    /// Moves a whole slot's list onto `pending` (which is empty).
    fn take(&mut self, slot: Slot) {
        debug_assert_eq!(self.pending, NIL);
        let head = self.swap_head(slot, NIL);
        self.pending = head;
        let mut i = head;
        while i != NIL {
            let e = &mut self.entries[i as usize];
            e.loc = Loc::Pending;
            i = e.next;
        }
    }

    /// The earliest slot to process and the tick it is due: the next
    /// occupied near slot, or the opening of the next occupied far window,
    /// whichever comes first (far first on a tie).
    fn next_event(&self) -> Option<(u64, Slot)> {
        let mut best: Option<(u64, Slot)> = None;
        for (j, f) in self.far.iter().enumerate() {
            if f.occupied == 0 {
                continue;
            }
            let w = self.far_width(j);
            let cur = self.elapsed / w;
            let start = ((cur + 1) & (FAR_SLOTS as u64 - 1)) as u32;
            let dist = u64::from(f.occupied.rotate_right(start).trailing_zeros());
            let at = (cur + 1 + dist).saturating_mul(w);
            let slot = Slot::Far {
                level: j as u8,
                slot: ((cur + 1 + dist) & (FAR_SLOTS as u64 - 1)) as u8,
            };
            if best.is_none_or(|(b, _)| at < b) {
                best = Some((at, slot));
            }
        }
        let n = self.near_len();
        let from = ((self.elapsed + 1) & (n - 1)) as usize;
        let near = self
            .near
            .first_from(from)
            .or_else(|| self.near.first_from(0).filter(|&s| s < from));
        if let Some(s) = near {
            let dist = (s as u64).wrapping_sub(from as u64) & (n - 1);
            let at = self.elapsed + 1 + dist;
            if best.is_none_or(|(b, _)| at < b) {
                best = Some((at, Slot::Near(s as u32)));
            }
        }
        best
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Near(u32),
    Far { level: u8, slot: u8 },
}

#[inline]
fn ceil_ticks(nanos: u64, tick_ns: u64) -> u64 {
    nanos / tick_ns + u64::from(nanos % tick_ns != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    const MS: u64 = 1_000_000;

    #[test]
    fn wheel_error_displays_and_is_an_error() {
        let mut w = wheel(2);
        let out = w.insert(2, Instant::from_secs(1)).unwrap_err();
        w.insert(0, Instant::from_secs(1)).unwrap();
        let again = w.insert(0, Instant::from_secs(2)).unwrap_err();
        assert_eq!(
            (out, again),
            (WheelError::OutOfRange, WheelError::AlreadyScheduled)
        );
        let (a, b): (&dyn std::error::Error, &dyn std::error::Error) = (&out, &again);
        assert!(a.to_string().contains("capacity"), "{a}");
        assert!(b.to_string().contains("already scheduled"), "{b}");
    }

    fn wheel(cap: u32) -> TimerWheel {
        TimerWheel::new(
            cap,
            Duration::from_millis(10),
            Duration::from_secs(60),
            Instant::ZERO,
        )
    }

    fn drain(w: &mut TimerWheel, now: Instant) -> Vec<u32> {
        let mut v: Vec<u32> = std::iter::from_fn(|| w.pop_expired(now)).collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn fires_at_deadline_not_before() {
        let mut w = wheel(4);
        w.insert(0, Instant::from_millis(25)).unwrap();
        assert!(drain(&mut w, Instant::from_millis(24)).is_empty());
        // Deadline 25 ms rounds up to tick 3 (30 ms): never early, at most a tick late.
        assert!(drain(&mut w, Instant::from_millis(29)).is_empty());
        assert_eq!(drain(&mut w, Instant::from_millis(30)), [0]);
        assert!(w.is_empty());
    }

    #[test]
    fn insert_twice_and_out_of_range_are_errors() {
        let mut w = wheel(1);
        w.insert(0, Instant::from_secs(1)).unwrap();
        assert_eq!(
            w.insert(0, Instant::from_secs(2)),
            Err(WheelError::AlreadyScheduled)
        );
        assert_eq!(
            w.insert(1, Instant::from_secs(2)),
            Err(WheelError::OutOfRange)
        );
        assert!(!w.extend(7, Instant::from_secs(9)));
        assert!(!w.cancel(7));
    }

    #[test]
    fn extend_is_lazy_and_never_lowers() {
        let mut w = wheel(2);
        w.insert(0, Instant::from_secs(30)).unwrap();
        assert!(w.extend(0, Instant::from_secs(50)));
        assert!(
            w.extend(0, Instant::from_secs(40)),
            "lower deadline is ignored, call still succeeds"
        );
        assert_eq!(w.deadline(0), Some(Instant::from_secs(50)));
        w.extend(0, Instant::from_nanos(50_000_000_001));
        assert_eq!(
            w.deadline(0),
            Some(Instant::from_nanos(50_000_000_001)),
            "exact, not rounded"
        );
        assert!(drain(&mut w, Instant::from_secs(30)).is_empty());
        assert!(drain(&mut w, Instant::from_secs(50)).is_empty());
        assert_eq!(drain(&mut w, Instant::from_millis(50_010)), [0]);
    }

    #[test]
    fn cancel_removes_from_slot_and_from_pending() {
        let mut w = wheel(3);
        for i in 0..3 {
            w.insert(i, Instant::from_secs(5)).unwrap();
        }
        assert!(w.cancel(1));
        let first = w.pop_expired(Instant::from_secs(5)).unwrap();
        // The rest of the slot is pending now; cancel one of them.
        let other = if first == 0 { 2 } else { 0 };
        assert!(w.cancel(other));
        assert_eq!(w.pop_expired(Instant::from_secs(5)), None);
        assert!(w.is_empty());
    }

    #[test]
    fn past_deadline_fires_on_next_tick() {
        let mut w = TimerWheel::new(
            1,
            Duration::from_millis(10),
            Duration::from_secs(60),
            Instant::from_secs(100),
        );
        w.insert(0, Instant::from_secs(1)).unwrap();
        assert_eq!(drain(&mut w, Instant::from_secs(100)), Vec::<u32>::new());
        assert_eq!(drain(&mut w, Instant::from_millis(100_010)), [0]);
    }

    #[test]
    fn far_deadlines_never_fire_early() {
        // Beyond the top level's span with a 1 ns tick (2^36 ns ~ 69 s).
        let mut w = TimerWheel::new(2, Duration::from_nanos(1), Duration::ZERO, Instant::ZERO);
        let far = Instant::from_secs(1000);
        w.insert(0, far).unwrap();
        w.insert(1, Instant::MAX).unwrap();
        let mut now = 0u64;
        while now < 1000 * 1_000_000_000 {
            now += 7_000_000_000;
            let fired = drain(&mut w, Instant::from_nanos(now));
            if Instant::from_nanos(now) < far {
                assert!(fired.is_empty(), "fired early at {now}");
            } else {
                assert_eq!(fired, [0]);
            }
        }
        assert!(w.is_scheduled(1));
    }

    #[test]
    fn next_deadline_is_a_lower_bound() {
        let mut w = wheel(3);
        assert_eq!(w.next_deadline(), None);
        w.insert(0, Instant::from_secs(20)).unwrap();
        w.insert(1, Instant::from_millis(700)).unwrap();
        let nd = w.next_deadline().unwrap();
        assert!(nd <= Instant::from_millis(700));
        assert!(drain(&mut w, nd.saturating_sub(Duration::from_nanos(1))).is_empty());
    }

    /// Leases renewed every heartbeat interval, never expiring: the work of a
    /// poll stays spread out, with no cascade of the whole book at a window
    /// boundary (the first, tokio-style placement moved every lease at once
    /// every 40.96 s).
    #[test]
    fn renewal_work_is_spread_over_polls() {
        let n = 20_000u32;
        let mut w = TimerWheel::new(
            n,
            Duration::from_millis(10),
            Duration::from_secs(60),
            Instant::ZERO,
        );
        // Grants spread over the first 5 s, 30 s leases.
        for i in 0..n {
            let granted = u64::from(i) * 5_000 / u64::from(n);
            w.insert(i, Instant::from_millis(granted + 30_000)).unwrap();
        }
        let mut worst = 0;
        let mut now_ms = 0u64;
        while now_ms < 200_000 {
            now_ms += 20;
            // Every entry is renewed once per 5 s interval (a slice of them per step).
            for i in (0..n).filter(|i| u64::from(*i) % 250 == (now_ms / 20) % 250) {
                assert!(w.extend(i, Instant::from_millis(now_ms + 20_000)));
            }
            let before = w.stats().moved;
            assert_eq!(
                w.pop_expired(Instant::from_millis(now_ms)),
                None,
                "nothing expires"
            );
            worst = worst.max(w.stats().moved - before);
        }
        // About n / (15 s / 20 ms) = 27 moves per step on average.
        println!("worst poll moved {worst} of {n} entries");
        assert!(worst < 200, "a poll moved {worst} of {n} entries");
        assert!(w.stats().moved > u64::from(n), "entries were moved lazily");
    }

    /// The wheel against a BTreeMap of deadlines over long random sequences of
    /// insert / extend / cancel / poll, with irregular poll intervals.
    #[test]
    fn matches_reference_model() {
        // A horizon of 0 gives the smallest near level (4096 ticks = 41 s), so
        // the far levels and their windows are exercised too.
        for horizon_s in [0, 60, 3_000] {
            for seed in 1..=6u64 {
                run_model(seed, 20_000, horizon_s);
            }
        }
    }

    fn run_model(seed: u64, ops: usize, horizon_s: u64) {
        let cap = 64u32;
        let tick = 10 * MS;
        let mut w = TimerWheel::new(
            cap,
            Duration::from_nanos(tick),
            Duration::from_secs(horizon_s),
            Instant::ZERO,
        );
        let mut model: BTreeMap<u32, u64> = BTreeMap::new(); // entry -> deadline ns
        let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut rand = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut now = 0u64;
        for _ in 0..ops {
            let r = rand();
            let e = (r % u64::from(cap)) as u32;
            // Deadlines from "already past" to far beyond level 2.
            let delta = match (r >> 8) % 4 {
                0 => (r >> 16) % (100 * MS),
                1 => (r >> 16) % (60_000 * MS),
                2 => (r >> 16) % (10_000_000 * MS),
                _ => 0,
            };
            match (r >> 6) % 4 {
                0 => {
                    let d = now + delta;
                    let res = w.insert(e, Instant::from_nanos(d));
                    if let std::collections::btree_map::Entry::Vacant(v) = model.entry(e) {
                        res.unwrap();
                        v.insert(d);
                    } else {
                        assert_eq!(res, Err(WheelError::AlreadyScheduled));
                    }
                }
                1 => {
                    let d = now + delta;
                    let ok = w.extend(e, Instant::from_nanos(d));
                    assert_eq!(ok, model.contains_key(&e));
                    if let Some(m) = model.get_mut(&e) {
                        *m = (*m).max(d);
                    }
                }
                2 => assert_eq!(w.cancel(e), model.remove(&e).is_some()),
                _ => {
                    now += (r >> 12) % (3_000 * MS);
                    let fired = drain(&mut w, Instant::from_nanos(now));
                    for f in &fired {
                        let d = model
                            .remove(f)
                            .expect("fired an entry that was not scheduled");
                        assert!(
                            d <= now,
                            "seed {seed}: entry {f} due {d} fired early at {now}"
                        );
                    }
                    // Everything due more than a tick ago must have fired.
                    for (e, d) in &model {
                        assert!(
                            *d > now.saturating_sub(tick),
                            "seed {seed}: entry {e} due {d} missed at {now}"
                        );
                    }
                }
            }
            assert_eq!(w.len() as usize, model.len());
        }
    }
}
