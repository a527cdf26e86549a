//! The push model's honesty check: this module owns the replay of a
//! [`crate::push`] trace on the real push roles, and the comparison of what
//! both observe. It drives the roles only through their public API.
//!
//! [`PushReplay`] runs one real [`PushPermits`] (D) and one real
//! [`PushWrites`] (P), with a real [`ClockOffset`] on P (an exact sample, a
//! sample a tick off on the conservative side, or none: the model's
//! [`ClockView`]), and passes wire bytes between them: the registration's
//! fields as their 40 hex digits, every notification as one `PRN:`, `PRV:`,
//! `PHB:` or `PEND:` record. Time is real [`Instant`] arithmetic: a model
//! tick is [`TICK_SECS`] s on both clocks, D's clock reads 1000 s more than
//! P's, and the settings are those of [`push_config`] (`duration` 3 ticks,
//! `extension` 2, `write_bound` 1, the defaults' 1 s heartbeat interval and
//! 1 s post margin, no drift in the fence, so that every deadline and fence
//! falls on a tick). Both roles poll once at the start and at every tick,
//! and the role a step touches polls right after it (what an engine step
//! does).
//!
//! After every step it compares: the messages each role emitted (decoded,
//! record by record) with the ones the model sent; the permits D reported
//! ended, and how ([`kvlease::push::PermitEnd`]), with the model's; P's
//! answer (`register` accepted or refused and why, `begin_write` let through
//! or not, `write_done`, `cancel`); and then the state: each permit live or
//! not on D, its fence in ticks, D's live count and revocations, P's entry
//! count (which shows when P forgets), the WRITEs P let through, and that no
//! WRITE was late.
//!
//! A mutant's counterexample ([`replay_mutant_trace`]) replays up to the
//! step where the mutant's roles differ from the correct ones; there the
//! real roles must do what the correct model does, and so refuse what the
//! mutant did.

use core::time::Duration;

use kvlease::clock_offset::{ClockOffset, ClockOffsetConfig, SampleOutcome};
use kvlease::fabric::ClockSample;
use kvlease::push::wire::{self, PushMessage};
use kvlease::push::{
    PermitFields, PushConfig, PushEnd, PushPermits, PushWrites, Refusal, WriteHandle,
};
use kvlease::{Instant, NonceSource};

use crate::push::{
    Answer, ClockView, Code, DPermit, Effects, PReg, PushAction, PushModel, PushMsg, PushState,
    Refused, DURATION_TICKS, EXTENSION_TICKS, MAX_REQUESTS, WRITE_BOUND_TICKS,
};
use crate::TICK_SECS;

/// P's name for the D peer.
const D_PEER: u16 = 3;
/// D's name for the P peer.
const P_PEER: u16 = 5;
/// P's clock at the model's first instant.
const P_START_SECS: u64 = 100;
/// D's clock minus P's.
const D_AHEAD_SECS: u64 = 1000;

fn tick() -> Duration {
    Duration::from_secs(TICK_SECS)
}

/// The guard's settings in the replay: a tick is [`TICK_SECS`] s.
pub fn push_config() -> PushConfig {
    PushConfig {
        capacity: 4,
        write_bound: tick() * u32::from(WRITE_BOUND_TICKS),
        // No drift allowance in the fence, so that it falls on a tick.
        drift_ppm: 0,
        ..PushConfig::with_duration(tick() * u32::from(DURATION_TICKS))
    }
}

/// P's estimate of D's clock for a model clock view.
pub fn clock_of(view: ClockView) -> ClockOffset {
    let mut c = ClockOffset::new(ClockOffsetConfig::default());
    let p0 = Instant::from_secs(P_START_SECS);
    let d0 = Instant::from_secs(P_START_SECS + D_AHEAD_SECS);
    match view {
        // 2 ms round trip, read in the middle: the offset exactly, bound 1 ms.
        ClockView::Exact => {
            c.observe(ClockSample {
                local_send: p0 - Duration::from_millis(2),
                remote: d0 - Duration::from_millis(1),
                local_recv: p0,
            });
        }
        // 2 s round trip, D read at its very end: the estimate is 1 s too
        // large (D's deadlines look 1 s earlier) and its bound 1 s, so the
        // gate closes 2 s (a tick) and the post margin sooner.
        ClockView::Early => {
            c.observe(ClockSample {
                local_send: p0 - Duration::from_secs(2),
                remote: d0,
                local_recv: p0,
            });
        }
        ClockView::NoSample => {}
    }
    c
}

/// The real roles, driven by a push model trace.
pub struct PushReplay {
    d: PushPermits,
    p: PushWrites,
    clock: ClockOffset,
    now_d: Instant,
    now_p: Instant,
    /// Per request: the fields of its permit, once registered.
    fields: [Option<PermitFields>; MAX_REQUESTS],
    /// Per request: P's handle, once it accepted the registration.
    handles: [Option<WriteHandle>; MAX_REQUESTS],
    /// Per request: P still has it (what the engine passes to `register`).
    live: [bool; MAX_REQUESTS],
    p_alive: bool,
    /// Revocations made.
    revoked: u64,
    /// This step's observations.
    sent: Vec<PushMsg>,
    ended: Vec<(u8, PushEnd)>,
    answer: Option<Answer>,
    errors: Vec<String>,
}

impl PushReplay {
    /// Fresh real roles for a run from `initial` (its clock view), each
    /// polled once at the first instant.
    pub fn new(initial: &PushState) -> Result<PushReplay, String> {
        let config = push_config();
        config
            .validate()
            .map_err(|e| format!("replay config: {e}"))?;
        let ticks = |n: u8| tick() * u32::from(n);
        if config.extension != ticks(EXTENSION_TICKS)
            || config.heartbeat_interval > tick()
            || config.post_margin + Duration::from_millis(10) >= tick()
        {
            return Err(format!(
                "the settings do not fall on the model's ticks: {config:?}"
            ));
        }
        let d = PushPermits::new(
            config,
            NonceSource::from_seed(0, 0x7075_7368, 0x006d_6f64_656c),
        )
        .map_err(|e| format!("PushPermits: {e}"))?;
        let p = PushWrites::new(config, 0x5eed).map_err(|e| format!("PushWrites: {e}"))?;
        let mut r = PushReplay {
            d,
            p,
            clock: clock_of(initial.clock),
            now_d: Instant::from_secs(P_START_SECS + D_AHEAD_SECS),
            now_p: Instant::from_secs(P_START_SECS),
            fields: [None; MAX_REQUESTS],
            handles: [None; MAX_REQUESTS],
            live: [true; MAX_REQUESTS],
            p_alive: true,
            revoked: 0,
            sent: Vec::new(),
            ended: Vec::new(),
            answer: None,
            errors: Vec::new(),
        };
        r.d_poll();
        r.p_poll();
        r.take_errors()?;
        if !r.sent.is_empty() || !r.ended.is_empty() {
            return Err(format!(
                "the first polls did something: {:?} {:?}",
                r.sent, r.ended
            ));
        }
        Ok(r)
    }

    fn take_errors(&mut self) -> Result<(), String> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(std::mem::take(&mut self.errors).join("; "))
        }
    }

    fn req_of(&self, slot: u32, nonce: kvlease::Nonce) -> Option<u8> {
        self.fields
            .iter()
            .position(|f| f.is_some_and(|f| f.slot == slot && f.nonce == nonce))
            .map(|i| i as u8)
    }

    /// A model's count of ticks to `deadline` (one D emits now: never past).
    fn left_to(&self, deadline: Instant) -> Result<i8, String> {
        let t = self.ticks_to(deadline)?;
        i8::try_from(t).map_err(|_| format!("deadline {deadline:?} is {t} ticks away"))
    }

    /// Ticks from D's now to `deadline` (a whole number, or an error).
    fn ticks_to(&self, deadline: Instant) -> Result<u8, String> {
        let ns = deadline.as_nanos().checked_sub(self.now_d.as_nanos());
        let t = tick().as_nanos() as u64;
        match ns {
            Some(ns) if ns % t == 0 && ns / t < 256 => Ok((ns / t) as u8),
            _ => Err(format!(
                "deadline {deadline:?} is not a whole number of ticks after D's now {:?}",
                self.now_d
            )),
        }
    }

    /// Decodes what a role emitted into model messages.
    fn record(&mut self, from_d: bool, peer: u16, msg: &[u8]) {
        let want_peer = if from_d { P_PEER } else { D_PEER };
        if peer != want_peer {
            self.errors
                .push(format!("message to peer {peer}, not {want_peer}"));
        }
        let decoded = match wire::decode(msg) {
            Ok(m) => m,
            Err(e) => {
                self.errors.push(format!(
                    "emitted bytes do not decode ({e}): {:?}",
                    String::from_utf8_lossy(msg)
                ));
                return;
            }
        };
        let mut out = Vec::new();
        let mut unknown = 0;
        match (from_d, decoded) {
            (true, PushMessage::Renew(records)) => {
                for f in records {
                    match (self.req_of(f.slot, f.nonce), self.left_to(f.deadline)) {
                        (Some(req), Ok(left)) => out.push(PushMsg::Renew { req, left }),
                        (_, Err(e)) => self.errors.push(e),
                        (None, _) => unknown += 1,
                    }
                }
            }
            (true, PushMessage::Revoke(records)) => {
                for (slot, nonce) in records {
                    match self.req_of(slot, nonce) {
                        Some(req) => out.push(PushMsg::Revoke { req }),
                        None => unknown += 1,
                    }
                }
            }
            (false, PushMessage::Alive(records)) => {
                for (slot, nonce) in records {
                    match self.req_of(slot, nonce) {
                        Some(req) => out.push(PushMsg::Alive { req }),
                        None => unknown += 1,
                    }
                }
            }
            (false, PushMessage::End(records)) => {
                for (slot, nonce, code) in records {
                    match self.req_of(slot, nonce) {
                        Some(req) => out.push(PushMsg::End {
                            req,
                            code: Code::of(code),
                        }),
                        None => unknown += 1,
                    }
                }
            }
            (from_d, m) => self.errors.push(format!(
                "{} emitted the other side's form: {m:?}",
                if from_d { "D" } else { "P" }
            )),
        }
        if unknown > 0 {
            self.errors
                .push(format!("{unknown} records name no permit of the replay"));
        }
        self.sent.extend(out);
    }

    fn d_poll(&mut self) {
        let mut msgs = Vec::new();
        let mut ends = Vec::new();
        self.d.poll(
            self.now_d,
            |peer, m| msgs.push((peer, m.to_vec())),
            |e| ends.push(e),
        );
        self.note_ends(ends);
        for (peer, m) in msgs {
            self.record(true, peer, &m);
        }
    }

    fn note_ends(&mut self, ends: Vec<kvlease::push::PermitEnd>) {
        for e in ends {
            match self.req_of(e.slot, e.nonce) {
                Some(req) if e.peer == P_PEER => self.ended.push((req, e.end)),
                _ => self
                    .errors
                    .push(format!("D ended a permit of no request: {e:?}")),
            }
        }
    }

    fn p_poll(&mut self) {
        if !self.p_alive {
            return;
        }
        let mut msgs = Vec::new();
        let clock = &self.clock;
        self.p.poll(
            |peer| (peer == D_PEER).then_some(clock),
            self.now_p,
            |peer, m| msgs.push((peer, m.to_vec())),
        );
        for (peer, m) in msgs {
            self.record(false, peer, &m);
        }
    }

    fn fields(&self, req: u8) -> Result<PermitFields, String> {
        self.fields[usize::from(req)].ok_or_else(|| format!("request {req} was never registered"))
    }

    /// The wire bytes of one model message.
    fn encode(&self, m: PushMsg) -> Result<Vec<u8>, String> {
        let rec = |req: u8| -> Result<Vec<u8>, String> {
            Ok(self.fields(req)?.encode()[..wire::PERMIT_RECORD_LEN].to_vec())
        };
        Ok(match m {
            PushMsg::Reg { req, .. } => self.fields(req)?.encode().to_vec(),
            PushMsg::Renew { req, left } => {
                // A `PRN:` counted down to `PAST` is a tick behind or more:
                // it raises nothing either way (P's held deadlines are ahead).
                let off = tick() * u32::from(left.unsigned_abs());
                let deadline = if left >= 0 {
                    self.now_d + off
                } else {
                    self.now_d - off
                };
                let f = PermitFields {
                    deadline,
                    ..self.fields(req)?
                };
                [wire::RENEW_PREFIX, &f.encode()[..]].concat()
            }
            PushMsg::Revoke { req } => [wire::REVOKE_PREFIX, &rec(req)?[..]].concat(),
            PushMsg::Alive { req } => [wire::ALIVE_PREFIX, &rec(req)?[..]].concat(),
            PushMsg::End { req, code } => {
                let c = match code {
                    Code::W => b'W',
                    Code::R => b'R',
                    Code::X => b'X',
                };
                [wire::END_PREFIX, &rec(req)?[..], &[c][..]].concat()
            }
        })
    }

    /// Applies `action` to the real roles and collects what they did.
    fn apply(&mut self, action: PushAction) -> Result<(), String> {
        self.sent.clear();
        self.ended.clear();
        self.answer = None;
        match action {
            PushAction::Register(i) => {
                let f = self
                    .d
                    .register(P_PEER, self.now_d)
                    .map_err(|e| format!("real register refused: {e}"))?;
                self.fields[usize::from(i)] = Some(f);
                let left = self.left_to(f.deadline)?;
                self.sent.push(PushMsg::Reg { req: i, left });
                self.d_poll();
            }
            PushAction::Revoke(i) => {
                let f = self.fields(i)?;
                self.d
                    .revoke(f.slot, f.nonce)
                    .map_err(|e| format!("real revoke refused: {e}"))?;
                self.revoked += 1;
                self.d_poll();
            }
            PushAction::Post(i) => {
                let Some(h) = self.handles[usize::from(i)] else {
                    return Err(format!("P has no handle for request {i}"));
                };
                let r = self.p.begin_write(h, &self.clock, self.now_p);
                self.answer = Some(Answer::BeginWrite(r.is_ok()));
                self.p_poll();
            }
            PushAction::Land(i) | PushAction::Fail(i) => {
                if self.p_alive {
                    let ok = matches!(action, PushAction::Land(_));
                    let done = match self.handles[usize::from(i)] {
                        Some(h) => self.p.write_done(h, ok, self.now_p),
                        None => false,
                    };
                    self.answer = Some(Answer::WriteDone(done));
                    self.p_poll();
                }
            }
            PushAction::LetGo(i) => {
                self.live[usize::from(i)] = false;
                let cancelled = match self.handles[usize::from(i)] {
                    Some(h) => self.p.cancel(h),
                    None => false,
                };
                self.answer = Some(Answer::Cancel(cancelled));
                self.p_poll();
            }
            PushAction::PDies => self.p_alive = false,
            PushAction::Resample => {
                // 2 ms round trip, read in the middle: exact, bound 1 ms.
                let sample = ClockSample {
                    local_send: self.now_p - Duration::from_millis(2),
                    remote: self.now_d - Duration::from_millis(1),
                    local_recv: self.now_p,
                };
                if self.clock.observe(sample) != SampleOutcome::Adopted {
                    return Err("P's estimate kept its old sample".into());
                }
            }
            PushAction::Tick => {
                self.now_d = self.now_d + tick();
                self.now_p = self.now_p + tick();
                self.d_poll();
                self.p_poll();
            }
            PushAction::Deliver(m) => {
                let bytes = self.encode(m)?;
                match m {
                    // A dead P takes nothing in.
                    PushMsg::Reg { .. } | PushMsg::Renew { .. } | PushMsg::Revoke { .. }
                        if !self.p_alive => {}
                    PushMsg::Reg { req, .. } => {
                        let f = PermitFields::decode(&bytes)
                            .map_err(|e| format!("registration field: {e}"))?;
                        let r = self.p.register(
                            D_PEER,
                            f,
                            self.live[usize::from(req)],
                            &self.clock,
                            self.now_p,
                        );
                        let answer = match r {
                            Ok(h) => {
                                self.handles[usize::from(req)] = Some(h);
                                Ok(())
                            }
                            Err(Refusal::RequestGone) => Err(Refused::Gone),
                            Err(Refusal::NoClock) => Err(Refused::NoClock),
                            Err(Refusal::PastDeadline) => Err(Refused::PastDeadline),
                            Err(Refusal::AlreadyEnded(c)) => {
                                Err(Refused::AlreadyEnded(Code::of(c)))
                            }
                            Err(Refusal::Exhausted) => {
                                return Err("P ran out of entries".into());
                            }
                        };
                        self.answer = Some(Answer::Register(answer));
                        self.p_poll();
                    }
                    PushMsg::Renew { .. } | PushMsg::Revoke { .. } => {
                        self.p
                            .on_message(D_PEER, &bytes)
                            .map_err(|e| format!("P refused {m:?}: {e}"))?;
                        self.p_poll();
                    }
                    PushMsg::Alive { .. } | PushMsg::End { .. } => {
                        let mut ends = Vec::new();
                        self.d
                            .on_message(P_PEER, &bytes, self.now_d, |e| ends.push(e))
                            .map_err(|e| format!("D refused {m:?}: {e}"))?;
                        self.note_ends(ends);
                        self.d_poll();
                    }
                }
            }
            PushAction::Drop(_) | PushAction::Duplicate(_) => {}
        }
        self.take_errors()
    }

    /// What the real roles did in the last step, next to the model's.
    fn compare_effects(&self, want: &Effects) -> Result<(), String> {
        let mut got_sent = self.sent.clone();
        let mut want_sent = want.sent.clone();
        got_sent.sort();
        want_sent.sort();
        if got_sent != want_sent {
            return Err(format!("messages: real {got_sent:?}, model {want_sent:?}"));
        }
        let key = |e: &(u8, PushEnd)| (e.0, format!("{:?}", e.1));
        let mut got_ended = self.ended.clone();
        let mut want_ended = want.ended.clone();
        got_ended.sort_by_key(key);
        want_ended.sort_by_key(key);
        if got_ended != want_ended {
            return Err(format!(
                "ended permits: real {got_ended:?}, model {want_ended:?}"
            ));
        }
        if self.answer != want.answer {
            return Err(format!(
                "P's answer: real {:?}, model {:?}",
                self.answer, want.answer
            ));
        }
        Ok(())
    }

    /// Every observable of the real roles' state, next to the model's `s`.
    fn compare_state(&self, s: &PushState) -> Result<(), String> {
        let mut live = 0;
        for (i, d) in s.d.iter().enumerate() {
            let real = self.fields[i].and_then(|f| self.d.deadline(f.slot, f.nonce));
            match (d, real) {
                (DPermit::Unregistered, _) if self.fields[i].is_none() => {}
                (DPermit::Open { fence } | DPermit::Revoking { fence }, Some(deadline)) => {
                    live += 1;
                    let got = self.ticks_to(self.d.fence(deadline))?;
                    if got != *fence {
                        return Err(format!(
                            "permit {i}: real fence in {got} ticks, model {fence}"
                        ));
                    }
                }
                (DPermit::Ended { .. }, None) if self.fields[i].is_some() => {}
                (d, real) => {
                    return Err(format!(
                        "permit {i}: real deadline {real:?} (registered: {}), model {d:?}",
                        self.fields[i].is_some()
                    ))
                }
            }
        }
        if self.d.live() != live {
            return Err(format!("D: real live {}, model {live}", self.d.live()));
        }
        // Revoked: revoking, or ended so (the correct roles end a revoked
        // permit `Revoked` whatever ends it).
        let want_revoked =
            s.d.iter()
                .filter(|d| {
                    matches!(
                        d,
                        DPermit::Revoking { .. }
                            | DPermit::Ended {
                                end: PushEnd::Revoked,
                                ..
                            }
                    )
                })
                .count() as u64;
        if self.d.counters().revoked != want_revoked {
            return Err(format!(
                "D: real revocations {}, model {want_revoked}",
                self.d.counters().revoked
            ));
        }
        if self.revoked != want_revoked {
            return Err(format!(
                "revocations made {}, model {want_revoked}",
                self.revoked
            ));
        }
        let entries = s.p.iter().filter(|p| p.entry()).count() as u32;
        if self.p.held() != entries {
            return Err(format!(
                "P: real entries {}, model {entries} ({:?})",
                self.p.held(),
                s.p
            ));
        }
        for (i, p) in s.p.iter().enumerate() {
            if matches!(p, PReg::Held { .. } | PReg::Posted { .. }) && self.handles[i].is_none() {
                return Err(format!(
                    "P: model holds {i} ({p:?}), real never accepted it"
                ));
            }
        }
        let c = self.p.counters();
        let posted: u64 = s.ghost.iter().map(|g| u64::from(g.posts)).sum();
        if c.posted != posted {
            return Err(format!(
                "P: real WRITEs let through {}, model {posted}",
                c.posted
            ));
        }
        if c.late_writes != 0 {
            return Err(format!("P: {} WRITEs past the write bound", c.late_writes));
        }
        if self.p_alive != s.p_alive || self.live[..] != s.live[..] {
            return Err("P's liveness or its requests differ".into());
        }
        Ok(())
    }

    /// Applies `action` (the model's step from `before` to `after`) to the
    /// real roles and compares them with the model's effects and `after`.
    pub fn step(
        &mut self,
        model: &PushModel,
        before: &PushState,
        action: PushAction,
        after: &PushState,
    ) -> Result<(), String> {
        let Some((next, fx)) = model.step(before, action) else {
            return Err("the model cannot take this step".into());
        };
        if &next != after {
            return Err(format!(
                "the trace's state is not the model's step: {after:?} vs {next:?}"
            ));
        }
        self.apply(action)?;
        self.compare_effects(&fx)?;
        self.compare_state(after)
    }

    /// What the real roles did in the last step, for a report.
    fn describe(&self) -> String {
        format!(
            "answer {:?}, ended {:?}, sent {:?}",
            self.answer, self.ended, self.sent
        )
    }
}

/// Replays the whole `trace` of `model` on fresh real roles; the first
/// disagreement, with the step it happened at.
pub fn replay_push_trace(
    model: &PushModel,
    initial: &PushState,
    trace: &[(PushAction, PushState)],
) -> Result<(), String> {
    let mut replay = PushReplay::new(initial)?;
    let mut before = initial;
    for (k, (action, after)) in trace.iter().enumerate() {
        replay
            .step(model, before, *action, after)
            .map_err(|e| format!("step {} ({action:?}): {e}", k + 1))?;
        before = after;
    }
    Ok(())
}

/// Where the real roles refused a mutant's counterexample.
#[derive(Clone, Debug)]
pub struct MutantRefusal {
    /// The step (1-based) where the mutant's roles differ from the correct ones.
    pub step: usize,
    /// Its action.
    pub action: PushAction,
    /// What the mutated model did there.
    pub mutant: String,
    /// What the real roles did there (the correct model's step, or nothing).
    pub real: String,
}

/// Replays a counterexample of the mutated `model` on the real roles: every
/// step the correct roles would take alike must agree with the real roles;
/// at the first step where the mutant differs, the real roles must do what
/// the correct model does (or, where the correct model has no such step,
/// refuse without any effect) and so not what the mutant did.
pub fn replay_mutant_trace(
    model: &PushModel,
    initial: &PushState,
    trace: &[(PushAction, PushState)],
) -> Result<MutantRefusal, String> {
    let correct = PushModel::new(model.bound, None);
    let mut replay = PushReplay::new(initial)?;
    let mut before = initial;
    for (k, (action, after)) in trace.iter().enumerate() {
        let step = k + 1;
        let mutated = model.step(before, *action);
        let right = correct.step(before, *action);
        if mutated == right {
            replay
                .step(model, before, *action, after)
                .map_err(|e| format!("step {step} ({action:?}), before the mutant's: {e}"))?;
            before = after;
            continue;
        }
        let Some((_, mfx)) = mutated else {
            return Err(format!(
                "step {step}: the mutated model cannot take {action:?}"
            ));
        };
        replay
            .apply(*action)
            .map_err(|e| format!("step {step} ({action:?}), the mutant's: {e}"))?;
        match right {
            Some((rs, rfx)) => {
                replay.compare_effects(&rfx).map_err(|e| {
                    format!(
                        "step {step} ({action:?}): the real roles are not the correct model: {e}"
                    )
                })?;
                replay.compare_state(&rs).map_err(|e| {
                    format!(
                        "step {step} ({action:?}): the real roles are not the correct model: {e}"
                    )
                })?;
            }
            None => {
                // No such step in the correct model: the real roles must
                // refuse it and change nothing.
                let refused = replay.sent.is_empty()
                    && replay.ended.is_empty()
                    && matches!(
                        replay.answer,
                        None | Some(Answer::BeginWrite(false) | Answer::WriteDone(false))
                    );
                if !refused {
                    return Err(format!(
                        "step {step} ({action:?}): the real roles took a step the correct model has not: {}",
                        replay.describe()
                    ));
                }
                replay.compare_state(before).map_err(|e| {
                    format!(
                        "step {step} ({action:?}): the real roles changed on a refused step: {e}"
                    )
                })?;
            }
        }
        if replay.compare_effects(&mfx).is_ok() {
            return Err(format!(
                "step {step} ({action:?}): the real roles did what the mutant did: {}",
                replay.describe()
            ));
        }
        return Ok(MutantRefusal {
            step,
            action: *action,
            mutant: format!(
                "answer {:?}, ended {:?}, sent {:?}",
                mfx.answer, mfx.ended, mfx.sent
            ),
            real: replay.describe(),
        });
    }
    Err("the mutant's roles never differ from the correct ones on this trace".into())
}
