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
//!   after it at the latest ([`crate::design`] invariant 4).
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
//! cascades in one poll when that boundary passes (`benches/wheel.rs`
//! measures the pause; `docs/benchmarks.md` has the figures). With placement
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WheelError {
    /// The entry index is not below the capacity.
    #[error("timer-wheel entry index is not below the capacity")]
    OutOfRange,
    /// The entry is already scheduled; cancel it or extend it instead.
    #[error("timer-wheel entry is already scheduled")]
    AlreadyScheduled,
}

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
mod tests;
