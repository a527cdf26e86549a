//! The model's abstraction of the P roles is honest: traces of the model,
//! replayed on the real `PrefillScheduler` and `PrefillRank`s (role messages
//! and notifications as bytes, lost directive messages left out, read-dones
//! from named senders), show the same slot words, held leases, time left,
//! grants, cancels, drains and slot checks after every step.
//!
//! Built with `--features mutant_...` (`.ci/mutants.sh`), the real
//! roles carry that bug and the model carries its mirror: they must still
//! agree, and the model must still find the counterexample.

use kvlease_model::replay::{replay_trace, Replay};
use kvlease_model::{Action, Bound, Mutant, ProtocolModel, State};
use stateright::Model;

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

/// The checker sees every enabled action: the cheap filter of the model's
/// action list ([`ProtocolModel::plausible`]) never hides one.
fn hides_nothing(model: &ProtocolModel, s: &State) {
    let mut all = Vec::new();
    model.candidate_actions(s, &mut all);
    for a in all {
        if model.next_state(s, a).is_some() {
            assert!(
                model.plausible(s, a),
                "plausible() hides the enabled {a:?} in {s:?}"
            );
        }
    }
}

/// A walk from the initial state until nothing is enabled or `depth` steps.
/// With `prefer`, an action of that kind is taken whenever one is enabled,
/// and no other directive loss spends the budget first (a uniform walk
/// seldom keeps it until the backstop can lose its probe).
fn walk(
    model: &ProtocolModel,
    rng: &mut Rng,
    depth: usize,
    prefer: Option<&str>,
) -> Vec<(Action, State)> {
    let mut s = model.initial();
    let mut trace = Vec::new();
    for _ in 0..depth {
        hides_nothing(model, &s);
        let next = model.successors(&s);
        if next.is_empty() {
            break;
        }
        let (a, n) = match prefer {
            None => next[rng.below(next.len())].clone(),
            Some(p) => match next.iter().find(|(a, _)| kind(a) == p) {
                Some(x) => x.clone(),
                None => {
                    let rest: Vec<_> = next
                        .iter()
                        .filter(|(a, _)| !kind(a).ends_with("MissedBy"))
                        .collect();
                    if rest.is_empty() {
                        next[rng.below(next.len())].clone()
                    } else {
                        rest[rng.below(rest.len())].clone()
                    }
                }
            },
        };
        trace.push((a, n.clone()));
        s = n;
    }
    trace
}

#[test]
fn model_traces_replay_on_the_real_roles() {
    let mutant = Replay::mutant();
    let mut steps = 0usize;
    let mut actions = std::collections::HashSet::<String>::new();
    for (name, bound) in Bound::CI {
        let model = ProtocolModel::new(bound, mutant);
        let mut rng = Rng(0x6b76_6c65_6173_6531);
        for w in 0..3000 {
            // One walk in ten favours the backstop losing its probe.
            let prefer = (w % 10 == 0).then_some("BackstopMissedBy");
            let trace = walk(&model, &mut rng, bound.depth, prefer);
            steps += trace.len();
            for (a, _) in &trace {
                actions.insert(kind(a));
            }
            if let Err(e) = replay_trace(&model.initial(), &trace, &bound) {
                let listing: Vec<String> = trace.iter().map(|(a, _)| format!("{a:?}")).collect();
                panic!(
                    "[{name}] walk {w}: the real roles disagree with the model at {e}\ntrace:\n{}",
                    listing.join("\n")
                );
            }
        }
    }
    println!(
        "replayed {steps} model steps on the real roles ({} kinds of action), mutant {mutant:?}",
        actions.len()
    );
    // Every kind of action was replayed (all 19 of them), but those the
    // mutant makes unreachable: freed at its first report, a lease never
    // waits for a second rank, so the backstop never has anyone to probe;
    // with "not held" ignored, a probe that is not lost changes nothing.
    let unreachable: &[&str] = match mutant {
        Some(Mutant::FreeOnFirstReport) => &["Backstop", "BackstopMissedBy"],
        Some(Mutant::IgnoreNotHeld) => &["Backstop"],
        _ => &[],
    };
    let missing: Vec<_> = ALL_KINDS
        .iter()
        .filter(|k| !actions.contains(**k) && !unreachable.contains(k))
        .collect();
    assert!(missing.is_empty(), "never replayed: {missing:?}");
    assert!(
        actions.iter().all(|a| ALL_KINDS.contains(&a.as_str())),
        "an action kind this test does not list: {actions:?}"
    );
}

/// Every kind of [`Action`], by name.
const ALL_KINDS: [&str; 19] = [
    "Grant",
    "GrantMissedBy",
    "Cancel",
    "CancelMissedBy",
    "Backstop",
    "BackstopMissedBy",
    "RankLost",
    "FreeBlocks",
    "Poll",
    "Tick",
    "Heartbeat",
    "StartRead",
    "CheckSlot",
    "Deliver",
    "Drop",
    "Duplicate",
    "CrashD",
    "CrashRank",
    "RestartP",
];

/// An action's kind: its variant's name.
fn kind(a: &Action) -> String {
    let s = format!("{a:?}");
    s.split('(').next().unwrap_or_default().to_string()
}

/// With the real roles mutated (`.ci/mutants.sh`), the model's
/// counterexample to the property the bug breaks is a trace of the real
/// roles too: replayed on them, they agree at every step, down to the step
/// that breaks the property. Without a mutant, this checks the correct
/// model finds nothing to replay.
#[test]
fn the_counterexample_is_a_trace_of_the_real_roles() {
    let Some(mutant) = Replay::mutant() else {
        let mut bounds: Vec<Bound> = Mutant::ALL.iter().map(|m| m.bound()).collect();
        bounds.dedup();
        for bound in bounds {
            let report = kvlease_model::check(ProtocolModel::new(bound, None), 2);
            println!("no real mutant in this build; correct model at a mutant bound: {report}");
            assert!(report.violations().is_empty());
        }
        return;
    };
    let bound = mutant.bound();
    let model = ProtocolModel::new(bound, Some(mutant));
    let report = kvlease_model::check(model.clone(), 2);
    let property = mutant.breaks();
    let Some(trace) = report.discoveries.get(property) else {
        panic!("mutant {mutant:?}: the model found no counterexample to \"{property}\"");
    };
    println!(
        "real mutant {mutant:?}: counterexample to \"{property}\":\n{}",
        report.trace(property).unwrap_or_default()
    );
    if let Err(e) = replay_trace(&model.initial(), trace, &bound) {
        panic!("the real mutated roles disagree with the mutated model at {e}");
    }
    println!("replayed on the real mutated roles: they agree at every step");
}

/// The replay tells the bugs apart: on the correct real roles, the
/// counterexample of every model mutant stops replaying at a step where the
/// real roles behave differently (so agreement above means something).
#[test]
fn a_mutant_counterexample_does_not_replay_on_the_correct_roles() {
    if Replay::mutant().is_some() {
        println!("real roles mutated in this build: see the test above");
        return;
    }
    for mutant in Mutant::ALL {
        let bound = mutant.bound();
        let model = ProtocolModel::new(bound, Some(mutant));
        let report = kvlease_model::check(model.clone(), 2);
        let Some(trace) = report.discoveries.get(mutant.breaks()) else {
            panic!("mutant {mutant:?}: no counterexample");
        };
        match replay_trace(&model.initial(), trace, &bound) {
            Ok(()) => panic!("the correct roles replayed the {mutant:?} counterexample"),
            Err(e) => println!("mutant {mutant:?}: the correct roles differ at {e}"),
        }
    }
}
