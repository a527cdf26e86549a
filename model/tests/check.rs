//! The model check of issues 14 and 19: every property holds in every
//! interleaving to the CI bound, and each mutant breaks its property with a
//! printed counterexample.

use kvlease_model::{
    check, Bound, Mutant, ProtocolModel, EX_ACCEPTED, EX_MISSED_BACKSTOP, EX_MISSED_CANCELLED,
    EX_REJECTED_FREED, EX_RUN_ENDS_ALIVE, EX_RUN_ENDS_CRASH, EX_SLOT_REUSED, EX_TWO_READERS,
};

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The examples (`sometimes` properties) a bound must show: the model is not
/// vacuous, and what the bound adds does happen in it.
fn expected_examples(bound: &Bound) -> Vec<&'static str> {
    let mut want = vec![EX_ACCEPTED, EX_REJECTED_FREED, EX_RUN_ENDS_ALIVE];
    if bound.requests > bound.slots {
        want.push(EX_SLOT_REUSED);
    }
    if bound.d_crashes > 0 {
        want.push(EX_RUN_ENDS_CRASH);
    }
    if bound.d_tp == 4 {
        want.push(EX_TWO_READERS);
    }
    if bound.directive_losses > 0 {
        // The backstop ends a lease a rank missed the Grant of, and so
        // does an engine's cancel.
        want.push(EX_MISSED_BACKSTOP);
        if bound.cancels > 0 {
            want.push(EX_MISSED_CANCELLED);
        }
    }
    want
}

/// The correct protocol: every `always` property holds in every state to
/// the bound, and the `sometimes` ones (the model is not vacuous) are seen.
#[test]
fn every_property_holds_to_the_ci_bound() {
    for (name, bound) in Bound::CI {
        let report = check(ProtocolModel::new(bound, None), threads());
        println!("model check [{name}] {bound:?}: {report}");
        for v in report.violations() {
            println!("VIOLATED: {v}\n{}", report.trace(v).unwrap_or_default());
        }
        assert!(report.violations().is_empty(), "[{name}] properties failed");
        assert!(
            report.max_depth < bound.depth,
            "[{name}] the depth bound cut the search: raise it"
        );
        for example in expected_examples(&bound) {
            assert!(
                report.discoveries.contains_key(example),
                "[{name}] never happened: {example}"
            );
        }
        assert!(report.unique_states > 10_000, "[{name}] suspiciously small");
    }
}

fn mutant_breaks(mutant: Mutant) {
    let bound = mutant.bound();
    let report = check(ProtocolModel::new(bound, Some(mutant)), threads());
    let property = mutant.breaks();
    let trace = report.trace(property);
    println!("mutant {mutant:?} {bound:?}: {report}");
    match &trace {
        Some(t) => println!("counterexample to \"{property}\":\n{t}"),
        None => println!("no counterexample; found: {:?}", report.violations()),
    }
    assert!(
        trace.is_some(),
        "mutant {mutant:?} survived: no counterexample to \"{property}\""
    );
}

#[test]
fn mutant_zero_after_report_breaks_verification() {
    mutant_breaks(Mutant::ZeroAfterReport);
}

#[test]
fn mutant_reuse_before_free_breaks_slot_reuse() {
    mutant_breaks(Mutant::ReuseBeforeFree);
}

#[test]
fn mutant_free_on_first_report_breaks_free_while_held() {
    mutant_breaks(Mutant::FreeOnFirstReport);
}

#[test]
fn mutant_count_per_rank_breaks_readers_done() {
    mutant_breaks(Mutant::CountPerRank);
}

#[test]
fn mutant_ignore_not_held_breaks_cancel_liveness() {
    mutant_breaks(Mutant::IgnoreNotHeld);
}
