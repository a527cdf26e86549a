//! Benchmarks of the `Fabric` implementations: a notification round trip
//! (send + drain of one 64-byte heartbeat) and a 64-slot lease READ (64
//! descriptors of 8 bytes, and one 512-byte descriptor), each against a
//! naive baseline measured in the same run (the house rule: speed claims are
//! ratios against a naive baseline).
//!
//! The measurement loops are generic over [`Fabric`] (`notify_round_trip`,
//! `read_to_completion`), so every implementation is measured the same way.
//! Loopback and (behind the `nixl` feature) NIXL are measured side by side
//! in the same groups, with ids `loopback/...`, `nixl/...` and
//! `baseline/...`.
//!
//! Run: `cargo bench --bench fabric`. For NIXL too:
//!
//! ```text
//! eval "$(.ci/nixl-runtime.sh | tail -1)"
//! cargo bench --features nixl --bench fabric
//! ```
//!
//! Without the NIXL runtime (`libnixl_capi.so` not loadable) the NIXL
//! variants print why they are skipped and the rest runs, unless
//! `KVLEASE_REQUIRE_NIXL=1`, which makes the absence a panic (as in
//! `tests/nixl_fabric.rs`).

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
/// it, with `tx` draining too (its engine-loop step) while `rx` has nothing.
/// Any fabric.
///
/// The sender's drain is what a real engine loop does every step anyway,
/// and NIXL needs it: without a progress thread only the sender's own calls
/// progress its UCX worker, and a sender that never polls gets one
/// notification out and then none (measured: the second did not arrive in
/// two million receiver drains).
/// Loopback delivers at once, so its `tx` drain never runs.
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
            loop {
                rx.drain_notifications(&mut |_, m| got += m.len())
                    .expect("drain in a bench");
                if got != 0 {
                    break;
                }
                // Nothing is ever sent to `tx` here.
                tx.drain_notifications(&mut |_, _| {})
                    .expect("sender drain in a bench");
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

/// The 64-slot READ both ways: one 8-byte descriptor per slot, and one
/// 512-byte descriptor. Any fabric.
fn slot_descs(landing_region: RegionId, slot_region: RegionId) -> (Vec<ReadDesc>, [ReadDesc; 1]) {
    let words = kvlease::testkit::slot_word_descs(landing_region, 0, slot_region, 64);
    let block = [ReadDesc {
        local: landing_region,
        local_offset: 0,
        remote: slot_region,
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
        "loopback/d_to_p",
        &mut pair.d,
        to_p,
        &mut pair.p,
        HEARTBEAT,
    );
    let to_d = pair.to_d;
    notify_round_trip(
        &mut g,
        "loopback/p_to_d",
        &mut pair.p,
        to_d,
        &mut pair.d,
        HEARTBEAT,
    );
    drop(pair);
    #[cfg(feature = "nixl")]
    nixl::bench_notify(&mut g);

    // Naive baseline: a locked deque of owned messages (allocates per send).
    let queue: Mutex<VecDeque<(String, Vec<u8>)>> = Mutex::new(VecDeque::new());
    g.bench_function("baseline/mutex_vecdeque", |b| {
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
    let (words, block) = slot_descs(pair.landing_region, pair.slot_region);
    let now = || Instant::from_secs(1);
    let to_p = pair.to_p;
    read_to_completion(&mut g, "loopback/64x8", &mut pair.d, to_p, &words, &now);
    read_to_completion(&mut g, "loopback/1x512", &mut pair.d, to_p, &block, &now);
    #[cfg(feature = "nixl")]
    nixl::bench_read(&mut g);

    // Baseline: the floor, 64 direct atomic loads into a buffer, with no
    // fabric at all.
    let mut buf = [0u8; 512];
    g.bench_function("baseline/direct_loads", |b| {
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

/// NIXL variants, called from inside the loopback groups so that their
/// results sit next to loopback's: two connected NIXL fabrics in this
/// process (P exporting 64 lease slots, D with a 512-byte landing region),
/// engine-loop progress, UCX error handling `none` (the defaults), measured
/// with the same `notify_round_trip` / `read_to_completion` and a real clock.
#[cfg(feature = "nixl")]
mod nixl {
    use std::sync::Arc;
    use std::time::Duration;

    use criterion::measurement::WallTime;
    use criterion::BenchmarkGroup;
    use kvlease::fabric::nixl::{NixlConfig, NixlFabric, NixlInitError};
    use kvlease::fabric::{AgentId, Fabric, HandshakeState, RegionId};
    use kvlease::{LeaseSlots, MonotonicClock};

    use super::{notify_round_trip, read_to_completion, HEARTBEAT};

    /// Bound on a handshake (they take milliseconds).
    const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);

    /// P (exports 64 lease slots) and D (a 512-byte landing buffer), each
    /// handshaken with the other.
    struct NixlPair {
        p: NixlFabric,
        d: NixlFabric,
        to_p: AgentId,
        to_d: AgentId,
        slot_region: RegionId,
        landing_region: RegionId,
        clock: MonotonicClock,
    }

    /// Builds the pair, or prints why the NIXL variants of `group` are
    /// skipped and returns `None` when the runtime is absent.
    fn nixl_pair(group: &str) -> Option<NixlPair> {
        let clock = MonotonicClock::new();
        let config = |role: &str| {
            let mut cfg = NixlConfig::new(format!("kvl-bench-{role}-{}", std::process::id()));
            cfg.clock = clock;
            cfg
        };
        let mut p = match NixlFabric::new(config("p")) {
            Ok(p) => p,
            Err(NixlInitError::RuntimeNotFound) => {
                if std::env::var("KVLEASE_REQUIRE_NIXL").as_deref() == Ok("1") {
                    panic!(
                        "{group}: NIXL runtime not found and KVLEASE_REQUIRE_NIXL=1: \
                         run .ci/nixl-runtime.sh and export the LD_LIBRARY_PATH it prints"
                    );
                }
                println!(
                    "{group}/nixl/*: SKIPPED: NIXL runtime not found (libnixl_capi.so not \
                     loadable); run `eval \"$(.ci/nixl-runtime.sh | tail -1)\"` first"
                );
                return None;
            }
            Err(e) => panic!("{group}: NIXL fabric P: {e}"),
        };
        let mut d = NixlFabric::new(config("d")).expect("NIXL fabric D");
        let slots = Arc::new(LeaseSlots::new(64));
        let slot_region = p.register_slots(slots, true).expect("slots");
        // Leaked: the landing buffer must outlive the fabric and is only ever
        // written through it.
        let landing: &'static mut [u8] = Box::leak(vec![0u8; 512].into_boxed_slice());
        // SAFETY: leaked, so allocated and unmoved forever, and no Rust
        // reference to it is used after this point.
        let landing_region =
            unsafe { d.register_memory(landing.as_mut_ptr(), landing.len()) }.expect("landing");
        // Registrations first: a peer learns the regions in the handshake.
        let to_p = connect(&mut d, &mut p, clock);
        let to_d = connect(&mut p, &mut d, clock);
        Some(NixlPair {
            p,
            d,
            to_p,
            to_d,
            slot_region,
            landing_region,
            clock,
        })
    }

    /// Handshakes `from` with `to`, polling both (engine-loop progress needs
    /// every side to poll).
    fn connect(from: &mut NixlFabric, to: &mut NixlFabric, clock: MonotonicClock) -> AgentId {
        let addr = to.listen_addr().to_string();
        let id = from
            .start_handshake(&addr, clock.now())
            .expect("start handshake");
        let start = std::time::Instant::now();
        loop {
            to.drain_notifications(&mut |_, _| {}).expect("drain");
            match from.handshake_state(id, clock.now()) {
                HandshakeState::Ready(_) => return id,
                HandshakeState::Pending => {}
                HandshakeState::Failed(e) => panic!("NIXL handshake with {addr} failed: {e}"),
            }
            assert!(
                start.elapsed() < HANDSHAKE_WAIT,
                "NIXL handshake with {addr} not done in {HANDSHAKE_WAIT:?}"
            );
            std::thread::yield_now();
        }
    }

    /// `nixl/d_to_p` and `nixl/p_to_d` in the notification group.
    pub fn bench_notify(g: &mut BenchmarkGroup<'_, WallTime>) {
        let Some(mut pair) = nixl_pair(super::NOTIFY_GROUP) else {
            return;
        };
        let (to_p, to_d) = (pair.to_p, pair.to_d);
        notify_round_trip(g, "nixl/d_to_p", &mut pair.d, to_p, &mut pair.p, HEARTBEAT);
        notify_round_trip(g, "nixl/p_to_d", &mut pair.p, to_d, &mut pair.d, HEARTBEAT);
    }

    /// `nixl/64x8` and `nixl/1x512` in the READ group. P does not poll
    /// while D reads: a READ is one-sided (UCX error handling `none`).
    ///
    /// In one process UCX copies with `cma`: one `process_vm_readv` system
    /// call per descriptor (64 per `64x8` READ under strace, 1 per `1x512`),
    /// which is why `64x8` costs tens of times what `1x512` does.
    pub fn bench_read(g: &mut BenchmarkGroup<'_, WallTime>) {
        let Some(mut pair) = nixl_pair(super::READ_GROUP) else {
            return;
        };
        let (words, block) = super::slot_descs(pair.landing_region, pair.slot_region);
        let clock = pair.clock;
        // A real clock: the fabric's transfer timeout turns a stuck READ
        // into a panic in `read_to_completion` instead of a hang.
        let now = move || clock.now();
        let to_p = pair.to_p;
        read_to_completion(g, "nixl/64x8", &mut pair.d, to_p, &words, &now);
        read_to_completion(g, "nixl/1x512", &mut pair.d, to_p, &block, &now);
        let stats = pair.d.stats();
        println!(
            "{}/nixl: {} READs posted, request cache hits {} misses {}, failed {}",
            super::READ_GROUP,
            stats.reads_posted,
            stats.request_cache_hits,
            stats.request_cache_misses,
            stats.reads_failed
        );
    }
}

fn benches(c: &mut Criterion) {
    bench_notify(c);
    bench_read(c);
}

criterion_group!(fabric_benches, benches);
criterion_main!(fabric_benches);
