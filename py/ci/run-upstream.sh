#!/usr/bin/env bash
# Run vLLM 0.34.0's own NIXL connector unit tests, taken unmodified from the
# sdist by py/ci/vllm-env.sh, on CPU:
#
#   stock       against stock vLLM (the baseline);
#   substitute  with the classes of a substitute module put in place of vLLM's
#               NixlPullConnector / NixlPullConnectorScheduler / ...Worker by
#               the pytest plugin py/tests/upstream/kvlease_substitute.py
#               (default module: passthrough_connector, the counting prototype);
#               every test that passes on stock must pass here too, and at
#               least one test must have called a substitute hook.
#   all         (default) substitute, then the comparison against stock: the
#               stock run only when the substituted run failed something (or
#               KVLEASE_UPSTREAM_STOCK=always), else stock's collection, every
#               test of which must have passed substituted. (Not side by side:
#               tried, two runs on this 2-core host took 332 s together, 175 s alone.)
#   plugin      `all` with the real plugin: kvlease.vllm's KvLeaseNixlConnector,
#               KvLeaseScheduler and KvLeaseWorker themselves (module
#               kvlease_plugin, which only counts their calls); the
#               comparison also says which tests ran with kvlease state active.
#   mutant      the negative control: test_nixl_heartbeat.py with
#               mutant_connector (a worker that drops heartbeats and never
#               reaps) must FAIL; this mode exits 0 only if it does.
#
#   py/ci/run-upstream.sh [stock|substitute|all|plugin|mutant] [SUBSTITUTE_MODULE]
#
# Files: test_nixl_heartbeat.py and test_nixl_connector.py; the node ids in
# py/tests/upstream/not-on-cpu.txt are deselected (each line says why).
# Results (JUnit XML, the substitution report) go to .vllm-tests/results/.
set -euo pipefail

mode="${1:-all}"
sub_module="${2:-passthrough_connector}"
if [ "$mode" = plugin ]; then
    mode=all
    sub_module=kvlease_plugin
fi
repo_root="$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)"
vllm_env="$("${repo_root}/py/ci/vllm-env.sh")"   # assigned first, so set -e sees a failure
eval "$vllm_env"

cd "$VLLM_TESTS_DIR"
# The tests must be byte-for-byte the sdist's.
sha256sum --quiet -c MANIFEST.sha256
echo "upstream test files match the sdist manifest ($(wc -l < MANIFEST.sha256) files)"

results="${VLLM_TESTS_DIR}/results"
mkdir -p "$results"
test_files=(tests/v1/kv_connector/unit/test_nixl_heartbeat.py
            tests/v1/kv_connector/unit/test_nixl_connector.py)
deselect=()
while IFS= read -r line; do
    case "$line" in ''|'#'*) continue ;; esac
    deselect+=(--deselect "${line%% # *}")
done < "${repo_root}/py/tests/upstream/not-on-cpu.txt"

run_pytest() {
    local name="$1"; shift
    local t0; t0=$(date +%s)
    echo "== upstream tests (${name})"
    # -p no:cacheprovider: the tree is read-only upstream code; --timeout: a hung
    # test must fail, not eat the CI budget.
    local rc=0
    "$VLLM_ENV_PYTHON" -m pytest -q -p no:cacheprovider -rfEsxX --timeout=300 \
        --junitxml="${results}/${name}.xml" "${deselect[@]}" "$@" "${test_files[@]}" || rc=$?
    echo "== ${name}: $(( $(date +%s) - t0 )) s (exit ${rc})"
    return "$rc"
}

if [ "$mode" = stock ]; then
    run_pytest stock
fi
sub_rc=0
if [ "$mode" = substitute ] || [ "$mode" = all ]; then
    PYTHONPATH="${repo_root}/py/tests/upstream${PYTHONPATH:+:${PYTHONPATH}}" \
        run_pytest "substitute-${sub_module}" -p kvlease_substitute \
        --kvlease-substitute="$sub_module" \
        --kvlease-report="${results}/substitute-${sub_module}.json" || sub_rc=$?
    [ "$mode" = all ] || exit "$sub_rc"
fi
if [ "$mode" = mutant ]; then
    echo "== negative control: vLLM's heartbeat tests with mutant_connector (must fail)"
    if PYTHONPATH="${repo_root}/py/tests/upstream${PYTHONPATH:+:${PYTHONPATH}}" \
        "$VLLM_ENV_PYTHON" -m pytest -q -p no:cacheprovider --timeout=300 \
        -p kvlease_substitute --kvlease-substitute=mutant_connector \
        tests/v1/kv_connector/unit/test_nixl_heartbeat.py; then
        echo "mutant_connector passed vLLM's heartbeat tests: the substitution does not reach the worker"
        exit 1
    fi
    echo "== negative control ok: the mutant worker fails vLLM's heartbeat tests"
fi
if [ "$mode" = all ]; then
    # The stock run is the baseline that tells vLLM's own failures on this
    # host from the substitutes'. When the substituted run failed nothing,
    # all it would add is that every test stock collects ran and passed:
    # checked from stock's collection instead (seconds, not the ~190 s of a
    # run). Any test missing, skipped or failed there, and the stock run
    # follows, with the comparison, which names the tests that passed on
    # stock only. KVLEASE_UPSTREAM_STOCK=always runs it regardless.
    compare=("$VLLM_ENV_PYTHON" "${repo_root}/py/tests/upstream/compare_runs.py")
    sub_files=("${results}/substitute-${sub_module}.xml" "${results}/substitute-${sub_module}.json")
    if [ "$sub_rc" = 0 ] && [ "${KVLEASE_UPSTREAM_STOCK:-auto}" != always ]; then
        echo "== stock: collected only (the substituted run failed nothing)"
        "$VLLM_ENV_PYTHON" -m pytest --collect-only -q -p no:cacheprovider "${deselect[@]}" \
            "${test_files[@]}" > "${results}/stock-collected.txt"
        if "${compare[@]}" "${results}/stock-collected.txt" "${sub_files[@]}"; then
            exit 0
        fi
        echo "== a collected test did not pass with the substitutes: the stock baseline follows"
    fi
    run_pytest stock
    "${compare[@]}" "${results}/stock.xml" "${sub_files[@]}"
    # As strict as when stock always ran first: a failure with the
    # substitutes fails the step even where stock failed too.
    exit "$sub_rc"
fi
