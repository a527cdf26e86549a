//! The model check of issue 14: every property holds in every interleaving
//! to the CI bound, and each mutant breaks its property with a printed
//! counterexample.

use kvlease_model::{check, Bound, Mutant, ProtocolModel};

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
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
        for example in [
            "D accepts a verified load",
            "D rejects a READ whose blocks were freed during it",
            "a slot is reused by a second lease",
        ] {
            assert!(
                report.discoveries.contains_key(example),
                "[{name}] never happened: {example}"
            );
        }
        assert!(
            report
                .discoveries
                .contains_key("a run ends with D alive and every request read or expired"),
            "[{name}] no fair run ended: the liveness check is vacuous"
        );
        if bound.d_crashes > 0 {
            assert!(
                report
                    .discoveries
                    .contains_key("a run ends after a D crash with every block freed"),
                "[{name}] no run ended after a D crash: the liveness check is vacuous"
            );
        }
        assert!(report.unique_states > 10_000, "[{name}] suspiciously small");
    }
}

fn mutant_breaks(mutant: Mutant) {
    // The process-fault bound without crashes: the bugs need none.
    let bound = Bound {
        d_crashes: 0,
        rank_crashes: 0,
        p_restarts: 0,
        ..Bound::CI[1].1
    };
    let report = check(ProtocolModel::new(bound, Some(mutant)), threads());
    let property = mutant.breaks();
    let trace = report.trace(property);
    println!("mutant {mutant:?}: {report}");
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
