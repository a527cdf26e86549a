"""The comparison of vLLM's upstream tests with the plugin's classes against
stock vLLM (py/tests/upstream/compare_runs.py): with stock's collection
standing in for its run, only a substituted run that passed every collected
test (upstream's own xfails aside) may skip the stock run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "upstream" / "compare_runs.py"
_spec = importlib.util.spec_from_file_location("compare_runs", SCRIPT)
assert _spec is not None and _spec.loader is not None
compare_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_runs)

FILE = "tests/v1/kv_connector/unit/test_nixl_connector.py"
CLASSNAME = "tests.v1.kv_connector.unit.test_nixl_connector"


def junit(path: Path, cases: dict[str, str]) -> str:
    """A JUnit file of ``cases`` (name -> passed / failed / skipped / xfailed),
    as pytest writes it; a name may carry a class (``Class::test``)."""
    rows = []
    for name, outcome in cases.items():
        cls, _, test = name.rpartition("::")
        classname = CLASSNAME + ("." + cls if cls else "")
        child = {
            "passed": "",
            "failed": '<failure message="boom"/>',
            "skipped": '<skipped type="pytest.skip" message="no"/>',
            "xfailed": '<skipped type="pytest.xfail" message="upstream"/>',
        }[outcome]
        rows.append(f'<testcase classname="{classname}" name="{test}">{child}</testcase>')
    path.write_text("<testsuites><testsuite>" + "".join(rows) + "</testsuite></testsuites>")
    return str(path)


def report(path: Path, names: list[str]) -> str:
    """The substitution report: every test called one hook."""
    tests = {f"{FILE}::{n}": {"calls": {"KvLeaseScheduler.build_connector_meta": 1}} for n in names}
    path.write_text(json.dumps({"tests": tests}))
    return str(path)


def collection(path: Path, names: list[str]) -> str:
    lines = [f"{FILE}::{n}" for n in names] + ["", f"{len(names)} tests collected in 1.00s"]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


NAMES = ["test_a", "test_b[x-1]", "TestK::test_c"]


def run(tmp_path: Path, sub: dict[str, str], collected: list[str] = NAMES) -> int:
    return compare_runs.main(collection(tmp_path / "stock-collected.txt", collected),
                             junit(tmp_path / "sub.xml", sub), report(tmp_path / "sub.json", list(sub)))


def test_every_collected_test_passed_substituted_stands_in_for_the_stock_run(tmp_path, capsys):
    assert run(tmp_path, {n: "passed" for n in NAMES}) == 0
    assert "3 collected (not run" in capsys.readouterr().out


def test_upstreams_own_xfail_is_no_regression(tmp_path):
    assert run(tmp_path, {"test_a": "passed", "test_b[x-1]": "xfailed", "TestK::test_c": "passed"}) == 0


@pytest.mark.parametrize("outcome", ["failed", "skipped"])
def test_a_collected_test_that_did_not_pass_asks_for_the_stock_run(tmp_path, capsys, outcome):
    assert run(tmp_path, {"test_a": "passed", "test_b[x-1]": outcome, "TestK::test_c": "passed"}) == 1
    assert "test_nixl_connector.py::test_b[x-1]" in capsys.readouterr().out


def test_a_collected_test_missing_from_the_substituted_run_asks_for_the_stock_run(tmp_path, capsys):
    assert run(tmp_path, {"test_a": "passed", "TestK::test_c": "passed"}) == 1
    assert "test_nixl_connector.py::test_b[x-1]" in capsys.readouterr().out


def test_against_a_stock_run_only_what_passed_on_stock_must_pass(tmp_path):
    stock = junit(tmp_path / "stock.xml", {"test_a": "passed", "test_b[x-1]": "failed"})
    sub = junit(tmp_path / "sub.xml", {"test_a": "passed", "test_b[x-1]": "failed"})
    assert compare_runs.main(stock, sub, report(tmp_path / "sub.json", ["test_a", "test_b[x-1]"])) == 0
    sub = junit(tmp_path / "sub2.xml", {"test_a": "failed", "test_b[x-1]": "passed"})
    assert compare_runs.main(stock, sub, report(tmp_path / "sub2.json", ["test_a", "test_b[x-1]"])) == 1
