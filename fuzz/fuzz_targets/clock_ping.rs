//! Fuzz target for `kvlease::clock_ping`.
//!
//! Every input is used two ways:
//! 1. as a notification: `decode` must not panic, must claim exactly the
//!    messages that start with `CLKPING:` or `CLKPONG:`, and must agree with a
//!    naive reference (std's `u64::from_str_radix` on exact-length bodies);
//!    whatever decodes re-encodes to the input with hex digits lowercased;
//! 2. as a program for a pinger (pings, matching and foreign pongs, time
//!    steps): each ping yields at most one sample, every sample's send is no
//!    later than its receive, and the counters add up.
#![no_main]

use core::time::Duration;

use arbitrary::Arbitrary;
use kvlease::clock_ping::{self, ClockMessage, ClockPinger, PING_PREFIX, PONG_PREFIX};
use kvlease::Instant;
use libfuzzer_sys::fuzz_target;

#[path = "common/mod.rs"]
mod common;
use common::program;

fuzz_target!(|data: &[u8]| {
    check_decode(data);
    check_pinger(data);
});

fn reference_hex(field: &[u8]) -> Option<u64> {
    let s = core::str::from_utf8(field).ok()?;
    // from_str_radix accepts a leading '+', the wire does not.
    if s.bytes().all(|c| c.is_ascii_hexdigit()) {
        u64::from_str_radix(s, 16).ok()
    } else {
        None
    }
}

fn reference(msg: &[u8]) -> Option<Option<ClockMessage>> {
    if let Some(body) = msg.strip_prefix(PING_PREFIX) {
        return Some(if body.len() == 16 {
            reference_hex(body).map(|token| ClockMessage::Ping { token })
        } else {
            None
        });
    }
    if let Some(body) = msg.strip_prefix(PONG_PREFIX) {
        return Some(if body.len() == 32 {
            match (reference_hex(&body[..16]), reference_hex(&body[16..])) {
                (Some(token), Some(clock)) => Some(ClockMessage::Pong {
                    token,
                    remote: Instant::from_nanos(clock),
                }),
                _ => None,
            }
        } else {
            None
        });
    }
    None
}

fn check_decode(msg: &[u8]) {
    let got = clock_ping::decode(msg);
    let want = reference(msg);
    assert_eq!(got.is_some(), clock_ping::is_clock_message(msg));
    match (got, want) {
        (None, None) => {}
        (Some(Ok(m)), Some(Some(r))) => {
            assert_eq!(m, r);
            let mut buf = [0u8; clock_ping::PONG_LEN];
            let n = match m {
                ClockMessage::Ping { token } => clock_ping::encode_ping(token, &mut buf),
                ClockMessage::Pong { token, remote } => {
                    clock_ping::encode_pong(token, remote, &mut buf)
                }
            }
            .expect("buffer is large enough");
            let (prefix, body) = msg.split_at(PING_PREFIX.len());
            assert_eq!(&buf[..prefix.len()], prefix);
            assert_eq!(&buf[prefix.len()..n], &body.to_ascii_lowercase()[..]);
        }
        (Some(Err(_)), Some(None)) => {}
        (got, want) => panic!("decode {got:?} but reference {want:?} for {msg:?}"),
    }
}

/// One pinger step: time passes by `arg` ms, then `kind` happens.
#[derive(Debug, Arbitrary)]
struct PingerOp {
    kind: PingerKind,
    /// Milliseconds of time first; also the pong's remote clock (ns) and,
    /// mixed, the foreign pong's token.
    arg: u8,
}

#[derive(Debug, Arbitrary)]
enum PingerKind {
    /// A ping goes out (its token is remembered).
    Ping,
    /// The pong to the last ping arrives.
    Pong,
    /// A pong for a token never sent arrives.
    ForeignPong,
    /// The pinger is asked whether a ping is due.
    Due,
}

fn check_pinger(data: &[u8]) {
    let mut p = ClockPinger::new(0, Duration::from_millis(5));
    let mut now = 0u64;
    let mut last_token = None;
    let mut pings_answered = 0u64;
    let mut buf = [0u8; clock_ping::PING_LEN];
    for PingerOp { kind, arg } in program::<PingerOp>(data) {
        let arg = u64::from(arg);
        now += arg;
        let t = Instant::from_millis(now);
        match kind {
            PingerKind::Ping => {
                p.ping(t, &mut buf).expect("buffer fits");
                let Some(Ok(ClockMessage::Ping { token })) = clock_ping::decode(&buf) else {
                    panic!("own ping does not decode");
                };
                last_token = Some(token);
            }
            PingerKind::Pong => {
                if let Some(token) = last_token {
                    if let Some(s) = p.on_pong(token, Instant::from_nanos(arg), t) {
                        assert!(s.local_send <= s.local_recv);
                        pings_answered += 1;
                    }
                }
            }
            PingerKind::ForeignPong => {
                assert!(
                    p.on_pong(arg ^ 0xdead_beef, Instant::ZERO, t).is_none()
                        || Some(arg ^ 0xdead_beef) == last_token
                );
            }
            PingerKind::Due => {
                let _ = p.due(t);
            }
        }
    }
    let c = p.counters();
    assert_eq!(c.samples, pings_answered);
    assert!(c.samples <= c.pings);
    assert!(c.samples + c.unanswered <= c.pings);
}
