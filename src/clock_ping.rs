//! Clock ping/pong over the notification channel: re-sampling a peer's
//! clock without a new handshake.
//!
//! This module owns the bytes of the two clock notifications and the
//! pinger's one piece of state (the ping in flight). It never sends (the
//! engine hands the bytes to the fabric), never reads a clock (callers pass
//! `now`), and folds nothing into an estimate itself: a matched pong yields
//! a [`ClockSample`] for [`crate::clock_offset::ClockOffset::observe`].
//!
//! # Format (fixed)
//!
//! ```text
//! ping: CLKPING:<16 hex: token>                                 24 bytes
//! pong: CLKPONG:<16 hex: token><16 hex: responder's clock, ns>  40 bytes
//! ```
//!
//! ASCII (nixl-sys's notification API refuses bytes that are not UTF-8), hex
//! most significant digit first, exactly that many digits: encoders write
//! lowercase, the decoder accepts either case. The token is opaque to the
//! responder, which echoes it unchanged next to its own monotonic clock in
//! nanoseconds since its origin. Anything else after a `CLKPING:` or
//! `CLKPONG:` prefix (a wrong length, a non-hex digit) is a
//! [`ClockMsgError`]: counted and dropped, never a panic.
//!
//! # When to stamp
//!
//! The sample is only as good as its stamps: the pinger's `now` for
//! [`ClockPinger::ping`] must be read *before* the ping is sent, its `now`
//! for [`ClockPinger::on_pong`] *after* the pong was drained, and the
//! responder's `now` for [`encode_pong`] after the ping was drained (not the
//! stale start of its step). Then the responder's reading lies inside the
//! round trip, which is all the estimator's bound assumes.
//!
//! # Peers that do not speak it (vLLM)
//!
//! A vLLM P reads any notification that is not `HB:` as a read-done and
//! splits off an integer after the last `:`, so a ping must never reach one:
//! send pings only to peers whose handshake shows they are kvlease (they
//! advertise compact heartbeats, [`crate::fabric::PeerInfo::compact_heartbeats`];
//! [`peer_answers_pings`] asks exactly that).
//! The other way round, a peer that never answers costs nothing: the pinger
//! keeps the estimate it has (from the handshake) and its next ping replaces
//! the unanswered one. On the receiving side, [`decode`] claims only the two
//! prefixes and returns `None` for everything else, so an engine tries it
//! first and hands the rest to [`crate::wire::decode`]; a P rank that gets a
//! clock message anyway counts it (`clock_messages`) and changes nothing.
//!
//! ```
//! use kvlease::clock_ping::{self, ClockMessage, ClockPinger};
//! use kvlease::Instant;
//! use core::time::Duration;
//!
//! let mut pinger = ClockPinger::new(0x5eed, Duration::from_secs(60));
//! let mut buf = [0u8; clock_ping::PONG_LEN];
//! // P, step at 10 s: a ping to D.
//! let n = pinger.ping(Instant::from_secs(10), &mut buf)?;
//! // D drains it and answers with its clock (D is 1000 s ahead).
//! let Some(Ok(ClockMessage::Ping { token })) = clock_ping::decode(&buf[..n]) else { panic!() };
//! let mut reply = [0u8; clock_ping::PONG_LEN];
//! let m = clock_ping::encode_pong(token, Instant::from_millis(1_010_001), &mut reply)?;
//! // P drains the pong 2 ms after it pinged.
//! let Some(Ok(ClockMessage::Pong { token, remote })) = clock_ping::decode(&reply[..m]) else { panic!() };
//! let sample = pinger.on_pong(token, remote, Instant::from_millis(10_002)).expect("matched");
//! assert_eq!(sample.remote, Instant::from_millis(1_010_001));
//! // Anything else is not a clock message.
//! assert!(clock_ping::decode(b"HB:req-1").is_none());
//! # Ok::<(), clock_ping::ClockMsgError>(())
//! ```

use core::time::Duration;

use crate::fabric::{ClockSample, PeerInfo};
use crate::time::Instant;

/// Prefix of a ping.
pub const PING_PREFIX: &[u8] = b"CLKPING:";
/// Prefix of a pong.
pub const PONG_PREFIX: &[u8] = b"CLKPONG:";
/// Bytes of a ping.
pub const PING_LEN: usize = PING_PREFIX.len() + 16;
/// Bytes of a pong.
pub const PONG_LEN: usize = PONG_PREFIX.len() + 32;

/// A decoded clock message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockMessage {
    /// Answer with [`encode_pong`] echoing `token`.
    Ping {
        /// The pinger's token.
        token: u64,
    },
    /// The answer to a ping.
    Pong {
        /// The token of the ping it answers.
        token: u64,
        /// The responder's clock when it answered.
        remote: Instant,
    },
}

/// What is wrong with a clock message (or a request to encode one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClockMsgError {
    /// The body after the prefix is not exactly 16 (ping) or 32 (pong) bytes.
    #[error("clock message body has the wrong length")]
    BadLength,
    /// A field has a byte that is not a hex digit.
    #[error("clock message field is not hex")]
    NotHex,
    /// Encoder: the output buffer is too short.
    #[error("buffer too small for the clock message")]
    BufferTooSmall,
}

/// Whether a ping may be sent to the peer a handshake described: only to a
/// kvlease peer (one that advertises compact heartbeats). A vLLM peer would
/// read a ping as a malformed read-done.
pub fn peer_answers_pings(peer: &PeerInfo) -> bool {
    peer.compact_heartbeats
}

/// Whether `msg` claims to be a clock message (starts with either prefix).
pub fn is_clock_message(msg: &[u8]) -> bool {
    msg.starts_with(PING_PREFIX) || msg.starts_with(PONG_PREFIX)
}

/// Decodes a clock message; `None` when `msg` is not one (hand it to
/// [`crate::wire::decode`]).
pub fn decode(msg: &[u8]) -> Option<Result<ClockMessage, ClockMsgError>> {
    if let Some(body) = msg.strip_prefix(PING_PREFIX) {
        return Some(decode_ping(body));
    }
    if let Some(body) = msg.strip_prefix(PONG_PREFIX) {
        return Some(decode_pong(body));
    }
    None
}

fn decode_ping(body: &[u8]) -> Result<ClockMessage, ClockMsgError> {
    let digits: &[u8; 16] = body.try_into().map_err(|_| ClockMsgError::BadLength)?;
    Ok(ClockMessage::Ping {
        token: hex_u64(digits)?,
    })
}

fn decode_pong(body: &[u8]) -> Result<ClockMessage, ClockMsgError> {
    let digits: &[u8; 32] = body.try_into().map_err(|_| ClockMsgError::BadLength)?;
    let (token, remote) = digits.split_at(16);
    Ok(ClockMessage::Pong {
        token: hex_u64(token)?,
        remote: Instant::from_nanos(hex_u64(remote)?),
    })
}

fn hex_u64(digits: &[u8]) -> Result<u64, ClockMsgError> {
    crate::wire::scalar_hex(digits).ok_or(ClockMsgError::NotHex)
}

fn put_hex(v: u64, out: &mut [u8]) {
    out.copy_from_slice(&crate::wire::encode_u64_hex(v));
}

/// Writes a ping for `token` into `out`; returns its length ([`PING_LEN`]).
pub fn encode_ping(token: u64, out: &mut [u8]) -> Result<usize, ClockMsgError> {
    let out = out
        .get_mut(..PING_LEN)
        .ok_or(ClockMsgError::BufferTooSmall)?;
    let (prefix, digits) = out.split_at_mut(PING_PREFIX.len());
    prefix.copy_from_slice(PING_PREFIX);
    put_hex(token, digits);
    Ok(PING_LEN)
}

/// Writes the pong to a ping of `token`, stamped with the responder's clock
/// `now` (read after the ping was drained); returns its length ([`PONG_LEN`]).
pub fn encode_pong(token: u64, now: Instant, out: &mut [u8]) -> Result<usize, ClockMsgError> {
    let out = out
        .get_mut(..PONG_LEN)
        .ok_or(ClockMsgError::BufferTooSmall)?;
    let (prefix, digits) = out.split_at_mut(PONG_PREFIX.len());
    prefix.copy_from_slice(PONG_PREFIX);
    let (token_digits, clock_digits) = digits.split_at_mut(16);
    put_hex(token, token_digits);
    put_hex(now.as_nanos(), clock_digits);
    Ok(PONG_LEN)
}

/// What a pinger saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PingerCounters {
    /// Pings encoded.
    pub pings: u64,
    /// Pongs that matched the ping in flight: samples.
    pub samples: u64,
    /// Pongs for no ping in flight or another token (late, duplicated,
    /// foreign): dropped.
    pub unmatched: u64,
    /// Pings replaced before any answer came (a peer that does not answer
    /// shows here, and nowhere else).
    pub unanswered: u64,
}

/// One peer's pinger: at most one ping in flight, re-sent every
/// `interval`. See the module docs.
#[derive(Clone, Debug)]
pub struct ClockPinger {
    next_token: u64,
    interval: Duration,
    in_flight: Option<(u64, Instant)>,
    last_ping: Option<Instant>,
    counters: PingerCounters,
}

impl ClockPinger {
    /// A pinger whose tokens start at `seed` (pick it at random, so a pong
    /// meant for a previous incarnation does not match), pinging at most
    /// once per `interval`.
    pub fn new(seed: u64, interval: Duration) -> ClockPinger {
        ClockPinger {
            next_token: seed,
            interval,
            in_flight: None,
            last_ping: None,
            counters: PingerCounters::default(),
        }
    }

    /// What it saw so far.
    pub fn counters(&self) -> PingerCounters {
        self.counters
    }

    /// Whether a ping is due at `now` (never pinged, or `interval` passed).
    pub fn due(&self, now: Instant) -> bool {
        self.last_ping
            .is_none_or(|at| now.saturating_duration_since(at) >= self.interval)
    }

    /// Encodes a new ping into `out` (stamped `now`, read before sending)
    /// and forgets any unanswered one.
    pub fn ping(&mut self, now: Instant, out: &mut [u8]) -> Result<usize, ClockMsgError> {
        let token = self.next_token;
        let n = encode_ping(token, out)?;
        self.next_token = self.next_token.wrapping_add(1);
        if self.in_flight.is_some() {
            self.counters.unanswered += 1;
        }
        self.in_flight = Some((token, now));
        self.last_ping = Some(now);
        self.counters.pings += 1;
        Ok(n)
    }

    /// A pong arrived (drained at `now`): the sample, when it answers the
    /// ping in flight. Each ping yields at most one sample.
    pub fn on_pong(&mut self, token: u64, remote: Instant, now: Instant) -> Option<ClockSample> {
        match self.in_flight {
            Some((t, sent)) if t == token => {
                self.in_flight = None;
                self.counters.samples += 1;
                Some(ClockSample {
                    local_send: sent,
                    remote,
                    local_recv: now,
                })
            }
            _ => {
                self.counters.unmatched += 1;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_bytes() {
        let mut b = [0u8; PONG_LEN];
        assert_eq!(encode_ping(0xff, &mut b), Ok(24));
        assert_eq!(&b[..24], b"CLKPING:00000000000000ff");
        assert_eq!(encode_pong(1, Instant::from_nanos(0xabc), &mut b), Ok(40));
        assert_eq!(&b[..], b"CLKPONG:00000000000000010000000000000abc");
        assert_eq!(
            encode_ping(1, &mut [0u8; 23]),
            Err(ClockMsgError::BufferTooSmall)
        );
        assert_eq!(
            encode_pong(1, Instant::ZERO, &mut [0u8; 39]),
            Err(ClockMsgError::BufferTooSmall)
        );
    }

    #[test]
    fn decoding_is_strict_and_claims_only_its_prefixes() {
        assert_eq!(
            decode(b"CLKPING:00000000000000FF"),
            Some(Ok(ClockMessage::Ping { token: 255 }))
        );
        assert_eq!(
            decode(b"CLKPING:00000000000000f"),
            Some(Err(ClockMsgError::BadLength))
        );
        assert_eq!(
            decode(b"CLKPING:00000000000000fg"),
            Some(Err(ClockMsgError::NotHex))
        );
        assert_eq!(
            decode(b"CLKPONG:0000000000000001000000000000000"),
            Some(Err(ClockMsgError::BadLength))
        );
        assert_eq!(decode(b"CLKPING"), None);
        assert_eq!(decode(b"req-1:1"), None);
        assert_eq!(decode(b""), None);
        assert!(is_clock_message(b"CLKPONG:"));
        assert!(!is_clock_message(b"HB:x"));
    }

    #[test]
    fn only_kvlease_peers_are_pinged() {
        let kvlease = PeerInfo {
            slot_region: None,
            slot_count: 0,
            compact_heartbeats: true,
            clock: None,
        };
        let vllm = PeerInfo {
            compact_heartbeats: false,
            ..kvlease
        };
        assert!(peer_answers_pings(&kvlease));
        assert!(!peer_answers_pings(&vllm));
    }

    #[test]
    fn pinger_matches_one_pong_per_ping() {
        let mut p = ClockPinger::new(u64::MAX, Duration::from_secs(30));
        let mut b = [0u8; PING_LEN];
        assert!(p.due(Instant::ZERO));
        p.ping(Instant::from_secs(1), &mut b).unwrap();
        assert!(!p.due(Instant::from_secs(30)));
        assert!(p.due(Instant::from_secs(31)));
        let r = Instant::from_secs(9);
        assert_eq!(p.on_pong(7, r, Instant::from_secs(2)), None);
        let s = p.on_pong(u64::MAX, r, Instant::from_secs(2)).unwrap();
        assert_eq!(s.local_send, Instant::from_secs(1));
        assert_eq!(p.on_pong(u64::MAX, r, Instant::from_secs(2)), None);
        // The token wrapped; a ping never answered is counted when replaced.
        p.ping(Instant::from_secs(40), &mut b).unwrap();
        assert_eq!(&b[8..], b"0000000000000000");
        p.ping(Instant::from_secs(80), &mut b).unwrap();
        let c = p.counters();
        assert_eq!(
            (c.pings, c.samples, c.unmatched, c.unanswered),
            (3, 1, 2, 1)
        );
    }
}
