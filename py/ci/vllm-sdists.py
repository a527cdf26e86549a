#!/usr/bin/env python3
"""vLLM's source distributions for the supported versions, in the cache.

The plugin supports vLLM 0.32, 0.33 and 0.34 (``kvlease.vllm.compat``);
``py/tests/vllm/test_private_names.py`` checks every vLLM name the plugin
relies on against each of these sdists, read from the archive (nothing is
extracted, nothing is installed). This script puts them in
``$KVLEASE_CACHE_DIR/sdists/`` (default ``~/.cache/kvlease/sdists/``):

* each file is checked against the sha256 pinned below and the one the index
  publishes (PEP 691 JSON of the simple API, ``$PIP_INDEX_URL`` or PyPI), and
  written atomically;
* a file already there with the pinned hash is kept (a second run reads three
  files and downloads nothing);
* vLLM 0.34.0's sdist, which ``py/ci/vllm-env.sh`` keeps in
  ``$KVLEASE_CACHE_DIR/vllm-0.34.0/``, is linked (or copied) from there
  instead of downloaded again.

stdout is one ``export KVLEASE_VLLM_SDIST_DIR=<dir>`` line, so callers can
``eval "$(python3 py/ci/vllm-sdists.py)"``; progress goes to stderr. Exit
status 1 with a message on a hash mismatch or a failed download.

``--tree VERSION`` also unpacks that release's Python sources (``vllm/``)
and the few test helpers the plugin's tests import (``tests/``: vLLM's
``create_vllm_config`` and what it imports) into
``$KVLEASE_CACHE_DIR/sdists/tree-VERSION/`` (once per sdist hash), and adds
``export KVLEASE_VLLM_TREE=<dir>``: ``py/ci/run-vllm.sh``'s ``vllm033``
step puts that directory first on ``PYTHONPATH``, so that the 0.34 venv
imports that release's ``vllm`` instead of its own.

Why urllib and not ``pip download --no-binary``: pip prepares an sdist's
metadata before saving it, and vLLM's setup.py needs torch and cmake for that.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

#: version -> sha256 of vllm-<version>.tar.gz (as published on PyPI).
SDISTS: dict[str, str] = {
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    "0.34.0": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
}


def cache_root() -> Path:
    """``$KVLEASE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvlease``, else
    ``~/.cache/kvlease`` (as py/ci/vllm-env.sh)."""
    if os.environ.get("KVLEASE_CACHE_DIR"):
        return Path(os.environ["KVLEASE_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "kvlease"


def sdist_dir() -> Path:
    return cache_root() / "sdists"


def sdist_path(version: str) -> Path:
    return sdist_dir() / f"vllm-{version}.tar.gz"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def log(msg: str) -> None:
    print(f"vllm-sdists: {msg}", file=sys.stderr, flush=True)


def _index_files(index: str) -> list[dict]:
    req = urllib.request.Request(
        index.rstrip("/") + "/vllm/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["files"]


def _place(src: Path, dest: Path) -> None:
    """``src`` at ``dest`` (a hard link, or a copy across file systems),
    atomically."""
    tmp = dest.with_name(dest.name + ".part")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


def ensure(version: str, files: list[dict] | None, index: str) -> list[dict] | None:
    """Makes ``sdist_path(version)`` the pinned file. Returns the index's
    file list (fetched at most once per run)."""
    pinned = SDISTS[version]
    dest = sdist_path(version)
    if dest.is_file() and sha256_of(dest) == pinned:
        log(f"{dest.name}: present, sha256 ok")
        return files
    if dest.exists():
        log(f"{dest.name}: sha256 is not the pinned one; fetching it again")
        dest.unlink()
    shared = cache_root() / f"vllm-{version}" / dest.name  # py/ci/vllm-env.sh's copy
    if shared.is_file() and sha256_of(shared) == pinned:
        _place(shared, dest)
        log(f"{dest.name}: taken from {shared}")
        return files
    if files is None:
        files = _index_files(index)
    entry = next((f for f in files if f.get("filename") == dest.name), None)
    if entry is None:
        raise SystemExit(f"vllm-sdists: {dest.name} is not on {index}")
    published = (entry.get("hashes") or {}).get("sha256")
    if published != pinned:
        raise SystemExit(
            f"vllm-sdists: the index's sha256 of {dest.name} is {published}, not the pinned {pinned}"
        )
    t = time.monotonic()
    log(f"{dest.name}: downloading from {index}")
    tmp = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    with urllib.request.urlopen(entry["url"], timeout=600) as r, open(tmp, "wb") as f:
        for chunk in iter(lambda: r.read(1 << 20), b""):
            h.update(chunk)
            f.write(chunk)
    if h.hexdigest() != pinned:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"vllm-sdists: the downloaded {dest.name} does not match sha256 {pinned}")
    os.replace(tmp, dest)
    log(f"{dest.name}: done in {time.monotonic() - t:.1f} s")
    return files


#: What --tree unpacks besides vllm/: the test helpers the plugin's tests
#: import (tests/v1/kv_connector/unit/utils.py and its imports), as
#: py/ci/vllm-env.sh extracts them for 0.34 (members a release lacks are skipped).
TREE_TEST_FILES = (
    "tests/__init__.py",
    "tests/conftest.py",
    "tests/utils.py",
    "tests/ci_envs.py",
    "tests/models/__init__.py",
    "tests/models/utils.py",
    "tests/models/registry.py",
    "tests/v1/__init__.py",
    "tests/v1/attention/utils.py",
    "tests/v1/spec_decode/__init__.py",
    "tests/v1/spec_decode/utils.py",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/conftest.py",
)
TREE_TEST_DIRS = ("vllm/", "tests/v1/kv_connector/unit/")
TREE_REV = "1"  # bump when the selection above changes


def tree(version: str) -> Path:
    """``tree-<version>/``: the release's ``vllm/`` and test helpers,
    unpacked from its (checked) sdist once per sdist hash."""
    dest = sdist_dir() / f"tree-{version}"
    stamp = f"{SDISTS[version]} rev {TREE_REV}"
    stamp_file = dest / ".kvlease-stamp"
    if stamp_file.is_file() and stamp_file.read_text().strip() == stamp:
        log(f"{dest.name}: present")
        return dest
    t = time.monotonic()
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    prefix = f"vllm-{version}/"
    with tarfile.open(sdist_path(version), "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                continue
            rel = m.name[len(prefix):]
            if rel in TREE_TEST_FILES or rel.startswith(TREE_TEST_DIRS):
                m.name = rel
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    (tmp / ".kvlease-stamp").write_text(stamp + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    log(f"{dest.name}: unpacked in {time.monotonic() - t:.1f} s")
    return dest


def main(argv: list[str]) -> int:
    want_tree = None
    if argv[:1] == ["--tree"] and len(argv) == 2 and argv[1] in SDISTS:
        want_tree = argv[1]
    elif argv:
        print(f"usage: vllm-sdists.py [--tree {{{','.join(SDISTS)}}}]", file=sys.stderr)
        return 2
    index = os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
    sdist_dir().mkdir(parents=True, exist_ok=True)
    files: list[dict] | None = None
    try:
        for version in SDISTS:
            files = ensure(version, files, index)
        unpacked = tree(want_tree) if want_tree else None
    except (OSError, tarfile.TarError) as e:  # urllib.error.URLError is an OSError
        log(f"error: {e}")
        return 1
    print(f"export KVLEASE_VLLM_SDIST_DIR={shlex.quote(str(sdist_dir()))}")
    if unpacked is not None:
        print(f"export KVLEASE_VLLM_TREE={shlex.quote(str(unpacked))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
