//! # The push guard, model-checked
//!
//! This module owns a model of push mode's guard ([`kvlease::push`]): one D
//! (its [`kvlease::push::PushPermits`] and the engine that registers blocks
//! and frees them when a permit ends), one P (its
//! [`kvlease::push::PushWrites`] and the engine that posts the WRITE) and a
//! network that loses, duplicates and reorders the guard's notifications,
//! while D aborts, P lets a request go or dies, and the WRITE lands or
//! fails. [`check_push`] explores every interleaving to a depth bound,
//! breadth first, and checks the properties of [`PushModel::properties`].
//! Like the pull model ([`crate`]), it is a plain [`Model`] with budgets in a
//! [`PushBound`] and ghost state, and [`crate::push_replay`] keeps it honest:
//! it replays traces on the real roles, passing wire bytes between them.
//!
//! # What is modelled
//!
//! - **D** registers each request's blocks once ([`PushAction::Register`]:
//!   a permit, its fields in the registration), renews an open permit on
//!   P's `PHB:` (the deadline moves to at least now + extension, and a
//!   `PRN:` with it goes to P), revokes one ([`PushAction::Revoke`]: an
//!   abort, a preemption, or D's watchdog giving up on its own: the same
//!   path), resends `PRV:` every tick while a revoked permit lives, and ends
//!   a permit on P's `PEND:` or at the fence. Once a permit ended its blocks
//!   are free (ghost: D may reuse them at once).
//! - **P** takes a registration ([`PushMsg::Reg`]): accepted while the
//!   request is live and the gate is open, refused (`R`) otherwise: a *late*
//!   registration (P let the request go first, [`PushAction::LetGo`]), one
//!   past its deadline, or one P cannot compare with D's clock (no sample).
//!   It posts the WRITE ([`PushAction::Post`]: `begin_write`, then the post)
//!   while the gate is open, heartbeats what it holds every tick, applies
//!   `PRN:`, answers `PRV:` (at once when held, when the WRITE ends when
//!   posted, again when ended), ends a held registration whose gate closed,
//!   and forgets an ended one once its deadline *surely* passed (the
//!   library's `PushWrites::surely_past`: a tick after P's copy of the
//!   deadline, whatever P's view; never while P has no sample), so that a
//!   duplicate of it is answered again while a gate could let it through.
//!   P may die ([`PushAction::PDies`]): it stops, and a WRITE it
//!   posted still lands (or fails) within the write bound. P's clock
//!   estimate may become exact during a run ([`PushAction::Resample`]: its
//!   first sample, or a tighter one), from a budget.
//! - **The WRITE** is in flight from its post to [`PushAction::Land`] (the
//!   data is in D's blocks) or [`PushAction::Fail`] (nothing lands); P hears
//!   of either (`write_done`) if it is alive.
//! - **The network** may lose ([`PushAction::Drop`]), duplicate
//!   ([`PushAction::Duplicate`]) and reorder every notification, within
//!   budgets. Each message carries one record (the real ones pack several:
//!   the roles take them one by one, so the model's finer messages cover the
//!   real packings).
//!
//! # Time
//!
//! No absolute clock: a tick is [`crate::TICK_SECS`] s (the replay's
//! setting: `duration` 3 ticks, `extension` 2, `write_bound` 1, the
//! heartbeat and `PRV:` resend interval at most one), and every deadline is
//! a count of ticks left: D's permit counts down to its **fence**
//! (`deadline + write_bound`), P's copy of the deadline to the gate, a
//! registration or `PRN:` in flight carries its deadline's count down.
//! [`PushAction::Tick`] moves them all on, then runs both roles' polls at
//! the new instant (D ends what its fence passed and resends `PRV:`; P ends
//! held registrations whose gate closed, forgets ended ones, heartbeats).
//! A count stops at [`PAST`] (-1: the deadline passed a tick or more ago),
//! so that "now" (0) and "surely passed" are told apart. P's gate is open
//! while its copy has more than `early` ticks left: `early` is 0, or 1 when
//! P's clock estimate is one tick off on the conservative side
//! ([`ClockView::Early`], one of the initial states), so P's view of a
//! deadline is never later than D's. P forgets an ended entry at a scan
//! once its copy is [`PAST`], whatever `early` is (the real rule adds the
//! estimate's error bound to its translated deadline, which cancels the
//! early view's error; see `PushModel::scan`). **The write bound**: a tick may not
//! pass while a posted WRITE has been in flight for
//! [`WRITE_BOUND_TICKS`]; it must land or fail first. **P's prefill** is
//! bounded too ([`PushBound::hold`]): time may pass while P holds a
//! registration without posting only `hold` ticks in a run, so every run
//! ends; P's heartbeats and D's renewals are not budgeted.
//!
//! # Properties
//!
//! Safety, in every state: no WRITE lands in a freed block (the blocks of a
//! permit D ended), and D counts a load written only if P's WRITE landed.
//! Liveness, where a fair run ends (as the pull model: the model is finite
//! and every run ends, so "eventually" is checked in every quiescent state,
//! where nothing but an optional step is enabled): every registration ends
//! (written, or failed with its blocks freed), and so does a late one, a
//! refused one (unwritten both), and every one after P died.
//!
//! # Mutants
//!
//! [`PushMutant`]: D frees on abort without waiting, and P posts after its
//! permit ended. Each must yield a counterexample to
//! [`PROP_NO_WRITE_IN_FREED`] that the real roles replay up to the mutant's
//! step, where they refuse what the mutant did
//! ([`crate::push_replay::replay_mutant_trace`]).
//!
//! # What it found
//!
//! A real bug, now fixed. With P's clock estimate improving during a run
//! ([`PushBound::RESAMPLE`]), the real roles let a WRITE land in freed
//! blocks: P forgot an ended registration as soon as its gate was closed
//! under the estimate of the moment (with no sample: at the next scan),
//! and took a duplicate of it that arrived after a better estimate (its
//! first sample, or a tighter one) opened the gate again, as new:
//!
//! ```text
//! clock NoSample: Register(0), Duplicate(Reg), Deliver(Reg) -> refused R (no clock),
//! Deliver(PEND R) -> D frees the blocks, Tick -> P forgot the entry, Resample,
//! Deliver(Reg, 2 ticks left) -> accepted, Post(0), Land(0) -> in freed blocks
//! ```
//!
//! The counterexample replayed on the real roles step by step, the landing
//! included. `src/push/writes.rs` now forgets an ended registration only
//! once its deadline surely passed under P's current estimate, and never
//! while P has no estimate of that D (`PushWrites::surely_past`); the model's
//! P forgets by the same rule, [`PushBound::RESAMPLE`] passes, and
//! [`PushBound::CI`] checks the estimate improving on two registrations and
//! through every fault ([`EX_REFUSED_DUP_ANSWERED`] shows the duplicate
//! answered `R` again). The cost: with no sample of a D, P keeps its ended
//! entries until a sample comes.
//!
//! # Not modelled
//!
//! Running out of permits or entries (`Exhausted`: the replay's capacity is
//! never reached); several P or D peers; P's estimate error changing other
//! than by [`PushAction::Resample`] (it is fixed per run otherwise); events
//! between two tick instants (a post happens at a tick, so the model's
//! last post under a deadline is a tick before it, and the fence
//! arithmetic's margins below a tick are the unit tests' to pin: the replay
//! sets no drift in the fence so that it falls on a tick).

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant as WallInstant};

use kvlease::push::{EndCode, PushEnd};
use stateright::{Checker, HasDiscoveries, Model, Property};

/// Requests (registrations) the model holds at most.
pub const MAX_REQUESTS: usize = 2;
/// A fresh permit's time, in ticks (`duration` = 6 s).
pub const DURATION_TICKS: u8 = 3;
/// A renewal's floor, in ticks (`extension` = 4 s).
pub const EXTENSION_TICKS: u8 = 2;
/// Longest a posted WRITE stays in flight, in ticks (`write_bound` = 2 s);
/// the fence is this long after the deadline.
pub const WRITE_BOUND_TICKS: u8 = 1;
/// A count of ticks to a deadline that passed a tick or more ago (counts
/// stop there: past that, how long ago changes nothing). A deadline that is
/// *now* (0) has not surely passed: P's estimate of D's clock may put it a
/// little later; one [`PAST`] has, under any estimate P holds.
pub const PAST: i8 = -1;

/// A count of ticks left, one tick later.
fn count_down(left: i8) -> i8 {
    (left - 1).max(PAST)
}

/// A count of ticks, as a deadline's count.
fn ticks(n: u8) -> i8 {
    i8::try_from(n).unwrap_or(i8::MAX)
}

/// A `PEND:` code (as [`EndCode`], ordered: it keys the network).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Code {
    /// `W`: the WRITE completed.
    W,
    /// `R`: refused at registration.
    R,
    /// `X`: ended without a complete WRITE.
    X,
}

impl Code {
    /// The real code.
    pub fn real(self) -> EndCode {
        match self {
            Code::W => EndCode::Written,
            Code::R => EndCode::Refused,
            Code::X => EndCode::Ended,
        }
    }

    /// The model's code for a real one.
    pub fn of(code: EndCode) -> Code {
        match code {
            EndCode::Written => Code::W,
            EndCode::Refused => Code::R,
            EndCode::Ended => Code::X,
        }
    }
}

/// P's estimate of D's clock, fixed for a run (an initial state each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ClockView {
    /// P's view of a deadline is D's, to within much less than a tick.
    Exact,
    /// P's view is one tick early (a wide round trip and an estimate off by
    /// its bound): its gate closes a tick sooner.
    Early,
    /// P has no sample of D's clock: it refuses every registration.
    NoSample,
}

impl ClockView {
    fn early(self) -> i8 {
        match self {
            ClockView::Early => 1,
            _ => 0,
        }
    }
}

/// D's permit for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DPermit {
    /// Not registered yet.
    Unregistered,
    /// Granted; `fence`: ticks until the fence (`deadline + write_bound`).
    Open {
        /// Ticks to the fence.
        fence: u8,
    },
    /// Revoked, waiting for P's answer or the fence (which no longer moves).
    Revoking {
        /// Ticks to the fence.
        fence: u8,
    },
    /// Ended: its blocks are free (ghost: D may have reused them).
    Ended {
        /// How, as the real `PermitEnd` says.
        end: PushEnd,
        /// Ghost: ended at the fence (not on P's word).
        at_fence: bool,
    },
}

impl DPermit {
    /// Open or revoking: the blocks are still the permit's.
    pub fn live(&self) -> bool {
        matches!(self, DPermit::Open { .. } | DPermit::Revoking { .. })
    }

    /// Ended: the blocks are free.
    pub fn ended(&self) -> bool {
        matches!(self, DPermit::Ended { .. })
    }
}

/// P's entry for one registration. `left`: P's copy of D's deadline, ticks
/// from now (0: it is now; [`PAST`]: it passed a tick or more ago).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PReg {
    /// P never had an entry for it.
    None,
    /// Accepted; no WRITE posted yet.
    Held {
        /// Ticks to P's copy of the deadline.
        left: i8,
    },
    /// The WRITE was let through; `revoked`: a `PRV:` came meanwhile.
    Posted {
        /// Ticks to P's copy of the deadline.
        left: i8,
        /// A `PRV:` arrived while the WRITE was in flight.
        revoked: bool,
    },
    /// Ended (answered with `code`), remembered for duplicates.
    Ended {
        /// Ticks to P's copy of the deadline.
        left: i8,
        /// The answer.
        code: Code,
    },
    /// Ended and forgotten: its deadline surely passed (a duplicate could
    /// not pass the gate under any estimate of D's clock P may get).
    Forgotten,
}

impl PReg {
    /// P has an entry for it (what `PushWrites::held` counts).
    pub fn entry(&self) -> bool {
        matches!(
            self,
            PReg::Held { .. } | PReg::Posted { .. } | PReg::Ended { .. }
        )
    }
}

/// One notification (one record) on the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PushMsg {
    /// D to P: the registration (vLLM's `PUSH_REG` with the permit), its
    /// deadline `left` ticks from now.
    Reg {
        /// The request.
        req: u8,
        /// Ticks to the registered deadline (0: it is now; [`PAST`]: it
        /// passed a tick or more ago).
        left: i8,
    },
    /// D to P: `PRN:`, the deadline `left` ticks from now.
    Renew {
        /// The request.
        req: u8,
        /// Ticks to the renewed deadline (as `Reg`'s).
        left: i8,
    },
    /// D to P: `PRV:`.
    Revoke {
        /// The request.
        req: u8,
    },
    /// P to D: `PHB:`.
    Alive {
        /// The request.
        req: u8,
    },
    /// P to D: `PEND:`.
    End {
        /// The request.
        req: u8,
        /// Why.
        code: Code,
    },
}

/// Why P refused a registration (as [`kvlease::push::Refusal`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refused {
    /// P no longer has the request (a late registration).
    Gone,
    /// No sample of D's clock.
    NoClock,
    /// The gate is closed already.
    PastDeadline,
    /// A duplicate of a registration P ended: answered again.
    AlreadyEnded(Code),
}

/// What P's call returned in a step, as the replay compares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Answer {
    /// `register`: accepted (or a duplicate of a live one), or refused.
    Register(Result<(), Refused>),
    /// `begin_write`: let through (true) or refused.
    BeginWrite(bool),
    /// `write_done`: P had that WRITE in flight.
    WriteDone(bool),
    /// `cancel`: a held registration ended.
    Cancel(bool),
}

/// What a step did that the real roles can be asked about: the messages
/// they emitted (before the network drops what can no longer matter), the
/// permits D ended, and P's answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Effects {
    /// Messages sent, one record each.
    pub sent: Vec<PushMsg>,
    /// Permits D ended (reported by `on_end`), by request.
    pub ended: Vec<(u8, PushEnd)>,
    /// P's answer, for a step that calls P.
    pub answer: Option<Answer>,
}

/// Ghost state of one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ghost {
    /// WRITEs P let through.
    pub posts: u8,
    /// A WRITE landed (the data is in the blocks).
    pub landed: bool,
    /// A WRITE landed after P died.
    pub landed_dead: bool,
    /// P let the request go before the registration first reached it.
    pub late: bool,
    /// P refused the registration when it first reached it, and why.
    pub refused: Option<Refused>,
    /// P's copy of the deadline was moved later by a `PRN:`.
    pub renewed: bool,
    /// D revoked it while a WRITE was in flight.
    pub revoked_in_flight: bool,
    /// P refused the registration at its gate, then a duplicate of it came
    /// that the gate would let through now (P's clock estimate improved),
    /// and P answered it from its ended entry.
    pub refused_dup_answered: bool,
}

/// What is left of the budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PushBudget {
    /// Losses.
    pub drops: u8,
    /// Duplications.
    pub dups: u8,
    /// D's revocations.
    pub revokes: u8,
    /// P letting a request go.
    pub let_gos: u8,
    /// P deaths.
    pub p_deaths: u8,
    /// WRITEs that fail.
    pub failed_writes: u8,
    /// Ticks P may hold a registration without posting.
    pub hold: u8,
    /// P's clock estimate becoming exact.
    pub samples: u8,
}

/// The whole system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PushState {
    /// P's estimate of D's clock.
    pub clock: ClockView,
    /// D's permits, by request.
    pub d: [DPermit; MAX_REQUESTS],
    /// P is up.
    pub p_alive: bool,
    /// P's entries, by request.
    pub p: [PReg; MAX_REQUESTS],
    /// P still has the request (the engine's `request_live`).
    pub live: [bool; MAX_REQUESTS],
    /// A posted WRITE in flight, with the ticks it has been in flight.
    pub inflight: [Option<u8>; MAX_REQUESTS],
    /// Notifications in flight, with their copy counts.
    pub net: BTreeMap<PushMsg, u8>,
    /// Budgets left.
    pub budget: PushBudget,
    /// Ghost state, by request.
    pub ghost: [Ghost; MAX_REQUESTS],
    /// Ghost: a WRITE landed in blocks D had freed.
    pub landed_in_freed: bool,
}

/// One step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PushAction {
    /// D registers the request's blocks with P (a permit; the registration
    /// goes out).
    Register(u8),
    /// D revokes the permit: an abort, a preemption, or its watchdog.
    Revoke(u8),
    /// P's prefill is done: `begin_write`, and the WRITE if let through.
    Post(u8),
    /// The WRITE in flight lands (completes); P hears of it if alive.
    Land(u8),
    /// The WRITE in flight fails (nothing lands); P hears of it if alive.
    Fail(u8),
    /// P lets the request go (aborted, its own lease lapsed): a held
    /// registration is cancelled, a later one will be refused.
    LetGo(u8),
    /// P dies.
    PDies,
    /// P's clock estimate of D becomes exact: its first sample (from
    /// [`ClockView::NoSample`]) or a tighter one (from [`ClockView::Early`]),
    /// from the handshake or a later clock ping.
    Resample,
    /// Time moves on one tick; both roles poll.
    Tick,
    /// The network delivers one copy (and the receiver polls).
    Deliver(PushMsg),
    /// The network loses one copy.
    Drop(PushMsg),
    /// The network duplicates a message.
    Duplicate(PushMsg),
}

impl PushAction {
    /// Steps that may happen, never must: faults and choices. A run with
    /// nothing else enabled is over.
    pub fn optional(&self) -> bool {
        matches!(
            self,
            PushAction::Revoke(_)
                | PushAction::Fail(_)
                | PushAction::LetGo(_)
                | PushAction::PDies
                | PushAction::Resample
                | PushAction::Drop(_)
                | PushAction::Duplicate(_)
        )
    }
}

/// A deliberate bug in the model's roles; each must make
/// [`PROP_NO_WRITE_IN_FREED`] fail. They live only in the model: the real
/// roles refuse the mutant's step ([`crate::push_replay`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PushMutant {
    /// D ends a permit (frees its blocks) as soon as it revokes it, without
    /// waiting for P's answer or the fence.
    FreeOnAbort,
    /// P lets a WRITE through after its registration ended (revoked, or its
    /// gate closed): it ignores the gate.
    PostAfterEnd,
}

impl PushMutant {
    /// Both mutants.
    pub const ALL: [PushMutant; 2] = [PushMutant::FreeOnAbort, PushMutant::PostAfterEnd];

    /// The property it must break.
    pub fn breaks(self) -> &'static str {
        PROP_NO_WRITE_IN_FREED
    }

    /// The smallest bound that has what the bug needs (one request, one
    /// revocation, no fault), so that the search is quick.
    pub fn bound(self) -> PushBound {
        PushBound {
            requests: 1,
            revokes: 1,
            ..PushBound::BASE
        }
    }
}

/// Safety: no WRITE lands in blocks D freed.
pub const PROP_NO_WRITE_IN_FREED: &str = "no WRITE lands in a freed block";
/// Safety: a permit ends `Written` only after P's WRITE landed.
pub const PROP_WRITTEN_LANDED: &str = "D counts a load written only if P's WRITE landed";
/// Liveness: every registration ends.
pub const PROP_LIVE_ENDS: &str =
    "every registration ends: written, or failed with its blocks freed";
/// Liveness: a late registration ends.
pub const PROP_LIVE_LATE: &str = "a late registration ends unwritten, its blocks freed";
/// Liveness: a refused registration ends.
pub const PROP_LIVE_REFUSED: &str = "a refused registration ends unwritten, its blocks freed";
/// Liveness: after P's death every registration ends.
pub const PROP_LIVE_P_DEAD: &str = "after P dies every registration ends, its blocks freed";

/// The `always` properties: a discovery of one is a counterexample.
pub const PUSH_ALWAYS: [&str; 6] = [
    PROP_NO_WRITE_IN_FREED,
    PROP_WRITTEN_LANDED,
    PROP_LIVE_ENDS,
    PROP_LIVE_LATE,
    PROP_LIVE_REFUSED,
    PROP_LIVE_P_DEAD,
];

/// Example: a load written.
pub const EX_WRITTEN: &str = "a WRITE lands and D ends its permit Written";
/// Example: renewals carried a permit past its first deadline.
pub const EX_RENEWED_WRITTEN: &str = "a permit P saw renewed ends Written";
/// Example: a late registration answered at once.
pub const EX_LATE_REFUSED: &str = "a late registration is refused and D frees on P's answer";
/// Example: a registration reached P past its deadline.
pub const EX_PAST_DEADLINE: &str = "a registration reaching P past its deadline is refused";
/// Example: no clock sample.
pub const EX_NO_CLOCK: &str = "P without a clock sample refuses a registration";
/// Example: an abort waited for the WRITE in flight.
pub const EX_REVOKED_WAITED: &str =
    "a permit revoked with its WRITE in flight ends Revoked after the WRITE landed";
/// Example: a revoked permit ended at its fence.
pub const EX_REVOKED_AT_FENCE: &str = "a revoked permit with no answer from P ends at its fence";
/// Example: P died, the permit lapsed.
pub const EX_P_DEAD_LAPSED: &str = "after P dies a permit lapses at its fence";
/// Example: a WRITE posted before P's death landed.
pub const EX_DEAD_WRITE_LANDS: &str = "a WRITE P posted before it died lands";
/// Example: a failed WRITE.
pub const EX_FAILED_WRITE: &str = "a WRITE fails and D frees on P's X";
/// Example: the bug [`PushBound::RESAMPLE`] found, now refused.
pub const EX_REFUSED_DUP_ANSWERED: &str = "a duplicate of a registration P refused at its gate, \
     which the gate lets through after a better clock estimate, is answered R again";
/// Example: a run ends.
pub const EX_RUN_ENDS: &str = "a run ends with every request registered and every permit ended";

/// The model's bound and budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PushBound {
    /// Requests D registers (1 or 2).
    pub requests: u8,
    /// Notifications the network may lose.
    pub drops: u8,
    /// Notifications the network may duplicate.
    pub dups: u8,
    /// Permits D may revoke (abort, preemption, watchdog).
    pub revokes: u8,
    /// Requests P may let go.
    pub let_gos: u8,
    /// P deaths (0 or 1).
    pub p_deaths: u8,
    /// WRITEs that may fail.
    pub failed_writes: u8,
    /// Ticks P may hold a registration without posting, in a run.
    pub hold: u8,
    /// Also the initial state where P's clock view is a tick early.
    pub early_clock: bool,
    /// Also the initial state where P has no sample of D's clock.
    pub no_clock: bool,
    /// Times P's clock estimate may become exact ([`PushAction::Resample`]).
    pub samples: u8,
    /// Depth bound of the breadth-first search.
    pub depth: usize,
}

impl PushBound {
    /// One request, no fault, P holds up to 3 ticks (long enough for a
    /// renewal to matter), exact clocks.
    pub const BASE: PushBound = PushBound {
        requests: 1,
        drops: 0,
        dups: 0,
        revokes: 0,
        let_gos: 0,
        p_deaths: 0,
        failed_writes: 0,
        hold: 3,
        early_clock: false,
        no_clock: false,
        samples: 0,
        depth: 80,
    };

    /// What `cargo test -p kvlease-model --release` checks
    /// (`model/tests/push_check.rs`), each to the end of its state space:
    /// the network's faults on two registrations; an abort on two, under
    /// loss; and one registration through everything else (P's death, a
    /// late registration, a failed WRITE, an abort, the network's faults,
    /// P's clock a tick early or unsampled); and P's clock estimate
    /// improving during the run ([`PushBound::RESAMPLE`]) on two
    /// registrations, and on one through every fault.
    pub const CI: [(&'static str, PushBound); 5] = [
        (
            "network: two registrations, loss, duplication, reordering",
            PushBound {
                requests: 2,
                drops: 1,
                dups: 1,
                hold: 2,
                ..PushBound::BASE
            },
        ),
        (
            "abort: two registrations, one revoked, loss",
            PushBound {
                requests: 2,
                drops: 1,
                revokes: 1,
                hold: 2,
                ..PushBound::BASE
            },
        ),
        (
            "faults: P dies, lets the request go (late registration), a WRITE fails, \
             an abort, loss, duplication, P's clock a tick early or unsampled",
            PushBound {
                requests: 1,
                drops: 1,
                dups: 1,
                revokes: 1,
                let_gos: 1,
                p_deaths: 1,
                failed_writes: 1,
                early_clock: true,
                no_clock: true,
                ..PushBound::BASE
            },
        ),
        (
            "resample: two registrations, duplication, P's clock estimate improves \
             (its first sample, or a tighter one)",
            PushBound {
                requests: 2,
                ..PushBound::RESAMPLE
            },
        ),
        (
            "resample, faults: P's clock estimate improves; P dies, lets the request go, \
             a WRITE fails, an abort, loss, duplication",
            PushBound {
                drops: 1,
                revokes: 1,
                let_gos: 1,
                p_deaths: 1,
                failed_writes: 1,
                ..PushBound::RESAMPLE
            },
        ),
    ];

    /// P's clock estimate improves during the run (its first sample, or a
    /// tighter one) while a duplicate registration is in flight: the
    /// smallest bound that found the library's bug (see the module docs,
    /// "What it found"; `tests/push_check.rs` checks it and replays the old
    /// counterexample). The library failed it: P forgot an ended
    /// registration once its gate was closed *under the estimate of the
    /// moment* (no sample: always closed), and a duplicate that arrived
    /// after a better estimate opened the gate again was accepted as new,
    /// and written into blocks D freed. Fixed; [`PushBound::CI`] checks it
    /// with two registrations, and with every fault.
    pub const RESAMPLE: PushBound = PushBound {
        requests: 1,
        dups: 1,
        samples: 1,
        early_clock: true,
        no_clock: true,
        ..PushBound::BASE
    };

    /// Why this bound cannot be modelled, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if self.requests == 0 || usize::from(self.requests) > MAX_REQUESTS {
            return Err(format!("requests={}: 1 to {MAX_REQUESTS}", self.requests));
        }
        if self.p_deaths > 1 {
            return Err("p_deaths: 0 or 1 (a dead P stays dead)".into());
        }
        Ok(())
    }
}

/// The push guard's model: a bound and, for the mutation checks, one bug.
#[derive(Clone, Debug)]
pub struct PushModel {
    /// Sizes and budgets.
    pub bound: PushBound,
    /// The deliberate bug, if any.
    pub mutant: Option<PushMutant>,
    /// Drop the notifications that can no longer change anything
    /// ([`PushModel::new`] sets it; the replay's walks clear it, so that the
    /// real roles also take the stale messages, and show that they ignore
    /// them).
    pub prune: bool,
}

fn send(net: &mut BTreeMap<PushMsg, u8>, fx: &mut Effects, m: PushMsg) {
    fx.sent.push(m);
    *net.entry(m).or_insert(0) += 1;
}

fn take(net: &mut BTreeMap<PushMsg, u8>, m: PushMsg) -> bool {
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

impl PushModel {
    /// The model of `bound`, with `mutant` in its roles.
    ///
    /// # Panics
    ///
    /// On a bound [`PushBound::check`] refuses.
    pub fn new(bound: PushBound, mutant: Option<PushMutant>) -> PushModel {
        if let Err(e) = bound.check() {
            panic!("bad push model bound: {e}");
        }
        PushModel {
            bound,
            mutant,
            prune: true,
        }
    }

    /// The initial states: one per clock view the bound asks for.
    pub fn initial_states(&self) -> Vec<PushState> {
        let mut views = vec![ClockView::Exact];
        if self.bound.early_clock {
            views.push(ClockView::Early);
        }
        if self.bound.no_clock {
            views.push(ClockView::NoSample);
        }
        let b = &self.bound;
        views
            .into_iter()
            .map(|clock| PushState {
                clock,
                d: [DPermit::Unregistered; MAX_REQUESTS],
                p_alive: true,
                p: [PReg::None; MAX_REQUESTS],
                live: [true; MAX_REQUESTS],
                inflight: [None; MAX_REQUESTS],
                net: BTreeMap::new(),
                budget: PushBudget {
                    drops: b.drops,
                    dups: b.dups,
                    revokes: b.revokes,
                    let_gos: b.let_gos,
                    p_deaths: b.p_deaths,
                    failed_writes: b.failed_writes,
                    hold: b.hold,
                    samples: b.samples,
                },
                ghost: [Ghost::default(); MAX_REQUESTS],
                landed_in_freed: false,
            })
            .collect()
    }

    /// P's gate: it may post (or accept) under a deadline `left` ticks away.
    fn open(s: &PushState, left: i8) -> bool {
        s.clock != ClockView::NoSample && left > s.clock.early()
    }

    /// Every action of the alphabet that may apply to `s`.
    pub fn candidate_actions(&self, s: &PushState, out: &mut Vec<PushAction>) {
        for i in 0..self.bound.requests {
            out.extend([
                PushAction::Register(i),
                PushAction::Revoke(i),
                PushAction::Post(i),
                PushAction::Land(i),
                PushAction::Fail(i),
                PushAction::LetGo(i),
            ]);
        }
        out.extend([PushAction::PDies, PushAction::Resample, PushAction::Tick]);
        for m in s.net.keys() {
            out.extend([
                PushAction::Deliver(*m),
                PushAction::Drop(*m),
                PushAction::Duplicate(*m),
            ]);
        }
    }

    /// Where a fair run ends: no step but an optional one is enabled.
    pub fn quiescent(&self, s: &PushState) -> bool {
        let mut actions = Vec::new();
        self.candidate_actions(s, &mut actions);
        actions
            .into_iter()
            .filter(|a| !a.optional())
            .all(|a| self.step(s, a).is_none())
    }

    /// D ends permit `i` (its blocks are free from now on).
    fn end(n: &mut PushState, fx: &mut Effects, i: usize, end: PushEnd, at_fence: bool) {
        n.d[i] = DPermit::Ended { end, at_fence };
        fx.ended.push((i as u8, end));
    }

    /// P's scan (`PushWrites::poll` when due): held registrations whose gate
    /// closed end (`X`); ended ones whose deadline surely passed
    /// (`PushWrites::surely_past`: P's copy is [`PAST`], and P has an
    /// estimate of D's clock) and whose answer left already are forgotten.
    /// `owed`: the entry whose answer leaves in this poll (the scan runs
    /// before the answers go; the real scan runs again right after, which
    /// is the next tick's or the next registration's scan here: P's now
    /// moves only at a tick).
    ///
    /// "Surely passed" in ticks: the real rule is
    /// `now > to_local(deadline) + bound(now)`. With an exact estimate the
    /// right side is the deadline plus a millisecond or so; with
    /// [`ClockView::Early`] the estimate puts D's deadline 1 s (half a tick)
    /// early and its bound is 1 s, so the sum is the true deadline again
    /// (plus the bound's drift growth: milliseconds). Either way the rule
    /// holds from the first tick after the deadline, never at the deadline's
    /// own tick, whatever P's view. With no sample it never holds.
    fn scan(n: &mut PushState, fx: &mut Effects, owed: Option<usize>) {
        for i in 0..MAX_REQUESTS {
            match n.p[i] {
                PReg::Held { left } if !Self::open(n, left) => {
                    n.p[i] = PReg::Ended {
                        left,
                        code: Code::X,
                    };
                    send(
                        &mut n.net,
                        fx,
                        PushMsg::End {
                            req: i as u8,
                            code: Code::X,
                        },
                    );
                }
                PReg::Ended { left: PAST, .. }
                    if n.clock != ClockView::NoSample && owed != Some(i) =>
                {
                    n.p[i] = PReg::Forgotten;
                }
                _ => {}
            }
        }
    }

    /// P ends entry `i` with `code` and answers (this step's poll).
    fn p_finish(n: &mut PushState, fx: &mut Effects, i: usize, left: i8, code: Code) {
        n.p[i] = PReg::Ended { left, code };
        send(&mut n.net, fx, PushMsg::End { req: i as u8, code });
    }

    /// The step `a` from `s`: the next state (normalized) and what the roles
    /// did; `None` when `a` is not enabled (or would change nothing).
    pub fn step(&self, s: &PushState, a: PushAction) -> Option<(PushState, Effects)> {
        let mut n = s.clone();
        let mut fx = Effects::default();
        match a {
            PushAction::Register(i) => {
                let i = usize::from(i);
                if n.d[i] != DPermit::Unregistered {
                    return None;
                }
                n.d[i] = DPermit::Open {
                    fence: DURATION_TICKS + WRITE_BOUND_TICKS,
                };
                send(
                    &mut n.net,
                    &mut fx,
                    PushMsg::Reg {
                        req: i as u8,
                        left: ticks(DURATION_TICKS),
                    },
                );
            }
            PushAction::Revoke(i) => {
                let i = usize::from(i);
                let DPermit::Open { fence } = n.d[i] else {
                    return None;
                };
                if n.budget.revokes == 0 {
                    return None;
                }
                n.budget.revokes -= 1;
                n.ghost[i].revoked_in_flight = n.inflight[i].is_some();
                if self.mutant == Some(PushMutant::FreeOnAbort) {
                    Self::end(&mut n, &mut fx, i, PushEnd::Revoked, false);
                } else {
                    n.d[i] = DPermit::Revoking { fence };
                }
                send(&mut n.net, &mut fx, PushMsg::Revoke { req: i as u8 });
            }
            PushAction::Post(i) => {
                let i = usize::from(i);
                if !n.p_alive || n.inflight[i].is_some() {
                    return None;
                }
                let ignore_gate = self.mutant == Some(PushMutant::PostAfterEnd);
                match n.p[i] {
                    PReg::Held { left } => {
                        if Self::open(&n, left) || ignore_gate {
                            n.p[i] = PReg::Posted {
                                left,
                                revoked: false,
                            };
                            n.inflight[i] = Some(0);
                            n.ghost[i].posts += 1;
                            fx.answer = Some(Answer::BeginWrite(true));
                        } else {
                            fx.answer = Some(Answer::BeginWrite(false));
                            Self::p_finish(&mut n, &mut fx, i, left, Code::X);
                        }
                    }
                    // The mutant posts under a registration it ended (`X`:
                    // revoked, or its gate closed), once.
                    PReg::Ended { code: Code::X, .. } if ignore_gate && n.ghost[i].posts == 0 => {
                        n.inflight[i] = Some(0);
                        n.ghost[i].posts += 1;
                        fx.answer = Some(Answer::BeginWrite(true));
                    }
                    // The real `begin_write` refuses without a change.
                    _ => return None,
                }
            }
            PushAction::Land(i) | PushAction::Fail(i) => {
                let landed = matches!(a, PushAction::Land(_));
                let i = usize::from(i);
                n.inflight[i]?;
                if !landed {
                    if n.budget.failed_writes == 0 {
                        return None;
                    }
                    n.budget.failed_writes -= 1;
                }
                n.inflight[i] = None;
                if landed {
                    n.ghost[i].landed = true;
                    n.ghost[i].landed_dead |= !n.p_alive;
                    n.landed_in_freed |= n.d[i].ended();
                }
                if n.p_alive {
                    if let PReg::Posted { left, .. } = n.p[i] {
                        fx.answer = Some(Answer::WriteDone(true));
                        let code = if landed { Code::W } else { Code::X };
                        Self::p_finish(&mut n, &mut fx, i, left, code);
                    } else {
                        fx.answer = Some(Answer::WriteDone(false));
                    }
                }
            }
            PushAction::LetGo(i) => {
                let i = usize::from(i);
                if !n.p_alive || !n.live[i] || n.budget.let_gos == 0 {
                    return None;
                }
                n.budget.let_gos -= 1;
                n.live[i] = false;
                if let PReg::Held { left } = n.p[i] {
                    fx.answer = Some(Answer::Cancel(true));
                    Self::p_finish(&mut n, &mut fx, i, left, Code::X);
                } else {
                    fx.answer = Some(Answer::Cancel(false));
                }
            }
            PushAction::PDies => {
                if !n.p_alive || n.budget.p_deaths == 0 {
                    return None;
                }
                n.budget.p_deaths -= 1;
                n.p_alive = false;
            }
            PushAction::Resample => {
                if !n.p_alive || n.clock == ClockView::Exact || n.budget.samples == 0 {
                    return None;
                }
                n.budget.samples -= 1;
                n.clock = ClockView::Exact;
            }
            PushAction::Tick => self.tick(&mut n, &mut fx)?,
            PushAction::Deliver(m) => {
                if !take(&mut n.net, m) {
                    return None;
                }
                let to_p = matches!(
                    m,
                    PushMsg::Reg { .. } | PushMsg::Renew { .. } | PushMsg::Revoke { .. }
                );
                // A dead P takes nothing in.
                if n.p_alive || !to_p {
                    self.deliver(&mut n, &mut fx, m);
                }
            }
            PushAction::Drop(m) => {
                if n.budget.drops == 0 || !take(&mut n.net, m) {
                    return None;
                }
                n.budget.drops -= 1;
            }
            PushAction::Duplicate(m) => {
                if n.budget.dups == 0 || !n.net.contains_key(&m) {
                    return None;
                }
                n.budget.dups -= 1;
                *n.net.entry(m).or_insert(0) += 1;
            }
        }
        if self.prune {
            normalize(&mut n);
        }
        Some((n, fx))
    }

    /// Time moves on one tick, then D polls (ends what its fence passed,
    /// resends `PRV:`) and P polls (its scan, its answers, its `PHB:`).
    fn tick(&self, n: &mut PushState, fx: &mut Effects) -> Option<()> {
        // The write bound: a WRITE in flight that long lands or fails first.
        if n.inflight
            .iter()
            .flatten()
            .any(|age| *age >= WRITE_BOUND_TICKS)
        {
            return None;
        }
        let holding = n.p_alive && n.p.iter().any(|p| matches!(p, PReg::Held { .. }));
        if holding && n.budget.hold == 0 {
            return None;
        }
        // Time passes while something waits on it: a permit (its fence),
        // or an entry of P (its gate; its deadline, after which it may be
        // forgotten; the scan that forgets it). An ended entry whose
        // deadline passed while P has no sample waits on a sample, not on
        // time.
        let sampled = n.clock != ClockView::NoSample;
        let p_waits = n.p_alive
            && n.p.iter().any(|p| match *p {
                PReg::Held { .. } | PReg::Posted { .. } => true,
                PReg::Ended { left, .. } => left > PAST || sampled,
                PReg::None | PReg::Forgotten => false,
            });
        if !p_waits && !n.d.iter().any(DPermit::live) {
            return None;
        }
        if holding {
            n.budget.hold -= 1;
        }
        for d in n.d.iter_mut() {
            if let DPermit::Open { fence } | DPermit::Revoking { fence } = d {
                *fence -= 1;
            }
        }
        for p in n.p.iter_mut() {
            if let PReg::Held { left } | PReg::Posted { left, .. } | PReg::Ended { left, .. } = p {
                *left = count_down(*left);
            }
        }
        for age in n.inflight.iter_mut().flatten() {
            *age += 1;
        }
        let old = std::mem::take(&mut n.net);
        for (m, c) in old {
            let m = match m {
                PushMsg::Reg { req, left } => PushMsg::Reg {
                    req,
                    left: count_down(left),
                },
                PushMsg::Renew { req, left } => PushMsg::Renew {
                    req,
                    left: count_down(left),
                },
                m => m,
            };
            *n.net.entry(m).or_insert(0) += c;
        }
        // D's poll: the fence, then the resends.
        for i in 0..MAX_REQUESTS {
            match n.d[i] {
                DPermit::Open { fence: 0 } => Self::end(n, fx, i, PushEnd::Lapsed, true),
                DPermit::Revoking { fence: 0 } => Self::end(n, fx, i, PushEnd::Revoked, true),
                _ => {}
            }
        }
        for i in 0..MAX_REQUESTS {
            if matches!(n.d[i], DPermit::Revoking { .. }) {
                send(&mut n.net, fx, PushMsg::Revoke { req: i as u8 });
            }
        }
        // P's poll: the scan, then the heartbeat of every held or posted one.
        if n.p_alive {
            Self::scan(n, fx, None);
            for i in 0..MAX_REQUESTS {
                if matches!(n.p[i], PReg::Held { .. } | PReg::Posted { .. }) {
                    send(&mut n.net, fx, PushMsg::Alive { req: i as u8 });
                }
            }
        }
        Some(())
    }

    fn deliver(&self, n: &mut PushState, fx: &mut Effects, m: PushMsg) {
        match m {
            PushMsg::Reg { req, left } => {
                let i = usize::from(req);
                match n.p[i] {
                    PReg::Held { .. } | PReg::Posted { .. } => {
                        fx.answer = Some(Answer::Register(Ok(())));
                    }
                    PReg::Ended { code, .. } => {
                        // Refused at the gate (`R` with the request live), and
                        // the gate is open for it now: the estimate improved.
                        if code == Code::R && n.live[i] && Self::open(n, left) {
                            n.ghost[i].refused_dup_answered = true;
                        }
                        fx.answer = Some(Answer::Register(Err(Refused::AlreadyEnded(code))));
                        send(&mut n.net, fx, PushMsg::End { req, code });
                    }
                    first @ (PReg::None | PReg::Forgotten) => {
                        let refusal = if !n.live[i] {
                            Some(Refused::Gone)
                        } else if n.clock == ClockView::NoSample {
                            Some(Refused::NoClock)
                        } else if !Self::open(n, left) {
                            Some(Refused::PastDeadline)
                        } else {
                            None
                        };
                        fx.answer = Some(Answer::Register(refusal.map_or(Ok(()), Err)));
                        let owed = match refusal {
                            Some(r) => {
                                if first == PReg::None {
                                    n.ghost[i].refused = Some(r);
                                    n.ghost[i].late = r == Refused::Gone;
                                }
                                n.p[i] = PReg::Ended {
                                    left,
                                    code: Code::R,
                                };
                                Some(i)
                            }
                            None => {
                                n.p[i] = PReg::Held { left };
                                None
                            }
                        };
                        // A new entry makes the scan due: it runs in this
                        // poll, before the answer leaves.
                        Self::scan(n, fx, owed);
                        if owed.is_some() {
                            send(&mut n.net, fx, PushMsg::End { req, code: Code::R });
                        }
                    }
                }
            }
            PushMsg::Renew { req, left } => {
                let i = usize::from(req);
                if let PReg::Held { left: l } = n.p[i] {
                    if left > l {
                        n.p[i] = PReg::Held { left };
                        n.ghost[i].renewed = true;
                    }
                }
            }
            PushMsg::Revoke { req } => {
                let i = usize::from(req);
                match n.p[i] {
                    PReg::Held { left } => Self::p_finish(n, fx, i, left, Code::X),
                    PReg::Posted {
                        left,
                        revoked: false,
                    } => {
                        n.p[i] = PReg::Posted {
                            left,
                            revoked: true,
                        };
                    }
                    PReg::Ended { code, .. } => {
                        send(&mut n.net, fx, PushMsg::End { req, code });
                    }
                    _ => {}
                }
            }
            PushMsg::Alive { req } => {
                let i = usize::from(req);
                if let DPermit::Open { fence } = n.d[i] {
                    // Renewed when now + extension is past the deadline.
                    if fence < EXTENSION_TICKS + WRITE_BOUND_TICKS {
                        n.d[i] = DPermit::Open {
                            fence: EXTENSION_TICKS + WRITE_BOUND_TICKS,
                        };
                        send(
                            &mut n.net,
                            fx,
                            PushMsg::Renew {
                                req,
                                left: ticks(EXTENSION_TICKS),
                            },
                        );
                    }
                }
            }
            PushMsg::End { req, code } => {
                let i = usize::from(req);
                let end = match (n.d[i], code) {
                    (DPermit::Revoking { .. }, _) => PushEnd::Revoked,
                    (DPermit::Open { .. }, Code::W) => PushEnd::Written,
                    (DPermit::Open { .. }, Code::R) => PushEnd::Refused,
                    (DPermit::Open { .. }, Code::X) => PushEnd::EndedByP,
                    _ => return,
                };
                Self::end(n, fx, i, end, false);
            }
        }
    }
}

/// Drops the notifications whose delivery can change nothing now or later,
/// so that states that differ only in them are one: anything to a dead P; a
/// `PHB:` for a permit D no longer has open (only an open one renews); a
/// `PEND:` for a permit D ended; a `PRN:` that cannot raise P's copy (its
/// deadline is past P's gate, or P's entry left `Held`, which it never
/// re-enters: a registration P had an entry for is refused if it comes
/// again, since P forgets an entry only once its deadline, and so the
/// registration's, surely passed); a `PRV:` for a permit D ended and P
/// ended or forgot (its answer could only be a stale `PEND:`, and P never
/// holds the registration again). While P's clock estimate may still
/// improve ([`PushAction::Resample`]) a gate that is closed may open again
/// for a registration P has not taken yet: then a `PRN:` is kept whatever
/// P's gate says now.
fn normalize(s: &mut PushState) {
    let (d, p, p_alive, clock) = (&s.d, &s.p, s.p_alive, s.clock);
    let may_reopen = s.budget.samples > 0 && clock != ClockView::Exact;
    s.net.retain(|m, _| match *m {
        PushMsg::Reg { .. } => p_alive,
        PushMsg::Renew { req, left } => {
            let entry = matches!(p[usize::from(req)], PReg::None | PReg::Held { .. });
            let raises = if may_reopen {
                left > 0
            } else {
                clock != ClockView::NoSample && left > clock.early()
            };
            p_alive && entry && raises
        }
        PushMsg::Revoke { req } => {
            let i = usize::from(req);
            let answered = d[i].ended() && matches!(p[i], PReg::Ended { .. } | PReg::Forgotten);
            p_alive && !answered
        }
        PushMsg::Alive { req } => matches!(d[usize::from(req)], DPermit::Open { .. }),
        PushMsg::End { req, .. } => d[usize::from(req)].live(),
    });
}

fn registered(s: &PushState) -> impl Iterator<Item = (usize, &DPermit)> {
    s.d.iter()
        .enumerate()
        .filter(|(_, d)| **d != DPermit::Unregistered)
}

fn ended_unwritten(d: &DPermit) -> bool {
    matches!(d, DPermit::Ended { end, .. } if *end != PushEnd::Written)
}

impl Model for PushModel {
    type State = PushState;
    type Action = PushAction;

    fn init_states(&self) -> Vec<PushState> {
        self.initial_states()
    }

    fn actions(&self, s: &PushState, out: &mut Vec<PushAction>) {
        self.candidate_actions(s, out);
    }

    fn next_state(&self, s: &PushState, a: PushAction) -> Option<PushState> {
        self.step(s, a).map(|(n, _)| n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(PROP_NO_WRITE_IN_FREED, |_, s: &PushState| {
                !s.landed_in_freed
            }),
            Property::always(PROP_WRITTEN_LANDED, |_, s: &PushState| {
                (0..MAX_REQUESTS).all(|i| {
                    !matches!(
                        s.d[i],
                        DPermit::Ended {
                            end: PushEnd::Written,
                            ..
                        }
                    ) || s.ghost[i].landed
                })
            }),
            // Liveness, where a fair run ends (see the module docs); the
            // cheap test first: `quiescent` generates every successor.
            Property::always(PROP_LIVE_ENDS, |m: &PushModel, s: &PushState| {
                let done = registered(s).all(|(_, d)| d.ended())
                    && s.inflight.iter().all(Option::is_none)
                    && (!s.p_alive
                        || s.p
                            .iter()
                            .all(|p| !matches!(p, PReg::Held { .. } | PReg::Posted { .. })));
                done || !m.quiescent(s)
            }),
            Property::always(PROP_LIVE_LATE, |m: &PushModel, s: &PushState| {
                registered(s).all(|(i, d)| !s.ghost[i].late || ended_unwritten(d))
                    || !m.quiescent(s)
            }),
            Property::always(PROP_LIVE_REFUSED, |m: &PushModel, s: &PushState| {
                registered(s).all(|(i, d)| s.ghost[i].refused.is_none() || ended_unwritten(d))
                    || !m.quiescent(s)
            }),
            Property::always(PROP_LIVE_P_DEAD, |m: &PushModel, s: &PushState| {
                s.p_alive || registered(s).all(|(_, d)| d.ended()) || !m.quiescent(s)
            }),
            Property::sometimes(EX_WRITTEN, |_, s: &PushState| {
                s.d.iter().any(|d| {
                    matches!(
                        d,
                        DPermit::Ended {
                            end: PushEnd::Written,
                            ..
                        }
                    )
                })
            }),
            Property::sometimes(EX_RENEWED_WRITTEN, |_, s: &PushState| {
                (0..MAX_REQUESTS).any(|i| {
                    s.ghost[i].renewed
                        && matches!(
                            s.d[i],
                            DPermit::Ended {
                                end: PushEnd::Written,
                                ..
                            }
                        )
                })
            }),
            Property::sometimes(EX_LATE_REFUSED, |_, s: &PushState| {
                (0..MAX_REQUESTS).any(|i| {
                    s.ghost[i].late
                        && s.d[i]
                            == DPermit::Ended {
                                end: PushEnd::Refused,
                                at_fence: false,
                            }
                })
            }),
            Property::sometimes(EX_PAST_DEADLINE, |_, s: &PushState| {
                s.ghost
                    .iter()
                    .any(|g| g.refused == Some(Refused::PastDeadline))
            }),
            Property::sometimes(EX_NO_CLOCK, |_, s: &PushState| {
                s.ghost.iter().any(|g| g.refused == Some(Refused::NoClock))
            }),
            Property::sometimes(EX_REVOKED_WAITED, |_, s: &PushState| {
                (0..MAX_REQUESTS).any(|i| {
                    s.ghost[i].revoked_in_flight
                        && s.ghost[i].landed
                        && matches!(
                            s.d[i],
                            DPermit::Ended {
                                end: PushEnd::Revoked,
                                ..
                            }
                        )
                })
            }),
            Property::sometimes(EX_REVOKED_AT_FENCE, |_, s: &PushState| {
                s.d.contains(&DPermit::Ended {
                    end: PushEnd::Revoked,
                    at_fence: true,
                })
            }),
            Property::sometimes(EX_P_DEAD_LAPSED, |_, s: &PushState| {
                !s.p_alive
                    && s.d.iter().any(|d| {
                        matches!(
                            d,
                            DPermit::Ended {
                                end: PushEnd::Lapsed,
                                ..
                            }
                        )
                    })
            }),
            Property::sometimes(EX_DEAD_WRITE_LANDS, |_, s: &PushState| {
                s.ghost.iter().any(|g| g.landed_dead)
            }),
            Property::sometimes(EX_FAILED_WRITE, |_, s: &PushState| {
                (0..MAX_REQUESTS).any(|i| {
                    s.ghost[i].posts > 0
                        && !s.ghost[i].landed
                        && matches!(
                            s.d[i],
                            DPermit::Ended {
                                end: PushEnd::EndedByP,
                                ..
                            }
                        )
                })
            }),
            Property::sometimes(EX_REFUSED_DUP_ANSWERED, |_, s: &PushState| {
                s.ghost.iter().any(|g| g.refused_dup_answered)
            }),
            Property::sometimes(EX_RUN_ENDS, |m: &PushModel, s: &PushState| {
                registered(s).count() == usize::from(m.bound.requests)
                    && registered(s).all(|(_, d)| d.ended())
                    && m.quiescent(s)
            }),
        ]
    }
}

// ---- running the checker ---------------------------------------------------------------

/// A trace: the initial state, then each action with the state it led to.
pub type PushTrace = (PushState, Vec<(PushAction, PushState)>);

/// What one run of the checker found.
pub struct PushReport {
    /// Unique states explored.
    pub unique_states: usize,
    /// States generated, repeats included.
    pub states: usize,
    /// The deepest level reached.
    pub max_depth: usize,
    /// Wall time.
    pub elapsed: Duration,
    /// Property name to its discovery: a counterexample for an `always`
    /// property, an example for a `sometimes`.
    pub discoveries: BTreeMap<&'static str, PushTrace>,
}

impl PushReport {
    /// Names of the `always` properties that failed.
    pub fn violations(&self) -> Vec<&'static str> {
        self.discoveries
            .keys()
            .copied()
            .filter(|k| PUSH_ALWAYS.contains(k))
            .collect()
    }

    /// The discovery of `property`, one action a line, with the final state.
    pub fn trace(&self, property: &str) -> Option<String> {
        let (init, path) = self.discoveries.get(property)?;
        let mut out = format!("  0. initial: clock {:?}\n", init.clock);
        for (k, (a, _)) in path.iter().enumerate() {
            out.push_str(&format!("{:>3}. {a:?}\n", k + 1));
        }
        if let Some((_, last)) = path.last() {
            out.push_str(&format!("final state: {last:?}\n"));
        }
        Some(out)
    }
}

impl fmt::Display for PushReport {
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
/// `threads` threads). A mutated model stops at its first counterexample to
/// the property it breaks; the correct one explores everything to the bound.
/// For each `always` property that failed (the mutant's only, for a mutant)
/// the search is then run again on one thread with a depth bound raised one
/// step at a time from zero until that property fails, so that its
/// counterexample is a shortest one (stateright keeps the *last* failing
/// state it visits, seldom the first). The counts reported are the first
/// run's.
pub fn check_push(model: PushModel, threads: usize) -> PushReport {
    let start = WallInstant::now();
    let target = model.mutant.map(PushMutant::breaks);
    let mut first = run_checker(&model, threads, model.bound.depth, target);
    let failed: Vec<&'static str> = match target {
        Some(t) => vec![t],
        None => PUSH_ALWAYS.to_vec(),
    };
    for target in failed {
        let Some(len) = first.discoveries.get(target).map(|(_, path)| path.len()) else {
            continue;
        };
        // stateright visits a state of `k` steps when `k + 1 < depth`.
        for depth in 2..=len + 2 {
            let mut report = run_checker(&model, 1, depth, Some(target));
            if let Some(shortest) = report.discoveries.remove(target) {
                first.discoveries.insert(target, shortest);
                break;
            }
        }
    }
    first.elapsed = start.elapsed();
    first
}

fn run_checker(
    model: &PushModel,
    threads: usize,
    depth: usize,
    finish_on: Option<&'static str>,
) -> PushReport {
    let start = WallInstant::now();
    let mut builder = model
        .clone()
        .checker()
        .threads(threads.max(1))
        .target_max_depth(depth);
    if let Some(p) = finish_on {
        builder = builder.finish_when(HasDiscoveries::AnyOf([p].into()));
    }
    let checker = builder.spawn_bfs().join();
    let mut discoveries = BTreeMap::new();
    for (name, path) in checker.discoveries() {
        let states = path.clone().into_states();
        let actions = path.into_actions();
        let Some(init) = states.first().cloned() else {
            continue;
        };
        let steps: Vec<(PushAction, PushState)> = actions
            .into_iter()
            .zip(states.into_iter().skip(1))
            .collect();
        discoveries.insert(name, (init, steps));
    }
    PushReport {
        unique_states: checker.unique_state_count(),
        states: checker.state_count(),
        max_depth: checker.max_depth(),
        elapsed: start.elapsed(),
        discoveries,
    }
}
