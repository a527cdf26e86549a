//! The deployment as separate processes over real NIXL: each node is the
//! test binary re-executed with a role (`KVLEASE_CLUSTER_ROLE`). Each worker
//! owns its own NIXL agent; the schedulers own none. Role messages cross
//! pipes: every process writes lines to its stdout and reads lines from its
//! stdin, and the test process (the hub, standing in for the engines' IPC)
//! routes them. Time is real: each process steps on its own monotonic clock
//! every 2 ms, and the hub stamps events when it reads them.
//!
//! How a role is started is the caller's [`Launcher`]: `tests/it/cluster_nixl.rs`
//! runs all five on this host, `tests/it/two_hosts.rs` runs P's and D's inside
//! two network namespaces over UCX TCP. `KVLEASE_CLUSTER_DEBUG=1` echoes
//! every line the hub reads to stderr.
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
//!  KVL ev <wall-ns> <event>          child -> hub (cluster::Event), stamped
//!                                    with the child's wall clock
//! ```
//!
//! # Child environment
//!
//! - `KVLEASE_CLUSTER_ROLE`: the role to play (set by the hub);
//! - `KVLEASE_LISTEN_IP`: the address a worker's handshake listener binds
//!   (default `127.0.0.1`), which it reports in its `ready` event.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvlease::fabric::nixl::{NixlConfig, NixlFabric};
use kvlease::{Instant, MonotonicClock};

use crate::support::pipes::{self, hex, unhex};

use super::{
    Cluster, Cmd, DSchedNode, DWorkerNode, Event, Node, Outbox, PRankNode, PSchedNode, Role,
    Stamped, P_TP,
};

/// Environment: this process plays that role.
pub const ROLE_ENV: &str = "KVLEASE_CLUSTER_ROLE";
/// Environment: the IP a worker's handshake listener binds.
pub const LISTEN_IP_ENV: &str = "KVLEASE_LISTEN_IP";
/// A child gives up after this long, whatever happens.
const CHILD_LIFETIME: Duration = Duration::from_secs(240);

/// The wall clock in ns since the Unix epoch: comparable across the
/// processes of one machine (network namespaces share it).
pub fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// One parsed pipe line.
enum Line {
    Msg(Role, Vec<u8>),
    Cmd(Cmd),
    Ev(u64, Event),
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
        "ev" => {
            let (wall, event) = body.split_once(' ')?;
            Line::Ev(wall.parse().ok()?, Event::parse(event)?)
        }
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
    if let Ok(ip) = std::env::var(LISTEN_IP_ENV) {
        let ip: IpAddr = ip.parse().expect("KVLEASE_LISTEN_IP is an IP address");
        cfg.listen_addr = SocketAddr::new(ip, 0);
    }
    NixlFabric::new(cfg).expect("NIXL fabric")
}

/// Heartbeat delivery latencies (ns) for the heartbeats D sent in
/// `[from, to)` (hub time): each heartbeat batch D sent is paired, in order,
/// with the next renewal each P rank reported (TCP delivers in order and
/// loses nothing while the connection lives), on the processes' shared
/// wall clock.
pub fn heartbeat_latencies(c: &impl Cluster, from: Instant, to: Instant) -> Vec<u64> {
    let ev = c.events();
    let sent: Vec<&Stamped> = ev
        .iter()
        .filter(|s| matches!(s.event, Event::HbSent(_)))
        .collect();
    let mut out = Vec::new();
    for r in 0..P_TP {
        let heard: Vec<&Stamped> = ev
            .iter()
            .filter(|s| matches!(s.event, Event::Renewed(x, _) if x == r))
            .collect();
        for (s, h) in sent.iter().zip(heard.iter()) {
            if s.at >= from && s.at < to {
                out.push(h.wall_ns.saturating_sub(s.wall_ns));
            }
        }
    }
    out
}

/// The `q`th percentile of `v` (ns), in ms; NaN when `v` is empty.
pub fn percentile_ms(v: &mut [u64], q: usize) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_unstable();
    v[(v.len() - 1) * q / 100] as f64 / 1e6
}

// ---- a child: one node, stepped every 2 ms ------------------------------------------

/// Plays `role` until the hub closes stdin or the lifetime ends.
pub fn child_main(role: Role) {
    let clock = MonotonicClock::new();
    let config = super::lease_config();
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
    let rx = pipes::stdin_lines();
    let event_line = |e: &Event| format!("KVL ev {} {e}", wall_ns());
    emit(&[event_line(&Event::Ready(
        role,
        ready.unwrap_or_else(|| "-".into()),
    ))]);
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
        lines.extend(outbox.events.iter().map(event_line));
        if !lines.is_empty() {
            emit(&lines);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// If this process was started as a node, plays it and returns `true`; the
/// caller (a `#[test]` re-executed by the hub) then returns at once.
pub fn run_child_if_asked() -> bool {
    match std::env::var(ROLE_ENV) {
        Ok(role) => {
            child_main(Role::parse(&role).expect("a known role"));
            true
        }
        Err(_) => false,
    }
}

// ---- the hub --------------------------------------------------------------------------

/// Builds the command that starts one node: the test binary (`exe`) run
/// with `args` (libtest's, selecting the test), perhaps inside a wrapper
/// such as `ip netns exec`. The hub adds the role variable and the pipes.
pub type Launcher = Box<dyn Fn(Role, &std::path::Path, &[&str]) -> Command>;

/// The default [`Launcher`]: the test binary itself, on this host.
pub fn local_launcher() -> Launcher {
    Box::new(|_, exe, args| {
        let mut c = Command::new(exe);
        c.args(args);
        c
    })
}

struct Proc {
    role: Role,
    child: Child,
    stdin: Option<ChildStdin>,
}

/// The deployment's processes and the hub's view of them. See the module
/// docs.
pub struct ProcessCluster {
    test: String,
    launcher: Launcher,
    clock: MonotonicClock,
    procs: Vec<Proc>,
    tx: Sender<(Role, String)>,
    lines: Receiver<(Role, String)>,
    events: Vec<Stamped>,
    slack: Duration,
}

impl ProcessCluster {
    /// Starts the five processes for `test` (the `#[test]` function's name,
    /// which re-executes as the node) and waits until every worker's agent
    /// is up; tells the D worker where the P workers listen.
    pub fn start(test: &str, launcher: Launcher, slack: Duration) -> ProcessCluster {
        let (tx, rx) = mpsc::channel();
        let mut c = ProcessCluster {
            test: test.to_owned(),
            launcher,
            clock: MonotonicClock::new(),
            procs: Vec::new(),
            tx,
            lines: rx,
            events: Vec::new(),
            slack,
        };
        for role in Role::ALL {
            c.spawn(role);
        }
        let up = super::run_until(&mut c, Duration::from_secs(30), |ev| {
            ev.iter()
                .filter(|s| matches!(s.event, Event::Ready(..)))
                .count()
                == Role::ALL.len()
        });
        assert!(up, "not every process came up: {:?}", c.events);
        for r in 0..super::P_TP {
            let addr = c.ready_addr(Role::PRank(r), 0).expect("P worker ready");
            c.command(Role::DWorker, Cmd::Peer(r, addr));
        }
        c
    }

    fn spawn(&mut self, role: Role) {
        let exe = std::env::current_exe().expect("test binary");
        let args = ["--exact", &self.test, "--nocapture", "--test-threads=1"];
        let mut child = (self.launcher)(role, &exe, &args)
            .env(ROLE_ENV, role.name())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start a node");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped");
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send((role, line)).is_err() {
                    return;
                }
            }
        });
        self.procs.retain(|p| p.role != role);
        self.procs.push(Proc { role, child, stdin });
    }

    /// The handshake address in `role`'s latest `ready` event at or after
    /// event index `from`.
    fn ready_addr(&self, role: Role, from: usize) -> Option<String> {
        self.events[from..]
            .iter()
            .rev()
            .find_map(|s| match &s.event {
                Event::Ready(r, a) if *r == role => Some(a.clone()),
                _ => None,
            })
    }

    /// Kills `roles` and starts them again (new processes, new agents, new
    /// nonce sources); waits until they are up and tells the D worker where
    /// restarted P workers now listen.
    pub fn restart(&mut self, roles: &[Role]) {
        for &role in roles {
            self.kill(role);
        }
        let mark = self.events.len();
        for &role in roles {
            self.spawn(role);
        }
        let up = super::run_until(self, Duration::from_secs(30), |ev| {
            roles.iter().all(|role| {
                ev[mark..]
                    .iter()
                    .any(|s| matches!(&s.event, Event::Ready(r, _) if r == role))
            })
        });
        assert!(
            up,
            "restarted nodes did not come up: {:?}",
            &self.events[mark..]
        );
        for &role in roles {
            if let Role::PRank(r) = role {
                let addr = self.ready_addr(role, mark).expect("ready");
                self.command(Role::DWorker, Cmd::Peer(r, addr));
            }
        }
    }

    /// The OS process id of the node playing `role`.
    pub fn pid(&self, role: Role) -> u32 {
        self.procs
            .iter()
            .find(|p| p.role == role)
            .map(|p| p.child.id())
            .expect("a node for every role")
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
                let _ = writeln!(std::io::stderr(), "hub <- {}: {line}", from.name());
            }
            match parse_line(&line) {
                Some(Line::Msg(sender, bytes)) => {
                    assert_eq!(sender, from, "a child spoke for another");
                    let text = format!("KVL msg {} {}", from.name(), hex(&bytes));
                    for to in super::route(&bytes) {
                        self.send(to, &text);
                    }
                }
                Some(Line::Ev(wall_ns, event)) => self.events.push(Stamped {
                    at: self.clock.now(),
                    wall_ns,
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
        self.slack
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
