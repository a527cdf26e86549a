//! The notification wire codec: the exact bytes of heartbeats and read-done
//! notifications, decoded by borrowing and encoded into caller buffers.
//!
//! This module owns the *bytes* of every notification kvlease sends or
//! accepts, and nothing else. It does not know what an id refers to, never
//! looks up a lease, never sends (that is the fabric's business), and never
//! decides when to heartbeat (the heartbeat sender's). It reads no clock,
//! holds no state, never allocates and never panics on any input: decoding
//! borrows from the message, encoding writes into caller-provided buffers.
//!
//! # Formats
//!
//! All notifications are text. That is not only vLLM compatibility: nixl-sys's
//! notification API fails on bytes that are not UTF-8, so even our own compact
//! form is plain ASCII.
//!
//! ## 1. Heartbeat (vLLM)
//!
//! ```text
//! HB:<id>,<id>,...,<id>
//! ```
//!
//! The three bytes `48 42 3a` (`HB:`), then one or more request ids joined by
//! `,` (`2c`): no spaces, no count, no trailing comma. Ids are UTF-8, non-empty
//! and cannot contain `,`. Example: `HB:req-a,req-b,req-unknown`. This is
//! byte for byte what vLLM's D sends (`"HB:" + ",".join(ids)`) and what its P
//! accepts (everything after `HB:`, split on `,`).
//!
//! vLLM puts no size cap on a heartbeat; we do ([`encode_heartbeats`] splits a
//! batch so that no message exceeds the fabric's limit). Every piece is itself
//! a complete heartbeat, so a vLLM P accepts the split form unchanged.
//!
//! **Empty pieces are skipped, not fatal.** vLLM's D only checks that
//! `remote_request_id` is not `None`, so an empty id from a router reaches its
//! heartbeat set and `",".join` sends `HB:a,`, `HB:,a` or `HB:a,,b`. vLLM's P
//! looks every piece up, renews what it holds and ignores the rest, so one
//! bad piece costs nothing else. We decode the same way: such a message is a
//! heartbeat whose ids ([`HeartbeatIds`]) are only the non-empty pieces, and
//! [`HeartbeatIds::empty_pieces`] says how many pieces were empty, for P to
//! count (a router or D bug worth a metric, not a lost heartbeat). `HB:`
//! alone is a heartbeat with no ids and one empty piece (what vLLM's D sends
//! for a batch holding only the empty id; `"".split(",")` is `[""]` in
//! Python). Our encoders still refuse empty ids ([`check_heartbeat_id`]), so
//! we never send an empty piece. A body that is not UTF-8 still fails the
//! whole message ([`WireError::NotUtf8`]), as vLLM's `decode("utf-8")` does.
//!
//! ## 2. Read-done (vLLM)
//!
//! ```text
//! <request_id>:<consumers>
//! ```
//!
//! The id, `:` (`3a`), and the number of consumers the reader expects as a
//! decimal `u32` of at least 1 (ASCII digits only; leading zeros are accepted,
//! never written). The number is what **current vLLM** sends: how many D
//! ranks read from the P rank that receives it (`plan.local_consumers`,
//! [`crate::topology::TpMapping::consumers_per_p_rank`]), not D's world size
//! as some older releases sent; see [`crate::topology`] for what an older D
//! causes. The message is split at its **last** `:`, so ids may
//! contain `:`: `cmpl-abc:0:2` is id `cmpl-abc:0` with 2 consumers.
//!
//! An empty id (`:1`, `:1:nonce=...`) is [`WireError::EmptyId`]. vLLM's P
//! would look `""` up, find nothing and log "may have expired"; a read-done
//! names a single id, so refusing it (the book counts it as malformed)
//! loses nothing that vLLM would have acted on. The same holds for forms 3.
//!
//! ## 3. Read-done with nonce (the seed's addition)
//!
//! ```text
//! <request_id>:<consumers>:nonce=<16 hex digits>
//! ```
//!
//! Form 2 followed by `:nonce=` and the lease nonce as exactly 16 hex digits,
//! most significant first (`{:016x}`). Encoders write lowercase; the decoder
//! accepts either case. Nonce 0 is [`WireError::ZeroNonce`]: no lease ever
//! has it. The form cannot be confused with form 2, whose last field is all
//! digits: the decoder looks at the field after the last `:` and takes the
//! nonce form exactly when that field begins with `nonce=`.
//! Example: `cmpl-abc:0:2:nonce=00000000000000ff`.
//!
//! ## 4. Compact heartbeat (ours)
//!
//! ```text
//! HBC:<record><record>...        record = <8 hex: slot><16 hex: nonce>
//! ```
//!
//! The four bytes `48 42 43 3a` (`HBC:`), then N >= 1 records of exactly 24
//! hex digits each, with no separators: 8 digits of the lease slot (`u32`),
//! then 16 digits of the lease nonce (`u64`), most significant digit first.
//! Encoders write lowercase; the decoder accepts either case. A body whose
//! length is not a multiple of 24 is [`WireError::Truncated`]; a body with no
//! records is [`WireError::NoEntries`]; one bad record fails the whole
//! message. That strictness is deliberate, unlike the text form: `HBC:` is
//! ours, only our encoder writes it, and it cannot write an empty or bad
//! record, so a malformed body means a foreign or corrupted sender, and
//! records after a framing error would be misaligned guesses. Sent only to peers that advertise it
//! in the handshake ([`crate::fabric::PeerInfo::compact_heartbeats`]). The
//! (slot, nonce) pair renews a lease in O(1) without hashing an id, and a
//! heartbeat cannot renew a lease it does not hold the nonce of.
//! Example: slot 7, nonce 0xff is `HBC:00000007` `00000000000000ff`
//! (one record, no space).
//!
//! # How a message is classified
//!
//! 1. It starts with `HBC:`: compact heartbeat.
//! 2. It starts with `HB:`: heartbeat.
//! 3. Otherwise it is a read-done; a message with no `:` at all is
//!    [`WireError::UnknownPrefix`].
//!
//! The two prefixes are disjoint (`HBC:` does not start with `HB:`), so the
//! order of 1 and 2 is only for the reader's peace of mind.
//!
//! **The prefix ambiguity.** A read-done is not prefixed, so a read-done for
//! the id `HB` (`HB:1`) reads as a heartbeat for the id `1`, and one for an id
//! starting with `HB:` reads as a heartbeat too. vLLM has exactly the same
//! ambiguity and resolves it the same way: its P routes anything starting with
//! `HB:` to heartbeats. We add `HBC:` to that list: a vLLM P would take
//! `HBC:1` as a read-done for the id `HBC`, we take it as a (malformed)
//! compact heartbeat. Real ids (`cmpl-...`, `chatcmpl-...`) never start like
//! that, and [`encode_read_done`] refuses such ids with
//! [`WireError::AmbiguousId`] rather than send a message that would be read as
//! something else (possibly a heartbeat renewing other leases).
//!
//! # Decoding
//!
//! [`decode`] validates the whole message before it returns, so a returned
//! [`Notification`] is entirely well formed: its iterators yield every entry
//! and cannot fail halfway. They borrow from the message and re-scan it
//! lazily (a few hundred bytes a microsecond is far below their cost), which
//! is what lets decoding stay allocation-free without a caller-sized output
//! buffer.
//!
//! # Encoding
//!
//! Encoders write into caller buffers: a heartbeat batch goes through a
//! `scratch` buffer of at least `max_len` bytes, and each finished message is
//! handed to `emit` (which typically calls the fabric's send). An empty batch
//! emits nothing. A message of exactly `max_len` bytes is allowed.
//!
//! ```
//! use kvlease::wire::{self, Notification};
//!
//! let mut scratch = [0u8; 16];
//! let mut sent = Vec::new();
//! let stats = wire::encode_heartbeats(
//!     ["req-a", "req-b", "bad,id", "req-c"],
//!     16,
//!     &mut scratch,
//!     |msg| sent.push(msg.to_vec()),
//! )?;
//! assert_eq!(sent, [b"HB:req-a,req-b".to_vec(), b"HB:req-c".to_vec()]);
//! assert_eq!((stats.messages, stats.entries, stats.skipped), (2, 3, 1));
//!
//! match wire::decode(&sent[0])? {
//!     Notification::Heartbeat(ids) => {
//!         assert_eq!(ids.collect::<Vec<_>>(), ["req-a", "req-b"])
//!     }
//!     other => panic!("{other:?}"),
//! }
//! # Ok::<(), kvlease::wire::WireError>(())
//! ```

use core::fmt;

use crate::nonce::Nonce;

/// Prefix of a (text, vLLM) heartbeat: `HB:`.
pub const HEARTBEAT_PREFIX: &[u8] = b"HB:";

/// Prefix of a compact (slot, nonce) heartbeat: `HBC:`.
pub const COMPACT_HEARTBEAT_PREFIX: &[u8] = b"HBC:";

/// Bytes of one compact heartbeat record: 8 hex digits of slot, 16 of nonce.
pub const COMPACT_RECORD_LEN: usize = 24;

/// What separates the consumers field from the nonce in a read-done (form 3).
pub const READ_DONE_NONCE_TAG: &[u8] = b":nonce=";

/// The most bytes a read-done adds to its request id:
/// `:4294967295:nonce=` and 16 hex digits. A buffer of
/// `request_id.len() + MAX_READ_DONE_SUFFIX_LEN` bytes always suffices for
/// [`encode_read_done`].
pub const MAX_READ_DONE_SUFFIX_LEN: usize = 1 + 10 + READ_DONE_NONCE_TAG.len() + 16;

/// Digits of a nonce on the wire.
const NONCE_HEX_LEN: usize = 16;
/// Digits of a slot on the wire.
const SLOT_HEX_LEN: usize = 8;

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// Everything that can be wrong with a notification, or with a request to
/// encode one. `Copy` and allocation-free, so step paths can return and count
/// it. Decoding errors come first, encoding errors last.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireError {
    /// The message has no bytes at all.
    Empty,
    /// The message is neither a heartbeat (`HB:`), nor a compact heartbeat
    /// (`HBC:`), nor a read-done: it has no `:` to split a consumer count off.
    UnknownPrefix,
    /// A heartbeat or read-done is not valid UTF-8.
    NotUtf8,
    /// A read-done's request id is empty (`:1`); or an encoder was asked to
    /// send an empty id. (An empty piece of a heartbeat is not an error: see
    /// [`HeartbeatIds::empty_pieces`].)
    EmptyId,
    /// An id contains `,`, so it cannot be sent in a heartbeat (reported by
    /// [`check_heartbeat_id`]; the heartbeat encoder skips such ids, and the
    /// decoder cannot see them, since `,` separates ids).
    IdContainsComma,
    /// A read-done's consumer count is missing, not plain ASCII digits, or
    /// larger than `u32::MAX`.
    BadConsumers,
    /// A read-done's consumer count is 0 (at least one reader must exist),
    /// or an encoder was asked to send 0.
    ZeroConsumers,
    /// A nonce field is not exactly 16 hex digits (read-done `nonce=` field,
    /// or the last 16 digits of a compact record).
    BadNonce,
    /// A nonce is 0, which no lease ever has.
    ZeroNonce,
    /// The slot field of a compact record (its first 8 digits) is not hex.
    BadSlot,
    /// A compact heartbeat's body is not a whole number of 24-byte records.
    Truncated,
    /// A compact heartbeat has no records (`HBC:` alone).
    NoEntries,
    /// Encoder: `max_len` cannot hold even the prefix and one entry (a
    /// heartbeat needs 4 bytes, a compact heartbeat 28).
    MessageTooSmall,
    /// Encoder: the caller's buffer is too short (`scratch` shorter than
    /// `max_len`, or `out` shorter than the read-done being encoded).
    BufferTooSmall,
    /// Encoder: the read-done for this id would start with `HB:` or `HBC:`
    /// (the id is `HB` or `HBC`, or starts with `HB:` or `HBC:`), so every
    /// decoder, vLLM's included, would take it for a heartbeat. See the
    /// module docs on the prefix ambiguity.
    AmbiguousId,
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WireError::Empty => "empty notification",
            WireError::UnknownPrefix => {
                "notification is neither a heartbeat nor a read-done (no ':')"
            }
            WireError::NotUtf8 => "notification is not valid UTF-8",
            WireError::EmptyId => "empty request id",
            WireError::IdContainsComma => "request id contains ',' and cannot be heartbeated",
            WireError::BadConsumers => "read-done consumer count is not a decimal u32",
            WireError::ZeroConsumers => "read-done consumer count is 0",
            WireError::BadNonce => "nonce is not exactly 16 hex digits",
            WireError::ZeroNonce => "nonce is 0",
            WireError::BadSlot => "compact heartbeat slot is not 8 hex digits",
            WireError::Truncated => {
                "compact heartbeat body is not a whole number of 24-byte records"
            }
            WireError::NoEntries => "compact heartbeat has no records",
            WireError::MessageTooSmall => "max_len cannot hold a single entry",
            WireError::BufferTooSmall => "output buffer too small",
            WireError::AmbiguousId => {
                "request id would make the read-done look like a heartbeat (HB:/HBC:)"
            }
        })
    }
}

impl std::error::Error for WireError {}

// ---------------------------------------------------------------------------
// Decoded forms
// ---------------------------------------------------------------------------

/// One decoded notification, borrowing from the message bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notification<'a> {
    /// `HB:id,id,...`: renew these ids.
    Heartbeat(HeartbeatIds<'a>),
    /// `HBC:<records>`: renew these (slot, nonce) leases.
    CompactHeartbeat(CompactEntries<'a>),
    /// `id:consumers[:nonce=...]`: one consumer finished reading `id`.
    ReadDone(ReadDone<'a>),
}

/// A decoded read-done notification (forms 2 and 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReadDone<'a> {
    /// The P-side request id (may contain `:` and `,`; never empty).
    pub request_id: &'a str,
    /// How many read-dones P should wait for before releasing (>= 1).
    pub consumers: u32,
    /// The lease nonce, when the reader sent one (form 3).
    pub nonce: Option<Nonce>,
}

/// One record of a compact heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CompactEntry {
    /// The lease slot on the receiving P worker.
    pub slot: u32,
    /// The nonce the lease was granted with.
    pub nonce: Nonce,
}

/// The ids of a validated heartbeat, in message order. Borrowed; iterating
/// allocates nothing. Every id yielded is non-empty and free of `,`: empty
/// pieces of the message (`HB:a,,b`) are skipped, and counted in
/// [`HeartbeatIds::empty_pieces`].
#[derive(Clone)]
pub struct HeartbeatIds<'a> {
    /// The ids not yet yielded, still joined by `,` (empty pieces included).
    rest: &'a str,
    /// How many non-empty ids `rest` holds (counted during validation).
    remaining: usize,
    /// Empty pieces in the whole message (fixed at decode).
    empty_pieces: usize,
}

impl<'a> HeartbeatIds<'a> {
    /// Ids not yet yielded.
    pub fn len_hint(&self) -> usize {
        self.remaining
    }

    /// True once every id has been yielded. A heartbeat may be empty from
    /// the start: `HB:` or `HB:,` carry no id at all.
    pub fn is_empty(&self) -> bool {
        self.remaining == 0
    }

    /// How many pieces of the message, split on `,`, were empty: 1 for
    /// `HB:a,`, `HB:,a`, `HB:a,,b` and `HB:`; 0 for a well-formed heartbeat.
    /// A property of the whole message, unchanged by iteration. vLLM's P
    /// ignores such pieces too; P should add this to a counter (it points at
    /// a router dropping `remote_request_id` to `""`, or a D that sends it).
    pub fn empty_pieces(&self) -> usize {
        self.empty_pieces
    }

    /// The ids not yet yielded, as they appear on the wire (`a,b,c`, empty
    /// pieces included); for logging.
    pub fn as_str(&self) -> &'a str {
        self.rest
    }
}

impl<'a> Iterator for HeartbeatIds<'a> {
    type Item = &'a str;

    #[inline]
    fn next(&mut self) -> Option<&'a str> {
        // `remaining` counts the non-empty pieces left in `rest`, so while it
        // is positive a non-empty piece lies ahead and the loop ends on it;
        // an empty piece costs one extra turn. The `get`s always succeed
        // (',' is ASCII, hence a char boundary); they are `get`s only to
        // keep this panic-free.
        while self.remaining > 0 {
            let id = match find_comma(self.rest.as_bytes()) {
                Some(i) => {
                    let id = self.rest.get(..i).unwrap_or_default();
                    self.rest = self.rest.get(i + 1..).unwrap_or_default();
                    id
                }
                None => core::mem::take(&mut self.rest),
            };
            if !id.is_empty() {
                self.remaining -= 1;
                return Some(id);
            }
            if self.rest.is_empty() {
                // Unreachable after validation; never loop on a broken count.
                self.remaining = 0;
            }
        }
        None
    }

    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl ExactSizeIterator for HeartbeatIds<'_> {}
impl core::iter::FusedIterator for HeartbeatIds<'_> {}

impl PartialEq for HeartbeatIds<'_> {
    /// Equal when the ids not yet yielded are equal, in order, and the
    /// messages had as many empty pieces.
    fn eq(&self, other: &Self) -> bool {
        self.remaining == other.remaining
            && self.empty_pieces == other.empty_pieces
            && self.clone().eq(other.clone())
    }
}
impl Eq for HeartbeatIds<'_> {}

impl fmt::Debug for HeartbeatIds<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.clone()).finish()
    }
}

/// The records of a validated compact heartbeat, in message order. Borrowed;
/// each record is decoded from its 24 hex digits as it is yielded.
#[derive(Clone)]
pub struct CompactEntries<'a> {
    /// Records not yet yielded; validated, and a multiple of 24 bytes long.
    records: &'a [u8],
}

impl<'a> CompactEntries<'a> {
    /// Records not yet yielded.
    pub fn len_hint(&self) -> usize {
        self.records.len() / COMPACT_RECORD_LEN
    }

    /// True once every record has been yielded (a freshly decoded compact
    /// heartbeat is never empty).
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The records not yet yielded, as they appear on the wire; for logging.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.records
    }
}

impl Iterator for CompactEntries<'_> {
    type Item = CompactEntry;

    #[inline]
    fn next(&mut self) -> Option<CompactEntry> {
        let (rec, rest) = self.records.split_first_chunk::<COMPACT_RECORD_LEN>()?;
        self.records = rest;
        let (slot, hi, lo) = record_words(rec);
        // Validated by `decode`: all 24 bytes are hex digits and the nonce is
        // not 0, so `Nonce::new` cannot fail here; `?` only keeps the
        // iterator panic-free if that invariant were ever broken.
        let nonce = Nonce::new((u64::from(hex8_value(hi)) << 32) | u64::from(hex8_value(lo)))?;
        Some(CompactEntry {
            slot: hex8_value(slot),
            nonce,
        })
    }

    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.len_hint();
        (n, Some(n))
    }
}

impl ExactSizeIterator for CompactEntries<'_> {}
impl core::iter::FusedIterator for CompactEntries<'_> {}

impl PartialEq for CompactEntries<'_> {
    /// Equal when the records not yet yielded decode to the same values (the
    /// wire bytes may differ in hex case).
    fn eq(&self, other: &Self) -> bool {
        self.clone().eq(other.clone())
    }
}
impl Eq for CompactEntries<'_> {}

impl fmt::Debug for CompactEntries<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.clone()).finish()
    }
}

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
    if let Some(body) = msg.strip_prefix(HEARTBEAT_PREFIX) {
        return decode_heartbeat(body).map(Notification::Heartbeat);
    }
    decode_read_done(msg).map(Notification::ReadDone)
}

fn decode_heartbeat(body: &[u8]) -> Result<HeartbeatIds<'_>, WireError> {
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

fn decode_compact(body: &[u8]) -> Result<CompactEntries<'_>, WireError> {
    if body.is_empty() {
        return Err(WireError::NoEntries);
    }
    if body.len() % COMPACT_RECORD_LEN != 0 {
        return Err(WireError::Truncated);
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

fn decode_read_done(msg: &[u8]) -> Result<ReadDone<'_>, WireError> {
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
fn parse_consumers(digits: &[u8]) -> Result<u32, WireError> {
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
fn parse_nonce_hex(hex: &[u8]) -> Result<Nonce, WireError> {
    let digits: &[u8; NONCE_HEX_LEN] = hex.try_into().map_err(|_| WireError::BadNonce)?;
    let (hi, lo) = nonce_words(digits);
    if !(hex8_valid(hi) && hex8_valid(lo)) {
        return Err(WireError::BadNonce);
    }
    let raw = (u64::from(hex8_value(hi)) << 32) | u64::from(hex8_value(lo));
    Nonce::new(raw).ok_or(WireError::ZeroNonce)
}

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
    let mut stats = EncodeStats::default();
    let mut w = Cursor::new(buf);
    // Entries in the message under construction.
    let mut in_msg = 0u32;
    for id in ids {
        if check_heartbeat_id(id).is_err() || id.len() > max_len - prefix {
            stats.skipped = stats.skipped.saturating_add(1);
            continue;
        }
        if in_msg > 0 && w.remaining() < id.len() + 1 {
            emit(w.written());
            stats.messages = stats.messages.saturating_add(1);
            w.clear();
            in_msg = 0;
        }
        // The writes below fit: a fresh message has room for prefix + id
        // (checked above), a continued one for ',' + id (checked just now).
        // `put` reports failure instead of panicking; treat it as a skip.
        let ok = if in_msg == 0 {
            w.put(HEARTBEAT_PREFIX) && w.put(id.as_bytes())
        } else {
            w.put(b",") && w.put(id.as_bytes())
        };
        if !ok {
            stats.skipped = stats.skipped.saturating_add(1);
            continue;
        }
        in_msg += 1;
        stats.entries = stats.entries.saturating_add(1);
    }
    if in_msg > 0 {
        emit(w.written());
        stats.messages = stats.messages.saturating_add(1);
    }
    Ok(stats)
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
    mut emit: impl FnMut(&[u8]),
) -> Result<EncodeStats, WireError> {
    let prefix = COMPACT_HEARTBEAT_PREFIX.len();
    if max_len < prefix + COMPACT_RECORD_LEN {
        return Err(WireError::MessageTooSmall);
    }
    let buf = scratch
        .get_mut(..max_len)
        .ok_or(WireError::BufferTooSmall)?;
    let mut stats = EncodeStats::default();
    let mut w = Cursor::new(buf);
    let mut in_msg = 0u32;
    for e in entries {
        if in_msg > 0 && w.remaining() < COMPACT_RECORD_LEN {
            emit(w.written());
            stats.messages = stats.messages.saturating_add(1);
            w.clear();
            in_msg = 0;
        }
        let ok = (in_msg > 0 || w.put(COMPACT_HEARTBEAT_PREFIX)) && w.put(&encode_record(e));
        if !ok {
            // Unreachable: max_len holds prefix + one record.
            stats.skipped = stats.skipped.saturating_add(1);
            continue;
        }
        in_msg += 1;
        stats.entries = stats.entries.saturating_add(1);
    }
    if in_msg > 0 {
        emit(w.written());
        stats.messages = stats.messages.saturating_add(1);
    }
    Ok(stats)
}

/// The exact length of the read-done [`encode_read_done`] would write; at
/// most `request_id.len() + MAX_READ_DONE_SUFFIX_LEN`.
pub fn read_done_len(request_id: &str, consumers: u32, nonce: Option<Nonce>) -> usize {
    let nonce_len = match nonce {
        Some(_) => READ_DONE_NONCE_TAG.len() + NONCE_HEX_LEN,
        None => 0,
    };
    request_id
        .len()
        .saturating_add(1 + decimal_len(consumers) + nonce_len)
}

/// Encodes a read-done (`id:consumers`, or `id:consumers:nonce=<hex>` when
/// `nonce` is given) into `out` and returns the bytes written.
///
/// Errors: [`WireError::EmptyId`], [`WireError::ZeroConsumers`],
/// [`WireError::AmbiguousId`] (the message would start with `HB:`/`HBC:`),
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
    if misrouted(HEARTBEAT_PREFIX) || misrouted(COMPACT_HEARTBEAT_PREFIX) {
        return Err(WireError::AmbiguousId);
    }
    let len = read_done_len(request_id, consumers, nonce);
    let buf = out.get_mut(..len).ok_or(WireError::BufferTooSmall)?;
    let mut w = Cursor::new(buf);
    let (digits, n) = encode_decimal(consumers);
    let mut ok = w.put(id) && w.put(b":") && w.put(digits.get(n..).unwrap_or_default());
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

/// A write cursor over a caller buffer that reports overflow instead of
/// panicking.
struct Cursor<'b> {
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

fn decimal_len(mut v: u32) -> usize {
    let mut n = 1;
    while v >= 10 {
        v /= 10;
        n += 1;
    }
    n
}

/// `v` in decimal, right-aligned in the array; the digits are `[start..]`.
fn encode_decimal(mut v: u32) -> ([u8; 10], usize) {
    let mut out = [0u8; 10];
    let mut i = out.len();
    loop {
        i -= 1;
        // `v % 10 < 10`, so the cast is exact.
        out[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return (out, i);
        }
    }
}

fn encode_record(e: CompactEntry) -> [u8; COMPACT_RECORD_LEN] {
    let slot = encode_u32_hex(e.slot);
    let nonce = encode_u64_hex(e.nonce.get());
    let mut out = [0u8; COMPACT_RECORD_LEN];
    let (a, b) = out.split_at_mut(SLOT_HEX_LEN);
    a.copy_from_slice(&slot);
    b.copy_from_slice(&nonce);
    out
}

// ---------------------------------------------------------------------------
// SWAR hex
//
// A hex field is processed 8 digits (one u64, loaded little-endian) at a time.
// Each byte is classified with carry-free range tests: on lanes whose high bit
// is clear, adding `0x80 - lo` sets the lane's high bit exactly when the lane
// is >= lo, and adding `0x7f - hi` leaves it clear exactly when the lane is
// <= hi; neither sum can exceed 0xff, so no lane carries into its neighbour.
// Bytes >= 0x80 are masked to 7 bits for the tests and rejected separately.
// The unit tests check every byte value in every lane against a scalar
// decoder.
// ---------------------------------------------------------------------------

const LANES_01: u64 = 0x0101_0101_0101_0101;
const LANES_80: u64 = 0x8080_8080_8080_8080;
/// Eight ASCII '0' digits, as loaded little-endian.
const ASCII_ZEROS: u64 = LANES_01 * b'0' as u64;

const fn splat(b: u8) -> u64 {
    LANES_01 * b as u64
}

/// The three 8-digit words of a record: slot, nonce high half, nonce low half.
#[inline(always)]
fn record_words(r: &[u8; COMPACT_RECORD_LEN]) -> (u64, u64, u64) {
    (word::<0, 24>(r), word::<8, 24>(r), word::<16, 24>(r))
}

#[inline(always)]
fn nonce_words(r: &[u8; NONCE_HEX_LEN]) -> (u64, u64) {
    (word::<0, 16>(r), word::<8, 16>(r))
}

/// Bytes `OFF..OFF+8` of `r`, little-endian. `OFF` is a constant, so the
/// indices are checked at compile time.
#[inline(always)]
fn word<const OFF: usize, const N: usize>(r: &[u8; N]) -> u64 {
    u64::from_le_bytes([
        r[OFF],
        r[OFF + 1],
        r[OFF + 2],
        r[OFF + 3],
        r[OFF + 4],
        r[OFF + 5],
        r[OFF + 6],
        r[OFF + 7],
    ])
}

/// The index of the first `,` in `b`. Eight bytes a step: a lane of
/// `x ^ ",,,,,,,,"` is zero exactly where `x` has a comma, and
/// `(y - 0x01..) & !y & 0x80..` flags the lowest zero lane exactly (lanes
/// above a zero lane may be flagged spuriously by the borrow, but only the
/// lowest flag is used; little-endian, so lowest is first in memory).
#[inline]
fn find_comma(b: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(chunk) = b.get(i..).and_then(<[u8]>::first_chunk::<8>) {
        let y = u64::from_le_bytes(*chunk) ^ splat(b',');
        let hit = y.wrapping_sub(LANES_01) & !y & LANES_80;
        if hit != 0 {
            return Some(i + (hit.trailing_zeros() / 8) as usize);
        }
        i += 8;
    }
    let tail = b.get(i..).unwrap_or_default();
    tail.iter().position(|&c| c == b',').map(|p| i + p)
}

/// Whether `b` contains a `,`. Unlike [`find_comma`] it needs no position,
/// so it ORs the flags of all words without a branch per word (the flag
/// formula is exact for "some lane is zero"), and covers a ragged tail by
/// re-reading the last 8 bytes. Twice as fast as `contains` on 40-byte ids.
#[inline]
fn has_comma(b: &[u8]) -> bool {
    let flags = |w: &[u8; 8]| {
        let y = u64::from_le_bytes(*w) ^ splat(b',');
        y.wrapping_sub(LANES_01) & !y & LANES_80
    };
    let Some(last) = b.last_chunk::<8>() else {
        return b.contains(&b',');
    };
    let mut hit = flags(last);
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        if let Some(w) = w.first_chunk::<8>() {
            hit |= flags(w);
        }
    }
    hit != 0
}

/// Whether all 8 bytes of `x` are hex digits (either case).
#[inline(always)]
fn hex8_valid(x: u64) -> bool {
    let ascii = !x & LANES_80;
    let v = x & !LANES_80;
    let ge = |v: u64, lo: u8| (v + splat(0x80 - lo)) & LANES_80;
    let le = |v: u64, hi: u8| !(v + splat(0x7f - hi)) & LANES_80;
    let digit = ge(v, b'0') & le(v, b'9');
    let folded = v | splat(0x20); // 'A'..'F' -> 'a'..'f'; digits unchanged
    let letter = ge(folded, b'a') & le(folded, b'f');
    (digit | letter) & ascii == LANES_80
}

/// The value of 8 hex digits (first byte most significant). Meaningful only
/// when [`hex8_valid`] holds; for other input it returns some value without
/// panicking.
#[inline(always)]
fn hex8_value(x: u64) -> u32 {
    // Among hex digits, bit 6 is set exactly for the letters ('0'-'9' are
    // 0x30-0x39, 'A'-'F' 0x41-0x46, 'a'-'f' 0x61-0x66). Digit lanes: the low
    // nibble is the value. Letter lanes: the low nibble is 1..6, the value is
    // that + 9. Lanes stay below 0x20, so nothing carries.
    let letter = (x >> 6) & LANES_01;
    let nib = (x & splat(0x0f)) + letter * 9;
    // Pair up nibbles: byte 2k becomes (digit 2k << 4) | digit 2k+1.
    let pairs = ((nib << 4) | (nib >> 8)) & 0x00ff_00ff_00ff_00ff;
    // Gather bytes 0, 2, 4, 6 into the low 32 bits.
    let quads = (pairs | (pairs >> 8)) & 0x0000_ffff_0000_ffff;
    let le = (quads | (quads >> 16)) as u32;
    // Byte 0 holds the most significant digits.
    le.swap_bytes()
}

/// `v` as 8 lowercase hex digits, most significant first.
#[inline(always)]
fn encode_u32_hex(v: u32) -> [u8; 8] {
    // Spread the nibbles so that byte k holds nibble k (least significant
    // first), then reverse the bytes so that the most significant comes first.
    let mut x = u64::from(v);
    x = (x | (x << 16)) & 0x0000_ffff_0000_ffff;
    x = (x | (x << 8)) & 0x00ff_00ff_00ff_00ff;
    x = (x | (x << 4)) & 0x0f0f_0f0f_0f0f_0f0f;
    x = x.swap_bytes();
    // Lanes >= 10 get 'a' - 10 - '0' = 0x27 more on top of '0'.
    let letters = ((x + splat(0x06)) & splat(0x10)) >> 4;
    (x + splat(b'0') + letters * 0x27).to_le_bytes()
}

/// `v` as 16 lowercase hex digits, most significant first.
#[inline(always)]
fn encode_u64_hex(v: u64) -> [u8; NONCE_HEX_LEN] {
    let hi = encode_u32_hex((v >> 32) as u32);
    let lo = encode_u32_hex(v as u32);
    let mut out = [0u8; NONCE_HEX_LEN];
    let (a, b) = out.split_at_mut(8);
    a.copy_from_slice(&hi);
    b.copy_from_slice(&lo);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nonce(v: u64) -> Nonce {
        Nonce::new(v).expect("test nonce is non-zero")
    }

    fn ids_of(msg: &[u8]) -> Vec<&str> {
        match decode(msg) {
            Ok(Notification::Heartbeat(ids)) => ids.collect(),
            other => panic!("not a heartbeat: {other:?}"),
        }
    }

    fn entries_of(msg: &[u8]) -> Vec<CompactEntry> {
        match decode(msg) {
            Ok(Notification::CompactHeartbeat(e)) => e.collect(),
            other => panic!("not a compact heartbeat: {other:?}"),
        }
    }

    fn read_done_of(msg: &[u8]) -> ReadDone<'_> {
        match decode(msg) {
            Ok(Notification::ReadDone(r)) => r,
            other => panic!("not a read-done: {other:?}"),
        }
    }

    fn collect_hb(ids: &[&str], max_len: usize) -> (Vec<Vec<u8>>, EncodeStats) {
        let mut scratch = vec![0u8; max_len];
        let mut out = Vec::new();
        let stats = encode_heartbeats(ids.iter().copied(), max_len, &mut scratch, |m| {
            out.push(m.to_vec())
        })
        .expect("encode");
        (out, stats)
    }

    fn collect_compact(entries: &[CompactEntry], max_len: usize) -> (Vec<Vec<u8>>, EncodeStats) {
        let mut scratch = vec![0u8; max_len];
        let mut out = Vec::new();
        let stats =
            encode_compact_heartbeats(entries.iter().copied(), max_len, &mut scratch, |m| {
                out.push(m.to_vec())
            })
            .expect("encode");
        (out, stats)
    }

    fn rd(id: &str, consumers: u32, n: Option<Nonce>) -> Vec<u8> {
        let mut buf = vec![0u8; id.len() + MAX_READ_DONE_SUFFIX_LEN];
        let len = encode_read_done(id, consumers, n, &mut buf).expect("encode");
        assert_eq!(len, read_done_len(id, consumers, n));
        buf.truncate(len);
        buf
    }

    // -- vLLM examples ------------------------------------------------------

    #[test]
    fn vllm_heartbeat_example() {
        assert_eq!(
            ids_of(b"HB:req-a,req-b,req-unknown"),
            ["req-a", "req-b", "req-unknown"]
        );
        let (msgs, _) = collect_hb(&["req-a", "req-b", "req-unknown"], 1024);
        assert_eq!(msgs, [b"HB:req-a,req-b,req-unknown".to_vec()]);
    }

    #[test]
    fn vllm_read_done_example_splits_at_last_colon() {
        let r = read_done_of(b"cmpl-abc:0:2");
        assert_eq!(
            r,
            ReadDone {
                request_id: "cmpl-abc:0",
                consumers: 2,
                nonce: None
            }
        );
        assert_eq!(rd("cmpl-abc:0", 2, None), b"cmpl-abc:0:2");
    }

    #[test]
    fn read_done_ids_may_contain_colons_and_commas() {
        for id in ["a:b:c", "::x", "x::", "a,b", "1:2:3:4", "é:€:😀", "nonce=1"] {
            for n in [None, Some(nonce(0xdead_beef))] {
                let msg = rd(id, 7, n);
                let r = read_done_of(&msg);
                assert_eq!((r.request_id, r.consumers, r.nonce), (id, 7, n), "{id}");
            }
        }
        // An id ending in what looks like a nonce field is still just an id.
        let r = read_done_of(b"a:nonce=0000000000000001:3");
        assert_eq!(
            (r.request_id, r.consumers, r.nonce),
            ("a:nonce=0000000000000001", 3, None)
        );
    }

    #[test]
    fn read_done_with_nonce() {
        let msg = rd("cmpl-abc:0", 2, Some(nonce(0xff)));
        assert_eq!(msg, b"cmpl-abc:0:2:nonce=00000000000000ff");
        let r = read_done_of(b"cmpl-abc:0:2:nonce=00000000000000FF");
        assert_eq!(r.nonce, Some(nonce(0xff)));
        let r = read_done_of(b"x:1:nonce=FfFfFfFfFfFfFfFf");
        assert_eq!(r.nonce, Some(nonce(u64::MAX)));
        assert_eq!(r.consumers, 1);
    }

    #[test]
    fn consumers_parse() {
        assert_eq!(read_done_of(b"x:4294967295").consumers, u32::MAX);
        assert_eq!(read_done_of(b"x:0002").consumers, 2);
        assert_eq!(rd("x", u32::MAX, None), b"x:4294967295");
    }

    // -- empty pieces: vLLM's P renews what it holds, ignores the rest -----

    fn heartbeat_of(msg: &[u8]) -> HeartbeatIds<'_> {
        match decode(msg) {
            Ok(Notification::Heartbeat(ids)) => ids,
            other => panic!("not a heartbeat: {other:?}"),
        }
    }

    #[test]
    fn heartbeat_with_empty_pieces_keeps_its_ids() {
        // (message, ids, empty pieces), as vLLM's P splits them.
        let cases: [(&[u8], &[&str], usize); 8] = [
            (b"HB:req-a,", &["req-a"], 1),
            (b"HB:,req-a", &["req-a"], 1),
            (b"HB:req-a,,req-b", &["req-a", "req-b"], 1),
            (b"HB:,a,,,b,", &["a", "b"], 4),
            (b"HB:a,b", &["a", "b"], 0),
            (b"HB:a", &["a"], 0),
            (b"HB:,,a", &["a"], 2),
            (b"HB:\xc3\xa9,,\xf0\x9f\x98\x80,", &["é", "😀"], 2),
        ];
        for (msg, ids, empty) in cases {
            let hb = heartbeat_of(msg);
            assert_eq!(hb.empty_pieces(), empty, "{msg:?}");
            assert_eq!(hb.len(), ids.len(), "{msg:?}");
            assert_eq!(hb.clone().collect::<Vec<_>>(), ids, "{msg:?}");
            // empty_pieces describes the message: iteration does not change it.
            let mut it = hb.clone();
            it.next();
            assert_eq!(it.empty_pieces(), empty);
            assert_eq!(it.len(), ids.len() - 1);
        }
        // Equality sees through the separators but not through the empties.
        assert_eq!(heartbeat_of(b"HB:a,b"), heartbeat_of(b"HB:a,b"));
        assert_ne!(heartbeat_of(b"HB:a,,b"), heartbeat_of(b"HB:a,b"));
        assert_eq!(heartbeat_of(b"HB:a,,b"), heartbeat_of(b"HB:,a,b"));
        // Encoders still refuse to write an empty piece.
        let (msgs, stats) = collect_hb(&["a", "", "b"], 64);
        assert_eq!(msgs, [b"HB:a,b".to_vec()]);
        assert_eq!(stats.skipped, 1);
    }

    #[test]
    fn bare_heartbeat_prefix_is_a_heartbeat_with_no_ids() {
        // vLLM's D sends "HB:" for a batch holding only the empty id; its P
        // looks "" up and ignores it. A heartbeat with no ids, one empty piece.
        let hb = heartbeat_of(b"HB:");
        assert!(hb.is_empty());
        assert_eq!(hb.len(), 0);
        assert_eq!(hb.empty_pieces(), 1);
        assert_eq!(hb.clone().next(), None);
        let hb = heartbeat_of(b"HB:,,");
        assert_eq!((hb.len(), hb.empty_pieces()), (0, 3));
        assert_eq!(hb.clone().count(), 0);
    }

    #[test]
    fn other_forms_stay_strict_about_empty_fields() {
        // Compact heartbeats are ours: no records, or a bad one, fails the message.
        assert_eq!(decode(b"HBC:"), Err(WireError::NoEntries));
        let good = "00000007000000000000000f";
        let bad = format!("HBC:{good}{}", "z".repeat(24));
        assert_eq!(decode(bad.as_bytes()), Err(WireError::BadSlot));
        // A read-done names one id: an empty one is refused (vLLM drops it too).
        assert_eq!(decode(b":1"), Err(WireError::EmptyId));
        assert_eq!(
            decode(b":2:nonce=00000000000000ff"),
            Err(WireError::EmptyId)
        );
        // Not UTF-8 anywhere in a heartbeat still fails it whole, as vLLM's decode does.
        assert_eq!(decode(b"HB:a,,\xff"), Err(WireError::NotUtf8));
    }

    // -- one test per error variant ---------------------------------------

    #[test]
    fn error_empty() {
        assert_eq!(decode(b""), Err(WireError::Empty));
    }

    #[test]
    fn error_unknown_prefix() {
        assert_eq!(decode(b"hello"), Err(WireError::UnknownPrefix));
        assert_eq!(decode(b"HB"), Err(WireError::UnknownPrefix));
        assert_eq!(decode(b"HBC"), Err(WireError::UnknownPrefix));
    }

    #[test]
    fn error_not_utf8() {
        assert_eq!(decode(b"HB:a,\xff"), Err(WireError::NotUtf8));
        assert_eq!(decode(b"\xc3:1"), Err(WireError::NotUtf8));
        assert_eq!(decode(b"\xff"), Err(WireError::NotUtf8));
    }

    #[test]
    fn error_empty_id() {
        // Only a read-done's empty id is an error (heartbeats skip empty pieces).
        for m in [&b":1"[..], b":1:nonce=0000000000000001"] {
            assert_eq!(decode(m), Err(WireError::EmptyId), "{m:?}");
        }
        let mut buf = [0u8; 64];
        assert_eq!(
            encode_read_done("", 1, None, &mut buf),
            Err(WireError::EmptyId)
        );
        assert_eq!(check_heartbeat_id(""), Err(WireError::EmptyId));
    }

    #[test]
    fn error_id_contains_comma() {
        assert_eq!(check_heartbeat_id("a,b"), Err(WireError::IdContainsComma));
        assert_eq!(check_heartbeat_id("a:b"), Ok(()));
    }

    #[test]
    fn error_bad_consumers() {
        for m in [
            &b"x:"[..],
            b"x:abc",
            b"x:+1",
            b"x: 1",
            b"x:1 ",
            b"x:-1",
            b"x:4294967296",
            b"x:99999999999999999999",
            b"x:1_0",
            b"x:nonce=0000000000000001", // nonce form without a consumer count
            b"x::nonce=0000000000000001",
            b"x:1:NONCE=0000000000000001", // the tag is case-sensitive
        ] {
            assert_eq!(decode(m), Err(WireError::BadConsumers), "{m:?}");
        }
    }

    #[test]
    fn error_zero_consumers() {
        assert_eq!(decode(b"x:0"), Err(WireError::ZeroConsumers));
        assert_eq!(decode(b"x:000"), Err(WireError::ZeroConsumers));
        assert_eq!(
            decode(b"x:0:nonce=0000000000000001"),
            Err(WireError::ZeroConsumers)
        );
        let mut buf = [0u8; 64];
        assert_eq!(
            encode_read_done("x", 0, None, &mut buf),
            Err(WireError::ZeroConsumers)
        );
    }

    #[test]
    fn error_bad_nonce() {
        for m in [
            &b"x:1:nonce="[..],
            b"x:1:nonce=000000000000001",   // 15 digits
            b"x:1:nonce=00000000000000001", // 17 digits
            b"x:1:nonce=000000000000000g",
            b"x:1:nonce=0x00000000000001",
            b"x:1:nonce= 000000000000001",
            b"x:1:nonce=00000000000000\xc3\xa9", // non-ASCII, valid UTF-8
        ] {
            assert_eq!(decode(m), Err(WireError::BadNonce), "{m:?}");
        }
        assert_eq!(
            decode(b"HBC:00000001000000000000000g"),
            Err(WireError::BadNonce)
        );
        assert_eq!(
            decode(b"HBC:00000001g00000000000000f"),
            Err(WireError::BadNonce)
        );
    }

    #[test]
    fn error_zero_nonce() {
        assert_eq!(
            decode(b"x:1:nonce=0000000000000000"),
            Err(WireError::ZeroNonce)
        );
        assert_eq!(
            decode(b"HBC:000000010000000000000000"),
            Err(WireError::ZeroNonce)
        );
        // Zero in a later record is caught up front too.
        assert_eq!(
            decode(b"HBC:000000010000000000000001ffffffff0000000000000000"),
            Err(WireError::ZeroNonce)
        );
    }

    #[test]
    fn error_bad_slot() {
        assert_eq!(
            decode(b"HBC:0000000z0000000000000001"),
            Err(WireError::BadSlot)
        );
        assert_eq!(
            decode(b"HBC:\xff00000000000000000000001"),
            Err(WireError::BadSlot)
        );
    }

    #[test]
    fn error_truncated() {
        assert_eq!(
            decode(b"HBC:00000001000000000000000"),
            Err(WireError::Truncated)
        );
        assert_eq!(decode(b"HBC:1"), Err(WireError::Truncated));
        assert_eq!(
            decode(b"HBC:0000000100000000000000010"),
            Err(WireError::Truncated)
        );
    }

    #[test]
    fn error_no_entries() {
        assert_eq!(decode(b"HBC:"), Err(WireError::NoEntries));
    }

    #[test]
    fn error_message_too_small() {
        let mut s = [0u8; 64];
        assert_eq!(
            encode_heartbeats(["a"], 3, &mut s, |_| ()),
            Err(WireError::MessageTooSmall)
        );
        assert_eq!(
            encode_compact_heartbeats([], 27, &mut s, |_| ()),
            Err(WireError::MessageTooSmall)
        );
        // The smallest legal limits work.
        assert_eq!(collect_hb(&["a"], 4).0, [b"HB:a".to_vec()]);
        let e = CompactEntry {
            slot: 1,
            nonce: nonce(2),
        };
        assert_eq!(collect_compact(&[e], 28).0.len(), 1);
    }

    #[test]
    fn error_buffer_too_small() {
        let mut s = [0u8; 10];
        let mut emitted = false;
        assert_eq!(
            encode_heartbeats(["a"], 11, &mut s, |_| emitted = true),
            Err(WireError::BufferTooSmall)
        );
        assert_eq!(
            encode_compact_heartbeats(
                [CompactEntry {
                    slot: 1,
                    nonce: nonce(1)
                }],
                28,
                &mut s,
                |_| emitted = true
            ),
            Err(WireError::BufferTooSmall)
        );
        assert!(!emitted);
        let mut out = [0u8; 12];
        assert_eq!(
            encode_read_done("abcdefghij", 10, None, &mut out),
            Err(WireError::BufferTooSmall)
        );
        assert_eq!(encode_read_done("abcdefghi", 10, None, &mut out), Ok(12));
        assert_eq!(&out, b"abcdefghi:10");
    }

    #[test]
    fn error_ambiguous_id() {
        let mut out = [0u8; 64];
        for id in ["HB", "HBC", "HB:x", "HBC:x", "HB:", "HBC:"] {
            assert_eq!(
                encode_read_done(id, 1, None, &mut out),
                Err(WireError::AmbiguousId),
                "{id}"
            );
        }
        for id in ["H", "HB_", "HBCD", "hb", "xHB:"] {
            let msg = rd(id, 1, None);
            assert_eq!(read_done_of(&msg).request_id, id);
        }
    }

    #[test]
    fn heartbeats_take_precedence_like_vllm() {
        // A read-done for the id "HB" is indistinguishable from a heartbeat.
        assert_eq!(ids_of(b"HB:1"), ["1"]);
        assert_eq!(decode(b"HBC:1"), Err(WireError::Truncated));
    }

    #[test]
    fn errors_display_and_are_errors() {
        let all = [
            WireError::Empty,
            WireError::UnknownPrefix,
            WireError::NotUtf8,
            WireError::EmptyId,
            WireError::IdContainsComma,
            WireError::BadConsumers,
            WireError::ZeroConsumers,
            WireError::BadNonce,
            WireError::ZeroNonce,
            WireError::BadSlot,
            WireError::Truncated,
            WireError::NoEntries,
            WireError::MessageTooSmall,
            WireError::BufferTooSmall,
            WireError::AmbiguousId,
        ];
        let mut seen = std::collections::HashSet::new();
        for e in all {
            let s = e.to_string();
            assert!(!s.is_empty());
            assert!(seen.insert(s), "duplicate message for {e:?}");
            let _: &dyn std::error::Error = &e;
        }
    }

    // -- heartbeats: encode, split, skip ----------------------------------

    #[test]
    fn heartbeat_iterator_is_exact_and_cloneable() {
        let Ok(Notification::Heartbeat(mut ids)) = decode(b"HB:a,bb,c:c") else {
            panic!()
        };
        assert_eq!(ids.len(), 3);
        assert_eq!(ids.len_hint(), 3);
        let copy = ids.clone();
        assert_eq!(ids.next(), Some("a"));
        assert_eq!(ids.as_str(), "bb,c:c");
        assert_eq!(ids.len(), 2);
        assert_eq!(copy.collect::<Vec<_>>(), ["a", "bb", "c:c"]);
        assert_eq!(ids.by_ref().count(), 2);
        assert!(ids.is_empty());
        assert_eq!(ids.next(), None);
    }

    #[test]
    fn heartbeat_utf8_ids() {
        assert_eq!(ids_of("HB:é,€€,😀".as_bytes()), ["é", "€€", "😀"]);
    }

    #[test]
    fn split_at_exact_boundary() {
        // "HB:aaaa,bbbb" is 12 bytes: exactly max_len is allowed.
        let (m, s) = collect_hb(&["aaaa", "bbbb"], 12);
        assert_eq!(m, [b"HB:aaaa,bbbb".to_vec()]);
        assert_eq!((s.messages, s.entries, s.skipped), (1, 2, 0));
        // One byte less and it splits.
        let (m, s) = collect_hb(&["aaaa", "bbbb"], 11);
        assert_eq!(m, [b"HB:aaaa".to_vec(), b"HB:bbbb".to_vec()]);
        assert_eq!((s.messages, s.entries), (2, 2));
        // An id of exactly max_len - 3 fits alone; one byte more is skipped.
        let (m, s) = collect_hb(&["aaaaaaaa", "bbbbbbbbb", "c"], 11);
        assert_eq!(m, [b"HB:aaaaaaaa".to_vec(), b"HB:c".to_vec()]);
        assert_eq!((s.messages, s.entries, s.skipped), (2, 2, 1));
    }

    #[test]
    fn unencodable_ids_are_skipped_rest_still_go_out() {
        let (m, s) = collect_hb(&["", "a,b", "ok", "", "also-ok"], 64);
        assert_eq!(m, [b"HB:ok,also-ok".to_vec()]);
        assert_eq!((s.messages, s.entries, s.skipped), (1, 2, 3));
        let (m, s) = collect_hb(&["", "a,b"], 64);
        assert!(m.is_empty());
        assert_eq!((s.messages, s.entries, s.skipped), (0, 0, 2));
    }

    #[test]
    fn empty_batches_emit_nothing() {
        let mut s = [0u8; 64];
        let st = encode_heartbeats(core::iter::empty(), 64, &mut s, |_| panic!("emitted"));
        assert_eq!(st, Ok(EncodeStats::default()));
        let st = encode_compact_heartbeats(core::iter::empty(), 64, &mut s, |_| panic!("emitted"));
        assert_eq!(st, Ok(EncodeStats::default()));
    }

    #[test]
    fn scratch_may_be_longer_than_max_len() {
        let mut s = [0u8; 100];
        let mut out = Vec::new();
        encode_heartbeats(["aaaa", "bbbb"], 8, &mut s, |m| out.push(m.to_vec())).expect("encode");
        assert_eq!(out, [b"HB:aaaa".to_vec(), b"HB:bbbb".to_vec()]);
    }

    // -- compact heartbeats ------------------------------------------------

    #[test]
    fn compact_exact_bytes() {
        let e = [
            CompactEntry {
                slot: 7,
                nonce: nonce(0xff),
            },
            CompactEntry {
                slot: u32::MAX,
                nonce: nonce(0x0123_4567_89ab_cdef),
            },
        ];
        let (m, s) = collect_compact(&e, 4 + 48);
        assert_eq!(
            m,
            [b"HBC:0000000700000000000000ffffffffff0123456789abcdef".to_vec()]
        );
        assert_eq!((s.messages, s.entries, s.skipped), (1, 2, 0));
        assert_eq!(entries_of(&m[0]), e);
        // Upper case decodes to the same values.
        assert_eq!(
            entries_of(b"HBC:0000000700000000000000FFFFFFFFFF0123456789ABCDEF"),
            e
        );
    }

    #[test]
    fn compact_split_at_exact_boundary() {
        let e: Vec<_> = (1..=5)
            .map(|i| CompactEntry {
                slot: i,
                nonce: nonce(u64::from(i) << 40),
            })
            .collect();
        // 4 + 2*24 = 52: exactly two records a message.
        for (max_len, per) in [(52, 2), (51, 1), (75, 2), (76, 3), (1000, 5)] {
            let (m, s) = collect_compact(&e, max_len);
            assert!(m.iter().all(|m| m.len() <= max_len));
            assert_eq!(m[0].len(), 4 + 24 * per, "max_len {max_len}");
            assert_eq!(s.messages as usize, 5usize.div_ceil(per));
            let back: Vec<_> = m.iter().flat_map(|m| entries_of(m)).collect();
            assert_eq!(back, e);
        }
    }

    #[test]
    fn compact_iterator_is_exact() {
        let Ok(Notification::CompactHeartbeat(mut it)) =
            decode(b"HBC:000000010000000000000001000000020000000000000002")
        else {
            panic!()
        };
        assert_eq!(it.len(), 2);
        assert_eq!(it.next().map(|e| e.slot), Some(1));
        assert_eq!(it.len(), 1);
        assert_eq!(it.as_bytes(), b"000000020000000000000002");
        assert_eq!(it.next().map(|e| e.nonce), Some(nonce(2)));
        assert!(it.is_empty());
        assert_eq!(it.next(), None);
    }

    // -- SWAR hex against a scalar reference ------------------------------

    fn scalar_hex(bytes: &[u8]) -> Option<u64> {
        let mut v = 0u64;
        for &b in bytes {
            let d = (b as char).to_digit(16)?;
            v = (v << 4) | u64::from(d);
        }
        Some(v)
    }

    #[test]
    fn swar_hex_decode_matches_scalar_for_every_byte_in_every_lane() {
        let bases: [&[u8; 8]; 4] = [b"00000000", b"ffffffff", b"9aF0c3E1", b"12345678"];
        for base in bases {
            for lane in 0..8 {
                for b in 0..=255u8 {
                    let mut d = *base;
                    d[lane] = b;
                    let x = u64::from_le_bytes(d);
                    let want = scalar_hex(&d);
                    assert_eq!(hex8_valid(x), want.is_some(), "{d:?}");
                    if let Some(w) = want {
                        assert_eq!(u64::from(hex8_value(x)), w, "{d:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn swar_hex_decode_random_words() {
        let mut rng = Rng(0x1234);
        let alphabet = b"0123456789abcdefABCDEF";
        for _ in 0..200_000 {
            // Mostly valid digits, sometimes anything.
            let mut d = [0u8; 8];
            for b in &mut d {
                *b = if rng.below(8) == 0 {
                    rng.next() as u8
                } else {
                    alphabet[rng.below(alphabet.len() as u64) as usize]
                };
            }
            let x = u64::from_le_bytes(d);
            let want = scalar_hex(&d);
            assert_eq!(hex8_valid(x), want.is_some(), "{d:?}");
            if let Some(w) = want {
                assert_eq!(u64::from(hex8_value(x)), w, "{d:?}");
            }
        }
    }

    #[test]
    fn swar_hex_encode_matches_format() {
        let mut rng = Rng(99);
        let check = |v: u64| {
            assert_eq!(encode_u64_hex(v), format!("{v:016x}").as_bytes(), "{v:x}");
            let v32 = v as u32;
            assert_eq!(encode_u32_hex(v32), format!("{v32:08x}").as_bytes());
        };
        for v in [
            0,
            1,
            9,
            10,
            15,
            16,
            u64::MAX,
            0x0123_4567_89ab_cdef,
            0xa5a5_a5a5_5a5a_5a5a,
        ] {
            check(v);
        }
        for shift in 0..64 {
            check(1 << shift);
            check(0xf << (shift & !3));
        }
        for _ in 0..100_000 {
            check(rng.next());
        }
    }

    #[test]
    fn swar_find_comma_matches_position() {
        let mut rng = Rng(5);
        for _ in 0..50_000 {
            let len = rng.below(40) as usize;
            let b: Vec<u8> = (0..len)
                .map(|_| match rng.below(6) {
                    0 => b',',
                    1 => rng.next() as u8,
                    _ => b'a' + rng.below(26) as u8,
                })
                .collect();
            assert_eq!(find_comma(&b), b.iter().position(|&c| c == b','), "{b:?}");
        }
        // Every byte value in every lane, and a comma after lanes that borrow.
        for lane in 0..16 {
            for v in 0..=255u8 {
                let mut b = [b'x'; 16];
                b[lane] = v;
                assert_eq!(find_comma(&b), b.iter().position(|&c| c == b','));
                b[15] = b',';
                assert_eq!(find_comma(&b), b.iter().position(|&c| c == b','));
            }
        }
    }

    #[test]
    fn swar_has_comma_matches_contains() {
        let mut rng = Rng(6);
        for _ in 0..50_000 {
            let len = rng.below(40) as usize;
            let b: Vec<u8> = (0..len)
                .map(|_| match rng.below(30) {
                    0 => b',',
                    1 => rng.next() as u8,
                    _ => b'a' + rng.below(26) as u8,
                })
                .collect();
            assert_eq!(has_comma(&b), b.contains(&b','), "{b:?}");
        }
        for len in 0..20 {
            for at in 0..len {
                let mut b = vec![b'x'; len];
                assert!(!has_comma(&b));
                b[at] = b',';
                assert!(has_comma(&b), "len {len} at {at}");
            }
        }
    }

    #[test]
    fn decimal_roundtrip() {
        for v in [
            1u32,
            9,
            10,
            99,
            100,
            12345,
            999_999_999,
            1_000_000_000,
            u32::MAX,
        ] {
            let (d, i) = encode_decimal(v);
            assert_eq!(&d[i..], v.to_string().as_bytes());
            assert_eq!(decimal_len(v), v.to_string().len());
            assert_eq!(parse_consumers(&d[i..]), Ok(v));
        }
    }

    // -- property: random batches round-trip -------------------------------

    /// splitmix64: a seeded generator, so failures reproduce.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    fn random_id(rng: &mut Rng) -> String {
        // ASCII, the separators, multi-byte UTF-8 and the heartbeat prefixes.
        const PIECES: &[&str] = &[
            "a", "b", "z", "0", "9", "-", "_", ":", ",", "é", "€", "😀", "HB", "HB:", "HBC:",
            "cmpl-", "nonce=",
        ];
        let n = match rng.below(10) {
            0 => 0,
            1 => 20 + rng.below(40) as usize, // often too long for the limit
            _ => 1 + rng.below(8) as usize,
        };
        (0..n)
            .map(|_| PIECES[rng.below(PIECES.len() as u64) as usize])
            .collect()
    }

    #[test]
    fn property_heartbeat_batches_roundtrip() {
        let mut rng = Rng(0x6b76_6c65_6173_6521);
        for case in 0..3_000 {
            let max_len = 4 + rng.below(80) as usize;
            let n = rng.below(40) as usize;
            let ids: Vec<String> = (0..n).map(|_| random_id(&mut rng)).collect();
            let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
            let (msgs, stats) = collect_hb(&refs, max_len);

            let encodable: Vec<&str> = refs
                .iter()
                .copied()
                .filter(|id| check_heartbeat_id(id).is_ok() && id.len() <= max_len - 3)
                .collect();
            let decoded: Vec<Vec<&str>> = msgs.iter().map(|m| ids_of(m)).collect();
            let flat: Vec<&str> = decoded.iter().flatten().copied().collect();
            assert_eq!(flat, encodable, "case {case}, max_len {max_len}");
            assert_eq!(stats.messages as usize, msgs.len());
            assert_eq!(stats.entries as usize, encodable.len());
            assert_eq!(stats.skipped as usize, n - encodable.len());
            for (i, m) in msgs.iter().enumerate() {
                assert!(m.len() <= max_len, "case {case}: {} > {max_len}", m.len());
                // Greedy: the next message's first id would not have fit.
                if let Some(next) = decoded.get(i + 1) {
                    assert!(
                        m.len() + 1 + next[0].len() > max_len,
                        "case {case}: not packed"
                    );
                }
            }
        }
    }

    #[test]
    fn property_compact_batches_roundtrip() {
        let mut rng = Rng(42);
        for case in 0..2_000 {
            let max_len = 28 + rng.below(200) as usize;
            let n = rng.below(30) as usize;
            let entries: Vec<CompactEntry> = (0..n)
                .map(|_| CompactEntry {
                    slot: rng.next() as u32,
                    nonce: Nonce::new(rng.next()).unwrap_or(nonce(1)),
                })
                .collect();
            let (msgs, stats) = collect_compact(&entries, max_len);
            let per = (max_len - 4) / 24;
            assert_eq!(stats.messages as usize, n.div_ceil(per), "case {case}");
            assert_eq!((stats.entries as usize, stats.skipped), (n, 0));
            assert!(msgs.iter().all(|m| m.len() <= max_len));
            let back: Vec<_> = msgs.iter().flat_map(|m| entries_of(m)).collect();
            assert_eq!(back, entries, "case {case}");
        }
    }

    #[test]
    fn property_read_done_roundtrip() {
        let mut rng = Rng(7);
        let mut encoded = 0;
        for _ in 0..20_000 {
            let id = random_id(&mut rng);
            let consumers = match rng.below(4) {
                0 => 0,
                1 => u32::MAX,
                _ => rng.below(9) as u32 + 1,
            };
            let n = Nonce::new(rng.next() >> rng.below(64));
            let n = if rng.below(2) == 0 { None } else { n };
            let mut buf = vec![0u8; id.len() + MAX_READ_DONE_SUFFIX_LEN];
            match encode_read_done(&id, consumers, n, &mut buf) {
                Ok(len) => {
                    encoded += 1;
                    let r = read_done_of(&buf[..len]);
                    assert_eq!(
                        (r.request_id, r.consumers, r.nonce),
                        (id.as_str(), consumers, n)
                    );
                }
                Err(WireError::EmptyId) => assert!(id.is_empty()),
                Err(WireError::ZeroConsumers) => assert_eq!(consumers, 0),
                Err(WireError::AmbiguousId) => {
                    let msg = format!("{id}:");
                    assert!(msg.starts_with("HB:") || msg.starts_with("HBC:"), "{id}");
                }
                Err(e) => panic!("{id:?}: {e}"),
            }
        }
        assert!(encoded > 10_000);
    }

    #[test]
    fn decode_never_panics_on_random_bytes() {
        // A cheap, always-on cousin of the fuzz target.
        let mut rng = Rng(3);
        let alphabet = b"HBC:,0123456789abcdefABCDEFnonce=\xff\xc3\xa9";
        for _ in 0..100_000 {
            let len = rng.below(64) as usize;
            let mut m: Vec<u8> = (0..len)
                .map(|_| alphabet[rng.below(alphabet.len() as u64) as usize])
                .collect();
            let prefix: &[u8] = match rng.below(3) {
                0 => b"HB:",
                1 => b"HBC:",
                _ => b"",
            };
            m.splice(0..0, prefix.iter().copied());
            if let Ok(n) = decode(&m) {
                // Whatever decodes iterates fully.
                match n {
                    Notification::Heartbeat(ids) => {
                        // vLLM's P: the body split on ',', empty pieces ignored.
                        let body = core::str::from_utf8(&m[3..]).unwrap();
                        let pieces: Vec<&str> = body.split(',').collect();
                        let want: Vec<&str> =
                            pieces.iter().copied().filter(|p| !p.is_empty()).collect();
                        assert_eq!(ids.len(), want.len(), "{m:?}");
                        assert_eq!(ids.empty_pieces(), pieces.len() - want.len(), "{m:?}");
                        assert_eq!(ids.collect::<Vec<_>>(), want, "{m:?}");
                    }
                    Notification::CompactHeartbeat(e) => assert!(e.count() >= 1),
                    Notification::ReadDone(r) => assert!(r.consumers >= 1),
                }
            }
        }
    }
}
