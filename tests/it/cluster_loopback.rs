//! The engine-shaped deployment of `tests/it/cluster/mod.rs` (P: a scheduler and
//! two workers; D: a scheduler and one worker) in one process, on the
//! loopback fabric, in virtual time: every node is stepped once per tick,
//! role messages produced in one tick are delivered at the start of the
//! next (the engine's IPC), and a killed node stops (its agent crashes).
//! Deterministic; bounds are to one step and one wheel tick.

use crate::cluster;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kvlease::fabric::loopback::{LoopbackConfig, LoopbackFabric, LoopbackNetwork, NodeId};
use kvlease::Instant;

use crate::cluster::{
    Cluster, Cmd, DSchedNode, DWorkerNode, Node, Outbox, PRankNode, PSchedNode, Role, Stamped,
    P_TP, STEP,
};

struct Member {
    role: Role,
    node: Box<dyn Node>,
    agent: Option<NodeId>,
    alive: bool,
}

struct LoopbackCluster {
    net: Arc<LoopbackNetwork>,
    now: Instant,
    tick: Duration,
    members: Vec<Member>,
    /// Role messages produced last tick: (sender, bytes).
    inflight: VecDeque<(Role, Vec<u8>)>,
    events: Vec<Stamped>,
}

impl LoopbackCluster {
    fn new() -> LoopbackCluster {
        let config = cluster::lease_config();
        let net = LoopbackNetwork::new(LoopbackConfig {
            handshake_polls: 2,
            read_latency: Duration::from_millis(1),
            // A dead peer is silent: its READs time out, as the NIXL
            // fabric's do (its default transfer timeout).
            transfer_timeout: Duration::from_secs(5),
            ..LoopbackConfig::default()
        });
        let now = Instant::from_secs(100);
        net.advance_to(now);
        let mut members = Vec::new();
        members.push(Member {
            role: Role::PSched,
            node: Box::new(PSchedNode::new(&config, now)),
            agent: None,
            alive: true,
        });
        for r in 0..P_TP {
            let role = Role::PRank(r);
            let f = LoopbackFabric::join(&net, &role.name()).expect("join");
            let agent = Some(f.node());
            members.push(Member {
                role,
                node: Box::new(PRankNode::new(f, &config, r, now)),
                agent,
                alive: true,
            });
        }
        members.push(Member {
            role: Role::DSched,
            node: Box::new(DSchedNode::new(&config)),
            agent: None,
            alive: true,
        });
        let d = LoopbackFabric::join(&net, &Role::DWorker.name()).expect("join");
        let agent = Some(d.node());
        members.push(Member {
            role: Role::DWorker,
            node: Box::new(DWorkerNode::new(d, &config)),
            agent,
            alive: true,
        });
        let mut c = LoopbackCluster {
            net,
            now,
            tick: config.wheel_tick(),
            members,
            inflight: VecDeque::new(),
            events: Vec::new(),
        };
        // D's discovery: a loopback agent's address is its name.
        for r in 0..P_TP {
            c.command(Role::DWorker, Cmd::Peer(r, Role::PRank(r).name()));
        }
        c
    }

    fn member(&mut self, role: Role) -> &mut Member {
        self.members
            .iter_mut()
            .find(|m| m.role == role)
            .expect("every role has a member")
    }

    fn collect(&mut self, from: Role, out: Outbox) {
        for m in out.msgs {
            self.inflight.push_back((from, m));
        }
        for event in out.events {
            self.events.push(Stamped {
                at: self.now,
                wall_ns: 0,
                from,
                event,
            });
        }
    }
}

impl Cluster for LoopbackCluster {
    fn now(&self) -> Instant {
        self.now
    }

    fn command(&mut self, role: Role, cmd: Cmd) {
        let now = self.now;
        let mut out = Outbox::default();
        let m = self.member(role);
        if m.alive {
            m.node.command(&cmd, now, &mut out);
        }
        self.collect(role, out);
    }

    fn tick(&mut self) {
        self.now = self.now + STEP;
        self.net.advance_to(self.now);
        let now = self.now;
        // Last tick's role messages arrive; what delivering or stepping
        // sends goes out next tick, as in an engine.
        let arriving: Vec<_> = self.inflight.drain(..).collect();
        for (from, msg) in arriving {
            for to in cluster::route(&msg) {
                let mut out = Outbox::default();
                let m = self.member(to);
                if m.alive {
                    m.node.deliver(from, &msg, now, &mut out);
                }
                self.collect(to, out);
            }
        }
        for k in 0..self.members.len() {
            let mut out = Outbox::default();
            let m = &mut self.members[k];
            if m.alive {
                m.node.step(now, &mut out);
            }
            let role = m.role;
            self.collect(role, out);
        }
    }

    fn events(&self) -> &[Stamped] {
        &self.events
    }

    fn kill(&mut self, role: Role) {
        let net = self.net.clone();
        let m = self.member(role);
        m.alive = false;
        if let Some(a) = m.agent {
            net.crash(a);
        }
    }

    fn slack(&self) -> Duration {
        STEP + self.tick
    }
}

#[test]
fn happy_path_verified_end_to_end() {
    cluster::happy_path_verified_end_to_end(&mut LoopbackCluster::new());
}

#[test]
fn deaf_rank_expires_alone_and_the_load_fails() {
    cluster::deaf_rank_expires_alone_and_the_load_fails(&mut LoopbackCluster::new());
}

#[test]
fn killed_d_worker_is_reclaimed_by_both_ranks() {
    cluster::killed_d_worker_is_reclaimed_by_both_ranks(&mut LoopbackCluster::new());
}

#[test]
fn killed_p_rank_fails_the_load() {
    cluster::killed_p_rank_fails_the_load(&mut LoopbackCluster::new());
}

#[test]
fn commands_and_events_round_trip_as_text() {
    use crate::cluster::{Cmd, Event};
    use kvlease::{LeaseFields, Nonce, ReleaseReason};
    let lease = Some(LeaseFields {
        slot: 3,
        nonce: Nonce::new(99).unwrap(),
    });
    let cmds = [
        Cmd::Prefill("a".into()),
        Cmd::Deaf(true),
        Cmd::Peer(1, "127.0.0.1:5".into()),
        Cmd::Track {
            d_id: "d".into(),
            p_id: "p".into(),
            lease,
        },
        Cmd::Load {
            d_id: "d".into(),
            p_id: "p".into(),
            lease: None,
        },
    ];
    for c in cmds {
        assert_eq!(Cmd::parse(&c.to_string()), Some(c));
    }
    let events = [
        Event::Ready(Role::PRank(1), "x:1".into()),
        Event::Granted("a".into(), lease),
        Event::RankReleased(1, 3, 99, ReleaseReason::Expired),
        Event::Renewed(0, 2),
        Event::Released {
            id: "a".into(),
            reason: ReleaseReason::ReadDone,
            nonce: 99,
            slot: None,
        },
        Event::Loaded("d".into(), "read-failed:TimedOut".into()),
        Event::Outcome("d".into(), "verified".into()),
    ];
    for e in events {
        assert_eq!(Event::parse(&e.to_string()), Some(e));
    }
}
