#![cfg(feature = "nixl")]
// Std atomics are fine in tests (clippy.toml's rule is for the library; see src/sync.rs).
#![allow(clippy::disallowed_types)]
//! The engine-shaped deployment of `tests/cluster/mod.rs` as five
//! processes over real NIXL: the P scheduler, P workers 0 and 1, the D
//! scheduler and the D worker are each this test binary re-executed with a
//! role (`KVLEASE_CLUSTER_ROLE`). Each worker owns its own NIXL agent; the
//! schedulers own none. Role messages cross pipes: every process writes
//! lines to its stdout and reads lines from its stdin, and the test process
//! (the hub, standing in for the engines' IPC) routes them. Time is real:
//! each process steps on its own monotonic clock every 2 ms, and the hub
//! stamps events when it reads them.
//!
//! Needs `libnixl_capi.so` on `LD_LIBRARY_PATH` (see `tests/protocol_nixl.rs`);
//! without it every test prints `SKIPPED` and passes, unless
//! `KVLEASE_REQUIRE_NIXL=1`. `KVLEASE_CLUSTER_DEBUG=1` echoes every line the
//! hub reads to stderr.
//!
//! # The pipe protocol
//!
//! One line per item, from `KVL` on (anything else on a child's stdout is
//! libtest's own output and is ignored; libtest may start a line with the
//! test's name before the child's first item):
//!
//! ```text
//!  KVL msg <from-role> <hex bytes>   a role message (either direction)
//!  KVL cmd <command>                 hub -> child (cluster::Cmd)
//!  KVL ev <event>                    child -> hub (cluster::Event)
//! ```

mod cluster;

#[path = "support/nixl_gate.rs"]
mod nixl_gate;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

use kvlease::fabric::nixl::{NixlConfig, NixlFabric};
use kvlease::{Instant, MonotonicClock};

use cluster::{
    Cluster, Cmd, DSchedNode, DWorkerNode, Event, Node, Outbox, PRankNode, PSchedNode, Role,
    Stamped, P_TP,
};
use nixl_gate::{nixl_or_skip, say};

/// Environment: this process plays that role.
const ROLE_ENV: &str = "KVLEASE_CLUSTER_ROLE";
/// A child gives up after this long, whatever happens.
const CHILD_LIFETIME: Duration = Duration::from_secs(120);
/// Scheduling slack of real time on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(2);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// One parsed pipe line.
enum Line {
    Msg(Role, Vec<u8>),
    Cmd(Cmd),
    Ev(Event),
}

fn parse_line(line: &str) -> Option<Line> {
    // libtest may have written `test name ... ` on the same line first.
    let rest = &line[line.find("KVL ")? + 4..];
    let (kind, body) = rest.split_once(' ')?;
    Some(match kind {
        "msg" => {
            let (from, bytes) = body.split_once(' ')?;
            Line::Msg(Role::parse(from)?, unhex(bytes)?)
        }
        "cmd" => Line::Cmd(Cmd::parse(body)?),
        "ev" => Line::Ev(Event::parse(body)?),
        _ => return None,
    })
}

fn agent_name(role: Role) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "kvl-cluster-{}-{}-{}",
        role.name(),
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn fabric(role: Role, clock: MonotonicClock) -> NixlFabric {
    let mut cfg = NixlConfig::new(agent_name(role));
    cfg.clock = clock;
    NixlFabric::new(cfg).expect("NIXL fabric")
}

// ---- a child: one node, stepped every 2 ms ------------------------------------------

fn child_main(role: Role) {
    let clock = MonotonicClock::new();
    let config = cluster::lease_config();
    let now = clock.now();
    let out = std::io::stdout();
    let emit = |lines: &[String]| {
        let mut o = out.lock();
        for l in lines {
            let _ = writeln!(o, "{l}");
        }
        let _ = o.flush();
    };
    let (mut node, ready): (Box<dyn Node>, Option<String>) = match role {
        Role::PSched => (Box::new(PSchedNode::new(&config, now)), None),
        Role::PRank(r) => {
            let f = fabric(role, clock);
            let addr = f.listen_addr().to_string();
            (Box::new(PRankNode::new(f, &config, r, now)), Some(addr))
        }
        Role::DSched => (Box::new(DSchedNode::new(&config)), None),
        Role::DWorker => {
            let f = fabric(role, clock);
            let addr = f.listen_addr().to_string();
            (Box::new(DWorkerNode::new(f, &config)), Some(addr))
        }
    };
    let (tx, rx) = mpsc::channel::<Option<String>>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(Some(line)).is_err() {
                return;
            }
        }
        let _ = tx.send(None);
    });
    emit(&[format!(
        "KVL ev {}",
        Event::Ready(role, ready.unwrap_or_else(|| "-".into()))
    )]);
    let start = std::time::Instant::now();
    while start.elapsed() < CHILD_LIFETIME {
        let now = clock.now();
        let mut outbox = Outbox::default();
        while let Ok(msg) = rx.try_recv() {
            let Some(line) = msg else { return };
            match parse_line(&line) {
                Some(Line::Msg(from, bytes)) => node.deliver(from, &bytes, now, &mut outbox),
                Some(Line::Cmd(cmd)) => node.command(&cmd, now, &mut outbox),
                _ => panic!("{}: bad line {line:?}", role.name()),
            }
        }
        node.step(now, &mut outbox);
        let mut lines: Vec<String> = outbox
            .msgs
            .iter()
            .map(|m| format!("KVL msg {} {}", role.name(), hex(m)))
            .collect();
        lines.extend(outbox.events.iter().map(|e| format!("KVL ev {e}")));
        if !lines.is_empty() {
            emit(&lines);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

// ---- the hub --------------------------------------------------------------------------

struct Proc {
    role: Role,
    child: Child,
    stdin: Option<ChildStdin>,
}

struct ProcessCluster {
    clock: MonotonicClock,
    procs: Vec<Proc>,
    lines: Receiver<(Role, String)>,
    events: Vec<Stamped>,
}

impl ProcessCluster {
    /// Starts the five processes for `test` and waits until every worker's
    /// agent is up; tells the D worker where the P workers listen.
    fn start(test: &str) -> ProcessCluster {
        let (tx, rx) = mpsc::channel();
        let mut procs = Vec::new();
        for role in Role::ALL {
            let mut child = Command::new(std::env::current_exe().expect("test binary"))
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env(ROLE_ENV, role.name())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("re-execute the test binary");
            let stdin = child.stdin.take();
            let stdout = child.stdout.take().expect("piped");
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send((role, line)).is_err() {
                        return;
                    }
                }
            });
            procs.push(Proc { role, child, stdin });
        }
        let mut c = ProcessCluster {
            clock: MonotonicClock::new(),
            procs,
            lines: rx,
            events: Vec::new(),
        };
        let up = cluster::run_until(&mut c, Duration::from_secs(30), |ev| {
            ev.iter()
                .filter(|s| matches!(s.event, Event::Ready(..)))
                .count()
                == Role::ALL.len()
        });
        assert!(up, "not every process came up: {:?}", c.events);
        for r in 0..P_TP {
            let addr = c
                .events
                .iter()
                .find_map(|s| match &s.event {
                    Event::Ready(Role::PRank(x), a) if *x == r => Some(a.clone()),
                    _ => None,
                })
                .expect("P worker ready");
            c.command(Role::DWorker, Cmd::Peer(r, addr));
        }
        c
    }

    fn send(&mut self, to: Role, line: &str) {
        if let Some(p) = self.procs.iter_mut().find(|p| p.role == to) {
            if let Some(stdin) = p.stdin.as_mut() {
                // A dead child's pipe refuses: the message is lost, as it
                // would be for a dead process.
                let _ = writeln!(stdin, "{line}").and_then(|()| stdin.flush());
            }
        }
    }
}

impl Cluster for ProcessCluster {
    fn now(&self) -> Instant {
        self.clock.now()
    }

    fn command(&mut self, role: Role, cmd: Cmd) {
        self.send(role, &format!("KVL cmd {cmd}"));
    }

    fn tick(&mut self) {
        std::thread::sleep(Duration::from_millis(2));
        while let Ok((from, line)) = self.lines.try_recv() {
            if std::env::var("KVLEASE_CLUSTER_DEBUG").is_ok() {
                say(&format!("hub <- {}: {line}", from.name()));
            }
            match parse_line(&line) {
                Some(Line::Msg(sender, bytes)) => {
                    assert_eq!(sender, from, "a child spoke for another");
                    let text = format!("KVL msg {} {}", from.name(), hex(&bytes));
                    for to in cluster::route(&bytes) {
                        self.send(to, &text);
                    }
                }
                Some(Line::Ev(event)) => self.events.push(Stamped {
                    at: self.clock.now(),
                    from,
                    event,
                }),
                Some(Line::Cmd(_)) => panic!("{} sent a command", from.name()),
                None => {} // libtest's own output
            }
        }
    }

    fn events(&self) -> &[Stamped] {
        &self.events
    }

    fn kill(&mut self, role: Role) {
        if let Some(p) = self.procs.iter_mut().find(|p| p.role == role) {
            let _ = p.child.kill();
            let _ = p.child.wait();
            p.stdin = None;
        }
    }

    fn slack(&self) -> Duration {
        SLACK
    }
}

impl Drop for ProcessCluster {
    fn drop(&mut self) {
        for p in &mut self.procs {
            p.stdin = None;
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }
}

/// Runs one scenario: as a child when the role variable is set, else as
/// the hub of five fresh processes.
fn run(test: &str, body: fn(&mut ProcessCluster)) {
    if let Ok(role) = std::env::var(ROLE_ENV) {
        child_main(Role::parse(&role).expect("a known role"));
        return;
    }
    let Some(_g) = nixl_or_skip() else { return };
    let t0 = std::time::Instant::now();
    let mut c = ProcessCluster::start(test);
    body(&mut c);
    say(&format!(
        "cluster over nixl (5 processes): {test}: {:.1} s, {} events",
        t0.elapsed().as_secs_f64(),
        c.events.len()
    ));
}

#[test]
fn happy_path_verified_end_to_end() {
    run(
        "happy_path_verified_end_to_end",
        cluster::happy_path_verified_end_to_end,
    );
}

#[test]
fn deaf_rank_expires_alone_and_the_load_fails() {
    run(
        "deaf_rank_expires_alone_and_the_load_fails",
        cluster::deaf_rank_expires_alone_and_the_load_fails,
    );
}

#[test]
fn killed_d_worker_is_reclaimed_by_both_ranks() {
    run(
        "killed_d_worker_is_reclaimed_by_both_ranks",
        cluster::killed_d_worker_is_reclaimed_by_both_ranks,
    );
}

#[test]
fn killed_p_rank_fails_the_load() {
    run(
        "killed_p_rank_fails_the_load",
        cluster::killed_p_rank_fails_the_load,
    );
}
