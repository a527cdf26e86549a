"""pytest fixtures of the real-engine cases: the fleet, the reference texts,
and the record every case leaves for the report.

Run through ``py/engine/run.sh`` (which builds the environment and the
kvlease wheel first), or by hand inside ``eval "$(py/engine/env.sh)"`` with
``$ENGINE_PYTHON -m pytest py/engine``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet import Fleet  # noqa: E402


def _work() -> Path:
    return Path(os.environ.get("ENGINE_WORK", Path(__file__).resolve().parents[2] / ".engine"))


@pytest.fixture(scope="session")
def results_dir() -> Path:
    d = _work() / "results"
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def fleet(results_dir: Path):
    model = os.environ.get("ENGINE_MODEL")
    if not model:
        pytest.fail("ENGINE_MODEL is not set: run py/engine/run.sh, or eval \"$(py/engine/env.sh)\"")
    logs = _work() / "logs" / time.strftime("%Y%m%d-%H%M%S")
    f = Fleet(model, logs)
    try:
        yield f
    finally:
        f.close()
        (results_dir / "crashes.json").write_text(json.dumps(f.crashes, indent=1))


class CaseRecord:
    """One line per case and connector in results/cases.jsonl (the report's table)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, case: str, connector: str, **figures) -> None:
        row = {"case": case, "connector": connector, **figures}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"\n[real-engine] {json.dumps(row)}")


@pytest.fixture(scope="session")
def record(results_dir: Path) -> CaseRecord:
    path = results_dir / "cases.jsonl"
    path.unlink(missing_ok=True)
    return CaseRecord(path)
