//! `kvlease-model`: runs the protocol model check at a chosen bound (the
//! longer local run of `docs/model-check.md`). `ci` checks [`Bound::CI`], `long` (the
//! default) checks [`Bound::LONG`]; `key=value` arguments override a bound's
//! fields (`requests`, `slots`, `d_tp`, `drops`, `dups`, `heartbeats`,
//! `directive_losses`, `cancels`, `d_crashes`, `rank_crashes`, `p_restarts`,
//! `depth`) or set `threads`; `examples` prints the trace of every
//! `sometimes` property seen (the shortest run that shows it). Exits 1 when a
//! property fails (the counterexample is printed), 2 on a bad argument.
//!
//! ```text
//! cargo run -p kvlease-model --release -- long
//! cargo run -p kvlease-model --release -- long requests=3 slots=2 depth=40
//! cargo run -p kvlease-model --release -- ci d_tp=4 heartbeats=1
//! ```

use std::process::ExitCode;

use kvlease_model::{check, Bound, ProtocolModel};

fn main() -> ExitCode {
    let mut runs: Vec<(&str, Bound)> =
        vec![("long: the network and process faults at once", Bound::LONG)];
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut examples = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "ci" => runs = Bound::CI.to_vec(),
            "long" => runs = vec![("long: the network and process faults at once", Bound::LONG)],
            "examples" => examples = true,
            kv => {
                let Some((key, value)) = kv.split_once('=') else {
                    eprintln!("unknown argument {kv:?} (ci, long, or key=value)");
                    return ExitCode::from(2);
                };
                let Ok(v) = value.parse::<usize>() else {
                    eprintln!("{key}: {value:?} is not a number");
                    return ExitCode::from(2);
                };
                let small = u8::try_from(v).ok().filter(|n| *n <= 8);
                for (_, b) in runs.iter_mut() {
                    let field = match key {
                        "requests" => &mut b.requests,
                        "slots" => &mut b.slots,
                        "d_tp" => &mut b.d_tp,
                        "directive_losses" => &mut b.directive_losses,
                        "cancels" => &mut b.cancels,
                        "drops" => &mut b.drops,
                        "dups" => &mut b.dups,
                        "heartbeats" => &mut b.heartbeats,
                        "d_crashes" => &mut b.d_crashes,
                        "rank_crashes" => &mut b.rank_crashes,
                        "p_restarts" => &mut b.p_restarts,
                        "depth" => {
                            b.depth = v;
                            continue;
                        }
                        "threads" => {
                            threads = v.max(1);
                            continue;
                        }
                        _ => {
                            eprintln!("unknown key {key:?}");
                            return ExitCode::from(2);
                        }
                    };
                    match small {
                        Some(n) => *field = n,
                        None => {
                            eprintln!("{key}={v}: at most 8");
                            return ExitCode::from(2);
                        }
                    }
                }
            }
        }
    }
    let mut failed = false;
    for (name, bound) in runs {
        if let Err(e) = bound.check() {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
        let report = check(ProtocolModel::new(bound, None), threads);
        println!("model check [{name}] {bound:?}: {report}");
        if report.max_depth >= bound.depth {
            println!("  (the depth bound cut the search: not every state was reached)");
        }
        for v in report.violations() {
            failed = true;
            println!("VIOLATED: {v}\n{}", report.trace(v).unwrap_or_default());
        }
        let seen: Vec<&str> = report.discoveries.keys().copied().collect();
        println!("  seen: {seen:?}");
        if examples {
            for name in seen.iter().filter(|n| !report.violations().contains(n)) {
                println!(
                    "example: {name}\n{}",
                    report.trace(name).unwrap_or_default()
                );
            }
        }
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
