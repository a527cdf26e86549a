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
//! Sent only to a peer that exports lease slots: [`ReadDoneForm`] picks the
//! form from what the peer advertised, and [`encode_read_done_for`] writes
//! it (a stock vLLM P, which splits at the last `:`, would look up
//! `id:consumers` as the request id, find nothing, and hold the blocks until
//! the lease expires).
//!
//! Form 2 followed by `:nonce=` and the lease nonce as exactly 16 hex digits,
//! most significant first (`{:016x}`). Encoders write lowercase; the decoder
//! accepts either case. The digits are the nonce's 64 bits, unsigned: the
//! seed's int64 `remote_lease_nonce` -5 is `fffffffffffffffb` (its
//! two's-complement bits, which is what a foreign P's int64 slot cell
//! holds); nonces kvlease draws are below 2^53, so their first two digits
//! are `00` and the third at most `1` (see [`crate::nonce`], "Signedness on
//! the wire"). Nonce 0 is [`WireError::ZeroNonce`]: no lease ever
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
//! ## 5. Packed heartbeat (ours)
//!
//! ```text
//! HBP:<record><record>...        record = 16 bytes, each 0x40 | a six-bit digit
//! ```
//!
//! The four bytes `48 42 50 3a` (`HBP:`), then N >= 1 records of exactly 16
//! bytes: the same (slot, nonce) pair as form 4, as the 96-bit number whose
//! six-bit digit `k` (least significant first) is byte `k`'s low six bits;
//! the slot is bits 0..32, the nonce bits 32..96. Every byte is in
//! `0x40..=0x7f`, so the message is ASCII. The layout, with its diagram, is
//! in `wire/packed.rs`. Errors as in form 4, except that a byte outside
//! `0x40..=0x7f` is [`WireError::BadPackedDigit`] and the record length is 16.
//! Sent only to peers whose advert says they accept it
//! ([`crate::fabric::LeaseAdvert::packed_heartbeats`]): a P decodes it about
//! four times faster than `HBC:` (no hex), which is what keeps its heartbeat
//! step at 100k leases under half a millisecond. Example: slot 7, nonce 0xff
//! is `HBP:G@@@@|O@@@@@@@@@` (bytes `47 40 40 40 40 7c 4f 40`, then eight `40`).
//!
//! # How a message is classified
//!
//! 1. It starts with `HBC:`: compact heartbeat.
//! 2. It starts with `HBP:`: packed heartbeat.
//! 3. It starts with `HB:`: heartbeat.
//! 4. Otherwise it is a read-done; a message with no `:` at all is
//!    [`WireError::UnknownPrefix`].
//!
//! The three prefixes are disjoint (neither `HBC:` nor `HBP:` starts with
//! `HB:`), so the order of 1 to 3 is only for the reader's peace of mind.
//!
//! **The prefix ambiguity.** A read-done is not prefixed, so a read-done for
//! the id `HB` (`HB:1`) reads as a heartbeat for the id `1`, and one for an id
//! starting with `HB:` reads as a heartbeat too. vLLM has exactly the same
//! ambiguity and resolves it the same way: its P routes anything starting with
//! `HB:` to heartbeats. We add `HBC:` and `HBP:` to that list: a vLLM P would take
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum WireError {
    /// The message has no bytes at all.
    #[error("empty notification")]
    Empty,
    /// The message is neither a heartbeat (`HB:`), nor a compact heartbeat
    /// (`HBC:`), nor a read-done: it has no `:` to split a consumer count off.
    #[error("notification is neither a heartbeat nor a read-done (no ':')")]
    UnknownPrefix,
    /// A heartbeat or read-done is not valid UTF-8.
    #[error("notification is not valid UTF-8")]
    NotUtf8,
    /// A read-done's request id is empty (`:1`); or an encoder was asked to
    /// send an empty id. (An empty piece of a heartbeat is not an error: see
    /// [`HeartbeatIds::empty_pieces`].)
    #[error("empty request id")]
    EmptyId,
    /// An id contains `,`, so it cannot be sent in a heartbeat (reported by
    /// [`check_heartbeat_id`]; the heartbeat encoder skips such ids, and the
    /// decoder cannot see them, since `,` separates ids).
    #[error("request id contains ',' and cannot be heartbeated")]
    IdContainsComma,
    /// A read-done's consumer count is missing, not plain ASCII digits, or
    /// larger than `u32::MAX`.
    #[error("read-done consumer count is not a decimal u32")]
    BadConsumers,
    /// A read-done's consumer count is 0 (at least one reader must exist),
    /// or an encoder was asked to send 0.
    #[error("read-done consumer count is 0")]
    ZeroConsumers,
    /// A nonce field is not exactly 16 hex digits (read-done `nonce=` field,
    /// or the last 16 digits of a compact record).
    #[error("nonce is not exactly 16 hex digits")]
    BadNonce,
    /// A nonce is 0, which no lease ever has.
    #[error("nonce is 0")]
    ZeroNonce,
    /// The slot field of a compact record (its first 8 digits) is not hex.
    #[error("compact heartbeat slot is not 8 hex digits")]
    BadSlot,
    /// A compact heartbeat's body is not a whole number of records (24
    /// bytes for `HBC:`, 16 for `HBP:`).
    #[error("compact heartbeat body is not a whole number of records")]
    Truncated,
    /// A compact heartbeat has no records (`HBC:` or `HBP:` alone).
    #[error("compact heartbeat has no records")]
    NoEntries,
    /// A byte of a packed heartbeat's body is not a six-bit digit
    /// (`0x40..=0x7f`).
    #[error("packed heartbeat byte is not a six-bit digit (0x40..=0x7f)")]
    BadPackedDigit,
    /// Encoder: `max_len` cannot hold even the prefix and one entry (a
    /// heartbeat needs 4 bytes, a compact heartbeat 28).
    #[error("max_len cannot hold a single entry")]
    MessageTooSmall,
    /// Encoder: the caller's buffer is too short (`scratch` shorter than
    /// `max_len`, or `out` shorter than the read-done being encoded).
    #[error("output buffer too small")]
    BufferTooSmall,
    /// Encoder: the read-done for this id would start with `HB:`, `HBC:`
    /// or `HBP:` (the id is `HB`, `HBC` or `HBP`, or starts with one of the
    /// three prefixes), so every
    /// decoder, vLLM's included, would take it for a heartbeat. See the
    /// module docs on the prefix ambiguity.
    #[error("request id would make the read-done look like a heartbeat (HB:/HBC:/HBP:)")]
    AmbiguousId,
}

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
    /// `HBP:<records>`: renew these (slot, nonce) leases (packed records).
    PackedHeartbeat(PackedEntries<'a>),
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

mod decode;
mod encode;
mod hex;
mod packed;
pub(crate) use hex::{encode_u32_hex, encode_u64_hex, scalar_hex};
#[cfg(test)]
mod tests;

pub use decode::decode;
pub use encode::{
    check_heartbeat_id, encode_compact_heartbeats, encode_heartbeats, encode_packed_heartbeats,
    encode_read_done, encode_read_done_for, read_done_len, EncodeStats, ReadDoneForm,
};
use hex::{find_comma, hex8_value, record_words};
pub use packed::{PackedBlock, PackedEntries, PACKED_HEARTBEAT_PREFIX, PACKED_RECORD_LEN};
