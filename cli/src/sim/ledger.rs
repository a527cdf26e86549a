//! The simulator's record of every request in flight: where it is on P and
//! on D, and the facts the metrics need about it.
//!
//! This module owns the request table. It is bookkeeping outside the
//! engines (a real deployment has no such global view); the engines only
//! use it to find a request's KV blocks and sizes, and the metrics use it to
//! judge what happened (was the READ stale, was the D alive when P freed).
//! No lease decision reads it.

use std::collections::BTreeMap;

use kvlease::{Instant, LeaseFields};

/// Where a request stands on D.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DState {
    /// Not handed to a D yet (prefilling, or in the router).
    NotYet,
    /// In a D's waiting queue (tracked and heartbeated under a lease policy).
    Waiting,
    /// D's block READs (and checks) in flight.
    Loading,
    /// Decoding.
    Running,
    /// Finished.
    Done,
    /// Lost: its D crashed, or no D was alive to take it.
    Lost,
}

/// One request.
#[derive(Clone, Debug)]
pub struct Req {
    /// Prompt tokens.
    pub prompt: u32,
    /// Output tokens to decode.
    pub output: u32,
    /// When it arrived at the router.
    pub arrived: Instant,
    /// Its P engine.
    pub p: u32,
    /// The KV blocks P allocated for it (`remote_block_ids`).
    pub p_blocks: Vec<u32>,
    /// P still holds the blocks.
    pub p_held: bool,
    /// When P freed them.
    pub p_freed_at: Option<Instant>,
    /// When P's lease started (prefill done).
    pub granted_at: Option<Instant>,
    /// `remote_lease_slot` / `remote_lease_nonce`, if P exported them.
    pub lease: Option<LeaseFields>,
    /// P's scheduler granted it a lease (a refused one is answered without
    /// KV to pull: D prefills it itself).
    pub leased: bool,
    /// Its D engine, once routed.
    pub d: Option<u32>,
    /// When it reached D's queue.
    pub d_arrived: Option<Instant>,
    /// Where it is on D.
    pub d_state: DState,
    /// Its D crashed at this time while P held the blocks.
    pub orphaned_at: Option<Instant>,
    /// When its D crashed, heartbeats (not the initial lease) decided its
    /// expiry (see `metrics`).
    pub renewed_before_crash: bool,
}

impl Req {
    /// Whether D still wants P's blocks: it will read them, or is reading.
    pub fn d_needs_blocks(&self) -> bool {
        matches!(
            self.d_state,
            DState::NotYet | DState::Waiting | DState::Loading
        )
    }

    /// Nothing more will happen to it on either side.
    pub fn settled(&self) -> bool {
        !self.p_held && matches!(self.d_state, DState::Done | DState::Lost)
    }
}

/// Every request in flight, by serial number.
#[derive(Debug, Default)]
pub struct Ledger {
    reqs: BTreeMap<u64, Req>,
    /// Requests that arrived so far.
    pub arrived: u64,
    /// Requests settled (removed) so far.
    pub settled: u64,
}

impl Ledger {
    /// Adds a new request; returns its serial number.
    pub fn add(&mut self, req: Req) -> u64 {
        let serial = self.arrived;
        self.arrived += 1;
        self.reqs.insert(serial, req);
        serial
    }

    /// The request, if still in flight.
    pub fn get(&self, serial: u64) -> Option<&Req> {
        self.reqs.get(&serial)
    }

    /// The request, mutably.
    pub fn get_mut(&mut self, serial: u64) -> Option<&mut Req> {
        self.reqs.get_mut(&serial)
    }

    /// Drops the request if nothing more will happen to it.
    pub fn settle_if_done(&mut self, serial: u64) {
        if self.reqs.get(&serial).is_some_and(Req::settled) {
            self.reqs.remove(&serial);
            self.settled += 1;
        }
    }

    /// Requests in flight.
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// No request in flight.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Every request in flight, by serial.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Req)> {
        self.reqs.iter().map(|(k, v)| (*k, v))
    }

    /// Every request in flight, mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (u64, &mut Req)> {
        self.reqs.iter_mut().map(|(k, v)| (*k, v))
    }
}

/// P's request id for `serial` (what heartbeats and read-dones name).
pub fn p_request_id(serial: u64) -> String {
    format!("p{serial}")
}

/// D's request id for `serial` (what D's tracker and outcomes name).
pub fn d_request_id(serial: u64) -> String {
    format!("d{serial}")
}

/// The serial in a P or D request id; `None` for an id the simulator did
/// not make.
pub fn serial_of(id: &str) -> Option<u64> {
    id.get(1..)?.parse().ok()
}
