//! [`LeaseVerifier`]: D's check, after its block READs, that P still held
//! the blocks for the whole READ.
//!
//! This module owns the slot READs and their verdicts. It does not post the
//! block READs, decide the KV-load failure policy, or send the read-done
//! notification (which must go out only after the verdict, carrying the
//! nonce): it is told "these block READs of request `token` have completed,
//! from these P ranks, under this (slot, nonce)" and answers "verified" or
//! not.
//!
//! # Why a matching nonce proves the READ was safe
//!
//! P writes the nonce into the slot before it exports it, zeroes the slot
//! before it reports the lease released (and so before the blocks can be
//! reused), and hands the slot to a new lease only after the blocks were
//! freed. The slot READ is posted only after every block READ completed. So
//! if the slot still holds our nonce, P had not released the lease when the
//! block READs finished, and the blocks held our KV throughout. No clock is
//! compared. This covers a READ that starts after the lease lapsed and a
//! lease that lapses mid-READ.
//!
//! # Batching
//!
//! Every check that is submitted before a step shares **one READ per remote
//! rank**: the verifier gathers, per P agent, the slots of all waiting checks
//! into one READ: a single descriptor over the span of their slots when it
//! is at most [`WINDOW_SLOTS`] slots (into the batch's window; the slot pool
//! hands out recently freed slots first, so live slots stay packed low),
//! else one descriptor of 8 bytes per check (into a landing cell per
//! (check, rank)). While an agent's READ is in flight, new checks for it wait
//! for the next one. A check resolves in the step after its submission when
//! the fabric completes the READ at once, else in a later step.
//!
//! # Layout
//!
//! ```text
//!  checks:  [Check; capacity]                    token, slot, nonce, up to 8 targets, pending mask
//!  landing: [AtomicU64; capacity * MAX_TARGETS]  cell c = check * MAX_TARGETS + k, registered
//!  windows: [AtomicU64; max_agents * WINDOW_SLOTS] one span window per live agent batch, registered
//!  next:    [u32; capacity * MAX_TARGETS]        intrusive lists of cells, per agent: queued, in flight
//!  agents:  [AgentBatch; max_agents]             agent, its slot region, its two lists, its READ
//! ```
//!
//! # Fail closed
//!
//! Every path that cannot prove the lease is a failed KV load: lease fields
//! missing ([`Verdict::Unverifiable`]), the slot READ failing or timing out
//! ([`Verdict::ReadFailed`]), a slot not holding the nonce
//! ([`Verdict::Lapsed`]). A verifier that is full refuses the check
//! ([`VerifyError::Full`]); the caller must then fail the load too.
//!
//! # Allocation
//!
//! All arrays are allocated in [`LeaseVerifier::new`]; submit and step
//! allocate nothing (the fabric's own READ path may; see its docs).

use core::fmt;

use crate::fabric::{AgentId, Fabric, FabricError, ReadDesc, RegionId, XferId, XferState};
use crate::nonce::Nonce;
use crate::slots::{LeaseSlots, SLOT_BYTES};
use crate::sync::{AtomicU64, Ordering};
use crate::time::Instant;

/// Most P ranks one check can cover (P TP / D TP up to 8).
pub const MAX_TARGETS: usize = 8;

/// Slots one coalesced READ covers: when the waiting checks of an agent lie
/// within this many consecutive slots, they are read as one descriptor.
pub const WINDOW_SLOTS: u32 = 1024;

const NIL: u32 = u32::MAX;

/// One P rank a request's blocks were read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerifyTarget {
    /// The P agent (rank) read from.
    pub agent: AgentId,
    /// That agent's lease-slot region ([`crate::fabric::PeerInfo::slot_region`]).
    pub slot_region: RegionId,
}

/// What the check found. Only [`Verdict::Verified`] may be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every slot still held the nonce: the pulled KV is the request's own.
    Verified,
    /// A slot no longer held the nonce: the lease lapsed before the READ
    /// finished. Fail the load (`kv_load_failure_policy`).
    Lapsed,
    /// The request carried no lease fields (a router dropped them, or P had
    /// no free slot). Fail the load.
    Unverifiable,
    /// The slot READ failed. Fail the load.
    ReadFailed(FabricError),
}

impl Verdict {
    /// True only for [`Verdict::Verified`].
    pub fn is_verified(self) -> bool {
        self == Verdict::Verified
    }

    /// When several ranks disagree, the worst verdict wins.
    fn worse(self, other: Verdict) -> Verdict {
        fn rank(v: Verdict) -> u8 {
            match v {
                Verdict::Verified => 0,
                Verdict::Unverifiable => 1,
                Verdict::ReadFailed(_) => 2,
                Verdict::Lapsed => 3,
            }
        }
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }
}

/// Why a check was refused. The caller must fail the KV load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyError {
    /// `capacity` checks are waiting.
    Full,
    /// No target, or more than [`MAX_TARGETS`].
    BadTargets,
    /// More distinct P agents than `max_agents` have checks waiting.
    TooManyAgents,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            VerifyError::Full => "lease verifier full",
            VerifyError::BadTargets => "a check needs 1 to 8 P ranks",
            VerifyError::TooManyAgents => "too many distinct P agents with checks waiting",
        })
    }
}

impl std::error::Error for VerifyError {}

/// Event counts since construction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerifierCounters {
    /// Checks accepted.
    pub submitted: u64,
    /// Checks refused (full, bad targets, too many agents).
    pub refused: u64,
    /// Verdicts: verified.
    pub verified: u64,
    /// Verdicts: lapsed.
    pub lapsed: u64,
    /// Verdicts: unverifiable.
    pub unverifiable: u64,
    /// Verdicts: slot READ failed.
    pub read_failed: u64,
    /// Slot READs posted (one per agent per batch).
    pub slot_reads: u64,
    /// Of those, READs of one contiguous span (one descriptor).
    pub coalesced_reads: u64,
}

#[derive(Clone, Copy, Debug)]
struct Check {
    token: u64,
    slot: u32,
    nonce: Nonce,
    /// Bit k set: target k not resolved yet.
    pending: u8,
    verdict: Verdict,
    in_use: bool,
}

#[derive(Clone, Copy, Debug)]
struct AgentBatch {
    agent: AgentId,
    slot_region: RegionId,
    queued: u32,
    inflight: u32,
    xfer: Option<XferId>,
    /// This batch's span window (index into `windows`).
    window: u32,
    /// The in-flight READ is one span starting at this slot (else one
    /// descriptor per cell).
    span_base: Option<u32>,
}

/// D's lease verifier. See the module docs.
#[derive(Debug)]
pub struct LeaseVerifier {
    checks: Box<[Check]>,
    free: Vec<u32>,
    /// Registered landing cells. Leaked on purpose: the fabric keeps the
    /// registration (and may write into it) until it is dropped, which may
    /// be after this verifier; a `'static` buffer can never dangle.
    landing: &'static [AtomicU64],
    landing_region: RegionId,
    /// One window of `WINDOW_SLOTS` words per live agent batch, for span
    /// READs; registered and leaked like `landing`.
    windows: &'static [AtomicU64],
    windows_region: RegionId,
    free_windows: Vec<u32>,
    next: Box<[u32]>,
    agents: Vec<AgentBatch>,
    max_agents: usize,
    descs: Vec<ReadDesc>,
    done: Vec<u32>,
    counters: VerifierCounters,
}

impl LeaseVerifier {
    /// A verifier for up to `capacity` waiting checks against up to
    /// `max_agents` distinct P agents, with its landing cells registered on
    /// `fabric`. Allocates `capacity * 8 * 8` bytes of landing cells and
    /// `max_agents * 8 KiB` of span windows once, for the life of the process.
    pub fn new<F: Fabric>(
        fabric: &mut F,
        capacity: u32,
        max_agents: u32,
    ) -> Result<LeaseVerifier, FabricError> {
        let cells = capacity as usize * MAX_TARGETS;
        let landing: &'static [AtomicU64] =
            Box::leak((0..cells.max(1)).map(|_| AtomicU64::new(0)).collect());
        // SAFETY: `landing` is 'static, so it outlives the registration. We
        // never hold a plain reference into it: every local access is an
        // atomic load or store, and cells are only read after the READ that
        // writes them has completed.
        let landing_region = unsafe {
            fabric.register_memory(landing.as_ptr() as *mut u8, landing.len() * SLOT_BYTES)?
        };
        let window_words = max_agents.max(1) as usize * WINDOW_SLOTS as usize;
        let windows: &'static [AtomicU64] =
            Box::leak((0..window_words).map(|_| AtomicU64::new(0)).collect());
        // SAFETY: as for `landing`.
        let windows_region = unsafe {
            fabric.register_memory(windows.as_ptr() as *mut u8, windows.len() * SLOT_BYTES)?
        };
        let placeholder = Check {
            token: 0,
            slot: 0,
            nonce: Nonce::ONE,
            pending: 0,
            verdict: Verdict::Verified,
            in_use: false,
        };
        Ok(LeaseVerifier {
            checks: vec![placeholder; capacity as usize].into_boxed_slice(),
            free: (0..capacity).rev().collect(),
            landing,
            landing_region,
            windows,
            windows_region,
            free_windows: (0..max_agents.max(1)).rev().collect(),
            next: vec![NIL; cells].into_boxed_slice(),
            agents: Vec::with_capacity(max_agents as usize),
            max_agents: max_agents as usize,
            descs: Vec::with_capacity(capacity as usize),
            done: Vec::with_capacity(capacity as usize),
            counters: VerifierCounters::default(),
        })
    }

    /// Event counts since construction.
    pub fn counters(&self) -> &VerifierCounters {
        &self.counters
    }

    /// Checks accepted and not yet reported.
    pub fn waiting(&self) -> usize {
        self.checks.len() - self.free.len()
    }

    /// Submits the check for request `token` (any caller value, returned with
    /// the verdict) once **all** its block READs completed. `lease` is the
    /// request's (`remote_lease_slot`, `remote_lease_nonce`), `None` when
    /// `kv_transfer_params` lacked them; `targets` are the P ranks read from.
    pub fn submit(
        &mut self,
        token: u64,
        lease: Option<(u32, Nonce)>,
        targets: &[VerifyTarget],
    ) -> Result<(), VerifyError> {
        let targets = if lease.is_some() { targets } else { &[] };
        if (lease.is_some() && targets.is_empty()) || targets.len() > MAX_TARGETS {
            self.counters.refused += 1;
            return Err(VerifyError::BadTargets);
        }
        // Every target's agent must have (or get) a batch; check before taking a check.
        let new_agents = targets
            .iter()
            .enumerate()
            .filter(|(i, t)| {
                self.batch_of(t.agent).is_none()
                    && !targets[..*i].iter().any(|u| u.agent == t.agent)
            })
            .count();
        if self.agents.len() + new_agents > self.max_agents {
            self.counters.refused += 1;
            return Err(VerifyError::TooManyAgents);
        }
        let Some(c) = self.free.pop() else {
            self.counters.refused += 1;
            return Err(VerifyError::Full);
        };
        self.counters.submitted += 1;
        let check = &mut self.checks[c as usize];
        *check = Check {
            token,
            slot: 0,
            nonce: Nonce::ONE,
            pending: 0,
            verdict: Verdict::Verified,
            in_use: true,
        };
        let Some((slot, nonce)) = lease else {
            check.verdict = Verdict::Unverifiable;
            self.done.push(c);
            return Ok(());
        };
        check.slot = slot;
        check.nonce = nonce;
        for (k, t) in targets.iter().enumerate() {
            self.checks[c as usize].pending |= 1 << k;
            let b = match self.batch_of(t.agent) {
                Some(b) => b,
                None => {
                    // submit() checked that the agent fits, and there is a
                    // window for every agent that fits.
                    let window = self.free_windows.pop().unwrap_or(0);
                    debug_assert!(self.agents.len() < self.max_agents);
                    self.agents.push(AgentBatch {
                        agent: t.agent,
                        slot_region: t.slot_region,
                        queued: NIL,
                        inflight: NIL,
                        xfer: None,
                        window,
                        span_base: None,
                    });
                    self.agents.len() - 1
                }
            };
            let cell = c * MAX_TARGETS as u32 + k as u32;
            self.next[cell as usize] = self.agents[b].queued;
            self.agents[b].queued = cell;
            self.agents[b].slot_region = t.slot_region;
        }
        Ok(())
    }

    /// Drives the slot READs: collects finished ones, posts one READ per
    /// agent with waiting checks, and reports every check whose verdict is
    /// known as `(token, verdict)`. Call once per D step.
    pub fn step<F: Fabric>(
        &mut self,
        fabric: &mut F,
        now: Instant,
        mut report: impl FnMut(u64, Verdict),
    ) {
        let mut b = 0;
        while b < self.agents.len() {
            if self.agents[b].xfer.is_some() {
                self.poll(fabric, b, now);
            }
            if self.agents[b].xfer.is_none() && self.agents[b].queued != NIL {
                self.post(fabric, b, now);
                // A fast READ (NIXL loopback: ~1 us) may be done already.
                if self.agents[b].xfer.is_some() {
                    self.poll(fabric, b, now);
                }
            }
            let a = self.agents[b];
            if a.xfer.is_none() && a.queued == NIL && a.inflight == NIL {
                // Nothing left for this agent: forget it (capacity is per live agent).
                self.free_windows.push(a.window);
                self.agents.swap_remove(b);
            } else {
                b += 1;
            }
        }
        for c in self.done.drain(..) {
            let check = &mut self.checks[c as usize];
            debug_assert!(check.in_use && check.pending == 0);
            check.in_use = false;
            match check.verdict {
                Verdict::Verified => self.counters.verified += 1,
                Verdict::Lapsed => self.counters.lapsed += 1,
                Verdict::Unverifiable => self.counters.unverifiable += 1,
                Verdict::ReadFailed(_) => self.counters.read_failed += 1,
            }
            report(check.token, check.verdict);
            self.free.push(c);
        }
    }

    fn poll<F: Fabric>(&mut self, fabric: &mut F, b: usize, now: Instant) {
        if let Some(x) = self.agents[b].xfer {
            match fabric.read_state(x, now) {
                XferState::InProgress => {}
                XferState::Done => self.resolve_inflight(b, None),
                XferState::Failed(e) => self.resolve_inflight(b, Some(e)),
            }
        }
    }

    fn batch_of(&self, agent: AgentId) -> Option<usize> {
        self.agents.iter().position(|a| a.agent == agent)
    }

    /// Posts one READ for every queued cell of agent batch `b`: a single
    /// descriptor over the span of their slots when it fits the batch's
    /// window, else one 8-byte descriptor per cell. (Per-descriptor cost is
    /// what matters on real fabrics: UCX over shared memory makes one system
    /// call per descriptor, 64 of them cost 40x one 512-byte span.)
    fn post<F: Fabric>(&mut self, fabric: &mut F, b: usize, now: Instant) {
        let batch = self.agents[b];
        let (mut lo, mut hi) = (u32::MAX, 0u32);
        let mut cell = batch.queued;
        while cell != NIL {
            let slot = self.checks[(cell / MAX_TARGETS as u32) as usize].slot;
            lo = lo.min(slot);
            hi = hi.max(slot);
            cell = self.next[cell as usize];
        }
        self.descs.clear();
        let span = hi.saturating_sub(lo).saturating_add(1);
        if span <= WINDOW_SLOTS {
            let base = batch.window as usize * WINDOW_SLOTS as usize;
            // Zero first: a fabric that reports Done without writing must
            // not leave an earlier check's nonce to be compared.
            for w in &self.windows[base..base + span as usize] {
                w.store(0, Ordering::Relaxed);
            }
            self.descs.push(ReadDesc {
                local: self.windows_region,
                local_offset: (base * SLOT_BYTES) as u64,
                remote: batch.slot_region,
                remote_offset: LeaseSlots::offset_of(lo),
                len: u64::from(span) * SLOT_BYTES as u64,
            });
            self.agents[b].span_base = Some(lo);
        } else {
            let mut cell = batch.queued;
            while cell != NIL {
                let check = &self.checks[(cell / MAX_TARGETS as u32) as usize];
                self.landing[cell as usize].store(0, Ordering::Relaxed);
                self.descs.push(ReadDesc {
                    local: self.landing_region,
                    local_offset: u64::from(cell) * SLOT_BYTES as u64,
                    remote: batch.slot_region,
                    remote_offset: LeaseSlots::offset_of(check.slot),
                    len: SLOT_BYTES as u64,
                });
                cell = self.next[cell as usize];
            }
            self.agents[b].span_base = None;
        }
        // The queued list becomes the in-flight list, READ or not.
        self.agents[b].inflight = batch.queued;
        self.agents[b].queued = NIL;
        match fabric.post_read(batch.agent, &self.descs, None, now) {
            Ok(x) => {
                self.agents[b].xfer = Some(x);
                self.counters.slot_reads += 1;
                self.counters.coalesced_reads += u64::from(self.agents[b].span_base.is_some());
            }
            Err(e) => self.resolve_inflight(b, Some(e)),
        }
    }

    /// The word a completed READ left for `cell` of batch `b`.
    fn landed(&self, b: usize, cell: u32, slot: u32) -> u64 {
        let word = match self.agents[b].span_base {
            Some(lo) => {
                let base = self.agents[b].window as usize * WINDOW_SLOTS as usize;
                &self.windows[base + (slot - lo) as usize]
            }
            None => &self.landing[cell as usize],
        };
        u64::from_le(word.load(Ordering::Acquire))
    }

    /// Resolves every in-flight cell of batch `b`: by comparing its landing
    /// word with the nonce, or as failed with `error`.
    fn resolve_inflight(&mut self, b: usize, error: Option<FabricError>) {
        let mut cell = self.agents[b].inflight;
        self.agents[b].inflight = NIL;
        self.agents[b].xfer = None;
        while cell != NIL {
            let next = self.next[cell as usize];
            let c = cell / MAX_TARGETS as u32;
            let k = cell % MAX_TARGETS as u32;
            let (slot, nonce) = (self.checks[c as usize].slot, self.checks[c as usize].nonce);
            let verdict = match error {
                Some(e) => Verdict::ReadFailed(e),
                None if self.landed(b, cell, slot) == nonce.get() => Verdict::Verified,
                None => Verdict::Lapsed,
            };
            let check = &mut self.checks[c as usize];
            check.verdict = check.verdict.worse(verdict);
            check.pending &= !(1 << k);
            if check.pending == 0 {
                self.done.push(c);
            }
            cell = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::{HandshakeState, PeerInfo};
    use std::sync::Arc;

    /// A fabric whose remote agents are slot arrays in this process. READs
    /// complete when the test says so, copying the remote words at that
    /// moment (so a slot changed while a READ is "in flight" is observed).
    struct FakeFabric {
        remotes: Vec<Arc<LeaseSlots>>,
        /// Registered local regions, by RegionId (0 is a placeholder).
        regions: Vec<(*mut u8, usize)>,
        reads: Vec<(AgentId, Vec<ReadDesc>, bool)>,
        complete: bool,
        fail_next: Option<FabricError>,
    }

    impl FakeFabric {
        fn new(agents: usize, slots: u32) -> FakeFabric {
            FakeFabric {
                remotes: (0..agents)
                    .map(|_| Arc::new(LeaseSlots::new(slots)))
                    .collect(),
                regions: vec![(std::ptr::null_mut(), 0)],
                reads: Vec::new(),
                complete: true,
                fail_next: None,
            }
        }
    }

    impl Fabric for FakeFabric {
        fn name(&self) -> &str {
            "fake"
        }
        fn register_slots(&mut self, _: Arc<LeaseSlots>, _: bool) -> Result<RegionId, FabricError> {
            Ok(RegionId(0))
        }
        unsafe fn register_memory(
            &mut self,
            ptr: *mut u8,
            len: usize,
        ) -> Result<RegionId, FabricError> {
            self.regions.push((ptr, len));
            Ok(RegionId(self.regions.len() as u32 - 1))
        }
        fn max_notification_len(&self) -> usize {
            4096
        }
        fn start_handshake(&mut self, _: &str, _: Instant) -> Result<AgentId, FabricError> {
            Ok(AgentId(0))
        }
        fn handshake_state(&mut self, _: AgentId, _: Instant) -> HandshakeState {
            HandshakeState::Ready(PeerInfo {
                slot_region: Some(RegionId(0)),
                slot_count: 0,
                compact_heartbeats: false,
                clock: None,
            })
        }
        fn send_notification(&mut self, _: AgentId, _: &[u8]) -> Result<(), FabricError> {
            Ok(())
        }
        fn drain_notifications(
            &mut self,
            _: &mut dyn FnMut(&str, &[u8]),
        ) -> Result<usize, FabricError> {
            Ok(0)
        }
        fn post_read(
            &mut self,
            from: AgentId,
            descs: &[ReadDesc],
            _: Option<&[u8]>,
            _: Instant,
        ) -> Result<XferId, FabricError> {
            if let Some(e) = self.fail_next.take() {
                return Err(e);
            }
            self.reads.push((from, descs.to_vec(), false));
            Ok(XferId(self.reads.len() as u64 - 1))
        }
        fn read_state(&mut self, xfer: XferId, _: Instant) -> XferState {
            if !self.complete {
                return XferState::InProgress;
            }
            let Some((agent, descs, finished)) = self.reads.get_mut(xfer.0 as usize) else {
                return XferState::Failed(FabricError::UnknownXfer);
            };
            if !*finished {
                *finished = true;
                for d in descs.iter() {
                    for w in 0..d.len / 8 {
                        let slot = (d.remote_offset / 8 + w) as u32;
                        let word = self.remotes[agent.0 as usize].load(slot).unwrap_or(0);
                        let at = (d.local_offset + 8 * w) as usize;
                        let (ptr, len) = self.regions[d.local.0 as usize];
                        assert!(at + 8 <= len);
                        // SAFETY: inside the registered region (checked above); the
                        // verifier does not read it until we report Done.
                        unsafe { ptr.add(at).cast::<u64>().write_unaligned(word.to_le()) };
                    }
                }
            }
            XferState::Done
        }
        fn cancel_read(&mut self, _: XferId) {}
    }

    fn target(agent: u32) -> VerifyTarget {
        VerifyTarget {
            agent: AgentId(agent),
            slot_region: RegionId(0),
        }
    }

    fn n(x: u64) -> Nonce {
        Nonce::new(x).unwrap()
    }

    fn run(v: &mut LeaseVerifier, f: &mut FakeFabric) -> Vec<(u64, Verdict)> {
        let mut out = Vec::new();
        v.step(f, Instant::ZERO, |t, verdict| out.push((t, verdict)));
        out.sort_by_key(|x| x.0);
        out
    }

    #[test]
    fn matching_nonce_verifies_and_changed_slot_lapses() {
        let mut f = FakeFabric::new(1, 8);
        f.remotes[0].publish(3, 77);
        f.remotes[0].publish(4, 88);
        let mut v = LeaseVerifier::new(&mut f, 4, 4).unwrap();
        v.submit(1, Some((3, n(77))), &[target(0)]).unwrap();
        v.submit(2, Some((4, n(88))), &[target(0)]).unwrap();
        f.complete = false;
        assert!(run(&mut v, &mut f).is_empty(), "READ still in flight");
        // The lease of token 2 lapses while the slot READ is in flight.
        f.remotes[0].clear(4);
        f.remotes[0].publish(4, 99);
        f.complete = true;
        assert_eq!(
            run(&mut v, &mut f),
            [(1, Verdict::Verified), (2, Verdict::Lapsed)]
        );
        assert_eq!(f.reads.len(), 1, "both checks shared one READ");
        assert_eq!(v.waiting(), 0);
        assert_eq!(
            (
                v.counters().verified,
                v.counters().lapsed,
                v.counters().slot_reads
            ),
            (1, 1, 1)
        );
    }

    #[test]
    fn every_rank_must_hold_the_nonce() {
        let mut f = FakeFabric::new(3, 4);
        for r in 0..3 {
            f.remotes[r].publish(1, 5);
        }
        f.remotes[2].clear(1);
        let mut v = LeaseVerifier::new(&mut f, 4, 4).unwrap();
        v.submit(7, Some((1, n(5))), &[target(0), target(1), target(2)])
            .unwrap();
        v.submit(8, Some((1, n(5))), &[target(0), target(1)])
            .unwrap();
        assert_eq!(
            run(&mut v, &mut f),
            [(7, Verdict::Lapsed), (8, Verdict::Verified)]
        );
        assert_eq!(f.reads.len(), 3, "one READ per remote rank");
    }

    #[test]
    fn missing_fields_and_failed_reads_fail_closed() {
        let mut f = FakeFabric::new(1, 4);
        f.remotes[0].publish(0, 5);
        let mut v = LeaseVerifier::new(&mut f, 4, 4).unwrap();
        v.submit(1, None, &[]).unwrap();
        v.submit(2, Some((0, n(5))), &[target(0)]).unwrap();
        f.fail_next = Some(FabricError::PeerUnreachable);
        assert_eq!(
            run(&mut v, &mut f),
            [
                (1, Verdict::Unverifiable),
                (2, Verdict::ReadFailed(FabricError::PeerUnreachable))
            ]
        );
        // Out-of-range slot: the remote word reads as 0, never as the nonce.
        v.submit(3, Some((1000, n(5))), &[target(0)]).unwrap();
        assert_eq!(run(&mut v, &mut f), [(3, Verdict::Lapsed)]);
    }

    #[test]
    fn packed_slots_are_read_as_one_span_and_scattered_ones_per_slot() {
        let mut f = FakeFabric::new(1, 6000);
        for (slot, nonce) in [(0, 10), (7, 17), (5000, 50)] {
            f.remotes[0].publish(slot, nonce);
        }
        let mut v = LeaseVerifier::new(&mut f, 8, 2).unwrap();
        // Slots 0 and 7: one 64-byte descriptor.
        v.submit(1, Some((0, n(10))), &[target(0)]).unwrap();
        v.submit(2, Some((7, n(17))), &[target(0)]).unwrap();
        assert_eq!(
            run(&mut v, &mut f),
            [(1, Verdict::Verified), (2, Verdict::Verified)]
        );
        assert_eq!(f.reads[0].1.len(), 1);
        assert_eq!(f.reads[0].1[0].len, 64);
        // Slots 0 and 5000 are further apart than a window: two 8-byte descriptors.
        v.submit(3, Some((0, n(10))), &[target(0)]).unwrap();
        v.submit(4, Some((5000, n(51))), &[target(0)]).unwrap();
        assert_eq!(
            run(&mut v, &mut f),
            [(3, Verdict::Verified), (4, Verdict::Lapsed)]
        );
        assert_eq!(f.reads[1].1.len(), 2);
        assert_eq!(
            (v.counters().slot_reads, v.counters().coalesced_reads),
            (2, 1)
        );
    }

    #[test]
    fn refusals_are_typed() {
        let mut f = FakeFabric::new(3, 4);
        let mut v = LeaseVerifier::new(&mut f, 2, 2).unwrap();
        assert_eq!(
            v.submit(1, Some((0, n(1))), &[]),
            Err(VerifyError::BadTargets)
        );
        assert_eq!(
            v.submit(1, Some((0, n(1))), &[target(0); 9]),
            Err(VerifyError::BadTargets)
        );
        assert_eq!(
            v.submit(1, Some((0, n(1))), &[target(0), target(1), target(2)]),
            Err(VerifyError::TooManyAgents)
        );
        v.submit(1, Some((0, n(1))), &[target(0)]).unwrap();
        v.submit(2, Some((0, n(1))), &[target(1)]).unwrap();
        assert_eq!(
            v.submit(3, Some((0, n(1))), &[target(0)]),
            Err(VerifyError::Full)
        );
        assert_eq!(v.counters().refused, 4);
        assert_eq!(run(&mut v, &mut f).len(), 2);
        // Agents with nothing waiting are forgotten, so new ones fit.
        v.submit(4, Some((0, n(1))), &[target(2)]).unwrap();
    }
}
