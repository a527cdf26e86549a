//! The embedding scenario of `tests/it/embed/mod.rs` over the loopback fabric:
//! P and D in one process, in virtual time. On loopback the engine's agent
//! *is* the `LoopbackFabric` object, and kvlease works on it through the
//! same API as on NIXL: `lease_advert` into the engine's handshake message,
//! `add_peer` from it, the engine's drain routing kvlease's notifications.

use crate::embed;
use std::sync::Arc;
use std::time::Duration;

use kvlease::fabric::loopback::{LoopbackConfig, LoopbackFabric, LoopbackNetwork};
use kvlease::fabric::{
    Fabric, FabricError, LeaseAdvert, PeerRecord, ReadDesc, RegionId, SlotRegion, XferId, XferState,
};
use kvlease::{Instant, LeaseFields};

use crate::embed::{
    DWorker, Deployment, EngineAgent, EngineHello, PEvent, PWorker, RemoteKv, KV_LEN,
};

/// The engine's side over a loopback agent.
#[derive(Default)]
struct LoopbackEngine {
    /// The engine's buffer (leaked: registered memory must outlive the
    /// network).
    buf: Option<&'static mut [u8]>,
    region: Option<RegionId>,
    xfer: Option<XferId>,
}

impl EngineAgent for LoopbackEngine {
    type F = LoopbackFabric;

    fn register_kv(&mut self, f: &mut LoopbackFabric, byte: u8) -> RemoteKv {
        let buf: &'static mut [u8] = Box::leak(vec![byte; KV_LEN].into_boxed_slice());
        // SAFETY: leaked, so allocated and unmoved past the network; read
        // through the raw pointer only after a READ into it completed.
        let region = unsafe { f.register_memory(buf.as_mut_ptr(), buf.len()) }.expect("register");
        self.buf = Some(buf);
        self.region = Some(region);
        RemoteKv {
            addr: u64::from(region.0),
            len: KV_LEN as u64,
        }
    }

    fn hello(&self, f: &LoopbackFabric, kv: RemoteKv) -> EngineHello {
        EngineHello {
            name: f.name().to_owned(),
            metadata: Vec::new(),
            kv,
            advert: f.lease_advert().encode().to_vec(),
        }
    }

    fn drain(&mut self, f: &mut LoopbackFabric, sink: &mut dyn FnMut(&str, &[u8])) {
        f.drain_notifications(sink).expect("drain");
    }

    fn send_own(&mut self, f: &mut LoopbackFabric, peer: &str, msg: &[u8], now: Instant) {
        let id = f.start_handshake(peer, now).expect("registered peer");
        f.send_notification(id, msg).expect("send");
    }

    fn post_block_read(
        &mut self,
        f: &mut LoopbackFabric,
        peer: &str,
        kv: RemoteKv,
        notification: &[u8],
        now: Instant,
    ) {
        let id = f.start_handshake(peer, now).expect("registered peer");
        let desc = ReadDesc {
            local: self.region.expect("landing registered"),
            local_offset: 0,
            remote: RegionId(kv.addr as u32),
            remote_offset: 0,
            len: kv.len,
        };
        let note = (!notification.is_empty()).then_some(notification);
        self.xfer = Some(f.post_read(id, &[desc], note, now).expect("block READ"));
    }

    fn block_read_state(&mut self, f: &mut LoopbackFabric, now: Instant) -> Option<bool> {
        match f.read_state(self.xfer?, now) {
            XferState::InProgress => None,
            XferState::Done => Some(true),
            XferState::Failed(_) => Some(false),
        }
    }

    fn landing(&self) -> Vec<u8> {
        self.buf.as_deref().expect("registered").to_vec()
    }
}

/// Both workers in one process, stepped in turn every 10 ms of virtual time.
struct LoopbackDeployment {
    net: Arc<LoopbackNetwork>,
    now: Instant,
    p: PWorker<LoopbackEngine>,
    d: DWorker<LoopbackEngine>,
}

const STEP: Duration = Duration::from_millis(10);

impl LoopbackDeployment {
    fn new() -> LoopbackDeployment {
        let net = LoopbackNetwork::new(LoopbackConfig {
            read_latency: Duration::from_millis(1),
            ..LoopbackConfig::default()
        });
        let now = Instant::from_secs(50);
        net.advance_to(now);
        let p_fabric = LoopbackFabric::join(&net, "p-engine-agent").expect("join");
        let d_fabric = LoopbackFabric::join(&net, "d-engine-agent").expect("join");
        let p = PWorker::new(LoopbackEngine::default(), p_fabric, now);
        // The engine's own handshake: P's message, over the engine's channel
        // (here, bytes handed across).
        let hello = EngineHello::decode(&p.hello().encode()).expect("hello");
        let mut d = DWorker::new(LoopbackEngine::default(), d_fabric, hello.name.clone());
        d.connect(hello, now);
        LoopbackDeployment { net, now, p, d }
    }
}

impl Deployment for LoopbackDeployment {
    type E = LoopbackEngine;

    fn d(&mut self) -> &mut DWorker<LoopbackEngine> {
        &mut self.d
    }

    fn now(&self) -> Instant {
        self.now
    }

    fn step(&mut self) -> Vec<PEvent> {
        let mut events = Vec::new();
        self.d.step(self.now);
        self.p.step(self.now, &mut events);
        self.now = self.now + STEP;
        self.net.advance_to(self.now);
        events
    }

    fn grant(&mut self, id: &str) -> LeaseFields {
        self.p.grant(id, self.now)
    }

    fn track(&mut self, d_id: &str, p_id: &str, lease: LeaseFields) {
        self.d.track(d_id, p_id, lease, self.now);
    }

    fn step_len(&self) -> Duration {
        STEP
    }
}

#[test]
fn embedded_heartbeats_verify_and_release() {
    let mut d = LoopbackDeployment::new();
    embed::heartbeats_verify_and_release(&mut d);
}

#[test]
fn embedded_read_done_on_the_block_read_defeats_the_check() {
    let mut d = LoopbackDeployment::new();
    embed::read_done_on_the_block_read_defeats_the_check(&mut d);
}

#[test]
fn add_peer_checks_the_advert_against_the_remote() {
    let net = LoopbackNetwork::new(LoopbackConfig::default());
    let now = Instant::from_secs(1);
    let mut p = LoopbackFabric::join(&net, "p").expect("join");
    let mut d = LoopbackFabric::join(&net, "d").expect("join");
    let slots = Arc::new(kvlease::LeaseSlots::new(8));
    p.register_slots(slots, true).expect("slots");
    let advert = p.lease_advert();
    let s = advert.slots.expect("slots advertised");
    assert_eq!((s.count, s.len), (8, 64));
    assert!(advert.compact_heartbeats);
    let record = |name, advert| PeerRecord {
        agent_name: name,
        metadata: &[],
        advert,
        clock: None,
        regions: &[],
    };
    // An unknown agent, or an advert naming a region that is not the
    // remote's slot array, is refused.
    assert_eq!(
        d.add_peer(&record("nobody", Some(advert)), now),
        Err(FabricError::BadAddress)
    );
    let wrong = LeaseAdvert {
        slots: Some(SlotRegion { addr: 7, ..s }),
        ..advert
    };
    assert_eq!(
        d.add_peer(&record("p", Some(wrong)), now),
        Err(FabricError::UnknownRegion)
    );
    // The right one connects at once, and the sender's address (the name)
    // finds it.
    let id = d
        .add_peer(&record("p", Some(advert)), now)
        .expect("add_peer");
    match d.handshake_state(id, now) {
        kvlease::fabric::HandshakeState::Ready(info) => {
            assert_eq!(info.slot_count, 8);
            assert!(info.compact_heartbeats);
            assert!(info.slot_region.is_some());
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(d.start_handshake("p", now), Ok(id));
    // A peer without kvlease (vLLM): connected, nothing to verify against.
    let q = LoopbackFabric::join(&net, "q").expect("join");
    let id = d.add_peer(&record("q", None), now).expect("add_peer");
    match d.handshake_state(id, now) {
        kvlease::fabric::HandshakeState::Ready(info) => assert_eq!(info.slot_region, None),
        other => panic!("{other:?}"),
    }
    drop(q);
}
