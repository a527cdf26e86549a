//! [`PushWrites`]: P's side of the push guard, the registrations P holds
//! and the one WRITE each allows.
//!
//! This module owns, for every registration a D sent this P rank, whether P
//! may still post its WRITE (the gate: D's deadline translated onto P's
//! clock, widened by the clock estimate's error bound), whether the WRITE is
//! in flight, and how the permit ended, kept until a duplicate of the
//! registration could no longer pass the gate. It posts no WRITE and reads
//! no clock: the engine asks [`PushWrites::begin_write`] right before it
//! posts, and reports the WRITE's terminal state to
//! [`PushWrites::write_done`].
//!
//! # Layout
//!
//! ```text
//!  writes: [Write; capacity]   free, Held, Posted (in flight) or Ended(code)
//!  index:  IdIndex             (D peer, D's permit slot, nonce) -> entry
//!  free:   FreeStack
//!  live:   DenseSet            every non-free entry (the due scan)
//!  alive:  DenseSet            Held and Posted: named in each PHB:
//!  ends:   DenseSet            owe D a PEND: this step
//! ```

use core::time::Duration;

use super::wire::{self, EndCode, PeerMessages, PermitFields, PushMessage, PushWireError};
use super::{PushConfig, PushError};
use crate::clock_offset::ClockOffset;
use crate::collections::{DenseSet, FreeStack};
use crate::ids::IdIndex;
use crate::nonce::Nonce;
use crate::time::{duration_nanos, Instant};

/// The engine's name for one registration P accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WriteHandle {
    entry: u32,
    nonce: Nonce,
}

/// Why P did not accept a registration; P answered `PEND:` (`R`) already,
/// or will in this step's poll.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// P no longer has the request (its lease lapsed, it was aborted).
    RequestGone,
    /// P has no clock sample of that D: it cannot tell when D's deadline
    /// falls, so it may not write.
    NoClock,
    /// The deadline has passed on P's clock (worst case) already.
    PastDeadline,
    /// No free entry: the registration is not guarded, so not written,
    /// and not answered (there is no entry to answer from): D's fence ends
    /// it.
    Exhausted,
    /// The same registration again, after P ended it: answered again with
    /// the same code.
    AlreadyEnded(EndCode),
}

/// [`PushWrites::begin_write`]'s refusals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PostRefused {
    /// The handle names no live registration.
    UnknownHandle,
    /// D revoked the permit, or its deadline is too close: P ended it (`X`).
    Closed,
    /// The WRITE was posted already (one WRITE per registration).
    AlreadyPosted,
}

/// What P's writes did, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteCounters {
    /// Registrations accepted.
    pub accepted: u64,
    /// Refused because P no longer has the request.
    pub refused_gone: u64,
    /// Refused for want of a clock sample of D.
    pub refused_no_clock: u64,
    /// Refused because D's deadline had passed.
    pub refused_past_deadline: u64,
    /// Refused for want of an entry (no answer could be queued).
    pub refused_exhausted: u64,
    /// Duplicate registrations (answered again or ignored).
    pub duplicates: u64,
    /// WRITEs let through the gate.
    pub posted: u64,
    /// Posts refused at the gate (revoked or too close to the deadline).
    pub closed_at_gate: u64,
    /// Ended: WRITE completed.
    pub written: u64,
    /// Ended without a complete WRITE.
    pub ended: u64,
    /// Revocations received for a live registration.
    pub revoked: u64,
    /// Renewals applied.
    pub renewed: u64,
    /// Records naming no registration P has.
    pub stale_records: u64,
    /// Messages that did not decode (nothing changed).
    pub malformed: u64,
    /// `PHB:`/`PEND:` messages handed to `emit`.
    pub messages_sent: u64,
    /// WRITEs that reached their terminal state more than `write_bound`
    /// after they were let through.
    pub late_writes: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Held,
    Posted { revoked: bool },
    Ended(EndCode),
}

#[derive(Clone, Copy, Debug)]
struct Write {
    state: State,
    peer: u16,
    d_slot: u32,
    nonce: u64,
    /// On D's clock: the latest deadline D told P.
    deadline: Instant,
    /// P's clock when the WRITE was let through (to count late ones).
    posted_at: Instant,
    /// The index's hash of the entry's key (the index's removal rehashes
    /// the other members of a cluster from here).
    hash: u64,
}

const KEY_LEN: usize = 14;

fn key(peer: u16, d_slot: u32, nonce: u64) -> [u8; KEY_LEN] {
    let mut k = [0u8; KEY_LEN];
    k[..2].copy_from_slice(&peer.to_le_bytes());
    k[2..6].copy_from_slice(&d_slot.to_le_bytes());
    k[6..].copy_from_slice(&nonce.to_le_bytes());
    k
}

/// P's registrations. See the module docs and [`crate::push`].
#[derive(Debug)]
pub struct PushWrites {
    config: PushConfig,
    writes: Box<[Write]>,
    index: IdIndex,
    free: FreeStack,
    live: DenseSet,
    alive: DenseSet,
    ends: DenseSet,
    next_scan: Instant,
    next_heartbeat: Instant,
    scratch: Box<[u8]>,
    counters: WriteCounters,
}

impl PushWrites {
    /// Room for `config.capacity` registrations; allocates everything now.
    /// `hash_key` keys the index (random per process: D's fields come off
    /// the wire).
    pub fn new(config: PushConfig, hash_key: u64) -> Result<PushWrites, PushError> {
        config.validate()?;
        let n = config.capacity;
        Ok(PushWrites {
            writes: vec![
                Write {
                    state: State::Free,
                    peer: 0,
                    d_slot: 0,
                    nonce: 0,
                    deadline: Instant::ZERO,
                    posted_at: Instant::ZERO,
                    hash: 0,
                };
                n as usize
            ]
            .into_boxed_slice(),
            index: IdIndex::new(n, hash_key),
            free: FreeStack::full(n),
            live: DenseSet::new(n),
            alive: DenseSet::new(n),
            ends: DenseSet::new(n),
            next_scan: Instant::MAX,
            next_heartbeat: Instant::ZERO,
            scratch: vec![0u8; config.max_message_len].into_boxed_slice(),
            counters: WriteCounters::default(),
            config,
        })
    }

    /// What it did so far.
    pub fn counters(&self) -> WriteCounters {
        self.counters
    }

    /// Registrations held (not free), ended ones kept for duplicates included.
    pub fn held(&self) -> u32 {
        self.live.len()
    }

    /// Whether [`PushWrites::poll`] at `now` scans its entries, and so
    /// reads the clock estimates (the only part of a poll that does). A
    /// binding that must gather the estimates first can skip that work on
    /// the polls that do not scan: most of them.
    pub fn scans_at(&self, now: Instant) -> bool {
        now >= self.next_scan
    }

    /// The D peers that held entries name, one item per entry (a peer may
    /// repeat): registrations held or posted, and ended ones kept for their
    /// duplicates or owing D its answer. A peer named by none may be
    /// forgotten and its id given to another D engine: no answer of this P
    /// goes to the wrong D, and a late copy of an ended registration meets
    /// the gate afresh (no clock sample of the new id: refused or deferred,
    /// never written twice). O(held entries), no allocation; for the rare
    /// path that makes room in a full peer table, never a step.
    pub fn peers_in_use(&self) -> impl Iterator<Item = u16> + '_ {
        (0..self.live.len()).filter_map(move |k| {
            let entry = self.live.get(k)?;
            Some(self.writes[entry as usize].peer)
        })
    }

    /// A registration from D peer `peer` for a request P has
    /// (`request_live`) or no longer has. Accepted: P may post one WRITE
    /// under it while [`PushWrites::begin_write`] lets it. Refused: P
    /// answers `R` (this step's poll) and never writes: a registration that
    /// reaches P after P let the request go is answered at once, so D does
    /// not wait for a deadline. `clock` is P's estimate of that D's clock.
    pub fn register(
        &mut self,
        peer: u16,
        fields: PermitFields,
        request_live: bool,
        clock: &ClockOffset,
        now: Instant,
    ) -> Result<WriteHandle, Refusal> {
        let nonce = fields.nonce;
        let k = key(peer, fields.slot, nonce.get());
        let h = self.index.hash(&k);
        let writes = &self.writes;
        if let Some(e) = self.index.find(h, |e| {
            let w = &writes[e as usize];
            key(w.peer, w.d_slot, w.nonce) == k
        }) {
            self.counters.duplicates += 1;
            return match self.writes[e as usize].state {
                State::Ended(code) => {
                    self.ends.insert(e);
                    Err(Refusal::AlreadyEnded(code))
                }
                _ => Ok(WriteHandle { entry: e, nonce }),
            };
        }
        let refusal = if !request_live {
            Some(Refusal::RequestGone)
        } else if !clock.has_sample() {
            Some(Refusal::NoClock)
        } else if !self.gate_open(fields.deadline, clock, now) {
            Some(Refusal::PastDeadline)
        } else {
            None
        };
        let Some(e) = self.free.pop() else {
            self.counters.refused_exhausted += 1;
            return Err(Refusal::Exhausted);
        };
        self.writes[e as usize] = Write {
            state: State::Held,
            peer,
            d_slot: fields.slot,
            nonce: nonce.get(),
            deadline: fields.deadline,
            posted_at: Instant::ZERO,
            hash: h,
        };
        self.index.insert(h, e);
        self.live.insert(e);
        self.next_scan = Instant::ZERO;
        match refusal {
            Some(r) => {
                match r {
                    Refusal::RequestGone => self.counters.refused_gone += 1,
                    Refusal::NoClock => self.counters.refused_no_clock += 1,
                    _ => self.counters.refused_past_deadline += 1,
                }
                self.finish(e, EndCode::Refused);
                Err(r)
            }
            None => {
                self.alive.insert(e);
                self.counters.accepted += 1;
                Ok(WriteHandle { entry: e, nonce })
            }
        }
    }

    /// Right before posting the WRITE of `handle`: Ok when it may be posted
    /// now (the caller then posts within `post_margin`), and from then on
    /// the registration waits for [`PushWrites::write_done`]. Refused when D
    /// revoked it or its deadline is too close on P's clock (worst case):
    /// then P ends it (`X`) and must not post.
    pub fn begin_write(
        &mut self,
        handle: WriteHandle,
        clock: &ClockOffset,
        now: Instant,
    ) -> Result<(), PostRefused> {
        let Some(w) = self.get(handle) else {
            return Err(PostRefused::UnknownHandle);
        };
        match w.state {
            State::Held => {}
            State::Posted { .. } => return Err(PostRefused::AlreadyPosted),
            _ => return Err(PostRefused::Closed),
        }
        if !self.gate_open(w.deadline, clock, now) {
            self.counters.closed_at_gate += 1;
            self.finish(handle.entry, EndCode::Ended);
            return Err(PostRefused::Closed);
        }
        let w = &mut self.writes[handle.entry as usize];
        w.state = State::Posted { revoked: false };
        w.posted_at = now;
        self.counters.posted += 1;
        Ok(())
    }

    /// The posted WRITE of `handle` reached its terminal state: `ok` when
    /// it completed (the data is in D's blocks), false when it failed. P
    /// answers `W` or `X`. A WRITE that took longer than `write_bound` is
    /// counted in `late_writes`: past the bound D may have freed the blocks
    /// (see [`crate::push`]), so an operator must hear of it. Returns false
    /// for a handle with no WRITE in flight (counted as stale).
    pub fn write_done(&mut self, handle: WriteHandle, ok: bool, now: Instant) -> bool {
        match self.get(handle) {
            Some(
                w @ Write {
                    state: State::Posted { .. },
                    ..
                },
            ) => {
                if now.saturating_duration_since(w.posted_at) > self.config.write_bound {
                    self.counters.late_writes += 1;
                }
                let code = if ok { EndCode::Written } else { EndCode::Ended };
                self.finish(handle.entry, code);
                true
            }
            _ => {
                self.counters.stale_records += 1;
                false
            }
        }
    }

    /// P lets the request go before writing (aborted, its lease lapsed):
    /// a held registration ends (`X`). A posted WRITE is not affected: it
    /// ends at [`PushWrites::write_done`]. Returns whether it ended.
    pub fn cancel(&mut self, handle: WriteHandle) -> bool {
        if self.get(handle).is_some_and(|w| w.state == State::Held) {
            self.finish(handle.entry, EndCode::Ended);
            return true;
        }
        false
    }

    /// A notification from D peer `peer`: `PRN:` moves deadlines later,
    /// `PRV:` revokes (a held registration ends now, a posted one when its
    /// WRITE ends; an ended one is answered again).
    pub fn on_message(&mut self, peer: u16, msg: &[u8]) -> Result<(), PushWireError> {
        let decoded = match wire::decode(msg) {
            Ok(m) => m,
            Err(e) => {
                self.counters.malformed += 1;
                return Err(e);
            }
        };
        match decoded {
            PushMessage::Renew(records) => {
                for f in records {
                    self.on_renew(peer, f);
                }
            }
            PushMessage::Revoke(records) => {
                for (slot, nonce) in records {
                    self.on_revoke(peer, slot, nonce);
                }
            }
            PushMessage::Alive(r) => self.counters.stale_records += r.len() as u64,
            PushMessage::End(r) => self.counters.stale_records += r.len() as u64,
        }
        Ok(())
    }

    fn on_renew(&mut self, peer: u16, f: PermitFields) {
        let Some(e) = self.find(peer, f.slot, f.nonce) else {
            self.counters.stale_records += 1;
            return;
        };
        let w = &mut self.writes[e as usize];
        // Only a registration that may still post needs a later deadline;
        // a revoked one never gets one.
        if w.state == State::Held && f.deadline > w.deadline {
            w.deadline = f.deadline;
            self.counters.renewed += 1;
        }
    }

    fn on_revoke(&mut self, peer: u16, slot: u32, nonce: Nonce) {
        let Some(e) = self.find(peer, slot, nonce) else {
            // Never registered here, or ended and forgotten: D's fence ends
            // it. (Answering would be unsafe: the registration may still
            // be on its way.)
            self.counters.stale_records += 1;
            return;
        };
        match self.writes[e as usize].state {
            State::Held => {
                self.counters.revoked += 1;
                self.finish(e, EndCode::Ended);
            }
            State::Posted { revoked: false } => {
                self.counters.revoked += 1;
                self.writes[e as usize].state = State::Posted { revoked: true };
            }
            State::Ended(_) => {
                self.ends.insert(e);
            }
            _ => {}
        }
    }

    /// Once per step: ends held registrations whose gate closed, forgets
    /// ended ones that a duplicate registration could no longer pass the
    /// gate with, and hands `emit` the `PEND:` messages owed and, every
    /// heartbeat interval, the `PHB:` naming every registration P holds
    /// (held or posted), per D peer. `clocks` gives P's estimate of each D
    /// peer's clock (`None`: no estimate, so every gate of that peer is
    /// closed).
    pub fn poll<'c>(
        &mut self,
        clocks: impl Fn(u16) -> Option<&'c ClockOffset>,
        now: Instant,
        mut emit: impl FnMut(u16, &[u8]),
    ) {
        if now >= self.next_scan {
            self.scan(&clocks, now);
        }
        let mut sent = 0u64;
        let mut out = |peer: u16, m: &[u8]| {
            sent += 1;
            emit(peer, m)
        };
        // Ends first: an entry that ended this step is in no PHB:.
        Self::drain(
            &mut self.ends,
            &self.writes,
            &mut self.scratch,
            wire::END_PREFIX,
            &mut out,
        );
        if now >= self.next_heartbeat {
            self.next_heartbeat = now.saturating_add(self.config.heartbeat_interval);
            // Every held registration, without emptying `alive`; not a
            // WRITE in flight past `write_bound`: P no longer vouches for
            // it, so D's fence comes and bounds P's own hold
            // (`PushConfig::hold_bound`).
            let overdue_before = now.saturating_sub(self.config.write_bound);
            let mut w = PeerMessages::new(&mut self.scratch, wire::ALIVE_PREFIX);
            let mut k = 0;
            while let Some(e) = self.alive.get(k) {
                k += 1;
                let r = self.writes[e as usize];
                if matches!(r.state, State::Posted { .. }) && r.posted_at < overdue_before {
                    continue;
                }
                let Some(nonce) = Nonce::new(r.nonce) else {
                    continue;
                };
                let _ = w.permit(r.peer, r.d_slot, nonce, &mut out);
            }
            w.finish(&mut out);
        }
        self.counters.messages_sent += sent;
    }

    fn drain(
        set: &mut DenseSet,
        writes: &[Write],
        scratch: &mut [u8],
        prefix: &'static [u8],
        out: &mut impl FnMut(u16, &[u8]),
    ) {
        let mut w = PeerMessages::new(scratch, prefix);
        while let Some(e) = set.get(0) {
            set.remove(e);
            let r = writes[e as usize];
            let (Some(nonce), State::Ended(code)) = (Nonce::new(r.nonce), r.state) else {
                continue;
            };
            // The scratch holds at least one record (PushConfig::validate).
            let _ = w.end(r.peer, r.d_slot, nonce, code, out);
        }
        w.finish(out);
    }

    fn scan<'c>(&mut self, clocks: &impl Fn(u16) -> Option<&'c ClockOffset>, now: Instant) {
        let mut next = now.saturating_add(self.config.heartbeat_interval);
        let mut k = 0;
        while let Some(e) = self.live.get(k) {
            let w = self.writes[e as usize];
            let clock = clocks(w.peer);
            let closes = clock.and_then(|c| self.closes_at(w.deadline, c, now));
            let open = closes.is_some_and(|t| now < t);
            match w.state {
                State::Held if !open => {
                    self.finish(e, EndCode::Ended);
                }
                State::Ended(_)
                    if !self.ends.contains(e)
                        && clock.is_some_and(|c| self.surely_past(w.deadline, c, now)) =>
                {
                    // A duplicate of this registration would be refused at
                    // the gate under any estimate P may hold from now on:
                    // nothing to remember it for.
                    self.forget(e);
                    // Removal swaps the last member into position k.
                    continue;
                }
                _ => {}
            }
            if let Some(t) = closes.filter(|&t| now < t) {
                next = next.min(t);
            }
            if matches!(w.state, State::Ended(_)) && self.ends.contains(e) {
                // Forgettable once its PEND: is out (this step's drain).
                next = next.min(now.saturating_add(Duration::from_nanos(1)));
            }
            if let (State::Ended(_), Some(c)) = (w.state, clock) {
                // When it may be forgotten (the bound grows with the
                // sample's age, so this is an estimate; a later scan checks).
                if let (Some(local), Some(bound)) = (c.to_local(w.deadline), c.bound(now)) {
                    let t = local
                        .saturating_add(bound)
                        .saturating_add(Duration::from_nanos(1));
                    if now < t {
                        next = next.min(t);
                    }
                }
            }
            k += 1;
        }
        self.next_scan = next;
    }

    /// P's clock reading from which no WRITE may be posted under
    /// `deadline` (D's clock), as estimated at `now`: the deadline
    /// translated, less the estimate's error bound and the post margin.
    fn closes_at(&self, deadline: Instant, clock: &ClockOffset, now: Instant) -> Option<Instant> {
        let local = clock.to_local(deadline)?;
        let bound = clock.bound(now)?;
        let slack = duration_nanos(bound).saturating_add(duration_nanos(self.config.post_margin));
        Some(local.saturating_sub(Duration::from_nanos(slack)))
    }

    /// Whether `deadline` (D's clock) has passed on P's clock under every
    /// estimate consistent with this one: `now` is past the translated
    /// deadline plus the estimate's error bound. A gate closed only because
    /// the estimate is poor (wide, or about to be replaced by a tighter
    /// sample) is not enough to forget an ended registration: a better
    /// estimate could open it again for a duplicate of the registration.
    fn surely_past(&self, deadline: Instant, clock: &ClockOffset, now: Instant) -> bool {
        match (clock.to_local(deadline), clock.bound(now)) {
            (Some(local), Some(bound)) => now > local.saturating_add(bound),
            _ => false,
        }
    }

    fn gate_open(&self, deadline: Instant, clock: &ClockOffset, now: Instant) -> bool {
        self.closes_at(deadline, clock, now)
            .is_some_and(|t| now < t)
    }

    fn finish(&mut self, e: u32, code: EndCode) {
        let w = &mut self.writes[e as usize];
        debug_assert!(!matches!(w.state, State::Free | State::Ended(_)));
        w.state = State::Ended(code);
        self.alive.remove(e);
        self.ends.insert(e);
        match code {
            EndCode::Written => self.counters.written += 1,
            EndCode::Ended => self.counters.ended += 1,
            EndCode::Refused => {}
        }
    }

    fn forget(&mut self, e: u32) {
        let writes = &self.writes;
        let removed = self
            .index
            .remove(writes[e as usize].hash, e, |o| writes[o as usize].hash);
        debug_assert!(removed);
        self.writes[e as usize].state = State::Free;
        self.writes[e as usize].nonce = 0;
        self.live.remove(e);
        self.alive.remove(e);
        self.ends.remove(e);
        self.free.push(e);
    }

    fn get(&self, handle: WriteHandle) -> Option<Write> {
        self.writes
            .get(handle.entry as usize)
            .copied()
            .filter(|w| w.state != State::Free && w.nonce == handle.nonce.get())
    }

    fn find(&self, peer: u16, d_slot: u32, nonce: Nonce) -> Option<u32> {
        let k = key(peer, d_slot, nonce.get());
        let h = self.index.hash(&k);
        self.index.find(h, |e| {
            let w = &self.writes[e as usize];
            w.state != State::Free && key(w.peer, w.d_slot, w.nonce) == k
        })
    }
}
