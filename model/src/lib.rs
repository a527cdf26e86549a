//! # kvlease-model: the P/D lease protocol, model-checked with stateright
//!
//! This crate owns a model of the whole protocol between processes: one P
//! scheduler, two P ranks (worker processes), one D (scheduler and worker
//! folded into one actor: they share a process-local step loop), and a
//! network that loses, duplicates and reorders notifications, while D
//! crashes, a P rank crashes, and P restarts with a new nonce source. The
//! checker ([`check`]) explores every interleaving to a depth bound, breadth
//! first and exhaustively (not random walks), and checks the properties of
//! issue 14 (see [`ProtocolModel::properties`]).
//!
//! # What is real code and what is abstracted
//!
//! The library's role types cannot be model state: [`kvlease::PrefillRank`]
//! and [`kvlease::PrefillScheduler`] hold atomics (the exported slot words,
//! the lock-free slot pool), boxed arrays and a timing wheel, none of it
//! `Hash`. So the model keeps the smallest abstraction of each role
//! ([`Sched`], [`Rank`], [`Decoder`]) and [`replay`] keeps it honest: it runs
//! traces of this model on the real `PrefillScheduler` and `PrefillRank`s
//! (role messages as bytes, the real clock arithmetic) and asserts the same
//! observable outcome after every step: each rank's slot words and held
//! leases, each grant's slot and nonce, each report's effect, each drain.
//! Real code used directly in the model: the nonces are the real
//! [`kvlease::NonceSource`]'s draws (see [`nonce_of`]), and release reasons
//! combine with the real [`ReleaseReason::combine`].
//!
//! # Network
//!
//! Notifications between P and D (`kv_transfer_params` through the router,
//! `HB:`, read-done) sit in a multiset: any may be delivered next (reorder),
//! and within [`Bound`]'s budgets one may be lost or duplicated at any time,
//! the semantics of stateright's unordered, lossy, duplicating networks. A
//! plain [`Model`] rather than stateright's `ActorModel` keeps the budgets,
//! the ghost state and the no-op pruning of [`State::net`] in one place:
//! a notification that can no longer change anything (to a dead process, a
//! gone P instance, a lease the rank no longer holds) is dropped from the
//! state, so states that differ only in it are one.
//!
//! # Time
//!
//! The model keeps no absolute clock (so its state space is finite): each
//! rank's lease keeps its time left in ticks of 2 s, with the real settings
//! `kv_lease_duration` = 6 s (3 ticks) and extension = 4 s (2 ticks).
//! [`Action::Tick`] moves time on by one tick for every rank; a rank's
//! [`Action::Poll`] expires what is due, all of it at once, as the real
//! poll does; D's heartbeat is due once per tick (the real interval, 1 s, is
//! shorter). A READ is in flight from [`Action::StartRead`] to the last
//! [`Action::CheckSlot`], and ticks, expiries and frees may fall anywhere in
//! it.
//!
//! # Ordering the real code relies on (kept as constraints)
//!
//! - The ranks publish a lease's nonce in the step its Grant directive
//!   arrives, the step that runs the prefill, and `kv_transfer_params`
//!   leave P only after it: so [`Action::Grant`] writes every live rank's
//!   slot and sends the slot and nonce to D in one step.
//! - Reports travel over the engine's own IPC, and the scheduler drains
//!   released leases in the step that applied the last report: a rank's
//!   release reaches the scheduler in the same model step (the engine frees
//!   the blocks later, [`Action::FreeBlocks`]).
//! - D's slot READ of a rank starts only after its block READs completed
//!   (the READ is in flight from [`Action::StartRead`] to the last
//!   [`Action::CheckSlot`]).
//! - An engine that lost a worker grants nothing new until P restarts. A
//!   simplification: the real scheduler counts a lost rank as let go for
//!   leases granted later too ([`kvlease::PrefillScheduler::rank_lost`]), so
//!   the model does not explore leases granted while a rank is lost.
//! - After a P restart D's READs and slot READs against the old instance
//!   fail (its agent and registered memory are gone); requests are not
//!   re-granted across instances.

pub mod replay;

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant as WallInstant};

use kvlease::{Nonce, NonceSource, ReleaseReason};
use stateright::{Checker, HasDiscoveries, Model, Property};

/// P ranks (TP workers) in the model.
pub const RANKS: usize = 2;
/// A fresh lease's time left, in ticks (`kv_lease_duration` = 6 s, a tick = 2 s).
pub const DURATION_TICKS: u8 = 3;
/// A renewal's floor, in ticks (extension = 6 s * 2/3 = 4 s).
pub const EXTENSION_TICKS: u8 = 2;
/// The real seconds one tick stands for ([`replay`]).
pub const TICK_SECS: u64 = 2;

/// The real nonce P instance `epoch` issues as its `draw`-th: the first
/// draw of a real [`NonceSource`] seeded with that instance's key. Each P
/// restart gets a new key (a new nonce source).
pub fn nonce_of(epoch: u8, draw: u8) -> Nonce {
    let mut source = nonce_source(epoch);
    let mut n = source.next_nonce();
    for _ in 0..draw {
        n = source.next_nonce();
    }
    n
}

/// The nonce source of P instance `epoch` (shared with [`replay`]).
pub fn nonce_source(epoch: u8) -> NonceSource {
    NonceSource::from_seed(
        0,
        0x6b76_6c65_6173_6500 ^ u64::from(epoch),
        0x9e37_79b9_7f4a_7c15,
    )
}

/// A deliberate bug in the model's abstraction of the roles; each must make
/// one property fail. The same three exist in the real code behind
/// `cfg(kvlease_mutant)` (`.ci/mutants.sh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// A rank zeroes its slot only at its next poll, after its report left.
    ZeroAfterReport,
    /// The scheduler returns a slot to the pool at the drain, before the
    /// engine freed the blocks.
    ReuseBeforeFree,
    /// The scheduler releases a lease when one rank of two reported.
    FreeOnFirstReport,
}

impl Mutant {
    /// All mutants.
    pub const ALL: [Mutant; 3] = [
        Mutant::ZeroAfterReport,
        Mutant::ReuseBeforeFree,
        Mutant::FreeOnFirstReport,
    ];

    /// The property this mutant must break.
    pub fn breaks(self) -> &'static str {
        match self {
            Mutant::ZeroAfterReport => PROP_VERIFIED_READ,
            Mutant::ReuseBeforeFree => PROP_SLOT_REUSE,
            Mutant::FreeOnFirstReport => PROP_FREE_HELD,
        }
    }
}

/// Safety: D accepts a load only if P held its blocks from the READ's start
/// to its check.
pub const PROP_VERIFIED_READ: &str = "D accepts only loads whose blocks P held for the whole READ";
/// Safety: a slot goes to another lease only after the last one's blocks were freed.
pub const PROP_SLOT_REUSE: &str =
    "a slot is reused only after the blocks of its last lease were freed";
/// Safety: blocks are freed only when no rank holds the lease.
pub const PROP_FREE_HELD: &str = "blocks are never freed while a rank still holds the lease";
/// Liveness: after a D crash, every block is freed.
pub const PROP_LIVE_D_CRASH: &str = "after a D crash every block is eventually freed";
/// Liveness: with a live D, every request is read or expired.
pub const PROP_LIVE_D_ALIVE: &str = "with a live D every request is eventually read or expired";

/// The model's bound and budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    /// Requests P may prefill (each granted at most once); at most 8 (a
    /// heartbeat names them in a bit mask).
    pub requests: u8,
    /// Lease slots each P rank exports (fewer than requests: slots are reused).
    pub slots: u8,
    /// Notifications the network may lose.
    pub drops: u8,
    /// Notifications the network may duplicate.
    pub dups: u8,
    /// D heartbeat rounds (one message per rank each).
    pub heartbeats: u8,
    /// D crashes (D stays down).
    pub d_crashes: u8,
    /// P rank crashes.
    pub rank_crashes: u8,
    /// P restarts (new instance, new nonce source, fresh slot arrays).
    pub p_restarts: u8,
    /// Depth bound of the breadth-first search.
    pub depth: usize,
}

impl Bound {
    /// What `cargo test -p kvlease-model --release` checks, each to the end
    /// of its state space (the depth bound is never reached): the network's
    /// faults, then the process faults. Every property, every mutant.
    pub const CI: [(&'static str, Bound); 2] = [
        (
            "network: loss, duplication, reordering",
            Bound {
                requests: 2,
                slots: 1,
                drops: 1,
                dups: 1,
                heartbeats: 2,
                d_crashes: 0,
                rank_crashes: 0,
                p_restarts: 0,
                depth: 40,
            },
        ),
        (
            "processes: D crash, P rank crash, P restart",
            Bound {
                requests: 2,
                slots: 1,
                drops: 0,
                dups: 0,
                heartbeats: 2,
                d_crashes: 1,
                rank_crashes: 1,
                p_restarts: 1,
                depth: 40,
            },
        ),
    ];

    /// The longer local run (`docs/model-check.md`): every fault in one model.
    pub const LONG: Bound = Bound {
        requests: 2,
        slots: 1,
        drops: 1,
        dups: 1,
        heartbeats: 2,
        d_crashes: 1,
        rank_crashes: 1,
        p_restarts: 1,
        depth: 40,
    };
}

// ---- state ---------------------------------------------------------------------

/// A nonce in the model: (P instance, draw). [`nonce_of`] gives the real one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct N {
    /// The P instance that drew it.
    pub epoch: u8,
    /// Which of its draws.
    pub draw: u8,
}

/// Where a lease stands on the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Some rank has not reported.
    Held,
    /// Every rank reported (or, mutated, one) and the engine drained it: it
    /// frees the blocks, then gives `ticket` back.
    Drained {
        /// The slot ticket the engine holds until the blocks are freed.
        ticket: Option<u8>,
    },
    /// The engine freed the blocks.
    Freed,
    /// Its P instance died (blocks and slots with it).
    Lost,
}

/// The scheduler's view of one request's lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SLease {
    /// The lease's entry (its slot, or one past the slots when it has none).
    pub entry: u8,
    /// The lease's slot, if P had one free.
    pub slot: Option<u8>,
    /// The lease's nonce.
    pub nonce: N,
    /// Which ranks reported.
    pub reported: [bool; RANKS],
    /// The reasons reported so far, combined.
    pub reason: Option<ReleaseReason>,
    /// Where it stands.
    pub phase: Phase,
}

/// Abstraction of [`kvlease::PrefillScheduler`] plus the engine's block
/// bookkeeping: leases by request, the slot pool, the nonce count.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sched {
    /// The P instance (0, then 1 after a restart...).
    pub epoch: u8,
    /// Nonces drawn by this instance.
    pub draws: u8,
    /// Free slots; the top is the last (the real pool hands out the most
    /// recently returned slot first).
    pub pool: Vec<u8>,
    /// Free entries for leases without a slot (reused once drained).
    pub unslotted: Vec<u8>,
    /// Per request: its lease, once granted (by any instance).
    pub leases: Vec<Option<SLease>>,
    /// A rank of this instance died: no new grants until P restarts.
    pub degraded: bool,
    /// Per rank: dead, and the engine has not yet told the scheduler.
    pub lost_pending: [bool; RANKS],
}

/// One rank's share of a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RLease {
    /// The lease's entry.
    pub entry: u8,
    /// The lease's nonce.
    pub nonce: N,
    /// Its slot.
    pub slot: Option<u8>,
    /// Ticks until it is due (0: the next poll expires it).
    pub left: u8,
}

/// Abstraction of one [`kvlease::PrefillRank`] (its process).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rank {
    /// The worker process is up.
    pub alive: bool,
    /// Per request: this rank's share, while it holds it.
    pub held: Vec<Option<RLease>>,
    /// The exported slot words: `Some(nonce)` or zero (`None`).
    pub words: Vec<Option<N>>,
    /// Mutant [`Mutant::ZeroAfterReport`]: slots to zero at the next poll.
    pub deferred_zero: Vec<u8>,
}

/// D's view of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DReq {
    /// D has not heard of it.
    Unknown,
    /// In D's scheduler, heartbeated, not yet read.
    Tracked(Pull),
    /// Block READs posted. `clean` is ghost state: P held the blocks when
    /// the READ started and has not freed them since.
    Reading {
        /// What D pulls.
        pull: Pull,
        /// Ghost: no free of the blocks since the READ started.
        clean: bool,
        /// Per rank: the slot READ's result (true: the word held the nonce).
        checks: [Option<bool>; RANKS],
    },
    /// Checked. `accepted`: D used the KV.
    Done {
        /// D used the KV (every slot held the nonce).
        accepted: bool,
        /// Ghost: P held the blocks for the whole READ.
        clean: bool,
    },
}

/// `kv_transfer_params` as D got them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pull {
    /// `remote_lease_slot`, if P exported one.
    pub slot: Option<u8>,
    /// `remote_lease_nonce`.
    pub nonce: N,
}

/// D: its scheduler (tracker) and worker (sender, verifier) in one actor.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Decoder {
    /// D is up (a crashed D stays down).
    pub alive: bool,
    /// A heartbeat is due (set by each tick).
    pub hb_due: bool,
    /// Per request.
    pub reqs: Vec<DReq>,
}

/// A notification on the network between P and D.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    /// P to D (through the router): a request with its `kv_transfer_params`.
    Params {
        /// The request.
        req: u8,
        /// `remote_lease_slot`.
        slot: Option<u8>,
        /// `remote_lease_nonce`.
        nonce: N,
    },
    /// D to P rank `rank` of instance `epoch`: `HB:` with the requests in `reqs` (bit set).
    Heartbeat {
        /// The P instance addressed.
        epoch: u8,
        /// The rank.
        rank: u8,
        /// Bit i: request i.
        reqs: u8,
    },
    /// D to P rank `rank`: the read-done notification, with the nonce.
    ReadDone {
        /// The rank.
        rank: u8,
        /// The request.
        req: u8,
        /// The nonce D pulled under (its epoch addresses the instance).
        nonce: N,
    },
}

/// What is left of each fault and message budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Budget {
    /// Losses.
    pub drops: u8,
    /// Duplications.
    pub dups: u8,
    /// Heartbeat rounds.
    pub heartbeats: u8,
    /// D crashes.
    pub d_crashes: u8,
    /// Rank crashes.
    pub rank_crashes: u8,
    /// P restarts.
    pub p_restarts: u8,
}

/// The whole system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// The P scheduler (and the engine's block frees).
    pub sched: Sched,
    /// The P ranks.
    pub ranks: [Rank; RANKS],
    /// D.
    pub d: Decoder,
    /// Notifications in flight, with their copy counts: any may be
    /// delivered next (reordering), lost or duplicated.
    pub net: BTreeMap<Msg, u8>,
    /// What is left of the fault budgets.
    pub budget: Budget,
}

/// One step of one actor (or of the network, or of time).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// P: a request's prefill is scheduled: the scheduler assigns and
    /// starts its lease, every live rank writes the nonce into the slot in
    /// that step, and the slot and nonce go out to D (`kv_transfer_params`).
    Grant(u8),
    /// The engine tells the scheduler that the rank died (`rank_lost`).
    RankLost(u8),
    /// The engine frees the request's drained blocks and gives the slot back (`blocks_freed`).
    FreeBlocks(u8),
    /// The rank polls: expires every due lease.
    Poll(u8),
    /// Time moves on one tick.
    Tick,
    /// D's heartbeat is due: one `HB:` per P rank for every tracked request.
    Heartbeat,
    /// D's block READs of the request are posted and complete: the READ is
    /// in flight until its last slot check.
    StartRead(u8),
    /// D's slot READ of (request, rank) completes; after the last, D decides
    /// and sends the read-done notifications.
    CheckSlot(u8, u8),
    /// The network delivers one copy of the message.
    Deliver(Msg),
    /// The network loses one copy.
    Drop(Msg),
    /// The network duplicates the message.
    Duplicate(Msg),
    /// D crashes (for good).
    CrashD,
    /// P rank crashes (its slot words with it).
    CrashRank(u8),
    /// P restarts: a new instance, new nonce source, fresh slot arrays.
    RestartP,
}

// ---- the model ---------------------------------------------------------------------

/// The protocol model: a bound and, for the mutation checks, one bug.
#[derive(Clone, Debug)]
pub struct ProtocolModel {
    /// Sizes and budgets.
    pub bound: Bound,
    /// The deliberate bug, if any.
    pub mutant: Option<Mutant>,
}

impl ProtocolModel {
    /// The model of `bound`, with `mutant` in its abstraction of the roles.
    pub fn new(bound: Bound, mutant: Option<Mutant>) -> ProtocolModel {
        ProtocolModel { bound, mutant }
    }

    /// `kv_lease_capacity`: every request may be live at once.
    pub fn capacity(&self) -> u8 {
        self.bound.requests.max(self.bound.slots)
    }

    fn fresh_sched(&self, epoch: u8, leases: Vec<Option<SLease>>) -> Sched {
        Sched {
            epoch,
            draws: 0,
            pool: (0..self.bound.slots).rev().collect(),
            unslotted: (self.bound.slots..self.bound.slots + self.capacity())
                .rev()
                .collect(),
            leases,
            degraded: false,
            lost_pending: [false; RANKS],
        }
    }

    fn fresh_rank(&self) -> Rank {
        Rank {
            alive: true,
            held: vec![None; usize::from(self.bound.requests)],
            words: vec![None; usize::from(self.bound.slots)],
            deferred_zero: Vec::new(),
        }
    }

    /// The initial state.
    pub fn initial(&self) -> State {
        let n = usize::from(self.bound.requests);
        State {
            sched: self.fresh_sched(0, vec![None; n]),
            ranks: [self.fresh_rank(), self.fresh_rank()],
            d: Decoder {
                alive: true,
                hb_due: false,
                reqs: vec![DReq::Unknown; n],
            },
            net: BTreeMap::new(),
            budget: Budget {
                drops: self.bound.drops,
                dups: self.bound.dups,
                heartbeats: self.bound.heartbeats,
                d_crashes: self.bound.d_crashes,
                rank_crashes: self.bound.rank_crashes,
                p_restarts: self.bound.p_restarts,
            },
        }
    }

    /// Every state reachable from `s` in one step, with its action.
    pub fn successors(&self, s: &State) -> Vec<(Action, State)> {
        let mut actions = Vec::new();
        self.actions(s, &mut actions);
        actions
            .into_iter()
            .filter_map(|a| self.next_state(s, a).map(|n| (a, n)))
            .collect()
    }

    /// Where a fair run ends: no step but a fault is enabled. Faults (loss,
    /// duplication, crashes, restart) may happen, never must: a run that
    /// has nothing left to do but fail is over (the states after a fault
    /// are checked on their own).
    fn quiescent(&self, s: &State) -> bool {
        let mut actions = Vec::new();
        self.actions(s, &mut actions);
        actions
            .into_iter()
            .filter(|a| {
                !matches!(
                    a,
                    Action::Drop(_)
                        | Action::Duplicate(_)
                        | Action::CrashD
                        | Action::CrashRank(_)
                        | Action::RestartP
                )
            })
            .all(|a| self.next_state(s, a).is_none())
    }
}

fn send(net: &mut BTreeMap<Msg, u8>, m: Msg) {
    *net.entry(m).or_insert(0) += 1;
}

fn take(net: &mut BTreeMap<Msg, u8>, m: Msg) -> bool {
    match net.get_mut(&m) {
        Some(c) if *c > 1 => {
            *c -= 1;
            true
        }
        Some(_) => {
            net.remove(&m);
            true
        }
        None => false,
    }
}

/// The engine freed (or lost) request `req`'s blocks: any READ of them in
/// flight on D is no longer clean (ghost).
fn taint(d: &mut Decoder, req: usize) {
    if let DReq::Reading { clean, .. } = &mut d.reqs[req] {
        *clean = false;
    }
}

impl ProtocolModel {
    /// Rank `r` lets go of `req`: it zeroes the slot first, then reports;
    /// the scheduler counts the report and, once every rank reported,
    /// hands the lease to the engine (`apply_reports`, then
    /// `drain_released`, in the same scheduler step).
    fn rank_release(&self, s: &mut State, r: usize, req: usize, reason: ReleaseReason) {
        let rank = &mut s.ranks[r];
        let Some(l) = rank.held[req].take() else {
            return;
        };
        if let Some(slot) = l.slot {
            if self.mutant == Some(Mutant::ZeroAfterReport) {
                rank.deferred_zero.push(slot);
            } else {
                rank.words[usize::from(slot)] = None;
            }
        }
        self.on_report(&mut s.sched, r, req, l.nonce, reason);
    }

    /// The scheduler applies one report of rank `r` (`on_report`), and
    /// drains the lease if it is released.
    fn on_report(&self, sched: &mut Sched, r: usize, req: usize, nonce: N, reason: ReleaseReason) {
        let Some(l) = sched.leases[req].as_mut() else {
            return;
        };
        if l.phase != Phase::Held || l.nonce != nonce || l.reported[r] {
            return;
        }
        l.reported[r] = true;
        l.reason = Some(l.reason.map_or(reason, |x| x.combine(reason)));
        let reports = l.reported.iter().filter(|x| **x).count();
        let all = if self.mutant == Some(Mutant::FreeOnFirstReport) {
            1
        } else {
            RANKS
        };
        if reports < all {
            return;
        }
        if l.slot.is_none() {
            // The drain gives an unslotted entry straight back.
            sched.unslotted.push(l.entry);
        }
        let ticket = if self.mutant == Some(Mutant::ReuseBeforeFree) {
            if let Some(t) = l.slot {
                sched.pool.push(t);
            }
            None
        } else {
            l.slot
        };
        l.phase = Phase::Drained { ticket };
    }
}

impl Model for ProtocolModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.initial()]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        let n = self.bound.requests;
        for i in 0..n {
            out.push(Action::Grant(i));
            out.push(Action::FreeBlocks(i));
            out.push(Action::StartRead(i));
            for r in 0..RANKS as u8 {
                out.push(Action::CheckSlot(i, r));
            }
        }
        for r in 0..RANKS as u8 {
            out.push(Action::RankLost(r));
            out.push(Action::Poll(r));
            out.push(Action::CrashRank(r));
        }
        out.extend([
            Action::Tick,
            Action::Heartbeat,
            Action::CrashD,
            Action::RestartP,
        ]);
        for m in s.net.keys() {
            out.push(Action::Deliver(*m));
            out.push(Action::Drop(*m));
            out.push(Action::Duplicate(*m));
        }
    }

    fn next_state(&self, s: &State, a: Action) -> Option<State> {
        let mut s = s.clone();
        match a {
            Action::Grant(i) => {
                if s.sched.leases[usize::from(i)].is_some() || s.sched.degraded {
                    return None;
                }
                let nonce = N {
                    epoch: s.sched.epoch,
                    draw: s.sched.draws,
                };
                s.sched.draws += 1;
                let slot = s.sched.pool.pop();
                let entry = match slot {
                    Some(slot) => slot,
                    None => s.sched.unslotted.pop()?,
                };
                s.sched.leases[usize::from(i)] = Some(SLease {
                    entry,
                    slot,
                    nonce,
                    reported: [false; RANKS],
                    reason: None,
                    phase: Phase::Held,
                });
                for r in 0..RANKS {
                    if !s.ranks[r].alive {
                        continue;
                    }
                    // A rank still holding the entry (only a bug gets here:
                    // an entry is reused once every rank let go) lets the
                    // old lease go first, as the real rank does.
                    let stale = s.ranks[r]
                        .held
                        .iter()
                        .position(|h| h.is_some_and(|l| l.entry == entry));
                    if let Some(old) = stale {
                        self.rank_release(&mut s, r, old, ReleaseReason::Cancelled);
                    }
                    let rank = &mut s.ranks[r];
                    rank.held[usize::from(i)] = Some(RLease {
                        entry,
                        nonce,
                        slot,
                        left: DURATION_TICKS,
                    });
                    if let Some(slot) = slot {
                        rank.words[usize::from(slot)] = Some(nonce);
                    }
                }
                send(
                    &mut s.net,
                    Msg::Params {
                        req: i,
                        slot,
                        nonce,
                    },
                );
            }
            Action::RankLost(r) => {
                let r = usize::from(r);
                if !s.sched.lost_pending[r] {
                    return None;
                }
                s.sched.lost_pending[r] = false;
                for i in 0..s.sched.leases.len() {
                    if let Some(l) = s.sched.leases[i] {
                        if l.phase == Phase::Held {
                            self.on_report(&mut s.sched, r, i, l.nonce, ReleaseReason::Expired);
                        }
                    }
                }
            }
            Action::FreeBlocks(i) => {
                let l = s.sched.leases[usize::from(i)].as_mut()?;
                let Phase::Drained { ticket } = l.phase else {
                    return None;
                };
                l.phase = Phase::Freed;
                if let Some(t) = ticket {
                    s.sched.pool.push(t);
                }
                taint(&mut s.d, usize::from(i));
            }
            Action::Poll(r) => {
                let r = usize::from(r);
                let rank = &s.ranks[r];
                let due: Vec<usize> = (0..rank.held.len())
                    .filter(|&i| rank.held[i].is_some_and(|l| l.left == 0))
                    .collect();
                if !rank.alive || (due.is_empty() && rank.deferred_zero.is_empty()) {
                    return None;
                }
                let rank = &mut s.ranks[r];
                for slot in std::mem::take(&mut rank.deferred_zero) {
                    rank.words[usize::from(slot)] = None;
                }
                for i in due {
                    self.rank_release(&mut s, r, i, ReleaseReason::Expired);
                }
            }
            Action::Tick => {
                let mut changed = false;
                for rank in s.ranks.iter_mut().filter(|r| r.alive) {
                    for l in rank.held.iter_mut().flatten() {
                        if l.left > 0 {
                            l.left -= 1;
                            changed = true;
                        }
                    }
                }
                let tracking =
                    s.d.reqs
                        .iter()
                        .any(|r| matches!(r, DReq::Tracked(_) | DReq::Reading { .. }));
                if s.d.alive && tracking && !s.d.hb_due && s.budget.heartbeats > 0 {
                    s.d.hb_due = true;
                    changed = true;
                }
                if !changed {
                    return None;
                }
            }
            Action::Heartbeat => {
                if !s.d.alive || !s.d.hb_due || s.budget.heartbeats == 0 {
                    return None;
                }
                // One HB per (P instance, rank): requests grouped by engine.
                let mut by_epoch: BTreeMap<u8, u8> = BTreeMap::new();
                for (i, r) in s.d.reqs.iter().enumerate() {
                    let pull = match r {
                        DReq::Tracked(p) | DReq::Reading { pull: p, .. } => p,
                        _ => continue,
                    };
                    *by_epoch.entry(pull.nonce.epoch).or_insert(0) |= 1 << i;
                }
                if by_epoch.is_empty() {
                    return None;
                }
                s.d.hb_due = false;
                s.budget.heartbeats -= 1;
                for (epoch, reqs) in by_epoch {
                    for rank in 0..RANKS as u8 {
                        send(&mut s.net, Msg::Heartbeat { epoch, rank, reqs });
                    }
                }
            }
            Action::StartRead(i) => {
                let i = usize::from(i);
                let DReq::Tracked(pull) = s.d.reqs[i] else {
                    return None;
                };
                if !s.d.alive {
                    return None;
                }
                // Ghost: P holds the blocks now.
                let held = s.sched.leases[i].is_some_and(|l| {
                    l.nonce == pull.nonce && !matches!(l.phase, Phase::Freed | Phase::Lost)
                });
                if pull.slot.is_none() {
                    // No lease fields: unverifiable, the load fails.
                    s.d.reqs[i] = DReq::Done {
                        accepted: false,
                        clean: held,
                    };
                    send_read_done(&mut s.net, i as u8, pull.nonce);
                } else {
                    s.d.reqs[i] = DReq::Reading {
                        pull,
                        clean: held,
                        checks: [None; RANKS],
                    };
                }
            }
            Action::CheckSlot(i, r) => {
                let i = usize::from(i);
                let DReq::Reading {
                    pull,
                    clean,
                    mut checks,
                } = s.d.reqs[i]
                else {
                    return None;
                };
                if !s.d.alive || checks[usize::from(r)].is_some() {
                    return None;
                }
                let slot = usize::from(pull.slot?);
                let rank = &s.ranks[usize::from(r)];
                // A dead rank or a gone instance: the slot READ fails.
                let ok = s.sched.epoch == pull.nonce.epoch
                    && rank.alive
                    && rank.words[slot] == Some(pull.nonce);
                checks[usize::from(r)] = Some(ok);
                if checks.iter().all(Option::is_some) {
                    let accepted = checks.iter().all(|c| *c == Some(true));
                    s.d.reqs[i] = DReq::Done { accepted, clean };
                    send_read_done(&mut s.net, i as u8, pull.nonce);
                } else {
                    s.d.reqs[i] = DReq::Reading {
                        pull,
                        clean,
                        checks,
                    };
                }
            }
            Action::Deliver(m) => {
                if !take(&mut s.net, m) {
                    return None;
                }
                self.deliver(&mut s, m);
            }
            Action::Drop(m) => {
                if s.budget.drops == 0 || !take(&mut s.net, m) {
                    return None;
                }
                s.budget.drops -= 1;
            }
            Action::Duplicate(m) => {
                if s.budget.dups == 0 || !s.net.contains_key(&m) {
                    return None;
                }
                s.budget.dups -= 1;
                send(&mut s.net, m);
            }
            Action::CrashD => {
                if !s.d.alive || s.budget.d_crashes == 0 {
                    return None;
                }
                s.budget.d_crashes -= 1;
                s.d.alive = false;
                s.d.hb_due = false;
                for r in s.d.reqs.iter_mut() {
                    if matches!(r, DReq::Tracked(_) | DReq::Reading { .. }) {
                        *r = DReq::Unknown;
                    }
                }
            }
            Action::CrashRank(r) => {
                let r = usize::from(r);
                if !s.ranks[r].alive || s.budget.rank_crashes == 0 {
                    return None;
                }
                s.budget.rank_crashes -= 1;
                let rank = &mut s.ranks[r];
                rank.alive = false;
                rank.held.iter_mut().for_each(|h| *h = None);
                rank.words.iter_mut().for_each(|w| *w = None);
                rank.deferred_zero.clear();
                s.sched.lost_pending[r] = true;
                s.sched.degraded = true;
            }
            Action::RestartP => {
                if s.budget.p_restarts == 0 {
                    return None;
                }
                s.budget.p_restarts -= 1;
                let mut leases = s.sched.leases.clone();
                for (i, l) in leases.iter_mut().enumerate() {
                    if let Some(l) = l {
                        if !matches!(l.phase, Phase::Freed | Phase::Lost) {
                            l.phase = Phase::Lost;
                            taint(&mut s.d, i);
                        }
                    }
                }
                s.sched = self.fresh_sched(s.sched.epoch + 1, leases);
                s.ranks = [self.fresh_rank(), self.fresh_rank()];
            }
        }
        normalize(&mut s);
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(PROP_VERIFIED_READ, |_, s: &State| {
                s.d.reqs.iter().all(|r| {
                    !matches!(
                        r,
                        DReq::Done {
                            accepted: true,
                            clean: false
                        }
                    )
                })
            }),
            Property::always(PROP_SLOT_REUSE, |_, s: &State| slot_owners_ok(s)),
            Property::always(PROP_FREE_HELD, |_, s: &State| {
                s.sched.leases.iter().enumerate().all(|(i, l)| {
                    !l.is_some_and(|l| l.phase == Phase::Freed)
                        || s.ranks.iter().all(|r| !r.alive || r.held[i].is_none())
                })
            }),
            // Liveness under fairness: the model is finite and every path
            // ends (each message and fault comes out of a budget, time only
            // runs down), so "eventually" is checked where a fair run ends:
            // in every quiescent state, where no step but a fault is enabled.
            // (stateright's `eventually` misses counterexamples that end at a
            // state reached before by another path; this check does not.)
            Property::always(PROP_LIVE_D_CRASH, |m: &ProtocolModel, s: &State| {
                s.d.alive || all_blocks_freed(s) || !m.quiescent(s)
            }),
            Property::always(PROP_LIVE_D_ALIVE, |m: &ProtocolModel, s: &State| {
                !s.d.alive || all_read_or_expired(s) || !m.quiescent(s)
            }),
            // Not vacuous: the interesting things do happen within the bound.
            Property::sometimes("D accepts a verified load", |_, s: &State| {
                s.d.reqs
                    .iter()
                    .any(|r| matches!(r, DReq::Done { accepted: true, .. }))
            }),
            Property::sometimes(
                "D rejects a READ whose blocks were freed during it",
                |_, s: &State| {
                    s.d.reqs.iter().any(|r| {
                        matches!(
                            r,
                            DReq::Done {
                                accepted: false,
                                clean: false
                            }
                        )
                    })
                },
            ),
            // The liveness checks are not vacuous: fair runs do end, both ways.
            Property::sometimes(
                "a run ends with D alive and every request read or expired",
                |m: &ProtocolModel, s: &State| {
                    s.d.alive
                        && s.sched.leases.iter().all(Option::is_some)
                        && all_read_or_expired(s)
                        && m.quiescent(s)
                },
            ),
            Property::sometimes(
                "a run ends after a D crash with every block freed",
                |m: &ProtocolModel, s: &State| {
                    !s.d.alive
                        && s.sched.leases.iter().any(Option::is_some)
                        && all_blocks_freed(s)
                        && m.quiescent(s)
                },
            ),
            Property::sometimes("a slot is reused by a second lease", |_, s: &State| {
                s.sched
                    .leases
                    .iter()
                    .flatten()
                    .filter(|l| l.slot.is_some())
                    .count()
                    >= 2
            }),
        ]
    }
}

impl ProtocolModel {
    fn deliver(&self, s: &mut State, m: Msg) {
        match m {
            Msg::Params { req, slot, nonce } => {
                let i = usize::from(req);
                if s.d.alive && s.d.reqs[i] == DReq::Unknown {
                    s.d.reqs[i] = DReq::Tracked(Pull { slot, nonce });
                }
            }
            Msg::Heartbeat { epoch, rank, reqs } => {
                let rank = &mut s.ranks[usize::from(rank)];
                if epoch != s.sched.epoch || !rank.alive {
                    return;
                }
                for (i, h) in rank.held.iter_mut().enumerate() {
                    if let Some(l) = h {
                        if reqs & (1 << i) != 0 {
                            l.left = l.left.max(EXTENSION_TICKS);
                        }
                    }
                }
            }
            Msg::ReadDone { rank, req, nonce } => {
                let r = usize::from(rank);
                if nonce.epoch != s.sched.epoch || !s.ranks[r].alive {
                    return;
                }
                if s.ranks[r].held[usize::from(req)].is_some_and(|l| l.nonce == nonce) {
                    self.rank_release(s, r, usize::from(req), ReleaseReason::ReadDone);
                }
            }
        }
    }
}

/// Forgets what can no longer change anything, so that states that differ
/// only in it are one state: notifications whose delivery is a no-op now and
/// forever (to a dead D or rank, to a P instance that is gone, about a lease
/// the rank no longer holds: a rank holds a request's lease only from its
/// one Grant on). Removing them removes only no-op steps.
fn normalize(s: &mut State) {
    let mut kept = BTreeMap::new();
    for (m, count) in std::mem::take(&mut s.net) {
        let m = match m {
            Msg::Params { .. } if !s.d.alive => continue,
            Msg::Params { req, .. } if s.d.reqs[usize::from(req)] != DReq::Unknown => continue,
            Msg::Heartbeat { epoch, rank, reqs } => {
                let rank_state = &s.ranks[usize::from(rank)];
                if epoch != s.sched.epoch || !rank_state.alive {
                    continue;
                }
                let mut live = 0u8;
                for (i, h) in rank_state.held.iter().enumerate() {
                    if h.is_some() && reqs & (1 << i) != 0 {
                        live |= 1 << i;
                    }
                }
                if live == 0 {
                    continue;
                }
                Msg::Heartbeat {
                    epoch,
                    rank,
                    reqs: live,
                }
            }
            Msg::ReadDone { rank, req, nonce } => {
                let rank_state = &s.ranks[usize::from(rank)];
                if nonce.epoch != s.sched.epoch
                    || !rank_state.alive
                    || rank_state.held[usize::from(req)].is_none_or(|l| l.nonce != nonce)
                {
                    continue;
                }
                m
            }
            m => m,
        };
        *kept.entry(m).or_insert(0) += count;
    }
    s.net = kept;
}

fn send_read_done(net: &mut BTreeMap<Msg, u8>, req: u8, nonce: N) {
    for rank in 0..RANKS as u8 {
        send(net, Msg::ReadDone { rank, req, nonce });
    }
}

/// No two leases whose blocks are not freed share a slot (a drained lease
/// whose ticket went back early still has unfreed blocks).
fn slot_owners_ok(s: &State) -> bool {
    let mut owner = [false; 256];
    for l in s.sched.leases.iter().flatten() {
        if l.nonce.epoch != s.sched.epoch || matches!(l.phase, Phase::Freed | Phase::Lost) {
            continue;
        }
        if let Some(slot) = l.slot {
            let o = &mut owner[usize::from(slot)];
            if *o {
                return false;
            }
            *o = true;
        }
    }
    true
}

fn all_blocks_freed(s: &State) -> bool {
    s.sched
        .leases
        .iter()
        .flatten()
        .all(|l| matches!(l.phase, Phase::Freed | Phase::Lost))
}

fn all_read_or_expired(s: &State) -> bool {
    s.sched.leases.iter().flatten().all(|l| {
        l.phase == Phase::Lost
            || (l.phase == Phase::Freed
                && matches!(
                    l.reason,
                    Some(ReleaseReason::ReadDone | ReleaseReason::Expired)
                ))
    })
}

// ---- running the checker ---------------------------------------------------------------

/// What one run of the checker found.
pub struct CheckReport {
    /// Unique states explored.
    pub unique_states: usize,
    /// States generated, repeats included.
    pub states: usize,
    /// The deepest level reached.
    pub max_depth: usize,
    /// Wall time.
    pub elapsed: Duration,
    /// Property name to its discovery, printed: a counterexample for an
    /// `always` property, an example for a `sometimes`.
    pub discoveries: BTreeMap<&'static str, Vec<(Action, State)>>,
}

impl CheckReport {
    /// Names of the `always` properties that failed.
    pub fn violations(&self) -> Vec<&'static str> {
        self.discoveries
            .keys()
            .copied()
            .filter(|k| {
                [
                    PROP_VERIFIED_READ,
                    PROP_SLOT_REUSE,
                    PROP_FREE_HELD,
                    PROP_LIVE_D_CRASH,
                    PROP_LIVE_D_ALIVE,
                ]
                .contains(k)
            })
            .collect()
    }

    /// The counterexample of `property`, one action a line, with the final state.
    pub fn trace(&self, property: &str) -> Option<String> {
        let path = self.discoveries.get(property)?;
        let mut out = String::new();
        for (k, (a, _)) in path.iter().enumerate() {
            out.push_str(&format!("{:>3}. {a:?}\n", k + 1));
        }
        if let Some((_, last)) = path.last() {
            out.push_str(&format!("final state: {last:?}\n"));
        }
        Some(out)
    }
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} unique states ({} generated), depth {}, in {:.1} s",
            self.unique_states,
            self.states,
            self.max_depth,
            self.elapsed.as_secs_f64()
        )
    }
}

/// Checks `model` exhaustively to its depth bound (breadth first, on
/// `threads` threads) and reports what it found. A mutated model stops at
/// its first counterexample (the shortest one, breadth first); the correct
/// one explores everything to the bound.
pub fn check(model: ProtocolModel, threads: usize) -> CheckReport {
    let start = WallInstant::now();
    let depth = model.bound.depth;
    let mut builder = model
        .clone()
        .checker()
        .threads(threads.max(1))
        .target_max_depth(depth);
    if model.mutant.is_some() {
        builder = builder.finish_when(HasDiscoveries::AnyFailures);
    }
    let checker = builder.spawn_bfs().join();
    let mut discoveries = BTreeMap::new();
    for (name, path) in checker.discoveries() {
        let states = path.clone().into_states();
        let actions = path.into_actions();
        // Path: states s0..sn, actions a1..an; pair each action with its result.
        let steps: Vec<(Action, State)> = actions
            .into_iter()
            .zip(states.into_iter().skip(1))
            .collect();
        discoveries.insert(name, steps);
    }
    CheckReport {
        unique_states: checker.unique_state_count(),
        states: checker.state_count(),
        max_depth: checker.max_depth(),
        elapsed: start.elapsed(),
        discoveries,
    }
}
