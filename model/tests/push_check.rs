//! The model check of push mode's guard (`kvlease::push`): every property
//! holds in every interleaving to the CI bounds, the examples happen, each
//! mutant breaks "no WRITE lands in a freed block" with a printed
//! counterexample that the real roles replay up to the mutant's step and
//! refuse there, and traces of the correct model replay on the real
//! `PushPermits` and `PushWrites`, wire bytes between them.

use std::collections::BTreeSet;

use kvlease_model::push::{
    check_push, Answer, ClockView, Code, PReg, PushAction, PushBound, PushModel, PushMsg,
    PushMutant, PushState, Refused, EX_DEAD_WRITE_LANDS, EX_FAILED_WRITE, EX_LATE_REFUSED,
    EX_NO_CLOCK, EX_PAST_DEADLINE, EX_P_DEAD_LAPSED, EX_REFUSED_DUP_ANSWERED, EX_RENEWED_WRITTEN,
    EX_REVOKED_AT_FENCE, EX_REVOKED_WAITED, EX_RUN_ENDS, EX_WRITTEN,
};
use kvlease_model::push_replay::{replay_mutant_trace, replay_push_trace};

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The examples (`sometimes` properties) a bound must show.
fn expected_examples(bound: &PushBound) -> Vec<&'static str> {
    let mut want = vec![
        EX_WRITTEN,
        EX_RENEWED_WRITTEN,
        EX_PAST_DEADLINE,
        EX_RUN_ENDS,
    ];
    if bound.revokes > 0 {
        want.extend([EX_REVOKED_WAITED, EX_REVOKED_AT_FENCE]);
    }
    if bound.let_gos > 0 {
        want.push(EX_LATE_REFUSED);
    }
    if bound.p_deaths > 0 {
        want.extend([EX_P_DEAD_LAPSED, EX_DEAD_WRITE_LANDS]);
    }
    if bound.failed_writes > 0 {
        want.push(EX_FAILED_WRITE);
    }
    if bound.no_clock {
        want.push(EX_NO_CLOCK);
    }
    if bound.samples > 0 && bound.dups > 0 && (bound.no_clock || bound.early_clock) {
        want.push(EX_REFUSED_DUP_ANSWERED);
    }
    want
}

/// The correct guard: every `always` property holds in every state to the
/// bound, every example happens, and each example's run (the shortest that
/// shows it) replays on the real roles.
#[test]
fn every_push_property_holds_to_the_ci_bound() {
    for (name, bound) in PushBound::CI {
        let model = PushModel::new(bound, None);
        let report = check_push(model.clone(), threads());
        println!("push model check [{name}] {bound:?}: {report}");
        for v in report.violations() {
            println!("VIOLATED: {v}\n{}", report.trace(v).unwrap_or_default());
        }
        assert!(report.violations().is_empty(), "[{name}] properties failed");
        assert!(
            report.max_depth < bound.depth,
            "[{name}] the depth bound cut the search: raise it"
        );
        for example in expected_examples(&bound) {
            let Some((init, trace)) = report.discoveries.get(example) else {
                panic!("[{name}] never happened: {example}");
            };
            if let Err(e) = replay_push_trace(&model, init, trace) {
                panic!(
                    "[{name}] the example \"{example}\" does not replay on the real roles: {e}\n{}",
                    report.trace(example).unwrap_or_default()
                );
            }
        }
        assert!(report.unique_states > 1_000, "[{name}] suspiciously small");
    }
}

fn mutant_breaks(mutant: PushMutant) {
    let bound = mutant.bound();
    let model = PushModel::new(bound, Some(mutant));
    let report = check_push(model.clone(), threads());
    let property = mutant.breaks();
    println!("push mutant {mutant:?} {bound:?}: {report}");
    let Some((init, trace)) = report.discoveries.get(property) else {
        panic!(
            "mutant {mutant:?} survived: no counterexample to \"{property}\" (found {:?})",
            report.violations()
        );
    };
    println!(
        "counterexample to \"{property}\":\n{}",
        report.trace(property).unwrap_or_default()
    );
    match replay_mutant_trace(&model, init, trace) {
        Ok(r) => println!(
            "replayed on the real roles: they agree up to step {} ({:?}), where the mutant did [{}] and the real roles [{}]",
            r.step, r.action, r.mutant, r.real
        ),
        Err(e) => panic!("mutant {mutant:?}: the counterexample does not replay: {e}"),
    }
    // The correct model at the mutant's bound finds nothing.
    let correct = check_push(PushModel::new(bound, None), threads());
    assert!(
        correct.violations().is_empty(),
        "the correct model fails at the mutant's bound: {:?}",
        correct.violations()
    );
}

#[test]
fn mutant_free_on_abort_lands_a_write_in_freed_blocks() {
    mutant_breaks(PushMutant::FreeOnAbort);
}

#[test]
fn mutant_post_after_end_lands_a_write_in_freed_blocks() {
    mutant_breaks(PushMutant::PostAfterEnd);
}

/// xorshift64*: a seeded, dependency-free choice of successors.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

fn successors(model: &PushModel, s: &PushState) -> Vec<(PushAction, PushState)> {
    let mut all = Vec::new();
    model.candidate_actions(s, &mut all);
    all.into_iter()
        .filter_map(|a| model.step(s, a).map(|(n, _)| (a, n)))
        .collect()
}

/// An action's kind: its variant's name.
fn kind(a: &PushAction) -> String {
    let s = format!("{a:?}");
    s.split('(').next().unwrap_or_default().to_string()
}

/// Random walks of the correct model, each replayed on fresh real roles,
/// with nothing pruned from the network (so stale and duplicate messages,
/// and messages about a slot D reused, reach the real roles too).
#[test]
fn push_model_traces_replay_on_the_real_roles() {
    let mut steps = 0usize;
    let mut kinds = BTreeSet::new();
    let runs = PushBound::CI
        .into_iter()
        .chain([("resample", PushBound::RESAMPLE)]);
    for (name, bound) in runs {
        // Nothing pruned: the stale messages reach the real roles too.
        let model = PushModel {
            prune: false,
            ..PushModel::new(bound, None)
        };
        let inits = model.initial_states();
        let mut rng = Rng(0x7075_7368_6d6f_6431);
        for w in 0..1000 {
            let init = inits[w % inits.len()].clone();
            let mut s = init.clone();
            let mut trace = Vec::new();
            for _ in 0..bound.depth {
                let next = successors(&model, &s);
                if next.is_empty() {
                    break;
                }
                let (a, n) = next[rng.below(next.len())].clone();
                kinds.insert(kind(&a));
                trace.push((a, n.clone()));
                s = n;
            }
            steps += trace.len();
            if let Err(e) = replay_push_trace(&model, &init, &trace) {
                let listing: Vec<String> = trace.iter().map(|(a, _)| format!("{a:?}")).collect();
                panic!(
                    "[{name}] walk {w} (clock {:?}): the real roles disagree with the model at {e}\ntrace:\n{}",
                    init.clock,
                    listing.join("\n")
                );
            }
        }
    }
    println!(
        "replayed {steps} push model steps on the real roles ({} kinds of action)",
        kinds.len()
    );
    let all = [
        "Register",
        "Revoke",
        "Post",
        "Land",
        "Fail",
        "LetGo",
        "PDies",
        "Resample",
        "Tick",
        "Deliver",
        "Drop",
        "Duplicate",
    ];
    let missing: Vec<_> = all.iter().filter(|k| !kinds.contains(**k)).collect();
    assert!(missing.is_empty(), "never replayed: {missing:?}");
}

/// The library bug this model found (see `PushBound::RESAMPLE`), now fixed
/// in `kvlease::push::PushWrites`: P forgot an ended registration once its
/// gate was closed under the clock estimate of the moment (with no sample:
/// at once), and accepted a duplicate of it after a better estimate (its
/// first sample, or a tighter one) opened the gate again; it then posted a
/// WRITE into blocks D freed. P now forgets an entry only once its deadline
/// surely passed, never without a sample: no property fails with the
/// estimate improving during a run, and the examples still replay.
#[test]
fn a_better_clock_estimate_does_not_reopen_a_forgotten_registration() {
    let bound = PushBound::RESAMPLE;
    let model = PushModel::new(bound, None);
    let report = check_push(model.clone(), threads());
    println!("push model check [resample] {bound:?}: {report}");
    for v in report.violations() {
        println!("VIOLATED: {v}\n{}", report.trace(v).unwrap_or_default());
        if let Some((init, trace)) = report.discoveries.get(v) {
            match replay_push_trace(&model, init, trace) {
                Ok(()) => println!("the real roles replay it, step by step: a real bug"),
                Err(e) => println!("the real roles differ from the model at {e}: update the model"),
            }
        }
    }
    assert!(
        report.violations().is_empty(),
        "[resample] properties failed"
    );
    assert!(
        report.max_depth < bound.depth,
        "[resample] the depth bound cut the search: raise it"
    );
    for example in expected_examples(&bound) {
        let Some((init, trace)) = report.discoveries.get(example) else {
            panic!("[resample] never happened: {example}");
        };
        if let Err(e) = replay_push_trace(&model, init, trace) {
            panic!(
                "[resample] the example \"{example}\" does not replay on the real roles: {e}\n{}",
                report.trace(example).unwrap_or_default()
            );
        }
    }
}

/// The counterexample [`PushBound::RESAMPLE`] found, step by step, on the
/// fixed roles (the model's and the real ones, replayed): P without a clock
/// sample refuses the registration and D frees its blocks on the answer;
/// after a tick and P's first sample a duplicate of the registration, which
/// the gate would let through now, is answered `R` again from the entry P
/// kept, and P has nothing to post under.
#[test]
fn the_resample_counterexample_is_answered_again_on_the_fixed_roles() {
    let model = PushModel::new(PushBound::RESAMPLE, None);
    let init = model
        .initial_states()
        .into_iter()
        .find(|s| s.clock == ClockView::NoSample)
        .expect("RESAMPLE starts without a sample too");
    let reg = |left| PushMsg::Reg { req: 0, left };
    let actions = [
        PushAction::Register(0),
        PushAction::Duplicate(reg(3)),
        PushAction::Deliver(reg(3)),
        PushAction::Deliver(PushMsg::End {
            req: 0,
            code: Code::R,
        }),
        PushAction::Tick,
        PushAction::Resample,
        PushAction::Deliver(reg(2)),
    ];
    let mut s = init.clone();
    let mut trace = Vec::new();
    let mut last = None;
    for a in actions {
        let Some((n, fx)) = model.step(&s, a) else {
            panic!("the model cannot take {a:?} from {s:?}");
        };
        last = fx.answer;
        trace.push((a, n.clone()));
        s = n;
    }
    assert_eq!(
        last,
        Some(Answer::Register(Err(Refused::AlreadyEnded(Code::R)))),
        "the duplicate was not answered from the kept entry"
    );
    assert!(matches!(s.p[0], PReg::Ended { code: Code::R, .. }));
    assert!(s.ghost[0].refused_dup_answered);
    assert!(
        model.step(&s, PushAction::Post(0)).is_none(),
        "P may post under a refused registration"
    );
    replay_push_trace(&model, &init, &trace)
        .unwrap_or_else(|e| panic!("the real roles differ from the model at {e}"));
    // Once the deadline surely passed P forgets the entry; a duplicate is
    // then refused at the gate, under any estimate.
    let mut ticks = 0;
    while s.p[0] != PReg::Forgotten {
        let (n, _) = model
            .step(&s, PushAction::Tick)
            .expect("time passes until P forgets");
        trace.push((PushAction::Tick, n.clone()));
        s = n;
        ticks += 1;
    }
    assert_eq!(ticks, 3, "forgotten a tick after the deadline");
    replay_push_trace(&model, &init, &trace)
        .unwrap_or_else(|e| panic!("the real roles differ from the model at {e}"));
}
