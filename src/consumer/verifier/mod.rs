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
//! into one READ: when they all lie in one aligned window of [`WINDOW_SLOTS`]
//! slots of the remote array, a single descriptor over **that whole window**
//! (clipped to the agent's slot count) into the batch's local window; else
//! one descriptor of 8 bytes per check (into a landing cell per (check,
//! rank)). The slot pool hands out recently freed slots first, so live slots
//! stay packed low, usually in window 0. While an agent's READ is in flight,
//! new checks for it wait for the next one. A check resolves in the step
//! after its submission when the fabric completes the READ at once, else in
//! a later step.
//!
//! Why the whole window, not just the span of the slots: the descriptor
//! then depends only on (agent, window), never on which slots a batch
//! happens to check, and an agent batch keeps its local window for the
//! verifier's life (an idle batch is taken over by a new agent only when
//! all `max_agents` are in use). A fabric with prepared requests re-posts
//! the same one every step: over NIXL, `create_xfer_req` (which allocates)
//! runs once per (agent, window), and a steady verifier allocates nothing
//! (`tests/nixl_verifier_alloc.rs`). Reading 8 KiB instead of a few words
//! costs little on a local fabric; one descriptor instead of one per slot is
//! what matters (UCX over shared memory makes a system call per descriptor).
//!
//! # One bad slot fails one check
//!
//! A READ is refused as a whole when one of its descriptors lies outside the
//! remote region, so a `remote_lease_slot` beyond what the P rank exports
//! (a router that mangled `kv_transfer_params`, a P with fewer slots than
//! the slot claims) would fail every check batched with it. The verifier
//! therefore checks each slot against the rank's advertised slot count
//! ([`VerifyTarget::slot_count`], from [`PeerInfo::slot_count`]) before
//! batching: a slot out of range resolves its own check as
//! [`Verdict::SlotOutOfRange`] at the next step, without a READ, and the
//! others are read as usual.
//!
//! # Layout
//!
//! `F` is `kv_lease_max_fan_out` ([`VerifierConfig::max_fan_out`], at most
//! [`MAX_TARGETS`]): the most P ranks one check covers, the same number the
//! heartbeat sender is sized by.
//!
//! ```text
//!  checks:  [Check; capacity]                      token, slot, nonce, pending mask (one bit per target)
//!  landing: LandingWords(capacity * F)             cell c = check * F + k, registered
//!  windows: LandingWords(max_agents * WINDOW_SLOTS) one window per agent batch, for its life, registered
//!  next:    [u32; capacity * F]                    intrusive lists of cells, per agent: queued, in flight
//!  agents:  [AgentBatch; max_agents]               agent, its slot region, its two lists, its READ
//! ```
//!
//! # Verification off
//!
//! With `kv_lease_verification = false` ([`VerifierConfig::verification`])
//! no slot is read: every submitted check resolves at the next step as
//! [`Verdict::Unchecked`], which the tracker accepts as received, through
//! the same outcome path as a verified load, and counts
//! ([`VerifierCounters::unchecked`], the tracker's `loads_unverified`). That
//! is stock vLLM's behaviour, made visible.
//!
//! The two registered buffers are [`LandingWords`] behind an [`Arc`] shared
//! with the fabric ([`Fabric::register_landing`]): the fabric's share keeps
//! them allocated as long as its registration lasts, so dropping the
//! verifier first is fine, and nothing is leaked for the life of the process
//! (with the loopback and NIXL fabrics; a fabric that does not override
//! `register_landing` leaks its share, which is sound).
//!
//! # Fail closed
//!
//! Every path that cannot prove the lease is a failed KV load: lease fields
//! missing ([`Verdict::Unverifiable`]), a slot the P rank does not have
//! ([`Verdict::SlotOutOfRange`]), the slot READ failing or timing out
//! ([`Verdict::ReadFailed`]), a slot not holding the nonce
//! ([`Verdict::Lapsed`]). A verifier that is full refuses the check
//! ([`VerifyError::Full`]); the caller must then fail the load too.
//!
//! # Allocation
//!
//! All arrays are allocated in [`LeaseVerifier::new`]; submit and step
//! allocate nothing (the fabric's own READ path may; see its docs).

use std::sync::Arc;

use crate::collections::{FreeStack, Ring};
use crate::config::LeaseConfig;
use crate::fabric::{
    AgentId, Fabric, FabricError, LandingWords, PeerInfo, ReadDesc, RegionId, XferId, XferState,
};
use crate::lease_fields::LeaseFields;
use crate::nonce::Nonce;
use crate::slots::{LeaseSlots, SLOT_BYTES};
use crate::time::Instant;

/// Most P ranks one check can cover, whatever the configuration: the
/// pending ranks of a check are one `u64` mask ([`crate::config::limits::MAX_FAN_OUT`]).
pub const MAX_TARGETS: usize = crate::config::limits::MAX_FAN_OUT as usize;

/// How a verifier is sized, and whether it verifies at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifierConfig {
    /// Checks waiting at once (submitted, not yet reported).
    pub capacity: u32,
    /// Distinct P agents with checks waiting at once.
    pub max_agents: u32,
    /// Most P ranks one check covers (`kv_lease_max_fan_out`), at most
    /// [`MAX_TARGETS`].
    pub max_fan_out: u32,
    /// `kv_lease_verification`: read and compare the slots; `false` accepts
    /// every load as [`Verdict::Unchecked`] without a READ.
    pub verification: bool,
}

impl VerifierConfig {
    /// A verifier for `capacity` waiting checks against up to `max_agents` P
    /// agents, with the fan-out limit and the verification switch of
    /// `config` (`kv_lease_max_fan_out`, `kv_lease_verification`).
    pub fn new(config: &LeaseConfig, capacity: u32, max_agents: u32) -> VerifierConfig {
        VerifierConfig {
            capacity,
            max_agents,
            max_fan_out: config.max_fan_out,
            verification: config.verification,
        }
    }
}

/// Slots one coalesced READ covers: when the waiting checks of an agent lie
/// within this many consecutive slots, they are read as one descriptor.
pub const WINDOW_SLOTS: u32 = 1024;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Check {
    token: u64,
    slot: u32,
    nonce: Nonce,
    /// Bit k set: target k not resolved yet.
    pending: u64,
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
    /// Lease slots the agent exports (the READ never reaches past them).
    slot_count: u32,
    /// This batch's window (index into `windows`). A batch keeps its
    /// window for the verifier's life, so the READ of a given window of a
    /// given agent always has the same descriptor: the fabric re-posts one
    /// prepared request (NIXL: no allocation after warm-up).
    window: u32,
    /// The in-flight READ is one span starting at this slot (else one
    /// descriptor per cell).
    span_base: Option<u32>,
}

impl AgentBatch {
    /// Nothing queued, nothing in flight: the batch may change agents.
    fn is_idle(&self) -> bool {
        self.xfer.is_none() && self.queued == NIL && self.inflight == NIL
    }
}

/// D's lease verifier. See the module docs.
#[derive(Debug)]
pub struct LeaseVerifier {
    checks: Box<[Check]>,
    free: FreeStack,
    /// Registered landing cells, shared with the fabric (module docs).
    landing: Arc<LandingWords>,
    landing_region: RegionId,
    /// One window of `WINDOW_SLOTS` words per live agent batch, for span
    /// READs; registered and shared like `landing`.
    windows: Arc<LandingWords>,
    windows_region: RegionId,
    next: Box<[u32]>,
    agents: Vec<AgentBatch>,
    max_agents: usize,
    /// Landing cells per check: the most targets one check may name.
    fan: u32,
    verification: bool,
    descs: Vec<ReadDesc>,
    /// Checks with a verdict, reported at the next step (each at most once).
    done: Ring<u32>,
    counters: VerifierCounters,
}

impl LeaseVerifier {
    /// A verifier sized by `config`, with its landing cells registered on
    /// `fabric`. Allocates `capacity * max_fan_out * 8` bytes of landing
    /// cells and `max_agents * 8 KiB` of span windows, shared with the
    /// fabric: they are freed once both the verifier and the fabric are
    /// dropped. A fan-out of 0 or above [`MAX_TARGETS`] is brought into
    /// `1..=MAX_TARGETS` (a validated [`LeaseConfig`] is already there).
    pub fn new<F: Fabric>(
        fabric: &mut F,
        config: &VerifierConfig,
    ) -> Result<LeaseVerifier, FabricError> {
        let VerifierConfig {
            capacity,
            max_agents,
            ..
        } = *config;
        let fan = config.max_fan_out.clamp(1, MAX_TARGETS as u32);
        let cells = capacity as usize * fan as usize;
        let landing = LandingWords::new(cells);
        let landing_region = fabric.register_landing(Arc::clone(&landing))?;
        let windows = LandingWords::new(max_agents.max(1) as usize * WINDOW_SLOTS as usize);
        let windows_region = fabric.register_landing(Arc::clone(&windows))?;
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
            free: FreeStack::full(capacity),
            landing,
            landing_region,
            windows,
            windows_region,
            next: vec![NIL; cells].into_boxed_slice(),
            agents: Vec::with_capacity(max_agents as usize),
            max_agents: max_agents as usize,
            fan,
            verification: config.verification,
            descs: Vec::with_capacity(capacity as usize),
            done: Ring::new(capacity, 0),
            counters: VerifierCounters::default(),
        })
    }

    /// Event counts since construction.
    pub fn counters(&self) -> VerifierCounters {
        self.counters
    }

    /// Checks accepted and not yet reported.
    pub fn waiting(&self) -> usize {
        (self.free.capacity() - self.free.len()) as usize
    }

    /// Submits the check for request `token` (any caller value, returned with
    /// the verdict) once **all** its block READs completed. `lease` is the
    /// request's (`remote_lease_slot`, `remote_lease_nonce`)
    /// ([`crate::consumer::RemotePrefillParams::lease_fields`]), `None` when
    /// `kv_transfer_params` lacked them; `targets` are the P ranks read from
    /// ([`VerifyTarget::from_peer`]).
    ///
    /// Without lease fields the check is [`Verdict::Unverifiable`]; with a
    /// slot some target does not export, [`Verdict::SlotOutOfRange`]; both
    /// are reported at the next step without a READ. With verification off
    /// every check is [`Verdict::Unchecked`] at the next step, whatever its
    /// fields and targets.
    pub fn submit(
        &mut self,
        token: u64,
        lease: Option<LeaseFields>,
        targets: &[VerifyTarget],
    ) -> Result<(), VerifyError> {
        if !self.verification {
            let Some(c) = self.free.pop() else {
                self.counters.refused += 1;
                return Err(VerifyError::Full);
            };
            self.counters.submitted += 1;
            self.checks[c as usize] = Check {
                token,
                slot: 0,
                nonce: Nonce::ONE,
                pending: 0,
                verdict: Verdict::Unchecked,
                in_use: true,
            };
            self.resolved(c);
            return Ok(());
        }
        let targets = if lease.is_some() { targets } else { &[] };
        if (lease.is_some() && targets.is_empty()) || targets.len() > self.fan as usize {
            self.counters.refused += 1;
            return Err(VerifyError::BadTargets {
                targets: targets.len() as u32,
                max_fan_out: self.fan,
            });
        }
        // Checked here, before batching: a slot beyond a rank's region would
        // make the fabric refuse the whole READ, failing every check in it.
        let out_of_range = lease.is_some_and(|l| targets.iter().any(|t| l.slot >= t.slot_count));
        let targets = if out_of_range { &[] } else { targets };
        // Every target's agent must have (or get) a batch; check before taking a check.
        let new_agents = targets
            .iter()
            .enumerate()
            .filter(|(i, t)| {
                self.batch_of(t.agent).is_none()
                    && !targets[..*i].iter().any(|u| u.agent == t.agent)
            })
            .count();
        // Room: unused batches, plus idle ones (nothing queued or in flight)
        // of agents this check does not name, which a new agent may take over.
        let idle = self
            .agents
            .iter()
            .filter(|a| a.is_idle() && !targets.iter().any(|t| t.agent == a.agent))
            .count();
        if new_agents > self.max_agents - self.agents.len() + idle {
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
        let Some(LeaseFields { slot, nonce }) = lease else {
            check.verdict = Verdict::Unverifiable;
            self.resolved(c);
            return Ok(());
        };
        if out_of_range {
            check.verdict = Verdict::SlotOutOfRange;
            self.resolved(c);
            return Ok(());
        }
        check.slot = slot;
        check.nonce = nonce;
        for (k, t) in targets.iter().enumerate() {
            self.checks[c as usize].pending |= 1 << k;
            let b = match self.batch_of(t.agent) {
                Some(b) => b,
                None => {
                    // submit() checked above that a batch is free or idle.
                    let fresh = AgentBatch {
                        agent: t.agent,
                        slot_region: t.slot_region,
                        queued: NIL,
                        inflight: NIL,
                        xfer: None,
                        slot_count: t.slot_count,
                        window: self.agents.len() as u32,
                        span_base: None,
                    };
                    if self.agents.len() < self.max_agents {
                        self.agents.push(fresh);
                        self.agents.len() - 1
                    } else {
                        let b = self
                            .agents
                            .iter()
                            .position(AgentBatch::is_idle)
                            .unwrap_or(0);
                        debug_assert!(self.agents[b].is_idle());
                        self.agents[b] = AgentBatch {
                            window: self.agents[b].window,
                            ..fresh
                        };
                        b
                    }
                }
            };
            let cell = c * self.fan + k as u32;
            self.next[cell as usize] = self.agents[b].queued;
            self.agents[b].queued = cell;
            self.agents[b].slot_region = t.slot_region;
            self.agents[b].slot_count = t.slot_count;
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
            // An idle batch stays, with its window and so its prepared READ,
            // until another agent needs the room.
            b += 1;
        }
        while let Some(c) = self.done.pop() {
            let check = &mut self.checks[c as usize];
            debug_assert!(check.in_use && check.pending == 0);
            check.in_use = false;
            match check.verdict {
                Verdict::Verified => self.counters.verified += 1,
                Verdict::Lapsed => self.counters.lapsed += 1,
                Verdict::Unverifiable => self.counters.unverifiable += 1,
                Verdict::SlotOutOfRange => self.counters.slot_out_of_range += 1,
                Verdict::ReadFailed(_) => self.counters.read_failed += 1,
                Verdict::Unchecked => self.counters.unchecked += 1,
            }
            report(check.token, check.verdict);
            self.free.push(c);
        }
    }

    /// Queues check `c`, whose verdict is known, for the next report. The
    /// ring holds every check, and a check is queued once per submission.
    fn resolved(&mut self, c: u32) {
        let queued = self.done.push(c);
        debug_assert!(queued, "a check is queued once");
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
            let slot = self.checks[(cell / self.fan) as usize].slot;
            lo = lo.min(slot);
            hi = hi.max(slot);
            cell = self.next[cell as usize];
        }
        self.descs.clear();
        if lo / WINDOW_SLOTS == hi / WINDOW_SLOTS {
            // Every slot in one aligned window of the remote array: read that
            // whole window (clipped to the agent's slot count), whatever the
            // slots. The descriptor then depends only on (agent, window), and
            // the fabric re-posts the same prepared request every time.
            let first = lo / WINDOW_SLOTS * WINDOW_SLOTS;
            let count = batch.slot_count.saturating_sub(first).min(WINDOW_SLOTS);
            let base = batch.window as usize * WINDOW_SLOTS as usize;
            // Zero first: a fabric that reports Done without writing must
            // not leave an earlier check's nonce to be compared.
            for w in base..base + count as usize {
                self.windows.reset(w);
            }
            self.descs.push(ReadDesc {
                local: self.windows_region,
                local_offset: (base * SLOT_BYTES) as u64,
                remote: batch.slot_region,
                remote_offset: LeaseSlots::offset_of(first),
                len: u64::from(count) * SLOT_BYTES as u64,
            });
            self.agents[b].span_base = Some(first);
        } else {
            let mut cell = batch.queued;
            while cell != NIL {
                let check = &self.checks[(cell / self.fan) as usize];
                self.landing.reset(cell as usize);
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
        match self.agents[b].span_base {
            Some(lo) => {
                let base = self.agents[b].window as usize * WINDOW_SLOTS as usize;
                self.windows.load(base + slot.saturating_sub(lo) as usize)
            }
            None => self.landing.load(cell as usize),
        }
    }

    /// Resolves every in-flight cell of batch `b`: by comparing its landing
    /// word with the nonce, or as failed with `error`.
    fn resolve_inflight(&mut self, b: usize, error: Option<FabricError>) {
        let mut cell = self.agents[b].inflight;
        self.agents[b].inflight = NIL;
        self.agents[b].xfer = None;
        while cell != NIL {
            let next = self.next[cell as usize];
            let c = cell / self.fan;
            let k = cell % self.fan;
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
                self.resolved(c);
            }
            cell = next;
        }
    }
}

#[cfg(test)]
mod tests;

mod counters;
mod target;

pub use crate::verdict::Verdict;
pub use counters::{VerifierCounters, VerifyError};
pub use target::VerifyTarget;
