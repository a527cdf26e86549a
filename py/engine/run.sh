#!/usr/bin/env bash
# kvlease in a real vLLM engine (issue 28): real `vllm serve` P, D and a plain
# reference on vLLM's CPU build, real NIXL, vLLM's toy proxy and a float64
# router in front, stock NixlConnector as the control. .ci/run step 11.
#
#   py/engine/run.sh            the cases (py/engine/test_real_engine.py, then the fleet's:
#                               test_real_engine_fleet.py), then the table
#   py/engine/run.sh cases -k overload   some of them (the rest is passed to pytest)
#   py/engine/run.sh bench      the cost benchmark (py/engine/bench.py), not a test
#
# Builds everything it needs (py/engine/env.sh: the venv, vLLM's toy proxy,
# the tiny model; the kvlease wheel with maturin unless .ci/run's step 10
# already built it). Figures: .engine/results/.
set -euo pipefail
repo_root="$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)"
cd "$repo_root"
t_all=$(date +%s)
# Assigned first: `eval "$(...)"` would drop env.sh's failure and go on.
engine_env="$(py/engine/env.sh)"
eval "$engine_env"
what="${1:-cases}"
[ $# -gt 0 ] && shift

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${repo_root}/target}"
wheel="$(ls -t "${CARGO_TARGET_DIR}"/wheels-vllm/kvlease-*.whl 2>/dev/null | head -1 || true)"
if [ -z "$wheel" ] || [ -n "$(find py/src py/python src -newer "$wheel" -type f -print -quit)" ]; then
    echo "== engine: building the kvlease wheel (maturin)"
    rm -rf "${CARGO_TARGET_DIR}/wheels-engine"
    "$ENGINE_PYTHON" -m maturin build --release -m py/Cargo.toml -o "${CARGO_TARGET_DIR}/wheels-engine"
    wheel="$(ls "${CARGO_TARGET_DIR}"/wheels-engine/kvlease-*.whl)"
fi
"$ENGINE_PYTHON" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
echo "== engine: environment ready in $(( $(date +%s) - t_all )) s (wheel $(basename "$wheel"))"

mkdir -p "${ENGINE_WORK}/results"
case "$what" in
cases)
    t=$(date +%s)
    set +e
    (cd py/engine && "$ENGINE_PYTHON" -m pytest -q -p no:cacheprovider -rfEsxX -s \
        --durations=0 --junitxml="${ENGINE_WORK}/results/real-engine.xml" test_real_engine.py \
        test_real_engine_fleet.py "$@") \
        > "${ENGINE_WORK}/results/real-engine.log" 2>&1
    rc=$?
    set -e
    grep -E '^\[real-engine\]|passed|failed|error|FAILED|ERROR' "${ENGINE_WORK}/results/real-engine.log" | tail -60 || true
    "$ENGINE_PYTHON" py/engine/report.py "${ENGINE_WORK}/results/cases.jsonl"
    echo "== engine: cases done in $(( $(date +%s) - t )) s (exit ${rc}); whole step $(( $(date +%s) - t_all )) s"
    if [ "$rc" != 0 ]; then
        echo "== engine: a case failed; the instances' logs are under ${ENGINE_WORK}/logs/"
        # Each failure's name and its assertion lines ("E   ..."): the
        # tracebacks open with the cases' long docstrings, and a CI log that
        # keeps only part of the output must still say what failed and why.
        grep -E '^_{5,} test_|^E  |^(FAILED|ERROR) ' "${ENGINE_WORK}/results/real-engine.log" \
            | cut -c1-2000 | head -200 || true
        exit "$rc"
    fi
    ;;
bench)
    "$ENGINE_PYTHON" py/engine/bench.py --json "${ENGINE_WORK}/results/bench.json"
    ;;
*)
    echo "usage: py/engine/run.sh [cases|bench]" >&2; exit 2 ;;
esac
