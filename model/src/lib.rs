//! # kvlease-model: the P/D lease protocol, model-checked with stateright
//!
//! This crate owns a model of the whole protocol between processes: one P
//! scheduler (with the engine that drives it: grants, cancels, block frees),
//! two P ranks (worker processes), one D engine of 1, 2 or 4 workers, and a
//! network that loses, duplicates and reorders notifications and may lose a
//! directive message on its way to one rank, while D crashes, a P rank
//! crashes, and P restarts with a new nonce source. The checker ([`check`])
//! explores every interleaving to a depth bound, breadth first and
//! exhaustively (not random walks), and checks the properties of issues 14
//! and 19 (see [`ProtocolModel::properties`]). It owns no library code and
//! changes none: [`replay`] only drives the real roles.
//!
//! # What is modelled
//!
//! - **P**: the engine grants a request ([`Action::Grant`]: assign and start
//!   in one directive, as `PrefillScheduler::grant`), cancels it
//!   ([`Action::Cancel`], engine retries included, from a budget), frees a
//!   drained lease's blocks ([`Action::FreeBlocks`]) and declares a dead
//!   worker lost ([`Action::RankLost`]: every live lease, and every one
//!   granted while the rank stays lost, counts as let go by it, "not held").
//!   Each rank renews on its heartbeats, counts read-dones once per
//!   (sender, lease), expires on its own polls ([`Action::Poll`]), and
//!   answers every directive: a Cancel for a lease it does not hold (it
//!   missed the Grant, or already let go) is answered "not held"
//!   ([`ReleaseReason::NotHeld`]), which the scheduler counts as let go
//!   (or ignores, when that rank reported already).
//! - **The engine's IPC** may lose directive messages on their way to one
//!   rank ([`Action::GrantMissedBy`], [`Action::CancelMissedBy`],
//!   [`Action::BackstopMissedBy`], from a budget): that rank never holds the
//!   lease (its slot stays 0), or never hears the Cancel or the probe.
//! - **The scheduler's backstop** ([`Action::Backstop`]) probes a lease
//!   that one rank let go of (or was declared lost) while another has not:
//!   its Start again, at any time after the let-go (the real one waits
//!   `kv_lease_duration`), out of no budget. A rank that holds the lease
//!   ignores it; one that does not answers "not held".
//! - **D** is one actor for its scheduler (tracker, heartbeats) and its
//!   `d_tp` workers; worker `w` reads the P ranks the real
//!   [`kvlease::topology::TpMapping`] gives it (D TP 1: both P ranks; 2: one
//!   each; 4: one each, so every P rank has two readers), and each P rank
//!   expects that mapping's `consumers_per_p_rank` read-dones. A worker's
//!   READ ([`Action::StartRead`]) is in flight until its last slot check
//!   ([`Action::CheckSlot`]); then it sends its read-done, with its nonce,
//!   to each rank it read. A worker uses its part of the KV only if every
//!   slot check it made held the nonce.
//!
//! # What is real code and what is abstracted
//!
//! The library's role types cannot be model state: [`kvlease::PrefillRank`]
//! and [`kvlease::PrefillScheduler`] hold atomics (the exported slot words,
//! the lock-free slot pool), boxed arrays and a timing wheel, none of it
//! `Hash`. So the model keeps the smallest abstraction of each role
//! ([`Sched`], [`Rank`], [`Decoder`]) and [`replay`] keeps it honest: it runs
//! traces of this model on the real `PrefillScheduler` and `PrefillRank`s
//! (role messages as bytes, lost directive messages left out for the rank
//! that misses them, notifications as wire bytes from named senders, the
//! real clock arithmetic) and asserts the same observable outcome after
//! every step: each rank's slot words and held leases, each grant's slot and
//! nonce, each report's effect, each drain. Real code used directly in the
//! model: the nonces are the real [`kvlease::NonceSource`]'s draws (see
//! [`nonce_of`]), release reasons combine with the real
//! [`ReleaseReason::combine`], and the D-to-P reader mapping is the real
//! `TpMapping`.
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
//! gone P instance, a lease the rank no longer holds, a read-done whose
//! sender that rank already counted for the lease) is dropped from the
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
//! shorter), one `HB:` per P rank (with D TP 4 two real D workers heartbeat
//! each P rank: the model's one is the harsher case under loss). Ticks,
//! expiries, cancels and frees may fall anywhere in a READ.
//!
//! # Properties
//!
//! Safety, in every state: D never uses KV whose blocks P freed during the
//! worker's READ; a slot goes to a new lease only after the last one's
//! blocks were freed; blocks are never freed while a rank holds the lease;
//! a rank lets a lease go for read-done only once every one of its readers
//! finished its READ. Liveness, where a fair run ends (see
//! [`ProtocolModel::properties`]): a lease whose Cancel reached every rank is
//! freed; after a D crash every block is freed; with D alive every lease is
//! read, expired or cancelled. A lease one rank missed the Grant of is ended
//! by the scheduler's backstop ([`Action::Backstop`]): once another rank let
//! go of it, the scheduler probes it, and the rank that missed it answers
//! "not held". A `sometimes` property shows such a run with no
//! cancel from the engine. (Before the backstop, the last two properties
//! had to exempt that lease.)
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
//!   the blocks later, [`Action::FreeBlocks`]). A Cancel's directive and
//!   the ranks' answers are one step likewise.
//! - D's slot READ of a rank starts only after its block READs completed
//!   (the READ is in flight from [`Action::StartRead`] to the last
//!   [`Action::CheckSlot`]).
//! - After a P restart D's READs and slot READs against the old instance
//!   fail (its agent and registered memory are gone); requests are not
//!   re-granted across instances.
//!
//! # Not modelled
//!
//! A lease assigned at the start of its prefill and started later (Assign,
//! then Start: the pinned state and `kv_lease_max_pin`, 480 s against a
//! 2 s tick) and so a Start answered "not held"; a rank refusing a Grant
//! (a configuration mismatch between ranks); a restarted worker
//! (`rank_restarted`); D's tracker, sender and verifier as real code.

pub mod push;
pub mod push_replay;
pub mod replay;

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant as WallInstant};

use kvlease::topology::TpMapping;
use kvlease::{Nonce, NonceSource, ReleaseReason};
use stateright::{Checker, HasDiscoveries, Model, Property};

/// P ranks (TP workers) in the model.
pub const RANKS: usize = 2;
/// Most D workers (D TP) the model holds.
pub const MAX_D_TP: usize = 4;
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
/// one property fail. The same five exist in the real code behind
/// `feature = "mutant_..."` (`.ci/mutants.sh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// A rank zeroes its slot only at its next poll, after its report left.
    ZeroAfterReport,
    /// The scheduler returns a slot to the pool at the drain, before the
    /// engine freed the blocks.
    ReuseBeforeFree,
    /// The scheduler releases a lease when one rank of two reported.
    FreeOnFirstReport,
    /// A rank counts read-dones per rank, whoever sent them: a duplicated
    /// read-done stands in for a reader that is still reading.
    CountPerRank,
    /// The scheduler ignores "not held" reports: a lease a rank missed the
    /// Grant of is held forever, even after a cancel.
    IgnoreNotHeld,
}

impl Mutant {
    /// All mutants.
    pub const ALL: [Mutant; 5] = [
        Mutant::ZeroAfterReport,
        Mutant::ReuseBeforeFree,
        Mutant::FreeOnFirstReport,
        Mutant::CountPerRank,
        Mutant::IgnoreNotHeld,
    ];

    /// The property this mutant must break.
    pub fn breaks(self) -> &'static str {
        match self {
            Mutant::ZeroAfterReport => PROP_VERIFIED_READ,
            Mutant::ReuseBeforeFree => PROP_SLOT_REUSE,
            Mutant::FreeOnFirstReport => PROP_FREE_HELD,
            Mutant::CountPerRank => PROP_READERS_DONE,
            Mutant::IgnoreNotHeld => PROP_LIVE_CANCEL,
        }
    }

    /// The bound its counterexample is searched in: the smallest that has
    /// what the bug needs (no process faults: the bugs need none), so the
    /// search, which stops at the first (shortest) counterexample, is quick.
    pub fn bound(self) -> Bound {
        match self {
            Mutant::ZeroAfterReport | Mutant::ReuseBeforeFree | Mutant::FreeOnFirstReport => {
                Bound::BASE
            }
            // Two readers per P rank, and a read-done the network duplicates.
            Mutant::CountPerRank => Bound {
                requests: 1,
                d_tp: 4,
                dups: 1,
                ..Bound::BASE
            },
            // A Grant one rank misses, and a cancel.
            Mutant::IgnoreNotHeld => Bound {
                requests: 1,
                directive_losses: 1,
                cancels: 1,
                ..Bound::BASE
            },
        }
    }
}

/// Safety: D uses KV only if P held its blocks for the worker's whole READ.
pub const PROP_VERIFIED_READ: &str = "D accepts only loads whose blocks P held for the whole READ";
/// Safety: a slot goes to another lease only after the last one's blocks were freed.
pub const PROP_SLOT_REUSE: &str =
    "a slot is reused only after the blocks of its last lease were freed";
/// Safety: blocks are freed only when no rank holds the lease.
pub const PROP_FREE_HELD: &str = "blocks are never freed while a rank still holds the lease";
/// Safety: a rank's read-done release waits for every one of its readers.
pub const PROP_READERS_DONE: &str =
    "a rank lets a lease go for read-done only after every reader of it finished its READ";
/// Liveness: a cancel that reached every rank ends the lease.
pub const PROP_LIVE_CANCEL: &str = "a lease whose Cancel reached every rank is eventually freed";
/// Liveness: after a D crash, every block is freed.
pub const PROP_LIVE_D_CRASH: &str = "after a D crash every block is eventually freed";
/// Liveness: with a live D, every request is read, expired or cancelled.
pub const PROP_LIVE_D_ALIVE: &str =
    "with a live D every request is eventually read, expired or cancelled";

/// The `always` properties: a discovery of one is a counterexample.
pub const SAFETY_AND_LIVENESS: [&str; 7] = [
    PROP_VERIFIED_READ,
    PROP_SLOT_REUSE,
    PROP_FREE_HELD,
    PROP_READERS_DONE,
    PROP_LIVE_CANCEL,
    PROP_LIVE_D_CRASH,
    PROP_LIVE_D_ALIVE,
];

/// Example: D used a verified load.
pub const EX_ACCEPTED: &str = "D accepts a verified load";
/// Example: a free during a READ failed verification.
pub const EX_REJECTED_FREED: &str = "D rejects a READ whose blocks were freed during it";
/// Example: a fair run with a live D ended.
pub const EX_RUN_ENDS_ALIVE: &str = "a run ends with D alive and every request read or expired";
/// Example: a fair run after a D crash ended.
pub const EX_RUN_ENDS_CRASH: &str = "a run ends after a D crash with every block freed";
/// Example: a slot served two leases.
pub const EX_SLOT_REUSED: &str = "a slot is reused by a second lease";
/// Example: a rank counted two readers' read-dones and let go.
pub const EX_TWO_READERS: &str = "a lease is released by the read-dones of two readers per P rank";
/// Example: the "not held" answer to a Cancel ended a lease a rank missed.
pub const EX_MISSED_CANCELLED: &str =
    "a lease a rank missed the Grant of is freed after a cancel (\"not held\")";
/// Example: the backstop ended a lease a rank missed the Grant of, with no
/// cancel from the engine.
pub const EX_MISSED_BACKSTOP: &str =
    "a lease a rank missed the Grant of is freed with no engine cancel (the backstop)";

/// The model's bound and budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    /// Requests P may prefill (each granted at most once); at most 8 (a
    /// heartbeat names them in a bit mask).
    pub requests: u8,
    /// Lease slots each P rank exports (fewer than requests: slots are reused).
    pub slots: u8,
    /// D's workers (D TP): 1, 2 or 4, against P TP 2. With 4, each P rank
    /// has two readers.
    pub d_tp: u8,
    /// Notifications the network may lose.
    pub drops: u8,
    /// Notifications the network may duplicate.
    pub dups: u8,
    /// D heartbeat rounds (one message per rank each).
    pub heartbeats: u8,
    /// Directive messages the engine's IPC may lose on the way to one rank.
    pub directive_losses: u8,
    /// Cancels the engine may issue.
    pub cancels: u8,
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
    /// Two requests sharing one slot, D TP 1, two heartbeat rounds, no
    /// faults: the base every run adds its faults to.
    pub const BASE: Bound = Bound {
        requests: 2,
        slots: 1,
        d_tp: 1,
        drops: 0,
        dups: 0,
        heartbeats: 2,
        directive_losses: 0,
        cancels: 0,
        d_crashes: 0,
        rank_crashes: 0,
        p_restarts: 0,
        depth: 40,
    };

    /// What `cargo test -p kvlease-model --release` checks, each to the end
    /// of its state space (the depth bound is never reached): the network's
    /// faults; the process faults, with a cancel; and the engine's topology
    /// (two D readers per P rank) with two lost directives (a Grant, then the
    /// backstop's probe), a cancel and the network's faults. Every property,
    /// every mutant. Sized for the CI step's time (`docs/model-check.md`:
    /// state counts and times).
    pub const CI: [(&'static str, Bound); 3] = [
        (
            "network: loss, duplication, reordering",
            Bound {
                drops: 1,
                dups: 1,
                ..Bound::BASE
            },
        ),
        (
            "processes: D crash, P rank crash, P restart, cancel",
            Bound {
                cancels: 1,
                d_crashes: 1,
                rank_crashes: 1,
                p_restarts: 1,
                ..Bound::BASE
            },
        ),
        (
            "engine: D TP 4 (two readers per P rank), two lost directives, cancel, loss, duplication",
            Bound {
                requests: 1,
                d_tp: 4,
                drops: 1,
                dups: 1,
                // Two: a Grant lost to one rank, then the backstop's probe.
                directive_losses: 2,
                cancels: 1,
                ..Bound::BASE
            },
        ),
    ];

    /// The longer local run (`docs/model-check.md`): the network's and the
    /// processes' faults in one model (17.7 million states, 3.8 GB). A lost
    /// directive and a cancel on top outgrow a shared 2-core VM: ask for
    /// them with a smaller bound.
    pub const LONG: Bound = Bound {
        drops: 1,
        dups: 1,
        d_crashes: 1,
        rank_crashes: 1,
        p_restarts: 1,
        ..Bound::BASE
    };

    /// Why this bound cannot be modelled, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if self.requests == 0 || self.requests > 8 {
            return Err(format!("requests={}: 1 to 8", self.requests));
        }
        if self.slots == 0 {
            return Err("slots must be at least 1".into());
        }
        if !matches!(self.d_tp, 1 | 2 | 4) {
            return Err(format!("d_tp={}: 1, 2 or 4 (P TP is 2)", self.d_tp));
        }
        Ok(())
    }
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
    /// Which ranks reported (or count as let go: lost).
    pub reported: [bool; RANKS],
    /// The reasons reported so far, combined.
    pub reason: Option<ReleaseReason>,
    /// Where it stands.
    pub phase: Phase,
    /// Ghost: a live rank missed its Grant.
    pub missed: bool,
    /// Ghost: a rank of it was declared lost while it was held (or before
    /// its grant).
    pub rank_lost: bool,
    /// Ghost: the engine cancelled it (some Cancel may have been lost).
    pub cancelled: bool,
    /// Ghost: a Cancel reached every live rank.
    pub cancel_heard: bool,
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
    /// Per rank: declared lost (`rank_lost`): counts as let go of every
    /// lease, those granted from now on included.
    pub lost: [bool; RANKS],
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
    /// Bit w: D worker w's read-done was counted.
    pub readers: u8,
    /// Read-dones counted (the number of bits in `readers`, but under
    /// [`Mutant::CountPerRank`]).
    pub seen: u8,
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

/// One D worker's part of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Worker {
    /// No such worker (D TP is smaller than the model's arrays).
    Absent,
    /// Has not posted its READ.
    Idle,
    /// Block READs posted. `clean` is ghost state: P held the blocks when
    /// the READ started and has not freed them since.
    Reading {
        /// Ghost: no free of the blocks since the READ started.
        clean: bool,
        /// Per P rank it reads: the slot READ's result (true: the word held
        /// the nonce).
        checks: [Option<bool>; RANKS],
    },
    /// Checked, read-dones sent. `accepted`: it uses the KV.
    Done {
        /// Every slot it checked held the nonce.
        accepted: bool,
        /// Ghost: P held the blocks for the whole READ.
        clean: bool,
    },
}

/// D's view of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DReq {
    /// D has not heard of it.
    Unknown,
    /// In D's scheduler: heartbeated until every worker is done.
    Tracked {
        /// What D pulls.
        pull: Pull,
        /// Per D worker.
        workers: [Worker; MAX_D_TP],
    },
}

impl DReq {
    /// D knows it and some worker has not finished: D heartbeats it.
    pub fn active(&self) -> bool {
        match self {
            DReq::Tracked { workers, .. } => workers
                .iter()
                .any(|w| matches!(w, Worker::Idle | Worker::Reading { .. })),
            DReq::Unknown => false,
        }
    }
}

/// `kv_transfer_params` as D got them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pull {
    /// `remote_lease_slot`, if P exported one.
    pub slot: Option<u8>,
    /// `remote_lease_nonce`.
    pub nonce: N,
}

/// D: its scheduler (tracker) and workers (sender, verifier) in one actor.
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
    /// D worker `sender` to P rank `rank`: the read-done notification, with
    /// the nonce and the mapping's consumer count.
    ReadDone {
        /// The rank.
        rank: u8,
        /// The request.
        req: u8,
        /// The nonce D pulled under (its epoch addresses the instance).
        nonce: N,
        /// The D worker that sent it (its agent name: `d{sender}`).
        sender: u8,
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
    /// Directive messages lost to one rank.
    pub directive_losses: u8,
    /// Cancels.
    pub cancels: u8,
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
    /// Ghost: a rank let a lease go for read-done while one of its readers
    /// (D alive) had not finished its READ.
    pub read_done_early: bool,
}

/// One step of one actor (or of the network, or of time).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// P: a request's prefill is scheduled: the scheduler assigns and
    /// starts its lease, every live rank writes the nonce into the slot in
    /// that step, and the slot and nonce go out to D (`kv_transfer_params`).
    Grant(u8),
    /// As [`Action::Grant`], but the directive message never reaches the
    /// rank (lost on the engine's IPC): it does not hold the lease.
    GrantMissedBy(u8, u8),
    /// The engine cancels the request's lease: a Cancel directive to every
    /// live rank, each answering in the same step (released, or "not held").
    Cancel(u8),
    /// As [`Action::Cancel`], but the rank never gets the directive.
    CancelMissedBy(u8, u8),
    /// The scheduler's backstop (`PrefillScheduler::poll`) probes a lease
    /// that some rank let go of (or was declared lost) while another has
    /// not answered: its Start again, out of no budget; a rank that holds
    /// the lease ignores it, one that does not answers "not held". The
    /// real one waits a `kv_lease_duration` first; the model lets it happen
    /// any time after the first let-go, which covers every real timing.
    Backstop(u8),
    /// As [`Action::Backstop`], but the rank never gets the directive.
    BackstopMissedBy(u8, u8),
    /// The engine tells the scheduler that the rank died (`rank_lost`).
    RankLost(u8),
    /// The engine frees the request's drained blocks and gives the slot back (`blocks_freed`).
    FreeBlocks(u8),
    /// The rank polls: expires every due lease.
    Poll(u8),
    /// Time moves on one tick.
    Tick,
    /// D's heartbeat is due: one `HB:` per P rank for every active request.
    Heartbeat,
    /// D worker (request, worker)'s block READs are posted and complete:
    /// the READ is in flight until its last slot check.
    StartRead(u8, u8),
    /// D worker (request, worker)'s slot READ of P rank (third) completes;
    /// after its last, the worker decides and sends its read-dones.
    CheckSlot(u8, u8, u8),
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

impl Action {
    /// Actions that may happen, never must: faults, and the engine's
    /// choice to cancel. A run with nothing left to do but these is over
    /// (the states after them are checked on their own).
    pub fn optional(&self) -> bool {
        matches!(
            self,
            Action::Drop(_)
                | Action::Duplicate(_)
                | Action::CrashD
                | Action::CrashRank(_)
                | Action::RestartP
                | Action::GrantMissedBy(..)
                | Action::Cancel(_)
                | Action::CancelMissedBy(..)
                | Action::BackstopMissedBy(..)
        )
    }
}

// ---- the model ---------------------------------------------------------------------

/// The protocol model: a bound, the D-to-P reader mapping, and, for the
/// mutation checks, one bug.
#[derive(Clone, Debug)]
pub struct ProtocolModel {
    /// Sizes and budgets.
    pub bound: Bound,
    /// The deliberate bug, if any.
    pub mutant: Option<Mutant>,
    /// Per D worker: the P ranks it reads (the real `TpMapping`'s targets).
    pub targets: [[bool; RANKS]; MAX_D_TP],
    /// Read-dones each P rank waits for (`consumers_per_p_rank`).
    pub consumers: u8,
}

impl ProtocolModel {
    /// The model of `bound`, with `mutant` in its abstraction of the roles.
    ///
    /// # Panics
    ///
    /// On a bound [`Bound::check`] refuses.
    pub fn new(bound: Bound, mutant: Option<Mutant>) -> ProtocolModel {
        if let Err(e) = bound.check() {
            panic!("bad model bound: {e}");
        }
        let mapping = TpMapping::new(u32::from(bound.d_tp), RANKS as u32)
            .unwrap_or_else(|e| panic!("D TP {} against P TP {RANKS}: {e}", bound.d_tp));
        let mut targets = [[false; RANKS]; MAX_D_TP];
        for (w, t) in targets.iter_mut().enumerate().take(usize::from(bound.d_tp)) {
            let ranks = mapping
                .targets(w as u32)
                .unwrap_or_else(|e| panic!("targets of D worker {w}: {e}"));
            for r in ranks {
                t[r as usize] = true;
            }
        }
        ProtocolModel {
            bound,
            mutant,
            targets,
            consumers: mapping.consumers_per_p_rank() as u8,
        }
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
            lost: [false; RANKS],
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

    fn idle_workers(&self) -> [Worker; MAX_D_TP] {
        let mut w = [Worker::Absent; MAX_D_TP];
        for x in w.iter_mut().take(usize::from(self.bound.d_tp)) {
            *x = Worker::Idle;
        }
        w
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
                directive_losses: self.bound.directive_losses,
                cancels: self.bound.cancels,
                d_crashes: self.bound.d_crashes,
                rank_crashes: self.bound.rank_crashes,
                p_restarts: self.bound.p_restarts,
            },
            read_done_early: false,
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

    /// Where a fair run ends: no step but an optional one ([`Action::optional`])
    /// is enabled.
    pub fn quiescent(&self, s: &State) -> bool {
        let mut actions = Vec::new();
        self.actions(s, &mut actions);
        actions
            .into_iter()
            .filter(|a| !a.optional())
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

/// The engine freed (or lost) request `req`'s blocks: every READ of them in
/// flight on D is no longer clean (ghost).
fn taint(d: &mut Decoder, req: usize) {
    if let DReq::Tracked { workers, .. } = &mut d.reqs[req] {
        for w in workers.iter_mut() {
            if let Worker::Reading { clean, .. } = w {
                *clean = false;
            }
        }
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
        if reason == ReleaseReason::NotHeld && self.mutant == Some(Mutant::IgnoreNotHeld) {
            return;
        }
        l.reported[r] = true;
        l.reason = Some(l.reason.map_or(reason, |x| x.combine(reason)));
        let all = if self.mutant == Some(Mutant::FreeOnFirstReport) {
            1
        } else {
            RANKS
        };
        if l.reported.iter().filter(|x| **x).count() >= all {
            self.finish(sched, req);
        }
    }

    /// Every rank let go (by the scheduler's count): released and drained.
    fn finish(&self, sched: &mut Sched, req: usize) {
        let Some(l) = sched.leases[req].as_mut() else {
            return;
        };
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

    /// Grant of request `i`, the directive lost on its way to rank `missed`.
    fn grant(&self, s: &mut State, i: u8, missed: Option<usize>) -> Option<()> {
        let i = usize::from(i);
        if s.sched.leases[i].is_some() || s.sched.lost.iter().all(|x| *x) {
            return None;
        }
        if let Some(m) = missed {
            if s.budget.directive_losses == 0 || !s.ranks[m].alive {
                return None;
            }
            s.budget.directive_losses -= 1;
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
        // Ranks declared lost count as let go from the start ("not held").
        let lost = s.sched.lost;
        s.sched.leases[i] = Some(SLease {
            entry,
            slot,
            nonce,
            reported: lost,
            reason: lost.iter().any(|x| *x).then_some(ReleaseReason::NotHeld),
            phase: Phase::Held,
            missed: missed.is_some(),
            rank_lost: lost.iter().any(|x| *x),
            cancelled: false,
            cancel_heard: false,
        });
        for r in 0..RANKS {
            if !s.ranks[r].alive || missed == Some(r) {
                continue;
            }
            // A rank still holding the entry (only a bug gets here: an
            // entry is reused once every rank let go) lets the old lease
            // go first, as the real rank does.
            let stale = s.ranks[r]
                .held
                .iter()
                .position(|h| h.is_some_and(|l| l.entry == entry));
            if let Some(old) = stale {
                self.rank_release(s, r, old, ReleaseReason::Cancelled);
            }
            let rank = &mut s.ranks[r];
            rank.held[i] = Some(RLease {
                entry,
                nonce,
                slot,
                left: DURATION_TICKS,
                readers: 0,
                seen: 0,
            });
            if let Some(slot) = slot {
                rank.words[usize::from(slot)] = Some(nonce);
            }
        }
        send(
            &mut s.net,
            Msg::Params {
                req: i as u8,
                slot,
                nonce,
            },
        );
        Some(())
    }

    /// The engine cancels request `i`'s lease; the directive is lost on its
    /// way to rank `missed`. Every rank that gets it answers at once.
    fn cancel(&self, s: &mut State, i: u8, missed: Option<usize>) -> Option<()> {
        let i = usize::from(i);
        let l = s.sched.leases[i]?;
        if l.phase != Phase::Held || s.budget.cancels == 0 {
            return None;
        }
        if let Some(m) = missed {
            if s.budget.directive_losses == 0 || !s.ranks[m].alive {
                return None;
            }
            s.budget.directive_losses -= 1;
        }
        s.budget.cancels -= 1;
        if let Some(l) = s.sched.leases[i].as_mut() {
            l.cancelled = true;
            l.cancel_heard |= missed.is_none();
        }
        for r in 0..RANKS {
            if !s.ranks[r].alive || missed == Some(r) {
                continue;
            }
            if s.ranks[r].held[i].is_some_and(|h| h.nonce == l.nonce) {
                self.rank_release(s, r, i, ReleaseReason::Cancelled);
            } else {
                // Missed the Grant, or let go already: "not held" (a
                // duplicate the scheduler ignores in the second case).
                self.on_report(&mut s.sched, r, i, l.nonce, ReleaseReason::NotHeld);
            }
        }
        Some(())
    }

    /// The scheduler's backstop probes request `i`'s lease (its Start again);
    /// the directive is lost on its way to rank `missed`. A rank that holds
    /// the lease takes it for a duplicate; one that does not answers "not
    /// held" at once. `None` when it would change nothing (so a state where
    /// only a futile probe is left is where a run ends).
    fn probe(&self, s: &mut State, i: u8, missed: Option<usize>) -> Option<()> {
        let i = usize::from(i);
        let l = s.sched.leases[i]?;
        if l.phase != Phase::Held || !backstop_due(s, i) {
            return None;
        }
        if let Some(m) = missed {
            if s.budget.directive_losses == 0 || !s.ranks[m].alive {
                return None;
            }
            s.budget.directive_losses -= 1;
        }
        let before = s.sched.leases[i];
        for r in 0..RANKS {
            if !s.ranks[r].alive || missed == Some(r) {
                continue;
            }
            if s.ranks[r].held[i].is_none_or(|h| h.nonce != l.nonce) {
                self.on_report(&mut s.sched, r, i, l.nonce, ReleaseReason::NotHeld);
            }
        }
        (missed.is_some() || s.sched.leases[i] != before).then_some(())
    }

    /// Worker `w` finished its READ of request `i`: its read-done to every
    /// P rank it read.
    fn send_read_dones(&self, net: &mut BTreeMap<Msg, u8>, i: usize, w: usize, nonce: N) {
        for rank in 0..RANKS {
            if self.targets[w][rank] {
                send(
                    net,
                    Msg::ReadDone {
                        rank: rank as u8,
                        req: i as u8,
                        nonce,
                        sender: w as u8,
                    },
                );
            }
        }
    }
}

impl ProtocolModel {
    /// Every action of the model's alphabet that may apply to `s` (the
    /// network's only for messages in flight): what [`Model::actions`]
    /// filters with [`ProtocolModel::plausible`].
    pub fn candidate_actions(&self, s: &State, out: &mut Vec<Action>) {
        let n = self.bound.requests;
        for i in 0..n {
            out.push(Action::Grant(i));
            out.push(Action::Cancel(i));
            out.push(Action::Backstop(i));
            out.push(Action::FreeBlocks(i));
            for r in 0..RANKS as u8 {
                out.push(Action::GrantMissedBy(i, r));
                out.push(Action::CancelMissedBy(i, r));
                out.push(Action::BackstopMissedBy(i, r));
            }
            for w in 0..self.bound.d_tp {
                out.push(Action::StartRead(i, w));
                for r in 0..RANKS as u8 {
                    if self.targets[usize::from(w)][usize::from(r)] {
                        out.push(Action::CheckSlot(i, w, r));
                    }
                }
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

    /// A cheap necessary condition for `a` to be enabled in `s` (each a
    /// first guard of [`Model::next_state`]), so that the checker does not
    /// clone the state for the many actions that cannot apply. Never false
    /// for an enabled action: `model/tests/replay.rs` checks that on every
    /// state its walks visit.
    pub fn plausible(&self, s: &State, a: Action) -> bool {
        let held = |i: u8| {
            s.sched.leases[usize::from(i)].is_some_and(|l| l.phase == Phase::Held)
                && s.budget.cancels > 0
        };
        let worker = |i: u8, w: u8| match &s.d.reqs[usize::from(i)] {
            DReq::Tracked { workers, .. } if s.d.alive => Some(workers[usize::from(w)]),
            _ => None,
        };
        let backstop = |i: u8| {
            s.sched.leases[usize::from(i)].is_some_and(|l| l.phase == Phase::Held)
                && backstop_due(s, usize::from(i))
        };
        let losses = s.budget.directive_losses > 0;
        match a {
            Action::Grant(i) => s.sched.leases[usize::from(i)].is_none(),
            Action::GrantMissedBy(i, r) => {
                losses && s.ranks[usize::from(r)].alive && s.sched.leases[usize::from(i)].is_none()
            }
            Action::Cancel(i) => held(i),
            Action::CancelMissedBy(i, r) => losses && s.ranks[usize::from(r)].alive && held(i),
            Action::Backstop(i) => backstop(i),
            Action::BackstopMissedBy(i, r) => {
                losses && s.ranks[usize::from(r)].alive && backstop(i)
            }
            Action::RankLost(r) => s.sched.lost_pending[usize::from(r)],
            Action::FreeBlocks(i) => s.sched.leases[usize::from(i)]
                .is_some_and(|l| matches!(l.phase, Phase::Drained { .. })),
            Action::Poll(r) => {
                let rank = &s.ranks[usize::from(r)];
                rank.alive
                    && (!rank.deferred_zero.is_empty()
                        || rank.held.iter().flatten().any(|l| l.left == 0))
            }
            Action::Tick => true,
            Action::Heartbeat => s.d.alive && s.d.hb_due && s.budget.heartbeats > 0,
            Action::StartRead(i, w) => worker(i, w) == Some(Worker::Idle),
            Action::CheckSlot(i, w, _) => matches!(worker(i, w), Some(Worker::Reading { .. })),
            Action::Deliver(_) => true,
            Action::Drop(_) => s.budget.drops > 0,
            Action::Duplicate(_) => s.budget.dups > 0,
            Action::CrashD => s.d.alive && s.budget.d_crashes > 0,
            Action::CrashRank(r) => s.ranks[usize::from(r)].alive && s.budget.rank_crashes > 0,
            Action::RestartP => s.budget.p_restarts > 0,
        }
    }
}

impl Model for ProtocolModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.initial()]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        let mut all = Vec::with_capacity(64 + 3 * s.net.len());
        self.candidate_actions(s, &mut all);
        out.extend(all.into_iter().filter(|a| self.plausible(s, *a)));
    }

    fn next_state(&self, s: &State, a: Action) -> Option<State> {
        let mut s = s.clone();
        match a {
            Action::Grant(i) => self.grant(&mut s, i, None)?,
            Action::GrantMissedBy(i, r) => self.grant(&mut s, i, Some(usize::from(r)))?,
            Action::Cancel(i) => self.cancel(&mut s, i, None)?,
            Action::CancelMissedBy(i, r) => self.cancel(&mut s, i, Some(usize::from(r)))?,
            Action::Backstop(i) => self.probe(&mut s, i, None)?,
            Action::BackstopMissedBy(i, r) => self.probe(&mut s, i, Some(usize::from(r)))?,
            Action::RankLost(r) => {
                let r = usize::from(r);
                if !s.sched.lost_pending[r] {
                    return None;
                }
                s.sched.lost_pending[r] = false;
                s.sched.lost[r] = true;
                // `rank_lost` counts the rank as let go of every live lease
                // itself ("not held"): no report, so neither of the report
                // path's mutants applies.
                for i in 0..s.sched.leases.len() {
                    let Some(l) = s.sched.leases[i].as_mut() else {
                        continue;
                    };
                    if l.phase != Phase::Held || l.reported[r] {
                        continue;
                    }
                    l.reported[r] = true;
                    l.rank_lost = true;
                    l.reason = Some(l.reason.map_or(ReleaseReason::NotHeld, |x| {
                        x.combine(ReleaseReason::NotHeld)
                    }));
                    if l.reported.iter().all(|x| *x) {
                        self.finish(&mut s.sched, i);
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
                let tracking = s.d.reqs.iter().any(DReq::active);
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
                    if let DReq::Tracked { pull, .. } = r {
                        if r.active() {
                            *by_epoch.entry(pull.nonce.epoch).or_insert(0) |= 1 << i;
                        }
                    }
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
            Action::StartRead(i, w) => {
                let (i, w) = (usize::from(i), usize::from(w));
                let DReq::Tracked { pull, mut workers } = s.d.reqs[i] else {
                    return None;
                };
                if !s.d.alive || workers[w] != Worker::Idle {
                    return None;
                }
                // Ghost: P holds the blocks now.
                let held = s.sched.leases[i].is_some_and(|l| {
                    l.nonce == pull.nonce && !matches!(l.phase, Phase::Freed | Phase::Lost)
                });
                if pull.slot.is_none() {
                    // No lease fields: unverifiable, the load fails.
                    workers[w] = Worker::Done {
                        accepted: false,
                        clean: held,
                    };
                    self.send_read_dones(&mut s.net, i, w, pull.nonce);
                } else {
                    workers[w] = Worker::Reading {
                        clean: held,
                        checks: [None; RANKS],
                    };
                }
                s.d.reqs[i] = DReq::Tracked { pull, workers };
            }
            Action::CheckSlot(i, w, r) => {
                let (i, w, r) = (usize::from(i), usize::from(w), usize::from(r));
                let DReq::Tracked { pull, mut workers } = s.d.reqs[i] else {
                    return None;
                };
                let Worker::Reading { clean, mut checks } = workers[w] else {
                    return None;
                };
                if !s.d.alive || !self.targets[w][r] || checks[r].is_some() {
                    return None;
                }
                let slot = usize::from(pull.slot?);
                let rank = &s.ranks[r];
                // A dead rank or a gone instance: the slot READ fails.
                let ok = s.sched.epoch == pull.nonce.epoch
                    && rank.alive
                    && rank.words[slot] == Some(pull.nonce);
                checks[r] = Some(ok);
                let targets = self.targets[w];
                if (0..RANKS).all(|k| !targets[k] || checks[k].is_some()) {
                    let accepted = (0..RANKS).all(|k| !targets[k] || checks[k] == Some(true));
                    workers[w] = Worker::Done { accepted, clean };
                    self.send_read_dones(&mut s.net, i, w, pull.nonce);
                } else {
                    workers[w] = Worker::Reading { clean, checks };
                }
                s.d.reqs[i] = DReq::Tracked { pull, workers };
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
                // What a dead D was doing no longer matters; what it
                // finished stays (the properties look at it).
                for r in s.d.reqs.iter_mut() {
                    if r.active() {
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
        normalize(&mut s, self.mutant);
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(PROP_VERIFIED_READ, |_, s: &State| {
                !workers(s).any(|w| {
                    matches!(
                        w,
                        Worker::Done {
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
            Property::always(PROP_READERS_DONE, |_, s: &State| !s.read_done_early),
            // Liveness under fairness: the model is finite and every path
            // ends (each message, fault and cancel comes out of a budget,
            // time only runs down), so "eventually" is checked where a fair
            // run ends: in every quiescent state, where no step but an
            // optional one (a fault, a cancel) is enabled. (stateright's
            // `eventually` misses counterexamples that end at a state
            // reached before by another path; this check does not.) The
            // cheap test comes first: `quiescent` generates every successor.
            Property::always(PROP_LIVE_CANCEL, |m: &ProtocolModel, s: &State| {
                leases(s).all(|l| !l.cancel_heard || ended(l)) || !m.quiescent(s)
            }),
            Property::always(PROP_LIVE_D_CRASH, |m: &ProtocolModel, s: &State| {
                s.d.alive || leases(s).all(ended) || !m.quiescent(s)
            }),
            Property::always(PROP_LIVE_D_ALIVE, |m: &ProtocolModel, s: &State| {
                !s.d.alive || leases(s).all(read_expired_or_cancelled) || !m.quiescent(s)
            }),
            // Not vacuous: the interesting things do happen within the bound.
            Property::sometimes(EX_ACCEPTED, |_, s: &State| {
                workers(s).any(|w| matches!(w, Worker::Done { accepted: true, .. }))
            }),
            Property::sometimes(EX_REJECTED_FREED, |_, s: &State| {
                workers(s).any(|w| {
                    matches!(
                        w,
                        Worker::Done {
                            accepted: false,
                            clean: false
                        }
                    )
                })
            }),
            // The liveness checks are not vacuous: fair runs do end, both ways.
            Property::sometimes(EX_RUN_ENDS_ALIVE, |m: &ProtocolModel, s: &State| {
                s.d.alive
                    && s.sched.leases.iter().all(Option::is_some)
                    && leases(s).all(|l| {
                        l.phase == Phase::Lost
                            || (l.phase == Phase::Freed
                                && matches!(
                                    l.reason,
                                    Some(ReleaseReason::ReadDone | ReleaseReason::Expired)
                                ))
                    })
                    && m.quiescent(s)
            }),
            Property::sometimes(EX_RUN_ENDS_CRASH, |m: &ProtocolModel, s: &State| {
                !s.d.alive
                    && s.sched.leases.iter().any(Option::is_some)
                    && leases(s).all(ended)
                    && m.quiescent(s)
            }),
            Property::sometimes(EX_SLOT_REUSED, |_, s: &State| {
                leases(s).filter(|l| l.slot.is_some()).count() >= 2
            }),
            Property::sometimes(EX_TWO_READERS, |m: &ProtocolModel, s: &State| {
                m.consumers >= 2
                    && leases(s).any(|l| {
                        l.phase == Phase::Freed && l.reason == Some(ReleaseReason::ReadDone)
                    })
            }),
            Property::sometimes(EX_MISSED_CANCELLED, |_, s: &State| {
                leases(s).any(|l| l.missed && l.cancel_heard && l.phase == Phase::Freed)
            }),
            Property::sometimes(EX_MISSED_BACKSTOP, |m: &ProtocolModel, s: &State| {
                s.budget.cancels == m.bound.cancels
                    && leases(s).any(|l| l.missed && l.phase == Phase::Freed)
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
                    s.d.reqs[i] = DReq::Tracked {
                        pull: Pull { slot, nonce },
                        workers: self.idle_workers(),
                    };
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
            Msg::ReadDone {
                rank,
                req,
                nonce,
                sender,
            } => {
                let (r, i) = (usize::from(rank), usize::from(req));
                if nonce.epoch != s.sched.epoch || !s.ranks[r].alive {
                    return;
                }
                let Some(share) = s.ranks[r].held[i].as_mut() else {
                    return;
                };
                if share.nonce != nonce {
                    return;
                }
                let bit = 1u8 << sender;
                if share.readers & bit != 0 && self.mutant != Some(Mutant::CountPerRank) {
                    // This sender was counted for this lease: a duplicate.
                    return;
                }
                share.readers |= bit;
                share.seen += 1;
                if share.seen < self.consumers {
                    return;
                }
                // Ghost: every reader of this rank finished its READ (a
                // dead D reads nothing any more).
                if s.d.alive {
                    let finished = match &s.d.reqs[i] {
                        DReq::Tracked { workers, .. } => (0..MAX_D_TP).all(|w| {
                            !self.targets[w][r] || matches!(workers[w], Worker::Done { .. })
                        }),
                        DReq::Unknown => false,
                    };
                    s.read_done_early |= !finished;
                }
                self.rank_release(s, r, i, ReleaseReason::ReadDone);
            }
        }
    }
}

/// Forgets what can no longer change anything, so that states that differ
/// only in it are one state: notifications whose delivery is a no-op now and
/// forever (to a dead D or rank, to a P instance that is gone, about a lease
/// the rank no longer holds: a rank holds a request's lease only from its
/// one Grant on; a read-done from a sender the rank counted for that lease
/// already, but when the mutant counts per rank). Removing them removes only
/// no-op steps.
fn normalize(s: &mut State, mutant: Option<Mutant>) {
    // Edited in place: most steps change nothing here, and rebuilding the
    // map for every successor was a good part of the checker's time.
    let mut narrowed: Vec<(Msg, u8)> = Vec::new();
    let (ranks, d, epoch) = (&s.ranks, &s.d, s.sched.epoch);
    s.net.retain(|m, count| match *m {
        Msg::Params { req, .. } => d.alive && d.reqs[usize::from(req)] == DReq::Unknown,
        Msg::Heartbeat {
            epoch: e,
            rank,
            reqs,
        } => {
            let rank_state = &ranks[usize::from(rank)];
            if e != epoch || !rank_state.alive {
                return false;
            }
            let mut live = 0u8;
            for (i, h) in rank_state.held.iter().enumerate() {
                if h.is_some() && reqs & (1 << i) != 0 {
                    live |= 1 << i;
                }
            }
            if live != reqs && live != 0 {
                let m = Msg::Heartbeat {
                    epoch: e,
                    rank,
                    reqs: live,
                };
                narrowed.push((m, *count));
            }
            live == reqs
        }
        Msg::ReadDone {
            rank,
            req,
            nonce,
            sender,
        } => {
            let rank_state = &ranks[usize::from(rank)];
            let counted =
                |l: &RLease| l.readers & (1 << sender) != 0 && mutant != Some(Mutant::CountPerRank);
            nonce.epoch == epoch
                && rank_state.alive
                && rank_state.held[usize::from(req)]
                    .is_some_and(|l| l.nonce == nonce && !counted(&l))
        }
    });
    for (m, count) in narrowed {
        *s.net.entry(m).or_insert(0) += count;
    }
}

fn leases(s: &State) -> impl Iterator<Item = &SLease> {
    s.sched.leases.iter().flatten()
}

fn workers(s: &State) -> impl Iterator<Item = &Worker> {
    s.d.reqs.iter().flat_map(|r| match r {
        DReq::Tracked { workers, .. } => workers.as_slice(),
        DReq::Unknown => &[],
    })
}

/// Its blocks are freed (or went with their P instance).
fn ended(l: &SLease) -> bool {
    matches!(l.phase, Phase::Freed | Phase::Lost)
}

/// The scheduler's backstop may probe request `i`'s lease to some effect:
/// some rank let go of it (or was declared lost), which arms it, and some
/// live rank neither holds it nor reported it, which only a probe (or a
/// cancel) makes answer. (The real backstop also probes ranks that hold the
/// lease, every `kv_lease_duration`: a duplicate there, so the model leaves
/// those probes out.)
fn backstop_due(s: &State, i: usize) -> bool {
    let Some(l) = s.sched.leases[i] else {
        return false;
    };
    l.reported.iter().any(|r| *r)
        && (0..RANKS).any(|r| {
            s.ranks[r].alive
                && !l.reported[r]
                && s.ranks[r].held[i].is_none_or(|h| h.nonce != l.nonce)
        })
}

/// Ended, for a reason what happened explains: read or expired; cancelled
/// only if the engine cancelled it; "not held" only if a rank missed its
/// Grant or was lost.
fn read_expired_or_cancelled(l: &SLease) -> bool {
    match l.phase {
        Phase::Lost => true,
        Phase::Freed => match l.reason {
            Some(ReleaseReason::ReadDone | ReleaseReason::Expired) => true,
            Some(ReleaseReason::Cancelled) => l.cancelled,
            Some(ReleaseReason::NotHeld) => l.missed || l.rank_lost,
            None => false,
        },
        _ => false,
    }
}

/// No two leases whose blocks are not freed share a slot (a drained lease
/// whose ticket went back early still has unfreed blocks).
fn slot_owners_ok(s: &State) -> bool {
    let mut owner = [false; 256];
    for l in leases(s) {
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
            .filter(|k| SAFETY_AND_LIVENESS.contains(k))
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
