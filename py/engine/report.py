"""Prints the real-engine cases' figures (results/cases.jsonl) as a table.

    python report.py .engine/results/cases.jsonl

One row per case and connector: requests, texts equal to the plain
reference, wrong answers (HTTP 200 with another text), failed lease checks
(each one a recompute under kv_load_failure_policy "recompute"), P's KV usage
at the end, crashes, and the case's own figures.
"""

from __future__ import annotations

import json
import sys

MAIN = ("requests", "texts_equal", "wrong_answers", "failed_checks", "p_usage_end", "p_crashes")


def cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def main(path: str) -> int:
    try:
        rows = [json.loads(line) for line in open(path) if line.strip()]
    except FileNotFoundError:
        print(f"no figures: {path} is missing")
        return 1
    print("| case | connector | requests | equal | wrong | failed checks | other figures |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        other = ", ".join(f"{k} {cell(v)}" for k, v in r.items()
                          if k not in ("case", "connector", *MAIN[:4]))
        print(f"| {r['case']} | {r['connector']} | {cell(r.get('requests'))} | "
              f"{cell(r.get('texts_equal', r.get('a_equal')))} | "
              f"{cell(r.get('wrong_answers', r.get('a_wrong')))} | "
              f"{cell(r.get('failed_checks'))} | {other} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".engine/results/cases.jsonl"))
