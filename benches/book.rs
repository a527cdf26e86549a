//! [`LeaseBook`] renewals and the whole per-step P-side cost, beside the
//! naive dict-based reaper, measured in the same run (our speed claims are
//! ratios).
//!
//! The baseline is a `HashMap<String, Instant>` keyed by request id (vLLM's
//! P-side shape, vLLM#50789): a heartbeat is split with `str::split(',')`
//! (after UTF-8 validation), each id is one hash lookup and a `max`, and
//! expiry is a scan of every entry (`retain`). It is a generous baseline: the
//! ids are borrowed, not copied into fresh strings as Python would.
//!
//! Each size (1k, 10k, 100k, 1M leases; `lease_capacity` = `lease_slots` =
//! size, default 30 s lease / 20 s extension / 10 ms tick / 128-byte ids) is
//! built once outside the timing: every lease granted, with vLLM-style ids
//! `cmpl-<32 hex>-0` (39 bytes). The heartbeat stream is a random
//! permutation of the ids cut into messages of 256 ids (`HB:id,id,...`,
//! encoded with `wire::encode_heartbeats`; the compact `HBC:` form of the
//! same leases with `wire::encode_compact_heartbeats`), replayed in a cycle.
//! One engine step is 8 messages (2048 ids) and 20 ms, so every lease is
//! renewed at least every 9.8 s (at 1M) against a 20 s extension: the book
//! stays at size and nothing expires (asserted).
//!
//! - `book_renew`: renewing one message's 256 ids, already split
//!   (`kvlease`: `renew` by id; `kvlease_slot`: `renew_slot` by the
//!   (slot, nonce) pairs of the compact form; `baseline`: lookup + max).
//!   Throughput in ids.
//! - `book_p_step`: the full P step: 8 heartbeat messages through
//!   `LeaseBook::on_notification` (`wire::decode`, then `renew` of every
//!   id), `poll(now)`, `drain_released` (`kvlease`: text form;
//!   `kvlease_compact`: the `HBC:` form, renewed through `renew_slot`;
//!   `baseline`: split, update, full scan). Throughput in ids.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode,
    Throughput,
};
use kvlease::testkit::SplitMix64;
use kvlease::wire::{self, CompactEntry};
use kvlease::{Instant, LeaseBook, Nonce, Renewal};

mod common;
use common::{granted_book, lease_config, map_poll, permutation, request_id};

const SIZES: [u32; 4] = [1_000, 10_000, 100_000, 1_000_000];
/// One engine step.
const STEP: Duration = Duration::from_millis(20);
const IDS_PER_MSG: usize = 256;
const MSGS_PER_STEP: usize = 8;
const T0: Instant = Instant::from_secs(1_000);

/// The heartbeat stream, identical for every variant.
struct Messages {
    /// `HB:id,...`, 256 ids each.
    text: Vec<String>,
    /// Byte ranges of the ids inside `text[j]` (the renew bench's pre-split ids).
    spans: Vec<Vec<(u32, u32)>>,
    /// `HBC:<records>` for the same leases.
    compact: Vec<Vec<u8>>,
    /// The (slot, nonce) pairs of `compact[j]`, pre-decoded.
    pairs: Vec<Vec<(u32, Nonce)>>,
}

/// Where one structure is in the stream, and its clock.
struct Stream {
    now: Instant,
    msg: usize,
    in_step: usize,
    msgs: usize,
}

impl Stream {
    fn new(msgs: usize) -> Stream {
        Stream {
            now: T0,
            msg: 0,
            in_step: 0,
            msgs,
        }
    }

    fn take_msg(&mut self) -> usize {
        let j = self.msg;
        self.msg = if j + 1 == self.msgs { 0 } else { j + 1 };
        j
    }

    /// The renew bench: the next message, and the step it belongs to.
    fn next_batch(&mut self) -> (usize, Instant) {
        if self.in_step == 0 {
            self.now = self.now + STEP;
        }
        self.in_step = (self.in_step + 1) % MSGS_PER_STEP;
        (self.take_msg(), self.now)
    }

    /// The P step: a new step's `now`.
    fn begin_step(&mut self) -> Instant {
        self.in_step = 0;
        self.now = self.now + STEP;
        self.now
    }
}

/// Counts what the timed code did, checked after each bench.
#[derive(Default)]
struct Tally {
    ids: u64,
    renewed: u64,
    released: u64,
    bad: u64,
}

impl Tally {
    /// (A bench left out by a filter ran nothing and passes.)
    fn check(&self, what: &str) {
        assert_eq!(self.renewed, self.ids, "{what}: every id must renew");
        assert_eq!(self.released, 0, "{what}: nothing may expire");
        assert_eq!(self.bad, 0, "{what}: every message must decode");
    }
}

struct Fixture {
    n: u32,
    extension: Duration,
    msgs: Messages,
    book: LeaseBook,
    book_stream: Stream,
    map: HashMap<String, Instant>,
    map_stream: Stream,
}

impl Fixture {
    fn build(n: u32) -> Fixture {
        let mut rng = SplitMix64::new(0x9e37_79b9_7f4a_7c15 ^ u64::from(n));
        let cfg = lease_config(n);
        let ids: Vec<String> = (0..n).map(|_| request_id(&mut rng)).collect();
        let (book, map, lease_fields) = granted_book(&cfg, &ids, T0);
        let order = permutation(n, &mut rng);
        let count = (n as usize).div_ceil(IDS_PER_MSG);
        let mut msgs = Messages {
            text: Vec::with_capacity(count),
            spans: Vec::with_capacity(count),
            compact: Vec::with_capacity(count),
            pairs: Vec::with_capacity(count),
        };
        let mut scratch = vec![0u8; 64 * 1024];
        for j in 0..count {
            // Wraps around at the end, so every message has 256 ids.
            let entries: Vec<u32> = (0..IDS_PER_MSG)
                .map(|i| order[(j * IDS_PER_MSG + i) % n as usize])
                .collect();
            let mut text = Vec::new();
            let stats = wire::encode_heartbeats(
                entries.iter().map(|&e| ids[e as usize].as_str()),
                scratch.len(),
                &mut scratch,
                |m| text.push(String::from_utf8(m.to_vec()).expect("ASCII")),
            )
            .expect("encode");
            assert_eq!((stats.messages, stats.skipped), (1, 0));
            let text = text.pop().expect("one message");
            let mut spans = Vec::with_capacity(IDS_PER_MSG);
            let mut at = 3u32; // after "HB:"
            for id in text[3..].split(',') {
                spans.push((at, at + id.len() as u32));
                at += id.len() as u32 + 1;
            }
            let pairs: Vec<(u32, Nonce)> = entries
                .iter()
                .map(|&e| {
                    let f = lease_fields[e as usize];
                    (f.slot, f.nonce)
                })
                .collect();
            let mut compact = Vec::new();
            let stats = wire::encode_compact_heartbeats(
                pairs
                    .iter()
                    .map(|&(slot, nonce)| CompactEntry { slot, nonce }),
                4 + 24 * IDS_PER_MSG,
                &mut scratch,
                |m| compact.push(m.to_vec()),
            )
            .expect("encode");
            assert_eq!(stats.messages, 1);
            msgs.text.push(text);
            msgs.spans.push(spans);
            msgs.compact.push(compact.pop().expect("one message"));
            msgs.pairs.push(pairs);
        }
        Fixture {
            n,
            extension: cfg.lease_extension(),
            msgs,
            book,
            book_stream: Stream::new(count),
            map,
            map_stream: Stream::new(count),
        }
    }

    fn assert_at_size(&self) {
        assert_eq!(self.book.held(), self.n, "the book stays at size");
        assert_eq!(self.map.len(), self.n as usize, "the map stays at size");
    }
}

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    g
}

fn bench_renew(c: &mut Criterion, f: &mut Fixture) {
    let n = f.n;
    let mut g = group(c, "book_renew");
    g.throughput(Throughput::Elements(IDS_PER_MSG as u64));
    let msgs = &f.msgs;
    let book = &mut f.book;
    let s = &mut f.book_stream;

    let mut t = Tally::default();
    g.bench_function(BenchmarkId::new("kvlease", n), |b| {
        b.iter(|| {
            let (j, now) = s.next_batch();
            let msg = msgs.text[j].as_bytes();
            for &(a, z) in &msgs.spans[j] {
                let r = book.renew(black_box(&msg[a as usize..z as usize]), now);
                t.renewed += u64::from(r == Renewal::Renewed);
            }
            t.ids += IDS_PER_MSG as u64;
        })
    });
    t.check("book_renew/kvlease");

    // The heartbeat path: the same ids through the batched `renew_all`
    // (what `on_notification` uses), so cache misses overlap.
    let mut t = Tally::default();
    g.bench_function(BenchmarkId::new("kvlease_batched", n), |b| {
        b.iter(|| {
            let (j, now) = s.next_batch();
            let msg = msgs.text[j].as_bytes();
            let ids = msgs.spans[j]
                .iter()
                .map(|&(a, z)| black_box(&msg[a as usize..z as usize]));
            let (renewed, _) = book.renew_all(ids, now);
            t.renewed += u64::from(renewed);
            t.ids += IDS_PER_MSG as u64;
        })
    });
    t.check("book_renew/kvlease_batched");

    let mut t = Tally::default();
    g.bench_function(BenchmarkId::new("kvlease_slot", n), |b| {
        b.iter(|| {
            let (j, now) = s.next_batch();
            for &(slot, nonce) in &msgs.pairs[j] {
                let r = book.renew_slot(black_box(slot), nonce, now);
                t.renewed += u64::from(r == Renewal::Renewed);
            }
            t.ids += IDS_PER_MSG as u64;
        })
    });
    t.check("book_renew/kvlease_slot");

    let mut t = Tally::default();
    g.bench_function(BenchmarkId::new("kvlease_slot_batched", n), |b| {
        b.iter(|| {
            let (j, now) = s.next_batch();
            let (renewed, _) = book.renew_slots_all(
                msgs.pairs[j]
                    .iter()
                    .map(|&(slot, nonce)| (black_box(slot), nonce)),
                now,
            );
            t.renewed += u64::from(renewed);
            t.ids += IDS_PER_MSG as u64;
        })
    });
    t.check("book_renew/kvlease_slot_batched");

    let map = &mut f.map;
    let s = &mut f.map_stream;
    let extension = f.extension;
    let mut t = Tally::default();
    g.bench_function(BenchmarkId::new("baseline", n), |b| {
        b.iter(|| {
            let (j, now) = s.next_batch();
            let to = now + extension;
            let msg = msgs.text[j].as_str();
            for &(a, z) in &msgs.spans[j] {
                if let Some(d) = map.get_mut(black_box(&msg[a as usize..z as usize])) {
                    *d = (*d).max(to);
                    t.renewed += 1;
                }
            }
            t.ids += IDS_PER_MSG as u64;
        })
    });
    t.check("book_renew/baseline");
    g.finish();
    f.assert_at_size();
}

fn bench_p_step(c: &mut Criterion, f: &mut Fixture) {
    let n = f.n;
    let mut g = group(c, "book_p_step");
    g.throughput(Throughput::Elements((IDS_PER_MSG * MSGS_PER_STEP) as u64));
    let msgs = &f.msgs;
    let book = &mut f.book;
    let s = &mut f.book_stream;

    // The same step for both heartbeat forms; only the message bytes differ.
    type Message = fn(&Messages, usize) -> &[u8];
    let forms: [(&str, Message); 2] = [
        ("kvlease", |m, j| m.text[j].as_bytes()),
        ("kvlease_compact", |m, j| &m.compact[j]),
    ];
    for (name, message) in forms {
        let mut t = Tally::default();
        g.bench_function(BenchmarkId::new(name, n), |b| {
            b.iter(|| {
                let now = s.begin_step();
                for _ in 0..MSGS_PER_STEP {
                    let j = s.take_msg();
                    match book.on_notification(0, "d0", black_box(message(msgs, j)), now) {
                        Ok(sum) => {
                            t.renewed += u64::from(sum.renewed);
                            t.ids += u64::from(sum.renewed + sum.ignored);
                        }
                        Err(_) => t.bad += 1,
                    }
                }
                book.poll(now);
                book.drain_released(|r| {
                    black_box(r);
                    t.released += 1;
                });
            })
        });
        t.check(&format!("book_p_step/{name}"));
    }

    if n >= 1_000_000 {
        // A full scan of 1M entries per step: fewer, flat samples.
        g.sample_size(10).sampling_mode(SamplingMode::Flat);
    }
    let map = &mut f.map;
    let s = &mut f.map_stream;
    let extension = f.extension;
    let mut t = Tally::default();
    g.bench_function(BenchmarkId::new("baseline", n), |b| {
        b.iter(|| {
            let now = s.begin_step();
            let to = now + extension;
            for _ in 0..MSGS_PER_STEP {
                let j = s.take_msg();
                let bytes = black_box(msgs.text[j].as_bytes());
                let Some(body) = std::str::from_utf8(bytes)
                    .ok()
                    .and_then(|m| m.strip_prefix("HB:"))
                else {
                    t.bad += 1;
                    continue;
                };
                for id in body.split(',') {
                    if let Some(d) = map.get_mut(id) {
                        *d = (*d).max(to);
                        t.renewed += 1;
                    }
                    t.ids += 1;
                }
            }
            t.released += map_poll(map, now);
        })
    });
    t.check("book_p_step/baseline");
    g.finish();
    f.assert_at_size();
}

fn benches(c: &mut Criterion) {
    for n in SIZES {
        let mut f = Fixture::build(n);
        bench_renew(c, &mut f);
        bench_p_step(c, &mut f);
    }
}

criterion_group!(book_benches, benches);
criterion_main!(book_benches);
