#!/usr/bin/env bash
# Prints the path of a uv binary (a pinned version, installed once from the
# package index into the kvlease cache), or fails with nothing on stdout.
#
#   uv_bin="$(py/ci/uv.sh)" || ...fall back to pip...
#
# Why: the env scripts install 3 GB of wheels into a venv on every clean
# checkout. uv installs the same wheels from the same wheelhouse, bytecode
# compiled on every core, in half pip's time (the engine venv on 2 cores:
# 63 s against pip's 121 s, 2026-12-06). Progress and errors go to stderr.
set -euo pipefail
UV_VERSION=0.13.9
cache_root="${KVLEASE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvlease}"
tool="${cache_root}/tools/uv-${UV_VERSION}"
python_bin="${KVLEASE_PYTHON:-python3}"
if ! "${tool}/bin/uv" --version >/dev/null 2>&1; then
    printf 'uv: installing uv==%s into %s\n' "$UV_VERSION" "$tool" >&2
    rm -rf "$tool"
    "$python_bin" -m venv "$tool" >&2
    "${tool}/bin/python" -m pip install --disable-pip-version-check -q \
        --only-binary=:all: "uv==${UV_VERSION}" >&2
fi
"${tool}/bin/uv" --version >/dev/null
printf '%s\n' "${tool}/bin/uv"
