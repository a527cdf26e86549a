"""Stock controls reused by the hash of everything they read.

Owns: the key of a stock control's inputs, and the cache of the figures a
stock control measured under that key (``~/.cache/kvlease/engine-controls``,
one JSON file per key). May not judge a case: the case asserts its control's
claim on the figures, measured now or reused, the same way.

Why: a stock vLLM control (``NixlPushConnector`` hanging on a late
registration, for one) runs no kvlease code. Its figures can only change
when something it reads changes: the case code and its harness (every file
under ``py/engine/``, the engine plugins included, and the end-to-end
harness's ports and hosts it imports), the tiny model (its
directory is named by the hash of its recipe), the pinned stock vLLM and
every other distribution in ``.venv-engine`` (kvlease's wheel left out: a
stock instance never imports it), Python and the machine's core count. The
key is the SHA-256 of all of those. Never time, never trust: change a byte
of any of them and the control runs again.

A stock push control costs the gate about four minutes on 2 cores (it waits
out hangs, and its D, stuck on a WRITE that cannot come, must be restarted),
so reusing it is most of what keeps step 11 in its budget. The plain
reference's texts (a ``vllm serve`` without KV transfer, no kvlease code
either) are kept the same way (conftest.py, ``sets``).

``KVLEASE_ENGINE_CONTROLS``: ``reuse`` (the default) reads the cache and
fills it; ``rerun`` runs every control again and refreshes the cache;
``off`` neither reads nor writes it.

A control's figures are stored only when they show what the control is for
(the case says which, ``store(..., shows=...)``): a control that showed
nothing fails its case and is never reused.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path

ENGINE_DIR = Path(__file__).resolve().parent
#: What the cases import from the end-to-end harness (instances.py), in
#: ``py/tests/vllm/harness/``.
HARNESS_FILES = ("__init__.py", "ports.py", "hosts.py")
MODES = ("reuse", "rerun", "off")


def _engine_files() -> list[tuple[str, Path]]:
    """Every file of the case code, its harness and plugins, by a name
    relative to ``py/``."""
    files = [p for p in ENGINE_DIR.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    harness = ENGINE_DIR.parent / "tests" / "vllm" / "harness"
    files += [harness / name for name in HARNESS_FILES if (harness / name).is_file()]
    return sorted((str(p.relative_to(ENGINE_DIR.parent)), p) for p in files)


def _distributions() -> list[str]:
    """name==version of every distribution this interpreter sees, kvlease's
    own wheel left out (stock instances never import it)."""
    seen = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name and name != "kvlease":
            seen.add(f"{name}=={dist.version}")
    return sorted(seen)


def inputs_key(model: str) -> str:
    """The SHA-256 of everything a stock control reads (see the module docs)."""
    h = hashlib.sha256()

    def part(label: str, data: bytes) -> None:
        h.update(label.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    for name, p in _engine_files():
        part(f"file:{name}", p.read_bytes())
    part("model", Path(model).name.encode())
    part("distributions", "\n".join(_distributions()).encode())
    part("python", sys.version.encode())
    part("machine", f"{platform.machine()} cores={os.cpu_count()}".encode())
    return h.hexdigest()


class ControlCache:
    """The figures of stock controls under one inputs key."""

    def __init__(self, key: str, root: Path | None = None, mode: str | None = None) -> None:
        mode = mode or os.environ.get("KVLEASE_ENGINE_CONTROLS", "reuse")
        if mode not in MODES:
            raise ValueError(f"KVLEASE_ENGINE_CONTROLS={mode!r}: expected one of {MODES}")
        self.key = key
        self.mode = mode
        root = root or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlease"
        self.path = root / "engine-controls" / f"{key}.json"

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def reused(self, case: str) -> dict | None:
        """The figures stored for ``case`` under this key (with
        ``reused_for`` naming the key), or None: then the control runs."""
        if self.mode != "reuse":
            return None
        entry = self._read().get(case)
        if entry is None:
            return None
        print(f"\n[real-engine] control reused: {case!r} measured "
              f"{entry['measured_at']} for inputs hash {self.key}")
        return {**entry["figures"], "reused_for": self.key[:16]}

    def store(self, case: str, figures: dict, *, shows: bool) -> None:
        """Keeps ``figures`` of a control just run, when it ``shows`` what
        it is for (a control that showed nothing fails its case)."""
        if self.mode == "off" or not shows:
            return
        entries = self._read()
        entries[case] = {"figures": figures,
                         "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        tmp.replace(self.path)
