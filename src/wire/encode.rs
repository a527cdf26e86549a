//! Encoding: heartbeats (split to the fabric's limit), compact heartbeats
//! and read-dones, into caller buffers (see the formats in the module docs
//! of [`crate::wire`]).

use super::hex::*;
use super::*;

// ---------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------

/// What an encoder did.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct EncodeStats {
    /// Messages handed to `emit`.
    pub messages: u32,
    /// Entries (ids or records) sent, over all messages.
    pub entries: u32,
    /// Entries that could not be encoded and were left out.
    pub skipped: u32,
}

/// Whether `id` can travel in a text heartbeat: non-empty and free of `,`.
/// (Its length is checked against the message limit by
/// [`encode_heartbeats`].) Trackers can call this when they start tracking a
/// request, so that a bad id is reported once rather than skipped every step.
pub fn check_heartbeat_id(id: &str) -> Result<(), WireError> {
    if id.is_empty() {
        Err(WireError::EmptyId)
    } else if has_comma(id.as_bytes()) {
        Err(WireError::IdContainsComma)
    } else {
        Ok(())
    }
}

/// Encodes a batch of request ids as text heartbeats (`HB:a,b,...`), split
/// into as many messages as needed so that none exceeds `max_len` bytes (a
/// message of exactly `max_len` is fine). Ids are packed greedily in order:
/// a message is finished when the next id does not fit.
///
/// `scratch` must hold at least `max_len` bytes, else
/// [`WireError::BufferTooSmall`]; a `max_len` under 4 (`HB:` plus a one-byte
/// id) is [`WireError::MessageTooSmall`]. Both are checked before anything is
/// emitted. Ids that cannot be encoded (empty, containing `,`, or longer than
/// `max_len - 3`) are skipped and counted in [`EncodeStats::skipped`]; the
/// rest still go out. `emit` gets each finished message, valid only during the
/// call. An empty batch emits nothing.
pub fn encode_heartbeats<'i, I: IntoIterator<Item = &'i str>>(
    ids: I,
    max_len: usize,
    scratch: &mut [u8],
    mut emit: impl FnMut(&[u8]),
) -> Result<EncodeStats, WireError> {
    let prefix = HEARTBEAT_PREFIX.len();
    if max_len <= prefix {
        return Err(WireError::MessageTooSmall);
    }
    let buf = scratch
        .get_mut(..max_len)
        .ok_or(WireError::BufferTooSmall)?;
    let mut batch = Batch::new(buf);
    for id in ids {
        if check_heartbeat_id(id).is_err() || id.len() > max_len - prefix {
            batch.skip();
            continue;
        }
        batch.make_room(id.len() + 1, &mut emit);
        // The writes below fit: a fresh message has room for prefix + id
        // (checked above), a continued one for ',' + id (checked just now).
        // `put` reports failure instead of panicking; `add` counts it as a
        // skip.
        let w = &mut batch.w;
        let ok = if batch.in_msg == 0 {
            w.put(HEARTBEAT_PREFIX) && w.put(id.as_bytes())
        } else {
            w.put(b",") && w.put(id.as_bytes())
        };
        batch.add(ok);
    }
    Ok(batch.finish(&mut emit))
}

/// Encodes (slot, nonce) records as compact heartbeats
/// (`HBC:<24 hex digits>...`), split so that no message exceeds `max_len`
/// bytes: each message carries up to `(max_len - 4) / 24` records.
///
/// `scratch` must hold at least `max_len` bytes, else
/// [`WireError::BufferTooSmall`]; a `max_len` under 28 (prefix plus one
/// record) is [`WireError::MessageTooSmall`]. Every [`CompactEntry`] is
/// encodable (a [`Nonce`] is never 0), so `skipped` is always 0. An empty
/// batch emits nothing.
pub fn encode_compact_heartbeats<I: IntoIterator<Item = CompactEntry>>(
    entries: I,
    max_len: usize,
    scratch: &mut [u8],
    emit: impl FnMut(&[u8]),
) -> Result<EncodeStats, WireError> {
    encode_records(
        COMPACT_HEARTBEAT_PREFIX,
        encode_record,
        entries,
        max_len,
        scratch,
        emit,
    )
}

/// Encodes (slot, nonce) records as packed heartbeats (`HBP:` and 16 bytes
/// a record, form 5 of the module docs), split so that no message exceeds
/// `max_len` bytes: each message carries up to `(max_len - 4) / 16` records.
/// Send them only to a peer whose advert accepts them
/// ([`crate::fabric::LeaseAdvert::packed_heartbeats`]).
///
/// Errors as [`encode_compact_heartbeats`]'s; `max_len` must hold at least
/// 20 bytes (prefix plus one record).
///
/// ```
/// use kvlease::wire::{self, CompactEntry, Notification};
/// use kvlease::Nonce;
///
/// let e = CompactEntry { slot: 7, nonce: Nonce::new(0xff).unwrap() };
/// let mut scratch = [0u8; 64];
/// let mut sent = Vec::new();
/// wire::encode_packed_heartbeats([e], 64, &mut scratch, |m| sent.push(m.to_vec()))?;
/// assert_eq!(sent, [b"HBP:G@@@@|O@@@@@@@@@".to_vec()]);
/// match wire::decode(&sent[0])? {
///     Notification::PackedHeartbeat(records) => assert_eq!(records.collect::<Vec<_>>(), [e]),
///     other => panic!("{other:?}"),
/// }
/// # Ok::<(), kvlease::wire::WireError>(())
/// ```
pub fn encode_packed_heartbeats<I: IntoIterator<Item = CompactEntry>>(
    entries: I,
    max_len: usize,
    scratch: &mut [u8],
    emit: impl FnMut(&[u8]),
) -> Result<EncodeStats, WireError> {
    encode_records(
        PACKED_HEARTBEAT_PREFIX,
        super::packed::encode_record,
        entries,
        max_len,
        scratch,
        emit,
    )
}

/// The batching of both record forms: `prefix`, then fixed-length records.
fn encode_records<const N: usize, I: IntoIterator<Item = CompactEntry>>(
    prefix: &[u8],
    record: fn(CompactEntry) -> [u8; N],
    entries: I,
    max_len: usize,
    scratch: &mut [u8],
    mut emit: impl FnMut(&[u8]),
) -> Result<EncodeStats, WireError> {
    if max_len < prefix.len() + N {
        return Err(WireError::MessageTooSmall);
    }
    let buf = scratch
        .get_mut(..max_len)
        .ok_or(WireError::BufferTooSmall)?;
    let mut batch = Batch::new(buf);
    for e in entries {
        batch.make_room(N, &mut emit);
        // Always fits (max_len holds prefix + one record); `add` would count
        // a failure as a skip.
        let w = &mut batch.w;
        let ok = (batch.in_msg > 0 || w.put(prefix)) && w.put(&record(e));
        batch.add(ok);
    }
    Ok(batch.finish(&mut emit))
}

/// The message under construction of a heartbeat encoder, and its counts:
/// the batching both heartbeat forms share. A message is emitted when the
/// next entry does not fit, and at the end.
///
/// `emit` is passed to each call rather than kept inside: with the closure
/// in the struct, the entry loop measured about 10 % slower
/// (benches/wire.rs, heartbeat_encode_256), the counts no longer staying in
/// registers.
struct Batch<'b> {
    w: Cursor<'b>,
    stats: EncodeStats,
    /// Entries in the message under construction.
    in_msg: u32,
}

impl<'b> Batch<'b> {
    fn new(buf: &'b mut [u8]) -> Self {
        Batch {
            w: Cursor::new(buf),
            stats: EncodeStats::default(),
            in_msg: 0,
        }
    }

    /// Emits the current message if it has entries and less than `need`
    /// bytes left.
    #[inline(always)]
    fn make_room(&mut self, need: usize, emit: &mut impl FnMut(&[u8])) {
        if self.in_msg > 0 && self.w.remaining() < need {
            self.flush(emit);
        }
    }

    #[inline(always)]
    fn flush(&mut self, emit: &mut impl FnMut(&[u8])) {
        emit(self.w.written());
        self.stats.messages = self.stats.messages.saturating_add(1);
        self.w.clear();
        self.in_msg = 0;
    }

    /// Counts the entry just written (`ok`), or a skip if the cursor
    /// refused it.
    #[inline(always)]
    fn add(&mut self, ok: bool) {
        if ok {
            self.in_msg += 1;
            self.stats.entries = self.stats.entries.saturating_add(1);
        } else {
            self.skip();
        }
    }

    /// Counts an entry that was not encoded.
    #[inline(always)]
    fn skip(&mut self) {
        self.stats.skipped = self.stats.skipped.saturating_add(1);
    }

    fn finish(mut self, emit: &mut impl FnMut(&[u8])) -> EncodeStats {
        if self.in_msg > 0 {
            self.flush(emit);
        }
        self.stats
    }
}

/// The exact length of the read-done [`encode_read_done`] would write; at
/// most `request_id.len() + MAX_READ_DONE_SUFFIX_LEN`.
pub fn read_done_len(request_id: &str, consumers: u32, nonce: Option<Nonce>) -> usize {
    let digits = itoa::Buffer::new().format(consumers).len();
    read_done_len_of(request_id.len(), digits, nonce.is_some())
}

/// `id:<digits>` plus `:nonce=<16 hex>` when `with_nonce`: the one sum both
/// [`read_done_len`] and [`encode_read_done`] (which has the digits at hand
/// already) use.
fn read_done_len_of(id_len: usize, digits: usize, with_nonce: bool) -> usize {
    let nonce_len = if with_nonce {
        READ_DONE_NONCE_TAG.len() + NONCE_HEX_LEN
    } else {
        0
    };
    id_len.saturating_add(1 + digits + nonce_len)
}

/// Encodes a read-done (`id:consumers`, or `id:consumers:nonce=<hex>` when
/// `nonce` is given) into `out` and returns the bytes written.
///
/// Errors: [`WireError::EmptyId`], [`WireError::ZeroConsumers`],
/// [`WireError::AmbiguousId`] (the message would start with `HB:`/`HBC:`/`HBP:`),
/// [`WireError::BufferTooSmall`] (`out` shorter than
/// [`read_done_len`]). Ids may contain `:` and `,`.
pub fn encode_read_done(
    request_id: &str,
    consumers: u32,
    nonce: Option<Nonce>,
    out: &mut [u8],
) -> Result<usize, WireError> {
    if request_id.is_empty() {
        return Err(WireError::EmptyId);
    }
    if consumers == 0 {
        return Err(WireError::ZeroConsumers);
    }
    let id = request_id.as_bytes();
    // The message starts with `id:`; it is misrouted exactly when that starts
    // with one of the heartbeat prefixes.
    let misrouted = |p: &[u8]| id.starts_with(p) || (id.len() + 1 == p.len() && p.starts_with(id));
    if misrouted(HEARTBEAT_PREFIX)
        || misrouted(COMPACT_HEARTBEAT_PREFIX)
        || misrouted(PACKED_HEARTBEAT_PREFIX)
    {
        return Err(WireError::AmbiguousId);
    }
    let mut decimal = itoa::Buffer::new();
    let digits = decimal.format(consumers).as_bytes();
    let len = read_done_len_of(id.len(), digits.len(), nonce.is_some());
    let buf = out.get_mut(..len).ok_or(WireError::BufferTooSmall)?;
    let mut w = Cursor::new(buf);
    let mut ok = w.put(id) && w.put(b":") && w.put(digits);
    if let Some(nonce) = nonce {
        ok = ok && w.put(READ_DONE_NONCE_TAG) && w.put(&encode_u64_hex(nonce.get()));
    }
    if ok {
        Ok(w.pos)
    } else {
        // Unreachable: `buf` is exactly `read_done_len` bytes.
        Err(WireError::BufferTooSmall)
    }
}

/// Which read-done a peer gets: chosen from what it advertised, never from
/// what we would like to send.
///
/// A stock vLLM P splits a read-done at its *last* `:` and looks the front
/// up as a request id: `cmpl-1:1:nonce=00ab...` names no request there, so
/// it holds the blocks until the lease expires (and an `HBC:` is an unknown
/// id to it as well). Only a P that exports lease slots speaks the nonce
/// form; everyone else gets vLLM's `id:consumers`. The nonce is what lets a
/// kvlease P drop a late read-done of an earlier request with the same id,
/// so it is sent whenever the peer can read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadDoneForm {
    /// vLLM's `id:consumers`: to peers that advertise no lease slots.
    Plain,
    /// `id:consumers:nonce=<16 hex>`: to peers that export lease slots.
    WithNonce,
}

impl ReadDoneForm {
    /// The form for a peer that does (`true`) or does not advertise lease
    /// slots: [`crate::fabric::PeerInfo::slot_region`] being set, or
    /// `LeaseAdvert::slots` in an engine's own handshake.
    pub const fn for_peer(advertises_lease_slots: bool) -> ReadDoneForm {
        if advertises_lease_slots {
            ReadDoneForm::WithNonce
        } else {
            ReadDoneForm::Plain
        }
    }

    /// The form for a peer whose handshake completed with `info`.
    pub const fn for_peer_info(info: &crate::fabric::PeerInfo) -> ReadDoneForm {
        ReadDoneForm::for_peer(info.slot_region.is_some())
    }
}

/// Encodes the read-done a peer can read ([`ReadDoneForm`]): with the
/// lease's nonce only in [`ReadDoneForm::WithNonce`] (and only if there is
/// one), vLLM's `id:consumers` otherwise. Errors as [`encode_read_done`].
///
/// ```
/// use kvlease::wire::{encode_read_done_for, ReadDoneForm};
/// use kvlease::Nonce;
///
/// let nonce = Nonce::new(0xab);
/// let mut buf = [0u8; 64];
/// let n = encode_read_done_for(ReadDoneForm::for_peer(false), "cmpl-1", 2, nonce, &mut buf)?;
/// assert_eq!(&buf[..n], b"cmpl-1:2", "a stock vLLM P only ever gets id:consumers");
/// let n = encode_read_done_for(ReadDoneForm::for_peer(true), "cmpl-1", 2, nonce, &mut buf)?;
/// assert_eq!(&buf[..n], b"cmpl-1:2:nonce=00000000000000ab");
/// # Ok::<(), kvlease::wire::WireError>(())
/// ```
pub fn encode_read_done_for(
    form: ReadDoneForm,
    request_id: &str,
    consumers: u32,
    nonce: Option<Nonce>,
    out: &mut [u8],
) -> Result<usize, WireError> {
    let nonce = match form {
        ReadDoneForm::WithNonce => nonce,
        ReadDoneForm::Plain => None,
    };
    encode_read_done(request_id, consumers, nonce, out)
}

/// A write cursor over a caller buffer that reports overflow instead of
/// panicking.
pub(super) struct Cursor<'b> {
    buf: &'b mut [u8],
    pos: usize,
}

impl<'b> Cursor<'b> {
    fn new(buf: &'b mut [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    #[inline]
    fn put(&mut self, bytes: &[u8]) -> bool {
        // `pos <= buf.len()` and both lengths are at most isize::MAX, so the
        // sum cannot overflow.
        match self.buf.get_mut(self.pos..self.pos + bytes.len()) {
            Some(dst) => {
                dst.copy_from_slice(bytes);
                self.pos += bytes.len();
                true
            }
            None => false,
        }
    }

    #[inline]
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    #[inline]
    fn written(&self) -> &[u8] {
        self.buf.get(..self.pos).unwrap_or_default()
    }

    #[inline]
    fn clear(&mut self) {
        self.pos = 0;
    }
}

pub(super) fn encode_record(e: CompactEntry) -> [u8; COMPACT_RECORD_LEN] {
    let slot = encode_u32_hex(e.slot);
    let nonce = encode_u64_hex(e.nonce.get());
    let mut out = [0u8; COMPACT_RECORD_LEN];
    let (a, b) = out.split_at_mut(SLOT_HEX_LEN);
    a.copy_from_slice(&slot);
    b.copy_from_slice(&nonce);
    out
}
