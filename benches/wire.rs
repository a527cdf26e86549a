//! Benchmarks of `kvlease::wire`: decoding (with every entry iterated) and
//! encoding of a 256-entry heartbeat, text and compact, each against a naive
//! baseline measured in the same run (the house rule: speed claims are
//! ratios against a naive baseline).
//!
//! Read-dones are measured the same way (256 encoded one by one).
//!
//! Text ids look like vLLM's (`cmpl-<uuid>-0`, 43 bytes). Run with
//! `cargo bench --bench wire`; throughput is in message bytes.

use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use kvlease::testkit::SplitMix64;
use kvlease::wire::{self, CompactEntry, Notification};
use kvlease::Nonce;

mod common;
use common::uuid_request_id;

const ENTRIES: usize = 256;

/// `cmpl-xxxxxxxx-xxxx-4xxx-yxxx-xxxxxxxxxxxx-0`, like vLLM's request ids.
fn vllm_ids(rng: &mut SplitMix64) -> Vec<String> {
    (0..ENTRIES)
        .map(|_| {
            let (a, b) = (rng.next_u64(), rng.next_u64());
            uuid_request_id("cmpl", a, b)
        })
        .collect()
}

fn compact_entries(rng: &mut SplitMix64) -> Vec<CompactEntry> {
    (0..ENTRIES)
        .map(|_| CompactEntry {
            slot: (rng.next_u64() % 100_000) as u32,
            nonce: Nonce::new(rng.next_u64() | 1).expect("odd, so non-zero"),
        })
        .collect()
}

/// A group over one message of `bytes` bytes, with the file's timings.
fn group<'a>(c: &'a mut Criterion, name: &str, bytes: usize) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Bytes(bytes as u64));
    g
}

fn one_message(f: impl FnOnce(&mut [u8], &mut dyn FnMut(&[u8]))) -> Vec<u8> {
    let mut scratch = vec![0u8; 1 << 16];
    let mut out = Vec::new();
    f(&mut scratch, &mut |m| out.push(m.to_vec()));
    assert_eq!(out.len(), 1, "expected one message");
    out.remove(0)
}

fn bench_heartbeat(c: &mut Criterion) {
    let ids = vllm_ids(&mut SplitMix64::new(1));
    let msg = one_message(|scratch, emit| {
        wire::encode_heartbeats(ids.iter().map(String::as_str), 1 << 16, scratch, emit)
            .expect("encode");
    });

    let mut g = group(c, "wire/heartbeat_decode_256", msg.len());
    g.bench_function("kvlease", |b| {
        b.iter(|| {
            let mut total = 0usize;
            if let Ok(Notification::Heartbeat(ids)) = wire::decode(black_box(&msg)) {
                for id in ids {
                    total += black_box(id).len();
                }
            }
            total
        })
    });
    g.bench_function("naive_string_split", |b| {
        b.iter(|| {
            let s = String::from_utf8(black_box(&msg).to_vec()).expect("utf8");
            let body = s.strip_prefix("HB:").expect("prefix");
            let ids: Vec<String> = body.split(',').map(String::from).collect();
            ids
        })
    });
    g.finish();

    let mut g = group(c, "wire/heartbeat_encode_256", msg.len());
    let mut scratch = vec![0u8; 1 << 16];
    g.bench_function("kvlease", |b| {
        b.iter(|| {
            let mut len = 0;
            wire::encode_heartbeats(
                black_box(&ids).iter().map(String::as_str),
                1 << 16,
                &mut scratch,
                |m| len += black_box(m).len(),
            )
            .expect("encode");
            len
        })
    });
    // The same ids split for a 4 KiB fabric limit (3 messages).
    g.bench_function("kvlease_split_4k", |b| {
        b.iter(|| {
            let mut len = 0;
            wire::encode_heartbeats(
                black_box(&ids).iter().map(String::as_str),
                4096,
                &mut scratch,
                |m| len += black_box(m).len(),
            )
            .expect("encode");
            len
        })
    });
    // Same job as ours minus splitting: drop ids that cannot be sent.
    g.bench_function("naive_filter_join", |b| {
        b.iter(|| {
            let ok: Vec<&str> = black_box(&ids)
                .iter()
                .map(String::as_str)
                .filter(|id| !id.is_empty() && !id.contains(','))
                .collect();
            format!("HB:{}", ok.join(","))
        })
    });
    // Less than our job: no id checks at all (a lower bound, not a peer).
    g.bench_function("naive_join_unchecked", |b| {
        b.iter(|| format!("HB:{}", black_box(&ids).join(",")))
    });
    g.finish();
}

fn bench_compact(c: &mut Criterion) {
    let entries = compact_entries(&mut SplitMix64::new(2));
    let msg = one_message(|scratch, emit| {
        wire::encode_compact_heartbeats(entries.iter().copied(), 1 << 16, scratch, emit)
            .expect("encode");
    });

    let mut g = group(c, "wire/compact_decode_256", msg.len());
    g.bench_function("kvlease", |b| {
        b.iter(|| {
            let mut acc = 0u64;
            if let Ok(Notification::CompactHeartbeat(entries)) = wire::decode(black_box(&msg)) {
                for e in entries {
                    acc ^= u64::from(e.slot) ^ e.nonce.get();
                }
            }
            acc
        })
    });
    g.bench_function("naive_from_str_radix", |b| {
        b.iter(|| {
            let s = String::from_utf8(black_box(&msg).to_vec()).expect("utf8");
            let body = s.strip_prefix("HBC:").expect("prefix");
            let out: Vec<(u32, u64)> = (0..body.len() / 24)
                .map(|i| {
                    let r = &body[i * 24..i * 24 + 24];
                    (
                        u32::from_str_radix(&r[..8], 16).expect("slot"),
                        u64::from_str_radix(&r[8..], 16).expect("nonce"),
                    )
                })
                .collect();
            out
        })
    });
    g.finish();

    let mut g = group(c, "wire/compact_encode_256", msg.len());
    let mut scratch = vec![0u8; 1 << 16];
    g.bench_function("kvlease", |b| {
        b.iter(|| {
            let mut len = 0;
            wire::encode_compact_heartbeats(
                black_box(&entries).iter().copied(),
                1 << 16,
                &mut scratch,
                |m| len += black_box(m).len(),
            )
            .expect("encode");
            len
        })
    });
    g.bench_function("naive_format", |b| {
        b.iter(|| {
            use std::fmt::Write;
            let mut s = String::from("HBC:");
            for e in black_box(&entries) {
                let _ = write!(s, "{:08x}{:016x}", e.slot, e.nonce.get());
            }
            s
        })
    });
    g.finish();
}

/// 256 read-dones (`id:consumers:nonce=<hex>`), each encoded into one
/// reused buffer, against `format!`. The consumer counts are the engine
/// shapes' (1 to 16 D ranks reading one P rank's blocks).
fn bench_read_done(c: &mut Criterion) {
    let ids: Vec<String> = (0..ENTRIES).map(|i| format!("cmpl-{i:032x}-0")).collect();
    let consumers = |i: usize| [1u32, 2, 4, 8, 16, 1, 3, 12][i % 8];
    let nonce = |i: usize| Nonce::new(0x9e37_79b9_0000_0001 ^ i as u64).expect("odd");
    let bytes = (0..ENTRIES)
        .map(|i| wire::read_done_len(&ids[i], consumers(i), Some(nonce(i))))
        .sum();
    let mut g = group(c, "wire/read_done_encode_256", bytes);
    let mut out = vec![0u8; 256];
    g.bench_function("kvlease", |b| {
        b.iter(|| {
            let mut len = 0;
            for (i, id) in black_box(&ids).iter().enumerate() {
                len += wire::encode_read_done(id, consumers(i), Some(nonce(i)), &mut out)
                    .expect("encode");
            }
            len
        })
    });
    g.bench_function("naive_format", |b| {
        b.iter(|| {
            let mut len = 0;
            for (i, id) in black_box(&ids).iter().enumerate() {
                let m = format!("{id}:{}:nonce={:016x}", consumers(i), nonce(i).get());
                len += black_box(m).len();
            }
            len
        })
    });
    g.finish();
}

criterion_group!(benches, bench_heartbeat, bench_compact, bench_read_done);
criterion_main!(benches);
