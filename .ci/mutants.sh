#!/usr/bin/env bash
# Mutation checks: build the library with one deliberate bug at a time
# (`--features mutant_...`, see the cfg blocks in src/producer/) and
# require the role model test (tests/it/book_model.rs) to FAIL on each. A mutant
# that passes means the model no longer guards that invariant.
#
#   zero_after_report     a rank zeroes its slot only after its report left
#   reuse_before_free     the scheduler returns a slot before the engine freed the blocks
#   free_on_first_report  the scheduler frees blocks when one rank of several reported
#   count_per_rank        a rank counts read-dones per rank, not per (sender, lease): a
#                         duplicated read-done frees its share while another reader reads
#   ignore_not_held       the scheduler ignores "not held" reports: a lease whose Grant a
#                         rank missed is held forever, even after a cancel
#
# The loom models of the roles across threads (loom_tests/roles.rs) must fail
# on zero_after_report too (the late zero races a decoder's slot READ) and on
# count_per_rank (a duplicated read-done lets go under a second reader).
#
# The protocol model (model/, stateright) must find each bug too: built with
# the same cfg, its replay test checks the model's counterexample for the
# mirrored model mutant (kvlease_model::Mutant) step by step against the
# mutated real roles (model/tests/replay.rs): zero_after_report breaks "D
# accepts only verified loads", reuse_before_free the slot reuse property,
# free_on_first_report "never freed while held", count_per_rank "read-done
# release only after every reader finished" (D TP 4: two readers per P
# rank, one read-done duplicated), ignore_not_held "a heard cancel ends the
# lease" (a Grant lost to one rank, then a cancel). Release, as above: a
# debug build of the mutated roles trips their own debug assertions first
# (zero_after_report: "slot published while held").
#
# The bugs are cargo features of the library (and of kvlease-model, which
# forwards them), so switching from one to the next rebuilds the library
# and what depends on it, not the dependency tree, and a mutated build sits
# beside the normal one in the same target dir (features are part of an
# artifact's hash) instead of evicting it: the release dependencies of step
# 5c and loom's of step 5 are reused.
set -uo pipefail
cd "$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)"
status=0
MUTANTS="zero_after_report reuse_before_free free_on_first_report count_per_rank ignore_not_held"
mkdir -p target/mutants
for m in $MUTANTS; do
    log="target/mutants/${m}.log"
    if cargo test --release --features "mutant_${m}" --test it -- book_model:: >"$log" 2>&1; then
        echo "MUTANT SURVIVED: ${m} (the model test passed with the bug in; see ${log})"
        status=1
    elif grep -q "panicked at" "$log"; then
        echo "mutant ${m} caught: $(grep -m1 -A1 'panicked at' "$log" | tail -1)"
    else
        echo "mutant ${m}: the build or test run failed without a model failure (see ${log})"
        tail -20 "$log"
        status=1
    fi
    log="target/mutants/model_${m}.log"
    if ! cargo test --release -p kvlease-model --features "mutant_${m}" --test replay -- --nocapture >"$log" 2>&1; then
        echo "model mutant run ${m} failed (see ${log})"
        grep -m1 -A3 "panicked at" "$log" || tail -20 "$log"
        status=1
    elif grep -q "replayed on the real mutated roles" "$log"; then
        echo "mutant ${m} caught by the protocol model: $(grep -m1 '^real mutant' "$log")"
    else
        echo "model mutant run ${m}: no counterexample replayed (see ${log})"
        status=1
    fi
done
# (mutant, the failure message the loom model must print)
for pair in "zero_after_report|verified a READ of reused blocks" \
    "count_per_rank|let go while decoder 1 was reading"; do
    m="${pair%%|*}"
    want="${pair#*|}"
    log="target/mutants/loom_${m}.log"
    if RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom \
        cargo test --release --features "mutant_${m}" --test loom_roles >"$log" 2>&1; then
        echo "MUTANT SURVIVED: ${m} under loom (see ${log})"
        status=1
    elif grep -q "$want" "$log"; then
        echo "mutant ${m} caught by loom: ${want}"
    else
        echo "loom mutant run ${m} failed without the expected failure (see ${log})"
        tail -20 "$log"
        status=1
    fi
done
exit $status
