#![cfg(feature = "nixl")]
//! The real NIXL fabric between real NIXL agents (UCX over shared memory and
//! loopback TCP): handshakes, notifications both ways, READs of registered
//! DRAM and of a remote lease-slot word, and a two-process test whose peer is
//! killed mid-conversation.
//!
//! Needs `libnixl_capi.so` on `LD_LIBRARY_PATH`:
//!
//! ```text
//! eval "$(.ci/nixl-runtime.sh | tail -1)"
//! KVLEASE_REQUIRE_NIXL=1 cargo test --features nixl --test it -- nixl_fabric::
//! ```
//!
//! Without the runtime every test prints `SKIPPED: NIXL runtime not found
//! (run .ci/nixl-runtime.sh)` and passes, unless `KVLEASE_REQUIRE_NIXL=1`,
//! which makes the absence a failure (CI sets it).
//!
//! The tests of this file hold one lock, so they run one at a time: their
//! latency numbers are not disturbed by each other on a 2-core machine.
//! Waits are poll loops with deadlines of seconds; nothing sleeps for a fixed
//! time and then asserts.
// Std atomics are fine in tests (clippy.toml's rule is for the library; see src/sync.rs).
#![allow(clippy::disallowed_types)]

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use crate::support::child::{every_line, spawn_test_child, wait_for, KillOnDrop};
use crate::support::exact_test_name;
use crate::support::nixl_gate::{nixl_or_skip, say};
use crate::support::nixl_pair::{
    connect, desc, fabric, finish, finish_hearing, poll_until, register_words, unique_name, WAIT,
};
use kvlease::fabric::nixl::{
    runtime_available, NixlConfig, NixlFabric, NixlInitError, ProgressMode, UcxErrorHandling,
    STATUS_INVALID_PARAM,
};
use kvlease::fabric::{AgentId, Fabric, FabricError, HandshakeState, RegionId, XferId, XferState};
use kvlease::{EngineShape, LeaseBook, LeaseConfig, LeaseSlots, MonotonicClock};

// The peer table (restarts, removal, eviction), the side channel's clients,
// and embedders whose peers do not speak kvlease: submodules, so that
// `nixl_fabric::` selects them too (CI reruns it over UCX TCP).
mod foreign;
mod peers;
mod side_channel;

/// Environment switch: this test binary runs as the two-process test's peer.
const CHILD_ENV: &str = "KVLEASE_NIXL_CHILD";
/// What the child prints once it listens: `KVLEASE_CHILD_READY <addr>`.
const READY_LINE: &str = "KVLEASE_CHILD_READY ";
/// What `child_without_runtime` prints: `KVLEASE_CHILD_ABSENT refused|present`.
const ABSENT_LINE: &str = "KVLEASE_CHILD_ABSENT ";
/// Environment: the child's word pattern seed.
const SEED_ENV: &str = "KVLEASE_NIXL_CHILD_SEED";
/// Environment: the address the child's handshake listener binds.
const LISTEN_ENV: &str = "KVLEASE_NIXL_CHILD_LISTEN";
/// Words of the child's exported region.
const CHILD_WORDS: usize = 64;

/// Word `i` of the region of the child started with `seed`.
fn child_word(seed: u64, i: u64) -> u64 {
    (seed << 32) | (i * 7 + 1)
}

/// Drains `f` until a notification arrives; returns (sender, bytes).
fn recv_one(f: &mut NixlFabric, others: &mut [&mut NixlFabric]) -> (String, Vec<u8>) {
    let mut got = None;
    poll_until(WAIT, || {
        f.drain_notifications(&mut |s, m| {
            if got.is_none() {
                got = Some((s.to_owned(), m.to_vec()));
            }
        })
        .unwrap();
        for o in others.iter_mut() {
            o.drain_notifications(&mut |_, _| {}).unwrap();
        }
        got.take()
    })
    .expect("no notification arrived in time")
}

fn read_word(words: &[u64], i: usize) -> u64 {
    // The fabric wrote the buffer behind the compiler's back.
    // SAFETY: `i` is in bounds (indexing panics otherwise before the read)
    // and the READ that wrote it has finished.
    unsafe { std::ptr::read_volatile(&words[i]) }
}

#[test]
fn handshake_advertises_slots_regions_and_a_clock_sample() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    let slots = Arc::new(LeaseSlots::new(64));
    let mut kv = vec![0u64; 16];
    let mut p = fabric("p", clock, ProgressMode::EngineLoop);
    let mut d = fabric("d", clock, ProgressMode::EngineLoop);
    assert_eq!(p.register_slots(slots.clone(), true).unwrap(), RegionId(0));
    assert_eq!(register_words(&mut p, &mut kv), RegionId(1));

    let (id, info) = connect(&mut d, &mut p, clock);
    assert_eq!(info.slot_region, Some(RegionId(0)));
    assert_eq!(info.slot_count, 64);
    assert!(info.compact_heartbeats);
    let c = info.clock.expect("clock sample");
    assert!(
        c.local_send <= c.remote && c.remote <= c.local_recv,
        "{c:?}"
    );

    // Same address: same agent, still ready. Unknown id: typed failure.
    let again = d
        .start_handshake(&p.listen_addr().to_string(), clock.now())
        .unwrap();
    assert_eq!(again, id);
    assert!(matches!(
        d.handshake_state(id, clock.now()),
        HandshakeState::Ready(_)
    ));
    assert_eq!(
        d.handshake_state(AgentId(77), clock.now()),
        HandshakeState::Failed(FabricError::UnknownAgent)
    );

    // A P without slots advertises none.
    let (_, plain) = connect(&mut p, &mut d, clock);
    assert_eq!((plain.slot_region, plain.slot_count), (None, 0));
    assert!(!plain.compact_heartbeats);
}

#[test]
fn handshake_failures_are_typed_and_prompt() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    let mut d = fabric("d", clock, ProgressMode::EngineLoop);
    // A port nobody listens on: bind one, learn it, close it.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let cases = [
        (dead.as_str(), FabricError::PeerUnreachable),
        ("no-port-here", FabricError::BadAddress),
    ];
    for (addr, want) in cases {
        let id = d.start_handshake(addr, clock.now()).unwrap();
        let got = poll_until(WAIT, || match d.handshake_state(id, clock.now()) {
            HandshakeState::Pending => None,
            s => Some(s),
        });
        assert_eq!(got, Some(HandshakeState::Failed(want)), "{addr}");
        assert_eq!(
            d.send_notification(id, b"x"),
            Err(FabricError::NotConnected)
        );
    }
    assert_eq!(
        d.start_handshake("", clock.now()),
        Err(FabricError::BadAddress)
    );

    // A listener that accepts and answers garbage.
    let garbage = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gaddr = garbage.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        if let Ok((mut s, _)) = garbage.accept() {
            let mut req = [0u8; 8];
            let _ = std::io::Read::read_exact(&mut s, &mut req);
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\nnot a kvlease listener");
        }
    });
    let id = d.start_handshake(&gaddr, clock.now()).unwrap();
    let got = poll_until(WAIT, || match d.handshake_state(id, clock.now()) {
        HandshakeState::Pending => None,
        s => Some(s),
    });
    assert_eq!(
        got,
        Some(HandshakeState::Failed(FabricError::PeerUnreachable))
    );
    server.join().unwrap();
}

#[test]
fn notifications_flow_both_ways() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    let mut a = fabric("a", clock, ProgressMode::EngineLoop);
    let mut b = fabric("b", clock, ProgressMode::EngineLoop);
    let (to_b, _) = connect(&mut a, &mut b, clock);
    let (to_a, _) = connect(&mut b, &mut a, clock);

    a.send_notification(to_b, b"HB:req-1,req-2").unwrap();
    assert_eq!(
        recv_one(&mut b, &mut [&mut a]),
        (a.name().to_owned(), b"HB:req-1,req-2".to_vec())
    );
    b.send_notification(to_a, b"req-1:1").unwrap();
    assert_eq!(
        recv_one(&mut a, &mut [&mut b]),
        (b.name().to_owned(), b"req-1:1".to_vec())
    );

    // Bytes that are not UTF-8 still arrive intact (nixl-sys's take_notifs
    // refuses them; the fabric falls back to the byte API).
    let binary = [0xff, 0x00, 0xfe, b'x'];
    a.send_notification(to_b, &binary).unwrap();
    assert_eq!(recv_one(&mut b, &mut [&mut a]).1, binary.to_vec());
    assert_eq!(b.stats().notification_map_resets, 1);
    // ... and the map is usable afterwards.
    a.send_notification(to_b, b"after").unwrap();
    assert_eq!(recv_one(&mut b, &mut [&mut a]).1, b"after".to_vec());

    // Many in one step arrive in order.
    for i in 0..100u32 {
        a.send_notification(to_b, format!("m{i}").as_bytes())
            .unwrap();
    }
    let mut seen = Vec::new();
    poll_until(WAIT, || {
        b.drain_notifications(&mut |_, m| seen.push(m.to_vec()))
            .unwrap();
        a.drain_notifications(&mut |_, _| {}).unwrap();
        (seen.len() >= 100).then_some(())
    })
    .expect("100 notifications in time");
    let want: Vec<Vec<u8>> = (0..100).map(|i| format!("m{i}").into_bytes()).collect();
    assert_eq!(seen, want);

    // Limits.
    let max = a.max_notification_len();
    assert_eq!(
        a.send_notification(to_b, &vec![b'x'; max + 1]),
        Err(FabricError::MessageTooLarge)
    );
    a.send_notification(to_b, &vec![b'y'; max]).unwrap();
    assert_eq!(recv_one(&mut b, &mut [&mut a]).1.len(), max);
    assert_eq!(
        a.send_notification(AgentId(9), b"x"),
        Err(FabricError::UnknownAgent)
    );
    assert_eq!(a.drain_notifications(&mut |_, _| {}), Ok(0));
}

#[test]
fn read_of_registered_dram_with_and_without_notification() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    let mut src: Vec<u64> = (0..64).map(|i| 0xA5A5_0000_0000_0000 | i).collect();
    let mut dst = vec![0u64; 64];
    let slots = Arc::new(LeaseSlots::new(8));
    let mut p = fabric("p", clock, ProgressMode::EngineLoop);
    let mut d = fabric("d", clock, ProgressMode::EngineLoop);
    let p_src = register_words(&mut p, &mut src);
    let d_slots = d.register_slots(slots, false).unwrap();
    let d_dst = register_words(&mut d, &mut dst);
    let (pid, _) = connect(&mut d, &mut p, clock);

    // Two descriptors, no notification.
    let descs = [
        desc(d_dst, 0, p_src, 8 * 10, 8 * 4),
        desc(d_dst, 8 * 32, p_src, 0, 8),
    ];
    let x = d.post_read(pid, &descs, None, clock.now()).unwrap();
    assert_eq!(finish(&mut d, &mut p, x, clock), XferState::Done);
    for i in 0..4 {
        assert_eq!(read_word(&dst, i), src[10 + i]);
    }
    assert_eq!(read_word(&dst, 32), src[0]);
    assert_eq!(
        d.read_state(x, clock.now()),
        XferState::Failed(FabricError::UnknownXfer)
    );
    assert_eq!(p.drain_notifications(&mut |_, _| {}), Ok(0));

    // The same descriptors with a notification: the prepared request is
    // re-posted, and P hears "read done" from D.
    let misses = d.stats().request_cache_misses;
    // SAFETY: no READ is in flight; P's region is only read remotely.
    unsafe { std::ptr::write_volatile(src.as_mut_ptr().add(10), 4242) };
    let x = d
        .post_read(pid, &descs, Some(b"req-7:1"), clock.now())
        .unwrap();
    let mut heard = Vec::new();
    assert_eq!(
        finish_hearing(&mut d, &mut p, x, clock, &mut heard),
        XferState::Done
    );
    assert_eq!(read_word(&dst, 0), 4242);
    if heard.is_empty() {
        heard.push(recv_one(&mut p, &mut [&mut d]));
    }
    assert_eq!(heard, vec![(d.name().to_owned(), b"req-7:1".to_vec())]);
    assert_eq!(
        d.stats().request_cache_misses,
        misses,
        "re-post allocated a new request"
    );
    assert!(d.stats().request_cache_hits >= 1);

    // Typed refusals, before anything reaches NIXL.
    let bad = [
        (desc(d_dst, 0, p_src, 8 * 63, 16), FabricError::OutOfBounds),
        (desc(d_dst, 8 * 63, p_src, 0, 16), FabricError::OutOfBounds),
        (
            desc(d_dst, 0, p_src, u64::MAX - 3, 8),
            FabricError::OutOfBounds,
        ),
        (desc(d_dst, 0, p_src, 0, 0), FabricError::OutOfBounds),
        (
            desc(d_dst, 0, RegionId(5), 0, 8),
            FabricError::UnknownRegion,
        ),
        (
            desc(RegionId(9), 0, p_src, 0, 8),
            FabricError::UnknownRegion,
        ),
        // The lease-slot array is not a landing region.
        (desc(d_slots, 0, p_src, 0, 8), FabricError::UnknownRegion),
    ];
    for (dsc, want) in bad {
        assert_eq!(
            d.post_read(pid, &[dsc], None, clock.now()),
            Err(want),
            "{dsc:?}"
        );
    }
    assert_eq!(
        d.post_read(pid, &[], None, clock.now()),
        Err(FabricError::Backend(STATUS_INVALID_PARAM))
    );
    let big = vec![b'z'; d.max_notification_len() + 1];
    assert_eq!(
        d.post_read(pid, &descs, Some(&big), clock.now()),
        Err(FabricError::MessageTooLarge)
    );
    assert_eq!(
        d.post_read(AgentId(3), &descs, None, clock.now()),
        Err(FabricError::UnknownAgent)
    );

    // Cancel: the id is forgotten, the next READ of the set still works.
    let x = d.post_read(pid, &descs, None, clock.now()).unwrap();
    d.cancel_read(x);
    d.cancel_read(x);
    assert_eq!(
        d.read_state(x, clock.now()),
        XferState::Failed(FabricError::UnknownXfer)
    );
    let x = d.post_read(pid, &descs, None, clock.now()).unwrap();
    assert_eq!(finish(&mut d, &mut p, x, clock), XferState::Done);

    // Concurrent READs of one set use two requests; both finish.
    let x1 = d.post_read(pid, &descs, None, clock.now()).unwrap();
    let x2 = d.post_read(pid, &descs, None, clock.now()).unwrap();
    assert_ne!(x1, x2);
    assert_eq!(finish(&mut d, &mut p, x1, clock), XferState::Done);
    assert_eq!(finish(&mut d, &mut p, x2, clock), XferState::Done);
    drop(d);
    drop(p);
}

#[test]
fn read_of_a_remote_lease_slot_word_sees_the_granted_nonce() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    let config = LeaseConfig::new(EngineShape {
        num_kv_blocks: 56,
        max_num_seqs: 8,
    });
    let mut book = LeaseBook::new(&config, clock.now());
    let slots = book.rank_slots(0).unwrap().clone();
    assert_eq!(slots.len(), 64);
    let mut landing = vec![u64::MAX; 64];
    let mut p = fabric("p", clock, ProgressMode::EngineLoop);
    let mut d = fabric("d", clock, ProgressMode::EngineLoop);
    let region = p.register_slots(slots.clone(), true).unwrap();
    let d_land = register_words(&mut d, &mut landing);
    let (pid, info) = connect(&mut d, &mut p, clock);
    assert_eq!(info.slot_region, Some(region));

    let grant = book.grant("req-slot", clock.now()).unwrap();
    let kvlease::LeaseFields { slot, nonce } = grant.lease_fields().expect("a verifiable lease");
    let word = |slot: u32| {
        desc(
            d_land,
            8 * u64::from(slot),
            region,
            LeaseSlots::offset_of(slot),
            8,
        )
    };
    let x = d.post_read(pid, &[word(slot)], None, clock.now()).unwrap();
    assert_eq!(finish(&mut d, &mut p, x, clock), XferState::Done);
    assert_eq!(read_word(&landing, slot as usize), nonce.get());

    // A slot nobody holds reads 0; the whole array in one descriptor too.
    let free = (slot + 1) % 64;
    let x = d.post_read(pid, &[word(free)], None, clock.now()).unwrap();
    assert_eq!(finish(&mut d, &mut p, x, clock), XferState::Done);
    assert_eq!(read_word(&landing, free as usize), 0);
    landing.iter_mut().for_each(|w| *w = u64::MAX);
    let all = desc(d_land, 0, region, 0, 8 * 64);
    let x = d.post_read(pid, &[all], None, clock.now()).unwrap();
    assert_eq!(finish(&mut d, &mut p, x, clock), XferState::Done);
    for s in 0..64u32 {
        assert_eq!(
            read_word(&landing, s as usize),
            slots.load(s).unwrap(),
            "slot {s}"
        );
    }
    // Beyond the advertised array: refused.
    assert_eq!(
        d.post_read(pid, &[word(64)], None, clock.now()),
        Err(FabricError::OutOfBounds)
    );
    drop(d);
    drop(p);
}

/// One handshake, a READ with an attached notification and a notification
/// round trip, in the given modes.
fn exercise(progress: ProgressMode, error_handling: UcxErrorHandling) {
    let clock = MonotonicClock::new();
    let mut src: Vec<u64> = (0..8).map(|i| i + 100).collect();
    let mut dst = vec![0u64; 8];
    let make = |role: &str| {
        let mut cfg = NixlConfig::new(unique_name(role));
        cfg.clock = clock;
        cfg.progress = progress;
        cfg.error_handling = error_handling;
        NixlFabric::new(cfg).expect("NIXL fabric")
    };
    let mut p = make("p");
    let mut d = make("d");
    let p_src = register_words(&mut p, &mut src);
    let d_dst = register_words(&mut d, &mut dst);
    let (to_p, _) = connect(&mut d, &mut p, clock);
    let (to_d, _) = connect(&mut p, &mut d, clock);
    let x = d
        .post_read(
            to_p,
            &[desc(d_dst, 0, p_src, 0, 64)],
            Some(b"done"),
            clock.now(),
        )
        .unwrap();
    let mut heard = Vec::new();
    assert_eq!(
        finish_hearing(&mut d, &mut p, x, clock, &mut heard),
        XferState::Done
    );
    assert_eq!(read_word(&dst, 7), 107);
    if heard.is_empty() {
        heard.push(recv_one(&mut p, &mut [&mut d]));
    }
    assert_eq!(heard[0].1, b"done".to_vec());
    p.send_notification(to_d, b"ack").unwrap();
    assert_eq!(recv_one(&mut d, &mut [&mut p]).1, b"ack".to_vec());
    drop(d);
    drop(p);
}

#[test]
fn every_progress_and_error_handling_combination_works() {
    let Some(_g) = nixl_or_skip() else { return };
    for progress in [
        ProgressMode::EngineLoop,
        ProgressMode::Thread { delay_us: 1000 },
    ] {
        for eh in [UcxErrorHandling::None, UcxErrorHandling::Peer] {
            exercise(progress, eh);
        }
    }
}

#[test]
fn bad_settings_are_refused_before_nixl_is_touched() {
    let Some(_g) = nixl_or_skip() else { return };
    for name in ["", "a\0b"] {
        assert_eq!(
            NixlFabric::new(NixlConfig::new(name)).err(),
            Some(NixlInitError::BadName)
        );
    }
    assert_eq!(
        NixlFabric::new(NixlConfig::new("x".repeat(256))).err(),
        Some(NixlInitError::BadName)
    );
    let mut cfg = NixlConfig::new(unique_name("bad"));
    cfg.progress = ProgressMode::Thread { delay_us: 0 };
    assert!(matches!(
        NixlFabric::new(cfg).err(),
        Some(NixlInitError::BadConfig(_))
    ));
    let mut cfg = NixlConfig::new(unique_name("bad"));
    cfg.max_inflight_reads = 0;
    assert!(matches!(
        NixlFabric::new(cfg).err(),
        Some(NixlInitError::BadConfig(_))
    ));
    for (agents, clients) in [(0, 32), ((1 << 20) + 1, 32), (64, 0)] {
        let mut cfg = NixlConfig::new(unique_name("bad"));
        cfg.max_agents = agents;
        cfg.max_side_channel_clients = clients;
        assert!(
            matches!(
                NixlFabric::new(cfg).err(),
                Some(NixlInitError::BadConfig(_))
            ),
            "max_agents {agents}, max_side_channel_clients {clients}"
        );
    }
    // A listen address that cannot be bound.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut cfg = NixlConfig::new(unique_name("bad"));
    cfg.listen_addr = taken.local_addr().unwrap();
    assert!(matches!(
        NixlFabric::new(cfg).err(),
        Some(NixlInitError::Listen(_))
    ));
}

/// A child of `missing_runtime_is_a_typed_error`: no-op unless
/// `KVLEASE_NIXL_CHILD=absent`. Started without `LD_LIBRARY_PATH`.
#[test]
fn child_without_runtime() {
    if std::env::var(CHILD_ENV).as_deref() != Ok("absent") {
        return;
    }
    if runtime_available() {
        // Installed system-wide: nothing to check here.
        println!("{ABSENT_LINE}present");
        return;
    }
    let err = NixlFabric::new(NixlConfig::new("nobody")).err();
    assert_eq!(err, Some(NixlInitError::RuntimeNotFound));
    println!("{ABSENT_LINE}refused");
}

#[test]
fn missing_runtime_is_a_typed_error() {
    let Some(_g) = nixl_or_skip() else { return };
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &exact_test_name!(child_without_runtime),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "absent")
        .env_remove("LD_LIBRARY_PATH")
        .stdin(Stdio::null())
        .output()
        .expect("re-execute the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}");
    assert!(
        stdout.contains(&format!("{ABSENT_LINE}refused"))
            || stdout.contains(&format!("{ABSENT_LINE}present")),
        "{stdout}"
    );
}

#[test]
fn read_past_the_transfer_timeout_is_aborted_and_fails_the_peer() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    let mut src = vec![1u64; 64];
    let mut dst = vec![0u64; 64];
    // Error handling `peer` with engine-loop progress: a READ stalls while
    // the target does not poll (see the module docs), which is how this test
    // gets a READ that is still in flight.
    let make = |role: &str| {
        let mut cfg = NixlConfig::new(unique_name(role));
        cfg.clock = clock;
        cfg.error_handling = UcxErrorHandling::Peer;
        cfg.transfer_timeout = Duration::from_secs(2);
        NixlFabric::new(cfg).expect("NIXL fabric")
    };
    let mut p = make("p");
    let mut d = make("d");
    let p_src = register_words(&mut p, &mut src);
    let d_dst = register_words(&mut d, &mut dst);
    let (pid, _) = connect(&mut d, &mut p, clock);
    let all = [desc(d_dst, 0, p_src, 0, 8 * 64)];
    // `now` is the caller's: post at t, poll (without P polling) until "3 s
    // later" (the timeout is 2 s).
    let t = clock.now();
    let x = d.post_read(pid, &all, None, t).unwrap();
    let mut state = XferState::InProgress;
    for _ in 0..1000 {
        state = d.read_state(x, t);
        if state != XferState::InProgress {
            break;
        }
    }
    if state == XferState::InProgress {
        assert_eq!(
            d.read_state(x, t + Duration::from_secs(3)),
            XferState::Failed(FabricError::TimedOut)
        );
        assert_eq!(
            d.read_state(x, clock.now()),
            XferState::Failed(FabricError::UnknownXfer)
        );
        assert_eq!(
            d.handshake_state(pid, clock.now()),
            HandshakeState::Failed(FabricError::TimedOut)
        );
        assert_eq!(
            d.post_read(pid, &all, None, clock.now()),
            Err(FabricError::NotConnected)
        );
        // Re-handshake, and READs work again.
        let addr = p.listen_addr().to_string();
        assert_eq!(d.start_handshake(&addr, clock.now()), Ok(pid));
        poll_until(WAIT, || {
            p.drain_notifications(&mut |_, _| {}).unwrap();
            match d.handshake_state(pid, clock.now()) {
                HandshakeState::Ready(_) => Some(()),
                HandshakeState::Pending => None,
                HandshakeState::Failed(e) => panic!("re-handshake failed: {e}"),
            }
        })
        .expect("re-handshake in time");
    } else {
        say(&format!(
            "note: READ ended ({state:?}) without target progress; timeout path not reached"
        ));
    }
    let x = d.post_read(pid, &all, None, clock.now()).unwrap();
    assert_eq!(finish(&mut d, &mut p, x, clock), XferState::Done);
    assert_eq!(read_word(&dst, 7), 1);
    drop(d);
    drop(p);
}

// ---- latency measurements (numbers quoted in src/fabric/nixl.rs) ---------------

fn percentile(v: &mut [u64], q: usize) -> u64 {
    v.sort_unstable();
    v[(v.len() - 1) * q / 100]
}

fn measure(progress: ProgressMode, label: &str) {
    let clock = MonotonicClock::new();
    let slots = Arc::new(LeaseSlots::new(64));
    let mut landing = vec![0u64; 64];
    let mut p = fabric("mp", clock, progress);
    let mut d = fabric("md", clock, progress);
    let region = p.register_slots(slots, true).unwrap();
    let d_land = register_words(&mut d, &mut landing);
    let (to_p, _) = connect(&mut d, &mut p, clock);
    let (to_d, _) = connect(&mut p, &mut d, clock);

    const N: usize = 2000;
    let mut rtt = Vec::with_capacity(N);
    for i in 0..N + 100 {
        let t = std::time::Instant::now();
        d.send_notification(to_p, b"HBC:1").unwrap();
        let mut got = false;
        poll_until(WAIT, || {
            p.drain_notifications(&mut |_, _| got = true).unwrap();
            d.drain_notifications(&mut |_, _| {}).unwrap();
            got.then_some(())
        })
        .expect("ping");
        p.send_notification(to_d, b"ack").unwrap();
        let mut got = false;
        poll_until(WAIT, || {
            d.drain_notifications(&mut |_, _| got = true).unwrap();
            p.drain_notifications(&mut |_, _| {}).unwrap();
            got.then_some(())
        })
        .expect("pong");
        if i >= 100 {
            rtt.push(t.elapsed().as_nanos() as u64);
        }
    }
    let all = [desc(d_land, 0, region, 0, 8 * 64)];
    let mut read = Vec::with_capacity(N);
    for i in 0..N + 100 {
        let t = std::time::Instant::now();
        let x = d.post_read(to_p, &all, None, clock.now()).unwrap();
        // The target's engine loop runs too: over TCP a READ is served by
        // the target's UCX worker, which only its own NIXL calls progress.
        let s = poll_until(WAIT, || match d.read_state(x, clock.now()) {
            XferState::InProgress => {
                p.drain_notifications(&mut |_, _| {}).unwrap();
                None
            }
            s => Some(s),
        });
        assert_eq!(s, Some(XferState::Done));
        if i >= 100 {
            read.push(t.elapsed().as_nanos() as u64);
        }
    }
    let (r50, r99) = (percentile(&mut rtt, 50), percentile(&mut rtt, 99));
    let (x50, x99) = (percentile(&mut read, 50), percentile(&mut read, 99));
    say(&format!(
        "nixl {label}: notification round trip p50 {:.1} us p99 {:.1} us; 64-slot READ p50 {:.1} us p99 {:.1} us; request cache hits {} misses {}",
        r50 as f64 / 1e3,
        r99 as f64 / 1e3,
        x50 as f64 / 1e3,
        x99 as f64 / 1e3,
        d.stats().request_cache_hits,
        d.stats().request_cache_misses,
    ));
    assert_eq!(
        d.stats().request_cache_misses,
        1,
        "the 64-slot READ is prepared once"
    );
    // Sanity bounds only (shared CI machines are noisy).
    assert!(r50 < 50_000_000, "notification round trip p50 {r50} ns");
    assert!(x50 < 50_000_000, "READ p50 {x50} ns");
    drop(d);
    drop(p);
}

#[test]
fn measure_progress_modes() {
    let Some(_g) = nixl_or_skip() else { return };
    measure(ProgressMode::EngineLoop, "engine loop, ucx none");
    measure(
        ProgressMode::Thread { delay_us: 1000 },
        "progress thread 1000 us, ucx none",
    );
}

// ---- two processes ---------------------------------------------------------------

/// The peer of `killed_peer_process_fails_reads_with_a_typed_error`. A no-op
/// unless `KVLEASE_NIXL_CHILD=1` (the parent test re-executes this binary
/// with it). Exports a region of known words, answers handshakes, handshakes
/// back when told an address, echoes `ping:N` as `pong:N`, and exits after
/// 60 s at the latest, or on `bye`.
#[test]
fn child_peer_process() {
    if std::env::var(CHILD_ENV).as_deref() != Ok("1") {
        return;
    }
    let clock = MonotonicClock::new();
    let seed: u64 = std::env::var(SEED_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut words: Vec<u64> = (0..CHILD_WORDS as u64)
        .map(|i| child_word(seed, i))
        .collect();
    let mut cfg = NixlConfig::new(unique_name("child"));
    cfg.clock = clock;
    if let Some(addr) = std::env::var(LISTEN_ENV).ok().and_then(|a| a.parse().ok()) {
        cfg.listen_addr = addr;
    }
    let mut f = NixlFabric::new(cfg).expect("child fabric");
    register_words(&mut f, &mut words);
    println!("{READY_LINE}{}", f.listen_addr());
    std::io::stdout().flush().unwrap();
    let mut parent: Option<AgentId> = None;
    let mut inbox: Vec<Vec<u8>> = Vec::new();
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        f.drain_notifications(&mut |_, m| inbox.push(m.to_vec()))
            .unwrap();
        for m in inbox.drain(..) {
            if let Some(addr) = m.strip_prefix(b"addr=") {
                let addr = String::from_utf8_lossy(addr).into_owned();
                parent = Some(f.start_handshake(&addr, clock.now()).unwrap());
            } else if let Some(n) = m.strip_prefix(b"ping:") {
                if let Some(to) = parent {
                    let mut reply = b"pong:".to_vec();
                    reply.extend_from_slice(n);
                    let _ = f.send_notification(to, &reply);
                }
            } else if m == b"bye" {
                return;
            }
        }
        if let Some(to) = parent {
            if let HandshakeState::Ready(_) = f.handshake_state(to, clock.now()) {
                // Announce once.
                if f.stats().notifications_sent == 0 {
                    f.send_notification(to, b"hello").unwrap();
                }
            }
        }
        std::thread::yield_now();
    }
}

fn spawn_child(seed: u64, listen: &str) -> (KillOnDrop, String) {
    let seed = seed.to_string();
    let child = spawn_test_child(
        &exact_test_name!(child_peer_process),
        &[(CHILD_ENV, "1"), (SEED_ENV, &seed), (LISTEN_ENV, listen)],
        false,
        every_line,
    );
    let addr = wait_for(&child.lines, READY_LINE, Duration::from_secs(30))
        .expect("child did not report its address");
    (child.process, addr.trim().to_owned())
}

#[test]
fn killed_peer_process_fails_reads_with_a_typed_error() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    let mut landing = vec![0u64; CHILD_WORDS];
    let mut d = fabric("parent", clock, ProgressMode::EngineLoop);
    let d_land = register_words(&mut d, &mut landing);
    let (mut child, addr) = spawn_child(1, "127.0.0.1:0");

    let id = d.start_handshake(&addr, clock.now()).unwrap();
    let info = poll_until(WAIT, || match d.handshake_state(id, clock.now()) {
        HandshakeState::Ready(info) => Some(info),
        HandshakeState::Pending => None,
        HandshakeState::Failed(e) => panic!("handshake with the child failed: {e}"),
    })
    .expect("handshake with the child in time");
    assert_eq!(info.slot_region, None);
    let c = info.clock.unwrap();
    assert!(c.local_send <= c.local_recv);

    // READ across processes.
    let all = [desc(d_land, 0, RegionId(0), 0, 8 * CHILD_WORDS as u64)];
    let poll_read = |d: &mut NixlFabric, x: XferId| {
        poll_until(Duration::from_secs(20), || {
            match d.read_state(x, clock.now()) {
                XferState::InProgress => {
                    d.drain_notifications(&mut |_, _| {}).unwrap();
                    None
                }
                s => Some(s),
            }
        })
    };
    let x = d.post_read(id, &all, None, clock.now()).unwrap();
    assert_eq!(poll_read(&mut d, x), Some(XferState::Done));
    for i in 0..CHILD_WORDS {
        assert_eq!(read_word(&landing, i), child_word(1, i as u64));
    }

    // Notifications both ways across processes: the child handshakes back.
    let me = format!("addr={}", d.listen_addr());
    d.send_notification(id, me.as_bytes()).unwrap();
    let mut inbox: Vec<Vec<u8>> = Vec::new();
    poll_until(WAIT, || {
        d.drain_notifications(&mut |_, m| inbox.push(m.to_vec()))
            .unwrap();
        inbox.iter().any(|m| m == b"hello").then_some(())
    })
    .expect("the child's hello");
    let mut rtt = Vec::new();
    for n in 0..500u32 {
        let t = std::time::Instant::now();
        d.send_notification(id, format!("ping:{n}").as_bytes())
            .unwrap();
        let want = format!("pong:{n}").into_bytes();
        inbox.clear();
        poll_until(WAIT, || {
            d.drain_notifications(&mut |_, m| inbox.push(m.to_vec()))
                .unwrap();
            inbox.contains(&want).then_some(())
        })
        .expect("pong from the child");
        rtt.push(t.elapsed().as_nanos() as u64);
    }
    say(&format!(
        "nixl two processes, engine loop: notification round trip p50 {:.1} us p99 {:.1} us",
        percentile(&mut rtt, 50) as f64 / 1e3,
        percentile(&mut rtt, 99) as f64 / 1e3
    ));

    // Kill the peer, then READ from it: a typed failure, not a hang.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    // A notification to the dead peer returns at once, whatever it says
    // (UCX may still accept it into shared memory nobody reads).
    let t = std::time::Instant::now();
    let sent = d.send_notification(id, b"anyone?");
    say(&format!(
        "nixl notification to a killed peer: {sent:?} after {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    ));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "send to a dead peer blocked"
    );
    let t = std::time::Instant::now();
    let outcome = match d.post_read(id, &all, None, clock.now()) {
        Err(e) => Err(e),
        Ok(x) => match poll_read(&mut d, x) {
            Some(XferState::Failed(e)) => Err(e),
            Some(s) => Ok(s),
            None => panic!("READ from a killed peer still in progress after 20 s"),
        },
    };
    let took = t.elapsed();
    say(&format!(
        "nixl READ from a killed peer: {outcome:?} after {:.1} ms",
        took.as_secs_f64() * 1e3
    ));
    let err = outcome.expect_err("a READ from a dead process cannot succeed");
    assert!(
        matches!(
            err,
            FabricError::TimedOut | FabricError::PeerUnreachable | FabricError::Backend(_)
        ),
        "{err:?}"
    );
    // The peer is now failed: no more traffic until it is re-handshaken.
    assert!(matches!(
        d.handshake_state(id, clock.now()),
        HandshakeState::Failed(_)
    ));
    assert_eq!(
        d.send_notification(id, b"x"),
        Err(FabricError::NotConnected)
    );
    assert_eq!(
        d.post_read(id, &all, None, clock.now()),
        Err(FabricError::NotConnected)
    );
    // Re-handshaking a dead address fails promptly too.
    let again = d.start_handshake(&addr, clock.now()).unwrap();
    assert_eq!(again, id);
    let st = poll_until(WAIT, || match d.handshake_state(id, clock.now()) {
        HandshakeState::Pending => None,
        s => Some(s),
    });
    assert!(matches!(st, Some(HandshakeState::Failed(_))), "{st:?}");

    // A new peer process on the same address: the same AgentId re-handshakes
    // (new NIXL agent, new metadata, new memory) and READs work again.
    let (_child2, addr2) = spawn_child(2, &addr);
    assert_eq!(addr2, addr);
    assert_eq!(d.start_handshake(&addr, clock.now()), Ok(id));
    poll_until(WAIT, || match d.handshake_state(id, clock.now()) {
        HandshakeState::Ready(_) => Some(()),
        HandshakeState::Pending => None,
        HandshakeState::Failed(e) => panic!("re-handshake with the new child failed: {e}"),
    })
    .expect("re-handshake in time");
    let x = d.post_read(id, &all, None, clock.now()).unwrap();
    assert_eq!(poll_read(&mut d, x), Some(XferState::Done));
    for i in 0..CHILD_WORDS {
        assert_eq!(read_word(&landing, i), child_word(2, i as u64));
    }
    drop(d);
    drop(landing);
}
