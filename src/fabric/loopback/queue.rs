//! A bounded, lock-free, multi-producer single-consumer queue of byte
//! messages in fixed-size cells: one per receiving loopback agent.
//!
//! This module owns the ring, its cells and the publication protocol between
//! senders and the receiver. It knows nothing about agents, faults or time:
//! the [`Envelope`] that travels with each message is opaque to it.
//!
//! # Why this shape
//!
//! - **Preallocated cells.** Every cell holds up to `max_len` bytes, allocated
//!   once by [`channel`]. [`QueueProducer::push`] copies into a cell and
//!   [`QueueConsumer::pop_with`] lends the bytes in place, so neither side
//!   touches the heap after construction.
//! - **Lock-free.** Senders on any thread claim a position with one CAS on
//!   the tail; a full ring is reported at once ([`QueueError::Full`]), never
//!   waited out. The receiver is the single owner of the head (the consumer
//!   handle is not `Clone`), so it needs no CAS.
//! - **Loom-checked.** Every atomic comes from `crate::sync` and the cell
//!   bodies sit in an `UnsafeCell` that is loom's under `cfg(loom)`, so
//!   `loom_tests/loopback_queue.rs` sees any read of a cell racing its write.
//!
//! # Protocol (D. Vyukov's bounded queue, one consumer)
//!
//! ```text
//!   positions are u64 and only grow (2^64 messages never wrap in practice)
//!   cell i serves positions p with p % cap == i; its seq says whose turn it is:
//!     seq == p        free for the producer that claims position p
//!     seq == p + 1    holds the message of position p (published, Release)
//!     seq == p + cap  consumed; free for position p + cap
//!
//!   producer: p = tail; seq(cell p) == p ? CAS tail p -> p+1, write, seq = p+1
//!                       seq < p       ? full (last lap's message unread)
//!                       seq > p       ? another producer took p: reload tail
//!   consumer: seq(cell head) == head+1 ? read, seq = head+cap, head += 1
//!                                      : empty (or a claimed cell not yet
//!                                        published: later cells wait for it)
//! ```
//!
//! The three states must be distinct words, so `cap >= 2`: with one cell,
//! "holds position p" (`p + 1`) equals "free for position p + 1"
//! (`p + cap`), and a second push would overwrite an unread message while
//! the consumer may be reading it. [`channel`] raises a smaller capacity.
//!
//! The consumer's Acquire load of `seq` pairs with the producer's Release
//! store after writing the body; the producer's Acquire load pairs with the
//! consumer's Release store after reading it. So a body is never read while
//! written, nor overwritten while read.

use crossbeam_utils::CachePadded;

use std::sync::Arc;

use crate::sync::{AtomicU64, Ordering};

// Loom's `UnsafeCell` under `cfg(loom)` (it checks every access against the
// happens-before order); a zero-cost wrapper with the same closure API
// otherwise. Kept here rather than in `crate::sync` because only this queue
// needs it so far.
#[cfg(loom)]
use loom::cell::UnsafeCell;

#[cfg(not(loom))]
#[derive(Debug)]
struct UnsafeCell<T>(core::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    fn new(value: T) -> UnsafeCell<T> {
        UnsafeCell(core::cell::UnsafeCell::new(value))
    }

    fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// Metadata that travels with a message. The queue copies it and hands it
/// back; what the fields mean is the caller's business (the loopback fabric
/// uses them for the sender, the receiver's incarnation and delivery time).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Envelope {
    /// The sending agent's index on its network.
    pub sender: u32,
    /// Free for the caller (the loopback fabric: flags).
    pub flags: u32,
    /// Free for the caller (the loopback fabric: the receiver's incarnation).
    pub tag: u32,
    /// Free for the caller (the loopback fabric: earliest delivery, ns).
    pub stamp: u64,
}

/// The fewest cells a queue has (see the module docs on why not 1).
pub const MIN_CAPACITY: u32 = 2;

/// Why a push was refused. The message was not enqueued.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    /// Every cell holds an unread message.
    #[error("loopback notification queue is full")]
    Full,
    /// The message is longer than a cell (`max_len`).
    #[error("notification is longer than a loopback queue cell")]
    TooLarge,
}

/// What a cell holds: written only by the producer that claimed it, read
/// only by the consumer once published.
struct Body {
    envelope: Envelope,
    len: usize,
    bytes: Box<[u8]>,
}

struct Cell {
    seq: AtomicU64,
    body: UnsafeCell<Body>,
}

struct Shared {
    /// Next position a producer claims.
    tail: CachePadded<AtomicU64>,
    cells: Box<[CachePadded<Cell>]>,
    max_len: usize,
}

// SAFETY: the only non-Sync part is each cell's `body`. The seq protocol in
// the module docs gives exclusive access to it: one producer between its
// successful CAS and its Release store of `seq = p + 1`, then the single
// consumer between its Acquire load of that and its Release store of
// `seq = p + cap`. Bodies hold plain bytes, so moving them between threads
// (Send) is fine.
unsafe impl Sync for Shared {}
// SAFETY: see above; `Shared` owns plain data and atomics.
unsafe impl Send for Shared {}

/// The sending side of a queue. Cheap to clone; usable from any thread.
#[derive(Clone)]
pub struct QueueProducer {
    shared: Arc<Shared>,
}

/// The receiving side of a queue: exactly one exists per queue.
pub struct QueueConsumer {
    shared: Arc<Shared>,
    /// Next position to read. Owned here (not shared) because there is one
    /// consumer.
    head: u64,
}

impl core::fmt::Debug for QueueProducer {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("QueueProducer")
            .field("capacity", &self.shared.cells.len())
            .field("max_len", &self.shared.max_len)
            .finish()
    }
}

impl core::fmt::Debug for QueueConsumer {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("QueueConsumer")
            .field("capacity", &self.shared.cells.len())
            .field("head", &self.head)
            .finish()
    }
}

/// A queue of `capacity` cells of `max_len` bytes each (capacity is raised
/// to at least 2: with one cell the protocol cannot tell "published, unread"
/// from "free for the next lap", see the module docs). All memory is
/// allocated here.
pub fn channel(capacity: u32, max_len: usize) -> (QueueProducer, QueueConsumer) {
    let capacity = capacity.max(MIN_CAPACITY);
    let cells: Box<[CachePadded<Cell>]> = (0..u64::from(capacity))
        .map(|i| {
            CachePadded::new(Cell {
                seq: AtomicU64::new(i),
                body: UnsafeCell::new(Body {
                    envelope: Envelope::default(),
                    len: 0,
                    bytes: vec![0u8; max_len].into_boxed_slice(),
                }),
            })
        })
        .collect();
    let shared = Arc::new(Shared {
        tail: CachePadded::new(AtomicU64::new(0)),
        cells,
        max_len,
    });
    (
        QueueProducer {
            shared: shared.clone(),
        },
        QueueConsumer { shared, head: 0 },
    )
}

impl Shared {
    fn cell(&self, pos: u64) -> &Cell {
        // `cells` is non-empty (capacity >= 2), and the remainder is below
        // its length, so the index is in range.
        &self.cells[(pos % self.cells.len() as u64) as usize]
    }
}

impl QueueProducer {
    /// Copies `msg` with `envelope` into a free cell. Lock-free, never
    /// blocks, never allocates.
    pub fn push(&self, envelope: Envelope, msg: &[u8]) -> Result<(), QueueError> {
        let shared = &*self.shared;
        if msg.len() > shared.max_len {
            return Err(QueueError::TooLarge);
        }
        let mut pos = shared.tail.load(Ordering::Relaxed);
        loop {
            let cell = shared.cell(pos);
            let seq = cell.seq.load(Ordering::Acquire);
            if seq == pos {
                match shared.tail.compare_exchange_weak(
                    pos,
                    pos + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        cell.body.with_mut(|body| {
                            // SAFETY: the CAS made position `pos` ours, and
                            // seq == pos (loaded with Acquire) says the
                            // consumer finished with the cell's last lap, so
                            // nobody else touches the body until we publish.
                            let body = unsafe { &mut *body };
                            body.envelope = envelope;
                            body.len = msg.len();
                            body.bytes[..msg.len()].copy_from_slice(msg);
                        });
                        cell.seq.store(pos + 1, Ordering::Release);
                        return Ok(());
                    }
                    Err(actual) => pos = actual,
                }
            } else if seq < pos {
                // The cell still holds the message from one lap ago.
                return Err(QueueError::Full);
            } else {
                // Another producer claimed `pos` after we read the tail.
                pos = shared.tail.load(Ordering::Relaxed);
            }
        }
    }

    /// Number of cells.
    pub fn capacity(&self) -> u32 {
        self.shared.cells.len() as u32
    }

    /// Largest message a cell holds.
    pub fn max_len(&self) -> usize {
        self.shared.max_len
    }
}

impl QueueConsumer {
    /// Hands the oldest published message to `f` (its envelope and bytes,
    /// borrowed from the cell) and frees the cell after `f` returns; `None`
    /// when there is none. Never allocates.
    ///
    /// If `f` panics the cell is not freed and the message is handed out
    /// again by the next call.
    pub fn pop_with<R>(&mut self, f: impl FnOnce(Envelope, &[u8]) -> R) -> Option<R> {
        let shared = &*self.shared;
        let cap = shared.cells.len() as u64;
        let cell = shared.cell(self.head);
        if cell.seq.load(Ordering::Acquire) != self.head + 1 {
            return None;
        }
        let out = cell.body.with(|body| {
            // SAFETY: seq == head + 1 (Acquire) means the producer of this
            // position published the body and will not touch it again; no
            // producer reuses the cell before our Release store below.
            let body = unsafe { &*body };
            f(body.envelope, &body.bytes[..body.len])
        });
        cell.seq.store(self.head + cap, Ordering::Release);
        self.head += 1;
        Some(out)
    }

    /// Number of cells.
    pub fn capacity(&self) -> u32 {
        self.shared.cells.len() as u32
    }

    /// A producer handle for this queue.
    pub fn producer(&self) -> QueueProducer {
        QueueProducer {
            shared: self.shared.clone(),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn env(sender: u32) -> Envelope {
        Envelope {
            sender,
            ..Envelope::default()
        }
    }

    fn pop(c: &mut QueueConsumer) -> Option<(u32, Vec<u8>)> {
        c.pop_with(|e, b| (e.sender, b.to_vec()))
    }

    #[test]
    fn queue_error_displays_and_is_an_error() {
        let (p, _c) = channel(2, 4);
        let big = p.push(env(0), b"12345").unwrap_err();
        p.push(env(0), b"1").unwrap();
        p.push(env(0), b"2").unwrap();
        let full = p.push(env(0), b"3").unwrap_err();
        assert_eq!((big, full), (QueueError::TooLarge, QueueError::Full));
        let (a, b): (&dyn std::error::Error, &dyn std::error::Error) = (&big, &full);
        assert!(a.to_string().contains("longer"), "{a}");
        assert!(b.to_string().contains("full"), "{b}");
    }

    /// With one cell, "published at p" (seq = p + 1) and "free for p + 1"
    /// (seq = p + cap) are the same word, so a second push took the cell of
    /// an unread message: lost, and overwritten under a reading consumer.
    #[test]
    fn capacity_one_queue_never_overwrites_an_unread_message() {
        let (p, mut c) = channel(1, 4);
        let mut accepted = Vec::new();
        for i in 0..10u8 {
            match p.push(env(u32::from(i)), &[i]) {
                Ok(()) => accepted.push((u32::from(i), vec![i])),
                Err(e) => {
                    assert_eq!(e, QueueError::Full);
                    break;
                }
            }
        }
        assert!(accepted.len() < 10, "a bounded queue filled up");
        let popped: Vec<_> = std::iter::from_fn(|| pop(&mut c)).collect();
        assert_eq!(popped, accepted, "every accepted message, in order");
    }

    #[test]
    fn fifo_until_full_then_refuses() {
        let (p, mut c) = channel(3, 8);
        for i in 0..3u8 {
            p.push(env(u32::from(i)), &[i; 3]).unwrap();
        }
        assert_eq!(p.push(env(9), b"x"), Err(QueueError::Full));
        assert_eq!(pop(&mut c), Some((0, vec![0; 3])));
        p.push(env(3), b"").unwrap();
        assert_eq!(pop(&mut c), Some((1, vec![1; 3])));
        assert_eq!(pop(&mut c), Some((2, vec![2; 3])));
        assert_eq!(pop(&mut c), Some((3, vec![])));
        assert_eq!(pop(&mut c), None);
    }

    #[test]
    fn oversize_is_refused_and_exact_size_fits() {
        let (p, mut c) = channel(2, 4);
        assert_eq!(p.push(env(0), b"12345"), Err(QueueError::TooLarge));
        p.push(env(0), b"1234").unwrap();
        assert_eq!(pop(&mut c), Some((0, b"1234".to_vec())));
    }

    #[test]
    fn wraps_many_laps() {
        let (p, mut c) = channel(2, 8);
        // Miri (.ci/run's bounded step) interprets this ~1000x slower.
        for i in 0..if cfg!(miri) { 50u64 } else { 1000 } {
            p.push(env(i as u32), &i.to_le_bytes()).unwrap();
            assert_eq!(pop(&mut c), Some((i as u32, i.to_le_bytes().to_vec())));
        }
        assert_eq!(c.capacity(), 2);
        assert_eq!(c.producer().max_len(), 8);
    }

    #[test]
    fn threads_deliver_everything_once_and_intact() {
        // Miri (.ci/run's bounded step) interprets this ~1000x slower.
        const PER: u32 = if cfg!(miri) { 200 } else { 20_000 };
        let (p, mut c) = channel(16, 8);
        let mut seen = vec![0u32; 3];
        std::thread::scope(|s| {
            for t in 0..3u32 {
                let p = p.clone();
                s.spawn(move || {
                    for i in 0..PER {
                        let mut msg = [0u8; 8];
                        msg[..4].copy_from_slice(&t.to_le_bytes());
                        msg[4..].copy_from_slice(&i.to_le_bytes());
                        while p.push(env(t), &msg).is_err() {
                            std::thread::yield_now();
                        }
                    }
                });
            }
            let mut got = 0;
            while got < 3 * PER {
                let popped = c.pop_with(|e, b| {
                    let t = u32::from_le_bytes(b[..4].try_into().unwrap());
                    let i = u32::from_le_bytes(b[4..].try_into().unwrap());
                    assert_eq!(e.sender, t, "envelope and body disagree");
                    (t, i)
                });
                match popped {
                    Some((t, i)) => {
                        // Per-producer FIFO.
                        assert_eq!(seen[t as usize], i);
                        seen[t as usize] += 1;
                        got += 1;
                    }
                    None => std::thread::yield_now(),
                }
            }
        });
        assert_eq!(seen, vec![PER; 3]);
    }
}
