//! The receiving side of one loopback agent: the consumer end of its queue
//! and the *pen* where delayed and reordered messages wait.
//!
//! This module owns delivery order. It does not decide which message is
//! delayed or reordered (the sender's fault draw did, and stamped the answer
//! into the [`Envelope`]); it only honours the stamp.
//!
//! # Why a pen on the receiving side
//!
//! The ring is FIFO, and a delayed message must not hold back the messages
//! behind it. The receiver therefore moves a message that is not yet due
//! into its pen, a fixed array of cells it alone owns (so no atomics), and
//! delivers it from there once the network clock passes its stamp. Keeping
//! the pen here rather than on the sender means a message in flight still
//! arrives when its sender has crashed or stopped stepping, as on a real
//! network. If the pen is full the message is delivered at once and counted
//! in [`InboxStats::pen_overflow`] (a test fabric should degrade visibly,
//! not lose messages it was not asked to lose).
//!
//! # Order within one drain
//!
//! 1. pen messages that are due, by (due time, arrival);
//! 2. ring messages in FIFO order, each followed by every reordered message
//!    it overtook (those are released right after the next delivery);
//! 3. stale messages (stamped with an earlier incarnation of this agent, sent
//!    to the process before a crash) are discarded wherever they are found.
//!
//! A drain pops at most one ring's worth of messages, so it terminates even
//! while senders keep pushing.

use super::queue::{Envelope, QueueConsumer};

/// Envelope flag: the message was reordered; its stamp is the latest time it
/// may be released.
pub(crate) const FLAG_HOLD: u32 = 1;

/// Counters kept by the receiving side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct InboxStats {
    pub(crate) delivered: u64,
    pub(crate) discarded_stale: u64,
    pub(crate) pen_overflow: u64,
}

struct PenCell {
    used: bool,
    envelope: Envelope,
    arrival: u64,
    len: usize,
    bytes: Box<[u8]>,
}

/// What happened to one message popped from the ring.
enum Popped {
    Delivered,
    Penned,
    Stale,
}

pub(crate) struct Inbox {
    consumer: QueueConsumer,
    pen: Box<[PenCell]>,
    /// Used pen cells; lets a drain skip the pen scan when it is empty.
    penned: usize,
    /// Counts arrivals into the pen, to order equal due times.
    arrivals: u64,
}

impl Inbox {
    pub(crate) fn new(consumer: QueueConsumer, pen_capacity: u32, max_len: usize) -> Inbox {
        Inbox {
            consumer,
            pen: (0..pen_capacity)
                .map(|_| PenCell {
                    used: false,
                    envelope: Envelope::default(),
                    arrival: 0,
                    len: 0,
                    bytes: vec![0u8; max_len].into_boxed_slice(),
                })
                .collect(),
            penned: 0,
            arrivals: 0,
        }
    }

    /// Forgets everything in the pen (the agent restarted).
    pub(crate) fn reset(&mut self) {
        for cell in self.pen.iter_mut() {
            cell.used = false;
        }
        self.penned = 0;
    }

    /// Delivers every message that is due at network time `now` to `sink`
    /// as (sender name, bytes). `incarnation` is this agent's current life;
    /// `name_of` maps a sender index to its name. Returns the number
    /// delivered. Never allocates.
    pub(crate) fn drain<'n>(
        &mut self,
        now: u64,
        incarnation: u32,
        name_of: &dyn Fn(u32) -> &'n str,
        sink: &mut dyn FnMut(&str, &[u8]),
        stats: &mut InboxStats,
    ) -> usize {
        let before = stats.delivered;
        let mut pen = Pen {
            cells: &mut self.pen,
            penned: &mut self.penned,
            arrivals: &mut self.arrivals,
        };
        pen.release(now, false, incarnation, name_of, sink, stats);
        for _ in 0..self.consumer.capacity() {
            let popped = self.consumer.pop_with(|env, bytes| {
                if env.tag != incarnation {
                    return Popped::Stale;
                }
                let due = env.stamp <= now && env.flags & FLAG_HOLD == 0;
                if !due && pen.insert(env, bytes) {
                    return Popped::Penned;
                }
                if !due {
                    stats.pen_overflow += 1;
                }
                sink(name_of(env.sender), bytes);
                Popped::Delivered
            });
            match popped {
                None => break,
                Some(Popped::Delivered) => {
                    stats.delivered += 1;
                    // Everything reordered so far was overtaken by this one.
                    pen.release(u64::MAX, true, incarnation, name_of, sink, stats);
                }
                Some(Popped::Penned) => {}
                Some(Popped::Stale) => stats.discarded_stale += 1,
            }
        }
        (stats.delivered - before) as usize
    }
}

/// The pen, borrowed apart from the consumer so both can be used in one
/// `pop_with` closure.
struct Pen<'a> {
    cells: &'a mut [PenCell],
    penned: &'a mut usize,
    arrivals: &'a mut u64,
}

impl Pen<'_> {
    /// Copies a message in; false when every cell is used.
    fn insert(&mut self, envelope: Envelope, bytes: &[u8]) -> bool {
        let Some(cell) = self.cells.iter_mut().find(|c| !c.used) else {
            return false;
        };
        if bytes.len() > cell.bytes.len() {
            return false; // cannot happen: pen and ring cells have one size
        }
        cell.used = true;
        cell.envelope = envelope;
        cell.arrival = *self.arrivals;
        cell.len = bytes.len();
        cell.bytes[..bytes.len()].copy_from_slice(bytes);
        *self.arrivals += 1;
        *self.penned += 1;
        true
    }

    /// Delivers pen messages in (stamp, arrival) order: those due at `now`,
    /// or with `held_only`, every reordered message (whatever its stamp).
    fn release<'n>(
        &mut self,
        now: u64,
        held_only: bool,
        incarnation: u32,
        name_of: &dyn Fn(u32) -> &'n str,
        sink: &mut dyn FnMut(&str, &[u8]),
        stats: &mut InboxStats,
    ) {
        while *self.penned > 0 {
            let next = self
                .cells
                .iter_mut()
                .filter(|c| c.used && c.envelope.stamp <= now)
                .filter(|c| !held_only || c.envelope.flags & FLAG_HOLD != 0)
                .min_by_key(|c| (c.envelope.stamp, c.arrival));
            let Some(cell) = next else { break };
            cell.used = false;
            *self.penned -= 1;
            if cell.envelope.tag == incarnation {
                sink(name_of(cell.envelope.sender), &cell.bytes[..cell.len]);
                stats.delivered += 1;
            } else {
                stats.discarded_stale += 1;
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::queue::channel;
    use super::*;

    fn names(i: u32) -> &'static str {
        ["a", "b", "c"][i as usize]
    }

    fn drain(inbox: &mut Inbox, now: u64, stats: &mut InboxStats) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        inbox.drain(now, 0, &names, &mut |_, b| got.push(b.to_vec()), stats);
        got
    }

    fn env(stamp: u64, flags: u32) -> Envelope {
        Envelope {
            sender: 1,
            flags,
            tag: 0,
            stamp,
        }
    }

    #[test]
    fn delayed_message_waits_without_blocking_later_ones() {
        let (p, c) = channel(4, 8);
        let mut inbox = Inbox::new(c, 4, 8);
        let mut st = InboxStats::default();
        p.push(env(100, 0), b"late").unwrap();
        p.push(env(0, 0), b"now").unwrap();
        assert_eq!(drain(&mut inbox, 10, &mut st), [b"now".to_vec()]);
        assert_eq!(drain(&mut inbox, 99, &mut st), Vec::<Vec<u8>>::new());
        assert_eq!(drain(&mut inbox, 100, &mut st), [b"late".to_vec()]);
        assert_eq!(st.delivered, 2);
    }

    #[test]
    fn reordered_message_follows_the_next_one_or_its_deadline() {
        let (p, c) = channel(4, 8);
        let mut inbox = Inbox::new(c, 4, 8);
        let mut st = InboxStats::default();
        p.push(env(1_000, FLAG_HOLD), b"1").unwrap();
        p.push(env(0, 0), b"2").unwrap();
        assert_eq!(
            drain(&mut inbox, 0, &mut st),
            [b"2".to_vec(), b"1".to_vec()]
        );
        p.push(env(50, FLAG_HOLD), b"3").unwrap();
        assert!(drain(&mut inbox, 10, &mut st).is_empty());
        assert_eq!(drain(&mut inbox, 50, &mut st), [b"3".to_vec()]);
    }

    #[test]
    fn full_pen_delivers_early_and_counts_it() {
        let (p, c) = channel(4, 8);
        let mut inbox = Inbox::new(c, 1, 8);
        let mut st = InboxStats::default();
        p.push(env(100, 0), b"a").unwrap();
        p.push(env(100, 0), b"b").unwrap();
        assert_eq!(drain(&mut inbox, 0, &mut st), [b"b".to_vec()]);
        assert_eq!(st.pen_overflow, 1);
        assert_eq!(drain(&mut inbox, 100, &mut st), [b"a".to_vec()]);
    }

    #[test]
    fn stale_incarnation_is_discarded_and_reset_empties_the_pen() {
        let (p, c) = channel(4, 8);
        let mut inbox = Inbox::new(c, 4, 8);
        let mut st = InboxStats::default();
        p.push(
            Envelope {
                tag: 7,
                ..env(0, 0)
            },
            b"old",
        )
        .unwrap();
        p.push(env(100, 0), b"pen").unwrap();
        assert!(drain(&mut inbox, 0, &mut st).is_empty());
        assert_eq!(st.discarded_stale, 1);
        inbox.reset();
        assert!(drain(&mut inbox, 200, &mut st).is_empty());
    }
}
