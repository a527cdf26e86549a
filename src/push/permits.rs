//! [`PushPermits`]: D's side of the push guard, the write permits D granted
//! P over blocks it registered.
//!
//! This module owns, for every registration D sent, the permit's state, its
//! deadline on D's clock, and the moment D may free the blocks without
//! hearing from P (the fence). It sends nothing itself (messages go to the
//! caller's `emit`), reads no clock, and never frees a block: it tells the
//! engine when a permit ended and how ([`PermitEnd`]), and the engine frees
//! or uses the blocks then.
//!
//! # Layout
//!
//! ```text
//!  permits: [Permit; capacity]    the entry index is the permit's slot
//!  free:    FreeStack             slots with no permit
//!  live:    DenseSet              Open or Revoking: the only ones a due scan visits
//!  renews:  DenseSet              owe P a PRN: this step
//!  revokes: DenseSet              owe P a PRV: this step (resent every interval)
//!  next_due                       no fence falls before it: a quiet poll is one compare
//! ```

use core::time::Duration;

use super::wire::{self, EndCode, PeerMessages, PermitFields, PushMessage, PushWireError};
use super::{PushConfig, PushError};
use crate::collections::{DenseSet, FreeStack};
use crate::nonce::{Nonce, NonceSource};
use crate::time::{duration_nanos, Instant};

/// How a permit ended; from then on the blocks are the engine's again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PushEnd {
    /// P's WRITE landed (`PEND:` `W`): the KV load succeeded.
    Written,
    /// P refused the registration (`R`): a failed load. P has no WRITE of
    /// it in flight and will post none. (Usually P never posted; a duplicate
    /// registration reaching P after P wrote, lost its `W` and forgot it is
    /// refused too: the data landed, but D treats the load as failed, which
    /// costs a recompute, never a wrong answer.)
    Refused,
    /// P ended the permit without a complete WRITE (`X`): a failed load.
    EndedByP,
    /// No word from P until the fence (P dead, slow or cut off): a failed
    /// load. No WRITE of P can land any more.
    Lapsed,
    /// D revoked it ([`PushPermits::revoke`]: an abort, a preemption, D's
    /// own watchdog) and P answered, or the fence passed: free the blocks.
    Revoked,
}

impl PushEnd {
    /// Whether the blocks hold P's KV (the load succeeded).
    pub fn loaded(self) -> bool {
        self == PushEnd::Written
    }
}

/// One ended permit, reported once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PermitEnd {
    /// The permit's slot (free again after this report).
    pub slot: u32,
    /// The permit's nonce.
    pub nonce: Nonce,
    /// The P peer it was granted to.
    pub peer: u16,
    /// How it ended.
    pub end: PushEnd,
}

/// What D's permits did, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PermitCounters {
    /// Permits granted ([`PushPermits::register`]).
    pub registered: u64,
    /// Registrations refused for want of a free permit (a failed load).
    pub exhausted: u64,
    /// Renewals on P's `PHB:`.
    pub renewed: u64,
    /// Permits revoked by D.
    pub revoked: u64,
    /// Ended by P's `W`.
    pub written: u64,
    /// Ended by P's `R`.
    pub refused: u64,
    /// Ended by P's `X`.
    pub ended_by_p: u64,
    /// Ended at the fence without P's word.
    pub lapsed: u64,
    /// Revoked permits ended (by P's answer or at the fence).
    pub revoke_ended: u64,
    /// Records naming no live permit (stale nonce, duplicate, unknown slot).
    pub stale_records: u64,
    /// Messages that did not decode (nothing changed).
    pub malformed: u64,
    /// `PRN:`/`PRV:` messages handed to `emit`.
    pub messages_sent: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Open,
    Revoking,
}

#[derive(Clone, Copy, Debug)]
struct Permit {
    state: State,
    peer: u16,
    nonce: u64,
    /// The latest deadline D told P (or registered): P posts no WRITE after it.
    deadline: Instant,
}

/// D's write permits. See the module docs and [`crate::push`].
#[derive(Debug)]
pub struct PushPermits {
    config: PushConfig,
    nonces: NonceSource,
    permits: Box<[Permit]>,
    free: FreeStack,
    live: DenseSet,
    renews: DenseSet,
    revokes: DenseSet,
    next_due: Instant,
    next_resend: Instant,
    scratch: Box<[u8]>,
    counters: PermitCounters,
}

impl PushPermits {
    /// Room for `config.capacity` permits at once; allocates everything now.
    pub fn new(config: PushConfig, nonces: NonceSource) -> Result<PushPermits, PushError> {
        config.validate()?;
        let n = config.capacity;
        Ok(PushPermits {
            nonces,
            permits: vec![
                Permit {
                    state: State::Free,
                    peer: 0,
                    nonce: 0,
                    deadline: Instant::ZERO,
                };
                n as usize
            ]
            .into_boxed_slice(),
            free: FreeStack::full(n),
            live: DenseSet::new(n),
            renews: DenseSet::new(n),
            revokes: DenseSet::new(n),
            next_due: Instant::MAX,
            next_resend: Instant::ZERO,
            scratch: vec![0u8; config.max_message_len].into_boxed_slice(),
            counters: PermitCounters::default(),
            config,
        })
    }

    /// The settings.
    pub fn config(&self) -> &PushConfig {
        &self.config
    }

    /// What it did so far.
    pub fn counters(&self) -> PermitCounters {
        self.counters
    }

    /// Permits not yet ended.
    pub fn live(&self) -> u32 {
        self.live.len()
    }

    /// The P peers that live permits name, one item per permit (a peer
    /// may repeat). A peer named by none may be forgotten and its id given
    /// to another P engine: no message of the old one can end a permit of
    /// the new one. O(live permits), no allocation; for the rare path that
    /// makes room in a full peer table, never a step.
    pub fn peers_in_use(&self) -> impl Iterator<Item = u16> + '_ {
        (0..self.live.len()).filter_map(move |k| {
            let slot = self.live.get(k)?;
            Some(self.permits[slot as usize].peer)
        })
    }

    /// The deadline D last told P for a live permit (for metrics and
    /// checks); `None` once it ended.
    pub fn deadline(&self, slot: u32, nonce: Nonce) -> Option<Instant> {
        self.permits
            .get(slot as usize)
            .filter(|p| p.state != State::Free && p.nonce == nonce.get())
            .map(|p| p.deadline)
    }

    /// A permit for blocks D is about to register with P peer `peer`: the
    /// fields go into the registration. `Exhausted` when every permit is in
    /// use: the push cannot be guarded, so the caller fails the load
    /// (`kv_load_failure_policy`) and never registers the blocks.
    pub fn register(&mut self, peer: u16, now: Instant) -> Result<PermitFields, PushError> {
        let Some(slot) = self.free.pop() else {
            self.counters.exhausted += 1;
            return Err(PushError::Exhausted);
        };
        let nonce = self.nonces.next_nonce();
        let deadline = now.saturating_add(self.config.duration);
        let p = &mut self.permits[slot as usize];
        debug_assert_eq!(p.state, State::Free);
        *p = Permit {
            state: State::Open,
            peer,
            nonce: nonce.get(),
            deadline,
        };
        self.live.insert(slot);
        self.note_fence(deadline);
        self.counters.registered += 1;
        Ok(PermitFields {
            slot,
            nonce,
            deadline,
        })
    }

    /// D gives up on a registered push (abort, preemption, D's watchdog):
    /// P is told to stop (`PRV:`, resent every heartbeat interval), and the
    /// permit ends — the blocks may be freed — when P answers or at the
    /// fence, never before. Revoking a revoked permit is a no-op;
    /// `UnknownPermit` for one that ended or never existed.
    pub fn revoke(&mut self, slot: u32, nonce: Nonce) -> Result<(), PushError> {
        let Some(p) = self.find_mut(slot, nonce) else {
            return Err(PushError::UnknownPermit);
        };
        if p.state == State::Open {
            p.state = State::Revoking;
            self.renews.remove(slot);
            self.revokes.insert(slot);
            self.counters.revoked += 1;
        }
        Ok(())
    }

    /// A notification from P peer `peer`: `PHB:` renews the permits it names
    /// (P is alive and holds them), `PEND:` ends them. Records that name no
    /// live permit of that peer are counted and ignored; a message that does
    /// not decode changes nothing and returns its error.
    pub fn on_message(
        &mut self,
        peer: u16,
        msg: &[u8],
        now: Instant,
        mut on_end: impl FnMut(PermitEnd),
    ) -> Result<(), PushWireError> {
        let decoded = match wire::decode(msg) {
            Ok(m) => m,
            Err(e) => {
                self.counters.malformed += 1;
                return Err(e);
            }
        };
        match decoded {
            PushMessage::Alive(records) => {
                for (slot, nonce) in records {
                    self.on_alive(peer, slot, nonce, now);
                }
            }
            PushMessage::End(records) => {
                for (slot, nonce, code) in records {
                    self.on_end(peer, slot, nonce, code, &mut on_end);
                }
            }
            // D's own forms coming back: nothing for D to do.
            PushMessage::Renew(r) => self.counters.stale_records += r.len() as u64,
            PushMessage::Revoke(r) => self.counters.stale_records += r.len() as u64,
        }
        Ok(())
    }

    fn on_alive(&mut self, peer: u16, slot: u32, nonce: Nonce, now: Instant) {
        let extension = self.config.extension;
        let Some(p) = self.find_peer_mut(peer, slot, nonce) else {
            self.counters.stale_records += 1;
            return;
        };
        if p.state != State::Open {
            // A revoked permit is never extended: its fence stays put.
            return;
        }
        let wanted = now.saturating_add(extension);
        if wanted > p.deadline {
            p.deadline = wanted;
            self.renews.insert(slot);
        }
        self.counters.renewed += 1;
        // The fence only moved later: next_due stays a lower bound.
    }

    fn on_end(
        &mut self,
        peer: u16,
        slot: u32,
        nonce: Nonce,
        code: EndCode,
        on_end: &mut impl FnMut(PermitEnd),
    ) {
        let Some(p) = self.find_peer_mut(peer, slot, nonce) else {
            self.counters.stale_records += 1;
            return;
        };
        let end = match (p.state, code) {
            (State::Revoking, _) => PushEnd::Revoked,
            (_, EndCode::Written) => PushEnd::Written,
            (_, EndCode::Refused) => PushEnd::Refused,
            (_, EndCode::Ended) => PushEnd::EndedByP,
        };
        self.end(slot, end, on_end);
    }

    /// Once per step: ends the permits whose fence passed, and hands `emit`
    /// the `PRN:` and `PRV:` messages owed, per P peer.
    pub fn poll(
        &mut self,
        now: Instant,
        mut emit: impl FnMut(u16, &[u8]),
        mut on_end: impl FnMut(PermitEnd),
    ) {
        if now >= self.next_due {
            self.end_fenced(now, &mut on_end);
        }
        if now >= self.next_resend {
            // Lost PRV: are resent every interval while P has not answered.
            self.next_resend = now.saturating_add(self.config.heartbeat_interval);
            let mut k = 0;
            while let Some(slot) = self.live.get(k) {
                if self.permits[slot as usize].state == State::Revoking {
                    self.revokes.insert(slot);
                }
                k += 1;
            }
        }
        self.send_owed(&mut emit);
    }

    fn end_fenced(&mut self, now: Instant, on_end: &mut impl FnMut(PermitEnd)) {
        let mut next = Instant::MAX;
        let mut k = 0;
        while let Some(slot) = self.live.get(k) {
            let p = self.permits[slot as usize];
            let fence = self.fence(p.deadline);
            if now >= fence {
                let end = if p.state == State::Revoking {
                    PushEnd::Revoked
                } else {
                    PushEnd::Lapsed
                };
                // Removal swaps the last member into position k: visit k again.
                self.end(slot, end, on_end);
                continue;
            }
            next = next.min(fence);
            k += 1;
        }
        self.next_due = next;
    }

    fn send_owed(&mut self, emit: &mut impl FnMut(u16, &[u8])) {
        let mut sent = 0u64;
        let mut out = |peer: u16, m: &[u8]| {
            sent += 1;
            emit(peer, m)
        };
        for (set, renew) in [(&mut self.renews, true), (&mut self.revokes, false)] {
            let prefix = if renew {
                wire::RENEW_PREFIX
            } else {
                wire::REVOKE_PREFIX
            };
            let mut w = PeerMessages::new(&mut self.scratch, prefix);
            while let Some(slot) = set.get(0) {
                set.remove(slot);
                let p = self.permits[slot as usize];
                let Some(nonce) = Nonce::new(p.nonce) else {
                    continue;
                };
                // The scratch holds at least one record (PushConfig::validate).
                let _ = if renew {
                    let f = PermitFields {
                        slot,
                        nonce,
                        deadline: p.deadline,
                    };
                    w.renew(p.peer, f, &mut out)
                } else {
                    w.permit(p.peer, slot, nonce, &mut out)
                };
            }
            w.finish(&mut out);
        }
        self.counters.messages_sent += sent;
    }

    /// D's clock reading after which no WRITE of P under a permit with this
    /// deadline can land: P posts before the deadline (its gate is
    /// conservative by the offset estimate's bound), and a posted WRITE
    /// lands within `write_bound`, which D's clock measures to within
    /// `drift_ppm`.
    pub fn fence(&self, deadline: Instant) -> Instant {
        let w = duration_nanos(self.config.write_bound);
        let drift = w
            .saturating_mul(u64::from(self.config.drift_ppm))
            .div_ceil(1_000_000);
        deadline.saturating_add(Duration::from_nanos(w.saturating_add(drift)))
    }

    fn note_fence(&mut self, deadline: Instant) {
        let fence = self.fence(deadline);
        self.next_due = self.next_due.min(fence);
    }

    fn end(&mut self, slot: u32, end: PushEnd, on_end: &mut impl FnMut(PermitEnd)) {
        let p = &mut self.permits[slot as usize];
        let Some(nonce) = Nonce::new(p.nonce) else {
            return;
        };
        let report = PermitEnd {
            slot,
            nonce,
            peer: p.peer,
            end,
        };
        p.state = State::Free;
        p.nonce = 0;
        self.live.remove(slot);
        self.renews.remove(slot);
        self.revokes.remove(slot);
        self.free.push(slot);
        let c = &mut self.counters;
        match end {
            PushEnd::Written => c.written += 1,
            PushEnd::Refused => c.refused += 1,
            PushEnd::EndedByP => c.ended_by_p += 1,
            PushEnd::Lapsed => c.lapsed += 1,
            PushEnd::Revoked => c.revoke_ended += 1,
        }
        on_end(report);
    }

    fn find_mut(&mut self, slot: u32, nonce: Nonce) -> Option<&mut Permit> {
        self.permits
            .get_mut(slot as usize)
            .filter(|p| p.state != State::Free && p.nonce == nonce.get())
    }

    fn find_peer_mut(&mut self, peer: u16, slot: u32, nonce: Nonce) -> Option<&mut Permit> {
        self.find_mut(slot, nonce).filter(|p| p.peer == peer)
    }
}
