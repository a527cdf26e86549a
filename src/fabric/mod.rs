//! [`Fabric`]: the one trait through which kvlease talks to the network.
//!
//! This module owns the *shape* of the conversation between a P worker and a
//! D worker: registered memory, the handshake (and what it advertises),
//! notifications, READs. It holds no protocol logic: what a notification
//! means is `wire`'s business, when to send one is the lease book's and the
//! heartbeat sender's.
//!
//! # Ground rules
//!
//! - **Driven by the engine loop.** Every method returns promptly; nothing
//!   here requires a background thread of ours. Progress happens inside the
//!   calls (an implementation may also use its runtime's own progress thread).
//! - **Non-blocking handshakes.** [`Fabric::start_handshake`] returns an
//!   [`AgentId`] at once; [`Fabric::handshake_state`] is polled each step.
//! - **Borrowed notifications.** [`Fabric::drain_notifications`] hands each
//!   message to a callback as `&[u8]`; the bytes are valid only during the
//!   call. The loopback fabric allocates nothing here.
//! - **Typed errors**, never panics, for anything a peer can cause.
//!
//! # Regions
//!
//! A worker registers memory regions in order; the i-th registration is
//! region `i` on that agent ([`RegionId`]). The handshake advertises which
//! region holds the lease slots ([`PeerInfo::slot_region`]). READ descriptors
//! name a local region and a remote region by these indices plus byte offsets.

pub use advert::{AdvertError, LeaseAdvert, PeerRecord, RemoteRegion, SlotRegion, ADVERT_LEN};
pub use landing::LandingWords;

use crate::pack::Field;
use crate::slots::LeaseSlots;
use crate::time::Instant;
use std::sync::Arc;

pub mod advert;
pub mod host;
mod landing;
pub mod loopback;
#[cfg(all(feature = "nixl", not(loom)))]
pub mod nixl;

/// A remote agent this fabric has started a handshake with. Issued by the
/// fabric; meaningful only to the fabric that issued it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AgentId(pub u32);

/// A registered memory region: the index of its registration on its agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionId(pub u32);

/// An in-flight READ. Issued by the fabric; meaningful only to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct XferId(pub u64);

/// How both fabrics pack an [`XferId`]: the index of the READ's table entry,
/// and that entry's generation, bumped on every reuse so that a stale id
/// never names a later READ (diagram in [`crate::design`], "Packed words").
pub(crate) const XFER_INDEX: Field = Field::new(0, 32);
/// See [`XFER_INDEX`].
pub(crate) const XFER_GENERATION: Field = Field::above(XFER_INDEX, 32);
#[cfg(test)]
pub(crate) const XFER_LAYOUT: [Field; 2] = [XFER_INDEX, XFER_GENERATION];

impl XferId {
    /// The id of table entry `index` in its `generation`.
    #[inline]
    pub(crate) fn pack(generation: u32, index: u32) -> XferId {
        XferId(XFER_GENERATION.put(u64::from(generation)) | XFER_INDEX.put(u64::from(index)))
    }

    /// (generation, index).
    #[inline]
    pub(crate) fn unpack(self) -> (u32, u32) {
        (
            XFER_GENERATION.get(self.0) as u32,
            XFER_INDEX.get(self.0) as u32,
        )
    }
}

/// One contiguous piece of a READ: `len` bytes from `remote` at
/// `remote_offset` into `local` at `local_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadDesc {
    /// Local destination region.
    pub local: RegionId,
    /// Byte offset in the local region.
    pub local_offset: u64,
    /// Remote source region (its index on the remote agent).
    pub remote: RegionId,
    /// Byte offset in the remote region.
    pub remote_offset: u64,
    /// Bytes to copy.
    pub len: u64,
}

/// One clock sample taken during a handshake (for [`crate::clock_offset`]):
/// the remote read its monotonic clock between our send and our receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockSample {
    /// Our clock when the request left.
    pub local_send: Instant,
    /// The remote's clock when it answered (its own origin).
    pub remote: Instant,
    /// Our clock when the answer arrived.
    pub local_recv: Instant,
}

/// What a completed handshake told us about the remote agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The region holding the remote's lease slots, if it exports any.
    pub slot_region: Option<RegionId>,
    /// Number of lease slots in that region.
    pub slot_count: u32,
    /// The remote accepts compact (slot, nonce) heartbeats.
    pub compact_heartbeats: bool,
    /// A clock sample from the handshake, if the fabric took one.
    pub clock: Option<ClockSample>,
}

/// Where a handshake stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandshakeState {
    /// Started, not finished; poll again next step.
    Pending,
    /// Finished; notifications and READs to the agent may be posted.
    Ready(PeerInfo),
    /// Failed; start a new handshake to retry.
    Failed(FabricError),
}

/// Where a READ stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XferState {
    /// Still running.
    InProgress,
    /// Every descriptor was copied (and the attached notification, if any,
    /// is on its way).
    Done,
    /// The READ failed or timed out; the local bytes are undefined.
    Failed(FabricError),
}

/// What went wrong in the fabric. `Copy` and allocation-free, so it can be
/// returned from step paths.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FabricError {
    /// The agent id was never issued by this fabric (or was forgotten).
    #[error("unknown agent")]
    UnknownAgent,
    /// The agent's handshake has not completed.
    #[error("agent not connected (handshake not complete)")]
    NotConnected,
    /// The peer address could not be parsed or resolved.
    #[error("bad peer address")]
    BadAddress,
    /// The remote did not answer (crashed, partitioned) or answered garbage.
    #[error("peer unreachable")]
    PeerUnreachable,
    /// A READ or handshake exceeded the fabric's timeout.
    #[error("timed out")]
    TimedOut,
    /// A descriptor lies outside a registered region.
    #[error("descriptor outside a registered region")]
    OutOfBounds,
    /// A region id is not registered (locally or on the remote).
    #[error("unknown region")]
    UnknownRegion,
    /// The transfer id is unknown (never issued, or already finished and reaped).
    #[error("unknown transfer")]
    UnknownXfer,
    /// A notification is larger than the fabric accepts.
    #[error("notification too large")]
    MessageTooLarge,
    /// A fixed-capacity queue or table of the fabric is full.
    #[error("fabric queue or table full")]
    Full,
    /// The READ was cancelled.
    #[error("transfer cancelled")]
    Cancelled,
    /// The underlying runtime reported an error (its status code).
    #[error("fabric backend error {0}")]
    Backend(i32),
    /// This fabric does not offer the operation (see its docs).
    #[error("operation not supported by this fabric")]
    Unsupported,
}

impl FabricError {
    /// Every variant once (`Backend` at its extremes), for the tests that
    /// carry errors through a code.
    #[cfg(test)]
    pub(crate) const EXAMPLES: [FabricError; 15] = [
        FabricError::UnknownAgent,
        FabricError::NotConnected,
        FabricError::BadAddress,
        FabricError::PeerUnreachable,
        FabricError::TimedOut,
        FabricError::OutOfBounds,
        FabricError::UnknownRegion,
        FabricError::UnknownXfer,
        FabricError::MessageTooLarge,
        FabricError::Full,
        FabricError::Cancelled,
        FabricError::Backend(-1),
        FabricError::Backend(i32::MIN),
        FabricError::Backend(i32::MAX),
        FabricError::Unsupported,
    ];

    /// The error's code (1..=13) and backend status (0 unless `Backend`):
    /// the form role messages carry (`ipc::outcome`) and the loopback
    /// fabric's fault injection stores in one atomic word. Codes are part
    /// of the role-message format: never renumber one.
    pub fn code(self) -> (u8, i32) {
        match self {
            FabricError::UnknownAgent => (1, 0),
            FabricError::NotConnected => (2, 0),
            FabricError::BadAddress => (3, 0),
            FabricError::PeerUnreachable => (4, 0),
            FabricError::TimedOut => (5, 0),
            FabricError::OutOfBounds => (6, 0),
            FabricError::UnknownRegion => (7, 0),
            FabricError::UnknownXfer => (8, 0),
            FabricError::MessageTooLarge => (9, 0),
            FabricError::Full => (10, 0),
            FabricError::Cancelled => (11, 0),
            FabricError::Backend(status) => (12, status),
            FabricError::Unsupported => (13, 0),
        }
    }

    /// The error [`FabricError::code`] gave `(code, backend)`; `None` for an
    /// unknown code, or a backend status on a code that is not `Backend`'s.
    pub fn from_code(code: u8, backend: i32) -> Option<FabricError> {
        let e = match code {
            1 => FabricError::UnknownAgent,
            2 => FabricError::NotConnected,
            3 => FabricError::BadAddress,
            4 => FabricError::PeerUnreachable,
            5 => FabricError::TimedOut,
            6 => FabricError::OutOfBounds,
            7 => FabricError::UnknownRegion,
            8 => FabricError::UnknownXfer,
            9 => FabricError::MessageTooLarge,
            10 => FabricError::Full,
            11 => FabricError::Cancelled,
            12 => return Some(FabricError::Backend(backend)),
            13 => FabricError::Unsupported,
            _ => return None,
        };
        (backend == 0).then_some(e)
    }
}

/// The network as kvlease needs it. See the module docs for the ground rules.
pub trait Fabric {
    /// This agent's name, as peers see it in notifications' sender field.
    fn name(&self) -> &str;

    /// Registers this worker's lease slots (normally region 0) and whether it
    /// accepts compact heartbeats; both are advertised in the handshake.
    fn register_slots(
        &mut self,
        slots: Arc<LeaseSlots>,
        compact_heartbeats: bool,
    ) -> Result<RegionId, FabricError>;

    /// Registers `len` bytes at `ptr` (KV blocks, or a local landing buffer
    /// for READs) and returns its region id.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must stay allocated and unmoved until the fabric is
    /// dropped. Remote agents read it and local READs write it concurrently
    /// with the caller: the caller must not hold Rust references to bytes that
    /// a posted READ may write, and must treat bytes that remote agents may
    /// read as shared (write them only while no READ can target them, which is
    /// exactly what a lease guarantees).
    unsafe fn register_memory(&mut self, ptr: *mut u8, len: usize)
        -> Result<RegionId, FabricError>;

    /// Registers a landing buffer for this agent's READs and keeps a share
    /// of it ([`Arc`]) as long as the registration lasts, which is until the
    /// fabric is dropped: the buffer's other owners may drop theirs at any
    /// time without leaving the registration dangling.
    ///
    /// The default registers through [`Fabric::register_memory`] and leaks
    /// its share (the buffer then lives as long as the process), which is
    /// sound for any fabric; the loopback and NIXL fabrics keep the share
    /// and free the buffer once both sides are done with it.
    fn register_landing(&mut self, words: Arc<LandingWords>) -> Result<RegionId, FabricError> {
        // SAFETY: the share is leaked below, so the words are never freed
        // and, being a boxed slice, never move; every Rust-side access to
        // them is atomic (see `LandingWords`).
        let id = unsafe { self.register_memory(words.as_ptr().cast_mut(), words.byte_len())? };
        core::mem::forget(words);
        Ok(id)
    }

    /// Largest notification this fabric sends in one message. Encoders split
    /// batches to fit.
    fn max_notification_len(&self) -> usize;

    /// Starts a handshake with the agent at `address` (fabric-specific
    /// syntax) without blocking, or returns the existing id when one was
    /// already started for that address. `now` stamps the clock sample.
    fn start_handshake(&mut self, address: &str, now: Instant) -> Result<AgentId, FabricError>;

    /// Where the handshake with `agent` stands; drives its progress.
    fn handshake_state(&mut self, agent: AgentId, now: Instant) -> HandshakeState;

    /// This worker's lease advert: the slot region registered with
    /// [`Fabric::register_slots`] (if any) in this fabric's terms, for an
    /// engine that carries it in its own handshake
    /// ([`LeaseAdvert::encode`]). The default advertises nothing.
    fn lease_advert(&self) -> LeaseAdvert {
        LeaseAdvert {
            slots: None,
            compact_heartbeats: false,
            packed_heartbeats: false,
        }
    }

    /// Registers a remote agent from what the engine's own handshake
    /// delivered (its name, its NIXL metadata, its [`LeaseAdvert`], perhaps a
    /// clock sample) instead of running this fabric's handshake. On success
    /// the agent is connected at once: [`Fabric::handshake_state`] reports
    /// `Ready` with what the record said, and [`Fabric::start_handshake`]
    /// with the agent's name returns the same id (so a heartbeat sender whose
    /// peer address is the agent name finds it). Registering the same name
    /// again replaces the old incarnation (a restarted peer). Called at
    /// handshake time; may allocate. The default is
    /// [`FabricError::Unsupported`].
    fn add_peer(&mut self, peer: &PeerRecord<'_>, now: Instant) -> Result<AgentId, FabricError> {
        let _ = (peer, now);
        Err(FabricError::Unsupported)
    }

    /// Forgets a remote agent: its handshake (pending or complete) and
    /// whatever the fabric prepared for it (NIXL: the metadata it loaded and
    /// the READ requests it prepared, all released in NIXL). READs from it
    /// still in flight end: [`Fabric::read_state`] reports them
    /// `Failed(Cancelled)`. Afterwards `agent` is unknown to every method
    /// ([`FabricError::UnknownAgent`]); a later handshake with the same
    /// address, or `add_peer` with the same name, starts afresh and may be
    /// issued another id.
    ///
    /// For peers that are gone for good: every restart of a P worker is a
    /// new agent (vLLM names each with a fresh uuid), so an engine that
    /// learns a worker is gone removes it rather than let the fabric's table
    /// fill. The NIXL fabric also evicts stale peers by itself when its
    /// table is full (see its docs). Not a step path. Unknown ids are
    /// [`FabricError::UnknownAgent`]; the default is
    /// [`FabricError::Unsupported`].
    fn remove_peer(&mut self, agent: AgentId) -> Result<(), FabricError> {
        let _ = agent;
        Err(FabricError::Unsupported)
    }

    /// Sends one notification to a connected agent.
    fn send_notification(&mut self, to: AgentId, msg: &[u8]) -> Result<(), FabricError>;

    /// Hands every notification received since the last call to `sink` as
    /// (sender's agent name, bytes); returns how many. The borrows end with
    /// each callback.
    fn drain_notifications(
        &mut self,
        sink: &mut dyn FnMut(&str, &[u8]),
    ) -> Result<usize, FabricError>;

    /// Posts a READ from a connected agent. With `notification`, the remote
    /// receives it once the READ completes (vLLM's read-done path).
    fn post_read(
        &mut self,
        from: AgentId,
        descs: &[ReadDesc],
        notification: Option<&[u8]>,
        now: Instant,
    ) -> Result<XferId, FabricError>;

    /// Where a READ stands; drives its progress. A READ that has been in
    /// progress longer than the fabric's transfer timeout is `Failed(TimedOut)`.
    /// A finished READ (Done or Failed) is forgotten after it is reported once.
    fn read_state(&mut self, xfer: XferId, now: Instant) -> XferState;

    /// Abandons a READ; its local bytes are undefined. Unknown ids are a no-op.
    fn cancel_read(&mut self, xfer: XferId);
}
