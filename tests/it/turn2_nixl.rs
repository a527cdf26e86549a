#![cfg(feature = "nixl")]
//! Bidirectional mode over real NIXL, two processes: P here (the turn-2
//! reader), D in a child process (this test binary, re-executed) that caches
//! finished turns for a short TTL on its own monotonic clock.
//!
//! The clock sample is the one the real handshake takes; D's clock has
//! another origin (another process), and P only ever sees D's deadlines as
//! the float seconds D exported. In one run (about 10 s):
//!
//! 1. the handshake's estimate translates D's deadline to within its bound
//!    (plus pipe latency) of P's own reading of "now + TTL";
//! 2. a clock ping over NIXL comes back as a pong and is folded in;
//! 3. an early turn-2 read is verified, holds turn 1's bytes, and P's
//!    read-done frees D's blocks;
//! 4. P's gate, asked every 10 ms, reads until the deadline is within
//!    margin + bound + one step in its estimate, then declines; D frees the
//!    blocks only after the last accepted check;
//! 5. a read that passed the gate but stalls past D's TTL (D freed and reused
//!    the blocks) completes with the other conversation's bytes and no
//!    error, which the verifier turns into a failed load (`Lapsed`).
//!
//! Needs `libnixl_capi.so` on `LD_LIBRARY_PATH` (`.ci/nixl-runtime.sh`);
//! without it the test prints `SKIPPED` and passes, unless
//! `KVLEASE_REQUIRE_NIXL=1`. Waits are poll loops with deadlines; the only
//! timing bounds are the generous ones named below.
#![allow(clippy::disallowed_types)] // test memory: leaked std atomics (see clippy.toml)

use crate::support::child::{every_line, spawn_test_child, wait_for, KillOnDrop};
use crate::support::exact_test_name;
use crate::support::pipes;
use std::io::Write;
use std::process::ChildStdin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use crate::support::nixl_gate::{nixl_parent_or_child, say};
use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig, ReadGate};
use kvlease::clock_ping::{self, ClockMessage, ClockPinger};
use kvlease::consumer::{LeaseVerifier, Verdict, VerifyTarget};
use kvlease::decoder_cache::{self, DecoderCacheScheduler};
use kvlease::fabric::nixl::{NixlConfig, NixlFabric};
use kvlease::fabric::{AgentId, Fabric, HandshakeState, PeerInfo, ReadDesc, RegionId, XferState};
use kvlease::{
    EngineShape, Instant, LeaseConfig, LeaseFields, LeaseSlots, MonotonicClock, Nonce,
    ReleaseReason,
};

const CHILD_ENV: &str = "KVLEASE_TURN2_D_CHILD";
const P_ADDR_ENV: &str = "KVLEASE_TURN2_P_ADDR";
const READY: &str = "KVLEASE_TURN2_D_READY";
const CHILD_LIFETIME: Duration = Duration::from_secs(60);

const TTL: Duration = Duration::from_secs(3);
const MARGIN: Duration = Duration::from_millis(800);
/// Pipe latency and scheduling on a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(500);
const BLOCK_WORDS: usize = 512;
const TURN_1: u64 = 0x1111_1111_1111_1111;
const REUSED: u64 = 0x7e7e_7e7e_7e7e_7e7e;

fn config() -> LeaseConfig {
    let mut c = LeaseConfig::new(EngineShape {
        num_kv_blocks: 16,
        max_num_seqs: 0,
    });
    c.decoder_kv_blocks_ttl = TTL;
    c
}

fn fabric(role: &str, clock: MonotonicClock) -> NixlFabric {
    let mut cfg = NixlConfig::new(format!("kvl-turn2-{role}-{}", std::process::id()));
    cfg.clock = clock;
    NixlFabric::new(cfg).expect("NIXL fabric")
}

fn leak_words(n: usize) -> &'static [AtomicU64] {
    Box::leak((0..n).map(|_| AtomicU64::new(0)).collect())
}

fn register_words(f: &mut NixlFabric, words: &'static [AtomicU64]) -> RegionId {
    // SAFETY: leaked, so allocated and unmoved for the process's life; every
    // Rust access to the words is atomic.
    unsafe { f.register_memory(words.as_ptr() as *mut u8, std::mem::size_of_val(words)) }
        .expect("register memory")
}

fn fill(words: &[AtomicU64], v: u64) {
    for w in words {
        w.store(v, Ordering::Release);
    }
}

// ---- D: the child process ----------------------------------------------------------

/// D's worker and scheduler in one loop: `keep <id> <pattern>` lines on
/// stdin; prints `kept`, `freed` and `reused` lines; answers clock pings.
fn d_child() {
    let clock = MonotonicClock::new();
    let config = config();
    let mut f = fabric("d", clock);
    let slots = Arc::new(LeaseSlots::new(config.lease_slots));
    f.register_slots(slots.clone(), true).unwrap();
    let kv = leak_words(BLOCK_WORDS);
    let kv_region = register_words(&mut f, kv);
    let mut cache = DecoderCacheScheduler::new(&config, 1, clock.now()).unwrap();
    let mut rank = decoder_cache::new_cache_rank(&config, 0, slots, clock.now()).unwrap();
    let p_addr = std::env::var(P_ADDR_ENV).expect("P's address");
    let to_p = f.start_handshake(&p_addr, clock.now()).unwrap();
    let mut p_ready = false;
    let rx = pipes::stdin_lines();
    let addr = f.listen_addr();
    println!("{READY} {addr} {}", kv_region.0);
    std::io::stdout().flush().unwrap();
    let (mut meta, mut out) = (vec![0u8; 1 << 16], vec![0u8; rank.max_reports_len()]);
    let mut pongs: Vec<u64> = Vec::new();
    let mut released: Vec<(String, ReleaseReason, Option<kvlease::SlotTicket>)> = Vec::new();
    let start = std::time::Instant::now();
    while start.elapsed() < CHILD_LIFETIME {
        while let Ok(msg) = rx.try_recv() {
            let Some(line) = msg else { return };
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["keep", id, pattern] => {
                    fill(kv, u64::from_str_radix(pattern, 16).unwrap());
                    let kept = cache.keep(id, clock.now()).unwrap();
                    let f = kept.fields.expect("a free slot");
                    println!(
                        "kept {id} {} {} {}",
                        decoder_cache::expiry_time_param(kept.expiry),
                        f.slot,
                        f.nonce.get()
                    );
                }
                _ => panic!("D child: bad line {line:?}"),
            }
        }
        let now = clock.now();
        let n = cache
            .scheduler_mut()
            .encode_directives(now, &mut meta)
            .unwrap();
        rank.apply_directives(&meta[..n], now).unwrap();
        f.drain_notifications(&mut |_, msg| match clock_ping::decode(msg) {
            Some(Ok(ClockMessage::Ping { token })) => pongs.push(token),
            Some(_) => {}
            None => {
                let _ = rank.on_notification("d0", msg, now);
            }
        })
        .unwrap();
        if !p_ready {
            p_ready = matches!(f.handshake_state(to_p, now), HandshakeState::Ready(_));
        }
        if p_ready {
            for token in pongs.drain(..) {
                let mut buf = [0u8; clock_ping::PONG_LEN];
                // Stamped now, after the ping was drained.
                let m = clock_ping::encode_pong(token, clock.now(), &mut buf).unwrap();
                f.send_notification(to_p, &buf[..m]).unwrap();
            }
        }
        rank.poll(now);
        let m = rank.encode_reports(&mut out).unwrap();
        cache.scheduler_mut().apply_reports(0, &out[..m]).unwrap();
        cache.scheduler_mut().drain_released(|rel| {
            released.push((rel.request_id.to_owned(), rel.reason, rel.slot));
        });
        for (id, reason, ticket) in released.drain(..) {
            println!("freed {id} {reason:?}");
            if reason == ReleaseReason::Expired {
                // The engine reuses the freed blocks for another conversation.
                fill(kv, REUSED);
                println!("reused {id}");
            }
            if let Some(t) = ticket {
                cache.scheduler_mut().blocks_freed(t);
            }
        }
        std::io::stdout().flush().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
}

// ---- P: this process ------------------------------------------------------------------

struct P {
    clock: MonotonicClock,
    f: NixlFabric,
    to_d: AgentId,
    info: PeerInfo,
    kv_region: RegionId,
    landing: &'static [AtomicU64],
    landing_region: RegionId,
    verifier: LeaseVerifier,
    est: ClockOffset,
    pinger: ClockPinger,
    lines: mpsc::Receiver<String>,
    stdin: ChildStdin,
    _child: KillOnDrop,
}

/// A turn D kept, as P learns it from the params (via the router).
struct Kept {
    deadline: Instant,
    fields: LeaseFields,
    /// P's clock when the params arrived.
    seen_at: Instant,
}

impl P {
    /// One P engine step: drain notifications (pongs are folded in).
    fn step(&mut self) {
        let now = self.clock.now();
        let (pinger, est) = (&mut self.pinger, &mut self.est);
        self.f
            .drain_notifications(&mut |_, msg| {
                if let Some(Ok(ClockMessage::Pong { token, remote })) = clock_ping::decode(msg) {
                    if let Some(sample) = pinger.on_pong(token, remote, now) {
                        est.observe(sample);
                    }
                }
            })
            .unwrap();
    }

    /// Steps until D prints a line starting with `prefix`.
    fn expect_line(&mut self, prefix: &str) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            self.step();
            while let Ok(line) = self.lines.try_recv() {
                if line.starts_with(prefix) {
                    return line;
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "D never printed {prefix:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn keep(&mut self, id: &str, pattern: u64) -> Kept {
        writeln!(self.stdin, "keep {id} {pattern:x}").unwrap();
        self.stdin.flush().unwrap();
        let line = self.expect_line(&format!("kept {id} "));
        let seen_at = self.clock.now();
        let w: Vec<&str> = line.split_whitespace().collect();
        let secs: f64 = w[2].parse().unwrap();
        Kept {
            deadline: decoder_cache::parse_expiry_time(secs).unwrap(),
            fields: LeaseFields {
                slot: w[3].parse().unwrap(),
                nonce: Nonce::new(w[4].parse().unwrap()).unwrap(),
            },
            seen_at,
        }
    }

    /// Reads D's blocks; returns the word every block word holds.
    fn read_blocks(&mut self) -> u64 {
        fill(self.landing, 0);
        let descs = [ReadDesc {
            local: self.landing_region,
            local_offset: 0,
            remote: self.kv_region,
            remote_offset: 0,
            len: (BLOCK_WORDS * 8) as u64,
        }];
        let xfer = self
            .f
            .post_read(self.to_d, &descs, None, self.clock.now())
            .unwrap();
        loop {
            match self.f.read_state(xfer, self.clock.now()) {
                XferState::InProgress => std::thread::sleep(Duration::from_micros(100)),
                XferState::Done => break,
                XferState::Failed(e) => panic!("block READ failed: {e}"),
            }
        }
        let v = self.landing[0].load(Ordering::Acquire);
        assert!(self.landing.iter().all(|w| w.load(Ordering::Acquire) == v));
        v
    }

    fn verify(&mut self, fields: LeaseFields) -> Verdict {
        let target = VerifyTarget::from_peer(self.to_d, &self.info).expect("D exports slots");
        self.verifier.submit(1, Some(fields), &[target]).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut verdict = None;
        while verdict.is_none() {
            assert!(std::time::Instant::now() < deadline, "no verdict");
            let now = self.clock.now();
            self.verifier
                .step(&mut self.f, now, |_, v| verdict = Some(v));
            std::thread::sleep(Duration::from_micros(200));
        }
        verdict.unwrap()
    }
}

fn start() -> P {
    let clock = MonotonicClock::new();
    let mut f = fabric("p", clock);
    let landing = leak_words(BLOCK_WORDS);
    let landing_region = register_words(&mut f, landing);
    let verifier = LeaseVerifier::new(&mut f, &kvlease::testkit::verifier_config(16, 4)).unwrap();
    let p_addr = f.listen_addr().to_string();
    let child = spawn_test_child(
        &exact_test_name!(turn2_reads_over_real_nixl_between_two_processes),
        &[(CHILD_ENV, "1"), (P_ADDR_ENV, &p_addr)],
        true,
        every_line,
    );
    let ready = wait_for(&child.lines, READY, Duration::from_secs(30))
        .expect("the D child did not come up");
    let w: Vec<&str> = ready.split_whitespace().collect();
    let (d_addr, kv_region) = (w[0].to_owned(), RegionId(w[1].parse().unwrap()));
    let to_d = f.start_handshake(&d_addr, clock.now()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let info = loop {
        match f.handshake_state(to_d, clock.now()) {
            HandshakeState::Ready(info) => break info,
            HandshakeState::Pending => {}
            HandshakeState::Failed(e) => panic!("handshake with D failed: {e}"),
        }
        assert!(std::time::Instant::now() < deadline, "handshake timed out");
        std::thread::sleep(Duration::from_millis(1));
    };
    let mut est = ClockOffset::new(ClockOffsetConfig {
        safety_margin: MARGIN,
        ..ClockOffsetConfig::default()
    });
    est.observe(info.clock.expect("the NIXL handshake takes a clock sample"));
    P {
        clock,
        f,
        to_d,
        info,
        kv_region,
        landing,
        landing_region,
        verifier,
        est,
        pinger: ClockPinger::new(0x7ee5, Duration::from_secs(1)),
        lines: child.lines,
        stdin: child.stdin.expect("piped"),
        _child: child.process,
    }
}

#[test]
fn turn2_reads_over_real_nixl_between_two_processes() {
    let Some(_g) = nixl_parent_or_child(CHILD_ENV, d_child) else {
        return;
    };
    let t0 = std::time::Instant::now();
    let mut p = start();
    let bound = p.est.bound(p.clock.now()).unwrap();
    say(&format!(
        "turn2 over nixl: handshake offset {} ns, bound {:?}",
        p.est.offset_nanos().unwrap(),
        bound
    ));
    assert!(
        bound < Duration::from_millis(100),
        "handshake bound {bound:?}"
    );

    // 1. D's deadline, translated, is P's "now + TTL" within bound + slack.
    let k1 = p.keep("conv-1", TURN_1);
    let local = p.est.to_local(k1.deadline).unwrap();
    let expected = k1.seen_at + TTL;
    let bound = p.est.bound(k1.seen_at).unwrap();
    assert!(
        local <= expected + bound && local + bound + SLACK >= expected,
        "translated deadline {local:?}, P expected about {expected:?} (bound {bound:?})"
    );

    // 2. A clock ping over NIXL comes back and is folded in.
    assert!(
        clock_ping::peer_answers_pings(&p.info),
        "D is a kvlease peer"
    );
    let mut buf = [0u8; clock_ping::PING_LEN];
    let n = p.pinger.ping(p.clock.now(), &mut buf).unwrap();
    p.f.send_notification(p.to_d, &buf[..n]).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while p.pinger.counters().samples == 0 {
        assert!(std::time::Instant::now() < deadline, "no pong from D");
        p.step();
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(p.est.counters().samples, 2);

    // 3. An early read: verified, turn 1's bytes, read-done frees D at once.
    assert_eq!(
        p.est.check_read(Some(k1.deadline), p.clock.now()),
        ReadGate::Read
    );
    assert_eq!(p.read_blocks(), TURN_1);
    assert_eq!(p.verify(k1.fields), Verdict::Verified);
    let mut msg = [0u8; 64];
    let n = kvlease::wire::encode_read_done("conv-1", 1, Some(k1.fields.nonce), &mut msg).unwrap();
    p.f.send_notification(p.to_d, &msg[..n]).unwrap();
    assert_eq!(p.expect_line("freed conv-1"), "freed conv-1 ReadDone");

    // 4. The gate reads until margin + bound (+ one 10 ms step) remain in
    // its estimate, then declines; D frees only after the last read.
    let k2 = p.keep("conv-2", 0x2222);
    let mut last_read = None;
    let declined_at = loop {
        let now = p.clock.now();
        match p.est.check_read(Some(k2.deadline), now) {
            ReadGate::Read => last_read = Some(now),
            ReadGate::Decline => break now,
            ReadGate::NoSample => panic!("a sample was taken"),
        }
        p.step();
        std::thread::sleep(Duration::from_millis(10));
    };
    let local = p.est.to_local(k2.deadline).unwrap();
    let left = local.saturating_duration_since(declined_at);
    let bound = p.est.bound(declined_at).unwrap();
    assert!(
        left <= MARGIN + bound + SLACK,
        "declined with {left:?} left in P's estimate (margin {MARGIN:?}, bound {bound:?})"
    );
    let last_read = last_read.expect("reads were accepted before the decline");
    let line = p.expect_line("freed conv-2");
    let freed_seen = p.clock.now();
    assert_eq!(line, "freed conv-2 Expired");
    assert!(
        last_read + MARGIN <= freed_seen,
        "a read was accepted within the margin of D's free"
    );

    // 5. A read that passed the gate, then stalled past the TTL: D freed and
    // reused the blocks; the READ completes with no error and the wrong
    // bytes, and only the verifier tells.
    let k3 = p.keep("conv-3", 0x3333);
    assert_eq!(
        p.est.check_read(Some(k3.deadline), p.clock.now()),
        ReadGate::Read
    );
    p.expect_line("reused conv-3");
    let got = p.read_blocks();
    assert_eq!(got, REUSED, "unverified, P would decode these bytes");
    assert_eq!(p.verify(k3.fields), Verdict::Lapsed);

    let c = p.est.counters();
    say(&format!(
        "turn2 over nixl: {:.2} s; estimator {c:?}; pinger {:?}",
        t0.elapsed().as_secs_f64(),
        p.pinger.counters()
    ));
}
