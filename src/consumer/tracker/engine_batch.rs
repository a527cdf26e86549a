//! [`EngineBatch`]: one P engine's tracked requests as a heartbeat needs
//! them, and the iterators over its member positions.

use super::*;

/// One engine and its tracked requests, borrowed from the tracker.
///
/// From [`HeartbeatTracker::due`] it says why it was handed over
/// ([`EngineBatch::reason`]); from the inspection methods
/// ([`HeartbeatTracker::batch`], [`HeartbeatTracker::engine_of`],
/// [`HeartbeatTracker::engines`]) the reason is [`BatchReason::Due`].
#[derive(Clone, Copy)]
pub struct EngineBatch<'t> {
    pub(super) tracker: &'t HeartbeatTracker,
    pub(super) engine: u32,
    pub(super) reason: BatchReason,
}

impl<'t> EngineBatch<'t> {
    fn engine(&self) -> &'t Engine {
        &self.tracker.engines[self.engine as usize]
    }

    /// A handle that finds this engine again in a later step
    /// ([`HeartbeatTracker::batch`]) unless it disappeared meanwhile.
    pub fn handle(&self) -> EngineHandle {
        EngineHandle {
            index: self.engine,
            generation: self.engine().generation,
        }
    }

    /// The engine's identity.
    pub fn key(&self) -> EngineKey<'t> {
        decode_key(self.tracker.keys.id(self.engine))
    }

    /// Why the engine was handed over this step.
    pub fn reason(&self) -> BatchReason {
        self.reason
    }

    /// P's pipeline-parallel size, from the engine's first request.
    pub fn pp_size(&self) -> u32 {
        self.engine().pp_size
    }

    /// P's decode-context-parallel size, from the engine's first request.
    pub fn dcp_size(&self) -> u32 {
        self.engine().dcp_size
    }

    /// Requests tracked for this engine (never 0 for a live engine).
    pub fn len(&self) -> usize {
        self.engine().len as usize
    }

    /// Whether the engine has no requests (only for a stale batch).
    pub fn is_empty(&self) -> bool {
        self.engine().len == 0
    }

    /// Whether every request has a lease slot and nonce, so that the engine
    /// can be heartbeated in compact form.
    pub fn all_leased(&self) -> bool {
        self.engine().unleased == 0
    }

    /// The member positions of the engine, in list order.
    pub(super) fn positions(&self) -> Positions<'t> {
        let eng = self.engine();
        Positions {
            tracker: self.tracker,
            chunk: eng.head,
            off: 0,
            left: eng.len,
        }
    }

    /// The P-side ids to renew (for [`wire::encode_heartbeats`]), in no
    /// particular order.
    pub fn remote_request_ids(&self) -> impl ExactSizeIterator<Item = &'t str> + Clone + 't {
        let t = self.tracker;
        self.positions().map(move |p| t.remote_id(p))
    }

    /// The (slot, nonce) pairs of the requests that have them (for
    /// [`wire::encode_compact_heartbeats`]; complete only when
    /// [`EngineBatch::all_leased`]).
    pub fn leases(&self) -> impl Iterator<Item = CompactEntry> + Clone + 't {
        let t = self.tracker;
        self.positions()
            .filter_map(move |p| t.lease(p).map(CompactEntry::from))
    }

    /// Each request's P-side id and lease together, in no particular order.
    pub fn remotes(&self) -> impl ExactSizeIterator<Item = TrackedRemote<'t>> + Clone + 't {
        let t = self.tracker;
        self.positions().map(move |p| t.remote(p))
    }
}

impl sealed::Sealed for EngineBatch<'_> {}

impl HeartbeatBatch for EngineBatch<'_> {
    fn handle(&self) -> EngineHandle {
        EngineBatch::handle(self)
    }

    fn key(&self) -> EngineKey<'_> {
        EngineBatch::key(self)
    }

    fn pp_size(&self) -> u32 {
        EngineBatch::pp_size(self)
    }

    fn dcp_size(&self) -> u32 {
        EngineBatch::dcp_size(self)
    }

    fn reason(&self) -> BatchReason {
        self.reason
    }

    fn len(&self) -> usize {
        EngineBatch::len(self)
    }

    fn all_leased(&self) -> bool {
        EngineBatch::all_leased(self)
    }

    fn id_bytes(&self) -> usize {
        self.engine().id_bytes as usize
    }

    fn remotes(&self) -> impl Iterator<Item = TrackedRemote<'_>> + Clone + '_ {
        EngineBatch::remotes(self)
    }

    fn remote_request_ids(&self) -> impl Iterator<Item = &str> + Clone + '_ {
        EngineBatch::remote_request_ids(self)
    }

    fn leases(&self) -> impl Iterator<Item = CompactEntry> + Clone + '_ {
        EngineBatch::leases(self)
    }
}

impl fmt::Debug for EngineBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineBatch")
            .field("key", &self.key())
            .field("handle", &self.handle())
            .field("reason", &self.reason)
            .field("len", &self.len())
            .finish()
    }
}

/// The member positions of one engine, chunk by chunk.
#[derive(Clone, Debug)]
pub(super) struct Positions<'t> {
    tracker: &'t HeartbeatTracker,
    chunk: u32,
    off: u32,
    left: u32,
}

impl Iterator for Positions<'_> {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        if self.left == 0 {
            return None;
        }
        if self.off as usize == CHUNK {
            self.chunk = self.tracker.chunk_next[self.chunk as usize];
            self.off = 0;
        }
        let pos = self.chunk * CHUNK as u32 + self.off;
        self.off += 1;
        self.left -= 1;
        Some(pos)
    }

    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

impl ExactSizeIterator for Positions<'_> {}
