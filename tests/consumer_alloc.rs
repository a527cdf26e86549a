//! Zero allocation on the D side: after construction, 100,000 steady-state
//! steps (requests arriving with and without leases, finishing and
//! completing; engines appearing, disappearing and being refused when full;
//! tracker `due` feeding two D ranks' senders over P TP 1, 2 and 4 with
//! deferred, failing and compact peers) allocate exactly nothing. Also
//! measures what the tracker reserves at construction per tracked request,
//! the figure `docs/embedding.md` gives for `kv_lease_max_tracked_requests`.
//!
//! A counting `#[global_allocator]` counts allocations made on the test's
//! own thread while armed (a thread-local flag, so the harness's threads do
//! not interfere).

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use counting_alloc::{count_allocs, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

use std::time::Duration;

use kvlease::consumer::{
    DefaultPeerAddress, HeartbeatSender, HeartbeatTracker, RemotePrefillParams, SenderConfig,
    TrackOutcome,
};
use kvlease::testkit::{FakeFabric, Policy, SplitMix64};
use kvlease::{EngineShape, Instant, LeaseConfig};

/// Writes `prefix` and `n` in decimal into `buf`; returns the text.
fn id_into<'b, const N: usize>(buf: &'b mut [u8; N], prefix: &[u8], n: u64) -> &'b str {
    let len = counting_alloc::id_into(buf, prefix, n);
    std::str::from_utf8(&buf[..len]).unwrap()
}

/// 18 engines for 16 engine slots: once 16 are live, the other two are
/// refused (typed, counted) until one of the live ones empties.
const ENGINES: [&str; 18] = [
    "e00", "e01", "e02", "e03", "e04", "e05", "e06", "e07", "e08", "e09", "e10", "e11", "e12",
    "e13", "e14", "e15", "e16", "e17",
];
const STEPS: u64 = 100_000;
const TARGET_LIVE: usize = 2_000;

#[test]
fn steady_state_d_steps_allocate_nothing() {
    // ---- construction (may allocate) ----
    let mut config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 8192,
        max_num_seqs: 256,
    });
    config.max_tracked_requests = 4096;
    config.max_remote_engines = 16;
    config.validate().unwrap();
    let mut tracker = HeartbeatTracker::new(&config, 1).expect("tracker");
    let make_fabric = || {
        // Notifications of at most 512 bytes force splitting; the log keeps
        // the first 1,024 messages, the counters count all of them.
        let mut f = FakeFabric::new(512, 256, 1024, 1 << 18);
        f.set_policy("p0:5600/e03/", Policy::unreachable());
        f.set_policy(
            "p0:5600/e04/",
            Policy {
                ready_after_polls: 3,
                ..Policy::compact()
            },
        );
        f.set_default_policy(Policy::compact());
        f
    };
    let mut senders: Vec<HeartbeatSender<FakeFabric, DefaultPeerAddress>> = (0..2)
        .map(|rank| {
            let cfg = SenderConfig::new(&config, 2, rank);
            HeartbeatSender::new(make_fabric(), DefaultPeerAddress, cfg).unwrap()
        })
        .collect();
    let mut live: Vec<u64> = Vec::with_capacity(8192);
    let mut rng = SplitMix64::new(0x9e37_79b9_7f4a_7c15u64);
    let mut next = move || rng.next_u64();
    let mut now = Instant::from_secs(1);
    let mut next_id = 0u64;
    let mut started = 0u64;
    let mut refused = 0u64;
    let mut d_buf = [0u8; 32];
    let mut p_buf = [0u8; 96];

    counting_alloc::self_check();

    // ---- steady state: nothing below may allocate ----
    let ((), counts) = count_allocs(|| {
        for step in 0..STEPS {
            // Two regimes: a large stable population, then a small one in which
            // engines keep emptying, disappearing and coming back (slot reuse,
            // fresh handshakes, dropped deferred heartbeats).
            let target = if step < STEPS / 2 { TARGET_LIVE } else { 12 };
            now = now + Duration::from_millis(50);
            // Arrivals: 2 a step.
            for _ in 0..2 {
                let r = next();
                let n = next_id;
                next_id += 1;
                let e = (r % ENGINES.len() as u64) as usize;
                let engine = ENGINES[e];
                // P TP per engine: 1, 2 or 4 (fan-out 1, 1, 2 from D TP 2).
                let tp = [1, 2, 4][e % 3];
                // Every fourth engine gets some requests without a lease (text
                // heartbeats); the others are all leased (compact).
                let leased = e % 4 != 0 || (r >> 16) % 8 != 0;
                let d = id_into(&mut d_buf, b"cmpl-d-", n);
                // Mostly vLLM-sized ids (inline); every fifth longer than the
                // 64-byte inline slot (overflow arena).
                let prefix: &[u8] = if n % 5 == 0 {
                    b"chatcmpl-long-0123456789abcdef-0123456789abcdef-0123456789abcdef-"
                } else {
                    b"cmpl-p-0123456789abcdef-"
                };
                let p = id_into(&mut p_buf, prefix, n);
                let params = RemotePrefillParams {
                    do_remote_prefill: (r >> 24) % 16 != 0,
                    remote_engine_id: Some(engine),
                    remote_request_id: Some(p),
                    remote_host: Some("p0"),
                    remote_port: Some(5600),
                    // Engine e05 always arrives with tp 3: cannot map to D TP 2.
                    tp_size: Some(if engine == "e05" { 3 } else { tp }),
                    remote_lease_slot: leased.then_some((n % 4096) as u32),
                    remote_lease_nonce: leased.then_some(n as i64 + 1),
                    ..Default::default()
                };
                match tracker.on_new_request(d, &params, now) {
                    Ok(TrackOutcome::Started) => {
                        started += 1;
                        live.push(n);
                    }
                    Ok(_) => {}
                    Err(_) => refused += 1,
                }
            }
            // Departures: transfer complete or finished, 2 a step once the
            // population reached its target (so about `target` stay tracked).
            for k in 0..2 {
                if live.len() < target {
                    break;
                }
                let at = (next() % live.len() as u64) as usize;
                let n = live.swap_remove(at);
                let d = id_into(&mut d_buf, b"cmpl-d-", n);
                let stopped = if k == 0 {
                    tracker.on_transfer_complete(d)
                } else {
                    tracker.on_request_finished(d)
                };
                assert!(stopped);
            }
            // An untracked finish (vLLM reports every request).
            let d = id_into(&mut d_buf, b"never-", next() % 1000);
            assert!(!tracker.on_request_finished(d));
            // The heartbeat step for both D ranks.
            HeartbeatSender::step_all(&mut senders, &mut tracker, now);
        }
    });
    let (allocs, bytes) = (counts.allocs, counts.bytes);
    // Make sure the run exercised what it claims to.
    let tc = tracker.counters();
    let c0 = senders[0].counters();
    let c1 = senders[1].counters();
    eprintln!("tracker: {tc:?}");
    eprintln!("rank 0: {c0:?}");
    eprintln!("rank 1: {c1:?}");
    assert!(started > 100_000, "{started}");
    assert!(tc.requests_due > 1_000_000, "the large regime heartbeats");
    assert!(refused > 0 && tc.refused_engines_full > 0);
    assert!(tc.ignored_not_remote_prefill > 0);
    assert!(tc.stopped_transfer_complete > 0 && tc.stopped_finished > 0);
    for c in [c0, c1] {
        assert!(c.messages_sent > 10_000, "{c:?}");
        assert!(c.compact_messages_sent > 0 && c.compact_messages_sent < c.messages_sent);
        assert!(c.deferred_sent > 0, "ready_after_polls 3 peers");
        assert!(c.deferred_dropped > 0, "engines vanish while owed");
        assert!(c.handshakes_failed > 100, "e03 never connects");
        assert!(c.engines_refused > 0, "e05 has an unmappable TP");
    }
    for s in &senders {
        assert!(
            s.fabric().unlogged > 0,
            "messages beyond the log were counted"
        );
    }
    assert_eq!(
        (allocs, bytes),
        (0, 0),
        "steady-state D steps allocated {allocs} times ({bytes} bytes)"
    );
}

/// The memory figure `docs/embedding.md` gives for D's tracking capacity: what
/// `HeartbeatTracker::new` allocates per tracked request (the slope between
/// two capacities, so the per-engine part cancels) and in all with the
/// default config (65,536 requests, 64 engines, 128-byte ids).
#[test]
fn tracker_memory_per_request_matches_the_docs() {
    let shape = EngineShape {
        num_kv_blocks: 1024,
        max_num_seqs: 64,
    };
    let bytes = |requests: u32, max_id_len: u16| {
        let mut c = LeaseConfig::new(shape);
        c.max_tracked_requests = requests;
        c.max_request_id_len = max_id_len;
        c.validate().unwrap();
        let (tracker, counts) = count_allocs(|| HeartbeatTracker::new(&c, 1).expect("tracker"));
        drop(tracker);
        counts.bytes
    };
    let default = LeaseConfig::new(shape);
    assert_eq!(default.max_tracked_requests, 65_536);
    assert_eq!(default.max_request_id_len, 128);
    let per_request =
        |id_len| (bytes(2 * 65_536, id_len) - bytes(65_536, id_len)) as f64 / 65_536.0;
    // docs/embedding.md, "Configuration": about 383 B per request (128-byte ids), 191 B
    // with ids of at most 64 bytes; 25.2 MB for the default.
    let (p128, p64) = (per_request(128), per_request(64));
    let (tracker, total) = count_allocs(|| HeartbeatTracker::new(&default, 1).expect("tracker"));
    drop(tracker);
    println!("tracker memory: {p128} B/request (128-byte ids), {p64} B/request (64-byte ids), {} B default", total.bytes);
    assert!((378.0..=388.0).contains(&p128), "{p128} B per request");
    assert!((186.0..=196.0).contains(&p64), "{p64} B per request");
    assert!(
        (24_700_000..=25_700_000).contains(&total.bytes),
        "{} B for the default",
        total.bytes
    );
}
