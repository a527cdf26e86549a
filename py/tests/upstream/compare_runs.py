"""Compare a stock run of vLLM's upstream connector tests with a substituted
run: every test that passed on stock vLLM must pass with the substitutes, and
the substitutes must actually have been called.

Owns: reading the two JUnit XML files and the substitution report, printing
the per-test table, and the exit status. May not run tests itself.

    python compare_runs.py STOCK.xml SUBSTITUTE.xml SUBSTITUTE.json
    python compare_runs.py COLLECTED.txt SUBSTITUTE.xml SUBSTITUTE.json

The second form stands in for the stock run when the substituted run failed
nothing (``run-upstream.sh``): COLLECTED.txt is ``pytest --collect-only -q``
of the same files without substitution, and every test it lists must have
passed with the substitutes (or be upstream's own xfail). Anything else
(a test missing, skipped, failed) exits 1, and the caller then runs the
stock baseline to tell vLLM's failures from ours.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET


def outcomes(path: str) -> dict[str, str]:
    """Test name (file::name[params]) -> passed / failed / error / skipped / xfailed."""
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "")
        # classname is dotted (tests.v1...test_file[.Class]); keep file and class.
        parts = cls.split(".")
        file_idx = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        name = "::".join([parts[file_idx] + ".py", *parts[file_idx + 1 :], case.get("name", "")])
        outcome = "passed"
        for child in case:
            if child.tag == "failure":
                outcome = "failed"
            elif child.tag == "error":
                outcome = "error"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        result[name] = outcome
    return result


def collected(path: str) -> dict[str, str]:
    """``pytest --collect-only -q`` node ids -> "collected", named as
    ``outcomes`` names them (file::[Class::]name[params])."""
    result = {}
    with open(path) as f:
        for line in f:
            nodeid = line.strip()
            if "::" not in nodeid:
                continue  # the summary line, blank lines
            file, _, rest = nodeid.partition("::")
            result[file.rsplit("/", 1)[-1] + "::" + rest] = "collected"
    return result


def main(stock_xml: str, sub_xml: str, sub_json: str) -> int:
    stock = collected(stock_xml) if stock_xml.endswith(".txt") else outcomes(stock_xml)
    sub = outcomes(sub_xml)
    with open(sub_json) as f:
        report = json.load(f)
    calls_by_short = {}
    for nodeid, entry in report["tests"].items():
        path, _, rest = nodeid.partition("::")
        short = path.rsplit("/", 1)[-1] + "::" + rest
        calls_by_short[short] = entry.get("calls", {})

    regressions = []
    touched = 0
    active = 0
    print(f"{'test':<100} {'stock':<8} {'subst.':<8} hook calls (with kvlease state)")
    for name in sorted(set(stock) | set(sub)):
        s, t = stock.get(name, "-"), sub.get(name, "-")
        calls = calls_by_short.get(name, {})
        # Modules that count "Class.hook [kvlease]" too (kvlease_plugin):
        # calls that found kvlease's roles built, not vLLM's behaviour alone.
        with_state = sum(v for k, v in calls.items() if k.endswith(" [kvlease]"))
        plain = sum(v for k, v in calls.items() if not k.endswith(" [kvlease]"))
        if plain:
            touched += 1
        if with_state:
            active += 1
        if s == "passed" and t != "passed":
            regressions.append(name)
        elif s == "collected" and t not in ("passed", "xfailed"):
            regressions.append(name)
        print(f"{name:<100} {s:<8} {t:<8} {plain} ({with_state})")

    def count(d: dict[str, str]) -> str:
        keys = ("passed", "failed", "error", "skipped", "xfailed")
        return ", ".join(f"{sum(v == k for v in d.values())} {k}" for k in keys)

    if "collected" in stock.values():
        print(f"stock:      {len(stock)} collected (not run: the substituted run failed nothing)")
    else:
        print(f"stock:      {count(stock)}")
    print(f"substitute: {count(sub)}")
    print(f"tests that called a substitute hook: {touched} of {len(sub)}")
    if active:
        print(f"tests in which a hook ran with kvlease state active: {active} of {len(sub)}")
    if regressions:
        print("passed on stock vLLM (or collected there) but not with the substitutes:")
        for name in regressions:
            print(f"  {name}")
        return 1
    if touched == 0:
        print("no test called a substitute hook: the substitution did not take")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
