//! Two NIXL agents in one process: fabrics with unique names, handshakes
//! polled on both sides, READ descriptors and registered word buffers. Used
//! by the NIXL fabric tests (`it::nixl_fabric`) and by the zero-allocation
//! test of steady-state READs (`tests/nixl_alloc.rs`). Real time only:
//! every wait is a poll loop with a deadline, nothing sleeps.
#![cfg(feature = "nixl")]
#![allow(dead_code)]
// each test binary uses part of it
// Std atomics are fine in tests (clippy.toml's rule is for the library; see src/sync.rs).
#![allow(clippy::disallowed_types)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use kvlease::fabric::nixl::{NixlConfig, NixlFabric, ProgressMode};
use kvlease::fabric::{
    AgentId, Fabric, HandshakeState, PeerInfo, ReadDesc, RegionId, XferId, XferState,
};
use kvlease::MonotonicClock;

/// Generous bound for every wait.
pub const WAIT: Duration = Duration::from_secs(10);

/// An agent name no other agent of this machine has.
pub fn unique_name(role: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "kvl-{role}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// An engine's own NIXL agent, made the way an engine worker makes it: no
/// progress thread (its loop drains every step), UCX with error handling
/// `none`. For the tests of [`NixlFabric::with_agent`].
pub fn engine_agent(role: &str) -> nixl_sys::Agent {
    let cfg = nixl_sys::AgentConfig {
        enable_prog_thread: false,
        enable_listen_thread: false,
        thread_sync: nixl_sys::ThreadSync::Default,
        num_workers: 1,
        pthr_delay_us: 0,
        capture_telemetry: false,
        ..nixl_sys::AgentConfig::default()
    };
    let agent = nixl_sys::Agent::new_configured(&unique_name(role), &cfg).expect("engine agent");
    let (_mems, defaults) = agent.get_plugin_params("UCX").expect("UCX params");
    let mut params = defaults.clone().expect("params");
    params
        .set("ucx_error_handling_mode", "none")
        .expect("error handling");
    agent.create_backend("UCX", &params).expect("UCX backend");
    agent
}

pub fn fabric(role: &str, clock: MonotonicClock, progress: ProgressMode) -> NixlFabric {
    let mut cfg = NixlConfig::new(unique_name(role));
    cfg.clock = clock;
    cfg.progress = progress;
    cfg.transfer_timeout = Duration::from_secs(2);
    NixlFabric::new(cfg).expect("NIXL fabric")
}

/// Polls `f` until it yields, for at most `limit` of real time.
pub fn poll_until<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = std::time::Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::yield_now();
    }
}

/// Handshakes `from` with `to`, polling both (engine-loop progress needs
/// every side to poll).
pub fn connect(
    from: &mut NixlFabric,
    to: &mut NixlFabric,
    clock: MonotonicClock,
) -> (AgentId, PeerInfo) {
    let addr = to.listen_addr().to_string();
    let id = from.start_handshake(&addr, clock.now()).unwrap();
    let info = poll_until(WAIT, || {
        to.drain_notifications(&mut |_, _| {}).unwrap();
        match from.handshake_state(id, clock.now()) {
            HandshakeState::Ready(info) => Some(info),
            HandshakeState::Pending => None,
            HandshakeState::Failed(e) => panic!("handshake {} -> {addr} failed: {e}", from.name()),
        }
    })
    .expect("handshake did not complete in time");
    (id, info)
}

/// Polls a READ to its end, polling `target` too; what `target` receives
/// meanwhile is kept in `heard` (sender, bytes).
pub fn finish_hearing(
    d: &mut NixlFabric,
    target: &mut NixlFabric,
    x: XferId,
    clock: MonotonicClock,
    heard: &mut Vec<(String, Vec<u8>)>,
) -> XferState {
    poll_until(WAIT, || {
        target
            .drain_notifications(&mut |s, m| heard.push((s.to_owned(), m.to_vec())))
            .unwrap();
        match d.read_state(x, clock.now()) {
            XferState::InProgress => None,
            s => Some(s),
        }
    })
    .expect("READ neither finished nor failed in time")
}

/// [`finish_hearing`] for READs without a notification: `target` must hear
/// nothing.
pub fn finish(
    d: &mut NixlFabric,
    target: &mut NixlFabric,
    x: XferId,
    clock: MonotonicClock,
) -> XferState {
    let mut heard = Vec::new();
    let s = finish_hearing(d, target, x, clock, &mut heard);
    assert_eq!(heard, Vec::new(), "a READ without notification was heard");
    s
}

pub fn desc(
    local: RegionId,
    local_offset: u64,
    remote: RegionId,
    remote_offset: u64,
    len: u64,
) -> ReadDesc {
    ReadDesc {
        local,
        local_offset,
        remote,
        remote_offset,
        len,
    }
}

/// A word buffer registered with a fabric; kept alive by the test.
pub fn register_words(f: &mut NixlFabric, words: &mut [u64]) -> RegionId {
    // SAFETY: every caller keeps `words` alive and unmoved until its fabric
    // is dropped (the buffers are declared before the fabrics they are
    // registered with or outlive them explicitly), and reads it only after
    // the READs that target it have finished.
    unsafe { f.register_memory(words.as_mut_ptr().cast(), std::mem::size_of_val(words)) }.unwrap()
}
