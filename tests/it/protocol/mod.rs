//! The protocol test suite, written once and run over every fabric.
//!
//! Each `pub fn` taking `&mut H: Pair` is one test body: it plays a P worker
//! (a [`LeaseBook`] over P's fabric, lease slots and a registered KV buffer)
//! and a D worker (a [`HeartbeatTracker`], the [`HeartbeatSender`] that owns
//! D's fabric, a [`LeaseVerifier`], block READs) against each other, end to
//! end, through nothing but the [`Fabric`] trait. `tests/it/protocol_loopback.rs`
//! runs every body over two loopback agents in virtual time,
//! `tests/it/protocol_nixl.rs` over two real NIXL agents in real time.
//!
//! # Time
//!
//! A body never reads a clock and never sleeps: it asks the pair for
//! [`Pair::now`] and lets time pass with [`Pair::advance`] between engine
//! steps. Over loopback that moves virtual time by exactly one step, so runs
//! are deterministic and instant; over NIXL it yields the CPU briefly and
//! `now` is the wall clock. Loops therefore run until a condition holds or a
//! deadline on `now` passes, and timing assertions are bounds only ("not
//! before the expiry", "within extension + interval + [`Pair::slack`]").
//!
//! # Memory
//!
//! Buffers registered with a fabric (P's KV blocks, D's landing buffer) are
//! leaked `AtomicU64` words: `'static`, so they outlive every fabric, and
//! only ever accessed through atomics, so no Rust reference covers bytes a
//! READ writes (the `register_memory` safety contract).
// Std atomics are fine in tests (clippy.toml's rule is for the library; see src/sync.rs).
#![allow(clippy::disallowed_types)]

use core::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvlease::consumer::{
    EngineKey, HeartbeatSender, HeartbeatTracker, LeaseVerifier, RemotePrefillParams, SenderConfig,
    TrackOutcome, Verdict, VerifyTarget,
};
use kvlease::fabric::{
    AgentId, Fabric, HandshakeState, PeerInfo, ReadDesc, RegionId, XferId, XferState,
};
use kvlease::producer::{InboxSummary, ReadDoneOutcome};
use kvlease::testkit::six_second_leases;
use kvlease::wire::{self, WireError};
use kvlease::{Grant, Instant, LeaseBook, LeaseConfig, ReleaseReason};

/// How D turns P's `(remote_host, remote_port)` into a handshake address.
pub type AddrFn = fn(&EngineKey<'_>, u32, &mut dyn fmt::Write) -> fmt::Result;

/// D's heartbeat sender; it owns D's fabric.
pub type DSender<F> = HeartbeatSender<F, AddrFn>;

/// `{host}:{port}`: a NIXL fabric's listener address, and the name of the
/// loopback fabric's P agent. P has TP 1 here, so the rank is always 0.
pub fn p_address_of(k: &EngineKey<'_>, _rank: u32, out: &mut dyn fmt::Write) -> fmt::Result {
    write!(out, "{}:{}", k.host, k.port)
}

/// P's `remote_engine_id`.
pub const ENGINE_ID: &str = "prefill-0";

/// One engine step of either side.
pub const STEP: Duration = Duration::from_millis(50);

/// Words per KV block in P's registered buffer.
pub const BLOCK_WORDS: usize = 16;
/// KV blocks in P's registered buffer.
pub const BLOCKS: usize = 4;
/// What D's landing buffer holds before a READ.
pub const SENTINEL: u64 = 0xDEAD_BEEF_DEAD_BEEF;

/// Word `i` of P's KV buffer: distinct, non-zero, not the sentinel.
pub fn kv_word(i: usize) -> u64 {
    0xB10C_0000_0000_0000 | ((i as u64) << 16) | (i as u64 * 0x9E37 + 1) & 0xFFFF
}

/// The lease settings of the suite: the shortest lease the config accepts,
/// 6 s (interval 1 s, extension 4 s), so the real-time runs stay short.
pub fn lease_config() -> LeaseConfig {
    six_second_leases(24, 8)
}

/// Two agents, P and D, on one fabric, plus the clock they share.
pub trait Pair {
    /// The fabric under test.
    type F: Fabric;

    /// P's agent (one P worker, TP 1).
    fn p(&mut self) -> &mut Self::F;

    /// D's heartbeat sender, which owns D's agent. Must not be used after
    /// [`Pair::crash_d`].
    fn d(&mut self) -> &mut DSender<Self::F>;

    /// D's agent (for handshakes, READs and the verifier).
    fn d_fabric(&mut self) -> &mut Self::F {
        self.d().fabric_mut()
    }

    /// P's `(remote_host, remote_port)`: [`p_address_of`] turns them into
    /// the address D handshakes.
    fn p_endpoint(&self) -> (String, u16);

    /// The current instant on the clock both sides use.
    fn now(&self) -> Instant;

    /// Lets up to `dt` pass between two engine steps (virtual: exactly `dt`;
    /// real: a brief sleep, the wall clock moves on by itself).
    fn advance(&mut self, dt: Duration);

    /// D dies: its agent stops answering, sending and draining.
    fn crash_d(&mut self);

    /// How much later than a protocol bound an event may be observed:
    /// one step and one wheel tick in virtual time; scheduling noise in real
    /// time.
    fn slack(&self) -> Duration;
}

/// D's heartbeat sender over D's agent `f`: D TP 1, rank 0, addresses by
/// [`p_address_of`].
pub fn d_sender<F: Fabric>(f: F, config: &LeaseConfig) -> DSender<F> {
    HeartbeatSender::new(f, p_address_of as AddrFn, SenderConfig::new(config, 1, 0))
        .expect("D sender")
}

/// P's handshake address as D formats it.
pub fn p_address<H: Pair>(h: &H) -> String {
    let (host, port) = h.p_endpoint();
    format!("{host}:{port}")
}

/// `n` registrable words, leaked (see the module docs), set to `init(i)`.
pub fn leak_words(n: usize, init: impl Fn(usize) -> u64) -> &'static [AtomicU64] {
    Box::leak((0..n).map(|i| AtomicU64::new(init(i))).collect())
}

/// Registers leaked words with `f`.
pub fn register_words<F: Fabric>(f: &mut F, words: &'static [AtomicU64]) -> RegionId {
    // SAFETY: `words` is 'static (leaked), so it stays allocated and unmoved
    // past the fabric; it is only accessed through atomics, and only read
    // after the READs that write it have completed.
    unsafe { f.register_memory(words.as_ptr() as *mut u8, std::mem::size_of_val(words)) }
        .expect("register memory")
}

/// One notification P received.
#[derive(Debug)]
pub struct Heard {
    /// The sender's agent name.
    pub from: String,
    /// The bytes.
    pub msg: Vec<u8>,
    /// P's `now` in the step that drained it.
    pub at: Instant,
    /// What the book made of it.
    pub outcome: Result<InboxSummary<ReadDoneOutcome>, WireError>,
}

impl Heard {
    /// A text heartbeat.
    pub fn is_heartbeat(&self) -> bool {
        self.msg.starts_with(wire::HEARTBEAT_PREFIX)
    }
}

/// One lease P reported released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    /// The request.
    pub id: String,
    /// Why.
    pub reason: ReleaseReason,
    /// P's `now` in the step that reported it.
    pub at: Instant,
    /// The slot word when it was reported (must be 0: zeroed first).
    pub slot_word: Option<u64>,
}

/// The P worker: a lease book over P's fabric.
pub struct Prefill {
    /// The lease book (rank 0's slot array is registered as `slot_region`).
    pub book: LeaseBook,
    /// P's lease-slot region.
    pub slot_region: RegionId,
    /// P's KV blocks.
    pub kv_region: RegionId,
    /// Every notification drained, in order.
    pub heard: Vec<Heard>,
    /// Every release reported, in order.
    pub released: Vec<Release>,
}

impl Prefill {
    /// A book on `f`: lease slots registered first (region 0), then a KV
    /// buffer of [`BLOCKS`] blocks holding [`kv_word`]. Both are registered
    /// before any peer handshakes, so every handshake advertises them.
    pub fn on<F: Fabric>(f: &mut F, config: &LeaseConfig, now: Instant) -> Prefill {
        let book = LeaseBook::new(config, now);
        let slots = book.rank_slots(0).expect("rank 0").clone();
        let slot_region = f.register_slots(slots, false).expect("register slots");
        let kv = leak_words(BLOCKS * BLOCK_WORDS, kv_word);
        let kv_region = register_words(f, kv);
        Prefill {
            book,
            slot_region,
            kv_region,
            heard: Vec::new(),
            released: Vec::new(),
        }
    }

    /// [`Prefill::on`] P's agent of `h`.
    pub fn setup<H: Pair>(h: &mut H, config: &LeaseConfig) -> Prefill {
        let now = h.now();
        Prefill::on(h.p(), config, now)
    }

    /// One P engine step on `f` at `now`: drain every notification into the
    /// book, expire what is due, report releases, and free their blocks at
    /// once (slots back to the pool).
    pub fn step_on<F: Fabric>(&mut self, f: &mut F, now: Instant) {
        let book = &mut self.book;
        let heard = &mut self.heard;
        f.drain_notifications(&mut |from, msg| {
            let outcome = book.on_notification(0, from, msg, now);
            heard.push(Heard {
                from: from.to_owned(),
                msg: msg.to_vec(),
                at: now,
                outcome,
            });
        })
        .expect("P drains");
        self.book.poll(now);
        let slots = self.book.rank_slots(0).expect("rank 0").clone();
        let mut tickets = Vec::new();
        let released = &mut self.released;
        self.book.drain_released(|r| {
            released.push(Release {
                id: r.request_id.to_owned(),
                reason: r.reason,
                at: now,
                slot_word: r.slot.as_ref().and_then(|t| slots.load(t.slot())),
            });
            tickets.extend(r.slot);
        });
        for t in tickets {
            self.book.blocks_freed(t);
        }
    }

    /// One P step on the pair's P agent.
    pub fn step<H: Pair>(&mut self, h: &mut H) {
        let now = h.now();
        self.step_on(h.p(), now);
    }

    /// Heartbeats heard so far.
    pub fn heartbeats(&self) -> impl Iterator<Item = &Heard> {
        self.heard.iter().filter(|x| x.is_heartbeat())
    }

    /// When P last heard a heartbeat.
    pub fn last_heartbeat(&self) -> Option<Instant> {
        self.heartbeats().map(|x| x.at).last()
    }

    /// The word in `slot` of P's exported array.
    pub fn slot_word(&self, slot: u32) -> u64 {
        self.book
            .rank_slots(0)
            .and_then(|s| s.load(slot))
            .expect("slot in range")
    }
}

/// The D worker's scheduler side and its lease verifier.
pub struct Decode {
    /// Which requests D heartbeats.
    pub tracker: HeartbeatTracker,
    /// Sender steps that reported an error.
    pub step_errors: u32,
    /// Notifications D's agent received (P sends none in this protocol).
    pub received: u32,
}

impl Decode {
    /// A tracker sized from `config`.
    pub fn new(config: &LeaseConfig) -> Decode {
        Decode {
            tracker: HeartbeatTracker::new(config, 1).expect("tracker"),
            step_errors: 0,
            received: 0,
        }
    }

    /// D receives request `d_id`, whose prefill on P was leased as `p_id`
    /// with `grant` (P's `kv_transfer_params`), and starts heartbeating it.
    pub fn route<H: Pair>(&mut self, h: &H, d_id: &str, p_id: &str, grant: &Grant) {
        let (host, port) = h.p_endpoint();
        self.route_to(
            &host,
            port,
            d_id,
            p_id,
            grant.lease_fields().map(|f| (f.slot, f.nonce)),
            h.now(),
        );
    }

    /// [`Decode::route`] with P's endpoint and lease fields spelled out.
    pub fn route_to(
        &mut self,
        host: &str,
        port: u16,
        d_id: &str,
        p_id: &str,
        lease: Option<(u32, kvlease::Nonce)>,
        now: Instant,
    ) {
        let params = RemotePrefillParams {
            do_remote_prefill: true,
            remote_engine_id: Some(ENGINE_ID),
            remote_request_id: Some(p_id),
            remote_host: Some(host),
            remote_port: Some(port),
            tp_size: Some(1),
            remote_lease_slot: lease.map(|l| l.0),
            remote_lease_nonce: lease.map(|l| l.1.as_int64()),
            ..Default::default()
        };
        assert_eq!(
            self.tracker.on_new_request(d_id, &params, now),
            Ok(TrackOutcome::Started)
        );
    }

    /// One D engine step on `sender` at `now`: heartbeat due engines, and
    /// drain D's agent (engine-loop progress).
    pub fn step_on<F: Fabric>(&mut self, sender: &mut DSender<F>, now: Instant) {
        let report = sender.step(&mut self.tracker, now);
        if report.last_error.is_some() {
            self.step_errors += 1;
        }
        let received = &mut self.received;
        sender
            .fabric_mut()
            .drain_notifications(&mut |_, _| *received += 1)
            .expect("D drains");
    }

    /// One D step on the pair's D agent.
    pub fn step<H: Pair>(&mut self, h: &mut H) {
        let now = h.now();
        self.step_on(h.d(), now);
    }
}

/// Steps D (when given) and P, then lets one step pass, until `done` holds
/// or `now` passes `limit`. Returns whether `done` held.
pub fn run_until<H: Pair>(
    h: &mut H,
    p: &mut Prefill,
    mut d: Option<&mut Decode>,
    limit: Instant,
    mut done: impl FnMut(&Prefill) -> bool,
) -> bool {
    loop {
        if let Some(d) = d.as_deref_mut() {
            d.step(h);
        }
        p.step(h);
        if done(p) {
            return true;
        }
        if h.now() > limit {
            return false;
        }
        h.advance(STEP);
    }
}

/// Handshakes D with P (stepping P meanwhile) and returns P's agent id on D
/// and what the handshake told D.
pub fn handshake<H: Pair>(h: &mut H, p: &mut Prefill) -> (AgentId, PeerInfo) {
    let addr = p_address(h);
    let start = h.now();
    let id = h
        .d_fabric()
        .start_handshake(&addr, start)
        .expect("start handshake");
    loop {
        p.step(h);
        let now = h.now();
        match h.d_fabric().handshake_state(id, now) {
            HandshakeState::Ready(info) => return (id, info),
            HandshakeState::Pending => {}
            HandshakeState::Failed(e) => panic!("handshake D -> P ({addr}) failed: {e}"),
        }
        assert!(
            now <= start + Duration::from_secs(10),
            "handshake D -> P ({addr}) still pending after 10 s"
        );
        h.advance(STEP);
    }
}

/// Polls READ `x` on D to its end, stepping P meanwhile.
pub fn finish_read<H: Pair>(h: &mut H, p: &mut Prefill, x: XferId) -> XferState {
    let start = h.now();
    loop {
        p.step(h);
        let now = h.now();
        match h.d_fabric().read_state(x, now) {
            XferState::InProgress => {}
            s => return s,
        }
        assert!(
            now <= start + Duration::from_secs(10),
            "READ still in progress after 10 s"
        );
        h.advance(STEP);
    }
}

/// D's landing buffer for block READs, registered on D's agent.
pub struct Landing {
    /// The words, [`SENTINEL`] until a READ writes them.
    pub words: &'static [AtomicU64],
    /// Their region on D.
    pub region: RegionId,
}

impl Landing {
    /// Two blocks' worth of landing words on D.
    pub fn on_d<H: Pair>(h: &mut H) -> Landing {
        let words = leak_words(2 * BLOCK_WORDS, |_| SENTINEL);
        let region = register_words(h.d_fabric(), words);
        Landing { words, region }
    }

    /// READ descriptors for P's blocks 1 and 3 into landing blocks 0 and 1.
    pub fn descs(&self, p: &Prefill) -> [ReadDesc; 2] {
        let block = (BLOCK_WORDS * 8) as u64;
        [(1u64, 0u64), (3, 1)].map(|(remote, local)| ReadDesc {
            local: self.region,
            local_offset: local * block,
            remote: p.kv_region,
            remote_offset: remote * block,
            len: block,
        })
    }

    /// Resets every word to the sentinel (no READ may be in flight).
    pub fn reset(&self) {
        self.words
            .iter()
            .for_each(|w| w.store(SENTINEL, Ordering::Relaxed));
    }

    /// Asserts the landing words hold P's blocks 1 and 3.
    pub fn assert_blocks_1_and_3(&self) {
        for (k, remote_block) in [1usize, 3].into_iter().enumerate() {
            for i in 0..BLOCK_WORDS {
                let got = self.words[k * BLOCK_WORDS + i].load(Ordering::Acquire);
                let want = kv_word(remote_block * BLOCK_WORDS + i);
                assert_eq!(
                    got, want,
                    "landing block {k} word {i}: {got:#x}, want P block {remote_block}'s {want:#x}"
                );
            }
        }
    }
}

/// Reads P's blocks 1 and 3 into `landing`, optionally with a notification
/// attached, and checks the bytes.
pub fn read_blocks<H: Pair>(
    h: &mut H,
    p: &mut Prefill,
    agent: AgentId,
    landing: &Landing,
    notification: Option<&[u8]>,
) {
    landing.reset();
    let descs = landing.descs(p);
    let now = h.now();
    let x = h
        .d_fabric()
        .post_read(agent, &descs, notification, now)
        .expect("post block READ");
    assert_eq!(finish_read(h, p, x), XferState::Done);
    landing.assert_blocks_1_and_3();
}

/// Runs D's verifier until it reports `token`'s verdict, stepping P.
pub fn verify<H: Pair>(
    h: &mut H,
    p: &mut Prefill,
    verifier: &mut LeaseVerifier,
    token: u64,
) -> Verdict {
    let start = h.now();
    let mut verdict = None;
    loop {
        let now = h.now();
        verifier.step(h.d_fabric(), now, |t, v| {
            assert_eq!(t, token, "a verdict for a check never submitted");
            verdict = Some(v);
        });
        if let Some(v) = verdict {
            return v;
        }
        p.step(h);
        assert!(
            now <= start + Duration::from_secs(10),
            "no verdict for check {token} after 10 s"
        );
        h.advance(STEP);
    }
}

/// Runs P until it has heard `n` notifications in all; returns the last.
/// D's engine loop keeps draining its agent meanwhile, as a live D does
/// every step: over TCP a notification leaves only as the sender's UCX
/// worker is progressed, and only the sender's own NIXL calls do that.
fn hear<'p, H: Pair>(h: &mut H, p: &'p mut Prefill, n: usize) -> &'p Heard {
    let limit = h.now() + Duration::from_secs(10);
    loop {
        h.d_fabric()
            .drain_notifications(&mut |_, _| {})
            .expect("D drains");
        p.step(h);
        if p.heard.len() >= n {
            return &p.heard[n - 1];
        }
        assert!(
            h.now() <= limit,
            "P heard {} notifications, waited for {n}",
            p.heard.len()
        );
        h.advance(STEP);
    }
}

/// A read-done with nonce, as D sends it.
pub fn read_done(id: &str, nonce: kvlease::Nonce) -> Vec<u8> {
    let mut buf = vec![0; wire::read_done_len(id, 1, Some(nonce))];
    let n = wire::encode_read_done(id, 1, Some(nonce), &mut buf).expect("encode read-done");
    buf.truncate(n);
    buf
}

// ---- the bodies --------------------------------------------------------------------

/// (a) D handshakes P: the answer carries P's lease-slot region, its size
/// and a clock sample; the same address gives the same agent; a
/// notification D sends reaches P under D's agent name.
pub fn handshake_carries_p_slot_region<H: Pair>(h: &mut H) {
    let config = lease_config();
    let mut p = Prefill::setup(h, &config);
    let (id, info) = handshake(h, &mut p);
    assert_eq!(info.slot_region, Some(p.slot_region));
    assert_ne!(info.slot_region, Some(p.kv_region));
    assert_eq!(info.slot_count, config.lease_slots);
    assert!(!info.compact_heartbeats, "P registered its slots text-only");
    let c = info.clock.expect("the handshake takes a clock sample");
    assert!(c.local_send <= c.local_recv, "{c:?}");

    let addr = p_address(h);
    let now = h.now();
    assert_eq!(h.d_fabric().start_handshake(&addr, now), Ok(id));
    assert!(matches!(
        h.d_fabric().handshake_state(id, now),
        HandshakeState::Ready(_)
    ));

    // D -> P notification: a heartbeat for a lease P does not hold is heard,
    // attributed to D, and ignored.
    h.d_fabric()
        .send_notification(id, b"HB:nobody")
        .expect("send to P");
    let d_name = h.d_fabric().name().to_owned();
    let heard = hear(h, &mut p, 1);
    assert_eq!(heard.from, d_name);
    assert_eq!(heard.msg, b"HB:nobody");
    let summary = heard.outcome.expect("a well-formed heartbeat");
    assert_eq!((summary.renewed, summary.ignored), (0, 1));
    assert_eq!(p.book.counters().renew_unknown, 1);
}

/// (b) D's tracker and sender heartbeat P's leases over the fabric: one
/// batched `HB:` per interval renews every lease of D, P's book moves their
/// expiry to `last heartbeat + extension`, and the leases outlive the initial
/// lease. A request whose transfer completed on D drops out of the batch.
pub fn heartbeats_renew_leases<H: Pair>(h: &mut H) {
    let config = lease_config();
    let (interval, extension) = (config.heartbeat_interval(), config.lease_extension());
    let mut p = Prefill::setup(h, &config);
    let mut d = Decode::new(&config);
    let now = h.now();
    let ga = p.book.grant("cmpl-a", now).unwrap();
    let gb = p.book.grant("cmpl-b", now).unwrap();
    d.route(h, "d-a", "cmpl-a", &ga);
    d.route(h, "d-b", "cmpl-b", &gb);
    let start = h.now();

    // Run past the initial lease: the heartbeats alone keep both leases.
    let past = ga.expiry + interval;
    run_until(h, &mut p, Some(&mut d), past, |_| false);
    assert_eq!(p.released, Vec::new(), "a heartbeated lease was released");
    assert_eq!(p.book.held(), 2);
    let d_name = h.d_fabric().name().to_owned();
    let hbs: Vec<&Heard> = p.heartbeats().collect();
    let elapsed = h.now().saturating_duration_since(start);
    let most = (elapsed.as_millis() / interval.as_millis()) as usize + 2;
    assert!(
        (3..=most).contains(&hbs.len()),
        "{} heartbeats in {elapsed:?} (interval {interval:?})",
        hbs.len()
    );
    for x in &hbs {
        assert_eq!(x.from, d_name);
        let s = x.outcome.expect("well-formed heartbeat");
        assert_eq!(
            (s.renewed, s.ignored),
            (2, 0),
            "one message renews both: {:?}",
            String::from_utf8_lossy(&x.msg)
        );
    }
    assert_eq!(p.heard.len(), hbs.len(), "D sent only heartbeats");
    let last = p.last_heartbeat().unwrap();
    for (id, g) in [("cmpl-a", ga), ("cmpl-b", gb)] {
        let e = p.book.expiry(id).expect("held");
        assert!(e > g.expiry, "{id}: expiry never moved");
        assert_eq!(
            e,
            last + extension,
            "{id}: expiry = last heartbeat + extension"
        );
    }
    assert_eq!(p.book.counters().renewed, 2 * hbs.len() as u64);
    let sent = h.d().counters().messages_sent;
    assert!(
        sent >= hbs.len() as u64 && sent <= hbs.len() as u64 + 1,
        "{sent} sent"
    );
    assert_eq!((d.step_errors, d.received), (0, 0));

    // The KV of d-a arrived: only cmpl-b is heartbeated from now on (a
    // heartbeat already on its way may still name both).
    assert!(d.tracker.on_transfer_complete("d-a"));
    let n = p.heard.len();
    let limit = h.now() + 3 * interval + h.slack();
    assert!(
        run_until(h, &mut p, Some(&mut d), limit, |p| p.heard.len() >= n + 2),
        "heartbeats for cmpl-b stopped"
    );
    for x in &p.heard[n + 1..] {
        assert_eq!(x.msg, b"HB:cmpl-b");
        assert_eq!(x.outcome.expect("well-formed").renewed, 1);
    }
    let names_a = |x: &&Heard| x.msg.windows(6).any(|w| w == b"cmpl-a");
    let last_a = p.heartbeats().filter(names_a).last().unwrap().at;
    let expiry_a = p.book.expiry("cmpl-a").unwrap();
    assert_eq!(expiry_a, last_a + extension, "cmpl-a no longer renewed");
    assert_eq!(
        p.book.expiry("cmpl-b"),
        Some(p.last_heartbeat().unwrap() + extension)
    );
    assert!(p.book.expiry("cmpl-b").unwrap() > expiry_a);
}

/// (c) D READs two of P's registered KV blocks into its own registered
/// buffer and gets P's bytes; P hears nothing of a READ without a
/// notification; a descriptor beyond P's buffer is refused.
pub fn block_read_copies_p_blocks<H: Pair>(h: &mut H) {
    let config = lease_config();
    let mut p = Prefill::setup(h, &config);
    let (agent, _) = handshake(h, &mut p);
    let landing = Landing::on_d(h);
    read_blocks(h, &mut p, agent, &landing, None);
    // Again, the same descriptors (a cached request on NIXL).
    read_blocks(h, &mut p, agent, &landing, None);
    p.step(h);
    assert!(p.heard.is_empty(), "{:?}", p.heard);

    let mut beyond = landing.descs(&p)[1];
    beyond.remote_offset = (BLOCKS * BLOCK_WORDS * 8) as u64;
    let now = h.now();
    assert_eq!(
        h.d_fabric().post_read(agent, &[beyond], None, now),
        Err(kvlease::FabricError::OutOfBounds)
    );
}

/// (d) After its block READ, D's verifier READs the lease slot: Verified
/// while P holds the lease. P lets the lease lapse (expiry, slot zeroed,
/// blocks freed) and re-grants the slot to another request: the old (slot,
/// nonce) is now Lapsed, the new one Verified. Without lease fields the
/// check is Unverifiable.
pub fn verifier_tells_held_from_lapsed<H: Pair>(h: &mut H) {
    let config = lease_config();
    let mut p = Prefill::setup(h, &config);
    let (agent, info) = handshake(h, &mut p);
    let landing = Landing::on_d(h);
    let mut verifier = LeaseVerifier::new(h.d_fabric(), &kvlease::testkit::verifier_config(8, 4))
        .expect("verifier");
    let target = [VerifyTarget::from_peer(agent, &info).expect("P exports slots")];

    let now = h.now();
    let g1 = p.book.grant("cmpl-v1", now).unwrap();
    let kvlease::LeaseFields { slot, nonce } = g1.lease_fields().expect("a verifiable lease");
    assert_eq!(p.slot_word(slot), nonce.get());
    read_blocks(h, &mut p, agent, &landing, None);
    verifier
        .submit(1, Some(kvlease::LeaseFields { slot, nonce }), &target)
        .unwrap();
    assert_eq!(verify(h, &mut p, &mut verifier, 1), Verdict::Verified);

    // No heartbeat, no read-done: the lease lapses at its expiry, not before.
    let limit = g1.expiry + Duration::from_secs(2) + h.slack();
    assert!(
        run_until(h, &mut p, None, limit, |p| !p.released.is_empty()),
        "the lease never lapsed"
    );
    let r = p.released[0].clone();
    assert_eq!(
        (r.id.as_str(), r.reason),
        ("cmpl-v1", ReleaseReason::Expired)
    );
    assert!(
        r.at >= g1.expiry,
        "released early: {:?} < {:?}",
        r.at,
        g1.expiry
    );
    assert!(r.at <= g1.expiry + h.slack(), "released late: {:?}", r.at);
    assert_eq!(
        r.slot_word,
        Some(0),
        "slot zeroed before the release was reported"
    );
    assert_eq!(
        p.book.counters().slots_returned,
        1,
        "blocks freed, slot back"
    );

    // Another request takes the slot (the pool hands back the last freed).
    let now = h.now();
    let g2 = p.book.grant("cmpl-v2", now).unwrap();
    let kvlease::LeaseFields {
        slot: slot2,
        nonce: nonce2,
    } = g2.lease_fields().expect("a verifiable lease");
    assert_eq!(slot2, slot, "the freed slot is reused");
    assert_ne!(nonce2, nonce);
    assert_eq!(p.slot_word(slot), nonce2.get());

    // D's stale check (a READ after the lease lapsed) fails the load.
    read_blocks(h, &mut p, agent, &landing, None);
    verifier
        .submit(2, Some(kvlease::LeaseFields { slot, nonce }), &target)
        .unwrap();
    assert_eq!(verify(h, &mut p, &mut verifier, 2), Verdict::Lapsed);
    verifier
        .submit(
            3,
            Some(kvlease::LeaseFields {
                slot: slot2,
                nonce: nonce2,
            }),
            &target,
        )
        .unwrap();
    assert_eq!(verify(h, &mut p, &mut verifier, 3), Verdict::Verified);
    verifier.submit(4, None, &target).unwrap();
    assert_eq!(verify(h, &mut p, &mut verifier, 4), Verdict::Unverifiable);

    let c = verifier.counters();
    assert_eq!(
        (
            c.submitted,
            c.verified,
            c.lapsed,
            c.unverifiable,
            c.read_failed
        ),
        (4, 2, 1, 1, 0)
    );
    assert_eq!(c.slot_reads, 3, "one slot READ per check with a lease");
}

/// (e) D's read-done carries the nonce. Attached to the block READ, it
/// releases the lease (ReadDone) once the READ completed; the slot is zeroed
/// first. After P re-grants the same request id, the stale read-done (old
/// nonce), sent standalone, changes nothing; the current one releases.
pub fn read_done_with_nonce_releases_only_its_lease<H: Pair>(h: &mut H) {
    let config = lease_config();
    let mut p = Prefill::setup(h, &config);
    let (agent, _) = handshake(h, &mut p);
    let landing = Landing::on_d(h);

    let now = h.now();
    let g1 = p.book.grant("cmpl-r", now).unwrap();
    let kvlease::LeaseFields { slot, nonce: n1 } = g1.lease_fields().expect("a verifiable lease");
    let done1 = read_done("cmpl-r", n1);
    read_blocks(h, &mut p, agent, &landing, Some(&done1));
    let heard = hear(h, &mut p, 1);
    assert_eq!(heard.msg, done1);
    assert_eq!(
        heard.outcome.expect("well-formed read-done").read_done,
        Some(ReadDoneOutcome::Released)
    );
    assert_eq!(p.book.held(), 0);
    assert_eq!(p.released.len(), 1);
    let r = p.released[0].clone();
    assert_eq!(
        (r.id.as_str(), r.reason),
        ("cmpl-r", ReleaseReason::ReadDone)
    );
    assert!(r.at < g1.expiry, "released by the read-done, not by expiry");
    assert_eq!(r.slot_word, Some(0));

    // The same id leased again, on the same slot, with a new nonce.
    let now = h.now();
    let g2 = p.book.grant("cmpl-r", now).unwrap();
    let kvlease::LeaseFields {
        slot: slot2,
        nonce: n2,
    } = g2.lease_fields().expect("a verifiable lease");
    assert_eq!(slot2, slot);
    assert_ne!(n2, n1);

    // A late copy of the first read-done: dropped, nothing changes.
    h.d_fabric().send_notification(agent, &done1).unwrap();
    let heard = hear(h, &mut p, 2);
    assert_eq!(
        heard.outcome.expect("well-formed read-done").read_done,
        Some(ReadDoneOutcome::StaleNonce)
    );
    assert_eq!(p.book.held(), 1);
    assert_eq!(p.book.expiry("cmpl-r"), Some(g2.expiry));
    assert_eq!(p.slot_word(slot), n2.get());
    assert_eq!(p.released.len(), 1);
    assert_eq!(p.book.counters().read_done_stale_nonce, 1);

    // The current read-done, standalone: released.
    let done2 = read_done("cmpl-r", n2);
    h.d_fabric().send_notification(agent, &done2).unwrap();
    let heard = hear(h, &mut p, 3);
    assert_eq!(
        heard.outcome.expect("well-formed read-done").read_done,
        Some(ReadDoneOutcome::Released)
    );
    assert_eq!(p.released.len(), 2);
    assert_eq!(p.released[1].reason, ReleaseReason::ReadDone);
    assert_eq!(p.released[1].slot_word, Some(0));
    assert_eq!(p.book.held(), 0);
    assert_eq!(p.book.counters().released_read, 2);
    assert_eq!(p.book.counters().expired, 0);
}

/// (f) D heartbeats three leases past the initial lease, then crashes. P
/// releases all three (Expired) no earlier than their expiry (last heartbeat
/// + extension) and within extension + one interval of the crash.
pub fn crashed_decoder_leases_are_reclaimed<H: Pair>(h: &mut H) {
    let config = lease_config();
    let (interval, extension) = (config.heartbeat_interval(), config.lease_extension());
    let mut p = Prefill::setup(h, &config);
    let mut d = Decode::new(&config);
    let ids = ["cmpl-x", "cmpl-y", "cmpl-z"];
    let now = h.now();
    let mut initial = Instant::ZERO;
    for (k, id) in ids.iter().enumerate() {
        let g = p.book.grant(id, now).unwrap();
        initial = g.expiry;
        d.route(h, &format!("d-{k}"), id, &g);
    }
    run_until(h, &mut p, Some(&mut d), initial + interval, |_| false);
    assert_eq!(p.released, Vec::new());
    assert_eq!(p.book.held(), 3);
    assert!(p.heartbeats().count() >= 3);

    h.crash_d();
    drop(d);
    let crashed = h.now();
    let limit = crashed + extension + interval + h.slack();
    assert!(
        run_until(h, &mut p, None, limit, |p| p.released.len() == 3),
        "P still holds {} leases of the crashed D at {:?} (crash at {crashed:?})",
        p.book.held(),
        h.now()
    );
    let last = p.last_heartbeat().expect("heartbeats before the crash");
    let expiry = last + extension;
    for r in &p.released {
        assert!(ids.contains(&r.id.as_str()));
        assert_eq!(r.reason, ReleaseReason::Expired, "{r:?}");
        assert!(
            r.at >= expiry,
            "released before the expiry: {r:?}, expiry {expiry:?}"
        );
        assert!(
            r.at <= expiry + h.slack(),
            "released late: {r:?}, last heartbeat {last:?}"
        );
        assert!(r.at <= crashed + extension + interval + h.slack(), "{r:?}");
        assert_eq!(r.slot_word, Some(0));
    }
    assert_eq!(p.book.counters().expired, 3);
    assert_eq!(p.book.counters().slots_returned, 3);
}
