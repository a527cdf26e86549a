//! kvlease embedded in an engine that owns its agent and its handshake,
//! written once and run over two fabrics:
//!
//! - `tests/it/embed_loopback.rs`: both workers in one process on the loopback
//!   fabric, in virtual time;
//! - `tests/it/embed_nixl.rs`: a P process and a D process, each creating its
//!   own `nixl_sys::Agent` and exchanging metadata over its own pipe.
//!
//! The engine part ([`EngineAgent`]) is what an engine already has: its
//! agent, its KV buffer, its drain, its block READ with the read-done
//! attached, and its own handshake message ([`EngineHello`]). kvlease only
//! gets a fabric over that agent, the peers the engine registers
//! ([`Fabric::add_peer`]) and the notifications the engine routes to it.

#![allow(dead_code)] // each test binary uses part of it

use core::fmt;
use std::time::Duration;

use kvlease::consumer::{
    EngineKey, HeartbeatSender, HeartbeatTracker, LeaseVerifier, RemotePrefillParams, SenderConfig,
    Verdict, VerifyTarget,
};
use kvlease::fabric::{AgentId, Fabric, LeaseAdvert, PeerRecord};
use kvlease::ipc::report::ReportMsg;
use kvlease::testkit::six_second_leases;
use kvlease::{
    wire, Instant, LeaseConfig, LeaseFields, LeaseSlots, PrefillRank, PrefillScheduler,
    ReleaseReason,
};
use std::sync::Arc;

/// P's `remote_engine_id`.
pub const ENGINE_ID: &str = "prefill-e";
/// Bytes of P's KV buffer (the engine's), all [`KV_BYTE`].
pub const KV_LEN: usize = 4096;
/// What every byte of P's KV buffer holds.
pub const KV_BYTE: u8 = 0xAB;
/// The engine's own notification, not kvlease's: the engine gets it back.
pub const ENGINE_NOTE: &[u8] = b"engine:kv-layout-changed";

/// 6 s leases (heartbeat every 1 s, extension 4 s).
pub fn lease_config() -> LeaseConfig {
    six_second_leases(16, 4)
}

/// Where a worker's KV buffer lives, in its fabric's terms (NIXL: address;
/// loopback: region index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteKv {
    /// The fabric's handle.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

/// The engine's own handshake message: its agent name, its NIXL metadata,
/// where its KV is, and (new) kvlease's advert bytes. The format is the
/// engine's business; kvlease only supplies and reads the advert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineHello {
    /// The agent's name.
    pub name: String,
    /// NIXL metadata (empty on loopback).
    pub metadata: Vec<u8>,
    /// The engine's KV buffer.
    pub kv: RemoteKv,
    /// `LeaseAdvert::encode`'s bytes.
    pub advert: Vec<u8>,
}

impl EngineHello {
    /// The message as bytes (length-prefixed fields).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        for field in [self.name.as_bytes(), &self.metadata, &self.advert] {
            b.extend_from_slice(&(field.len() as u32).to_le_bytes());
            b.extend_from_slice(field);
        }
        b.extend_from_slice(&self.kv.addr.to_le_bytes());
        b.extend_from_slice(&self.kv.len.to_le_bytes());
        b
    }

    /// The inverse of [`EngineHello::encode`].
    pub fn decode(mut b: &[u8]) -> Option<EngineHello> {
        let mut field = || -> Option<Vec<u8>> {
            let (n, rest) = b.split_first_chunk::<4>()?;
            let n = u32::from_le_bytes(*n) as usize;
            let v = rest.get(..n)?.to_vec();
            b = &rest[n..];
            Some(v)
        };
        let name = String::from_utf8(field()?).ok()?;
        let metadata = field()?;
        let advert = field()?;
        let (addr, rest) = b.split_first_chunk::<8>()?;
        let (len, _) = rest.split_first_chunk::<8>()?;
        Some(EngineHello {
            name,
            metadata,
            kv: RemoteKv {
                addr: u64::from_le_bytes(*addr),
                len: u64::from_le_bytes(*len),
            },
            advert,
        })
    }
}

/// What the engine already has, over its own agent. kvlease's fabric `F`
/// runs on the same agent (for loopback it *is* the engine's agent object,
/// so the engine reaches it through kvlease's owner).
pub trait EngineAgent {
    /// kvlease's fabric over this agent.
    type F: Fabric;
    /// The engine's KV buffer (P) or landing buffer (D), registered by the
    /// engine, `KV_LEN` bytes, filled with `byte`.
    fn register_kv(&mut self, f: &mut Self::F, byte: u8) -> RemoteKv;
    /// The engine's handshake message, taken after every registration.
    fn hello(&self, f: &Self::F, kv: RemoteKv) -> EngineHello;
    /// The engine's drain, once per step: every notification on the agent.
    fn drain(&mut self, f: &mut Self::F, sink: &mut dyn FnMut(&str, &[u8]));
    /// Sends one of the engine's own notifications to `peer`.
    fn send_own(&mut self, f: &mut Self::F, peer: &str, msg: &[u8], now: Instant);
    /// The engine's block READ of `kv` on `peer` into its landing buffer,
    /// with `notification` attached unless it is empty (vLLM's read-done
    /// path).
    fn post_block_read(
        &mut self,
        f: &mut Self::F,
        peer: &str,
        kv: RemoteKv,
        notification: &[u8],
        now: Instant,
    );
    /// `Some(true)` when the block READ completed, `Some(false)` when it
    /// failed, `None` while in progress.
    fn block_read_state(&mut self, f: &mut Self::F, now: Instant) -> Option<bool>;
    /// The landing buffer's bytes.
    fn landing(&self) -> Vec<u8>;
}

/// An event on P.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PEvent {
    /// P's rank renewed `n` leases from one heartbeat.
    Renewed(u32),
    /// P's rank let go of its share.
    RankReleased(ReleaseReason),
    /// Every rank let go: the engine frees the blocks.
    Released(String, ReleaseReason),
    /// The engine got back a notification that was not kvlease's.
    EngineOwn(Vec<u8>),
}

/// A P worker (TP 1: the scheduler role lives beside it) embedding kvlease
/// in its engine's agent.
pub struct PWorker<E: EngineAgent> {
    /// The engine's side.
    pub engine: E,
    /// kvlease's fabric over the engine's agent.
    pub fabric: E::F,
    sched: PrefillScheduler,
    rank: PrefillRank,
    kv: RemoteKv,
    buf: Vec<u8>,
}

impl<E: EngineAgent> PWorker<E> {
    /// The engine registers its KV; kvlease registers its lease slots on the
    /// same agent.
    pub fn new(mut engine: E, mut fabric: E::F, now: Instant) -> PWorker<E> {
        let config = lease_config();
        let slots = Arc::new(LeaseSlots::new(config.lease_slots));
        let kv = engine.register_kv(&mut fabric, KV_BYTE);
        fabric.register_slots(slots.clone(), true).expect("slots");
        PWorker {
            sched: PrefillScheduler::new(&config, 1, now).expect("scheduler"),
            rank: PrefillRank::new(&config, 0, slots, now).expect("rank"),
            engine,
            fabric,
            kv,
            buf: vec![0; 1 << 16],
        }
    }

    /// The engine's handshake message, kvlease's advert inside.
    pub fn hello(&self) -> EngineHello {
        self.engine.hello(&self.fabric, self.kv)
    }

    /// The prefill of `id` completed: lease it.
    pub fn grant(&mut self, id: &str, now: Instant) -> LeaseFields {
        let g = self.sched.grant(id, now).expect("grant");
        let fields = g.lease_fields().expect("slotted lease");
        let n = self
            .sched
            .encode_directives(now, &mut self.buf)
            .expect("directives");
        self.rank
            .apply_directives(&self.buf[..n], now)
            .expect("own directives");
        fields
    }

    /// One engine step: the engine drains its agent and routes kvlease's
    /// notifications to the rank (getting back the ones that are not);
    /// expiries; reports to the scheduler; releases.
    pub fn step(&mut self, now: Instant, events: &mut Vec<PEvent>) {
        let rank = &mut self.rank;
        self.engine.drain(&mut self.fabric, &mut |_from, msg| {
            match rank.on_notification("d0", msg, now) {
                Ok(s) if s.renewed > 0 => events.push(PEvent::Renewed(s.renewed)),
                Ok(_) => {}
                // Not kvlease's: the engine handles it (here, records it).
                Err(_) => events.push(PEvent::EngineOwn(msg.to_vec())),
            }
        });
        self.rank.poll(now);
        if self.rank.pending_reports() > 0 {
            let n = self.rank.encode_reports(&mut self.buf).expect("reports");
            if let Ok(m) = ReportMsg::decode(&self.buf[..n]) {
                for rep in m.iter() {
                    events.push(PEvent::RankReleased(rep.reason));
                }
            }
            let msg = self.buf[..n].to_vec();
            self.sched.apply_reports(0, &msg).expect("reports apply");
        }
        let mut tickets = Vec::new();
        self.sched.drain_released(|r| {
            events.push(PEvent::Released(r.request_id.to_owned(), r.reason));
            tickets.extend(r.slot);
        });
        for t in tickets {
            self.sched.blocks_freed(t);
        }
    }
}

/// The D worker's peer address for P: the agent name the engine's
/// handshake delivered (so `start_handshake` finds the registered peer).
pub type NameAddress = Box<dyn Fn(&EngineKey<'_>, u32, &mut dyn fmt::Write) -> fmt::Result>;

/// Where D's load stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadState {
    /// Not started.
    Idle,
    /// The engine's block READ is in flight.
    Reading,
    /// The lease check is in flight.
    Verifying,
    /// The verdict.
    Done(Verdict),
    /// An unverified load (vLLM's behaviour) completed its block READ.
    Read,
}

/// A D worker embedding kvlease in its engine's agent.
pub struct DWorker<E: EngineAgent> {
    /// The engine's side.
    pub engine: E,
    tracker: HeartbeatTracker,
    sender: HeartbeatSender<E::F, NameAddress>,
    verifier: LeaseVerifier,
    p: Option<(AgentId, EngineHello)>,
    /// The load's state.
    pub load: LoadState,
    lease: Option<LeaseFields>,
    /// The read-done to send once the check is done (verified loads).
    read_done: Vec<u8>,
    verify: bool,
}

impl<E: EngineAgent> DWorker<E> {
    /// The engine registers its landing buffer; kvlease's verifier its
    /// landing words; P's name (from the handshake) is its peer address.
    pub fn new(mut engine: E, mut fabric: E::F, p_name: String) -> DWorker<E> {
        let config = lease_config();
        engine.register_kv(&mut fabric, 0);
        let address: NameAddress = Box::new(move |_key, _rank, out| out.write_str(&p_name));
        let mut sender = HeartbeatSender::new(fabric, address, SenderConfig::new(&config, 1, 0))
            .expect("sender");
        let verifier = LeaseVerifier::new(
            sender.fabric_mut(),
            &kvlease::testkit::verifier_config(16, 4),
        )
        .expect("verifier");
        let tracker = HeartbeatTracker::new(&config, 1).expect("tracker");
        DWorker {
            engine,
            tracker,
            sender,
            verifier,
            p: None,
            load: LoadState::Idle,
            lease: None,
            read_done: Vec::new(),
            verify: true,
        }
    }

    /// kvlease's fabric.
    pub fn fabric(&mut self) -> &mut E::F {
        self.sender.fabric_mut()
    }

    /// Registers P from the engine's handshake message.
    pub fn connect(&mut self, hello: EngineHello, now: Instant) -> AgentId {
        let advert = LeaseAdvert::decode(&hello.advert).expect("P's advert decodes");
        let record = PeerRecord {
            agent_name: &hello.name,
            metadata: &hello.metadata,
            advert: Some(advert),
            clock: None,
            regions: &[],
        };
        let id = self
            .sender
            .fabric_mut()
            .add_peer(&record, now)
            .expect("add_peer");
        self.p = Some((id, hello));
        id
    }

    /// A request for P's `p_id` arrived: heartbeat it while it waits.
    pub fn track(&mut self, d_id: &str, p_id: &str, lease: LeaseFields, now: Instant) {
        let params = RemotePrefillParams {
            do_remote_prefill: true,
            remote_engine_id: Some(ENGINE_ID),
            remote_request_id: Some(p_id),
            remote_host: Some("p"),
            remote_port: Some(1),
            tp_size: Some(1),
            remote_lease_slot: Some(lease.slot),
            remote_lease_nonce: Some(lease.nonce.as_int64()),
            ..Default::default()
        };
        self.tracker
            .on_new_request(d_id, &params, now)
            .expect("tracked");
        self.lease = Some(lease);
    }

    /// The engine sends one of its own notifications to P.
    pub fn send_engine_note(&mut self, now: Instant) {
        let (_, hello) = self.p.as_ref().expect("connected");
        let name = hello.name.clone();
        self.engine
            .send_own(self.sender.fabric_mut(), &name, ENGINE_NOTE, now);
    }

    /// Starts pulling `p_id`'s KV with the engine's block READ. A load
    /// that `verify`s carries no notification (the spec's order: block
    /// READs, then the slot check, then the read-done with the nonce);
    /// otherwise the read-done rides on the block READ, as in vLLM.
    /// `attach_anyway` attaches it to a verified load too (the mistake that
    /// `read_done_on_the_block_read_defeats_the_check` shows).
    pub fn start_load(&mut self, p_id: &str, verify: bool, attach_anyway: bool, now: Instant) {
        let lease = self.lease.filter(|_| verify);
        let (_, hello) = self.p.as_ref().expect("connected");
        let (name, kv) = (hello.name.clone(), hello.kv);
        let mut done = [0u8; 256];
        let n = wire::encode_read_done(p_id, 1, self.lease.map(|l| l.nonce), &mut done)
            .expect("read-done");
        self.read_done = done[..n].to_vec();
        let attach = lease.is_none() || attach_anyway;
        let note: &[u8] = if attach { &done[..n] } else { &[] };
        self.engine
            .post_block_read(self.sender.fabric_mut(), &name, kv, note, now);
        if attach {
            self.read_done.clear();
        }
        self.load = LoadState::Reading;
        self.verify = verify;
    }

    /// One engine step: heartbeats, the load, and the engine's drain.
    pub fn step(&mut self, now: Instant) {
        self.sender.step(&mut self.tracker, now);
        match self.load {
            LoadState::Reading => match self.engine.block_read_state(self.sender.fabric_mut(), now)
            {
                None => {}
                Some(false) => self.load = LoadState::Done(Verdict::Unverifiable),
                Some(true) if !self.verify => self.load = LoadState::Read,
                Some(true) => {
                    // The block READ is done: now check the lease slot, on
                    // the same agent, after it (the spec's ordering).
                    let (id, _) = self.p.as_ref().expect("connected");
                    let info = match self.sender.fabric_mut().handshake_state(*id, now) {
                        kvlease::fabric::HandshakeState::Ready(info) => info,
                        other => panic!("P not connected: {other:?}"),
                    };
                    let target = VerifyTarget::from_peer(*id, &info).expect("P exports slots");
                    self.verifier
                        .submit(1, self.lease, &[target])
                        .expect("submit");
                    self.load = LoadState::Verifying;
                }
            },
            LoadState::Verifying => {
                let mut verdict = None;
                self.verifier
                    .step(self.sender.fabric_mut(), now, |_, v| verdict = Some(v));
                if let Some(v) = verdict {
                    if v == Verdict::Verified {
                        assert!(
                            self.engine.landing().iter().all(|&b| b == KV_BYTE),
                            "verified, but the landing buffer is not P's KV"
                        );
                    }
                    self.load = LoadState::Done(v);
                    // Whatever the verdict, P may let go now.
                    if !self.read_done.is_empty() {
                        let (id, _) = self.p.as_ref().expect("connected");
                        self.sender
                            .fabric_mut()
                            .send_notification(*id, &self.read_done)
                            .expect("read-done");
                        self.read_done.clear();
                    }
                }
            }
            _ => {}
        }
        let mut heard = 0usize;
        self.engine
            .drain(self.sender.fabric_mut(), &mut |_, _| heard += 1);
    }

    /// The request finished on D: stop heartbeating it.
    pub fn finish(&mut self, d_id: &str) {
        self.tracker.on_request_finished(d_id);
    }
}

/// The protocol over the embedded fabrics, as a scenario sees it: P and D
/// stepped together (in one process, or each in its own with the commands
/// crossing a pipe).
pub trait Deployment {
    /// D's engine.
    type E: EngineAgent;
    /// D's worker.
    fn d(&mut self) -> &mut DWorker<Self::E>;
    /// The clock.
    fn now(&self) -> Instant;
    /// One step of both workers; P's events since the last call.
    fn step(&mut self) -> Vec<PEvent>;
    /// P grants `id`.
    fn grant(&mut self, id: &str) -> LeaseFields;
    /// D tracks `d_id` for P's `p_id`.
    fn track(&mut self, d_id: &str, p_id: &str, lease: LeaseFields);
    /// D's engine sends one of its own notifications to P.
    fn engine_note(&mut self) {
        let now = self.now();
        self.d().send_engine_note(now);
    }
    /// D starts its load of `p_id` (see [`DWorker::start_load`]).
    fn load(&mut self, p_id: &str, verify: bool, attach_anyway: bool) {
        let now = self.now();
        self.d().start_load(p_id, verify, attach_anyway, now);
    }
    /// D's load state.
    fn load_state(&mut self) -> LoadState {
        self.d().load
    }
    /// D finishes `d_id`.
    fn finish(&mut self, d_id: &str) {
        self.d().finish(d_id);
    }
    /// How long one step takes.
    fn step_len(&self) -> Duration;
}

/// Steps until `done` holds on the events seen so far or `limit` passes.
pub fn run_until<D: Deployment>(
    d: &mut D,
    events: &mut Vec<PEvent>,
    limit: Duration,
    mut done: impl FnMut(&[PEvent], LoadState) -> bool,
) -> bool {
    let end = d.now() + limit;
    loop {
        events.extend(d.step());
        let state = d.load_state();
        if done(events, state) {
            return true;
        }
        if d.now() > end {
            return false;
        }
    }
}

/// Waits for P's release of `id`; asserts it was by read-done.
fn released_by_read_done<D: Deployment>(d: &mut D, events: &mut Vec<PEvent>, id: &str) {
    let limit = Duration::from_secs(10);
    assert!(
        run_until(d, events, limit, |ev, _| ev
            .iter()
            .any(|e| matches!(e, PEvent::Released(x, _) if x == id))),
        "P never released {id}: {events:?}"
    );
    assert!(
        events.contains(&PEvent::Released(id.into(), ReleaseReason::ReadDone)),
        "{events:?}"
    );
}

/// Steps until D's load has an outcome; returns it.
fn load_outcome<D: Deployment>(d: &mut D, events: &mut Vec<PEvent>) -> LoadState {
    let limit = Duration::from_secs(10);
    assert!(
        run_until(d, events, limit, |_, s| matches!(
            s,
            LoadState::Done(_) | LoadState::Read
        )),
        "no outcome for the load"
    );
    d.load_state()
}

/// The scenario (issue 12): D heartbeats P's lease through P's engine
/// agent for longer than the initial lease; P's engine routes the
/// heartbeats to kvlease and gets its own notification back; D's engine
/// READs the blocks, kvlease checks the slot on the same agent and sends
/// the read-done (the spec's order for a verified load); P lets go on it.
/// Then a load without verification, as vLLM does it: the read-done rides
/// on the engine's block READ, and P lets go on that.
pub fn heartbeats_verify_and_release<D: Deployment>(d: &mut D) {
    let config = lease_config();
    let mut events = Vec::new();
    let lease = d.grant("req-e");
    let granted = d.now();
    d.track("d-e", "req-e", lease);
    d.engine_note();
    // 1.5 initial leases: heartbeats keep it.
    let held = config.lease_duration() * 3 / 2;
    run_until(d, &mut events, held, |_, _| false);
    assert!(d.now() >= granted + held);
    assert!(
        events.iter().any(|e| matches!(e, PEvent::Renewed(_))),
        "P heard no heartbeat: {events:?}"
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, PEvent::RankReleased(_) | PEvent::Released(..))),
        "a heartbeated lease was released: {events:?}"
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, PEvent::EngineOwn(m) if m == ENGINE_NOTE))
            .count(),
        1,
        "the engine's own notification must come back to the engine, once: {events:?}"
    );
    d.load("req-e", true, false);
    assert_eq!(
        load_outcome(d, &mut events),
        LoadState::Done(Verdict::Verified)
    );
    d.finish("d-e");
    released_by_read_done(d, &mut events, "req-e");

    // vLLM's way: no check, the read-done attached to the block READ.
    let lease = d.grant("req-v");
    d.track("d-v", "req-v", lease);
    d.load("req-v", false, false);
    assert_eq!(load_outcome(d, &mut events), LoadState::Read);
    d.finish("d-v");
    released_by_read_done(d, &mut events, "req-v");
}

/// Why a verified load must not attach its read-done to the block READ:
/// P lets go (and zeroes the slot) as soon as that READ completes, so the
/// slot check that follows finds 0, and a healthy lease fails its load.
pub fn read_done_on_the_block_read_defeats_the_check<D: Deployment>(d: &mut D) {
    let mut events = Vec::new();
    let lease = d.grant("req-x");
    d.track("d-x", "req-x", lease);
    d.load("req-x", true, true);
    assert_eq!(
        load_outcome(d, &mut events),
        LoadState::Done(Verdict::Lapsed)
    );
    released_by_read_done(d, &mut events, "req-x");
}
