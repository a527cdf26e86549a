#![cfg(feature = "nixl")]
// Std atomics are fine in tests (clippy.toml's rule is for the library; see src/sync.rs).
#![allow(clippy::disallowed_types)]
//! Two hosts on one machine: the engine-shaped deployment of
//! `tests/it/cluster/mod.rs` with the P engine (scheduler and two workers) in
//! one network namespace and the D engine (scheduler and worker) in
//! another, joined by a veth pair with addresses of their own, over the
//! real NIXL fabric with `UCX_TLS=tcp` (the transport between hosts without
//! RDMA). Faults come from outside the library: nftables rules inside D's
//! namespace (a partition, 5 % random loss), signals (kill, SIGSTOP) and a
//! restart of the P processes.
//!
//! ```text
//!   namespace kvl<N>p  10.77.0.1/24           namespace kvl<N>d  10.77.0.2/24
//!   P sched, P rank 0, P rank 1  ══ veth ══  D sched, D worker   ◀── nft rules here
//!                 ▲                                  ▲
//!                 └──── pipes: the hub (this test, the root namespace) ────┘
//! ```
//!
//! Needs root, `ip` (iproute2) and `nft` (nftables), and the NIXL runtime.
//! Without them each test prints `SKIPPED` with the reason and passes,
//! unless `KVLEASE_REQUIRE_NIXL=1` (as `.ci/run` sets it), where a skip is a
//! failure. The namespaces are removed when a test ends, also on failure
//! (a guard's `Drop`; deleting a namespace also deletes its veth end).
//!
//! Every case prints a timeline (the fault, the last heartbeat P heard, the
//! releases, D's verdicts), so that a reader sees why it passed. The leases
//! are the shortest the config takes: 6 s (heartbeat every 1 s, extension
//! 4 s). `KVLEASE_LOSS_SECONDS` shortens the 5 % loss case (default 60);
//! `KVLEASE_PARTITION_MS` sets the short partition (default 2000).

use crate::cluster;
use crate::support::exact_test_name;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::MutexGuard;
use std::time::Duration;

use kvlease::{Instant, LeaseFields, ReleaseReason};

use crate::cluster::process::{
    heartbeat_latencies, percentile_ms, run_child_if_asked, Launcher, ProcessCluster, LISTEN_IP_ENV,
};
use crate::cluster::{
    find, run_for, run_until, wait_for, Cluster, Cmd, Event, Role, Stamped, P_TP, STEP,
};
use crate::support::nixl_gate::{nixl_or_skip, say};

/// P's address on the veth pair.
const P_IP: &str = "10.77.0.1";
/// D's address on the veth pair.
const D_IP: &str = "10.77.0.2";
/// The TCP settings of both hosts (per network namespace), as
/// `docs/across-hosts.md` recommends across hosts: without them a partition of 2 s lapses 6 s
/// leases, because the kernel's exponential retransmission backoff delays
/// the first heartbeat after the partition by about as long again.
const TCP_TUNING: [(&str, &str); 2] = [
    ("tcp_thin_linear_timeouts", "1"),
    ("tcp_rto_max_ms", "1000"),
];
/// Scheduling slack of real time on a loaded 2-core machine, plus TCP's own
/// retransmission delays.
const SLACK: Duration = Duration::from_secs(2);

// ---- the two hosts ----------------------------------------------------------------------

/// Runs `cmd args`; `Err` with what it printed when it fails.
fn sh(cmd: &str, args: &[&str], stdin: Option<&str>) -> Result<(), String> {
    let mut c = Command::new(cmd);
    c.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().map_err(|e| format!("{cmd}: {e}"))?;
    if let Some(text) = stdin {
        use std::io::Write;
        let mut pipe = child.stdin.take().expect("piped");
        pipe.write_all(text.as_bytes())
            .map_err(|e| format!("{cmd} stdin: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{cmd} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Why this machine cannot run the two-host cases, if it cannot.
fn missing_prerequisite() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned));
    if uid.as_deref() != Some("0") {
        return Some("needs root (network namespaces, nftables)".into());
    }
    for (tool, arg, package) in [("ip", "-V", "iproute2"), ("nft", "--version", "nftables")] {
        if sh(tool, &[arg], None).is_err() {
            return Some(format!("`{tool}` not found (Debian package {package})"));
        }
    }
    None
}

/// Two network namespaces joined by a veth pair; removed on drop.
struct TwoHosts {
    p: String,
    d: String,
    d_dev: String,
}

impl TwoHosts {
    fn create() -> Result<TwoHosts, String> {
        static N: AtomicU32 = AtomicU32::new(0);
        let tag = format!(
            "kvl{}{}",
            std::process::id() % 100_000,
            N.fetch_add(1, Ordering::Relaxed)
        );
        let hosts = TwoHosts {
            p: format!("{tag}p"),
            d: format!("{tag}d"),
            d_dev: format!("{tag}d0"),
        };
        let p_dev = format!("{tag}p0");
        // From here on, Drop removes whatever was made.
        let (p, d) = (hosts.p.as_str(), hosts.d.as_str());
        sh("ip", &["netns", "add", p], None)?;
        sh("ip", &["netns", "add", d], None)?;
        sh(
            "ip",
            &[
                "link",
                "add",
                &p_dev,
                "netns",
                p,
                "type",
                "veth",
                "peer",
                "name",
                &hosts.d_dev,
                "netns",
                d,
            ],
            None,
        )?;
        for (ns, dev, ip) in [(p, p_dev.as_str(), P_IP), (d, hosts.d_dev.as_str(), D_IP)] {
            sh(
                "ip",
                &["-n", ns, "addr", "add", &format!("{ip}/24"), "dev", dev],
                None,
            )?;
            sh("ip", &["-n", ns, "link", "set", dev, "up"], None)?;
            sh("ip", &["-n", ns, "link", "set", "lo", "up"], None)?;
        }
        // TCP's retransmission backoff, tuned as for a deployment (the
        // `docs/across-hosts.md`): a heartbeat stream is thin, so retransmit
        // it at a fixed RTO, and never wait more than 1 s between retries.
        for ns in [p, d] {
            for (knob, value) in TCP_TUNING {
                let path = format!("/proc/sys/net/ipv4/{knob}");
                if sh("ip", &["netns", "exec", ns, "test", "-e", &path], None).is_ok() {
                    sh(
                        "ip",
                        &[
                            "netns",
                            "exec",
                            ns,
                            "sh",
                            "-c",
                            &format!("echo {value} > {path}"),
                        ],
                        None,
                    )?;
                } else {
                    say(&format!(
                        "note: this kernel has no {knob}; TCP's defaults apply"
                    ));
                }
            }
        }
        // UCX refuses a device without carrier ("No such device"): wait
        // until both ends report it, which takes a moment after `up`.
        for (ns, dev) in [(p, p_dev.as_str()), (d, hosts.d_dev.as_str())] {
            let up = (0..500).any(|_| {
                let out = Command::new("ip")
                    .args(["-n", ns, "-o", "link", "show", "dev", dev])
                    .output();
                let up = out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("state UP"));
                if !up {
                    std::thread::sleep(Duration::from_millis(10));
                }
                up
            });
            if !up {
                return Err(format!("{dev} in {ns} never came up"));
            }
        }
        Ok(hosts)
    }

    /// Starts nodes inside their host's namespace, the workers' listeners
    /// on that host's address, UCX restricted to TCP over the veth.
    fn launcher(&self) -> Launcher {
        let (p, d) = (self.p.clone(), self.d.clone());
        let (p_dev, d_dev) = (format!("{p}0"), self.d_dev.clone());
        Box::new(move |role, exe, args| {
            let is_p = matches!(role, Role::PSched | Role::PRank(_));
            let (ns, ip, dev) = if is_p {
                (&p, P_IP, &p_dev)
            } else {
                (&d, D_IP, &d_dev)
            };
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns])
                .arg(exe)
                .args(args)
                .env(LISTEN_IP_ENV, ip)
                .env("UCX_TLS", "tcp")
                .env("UCX_NET_DEVICES", dev);
            c
        })
    }

    /// Replaces D's fault rules with `rules` (nft statements applied to every
    /// packet through D's veth, both directions).
    fn fault(&self, rules: &str) {
        self.heal();
        let dev = &self.d_dev;
        let script = format!(
            "table inet kvlfault {{\n\
             chain in {{ type filter hook input priority 0; policy accept; iifname \"{dev}\" {rules}; }}\n\
             chain out {{ type filter hook output priority 0; policy accept; oifname \"{dev}\" {rules}; }}\n\
             }}\n"
        );
        sh(
            "ip",
            &["netns", "exec", &self.d, "nft", "-f", "-"],
            Some(&script),
        )
        .expect("install the fault rules");
    }

    /// Removes D's fault rules, if any.
    fn heal(&self) {
        let _ = sh(
            "ip",
            &[
                "netns", "exec", &self.d, "nft", "delete", "table", "inet", "kvlfault",
            ],
            None,
        );
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        let _ = sh("ip", &["netns", "del", &self.p], None);
        let _ = sh("ip", &["netns", "del", &self.d], None);
    }
}

/// Sets up two hosts and the five processes for `test`, or `None` when the
/// case is skipped. The guard must outlive the cluster (dropped after it).
fn start(test: &str) -> Option<(TwoHosts, ProcessCluster, MutexGuard<'static, ()>)> {
    let gate = nixl_or_skip()?;
    if let Some(why) = missing_prerequisite() {
        if std::env::var("KVLEASE_REQUIRE_NIXL").as_deref() == Ok("1") {
            panic!("two-host test cannot run and KVLEASE_REQUIRE_NIXL=1: {why}");
        }
        say(&format!("SKIPPED: {test}: {why}"));
        return None;
    }
    let hosts = TwoHosts::create().unwrap_or_else(|e| panic!("two hosts: {e}"));
    let cluster = ProcessCluster::start(test, hosts.launcher(), SLACK);
    Some((hosts, cluster, gate))
}

// ---- the timeline -----------------------------------------------------------------------

/// A line for the timeline: what happened, and when, relative to `t0`.
struct Mark(Instant, String);

fn secs(t0: Instant, t: Instant) -> String {
    if t >= t0 {
        format!("{:+7.2} s", t.saturating_duration_since(t0).as_secs_f64())
    } else {
        format!("{:+7.2} s", -t0.saturating_duration_since(t).as_secs_f64())
    }
}

/// Prints the case's timeline: the test's own marks (faults) and, from the
/// events, grants, the last heartbeat each P rank heard before `cut` (and the
/// first after it), releases and D's verdicts.
fn timeline(case: &str, c: &ProcessCluster, t0: Instant, cut: Option<Instant>, marks: &[Mark]) {
    let mut lines: Vec<(Instant, String)> = marks.iter().map(|m| (m.0, m.1.clone())).collect();
    let ev = c.events();
    for s in ev {
        let text = match &s.event {
            Event::Granted(id, _) => format!("P grants {id}"),
            Event::RankReleased(r, e, _, why) => {
                format!("P rank {r} lets go of entry {e} ({why:?})")
            }
            Event::Released { id, reason, .. } => {
                format!("P frees {id}'s blocks ({reason:?})")
            }
            Event::Loaded(id, v) => format!("D's verdict on {id}: {v}"),
            _ => continue,
        };
        lines.push((s.at, text));
    }
    if let Some(cut) = cut {
        for r in 0..P_TP {
            let renewed = |s: &&Stamped| matches!(s.event, Event::Renewed(x, _) if x == r);
            if let Some(last) = ev.iter().filter(renewed).rfind(|s| s.at <= cut) {
                lines.push((last.at, format!("last heartbeat P rank {r} heard")));
            }
            if let Some(next) = ev.iter().filter(renewed).find(|s| s.at > cut) {
                lines.push((next.at, format!("first heartbeat P rank {r} heard after")));
            }
        }
    }
    lines.sort_by_key(|l| l.0);
    let mut out = format!("two hosts, {case}: timeline");
    for (at, text) in lines {
        out.push_str(&format!("\n  {}  {text}", secs(t0, at)));
    }
    say(&out);
}

// ---- scenario pieces --------------------------------------------------------------------

fn track(c: &mut ProcessCluster, d_id: &str, p_id: &str, lease: LeaseFields) {
    c.command(
        Role::DSched,
        Cmd::Track {
            d_id: d_id.into(),
            p_id: p_id.into(),
            lease: Some(lease),
        },
    );
}

/// D pulls and verifies `p_id`'s KV; returns its verdict.
fn load(c: &mut ProcessCluster, d_id: &str, p_id: &str, lease: LeaseFields) -> String {
    c.command(
        Role::DWorker,
        Cmd::Load {
            d_id: d_id.into(),
            p_id: p_id.into(),
            lease: Some(lease),
        },
    );
    let v = wait_for(
        c,
        Duration::from_secs(20),
        "D's verdict",
        |e| matches!(e, Event::Loaded(d, _) if d == d_id),
    );
    match v.event {
        Event::Loaded(_, v) => v,
        _ => unreachable!(),
    }
}

fn releases(c: &ProcessCluster) -> Vec<Stamped> {
    c.events()
        .iter()
        .filter(|s| matches!(s.event, Event::RankReleased(..) | Event::Released { .. }))
        .cloned()
        .collect()
}

fn accepted(c: &ProcessCluster) -> usize {
    c.events()
        .iter()
        .filter(|s| matches!(&s.event, Event::Loaded(_, v) if v == "verified"))
        .count()
}

/// Runs `case` as the hub of two hosts (or as a node when the hub started
/// this process as one).
fn run(test: &str, case: fn(&TwoHosts, &mut ProcessCluster)) {
    if run_child_if_asked() {
        return;
    }
    let Some((hosts, mut c, _gate)) = start(test) else {
        return;
    };
    let t0 = std::time::Instant::now();
    case(&hosts, &mut c);
    say(&format!(
        "two hosts: {test}: {:.1} s, {} events",
        t0.elapsed().as_secs_f64(),
        c.events().len()
    ));
    drop(c);
    drop(hosts);
}

// ---- the cases --------------------------------------------------------------------------

/// A partition shorter than the extension: no lease lapses, and the load
/// after it verifies.
fn partition_shorter_than_the_extension(hosts: &TwoHosts, c: &mut ProcessCluster) {
    let config = cluster::lease_config();
    let lease = cluster::prefill(c, "req-short");
    let t0 = c.now();
    track(c, "d-short", "req-short", lease);
    run_for(c, Duration::from_secs(2));
    // Cut right after a heartbeat arrived, so that the partition, not the
    // phase of the heartbeat clock, decides (the worst phase costs up to
    // one interval more: see `docs/across-hosts.md`).
    let renewed = |ev: &[Stamped]| {
        ev.iter()
            .filter(|s| matches!(s.event, Event::Renewed(..)))
            .count()
    };
    let heard = renewed(c.events());
    assert!(run_until(c, Duration::from_secs(3), |ev| {
        renewed(ev) >= heard + P_TP as usize
    }));
    let cut = c.now();
    hosts.fault("drop");
    let partition = Duration::from_millis(
        std::env::var("KVLEASE_PARTITION_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2000),
    );
    run_for(c, partition);
    hosts.heal();
    let healed = c.now();
    run_for(c, config.lease_extension() + config.heartbeat_interval());
    let verdict = load(c, "d-short", "req-short", lease);
    timeline(
        &format!("partition {partition:?} (< extension 4 s)"),
        c,
        t0,
        Some(cut),
        &[
            Mark(cut, "fault: every packet through D's veth dropped".into()),
            Mark(healed, "fault healed".into()),
        ],
    );
    let early: Vec<_> = releases(c)
        .into_iter()
        .filter(|s| {
            !matches!(
                s.event,
                Event::RankReleased(_, _, _, ReleaseReason::ReadDone)
                    | Event::Released {
                        reason: ReleaseReason::ReadDone,
                        ..
                    }
            )
        })
        .collect();
    assert!(early.is_empty(), "a lease lapsed: {early:?}");
    assert_eq!(verdict, "verified");
    for r in 0..P_TP {
        assert!(
            find(c.events(), |e| matches!(e, Event::Renewed(x, _) if *x == r)).is_some(),
            "rank {r} heard no heartbeat"
        );
    }
}

/// A partition longer than the extension: P reclaims, and every load D
/// attempts afterwards fails verification.
fn partition_longer_than_the_extension(hosts: &TwoHosts, c: &mut ProcessCluster) {
    let config = cluster::lease_config();
    let (interval, extension) = (config.heartbeat_interval(), config.lease_extension());
    let lease = cluster::prefill(c, "req-long");
    let t0 = c.now();
    track(c, "d-long", "req-long", lease);
    run_for(c, Duration::from_secs(3));
    let cut = c.now();
    hosts.fault("drop");
    run_for(c, Duration::from_millis(500));
    // A load attempted during the partition: its handshake cannot complete.
    let during = load(c, "d-long-p", "req-long", lease);
    let bound = extension + interval + config.wheel_tick() + STEP + c.slack();
    let released = wait_for(
        c,
        bound + Duration::from_secs(5),
        "P's release",
        |e| matches!(e, Event::Released { id, .. } if id == "req-long"),
    );
    run_for(c, Duration::from_secs(1));
    hosts.heal();
    let healed = c.now();
    let verdicts: Vec<String> = (0..2)
        .map(|i| load(c, &format!("d-long-{i}"), "req-long", lease))
        .collect();
    timeline(
        "partition of 9+ s (> extension 4 s)",
        c,
        t0,
        Some(cut),
        &[
            Mark(cut, "fault: every packet through D's veth dropped".into()),
            Mark(healed, "fault healed".into()),
        ],
    );
    let took = released.at.saturating_duration_since(cut);
    assert!(
        matches!(
            released.event,
            Event::Released {
                reason: ReleaseReason::Expired,
                ..
            }
        ),
        "{released:?}"
    );
    assert!(
        took <= bound,
        "P reclaimed {took:?} after the cut (bound {bound:?})"
    );
    assert!(
        during.starts_with("read-failed"),
        "load during the partition: {during}"
    );
    assert!(
        verdicts.iter().all(|v| v == "lapsed"),
        "loads after the heal must fail verification: {verdicts:?}"
    );
    assert_eq!(
        accepted(c),
        0,
        "a load after the lapse was accepted: {verdicts:?}"
    );
}

/// 5 % random packet loss each way for a minute: no lease lapses; the
/// heartbeat delivery latency is reported beside the loss-free one.
fn five_percent_loss(hosts: &TwoHosts, c: &mut ProcessCluster) {
    let lossy = Duration::from_secs(
        std::env::var("KVLEASE_LOSS_SECONDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60),
    );
    let lease = cluster::prefill(c, "req-loss");
    let t0 = c.now();
    track(c, "d-loss", "req-loss", lease);
    run_for(c, Duration::from_secs(10));
    let cut = c.now();
    hosts.fault("numgen random mod 20 0 drop");
    run_for(c, lossy);
    hosts.heal();
    let healed = c.now();
    run_for(c, Duration::from_secs(2));
    let verdict = load(c, "d-loss", "req-loss", lease);
    timeline(
        "5 % packet loss",
        c,
        t0,
        None,
        &[
            Mark(cut, "fault: 5 % of packets through D's veth dropped".into()),
            Mark(healed, "fault healed".into()),
        ],
    );
    let mut clean = heartbeat_latencies(c, t0, cut);
    let mut lossy_lat = heartbeat_latencies(c, cut, healed);
    say(&format!(
        "two hosts, heartbeat delivery over UCX TCP: no loss p50 {:.2} ms p99 {:.2} ms ({} heartbeats); \
         5 % loss p50 {:.2} ms p99 {:.2} ms max {:.2} ms ({} heartbeats)",
        percentile_ms(&mut clean, 50),
        percentile_ms(&mut clean, 99),
        clean.len(),
        percentile_ms(&mut lossy_lat, 50),
        percentile_ms(&mut lossy_lat, 99),
        percentile_ms(&mut lossy_lat, 100),
        lossy_lat.len(),
    ));
    let lapsed: Vec<_> = releases(c).into_iter().filter(|s| s.at < healed).collect();
    assert!(
        lapsed.is_empty(),
        "a lease lapsed under 5 % loss: {lapsed:?}"
    );
    assert!(!lossy_lat.is_empty(), "no heartbeat measured under loss");
    assert_eq!(verdict, "verified");
}

/// The D worker process is killed: P reclaims within extension + one
/// interval + the fabric's detection time (none over TCP: the lease is the
/// detector).
fn d_killed(_hosts: &TwoHosts, c: &mut ProcessCluster) {
    let t0 = c.now();
    cluster::killed_d_worker_is_reclaimed_by_both_ranks(c);
    let freed = find(c.events(), |e| matches!(e, Event::Released { .. }))
        .map(|s| s.at)
        .unwrap_or(t0);
    let last_hb = c
        .events()
        .iter()
        .rfind(|s| matches!(s.event, Event::Renewed(..)))
        .map(|s| s.at);
    timeline("D worker killed", c, t0, last_hb, &[]);
    say(&format!(
        "two hosts, D killed: P freed the blocks {:.2} s after the last heartbeat it heard",
        last_hb.map_or(f64::NAN, |h| freed
            .saturating_duration_since(h)
            .as_secs_f64())
    ));
}

/// The D worker is stopped (SIGSTOP) for longer than the extension, then
/// continued: P reclaims meanwhile, and D's loads afterwards fail.
fn d_stalled(_hosts: &TwoHosts, c: &mut ProcessCluster) {
    let config = cluster::lease_config();
    let (interval, extension) = (config.heartbeat_interval(), config.lease_extension());
    let lease = cluster::prefill(c, "req-stall");
    let t0 = c.now();
    track(c, "d-stall", "req-stall", lease);
    run_for(c, Duration::from_secs(3));
    let pid = c.pid(Role::DWorker).to_string();
    sh("kill", &["-STOP", &pid], None).expect("SIGSTOP");
    let stopped = c.now();
    let bound = extension + interval + config.wheel_tick() + STEP + c.slack();
    let released = wait_for(
        c,
        bound + Duration::from_secs(5),
        "P's release",
        |e| matches!(e, Event::Released { id, .. } if id == "req-stall"),
    );
    run_for(c, Duration::from_secs(1));
    sh("kill", &["-CONT", &pid], None).expect("SIGCONT");
    let continued = c.now();
    run_for(c, Duration::from_secs(1));
    let verdict = load(c, "d-stall-1", "req-stall", lease);
    timeline(
        "D worker stopped 7+ s (> extension 4 s)",
        c,
        t0,
        Some(stopped),
        &[
            Mark(stopped, "fault: D worker SIGSTOP".into()),
            Mark(continued, "D worker SIGCONT".into()),
        ],
    );
    let took = released.at.saturating_duration_since(stopped);
    assert!(
        took <= bound,
        "P reclaimed {took:?} after the stop (bound {bound:?})"
    );
    assert_eq!(
        verdict, "lapsed",
        "the load after the stall must fail verification"
    );
    assert_eq!(accepted(c), 0, "a load after the lapse was accepted");
}

/// The P processes are killed and restarted: a new agent and new nonces.
/// D's load of a request of the old incarnation fails and never verifies;
/// D re-handshakes, its heartbeats reach the new incarnation, and a new
/// request completes verified.
fn p_restarted(_hosts: &TwoHosts, c: &mut ProcessCluster) {
    let config = cluster::lease_config();
    let old = cluster::prefill(c, "req-old");
    let t0 = c.now();
    track(c, "d-old", "req-old", old);
    run_for(c, Duration::from_secs(2));
    let p_roles = [Role::PSched, Role::PRank(0), Role::PRank(1)];
    c.restart(&p_roles);
    let restarted = c.now();
    let mark = c.events().len();
    let stale = load(c, "d-old", "req-old", old);
    let new = cluster::prefill(c, "req-new");
    assert_ne!(
        new.nonce, old.nonce,
        "a restarted P must not re-issue nonces"
    );
    track(c, "d-new", "req-new", new);
    run_for(c, config.lease_duration() + config.heartbeat_interval());
    let fresh = load(c, "d-new", "req-new", new);
    timeline(
        "P processes killed and restarted",
        c,
        t0,
        Some(restarted),
        &[Mark(
            restarted,
            "P scheduler and both ranks restarted".into(),
        )],
    );
    assert_ne!(
        stale, "verified",
        "a load against the old incarnation verified"
    );
    for r in 0..P_TP {
        assert!(
            c.events()[mark..]
                .iter()
                .any(|s| matches!(s.event, Event::Renewed(x, _) if x == r)),
            "no heartbeat reached the new rank {r}"
        );
    }
    let new_released = c.events()[mark..].iter().any(|s| {
        matches!(&s.event, Event::Released { id, reason, .. }
            if id == "req-new" && *reason != ReleaseReason::ReadDone)
    });
    assert!(!new_released, "the new lease lapsed");
    assert_eq!(fresh, "verified");
    assert_eq!(accepted(c), 1, "only the new request is accepted");
}

#[test]
fn two_hosts_partition_shorter_than_the_extension() {
    run(
        &exact_test_name!(two_hosts_partition_shorter_than_the_extension),
        partition_shorter_than_the_extension,
    );
}

#[test]
fn two_hosts_partition_longer_than_the_extension() {
    run(
        &exact_test_name!(two_hosts_partition_longer_than_the_extension),
        partition_longer_than_the_extension,
    );
}

#[test]
fn two_hosts_five_percent_loss() {
    run(
        &exact_test_name!(two_hosts_five_percent_loss),
        five_percent_loss,
    );
}

#[test]
fn two_hosts_d_killed() {
    run(&exact_test_name!(two_hosts_d_killed), d_killed);
}

#[test]
fn two_hosts_d_stalled() {
    run(&exact_test_name!(two_hosts_d_stalled), d_stalled);
}

#[test]
fn two_hosts_p_restarted() {
    run(&exact_test_name!(two_hosts_p_restarted), p_restarted);
}
