//! Decoding: one notification, validated whole before it is returned,
//! borrowing from the message (see the formats in the module docs of
//! [`crate::wire`]).

use super::hex::*;
use super::*;

// ---------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------

/// Decodes one notification, validating all of it before returning (see the
/// module docs for the forms and how a message is classified). Borrows from
/// `msg`; never allocates; never panics.
pub fn decode(msg: &[u8]) -> Result<Notification<'_>, WireError> {
    if msg.is_empty() {
        return Err(WireError::Empty);
    }
    if let Some(body) = msg.strip_prefix(COMPACT_HEARTBEAT_PREFIX) {
        return decode_compact(body).map(Notification::CompactHeartbeat);
    }
    if let Some(body) = msg.strip_prefix(PACKED_HEARTBEAT_PREFIX) {
        return super::packed::decode_packed(body).map(Notification::PackedHeartbeat);
    }
    if let Some(body) = msg.strip_prefix(HEARTBEAT_PREFIX) {
        return decode_heartbeat(body).map(Notification::Heartbeat);
    }
    decode_read_done(msg).map(Notification::ReadDone)
}

pub(super) fn decode_heartbeat(body: &[u8]) -> Result<HeartbeatIds<'_>, WireError> {
    let body = core::str::from_utf8(body).map_err(|_| WireError::NotUtf8)?;
    let b = body.as_bytes();
    // The body split on ',' has commas + 1 pieces. A piece is empty at the
    // start (body empty or starting with ','), at the end (a non-empty body
    // ending with ','), and between two commas in a row. The scans are
    // branch-free folds into byte-wide accumulators, which LLVM vectorises
    // (16 bytes an instruction on baseline x86-64); splitting piece by
    // piece, or counting into a usize, is 10-20x slower on 40-byte ids.
    let leading = usize::from(b.first().is_none_or(|&c| c == b','));
    let trailing = usize::from(b.last() == Some(&b','));
    let pairs = b.iter().zip(b.get(1..).unwrap_or_default());
    let any_doubled = pairs.clone().fold(0u8, |acc, (&x, &y)| {
        acc | u8::from((x == b',') & (y == b','))
    });
    // Counting the doubles only when there are some keeps the common,
    // well-formed heartbeat at one OR-fold.
    let doubled = if any_doubled == 0 {
        0
    } else {
        pairs.filter(|&(&x, &y)| x == b',' && y == b',').count()
    };
    // Blocks of 128 bytes, so a block's count fits its u8 accumulator.
    let commas: usize = b
        .chunks(128)
        .map(|block| {
            let n = block
                .iter()
                .fold(0u8, |acc, &x| acc.wrapping_add(u8::from(x == b',')));
            usize::from(n)
        })
        .sum();
    let empty_pieces = leading + trailing + doubled;
    Ok(HeartbeatIds {
        rest: body,
        // Every piece is either empty or an id; the empties are a subset.
        remaining: (commas + 1).saturating_sub(empty_pieces),
        empty_pieces,
    })
}

pub(super) fn decode_compact(body: &[u8]) -> Result<CompactEntries<'_>, WireError> {
    if body.is_empty() {
        return Err(WireError::NoEntries);
    }
    if body.len() % COMPACT_RECORD_LEN != 0 {
        return Err(WireError::Truncated);
    }
    // The common case, a well-formed body, in two branch-free passes: every
    // byte a hex digit (a fold LLVM vectorises, 16 bytes an instruction on
    // baseline x86-64), and no record whose nonce is all '0'. Only a body
    // that fails them takes the record-by-record loop below, which names
    // the error.
    if all_hex(body) && !any_zero_nonce(body) {
        return Ok(CompactEntries { records: body });
    }
    let mut rest = body;
    while let Some((rec, tail)) = rest.split_first_chunk::<COMPACT_RECORD_LEN>() {
        rest = tail;
        let (slot, hi, lo) = record_words(rec);
        if !hex8_valid(slot) {
            return Err(WireError::BadSlot);
        }
        if !(hex8_valid(hi) && hex8_valid(lo)) {
            return Err(WireError::BadNonce);
        }
        // Valid hex is 0 exactly when every digit is '0'.
        if hi == ASCII_ZEROS && lo == ASCII_ZEROS {
            return Err(WireError::ZeroNonce);
        }
    }
    Ok(CompactEntries { records: body })
}

/// Whether every byte of `b` is a hex digit (either case).
fn all_hex(b: &[u8]) -> bool {
    // Branch-free per byte, so that the fold vectorises: a digit is
    // '0'..='9' (0x30..0x39); a letter, with bit 5 set, 'a'..='f'.
    let not_hex =
        |c: u8| u8::from(!((c.wrapping_sub(b'0') < 10) | ((c | 0x20).wrapping_sub(b'a') < 6)));
    b.iter().fold(0u8, |acc, &c| acc | not_hex(c)) == 0
}

/// Whether some record of `body` (a whole number of records) has a nonce of
/// sixteen '0' digits.
fn any_zero_nonce(body: &[u8]) -> bool {
    body.chunks_exact(COMPACT_RECORD_LEN)
        .filter_map(|r| r.first_chunk::<COMPACT_RECORD_LEN>())
        .fold(false, |z, r| {
            let (_, hi, lo) = record_words(r);
            z | ((hi == ASCII_ZEROS) & (lo == ASCII_ZEROS))
        })
}

pub(super) fn decode_read_done(msg: &[u8]) -> Result<ReadDone<'_>, WireError> {
    let msg = core::str::from_utf8(msg).map_err(|_| WireError::NotUtf8)?;
    let (head, last) = msg.rsplit_once(':').ok_or(WireError::UnknownPrefix)?;
    let (head, consumers, nonce) = match last.strip_prefix("nonce=") {
        Some(hex) => {
            let nonce = parse_nonce_hex(hex.as_bytes())?;
            // Form 3 without a consumers field (`id:nonce=...` has nothing
            // left to split): the consumer count is what is missing.
            let (head, consumers) = head.rsplit_once(':').ok_or(WireError::BadConsumers)?;
            (head, consumers, Some(nonce))
        }
        None => (head, last, None),
    };
    let consumers = parse_consumers(consumers.as_bytes())?;
    if head.is_empty() {
        return Err(WireError::EmptyId);
    }
    Ok(ReadDone {
        request_id: head,
        consumers,
        nonce,
    })
}

/// A decimal u32 >= 1: ASCII digits only (no sign, no spaces), leading zeros
/// allowed.
pub(super) fn parse_consumers(digits: &[u8]) -> Result<u32, WireError> {
    if digits.is_empty() {
        return Err(WireError::BadConsumers);
    }
    let mut v: u32 = 0;
    for &b in digits {
        let d = b.wrapping_sub(b'0');
        if d > 9 {
            return Err(WireError::BadConsumers);
        }
        v = v
            .checked_mul(10)
            .and_then(|v| v.checked_add(u32::from(d)))
            .ok_or(WireError::BadConsumers)?;
    }
    if v == 0 {
        return Err(WireError::ZeroConsumers);
    }
    Ok(v)
}

/// Exactly 16 hex digits (either case), not all zero.
pub(super) fn parse_nonce_hex(hex: &[u8]) -> Result<Nonce, WireError> {
    let digits: &[u8; NONCE_HEX_LEN] = hex.try_into().map_err(|_| WireError::BadNonce)?;
    let (hi, lo) = nonce_words(digits);
    if !(hex8_valid(hi) && hex8_valid(lo)) {
        return Err(WireError::BadNonce);
    }
    let raw = (u64::from(hex8_value(hi)) << 32) | u64::from(hex8_value(lo));
    Nonce::new(raw).ok_or(WireError::ZeroNonce)
}
