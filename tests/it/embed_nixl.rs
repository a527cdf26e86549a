#![cfg(feature = "nixl")]
//! The embedding scenario of `tests/it/embed/mod.rs` over real NIXL, P and D in
//! two processes. Each side creates its own `nixl_sys::Agent` and UCX
//! backend (as an engine worker does), registers its own KV buffer, and
//! exchanges its own handshake message (`embed::EngineHello`: the agent's
//! NIXL metadata, where its KV is, and kvlease's advert) over its own
//! channel, a pipe here. kvlease gets a fabric over that agent
//! (`NixlFabric::with_agent`), the peer the engine registers
//! (`Fabric::add_peer`), and the notifications the engine's drain routes to
//! it. No second agent exists: both processes check `agents_created()`.
//!
//! The parent is D (it drives the scenario); the child, this test binary
//! re-executed with `KVLEASE_EMBED_CHILD=1`, is P. Lines on the pipes:
//!
//! ```text
//!  child -> parent   KVE agents <n> | KVE hello <hex> | KVE granted <slot> <nonce> | KVE ev <event>
//!  parent -> child   grant <id>
//! ```
//!
//! Needs `libnixl_capi.so` on `LD_LIBRARY_PATH`; otherwise `SKIPPED`, unless
//! `KVLEASE_REQUIRE_NIXL=1`.

use crate::embed;
use crate::support::child::{spawn_test_child, KillOnDrop};
use crate::support::exact_test_name;
use crate::support::pipes;
use std::io::Write;
use std::process::ChildStdin;
use std::sync::mpsc::Receiver;
use std::time::Duration;

use kvlease::fabric::nixl::{agents_created, drain_raw_notifications, NixlConfig, NixlFabric};
use kvlease::fabric::Fabric;
use kvlease::{Instant, LeaseFields, MonotonicClock, Nonce};
use nixl_sys::{
    Agent, AgentConfig, MemType, NixlRegistration, NotificationMap, OptArgs, SystemStorage,
    ThreadSync, XferDescList, XferOp, XferRequest, XferStatus,
};

use crate::embed::{
    DWorker, Deployment, EngineAgent, EngineHello, PEvent, PWorker, RemoteKv, KV_LEN,
};
use crate::support::nixl_gate::{nixl_parent_or_child, say};
use crate::support::pipes::{hex, parse_reason, reason_text, unhex};

const CHILD_ENV: &str = "KVLEASE_EMBED_CHILD";
const STEP: Duration = Duration::from_millis(2);

// ---- the engine's own code: its agent, its buffer, its drain, its READ ---------------

/// An engine worker's agent, made the way an engine makes it: no progress
/// thread (its loop drains every step), UCX with error handling `none`.
fn engine_agent(name: &str) -> Agent {
    let cfg = AgentConfig {
        enable_prog_thread: false,
        enable_listen_thread: false,
        thread_sync: ThreadSync::Default,
        num_workers: 1,
        pthr_delay_us: 0,
        capture_telemetry: false,
        ..AgentConfig::default()
    };
    let agent = Agent::new_configured(name, &cfg).expect("engine agent");
    let (_mems, defaults) = agent.get_plugin_params("UCX").expect("UCX params");
    let mut params = defaults.clone().expect("params");
    params
        .set("ucx_error_handling_mode", "none")
        .expect("error handling");
    agent.create_backend("UCX", &params).expect("UCX backend");
    agent
}

/// The engine's side over its own NIXL agent.
struct NixlEngine {
    agent: Agent,
    buf: Option<SystemStorage>,
    map: NotificationMap,
    xfer: Option<(XferRequest, bool)>,
}

impl NixlEngine {
    fn new(agent: Agent) -> NixlEngine {
        NixlEngine {
            agent,
            buf: None,
            map: NotificationMap::new().expect("map"),
            xfer: None,
        }
    }
}

impl EngineAgent for NixlEngine {
    type F = NixlFabric;

    fn register_kv(&mut self, _f: &mut NixlFabric, byte: u8) -> RemoteKv {
        let mut s = SystemStorage::new(KV_LEN).expect("storage");
        s.memset(byte);
        s.register(&self.agent, None).expect("register KV");
        let kv = RemoteKv {
            addr: s.as_slice().as_ptr() as u64,
            len: KV_LEN as u64,
        };
        self.buf = Some(s);
        kv
    }

    fn hello(&self, f: &NixlFabric, kv: RemoteKv) -> EngineHello {
        EngineHello {
            name: self.agent.name(),
            // Taken after kvlease registered its slots on this agent.
            metadata: self.agent.get_local_md().expect("metadata"),
            kv,
            advert: f.lease_advert().encode().to_vec(),
        }
    }

    fn drain(&mut self, _f: &mut NixlFabric, sink: &mut dyn FnMut(&str, &[u8])) {
        // kvlease's raw drain: an engine's own drain that a notification
        // which is not UTF-8 cannot wedge.
        drain_raw_notifications(&self.agent, &mut self.map, sink).expect("drain");
    }

    fn send_own(&mut self, _f: &mut NixlFabric, peer: &str, msg: &[u8], _now: Instant) {
        self.agent
            .send_notification(peer, msg, None)
            .expect("engine's notification");
    }

    fn post_block_read(
        &mut self,
        _f: &mut NixlFabric,
        peer: &str,
        kv: RemoteKv,
        notification: &[u8],
        _now: Instant,
    ) {
        let landing = self.buf.as_ref().expect("landing registered");
        let mut local = XferDescList::new(MemType::Dram).expect("dlist");
        let mut remote = XferDescList::new(MemType::Dram).expect("dlist");
        local.add_desc(landing.as_slice().as_ptr() as usize, KV_LEN, 0);
        remote.add_desc(kv.addr as usize, kv.len as usize, 0);
        let req = self
            .agent
            .create_xfer_req(XferOp::Read, &local, &remote, peer, None)
            .expect("block READ request");
        let mut opt = OptArgs::new().expect("opt");
        if notification.is_empty() {
            opt.set_has_notification(false).expect("opt");
        } else {
            opt.set_notification_message(notification).expect("opt");
            opt.set_has_notification(true).expect("opt");
        }
        let in_progress = self
            .agent
            .post_xfer_req(&req, Some(&opt))
            .expect("post block READ");
        self.xfer = Some((req, !in_progress));
    }

    fn block_read_state(&mut self, _f: &mut NixlFabric, _now: Instant) -> Option<bool> {
        let (req, done) = self.xfer.as_ref()?;
        if *done {
            return Some(true);
        }
        match self.agent.get_xfer_status(req) {
            Ok(XferStatus::Success) => Some(true),
            Ok(XferStatus::InProgress) => None,
            Err(_) => Some(false),
        }
    }

    fn landing(&self) -> Vec<u8> {
        self.buf.as_ref().expect("registered").as_slice().to_vec()
    }
}

fn kvlease_config(clock: MonotonicClock) -> NixlConfig {
    // The engine exchanges metadata itself: no side channel of ours.
    let mut c = NixlConfig::new("unused: the engine's agent names the fabric");
    c.side_channel = false;
    c.clock = clock;
    c
}

fn event_line(e: &PEvent) -> String {
    match e {
        PEvent::Renewed(n) => format!("KVE ev renewed {n}"),
        PEvent::RankReleased(r) => format!("KVE ev rank-released {}", reason_text(*r)),
        PEvent::Released(id, r) => format!("KVE ev released {id} {}", reason_text(*r)),
        PEvent::EngineOwn(m) => format!("KVE ev own {}", hex(m)),
    }
}

fn parse_event(w: &[&str]) -> Option<PEvent> {
    Some(match w {
        ["renewed", n] => PEvent::Renewed(n.parse().ok()?),
        ["rank-released", r] => PEvent::RankReleased(parse_reason(r)?),
        ["released", id, r] => PEvent::Released(id.to_string(), parse_reason(r)?),
        ["own", m] => PEvent::EngineOwn(unhex(m)?),
        _ => return None,
    })
}

// ---- the P process --------------------------------------------------------------------

fn p_main() {
    let clock = MonotonicClock::new();
    let agent = engine_agent(&format!("embed-p-{}", std::process::id()));
    let fabric = NixlFabric::with_agent(&agent, kvlease_config(clock)).expect("fabric");
    let mut p = PWorker::new(NixlEngine::new(agent), fabric, clock.now());
    let out = std::io::stdout();
    let emit = |line: String| {
        let mut o = out.lock();
        let _ = writeln!(o, "{line}");
        let _ = o.flush();
    };
    emit(format!("KVE agents {}", agents_created()));
    emit(format!("KVE hello {}", hex(&p.hello().encode())));
    let rx = pipes::stdin_lines();
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let now = clock.now();
        while let Ok(cmd) = rx.try_recv() {
            let Some(cmd) = cmd else { return };
            if let Some(id) = cmd.strip_prefix("grant ") {
                let l = p.grant(id, now);
                emit(format!("KVE granted {} {}", l.slot, l.nonce.get()));
            }
        }
        let mut events = Vec::new();
        p.step(now, &mut events);
        for e in &events {
            emit(event_line(e));
        }
        std::thread::sleep(STEP);
    }
}

// ---- the D process (the test) ---------------------------------------------------------

struct NixlDeployment {
    clock: MonotonicClock,
    _child: KillOnDrop,
    stdin: ChildStdin,
    lines: Receiver<String>,
    d: DWorker<NixlEngine>,
    granted: Option<LeaseFields>,
}

impl NixlDeployment {
    fn start() -> NixlDeployment {
        let child = spawn_test_child(
            &exact_test_name!(embedded_in_engine_agents_over_nixl),
            &[(CHILD_ENV, "1")],
            true,
            // P's protocol lines, without the prefix; the rest is libtest's.
            |line| line.find("KVE ").map(|i| line[i + 4..].to_owned()),
        );
        let rx = child.lines;
        let wait = |what: &str| -> String {
            let line = rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("P never sent {what}"));
            line.strip_prefix(what)
                .unwrap_or_else(|| panic!("expected {what}, got {line}"))
                .to_owned()
        };
        let p_agents: u64 = wait("agents ").parse().expect("a count");
        assert_eq!(p_agents, 0, "kvlease created an agent in the P process");
        let hello = EngineHello::decode(&unhex(&wait("hello ")).expect("hex")).expect("hello");

        let clock = MonotonicClock::new();
        let agent = engine_agent(&format!("embed-d-{}", std::process::id()));
        let fabric = NixlFabric::with_agent(&agent, kvlease_config(clock)).expect("fabric");
        assert!(fabric.engine_drains());
        let mut d = DWorker::new(NixlEngine::new(agent), fabric, hello.name.clone());
        d.connect(hello, clock.now());
        assert_eq!(
            agents_created(),
            0,
            "kvlease created an agent in the D process"
        );
        NixlDeployment {
            clock,
            _child: child.process,
            stdin: child.stdin.expect("piped"),
            lines: rx,
            d,
            granted: None,
        }
    }

    fn tell(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("P's stdin");
        self.stdin.flush().expect("flush");
    }
}

impl Deployment for NixlDeployment {
    type E = NixlEngine;

    fn d(&mut self) -> &mut DWorker<NixlEngine> {
        &mut self.d
    }

    fn now(&self) -> Instant {
        self.clock.now()
    }

    fn step(&mut self) -> Vec<PEvent> {
        self.d.step(self.clock.now());
        std::thread::sleep(STEP);
        let mut events = Vec::new();
        while let Ok(line) = self.lines.try_recv() {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["ev", rest @ ..] => events.push(parse_event(rest).expect("P's event")),
                ["granted", slot, nonce] => {
                    self.granted =
                        LeaseFields::from_params(slot.parse().ok(), nonce.parse::<i64>().ok());
                    assert!(self
                        .granted
                        .is_some_and(|l| Nonce::new(l.nonce.get()).is_some()));
                }
                _ => panic!("P said {line:?}"),
            }
        }
        events
    }

    fn grant(&mut self, id: &str) -> LeaseFields {
        self.granted = None;
        self.tell(&format!("grant {id}"));
        let end = self.clock.now() + Duration::from_secs(10);
        while self.granted.is_none() {
            assert!(self.clock.now() < end, "P never granted {id}");
            // Events before the grant belong to nobody waiting here.
            let _ = self.step();
        }
        self.granted.expect("granted")
    }

    fn track(&mut self, d_id: &str, p_id: &str, lease: LeaseFields) {
        let now = self.clock.now();
        self.d.track(d_id, p_id, lease, now);
    }

    fn step_len(&self) -> Duration {
        STEP
    }
}

#[test]
fn embedded_in_engine_agents_over_nixl() {
    let Some(_g) = nixl_parent_or_child(CHILD_ENV, p_main) else {
        return;
    };
    let t0 = std::time::Instant::now();
    let mut d = NixlDeployment::start();
    embed::heartbeats_verify_and_release(&mut d);
    say(&format!(
        "embedded over nixl (2 processes, the engines' own agents): {:.1} s; kvlease agents created: {}",
        t0.elapsed().as_secs_f64(),
        agents_created()
    ));
    assert_eq!(agents_created(), 0);
}
