"""pytest plugin: run vLLM's own NIXL connector tests with other classes in
place of vLLM's connector, scheduler and worker, without editing those tests.

Owns: rebinding the public names under which vLLM 0.34.0 exports its pull
connector classes, before any test module is imported, and proving afterwards
that the collected test modules and the calls made during the run went to the
substitutes. It may not touch the upstream test files (run-upstream.sh checks
their sha256 manifest) nor any vLLM class's own definition: only names that
point at a class are rebound, so a substitute can still subclass the original.

Load it with ``-p kvlease_substitute --kvlease-substitute=MODULE`` (with this
folder on ``sys.path``). MODULE must define ``UPSTREAM_SUBSTITUTES``, a dict
with any of the keys ``"connector"``, ``"scheduler"``, ``"worker"``, each a
subclass of ``NixlPullConnector``, ``NixlPullConnectorScheduler`` or
``NixlPullConnectorWorker``, and may define ``CALLS``, a
``collections.Counter`` its classes increment per hook call: the plugin then
reports, per test, which substitute hooks ran.

Why the names and not the classes: the upstream tests take the classes from
the ``nixl`` package (``from ...v1.nixl import NixlConnector,
NixlConnectorScheduler, NixlConnectorWorker``), from the compatibility modules
``nixl.scheduler`` / ``nixl.worker`` (``make_nixl_scheduler``, the heartbeat
tests' ``_worker_stub``), and through ``KVConnectorFactory``, whose lazy loader
reads the ``nixl`` package attribute. ``NixlPullConnector.__init__`` builds its
scheduler and worker from the globals of ``nixl.connector``, rebound too so a
pass-through connector that calls ``super().__init__`` builds the substitutes.
The defining modules (``pull_scheduler``, ``pull_worker``) are left alone.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections import Counter
from typing import Any

import pytest

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

# role -> (module that defines the stock class, stock class name,
#          [(module, attribute) to rebind])
_TARGETS: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "connector": (
        f"{_NIXL}.connector",
        "NixlPullConnector",
        [
            (_NIXL, "NixlConnector"),
            (_NIXL, "NixlPullConnector"),
            (f"{_NIXL}.connector", "NixlConnector"),
        ],
    ),
    "scheduler": (
        f"{_NIXL}.pull_scheduler",
        "NixlPullConnectorScheduler",
        [
            (_NIXL, "NixlConnectorScheduler"),
            (_NIXL, "NixlPullConnectorScheduler"),
            (f"{_NIXL}.scheduler", "NixlConnectorScheduler"),
            (f"{_NIXL}.scheduler", "NixlPullConnectorScheduler"),
            (f"{_NIXL}.connector", "NixlPullConnectorScheduler"),
        ],
    ),
    "worker": (
        f"{_NIXL}.pull_worker",
        "NixlPullConnectorWorker",
        [
            (_NIXL, "NixlConnectorWorker"),
            (_NIXL, "NixlPullConnectorWorker"),
            (f"{_NIXL}.worker", "NixlConnectorWorker"),
            (f"{_NIXL}.worker", "NixlPullConnectorWorker"),
            (f"{_NIXL}.connector", "NixlPullConnectorWorker"),
        ],
    ),
}

# The names a collected upstream test module may hold; each must be a substitute.
_MODULE_NAMES = {
    "NixlConnector": "connector",
    "NixlPullConnector": "connector",
    "NixlConnectorScheduler": "scheduler",
    "NixlPullConnectorScheduler": "scheduler",
    "NixlConnectorWorker": "worker",
    "NixlPullConnectorWorker": "worker",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvlease")
    group.addoption(
        "--kvlease-substitute",
        metavar="MODULE",
        default=None,
        help="module whose UPSTREAM_SUBSTITUTES replace vLLM's NIXL pull classes",
    )
    group.addoption(
        "--kvlease-report",
        metavar="PATH",
        default=None,
        help="write per-test substitute hook calls and outcomes as JSON",
    )


class _Substitution:
    """The rebinding done at configure time and the evidence gathered after."""

    def __init__(self, module_name: str) -> None:
        self.module_name = module_name
        self.module = importlib.import_module(module_name)
        self.substitutes: dict[str, type] = dict(self.module.UPSTREAM_SUBSTITUTES)
        self.calls: Counter[str] | None = getattr(self.module, "CALLS", None)
        self.rebound: list[str] = []
        self.per_test: dict[str, dict[str, Any]] = {}
        self._before: Counter[str] = Counter()

    def apply(self) -> None:
        unknown = set(self.substitutes) - set(_TARGETS)
        if unknown:
            raise pytest.UsageError(f"UPSTREAM_SUBSTITUTES: unknown roles {sorted(unknown)}")
        for role, cls in self.substitutes.items():
            def_module, def_name, names = _TARGETS[role]
            stock = getattr(importlib.import_module(def_module), def_name)
            if not (isinstance(cls, type) and issubclass(cls, stock)) or cls is stock:
                raise pytest.UsageError(
                    f"UPSTREAM_SUBSTITUTES[{role!r}] must be a proper subclass of "
                    f"{def_module}.{def_name}, got {cls!r}"
                )
            for mod_name, attr in names:
                mod = importlib.import_module(mod_name)
                current = getattr(mod, attr)
                if current is not stock and current is not cls:
                    raise pytest.UsageError(
                        f"{mod_name}.{attr} is {current!r}, not vLLM's {def_name}: "
                        "the vLLM layout changed, update kvlease_substitute._TARGETS"
                    )
                setattr(mod, attr, cls)
                self.rebound.append(f"{mod_name}.{attr} -> {cls.__module__}.{cls.__qualname__}")

    def check_modules(self, items: list[pytest.Item]) -> list[str]:
        """Every collected module's connector names must be the substitutes."""
        problems = []
        seen = set()
        for item in items:
            mod = getattr(item, "module", None)
            if mod is None or mod.__name__ in seen:
                continue
            seen.add(mod.__name__)
            for name, role in _MODULE_NAMES.items():
                if role in self.substitutes and hasattr(mod, name):
                    if getattr(mod, name) is not self.substitutes[role]:
                        problems.append(f"{mod.__name__}.{name} is {getattr(mod, name)!r}")
        return problems

    def before_test(self) -> None:
        if self.calls is not None:
            self._before = Counter(self.calls)

    def after_test(self, nodeid: str) -> None:
        if self.calls is None:
            return
        delta = Counter(self.calls)
        delta.subtract(self._before)
        self.per_test.setdefault(nodeid, {})["calls"] = {
            k: v for k, v in sorted(delta.items()) if v > 0
        }


_state: _Substitution | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    global _state
    module_name = config.getoption("--kvlease-substitute")
    if not module_name:
        return
    _state = _Substitution(module_name)
    _state.apply()


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if _state is None:
        return
    problems = _state.check_modules(items)
    if problems:
        raise pytest.UsageError(
            "upstream test modules hold vLLM's classes, not the substitutes "
            "(imported before the plugin ran?): " + "; ".join(problems)
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if _state is not None:
        _state.before_test()
    yield
    if _state is not None:
        _state.after_test(item.nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _state is None:
        return
    entry = _state.per_test.setdefault(report.nodeid, {})
    # The call phase decides, unless setup failed or was skipped.
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        entry["outcome"] = outcome


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _state is None:
        return
    tr = terminalreporter
    tr.section("kvlease substitution")
    tr.write_line(f"substitute module: {_state.module_name}")
    for line in _state.rebound:
        tr.write_line(f"  rebound {line}")
    if _state.calls is not None:
        touched = {n: e for n, e in _state.per_test.items() if e.get("calls")}
        tr.write_line(
            f"tests that called a substitute hook: {len(touched)} of {len(_state.per_test)}"
        )
        totals: Counter[str] = Counter()
        for e in touched.values():
            totals.update(e["calls"])
        for name, n in sorted(totals.items()):
            tr.write_line(f"  {name}: {n} calls")
    path = config.getoption("--kvlease-report")
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "substitute_module": _state.module_name,
                    "rebound": _state.rebound,
                    "tests": _state.per_test,
                },
                f,
                indent=1,
                sort_keys=True,
            )
        tr.write_line(f"report written to {path}")


# Let `-p kvlease_substitute` find this module even when it was imported under
# another name (pytest registers plugins by module name).
sys.modules.setdefault("kvlease_substitute", sys.modules[__name__])
