#!/usr/bin/env bash
# Installs wheels from a wheelhouse into a venv, these wheels only (no index,
# no resolver): with uv when it can be had, with pip otherwise.
#
#   py/ci/wheel-install.sh VENV WHEELHOUSE [-r FILE | SPEC ...]
#
# Why uv: the env scripts install 3 GB of wheels into a venv on every clean
# checkout, and uv does it in half pip's time, bytecode compiled on every
# core (the engine venv on 2 cores: 63 s against pip's 121 s, 2026-12-06).
# uv is a pinned version, installed once from the package index into the
# kvlease cache; it keeps no cache of its own here (UV_NO_CACHE), so the
# venv's files are the only copy on disk. Progress and errors go to stderr.
set -euo pipefail
UV_VERSION=0.13.9
venv="$1" wheelhouse="$2"
shift 2
cache_root="${KVLEASE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvlease}"
tool="${cache_root}/tools/uv-${UV_VERSION}"
python_bin="${KVLEASE_PYTHON:-python3}"

if ! "${tool}/bin/uv" --version >/dev/null 2>&1; then
    printf 'wheel-install: installing uv==%s into %s\n' "$UV_VERSION" "$tool" >&2
    rm -rf "$tool"
    { "$python_bin" -m venv "$tool" \
        && "${tool}/bin/python" -m pip install --disable-pip-version-check -q \
            --only-binary=:all: "uv==${UV_VERSION}"; } >&2 || true
fi
if "${tool}/bin/uv" --version >/dev/null 2>&1; then
    UV_NO_CACHE=1 "${tool}/bin/uv" pip install -q --python "${venv}/bin/python" \
        --no-index --find-links "$wheelhouse" --no-deps --compile-bytecode "$@" >&2
else
    printf 'wheel-install: uv unavailable, installing with pip\n' >&2
    "${venv}/bin/python" -m pip install --disable-pip-version-check -q \
        --no-index --find-links "$wheelhouse" --no-deps "$@" >&2
fi
