#!/usr/bin/env bash
# The Python environment for kvlease's vLLM 0.34.0 plugin tests, on a machine
# with no GPU and no network but the package registries:
#
#   1. a wheelhouse (download cache, shared by every clone of the repo):
#      vllm==0.34.0, nixl==1.5.1, nixl-cu12==1.5.1 and py/requirements-vllm.txt
#      (torch==2.14.0 and the pure-Python requirements, exactly pinned), as
#      wheels only, under $KVLEASE_CACHE_DIR (default ~/.cache/kvlease);
#   2. the virtualenv <repo>/.venv-vllm, installed from that wheelhouse with
#      --no-index --no-deps (vllm and nixl --no-deps as the issue asks; the
#      requirements file is a complete closure, checked with `pip check`);
#   3. vLLM's sdist vllm-0.34.0.tar.gz (sha256 pinned below) in the cache, and
#      from it only the tests the plugin is checked against, extracted to
#      <repo>/.vllm-tests/ (tests/v1/kv_connector/unit/ plus the conftest and
#      helper modules those tests import, and vLLM's pyproject.toml for its
#      pytest markers), with a sha256 manifest so runs can prove them unmodified;
#   4. an offline Hugging Face cache with the model configs the tests name
#      (py/tests/fixtures/hf-hub, copied to .vllm-tests/hf-home: no download).
#
# stdout is only `export NAME=value` lines, so callers can do
#
#     eval "$(py/ci/vllm-env.sh)"
#
# KVLEASE_VLLM_NIXL_CU13=1 also installs nixl-cu13==1.5.1 --no-deps. Without
# it, `import nixl` fails here (torch 2.14.0 from PyPI is a CUDA 13 build, and
# the nixl meta package then asks for nixl_cu13), so vLLM logs "NIXL is not
# available" and leaves vllm.distributed.nixl_utils.NixlWrapper None: tests use
# nixl_cu12._api directly or patch it in. With it, vLLM finds nixl_cu13's agent.
#
# Progress and step durations go to stderr. Idempotent: each step leaves a stamp
# (the hash of its inputs) and is skipped while the stamp matches; a second run
# takes about a second.
#
# Why the sdist is fetched with urllib and not `pip download --no-binary`:
# pip prepares an sdist's metadata before saving it, and vLLM's setup.py needs
# torch, cmake and setuptools-rust for that, so pip fails after downloading.
# The script asks the same index (PEP 691 JSON), and checks the file against
# the index's sha256 and the one pinned here.
set -euo pipefail

VLLM_VERSION=0.34.0
VLLM_SDIST_SHA256=fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113
NIXL_SPECS=(nixl==1.5.1 nixl-cu12==1.5.1)
if [ "${KVLEASE_VLLM_NIXL_CU13:-0}" = 1 ]; then
    NIXL_SPECS+=(nixl-cu13==1.5.1)
fi
# Bump when the steps below change in a way the stamps cannot see.
SCRIPT_REV=1

log() { printf 'vllm-env: %s\n' "$*" >&2; }
t_step=0
step_begin() { t_step=$(date +%s%N); log "$*"; }
step_end() { log "  done in $(( ($(date +%s%N) - t_step) / 1000000 )) ms"; }
t_all=$(date +%s%N)

repo_root="$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)"
py_dir="${repo_root}/py"
req_file="${py_dir}/requirements-vllm.txt"
venv="${KVLEASE_VLLM_VENV:-${repo_root}/.venv-vllm}"
tests_dir="${KVLEASE_VLLM_TESTS:-${repo_root}/.vllm-tests}"
cache_root="${KVLEASE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvlease}"
cache="${cache_root}/vllm-${VLLM_VERSION}"
wheelhouse="${cache}/wheels"
sdist="${cache}/vllm-${VLLM_VERSION}.tar.gz"
python_bin="${KVLEASE_PYTHON:-python3}"
index_url="${PIP_INDEX_URL:-https://pypi.org/simple}"

# ---- interpreter ---------------------------------------------------------------
if ! "$python_bin" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))'; then
    log "error: vLLM ${VLLM_VERSION} needs Python >=3.11,<3.15; ${python_bin} is $("$python_bin" -V 2>&1)"
    exit 1
fi
py_version="$("$python_bin" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"

hash_of() { cat "$@" | sha256sum | cut -c1-16; }
wheel_specs=("vllm==${VLLM_VERSION}" "${NIXL_SPECS[@]}")
inputs_hash="$( { echo "rev=${SCRIPT_REV} py=${py_version} ${wheel_specs[*]}"; cat "$req_file"; } | sha256sum | cut -c1-16)"

# ---- 1. wheelhouse ---------------------------------------------------------------
mkdir -p "$wheelhouse"
if [ "$(cat "${wheelhouse}/.stamp" 2>/dev/null)" = "$inputs_hash" ]; then
    log "1. wheelhouse up to date (${wheelhouse})"
else
    "${repo_root}/py/ci/need-disk.sh" "$wheelhouse" 4 "vllm-env's wheelhouse download (~3.4 GB)"
    step_begin "1. downloading wheels into ${wheelhouse} (first time: ~3.4 GB, torch and its CUDA libraries)"
    # --only-binary: never build anything; --no-deps: the requirements file is
    # the whole closure. Files already in the wheelhouse are not fetched again.
    "$python_bin" -m pip download --disable-pip-version-check -q \
        --only-binary=:all: --no-deps -d "$wheelhouse" \
        -r "$req_file" "${wheel_specs[@]}" >&2
    echo "$inputs_hash" > "${wheelhouse}/.stamp"
    step_end
fi

# ---- 2. virtualenv -----------------------------------------------------------------
if [ "$(cat "${venv}/.kvlease-stamp" 2>/dev/null)" = "$inputs_hash" ] && [ -x "${venv}/bin/python" ]; then
    log "2. ${venv} up to date"
else
    step_begin "2. creating ${venv} (Python ${py_version})"
    rm -rf "$venv"
    # Installed, torch and its CUDA libraries take 6.8 GB.
    "${repo_root}/py/ci/need-disk.sh" "$venv" 8 "the vLLM ${VLLM_VERSION} venv (${venv}, ~6.8 GB installed)"
    "$python_bin" -m venv "$venv"
    step_end
    # These wheels only, no resolver; uv when it can be had, else pip.
    pip_install=("${repo_root}/py/ci/wheel-install.sh" "$venv" "$wheelhouse")
    step_begin "2a. installing torch and the pinned requirements (from the wheelhouse)"
    "${pip_install[@]}" -r "$req_file" >&2
    step_end
    step_begin "2b. installing vllm==${VLLM_VERSION} and ${NIXL_SPECS[*]} --no-deps"
    "${pip_install[@]}" "${wheel_specs[@]}" >&2
    step_end
    step_begin "2c. pip check (only vLLM's deliberately omitted requirements may be missing)"
    # Expected: vllm's GPU-only and unused requirements (see requirements-vllm.txt),
    # and the nixl meta package's other variant (cu13, or cu12 when only cu13 is asked).
    unexpected="$("${venv}/bin/python" -m pip check 2>&1 \
        | grep -v -E "^vllm ${VLLM_VERSION//./\\.} (requires|has requirement) |^nixl 1\.5\.1 requires nixl-cu1[23]" \
        | grep -v '^No broken requirements' || true)"
    if [ -n "$unexpected" ]; then
        log "error: the requirements closure is broken:"
        printf '%s\n' "$unexpected" >&2
        exit 1
    fi
    step_end
    step_begin "2d. import check (torch, vllm, the NIXL connector, the NIXL agent class)"
    # nixl_cu12 and nixl_cu13 cannot both be imported in one process (pybind11:
    # 'type "nixl_thread_sync_t" is already registered'): with nixl-cu13 present,
    # vLLM's import of nixl._api loads cu13, and everything must use that.
    VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES='' KVLEASE_VLLM_NIXL_CU13="${KVLEASE_VLLM_NIXL_CU13:-0}" \
        "${venv}/bin/python" - <<'PY' >&2
import os
import torch, vllm
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnector
from vllm.distributed import nixl_utils
if os.environ["KVLEASE_VLLM_NIXL_CU13"] == "1":
    agent = nixl_utils.NixlWrapper
    assert agent is not None and agent.__module__ == "nixl_cu13._api", agent
else:
    from nixl_cu12._api import nixl_agent as agent
print(f"torch {torch.__version__} (cuda available: {torch.cuda.is_available()}), "
      f"vllm {vllm.__version__}, {NixlPullConnector.__name__}, agent {agent.__module__}")
PY
    step_end
    echo "$inputs_hash" > "${venv}/.kvlease-stamp"
fi

# ---- 3. the sdist and the upstream tests ---------------------------------------------
if [ -f "$sdist" ] && [ "$(sha256sum "$sdist" | cut -d' ' -f1)" = "$VLLM_SDIST_SHA256" ]; then
    log "3. sdist already in ${sdist}"
else
    step_begin "3. downloading vllm-${VLLM_VERSION}.tar.gz (51 MB) from ${index_url}"
    "$python_bin" - "$index_url" "$VLLM_VERSION" "$VLLM_SDIST_SHA256" "$sdist" <<'PY'
import hashlib, json, os, sys, urllib.request
index, version, pinned, dest = sys.argv[1:5]
name = f"vllm-{version}.tar.gz"
req = urllib.request.Request(index.rstrip("/") + "/vllm/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(req, timeout=120) as r:
    files = json.load(r)["files"]
entry = next(f for f in files if f["filename"] == name)
if entry["hashes"].get("sha256") != pinned:
    sys.exit(f"{name}: the index's sha256 {entry['hashes'].get('sha256')} is not the pinned {pinned}")
with urllib.request.urlopen(entry["url"], timeout=600) as r:
    data = r.read()
if hashlib.sha256(data).hexdigest() != pinned:
    sys.exit(f"{name}: downloaded bytes do not match sha256 {pinned}")
tmp = dest + ".part"
with open(tmp, "wb") as f:
    f.write(data)
os.replace(tmp, dest)
PY
    step_end
fi

# The files the two upstream test modules need: the unit test package (its
# conftest and utils), the helpers they import from other test packages, the
# top-level tests/conftest.py (fixtures dist_init, default_vllm_config) and
# what it imports, and vLLM's pyproject.toml (pytest markers).
members=(
    pyproject.toml
    tests/__init__.py tests/conftest.py tests/utils.py tests/ci_envs.py
    tests/models/__init__.py tests/models/utils.py tests/models/registry.py
    tests/v1/__init__.py
    tests/v1/attention/utils.py
    tests/v1/spec_decode/__init__.py tests/v1/spec_decode/utils.py
    tests/v1/kv_connector/__init__.py tests/v1/kv_connector/conftest.py
    tests/v1/kv_connector/unit
)
tests_hash="$( { echo "rev=${SCRIPT_REV} ${VLLM_SDIST_SHA256} ${members[*]}"; find "${py_dir}/tests/fixtures/hf-hub" -type f | sort | xargs cat; } | sha256sum | cut -c1-16)"
if [ "$(cat "${tests_dir}/.stamp" 2>/dev/null)" = "$tests_hash" ]; then
    log "4. upstream tests already extracted in ${tests_dir}"
else
    step_begin "4. extracting the upstream tests into ${tests_dir}"
    rm -rf "$tests_dir"
    mkdir -p "$tests_dir"
    tar -xzf "$sdist" -C "$tests_dir" --strip-components=1 \
        "${members[@]/#/vllm-${VLLM_VERSION}/}"
    # The manifest lets run-upstream.sh prove the files are byte-for-byte the
    # sdist's; read-only makes an accidental edit fail loudly.
    (cd "$tests_dir" && find pyproject.toml tests -type f | sort | xargs sha256sum) > "${tests_dir}/MANIFEST.sha256"
    find "${tests_dir}/tests" "${tests_dir}/pyproject.toml" -type f -exec chmod a-w {} +
    mkdir -p "${tests_dir}/hf-home"
    cp -r "${py_dir}/tests/fixtures/hf-hub" "${tests_dir}/hf-home/hub"
    echo "$tests_hash" > "${tests_dir}/.stamp"
    step_end
fi

log "ready in $(( ($(date +%s%N) - t_all) / 1000000 )) ms: ${venv}, tests in ${tests_dir}"

# ---- 5. the environment to use --------------------------------------------------
# CUDA_VISIBLE_DEVICES='': the PyPI vLLM wheel is a CUDA build; its CPU platform
# refuses to configure an engine on x86 unless vllm.triton_utils.HAS_TRITON, which
# a CUDA triton with 0 active drivers only keeps when the visible-devices variable
# is set and empty (the path Ray workers take). Nothing here has a GPU anyway.
cat <<EOF
export VLLM_ENV_PYTHON=${venv}/bin/python
export VLLM_ENV_VENV=${venv}
export VLLM_TESTS_DIR=${tests_dir}
export VLLM_TARGET_DEVICE=cpu
export CUDA_VISIBLE_DEVICES=
export HF_HOME=${tests_dir}/hf-home
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
export RAY_USAGE_STATS_ENABLED=0
EOF
