//! Benchmarks of the `Fabric` implementations: a notification round trip
//! (send + drain of one 64-byte heartbeat) and a 64-slot lease READ (64
//! descriptors of 8 bytes, and one 512-byte descriptor), each against a
//! naive baseline measured in the same run (the house rule: speed claims are
//! ratios against a naive baseline).
//!
//! The measurement loops are generic over [`Fabric`] (`notify_round_trip`,
//! `read_to_completion`), so every implementation is measured the same way.
//! Loopback is measured here; NIXL variants go in the marked `nixl` module
//! below, behind the `nixl` feature, reusing the same helpers and group
//! names so their results line up with loopback's.
//!
//! Run: `cargo bench --bench fabric` (add `--features nixl` for NIXL).

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use kvlease::fabric::loopback::{LoopbackConfig, LoopbackFabric, LoopbackNetwork};
use kvlease::fabric::{AgentId, Fabric, HandshakeState, ReadDesc, RegionId, XferState};
use kvlease::{Instant, LeaseSlots};

/// A heartbeat of 4 vLLM-style request ids: a typical small notification.
const HEARTBEAT: &[u8] = b"HB:cmpl-0f3a9c1e-42aa-4b1c-9d3e-000000000001-0,cmpl-1,cmpl-2,cmp";

/// Group names shared by every fabric's variants.
const NOTIFY_GROUP: &str = "fabric_notify_round_trip";
const READ_GROUP: &str = "fabric_read_64_slots";

fn configure(g: &mut BenchmarkGroup<'_, WallTime>) {
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(2));
}

// ------------------------------------------------ generic measurement loops

/// One iteration: `tx` sends `msg` to `to`, then `rx` drains until it got
/// it. Any fabric.
fn notify_round_trip<F: Fabric>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    tx: &mut F,
    to: AgentId,
    rx: &mut F,
    msg: &[u8],
) {
    g.bench_function(id, |b| {
        b.iter(|| {
            tx.send_notification(to, black_box(msg))
                .expect("send in a bench");
            let mut got = 0usize;
            while got == 0 {
                rx.drain_notifications(&mut |_, m| got += m.len())
                    .expect("drain in a bench");
            }
            black_box(got)
        })
    });
}

/// One iteration: post a READ of `descs` from `from`, poll it to
/// completion with `now()` as the time. Any fabric.
fn read_to_completion<F: Fabric>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    reader: &mut F,
    from: AgentId,
    descs: &[ReadDesc],
    now: &dyn Fn() -> Instant,
) {
    g.bench_function(id, |b| {
        b.iter(|| {
            let x = reader
                .post_read(from, black_box(descs), None, now())
                .expect("post in a bench");
            loop {
                match reader.read_state(x, now()) {
                    XferState::Done => break,
                    XferState::InProgress => {}
                    XferState::Failed(e) => panic!("READ failed in a bench: {e}"),
                }
            }
        })
    });
}

// ----------------------------------------------------------------- loopback

/// P (exports 64 lease slots) and D (a 512-byte landing buffer), connected.
struct LoopbackPair {
    p: LoopbackFabric,
    d: LoopbackFabric,
    to_p: AgentId,
    to_d: AgentId,
    slots: Arc<LeaseSlots>,
    slot_region: RegionId,
    landing_region: RegionId,
}

fn loopback_pair() -> LoopbackPair {
    let net = LoopbackNetwork::new(LoopbackConfig::default());
    let mut p = LoopbackFabric::join(&net, "P").expect("join");
    let mut d = LoopbackFabric::join(&net, "D").expect("join");
    let slots = Arc::new(LeaseSlots::new(64));
    let slot_region = p.register_slots(slots.clone(), true).expect("slots");
    // Leaked: the landing buffer must outlive the fabric and is only ever
    // written through it.
    let landing: &'static mut [u8] = Box::leak(vec![0u8; 512].into_boxed_slice());
    // SAFETY: leaked, so allocated and unmoved forever, and no Rust
    // reference to it is used after this point.
    let landing_region =
        unsafe { d.register_memory(landing.as_mut_ptr(), landing.len()) }.expect("landing");
    let connect = |a: &mut LoopbackFabric, b: &str| {
        let id = a.start_handshake(b, Instant::ZERO).expect("handshake");
        assert!(matches!(
            a.handshake_state(id, Instant::ZERO),
            HandshakeState::Ready(_)
        ));
        id
    };
    let to_p = connect(&mut d, "P");
    let to_d = connect(&mut p, "D");
    LoopbackPair {
        p,
        d,
        to_p,
        to_d,
        slots,
        slot_region,
        landing_region,
    }
}

fn slot_descs(pair: &LoopbackPair) -> (Vec<ReadDesc>, [ReadDesc; 1]) {
    let words = (0..64u32)
        .map(|s| ReadDesc {
            local: pair.landing_region,
            local_offset: 8 * u64::from(s),
            remote: pair.slot_region,
            remote_offset: LeaseSlots::offset_of(s),
            len: 8,
        })
        .collect();
    let block = [ReadDesc {
        local: pair.landing_region,
        local_offset: 0,
        remote: pair.slot_region,
        remote_offset: 0,
        len: 512,
    }];
    (words, block)
}

fn bench_notify(c: &mut Criterion) {
    let mut g = c.benchmark_group(NOTIFY_GROUP);
    configure(&mut g);
    g.throughput(Throughput::Elements(1));
    let mut pair = loopback_pair();
    let to_p = pair.to_p;
    notify_round_trip(
        &mut g,
        "loopback",
        &mut pair.d,
        to_p,
        &mut pair.p,
        HEARTBEAT,
    );
    let to_d = pair.to_d;
    notify_round_trip(
        &mut g,
        "loopback_p_to_d",
        &mut pair.p,
        to_d,
        &mut pair.d,
        HEARTBEAT,
    );

    // Naive baseline: a locked deque of owned messages (allocates per send).
    let queue: Mutex<VecDeque<(String, Vec<u8>)>> = Mutex::new(VecDeque::new());
    g.bench_function("baseline_mutex_vecdeque", |b| {
        b.iter(|| {
            queue
                .lock()
                .expect("bench lock")
                .push_back(("D".to_owned(), black_box(HEARTBEAT).to_vec()));
            let mut got = 0usize;
            while let Some((from, m)) = queue.lock().expect("bench lock").pop_front() {
                got += from.len() + m.len();
            }
            black_box(got)
        })
    });
    g.finish();
}

fn bench_read(c: &mut Criterion) {
    let mut g = c.benchmark_group(READ_GROUP);
    configure(&mut g);
    g.throughput(Throughput::Bytes(512));
    // The slots read 0 (publishing is the lease book's, crate-private); a
    // held slot costs the same atomic load.
    let mut pair = loopback_pair();
    let (words, block) = slot_descs(&pair);
    let now = || Instant::from_secs(1);
    let to_p = pair.to_p;
    read_to_completion(&mut g, "loopback_64x8", &mut pair.d, to_p, &words, &now);
    read_to_completion(&mut g, "loopback_1x512", &mut pair.d, to_p, &block, &now);

    // Baseline: the floor, 64 direct atomic loads into a buffer, with no
    // fabric at all.
    let mut buf = [0u8; 512];
    g.bench_function("baseline_direct_loads", |b| {
        b.iter(|| {
            for s in 0..64u32 {
                let w = pair.slots.load(black_box(s)).unwrap_or(0);
                buf[8 * s as usize..8 * s as usize + 8].copy_from_slice(&w.to_le_bytes());
            }
            black_box(&buf);
        })
    });
    g.finish();
}

// --------------------------------------------------------------------- NIXL

/// NIXL variants: build two connected NIXL fabrics (P exporting 64 lease
/// slots, D with a 512-byte landing region) and call `notify_round_trip` /
/// `read_to_completion` with ids like "nixl", "nixl_64x8", "nixl_1x512" in
/// groups `NOTIFY_GROUP` / `READ_GROUP`, with a real clock for `now`.
#[cfg(feature = "nixl")]
mod nixl {
    use criterion::Criterion;

    pub fn benches(_c: &mut Criterion) {
        // To be filled in with the NIXL fabric (src/fabric/nixl.rs).
    }
}

fn benches(c: &mut Criterion) {
    bench_notify(c);
    bench_read(c);
    #[cfg(feature = "nixl")]
    nixl::benches(c);
}

criterion_group!(fabric_benches, benches);
criterion_main!(fabric_benches);
