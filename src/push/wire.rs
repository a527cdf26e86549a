//! The push guard's notifications: their bytes, both directions.
//!
//! This module owns the four message forms of [`crate::push`] and the
//! permit fields D puts in its registration. It decodes and encodes; it
//! keeps no state, reads no clock and allocates nothing (encoders write into
//! the caller's buffer). Every form is a prefix and a whole number of
//! fixed-size records of lower-case hex digits, all or nothing, as `HBC:`
//! is ([`crate::wire`]): a body that is not whole, or one bad record, refuses
//! the whole message, since only kvlease writes these.
//!
//! | prefix | direction | record | bytes |
//! |---|---|---|---|
//! | `PRN:` | D to P | permit slot (8), nonce (16), deadline on D's clock in ns (16) | 40 |
//! | `PRV:` | D to P | permit slot (8), nonce (16) | 24 |
//! | `PHB:` | P to D | permit slot (8), nonce (16) | 24 |
//! | `PEND:` | P to D | permit slot (8), nonce (16), end code (1: `W`, `R`, `X`) | 25 |
//!
//! The registration fields ([`PermitFields::encode`]) are one `PRN:` record
//! without the prefix: 40 hex digits D adds to vLLM's `PUSH_REG` payload.

use crate::nonce::Nonce;
use crate::time::Instant;
use crate::wire::{encode_u32_hex, encode_u64_hex};

/// Bytes of a (slot, nonce) record.
pub const PERMIT_RECORD_LEN: usize = 24;
/// Bytes of a renewal record (slot, nonce, deadline).
pub const RENEW_RECORD_LEN: usize = 40;
/// Bytes of an end record (slot, nonce, code).
pub const END_RECORD_LEN: usize = 25;

/// D to P: permits renewed, with their new deadlines on D's clock.
pub const RENEW_PREFIX: &[u8] = b"PRN:";
/// D to P: permits revoked (D aborted the request, or stopped hearing P).
pub const REVOKE_PREFIX: &[u8] = b"PRV:";
/// P to D: permits P holds and has not ended (P is alive).
pub const ALIVE_PREFIX: &[u8] = b"PHB:";
/// P to D: permits P ended, each with why.
pub const END_PREFIX: &[u8] = b"PEND:";

/// What D registered: the permit's slot in D's table, its nonce, and the
/// deadline on D's clock after which P may not post a WRITE into the
/// registered blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PermitFields {
    /// The permit's entry in D's [`crate::push::PushPermits`].
    pub slot: u32,
    /// Fresh for every registration; names the permit in every message.
    pub nonce: Nonce,
    /// On D's monotonic clock; P translates it with its clock-offset
    /// estimate of D, widened by the estimate's error bound.
    pub deadline: Instant,
}

impl PermitFields {
    /// The 40 hex digits of the registration field.
    pub fn encode(&self) -> [u8; RENEW_RECORD_LEN] {
        let mut out = [0u8; RENEW_RECORD_LEN];
        out[..8].copy_from_slice(&encode_u32_hex(self.slot));
        out[8..24].copy_from_slice(&encode_u64_hex(self.nonce.get()));
        out[24..].copy_from_slice(&encode_u64_hex(self.deadline.as_nanos()));
        out
    }

    /// The fields from their 40 hex digits (either case).
    pub fn decode(field: &[u8]) -> Result<PermitFields, PushWireError> {
        let rec: &[u8; RENEW_RECORD_LEN] =
            field.try_into().map_err(|_| PushWireError::Truncated)?;
        renew_record(rec)
    }
}

/// How P ended a permit (the `PEND:` code).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndCode {
    /// `W`: P's WRITE completed; the blocks hold P's KV. No other WRITE of
    /// this permit will be posted.
    Written,
    /// `R`: refused at registration (P no longer has the request, cannot
    /// read D's clock, or has no room); P never posted and never will.
    Refused,
    /// `X`: ended without a complete WRITE (revoked, deadline passed, the
    /// WRITE failed, P let the request go); every WRITE P posted reached a
    /// terminal state first, and none will be posted.
    Ended,
}

impl EndCode {
    fn byte(self) -> u8 {
        match self {
            EndCode::Written => b'W',
            EndCode::Refused => b'R',
            EndCode::Ended => b'X',
        }
    }

    fn from_byte(b: u8) -> Option<EndCode> {
        match b {
            b'W' => Some(EndCode::Written),
            b'R' => Some(EndCode::Refused),
            b'X' => Some(EndCode::Ended),
            _ => None,
        }
    }
}

/// One decoded push notification; the records are validated, and the
/// iterators yield them without failing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PushMessage<'a> {
    /// `PRN:`
    Renew(Records<'a, RENEW_RECORD_LEN>),
    /// `PRV:`
    Revoke(Records<'a, PERMIT_RECORD_LEN>),
    /// `PHB:`
    Alive(Records<'a, PERMIT_RECORD_LEN>),
    /// `PEND:`
    End(Records<'a, END_RECORD_LEN>),
}

/// Why bytes are not a push message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushWireError {
    /// None of the four prefixes.
    UnknownPrefix,
    /// A prefix and no record.
    NoRecords,
    /// Not a whole number of records.
    Truncated,
    /// A slot, nonce or deadline that is not hex.
    BadHex,
    /// A nonce of 0 (never drawn).
    ZeroNonce,
    /// An end code other than `W`, `R`, `X`.
    BadCode,
    /// The caller's buffer cannot hold one record.
    BufferTooSmall,
}

impl core::fmt::Display for PushWireError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            PushWireError::UnknownPrefix => {
                "not a push message (no PRN:, PRV:, PHB: or PEND: prefix)"
            }
            PushWireError::NoRecords => "push message without records",
            PushWireError::Truncated => "push message is not a whole number of records",
            PushWireError::BadHex => "push record with a non-hex slot, nonce or deadline",
            PushWireError::ZeroNonce => "push record with nonce 0",
            PushWireError::BadCode => "push end record with a code other than W, R, X",
            PushWireError::BufferTooSmall => "buffer too small for one push record",
        })
    }
}

impl std::error::Error for PushWireError {}

/// Whether `msg` starts with one of the push prefixes (the engine routes it
/// here, not to the pull roles).
pub fn is_push_message(msg: &[u8]) -> bool {
    [RENEW_PREFIX, REVOKE_PREFIX, ALIVE_PREFIX, END_PREFIX]
        .iter()
        .any(|p| msg.starts_with(p))
}

/// Decodes one push notification, validating every record.
pub fn decode(msg: &[u8]) -> Result<PushMessage<'_>, PushWireError> {
    if let Some(body) = msg.strip_prefix(RENEW_PREFIX) {
        Records::<RENEW_RECORD_LEN>::validate(body, |r| renew_record(r).map(|_| ()))
            .map(PushMessage::Renew)
    } else if let Some(body) = msg.strip_prefix(REVOKE_PREFIX) {
        Records::<PERMIT_RECORD_LEN>::validate(body, |r| permit_record(r).map(|_| ()))
            .map(PushMessage::Revoke)
    } else if let Some(body) = msg.strip_prefix(ALIVE_PREFIX) {
        Records::<PERMIT_RECORD_LEN>::validate(body, |r| permit_record(r).map(|_| ()))
            .map(PushMessage::Alive)
    } else if let Some(body) = msg.strip_prefix(END_PREFIX) {
        Records::<END_RECORD_LEN>::validate(body, |r| end_record(r).map(|_| ()))
            .map(PushMessage::End)
    } else {
        Err(PushWireError::UnknownPrefix)
    }
}

/// Validated records of `N` bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Records<'a, const N: usize> {
    body: &'a [u8],
}

impl<'a, const N: usize> Records<'a, N> {
    fn validate(
        body: &'a [u8],
        check: impl Fn(&[u8; N]) -> Result<(), PushWireError>,
    ) -> Result<Self, PushWireError> {
        if body.is_empty() {
            return Err(PushWireError::NoRecords);
        }
        if body.len() % N != 0 {
            return Err(PushWireError::Truncated);
        }
        for rec in body.chunks_exact(N) {
            if let Ok(rec) = <&[u8; N]>::try_from(rec) {
                check(rec)?;
            }
        }
        Ok(Records { body })
    }

    /// Records not yet yielded.
    pub fn len(&self) -> usize {
        self.body.len() / N
    }

    /// Whether every record was yielded.
    pub fn is_empty(&self) -> bool {
        self.body.is_empty()
    }

    fn next_raw(&mut self) -> Option<&'a [u8; N]> {
        let (rec, rest) = self.body.split_first_chunk::<N>()?;
        self.body = rest;
        Some(rec)
    }
}

impl Iterator for Records<'_, RENEW_RECORD_LEN> {
    type Item = PermitFields;
    fn next(&mut self) -> Option<PermitFields> {
        // Validated by `decode`; `.ok()` only keeps this panic-free.
        self.next_raw().and_then(|r| renew_record(r).ok())
    }
}

impl Iterator for Records<'_, PERMIT_RECORD_LEN> {
    type Item = (u32, Nonce);
    fn next(&mut self) -> Option<(u32, Nonce)> {
        self.next_raw().and_then(|r| permit_record(r).ok())
    }
}

impl Iterator for Records<'_, END_RECORD_LEN> {
    type Item = (u32, Nonce, EndCode);
    fn next(&mut self) -> Option<(u32, Nonce, EndCode)> {
        self.next_raw().and_then(|r| end_record(r).ok())
    }
}

fn hex_value(digits: &[u8]) -> Result<u64, PushWireError> {
    crate::wire::scalar_hex(digits).ok_or(PushWireError::BadHex)
}

fn permit_record(r: &[u8]) -> Result<(u32, Nonce), PushWireError> {
    let (slot, nonce) = (r.get(..8), r.get(8..24));
    let (Some(slot), Some(nonce)) = (slot, nonce) else {
        return Err(PushWireError::Truncated);
    };
    // 8 hex digits always fit a u32.
    let slot = hex_value(slot)? as u32;
    let nonce = Nonce::new(hex_value(nonce)?).ok_or(PushWireError::ZeroNonce)?;
    Ok((slot, nonce))
}

fn renew_record(r: &[u8; RENEW_RECORD_LEN]) -> Result<PermitFields, PushWireError> {
    let (slot, nonce) = permit_record(r)?;
    let deadline = Instant::from_nanos(hex_value(&r[24..])?);
    Ok(PermitFields {
        slot,
        nonce,
        deadline,
    })
}

fn end_record(r: &[u8; END_RECORD_LEN]) -> Result<(u32, Nonce, EndCode), PushWireError> {
    let (slot, nonce) = permit_record(r)?;
    let code = EndCode::from_byte(r[24]).ok_or(PushWireError::BadCode)?;
    Ok((slot, nonce, code))
}

/// Writes push messages of one kind into a caller's buffer, a record at a
/// time, and hands each full message to `emit`; allocates nothing.
pub(crate) struct MessageWriter<'b> {
    buf: &'b mut [u8],
    prefix: &'static [u8],
    len: usize,
}

impl<'b> MessageWriter<'b> {
    /// A writer of `prefix` messages no longer than `buf`.
    pub(crate) fn new(buf: &'b mut [u8], prefix: &'static [u8]) -> MessageWriter<'b> {
        MessageWriter {
            buf,
            prefix,
            len: 0,
        }
    }

    fn record(
        &mut self,
        n: usize,
        emit: &mut impl FnMut(&[u8]),
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), PushWireError> {
        let p = self.prefix.len();
        if self.buf.len() < p + n {
            return Err(PushWireError::BufferTooSmall);
        }
        if self.len + n > self.buf.len() {
            self.flush(emit);
        }
        if self.len == 0 {
            self.buf[..p].copy_from_slice(self.prefix);
            self.len = p;
        }
        fill(&mut self.buf[self.len..self.len + n]);
        self.len += n;
        Ok(())
    }

    /// Adds a (slot, nonce) record (`PRV:`, `PHB:`).
    pub(crate) fn permit(
        &mut self,
        slot: u32,
        nonce: Nonce,
        emit: &mut impl FnMut(&[u8]),
    ) -> Result<(), PushWireError> {
        self.record(PERMIT_RECORD_LEN, emit, |r| {
            r[..8].copy_from_slice(&encode_u32_hex(slot));
            r[8..].copy_from_slice(&encode_u64_hex(nonce.get()));
        })
    }

    /// Adds a renewal record (`PRN:`).
    pub(crate) fn renew(
        &mut self,
        f: PermitFields,
        emit: &mut impl FnMut(&[u8]),
    ) -> Result<(), PushWireError> {
        self.record(RENEW_RECORD_LEN, emit, |r| r.copy_from_slice(&f.encode()))
    }

    /// Adds an end record (`PEND:`).
    pub(crate) fn end(
        &mut self,
        slot: u32,
        nonce: Nonce,
        code: EndCode,
        emit: &mut impl FnMut(&[u8]),
    ) -> Result<(), PushWireError> {
        self.record(END_RECORD_LEN, emit, |r| {
            r[..8].copy_from_slice(&encode_u32_hex(slot));
            r[8..24].copy_from_slice(&encode_u64_hex(nonce.get()));
            r[24] = code.byte();
        })
    }

    /// Hands the message built so far (if any) to `emit`.
    pub(crate) fn flush(&mut self, emit: &mut impl FnMut(&[u8])) {
        if self.len > self.prefix.len() {
            emit(&self.buf[..self.len]);
        }
        self.len = 0;
    }
}

/// A [`MessageWriter`] whose records each go to one peer: a message carries
/// one peer's records only, so a record for another peer first hands over
/// the message built so far. Callers visit their records grouped by peer
/// where they can (a set ordered by slot is not), and pay one message per
/// peer change otherwise. Allocates nothing.
pub(crate) struct PeerMessages<'b> {
    writer: MessageWriter<'b>,
    peer: Option<u16>,
}

impl<'b> PeerMessages<'b> {
    /// A writer of `prefix` messages no longer than `buf`.
    pub(crate) fn new(buf: &'b mut [u8], prefix: &'static [u8]) -> PeerMessages<'b> {
        PeerMessages {
            writer: MessageWriter::new(buf, prefix),
            peer: None,
        }
    }

    /// Makes `peer` the addressee of the message being built.
    fn address(&mut self, peer: u16, emit: &mut impl FnMut(u16, &[u8])) {
        if let Some(q) = self.peer.filter(|&q| q != peer) {
            self.writer.flush(&mut |m: &[u8]| emit(q, m));
        }
        self.peer = Some(peer);
    }

    /// Adds a (slot, nonce) record for `peer` (`PRV:`, `PHB:`).
    pub(crate) fn permit(
        &mut self,
        peer: u16,
        slot: u32,
        nonce: Nonce,
        emit: &mut impl FnMut(u16, &[u8]),
    ) -> Result<(), PushWireError> {
        self.address(peer, emit);
        self.writer
            .permit(slot, nonce, &mut |m: &[u8]| emit(peer, m))
    }

    /// Adds a renewal record for `peer` (`PRN:`).
    pub(crate) fn renew(
        &mut self,
        peer: u16,
        f: PermitFields,
        emit: &mut impl FnMut(u16, &[u8]),
    ) -> Result<(), PushWireError> {
        self.address(peer, emit);
        self.writer.renew(f, &mut |m: &[u8]| emit(peer, m))
    }

    /// Adds an end record for `peer` (`PEND:`).
    pub(crate) fn end(
        &mut self,
        peer: u16,
        slot: u32,
        nonce: Nonce,
        code: EndCode,
        emit: &mut impl FnMut(u16, &[u8]),
    ) -> Result<(), PushWireError> {
        self.address(peer, emit);
        self.writer
            .end(slot, nonce, code, &mut |m: &[u8]| emit(peer, m))
    }

    /// Hands the last peer's message (if any) to `emit`.
    pub(crate) fn finish(mut self, emit: &mut impl FnMut(u16, &[u8])) {
        if let Some(q) = self.peer {
            self.writer.flush(&mut |m: &[u8]| emit(q, m));
        }
    }
}
