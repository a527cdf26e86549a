//! An engine worker that owns its NIXL agent and its handshake, with
//! kvlease plugged into both (`docs/embedding.md`, "On the engine's own NIXL
//! agent and handshake"). Run it with the NIXL runtime on `LD_LIBRARY_PATH`
//! (`eval "$(.ci/nixl-runtime.sh | tail -1)"`):
//!
//! ```text
//! cargo run --example engine_worker --features nixl
//! ```
//!
//! Two workers, each on its own thread with its own agent (an `Agent` is not
//! `Send`; real engines run one process per GPU, the threads stand in):
//!
//! - **P** creates its agent and UCX backend, registers its KV buffer, lets
//!   kvlease register the lease slots on the same agent, grants a lease, and
//!   answers D's connection on a Unix socket with its own handshake message:
//!   agent name, NIXL metadata, KV address, kvlease's advert, and the lease
//!   fields (which a router would carry in `kv_transfer_params`). Each step
//!   it drains its agent once and hands every notification to kvlease's
//!   rank first; what kvlease refuses is the engine's.
//! - **D** creates its agent, registers its landing buffer, reads P's
//!   message, registers P with kvlease (`Fabric::add_peer`), heartbeats the
//!   lease, READs P's blocks with its own NIXL request, has kvlease check
//!   the lease slot on the same agent, then sends the read-done (with the
//!   nonce) so that P frees the blocks.

#[cfg(feature = "nixl")]
fn main() {
    worker::main();
}

#[cfg(not(feature = "nixl"))]
fn main() {
    eprintln!(
        "engine_worker needs the nixl feature: cargo run --example engine_worker --features nixl"
    );
}

#[cfg(feature = "nixl")]
mod worker {
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::sync::Arc;
    use std::time::Duration;

    use kvlease::consumer::{LeaseVerifier, Verdict, VerifierConfig, VerifyTarget};
    use kvlease::fabric::nixl::{
        agents_created, drain_raw_notifications, runtime_available, NixlConfig, NixlFabric,
    };
    use kvlease::fabric::{Fabric, HandshakeState, LeaseAdvert, PeerRecord};
    use kvlease::wire::{self, CompactEntry};
    use kvlease::{
        EngineShape, LeaseConfig, LeaseFields, LeaseSlots, MonotonicClock, Nonce, PrefillRank,
        PrefillScheduler,
    };
    use nixl_sys::{
        Agent, AgentConfig, MemType, NixlRegistration, NotificationMap, OptArgs, SystemStorage,
        ThreadSync, XferDescList, XferOp, XferStatus,
    };

    const KV_LEN: usize = 64 * 1024;

    /// How the engine makes its agent: no progress thread (its loop
    /// drains every step), UCX with error handling `none`.
    fn engine_agent(name: &str) -> Agent {
        let cfg = AgentConfig {
            enable_prog_thread: false,
            enable_listen_thread: false,
            thread_sync: ThreadSync::Default,
            num_workers: 1,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(name, &cfg).expect("agent");
        let (_, defaults) = agent.get_plugin_params("UCX").expect("UCX");
        let mut params = defaults.clone().expect("params");
        params
            .set("ucx_error_handling_mode", "none")
            .expect("param");
        agent.create_backend("UCX", &params).expect("UCX backend");
        agent
    }

    /// kvlease on the engine's agent: no agent, no side channel of its own.
    fn kvlease_fabric(agent: &Agent, clock: MonotonicClock) -> NixlFabric {
        let mut cfg = NixlConfig::new("ignored: the agent names the fabric");
        cfg.side_channel = false;
        cfg.clock = clock;
        NixlFabric::with_agent(agent, cfg).expect("kvlease fabric")
    }

    fn lease_config() -> LeaseConfig {
        let mut c = LeaseConfig::new(EngineShape {
            num_kv_blocks: 16,
            max_num_seqs: 4,
        });
        c.lease_duration = Duration::from_secs(6);
        c.validate().expect("config");
        c
    }

    /// The engine's own handshake message: length-prefixed fields.
    fn put(out: &mut Vec<u8>, field: &[u8]) {
        out.extend_from_slice(&(field.len() as u32).to_le_bytes());
        out.extend_from_slice(field);
    }

    fn take<'a>(b: &mut &'a [u8]) -> &'a [u8] {
        let (n, rest) = b.split_at(4);
        let n = u32::from_le_bytes(n.try_into().expect("4 bytes")) as usize;
        let (field, rest) = rest.split_at(n);
        *b = rest;
        field
    }

    fn prefill_worker(socket: UnixListener) {
        let clock = MonotonicClock::new();
        let agent = engine_agent("example-p");
        // The engine's KV buffer, registered by the engine.
        let mut kv = SystemStorage::new(KV_LEN).expect("kv");
        kv.memset(0xAB);
        kv.register(&agent, None).expect("register kv");
        // kvlease's lease slots, registered on the same agent.
        let config = lease_config();
        let slots = Arc::new(LeaseSlots::new(config.lease_slots));
        let mut fabric = kvlease_fabric(&agent, clock);
        fabric.register_slots(slots.clone(), true).expect("slots");
        let mut sched = PrefillScheduler::new(&config, 1, clock.now()).expect("scheduler");
        let mut rank = PrefillRank::new(&config, 0, slots, clock.now()).expect("rank");
        let lease = sched.grant("req-1", clock.now()).expect("grant");
        let fields = lease.lease_fields().expect("slotted");
        let mut buf = vec![0u8; 1 << 16];
        let n = sched
            .encode_directives(clock.now(), &mut buf)
            .expect("directives");
        rank.apply_directives(&buf[..n], clock.now())
            .expect("directives");

        // The engine's handshake: metadata taken after every registration.
        let mut hello = Vec::new();
        put(&mut hello, agent.name().as_bytes());
        put(&mut hello, &agent.get_local_md().expect("metadata"));
        put(&mut hello, &(kv.as_slice().as_ptr() as u64).to_le_bytes());
        put(&mut hello, &fabric.lease_advert().encode());
        put(&mut hello, &fields.slot.to_le_bytes());
        put(&mut hello, &fields.nonce.get().to_le_bytes());
        let (mut conn, _) = socket.accept().expect("D connects");
        conn.write_all(&(hello.len() as u32).to_le_bytes())
            .expect("send");
        conn.write_all(&hello).expect("send");

        let mut map = NotificationMap::new().expect("map");
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            let now = clock.now();
            // One drain per step, by the engine; kvlease's messages first.
            // The raw drain survives notifications that are not UTF-8
            // (nixl-sys's take_notifs fails on them, and leaves them queued).
            drain_raw_notifications(&agent, &mut map, &mut |from, m| {
                let text = String::from_utf8_lossy(m);
                match rank.on_notification("d0", m, now) {
                    Ok(s) => println!(
                        "P: kvlease's {:?} from {from}: renewed {}",
                        text.get(..4).unwrap_or(&text),
                        s.renewed
                    ),
                    Err(_) => println!("P: the engine's own notification {text:?}"),
                }
            })
            .expect("drain");
            rank.poll(now);
            if rank.pending_reports() > 0 {
                let n = rank.encode_reports(&mut buf).expect("reports");
                let reports = buf[..n].to_vec();
                sched.apply_reports(0, &reports).expect("reports");
            }
            let mut done = false;
            sched.drain_released(|r| {
                println!("P: free the blocks of {} ({:?})", r.request_id, r.reason);
                done = true;
            });
            if done {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        panic!("P: the lease was never released");
    }

    fn decode_worker(path: &std::path::Path) {
        let clock = MonotonicClock::new();
        let agent = engine_agent("example-d");
        let mut landing = SystemStorage::new(KV_LEN).expect("landing");
        landing.register(&agent, None).expect("register landing");
        let mut fabric = kvlease_fabric(&agent, clock);
        let mut verifier =
            LeaseVerifier::new(&mut fabric, &VerifierConfig::new(&lease_config(), 16, 4))
                .expect("verifier");

        // The engine's handshake with P, over its own channel.
        let mut conn = UnixStream::connect(path).expect("connect to P");
        let mut len = [0u8; 4];
        conn.read_exact(&mut len).expect("hello");
        let mut hello = vec![0u8; u32::from_le_bytes(len) as usize];
        conn.read_exact(&mut hello).expect("hello");
        let mut b = &hello[..];
        let name = String::from_utf8(take(&mut b).to_vec()).expect("name");
        let md = take(&mut b).to_vec();
        let kv_addr = u64::from_le_bytes(take(&mut b).try_into().expect("addr"));
        let advert = LeaseAdvert::decode(take(&mut b)).expect("P's advert");
        let slot = u32::from_le_bytes(take(&mut b).try_into().expect("slot"));
        let nonce = u64::from_le_bytes(take(&mut b).try_into().expect("nonce"));
        let lease = LeaseFields::from_params(Some(slot), Some(nonce as i64)).expect("lease");

        // kvlease learns P from the engine's handshake: no second one.
        let p = fabric
            .add_peer(
                &PeerRecord {
                    agent_name: &name,
                    metadata: &md,
                    advert: Some(advert),
                    clock: None,
                    regions: &[],
                },
                clock.now(),
            )
            .expect("add_peer");
        let HandshakeState::Ready(info) = fabric.handshake_state(p, clock.now()) else {
            panic!("P not connected");
        };

        // A heartbeat (a D engine sends one per interval with the sender).
        let mut scratch = [0u8; 256];
        wire::encode_compact_heartbeats(
            [CompactEntry {
                slot: lease.slot,
                nonce: lease.nonce,
            }],
            256,
            &mut scratch,
            |m| fabric.send_notification(p, m).expect("heartbeat"),
        )
        .expect("encode");
        agent
            .send_notification(&name, b"engine: hello from D", None)
            .expect("engine's own");

        // The engine's block READ, on its own request. A verified load
        // attaches no notification: P would free the blocks (and zero the
        // slot) before the check below could see the nonce.
        let mut local = XferDescList::new(MemType::Dram).expect("dlist");
        let mut remote = XferDescList::new(MemType::Dram).expect("dlist");
        local.add_desc(landing.as_slice().as_ptr() as usize, KV_LEN, 0);
        remote.add_desc(kv_addr as usize, KV_LEN, 0);
        let req = agent
            .create_xfer_req(XferOp::Read, &local, &remote, &name, None)
            .expect("request");
        let mut opt = OptArgs::new().expect("opt");
        opt.set_has_notification(false).expect("opt");
        let mut done = !agent.post_xfer_req(&req, Some(&opt)).expect("post");
        let mut notifs = NotificationMap::new().expect("map");
        while !done {
            done = agent.get_xfer_status(&req).expect("status") == XferStatus::Success;
            agent.get_notifications(&mut notifs, None).expect("drain");
        }

        // kvlease's check, after the block READ, on the same agent.
        let target = VerifyTarget::from_peer(p, &info).expect("P exports slots");
        verifier.submit(1, Some(lease), &[target]).expect("submit");
        let mut verdict = None;
        while verdict.is_none() {
            verifier.step(&mut fabric, clock.now(), |_, v| verdict = Some(v));
            agent.get_notifications(&mut notifs, None).expect("drain");
        }
        let verdict = verdict.expect("verdict");
        println!("D: verdict {verdict:?}");
        assert_eq!(verdict, Verdict::Verified);
        assert!(landing.as_slice().iter().all(|&b| b == 0xAB), "P's KV");

        // Now the read-done, with the nonce: P frees the blocks.
        let n =
            wire::encode_read_done("req-1", 1, Nonce::new(nonce), &mut scratch).expect("encode");
        fabric
            .send_notification(p, &scratch[..n])
            .expect("read-done");
        let end = std::time::Instant::now() + Duration::from_secs(2);
        while std::time::Instant::now() < end {
            // Keep progressing: over TCP a notification leaves as the sender's
            // worker is progressed.
            agent.get_notifications(&mut notifs, None).expect("drain");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    pub fn main() {
        if !runtime_available() {
            eprintln!("NIXL runtime not found: eval \"$(.ci/nixl-runtime.sh | tail -1)\" first");
            std::process::exit(2);
        }
        let path =
            std::env::temp_dir().join(format!("kvlease-example-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let socket = UnixListener::bind(&path).expect("bind the engine's socket");
        let p = std::thread::spawn(move || prefill_worker(socket));
        decode_worker(&path);
        p.join().expect("P worker");
        let _ = std::fs::remove_file(&path);
        println!(
            "kvlease agents created: {} (the engines' own agents only)",
            agents_created()
        );
    }
}
