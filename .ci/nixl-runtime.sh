#!/usr/bin/env bash
# Provision what the `nixl` cargo feature needs on a GPU-less machine with no
# NIXL install (see shared/notes/nixl.md):
#
#   (a) libclang for nixl-sys's bindgen build step (Debian packages);
#   (b) the NIXL runtime libraries (libnixl_capi.so, UCX and the plugins),
#       unpacked from the PyPI wheel nixl-cu12==1.5.1 into
#       <repo>/.nixl-runtime/ (git-ignored). Only the two library folders of
#       the wheel are extracted; no Python package is installed.
#   (c) prints the LD_LIBRARY_PATH to use. The LAST line of stdout is always
#       `export LD_LIBRARY_PATH=...`, so callers can do
#
#         eval "$(.ci/nixl-runtime.sh | tail -1)"
#
# Idempotent: each step is skipped when its result is already there. Needs
# root for apt-get (CI and developer machines run as root) and network access
# to the Debian mirror and PyPI only. Progress goes to stderr.
set -euo pipefail

NIXL_WHEEL_SPEC="nixl-cu12==1.5.1"
CLANG_PKGS=(libclang1-14 libclang-common-14-dev)

log() { printf 'nixl-runtime: %s\n' "$*" >&2; }

repo_root="$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)"
dest="${repo_root}/.nixl-runtime"
libdir="${dest}/.nixl_cu12.mesonpy.libs"

# ---- (a) libclang for bindgen ------------------------------------------------
pkg_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'
}
missing=()
for p in "${CLANG_PKGS[@]}"; do
    pkg_installed "$p" || missing+=("$p")
done
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -q -o Dpkg::Use-Pty=0 update >&2
    apt-get -q -o Dpkg::Use-Pty=0 install -y --no-install-recommends "${missing[@]}" >&2
else
    log "libclang already installed"
fi

# ---- (b) NIXL runtime libraries from the wheel ---------------------------------
if [ -f "${libdir}/libnixl_capi.so" ] && [ -f "${dest}/.complete" ]; then
    log "runtime already unpacked in ${dest}"
else
    pip_bin="$(command -v pip3 || command -v pip || true)"
    if [ -z "$pip_bin" ]; then
        log "error: neither pip3 nor pip is on PATH"
        exit 1
    fi
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    log "downloading ${NIXL_WHEEL_SPEC} (~68 MB)"
    "$pip_bin" download --no-deps --disable-pip-version-check -q "${NIXL_WHEEL_SPEC}" -d "$tmp" >&2
    wheel="$(ls "$tmp"/nixl_cu12-*.whl 2>/dev/null | head -1)"
    if [ -z "$wheel" ]; then
        log "error: pip download produced no nixl_cu12 wheel"
        exit 1
    fi
    rm -rf "$dest"
    mkdir -p "$dest"
    log "unpacking runtime libraries into ${dest}"
    if command -v unzip >/dev/null 2>&1; then
        unzip -q -o "$wheel" '.nixl_cu12.mesonpy.libs/*' 'nixl_cu12.libs/*' -d "$dest" >&2
    else
        python3 - "$wheel" "$dest" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
prefixes = (".nixl_cu12.mesonpy.libs/", "nixl_cu12.libs/")
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith(prefixes)])
PY
    fi
    if [ ! -f "${libdir}/libnixl_capi.so" ]; then
        log "error: ${libdir}/libnixl_capi.so missing after unpacking"
        exit 1
    fi
    touch "${dest}/.complete"
fi

# ---- (c) the environment to use ----------------------------------------------
# The real folder (not a folder of symlinks): the libraries find UCX and the
# plugins through $ORIGIN-relative RPATHs.
libdir_real="$(cd "$libdir" && pwd -P)"
echo "export LD_LIBRARY_PATH=${libdir_real}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
