//! [`TimerWheel`]: a fixed-capacity hierarchical timing wheel.
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
//!   and does not even touch the lists: it only raises the entry's deadline.
//!   When the entry's old slot comes due, the entry is found not to be due
//!   and is placed again (lazy renewal). So a heartbeat for 256 requests
//!   costs 256 stores.
//! - Polling costs O(levels + fired + re-placed), independent of how many
//!   entries are held: each level keeps a 64-bit occupancy bitmap and the
//!   next occupied slot is one `trailing_zeros` away.
//!
//! # Levels
//!
//! Six levels of 64 slots. With the default 10 ms tick:
//!
//! ```text
//!  level  slot width        level span        at 10 ms/tick
//!    0    1 tick            64 ticks           0.64 s
//!    1    64 ticks          4096 ticks         40.96 s
//!    2    64^2 ticks        64^3 ticks         43.7 min
//!    3    64^3 ticks        64^4 ticks         1.94 days
//!    4    64^4 ticks        64^5 ticks         124 days
//!    5    64^5 ticks        64^6 ticks         21.8 years
//! ```
//!
//! An entry lives on the level of the highest 6-bit group in which its
//! deadline differs from `elapsed` (the last tick polled), so every entry on
//! level `l` is due before every entry on level `l + 1`: the next expiry is
//! on the lowest non-empty level. When a slot on level `l > 0` comes due its
//! entries are placed again, now on a lower level, relative to the slot's
//! start (the cascade). A deadline past the top level's span is placed at the
//! top level's furthest slot and placed again when that comes due: far
//! deadlines fire late by design, never early.
//!
//! # Entry links
//!
//! Each entry has `next`/`prev` u32 links (`NIL` = none) into a doubly linked
//! list per slot, plus one list of entries taken from a due slot and not yet
//! handed out (`pending`), so that [`TimerWheel::pop_expired`] can return one
//! entry at a time and a caller may cancel entries in between.

use core::time::Duration;

use crate::time::{duration_nanos, Instant};

const LEVELS: usize = 6;
const SLOT_BITS: u32 = 6;
const SLOTS: usize = 1 << SLOT_BITS;
const SLOT_MASK: u64 = (SLOTS as u64) - 1;
/// Largest distance (in ticks) an entry can be placed from `elapsed`.
const MAX_SPAN: u64 = (1 << (SLOT_BITS as usize * LEVELS)) - 1;
const NIL: u32 = u32::MAX;

/// Where an entry is linked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loc {
    /// Not scheduled.
    Idle,
    /// In the list of slot `slot` of level `level`.
    Slot { level: u8, slot: u8 },
    /// Taken from a due slot, waiting in `pending`.
    Pending,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// Deadline in ticks (rounded up). May be later than where it is placed.
    deadline: u64,
    next: u32,
    prev: u32,
    loc: Loc,
}

#[derive(Debug)]
struct Level {
    occupied: u64,
    heads: [u32; SLOTS],
}

/// Why a wheel call was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WheelError {
    /// The entry index is not below the capacity.
    OutOfRange,
    /// The entry is already scheduled; cancel it or extend it instead.
    AlreadyScheduled,
}

/// A fixed-capacity hierarchical timing wheel. See the module docs.
#[derive(Debug)]
pub struct TimerWheel {
    tick_ns: u64,
    /// The last tick fully processed: every scheduled entry is due after it.
    elapsed: u64,
    levels: Box<[Level; LEVELS]>,
    entries: Box<[Entry]>,
    /// Head of the list of entries taken from a due slot.
    pending: u32,
    scheduled: u32,
}

impl TimerWheel {
    /// A wheel for entries `0..capacity` with the given tick (at least 1 ns),
    /// whose time starts at `start`.
    pub fn new(capacity: u32, tick: Duration, start: Instant) -> TimerWheel {
        let tick_ns = duration_nanos(tick).max(1);
        let empty = Entry {
            deadline: 0,
            next: NIL,
            prev: NIL,
            loc: Loc::Idle,
        };
        TimerWheel {
            tick_ns,
            elapsed: start.as_nanos() / tick_ns,
            levels: Box::new(core::array::from_fn(|_| Level {
                occupied: 0,
                heads: [NIL; SLOTS],
            })),
            entries: vec![empty; capacity as usize].into_boxed_slice(),
            pending: NIL,
            scheduled: 0,
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
        e.deadline = ceil_ticks(deadline.as_nanos(), self.tick_ns);
        self.scheduled += 1;
        self.place(entry);
        Ok(())
    }

    /// Raises `entry`'s deadline to `deadline` if that is later; never lowers
    /// it. O(1): the entry stays where it is until its old slot comes due.
    /// Returns false (and does nothing) when the entry is not scheduled.
    #[inline]
    pub fn extend(&mut self, entry: u32, deadline: Instant) -> bool {
        let t = ceil_ticks(deadline.as_nanos(), self.tick_ns);
        match self.entries.get_mut(entry as usize) {
            Some(e) if e.loc != Loc::Idle => {
                e.deadline = e.deadline.max(t);
                true
            }
            _ => false,
        }
    }

    /// The deadline `entry` will fire at, rounded up to its tick.
    pub fn deadline(&self, entry: u32) -> Option<Instant> {
        let e = self.entries.get(entry as usize)?;
        (e.loc != Loc::Idle).then(|| Instant::from_nanos(e.deadline.saturating_mul(self.tick_ns)))
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
                if self.entries[idx as usize].deadline <= now_t {
                    self.scheduled -= 1;
                    return Some(idx);
                }
                // Renewed since it was placed: place it again, lower down.
                self.place(idx);
                continue;
            }
            match self.next_expiration() {
                Some((level, slot, at)) if at <= now_t => {
                    debug_assert!(at >= self.elapsed);
                    self.elapsed = at;
                    self.take_slot(level, slot);
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
            self.next_expiration()?.2
        };
        Some(Instant::from_nanos(t.saturating_mul(self.tick_ns)))
    }

    /// Links a scheduled entry into the slot its deadline maps to, relative
    /// to `elapsed`.
    fn place(&mut self, idx: u32) {
        let deadline = self.entries[idx as usize].deadline;
        // A past deadline goes to the next tick; a far one to the furthest slot.
        let when = deadline.clamp(self.elapsed + 1, self.elapsed + MAX_SPAN);
        let level = level_for(self.elapsed, when);
        let slot = ((when >> (level as u32 * SLOT_BITS)) & SLOT_MASK) as usize;
        let lvl = &mut self.levels[level];
        let head = lvl.heads[slot];
        lvl.heads[slot] = idx;
        lvl.occupied |= 1 << slot;
        if head != NIL {
            self.entries[head as usize].prev = idx;
        }
        let e = &mut self.entries[idx as usize];
        e.next = head;
        e.prev = NIL;
        e.loc = Loc::Slot {
            level: level as u8,
            slot: slot as u8,
        };
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
                Loc::Slot { level, slot } => {
                    let lvl = &mut self.levels[level as usize];
                    lvl.heads[slot as usize] = next;
                    if next == NIL {
                        lvl.occupied &= !(1 << slot);
                    }
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

    /// Moves a whole slot's list onto `pending` (which is empty).
    fn take_slot(&mut self, level: usize, slot: usize) {
        debug_assert_eq!(self.pending, NIL);
        let lvl = &mut self.levels[level];
        let head = lvl.heads[slot];
        lvl.heads[slot] = NIL;
        lvl.occupied &= !(1 << slot);
        self.pending = head;
        let mut i = head;
        while i != NIL {
            let e = &mut self.entries[i as usize];
            e.loc = Loc::Pending;
            i = e.next;
        }
    }

    /// The earliest occupied slot: (level, slot, its start in ticks).
    fn next_expiration(&self) -> Option<(usize, usize, u64)> {
        for (level, lvl) in self.levels.iter().enumerate() {
            if lvl.occupied == 0 {
                continue;
            }
            let shift = level as u32 * SLOT_BITS;
            let slot_width = 1u64 << shift;
            let level_span = slot_width << SLOT_BITS;
            let now_slot = ((self.elapsed >> shift) & SLOT_MASK) as u32;
            // Slots from the current position on, wrapping around.
            let slot = ((lvl.occupied.rotate_right(now_slot).trailing_zeros() + now_slot) as u64
                & SLOT_MASK) as usize;
            let level_start = self.elapsed & !(level_span - 1);
            let mut at = level_start + slot as u64 * slot_width;
            if at <= self.elapsed && level > 0 {
                // Only the top level wraps (far deadlines): next lap.
                at += level_span;
            }
            return Some((level, slot, at.max(self.elapsed)));
        }
        None
    }
}

/// The level whose 6-bit group is the highest in which `elapsed` and `when` differ.
#[inline]
fn level_for(elapsed: u64, when: u64) -> usize {
    let mut masked = (elapsed ^ when) | SLOT_MASK;
    if masked >= MAX_SPAN {
        masked = MAX_SPAN - 1;
    }
    let significant = 63 - masked.leading_zeros();
    (significant / SLOT_BITS) as usize
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

    fn wheel(cap: u32) -> TimerWheel {
        TimerWheel::new(cap, Duration::from_millis(10), Instant::ZERO)
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
        assert!(drain(&mut w, Instant::from_secs(30)).is_empty());
        assert!(drain(&mut w, Instant::from_nanos(50_000 * MS - 1)).is_empty());
        assert_eq!(drain(&mut w, Instant::from_secs(50)), [0]);
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
        let mut w = TimerWheel::new(1, Duration::from_millis(10), Instant::from_secs(100));
        w.insert(0, Instant::from_secs(1)).unwrap();
        assert_eq!(drain(&mut w, Instant::from_secs(100)), Vec::<u32>::new());
        assert_eq!(drain(&mut w, Instant::from_millis(100_010)), [0]);
    }

    #[test]
    fn far_deadlines_never_fire_early() {
        // Beyond the top level's span with a 1 ns tick (2^36 ns ~ 69 s).
        let mut w = TimerWheel::new(2, Duration::from_nanos(1), Instant::ZERO);
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

    /// The wheel against a BTreeMap of deadlines over long random sequences of
    /// insert / extend / cancel / poll, with irregular poll intervals.
    #[test]
    fn matches_reference_model() {
        for seed in 1..=8u64 {
            run_model(seed, 20_000);
        }
    }

    fn run_model(seed: u64, ops: usize) {
        let cap = 64u32;
        let tick = 10 * MS;
        let mut w = TimerWheel::new(cap, Duration::from_nanos(tick), Instant::ZERO);
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
