//! Role messages: the bytes a scheduler and its workers exchange each step
//! over the engine's own IPC.
//!
//! An engine runs one scheduler process and one worker process per GPU; the
//! lease machinery is split the same way (see [`crate::producer`] and
//! [`crate::consumer`]), and the halves talk through the messages defined
//! here, which the engine carries inside what it already ships each step
//! (vLLM: the connector metadata down to the workers, the KV connector output
//! back up). kvlease never opens a channel of its own for them.
//!
//! This module owns the **bytes**: the frame every message shares, each
//! message's records, their encoders (into caller buffers) and their decoders
//! (borrowing from the received bytes). It decides nothing about leases.
//!
//! # Ground rules
//!
//! - **Outside input.** Bytes from another process may be truncated, stale,
//!   from another version or simply wrong. Every decoder checks the whole
//!   message before it returns, returns an [`IpcError`] for anything it
//!   cannot vouch for, and never panics (`fuzz/` has a target per decoder).
//!   A decoded message's iterators cannot fail halfway.
//! - **No allocation.** Encoders write into a caller buffer (a too-small
//!   buffer is [`IpcError::BufferTooSmall`], with the size needed, and
//!   nothing is consumed); decoders borrow.
//! - **No instants.** Processes do not share a clock (a worker may be on
//!   another host), so a deadline crosses as the *remaining* duration at
//!   encoding time, and the receiver rebases it onto its own clock. Delay in
//!   transit can only make the receiver's deadline later, never earlier.
//! - **Little-endian, fixed-size records.** Records are `#[repr(C)]`
//!   plain-old-data ([`bytemuck::Pod`]) with no padding, read with unaligned
//!   loads, so the received buffer needs no particular alignment. (The crate
//!   builds only for little-endian targets; see [`crate::slots`].)
//!
//! # Frame
//!
//! ```text
//!  offset  size  field
//!  ------  ----  ------------------------------------------------------------
//!       0     4  magic    "KVLR"
//!       4     2  version  1; a receiver refuses any other
//!       6     2  kind     what the records are (MsgKind)
//!       8     4  from     the sender: a worker's rank, or u32::MAX (scheduler)
//!      12     4  seq      the sender's message counter, +1 per message
//!      16     4  records  count of section A records
//!      20     4  extras   count of section B records (0 for most kinds)
//!      24     4  ids_len  bytes in the id area
//!      28     4  reserved 0
//!      32        section A: records × size_of(A)
//!                section B: extras × size_of(B)
//!                id area:   ids_len bytes of UTF-8 ids, each referenced by
//!                           (offset, length) from a record
//! ```
//!
//! The message is exactly `32 + records·|A| + extras·|B| + ids_len` bytes;
//! anything else is [`IpcError::Length`]. Ids live in one area after the
//! records so that the records stay fixed-size.
//!
//! # Messages
//!
//! | kind | from → to | records |
//! |---|---|---|
//! | [`MsgKind::Directives`] | P scheduler → every P worker | [`directive`]: grant, start, cancel |
//! | [`MsgKind::RankReports`] | one P worker → P scheduler | [`report`]: (entry, nonce, why released) |
//! | [`MsgKind::HeartbeatPlan`] | D scheduler → every D worker | [`plan`]: due, owed and gone engines; their members (P-side id, lease) |
//! | [`MsgKind::VerifyOutcomes`] | one D worker → D scheduler | [`outcome`]: (D-side id, verdict); owed engines |

/// The header accessors every received role message type has (`seq`, `len`,
/// `is_empty`, and `rank` for the workers' messages), written once. The
/// type must hold its checked frame in a field `frame`. `$sender` names who
/// counts the messages, `$records` what the records are, `$one` one record.
macro_rules! header_accessors {
    (rank: $sender:literal, $records:literal, $one:literal) => {
        /// The sender's rank (the header's `from`).
        pub fn rank(&self) -> u32 {
            self.frame.header.from
        }

        header_accessors!($sender, $records, $one);
    };
    ($sender:literal, $records:literal, $one:literal) => {
        #[doc = concat!("The ", $sender, "'s message counter.")]
        pub fn seq(&self) -> u32 {
            self.frame.header.seq
        }

        #[doc = concat!($records, " in the message.")]
        pub fn len(&self) -> u32 {
            self.frame.header.records
        }

        #[doc = concat!("True when the message carries no ", $one, ".")]
        pub fn is_empty(&self) -> bool {
            self.len() == 0
        }
    };
}

mod frame;

pub mod directive;
pub mod outcome;
pub mod plan;
pub mod report;

pub use frame::{FrameHeader, FRAME_HEADER_LEN, FRAME_MAGIC, FRAME_VERSION, FROM_SCHEDULER};
pub(crate) use frame::{FrameReader, FrameWriter};

/// What a message carries. The numbers are on the wire; never reuse one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MsgKind {
    /// P scheduler → P workers: [`directive::Directive`]s.
    Directives,
    /// P worker → P scheduler: [`report::RankReport`]s.
    RankReports,
    /// D scheduler → D workers: the heartbeat plan.
    HeartbeatPlan,
    /// D worker → D scheduler: verification outcomes.
    VerifyOutcomes,
}

impl MsgKind {
    /// The wire number.
    pub const fn code(self) -> u16 {
        match self {
            MsgKind::Directives => 1,
            MsgKind::RankReports => 2,
            MsgKind::HeartbeatPlan => 3,
            MsgKind::VerifyOutcomes => 4,
        }
    }
}

/// Why a role message could not be decoded or encoded. Every variant is a
/// refusal of the whole message: nothing of it was applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// Shorter than the frame header.
    #[error("role message of {len} bytes is shorter than its header")]
    TooShort {
        /// Bytes received.
        len: usize,
    },
    /// The first four bytes are not `KVLR`: not a kvlease role message.
    #[error("not a kvlease role message (bad magic)")]
    BadMagic,
    /// A frame version this build does not speak.
    #[error("role message version {found} (this build speaks {current})", current = FRAME_VERSION)]
    UnsupportedVersion {
        /// The version received.
        found: u16,
    },
    /// A message of another kind than the receiver takes.
    #[error("role message of kind {found}, expected kind {expected}")]
    WrongKind {
        /// The kind code expected.
        expected: u16,
        /// The kind code received.
        found: u16,
    },
    /// The length disagrees with the counts in the header.
    #[error("role message is {found} bytes but its header describes {expected}")]
    Length {
        /// What the header implies (saturating).
        expected: u64,
        /// Bytes received.
        found: usize,
    },
    /// A record is not valid: an unknown code, a zero nonce, an id reference
    /// outside the id area or not UTF-8, a field out of its range.
    #[error("role message record {index}: {what}")]
    BadRecord {
        /// Its index in its section.
        index: u32,
        /// What is wrong.
        what: &'static str,
    },
    /// A header field breaks the frame's rules (a reserved field not 0, a
    /// section this kind of message does not have).
    #[error("role message header: {what}")]
    Header {
        /// What is wrong.
        what: &'static str,
    },
    /// The sender field disagrees with who the receiver was told sent it.
    #[error("role message from sender {found}, expected sender {expected}")]
    WrongSender {
        /// Who the receiver expected.
        expected: u32,
        /// The header's `from`.
        found: u32,
    },
    /// An outcome message from a worker rank the tracker was not built for:
    /// its requests fail (see `HeartbeatTracker::apply_outcomes`).
    #[error(
        "verify outcomes from D worker {rank}, but the tracker aggregates workers 0..{workers}"
    )]
    UnknownWorker {
        /// The header's `from`.
        rank: u32,
        /// The worker count the tracker was built with.
        workers: u32,
    },
    /// The caller's buffer cannot hold the message; nothing was consumed.
    #[error("buffer too small for the role message ({needed} bytes needed)")]
    BufferTooSmall {
        /// Bytes the message needs.
        needed: usize,
    },
}
