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

from controls import ControlCache, inputs_key  # noqa: E402
from fleet import Fleet  # noqa: E402
from prompt_sets import SETS, PromptSet  # noqa: E402
from harness import hosts  # noqa: E402  (on the path through instances.py)
from shapes import D_AHEAD, P_AHEAD, PHASE_A, REF  # noqa: E402
from workload import complete_all, run  # noqa: E402


def _work() -> Path:
    return Path(os.environ.get("ENGINE_WORK", Path(__file__).resolve().parents[2] / ".engine"))


@pytest.fixture(scope="session")
def results_dir() -> Path:
    d = _work() / "results"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _model() -> str:
    model = os.environ.get("ENGINE_MODEL")
    if not model:
        pytest.fail("ENGINE_MODEL is not set: run py/engine/run.sh, or eval \"$(py/engine/env.sh)\"")
    return model


@pytest.fixture(scope="session")
def controls() -> ControlCache:
    """Stock controls' figures, reused while nothing they read changed
    (controls.py)."""
    cache = ControlCache(inputs_key(_model()))
    print(f"\n[real-engine] stock controls: {cache.mode}, inputs hash {cache.key}")
    return cache


@pytest.fixture(scope="session")
def two_hosts():
    """The two pairs of hosts every P and D runs on (shapes.py), made for
    the session and removed after the fleet stopped."""
    why = hosts.available()
    if why is not None:
        pytest.fail(f"the hosts cannot be made here: {why} (root, ip and unshare)")
    with D_AHEAD, P_AHEAD:
        yield {"D ahead": D_AHEAD, "P ahead": P_AHEAD}


@pytest.fixture(scope="session")
def fleet(results_dir: Path, two_hosts):
    model = _model()
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


#: The cache entry of the plain reference's texts (controls.py).
REFERENCE_TEXTS = "reference texts (plain vllm serve)"


@pytest.fixture(scope="session")
def sets(fleet, controls) -> dict[str, PromptSet]:
    """Every prompt set with its reference texts from a plain ``vllm serve``,
    started beside the first P and D and stopped once it answered. The
    plain instance runs no kvlease code: its texts are reused while nothing
    it read changed, as the stock controls are (controls.py), and then it
    is not started at all."""
    # Comma-separated prefixes: a quicker run of some cases (phase A is
    # then not started beside the reference).
    only = [x for x in os.environ.get("ENGINE_ONLY_SETS", "").split(",") if x]
    out = {s[0]: PromptSet(fleet.model, s) for s in SETS
           if not only or any(s[0].startswith(x) for x in only)}
    texts = {k: v for k, v in (controls.reused(REFERENCE_TEXTS) or {}).items()
             if k != "reused_for"}
    missing = [ps for ps in out.values() if len(texts.get(ps.name, ())) != len(ps.prompts)]
    fleet.ensure(**({"ref": REF} if missing else {}), **({} if only else PHASE_A))
    for ps in missing:
        answers = run(complete_all(fleet.running["ref"].url, ps.prompts, concurrency=8,
                                   max_tokens=ps.max_tokens, prefix=f"ref-{ps.name}"))
        bad = [a for a in answers if not a.ok]
        assert not bad, f"the plain reference failed: {bad[0].error}"
        texts[ps.name] = [a.text for a in answers]
    if missing:
        fleet.stop("ref")
        controls.store(REFERENCE_TEXTS, texts, shows=True)
    for ps in out.values():
        ps.reference = texts[ps.name]
    return out
