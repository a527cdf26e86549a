//! kvlease's handshake side channel under clients that misbehave: one that
//! connects and says nothing, one that trickles its request, more clients
//! than the listener serves at once. Real time, generous bounds: the
//! listener gives a client 2 s; "prompt" below means well under that.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::support::nixl_gate::{nixl_or_skip, say};
use crate::support::nixl_pair::{connect, fabric, poll_until, unique_name, WAIT};
use kvlease::fabric::nixl::{NixlConfig, NixlFabric, ProgressMode};
use kvlease::fabric::{Fabric, HandshakeState};
use kvlease::MonotonicClock;

/// How long the listener gives one client (`LISTENER_CLIENT_DEADLINE`).
const CLIENT_DEADLINE: Duration = Duration::from_secs(2);
/// A handshake that no stalled client delays completes well inside this.
const PROMPT: Duration = Duration::from_secs(1);

/// How long after `since` the listener closes `s` (reads until EOF or an
/// error; `None` if it is still open after `limit`).
fn closed_after(s: &mut TcpStream, since: Instant, limit: Duration) -> Option<Duration> {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(since.elapsed()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return None
            }
            Err(_) => return Some(since.elapsed()),
        }
    }
}

#[test]
fn a_client_that_sends_nothing_delays_no_other_handshake() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    let mut p = fabric("p", clock, ProgressMode::EngineLoop);
    let mut d = fabric("d", clock, ProgressMode::EngineLoop);
    let addr = p.listen_addr();
    // Four clients connect and say nothing: served one at a time, they
    // would hold the listener 4 x 2 s, past D's 5 s handshake timeout.
    let opened = Instant::now();
    let mut idle: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // A trickling client: one request byte every 400 ms, never all eight.
    let mut trickle = TcpStream::connect(addr).unwrap();
    let mut writer = trickle.try_clone().unwrap();
    let trickler = std::thread::spawn(move || {
        for _ in 0..7 {
            std::thread::sleep(Duration::from_millis(400));
            if writer.write_all(b"K").is_err() {
                return;
            }
        }
    });

    let t = Instant::now();
    let (_, info) = connect(&mut d, &mut p, clock);
    let took = t.elapsed();
    assert!(info.clock.is_some());
    assert!(
        took < PROMPT,
        "a handshake behind stalled clients took {took:?}"
    );

    // Each stalled client is cut off at its deadline, not later.
    let limit = CLIENT_DEADLINE * 3;
    for s in idle.iter_mut() {
        let after = closed_after(s, opened, limit).expect("an idle client is disconnected");
        assert!(
            after >= CLIENT_DEADLINE / 2 && after < CLIENT_DEADLINE + PROMPT,
            "idle client closed after {after:?}"
        );
    }
    let after =
        closed_after(&mut trickle, opened, limit).expect("a trickling client is disconnected");
    assert!(
        after < CLIENT_DEADLINE + PROMPT,
        "trickling client closed after {after:?} (the deadline covers the whole request)"
    );
    trickler.join().unwrap();
    let s = p.stats();
    assert_eq!((s.side_channel_answered, s.side_channel_refused), (1, 0));
    say(&format!(
        "nixl side channel: handshake behind 4 silent clients and 1 trickling one: {:.1} ms",
        took.as_secs_f64() * 1e3
    ));
}

#[test]
fn clients_beyond_the_bound_are_disconnected_at_once() {
    let Some(_g) = nixl_or_skip() else { return };
    let clock = MonotonicClock::new();
    let mut cfg = NixlConfig::new(unique_name("p"));
    cfg.clock = clock;
    cfg.max_side_channel_clients = 2;
    let mut p = NixlFabric::new(cfg).expect("P fabric");
    let mut d = fabric("d", clock, ProgressMode::EngineLoop);
    let addr = p.listen_addr();
    // The listener accepts in connection order, so these two take both
    // places before the third is accepted.
    let held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let t = Instant::now();
    let mut extra = TcpStream::connect(addr).unwrap();
    let after =
        closed_after(&mut extra, t, CLIENT_DEADLINE * 3).expect("the extra client is closed");
    assert!(
        after < PROMPT,
        "the client beyond the bound waited {after:?}"
    );
    assert_eq!(
        poll_until(WAIT, || (p.stats().side_channel_refused == 1).then_some(())),
        Some(())
    );
    // Once the held clients leave, handshakes go through again (retried:
    // a client thread frees its place just after its connection closes).
    drop(held);
    let target = addr.to_string();
    let id = d.start_handshake(&target, clock.now()).unwrap();
    let info = poll_until(WAIT, || {
        p.drain_notifications(&mut |_, _| {}).unwrap();
        match d.handshake_state(id, clock.now()) {
            HandshakeState::Ready(info) => Some(info),
            HandshakeState::Pending => None,
            HandshakeState::Failed(_) => {
                d.start_handshake(&target, clock.now()).unwrap();
                None
            }
        }
    })
    .expect("a handshake once the held clients left");
    assert!(info.clock.is_some());
    assert_eq!(p.stats().side_channel_answered, 1);
}
