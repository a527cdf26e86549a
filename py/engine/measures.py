"""Figures read off running instances: texts against the reference, the
lease counters of /metrics and their deltas, and how long KV usage takes
to come back.

Owns: how a figure is read (settled counters, polled usage). May not judge
a case: the cases in ``test_real_engine.py`` assert on what these return.
"""

from __future__ import annotations

import re
import time

from workload import Answer


def compare(answers: list[Answer], reference: list[str]) -> dict[str, int]:
    equal = sum(a.ok and a.text == r for a, r in zip(answers, reference))
    wrong = sum(a.ok and a.text != r for a, r in zip(answers, reference))
    failed = sum(not a.ok for a in answers)
    return {"requests": len(answers), "texts_equal": equal, "wrong_answers": wrong,
            "http_errors": failed}


COUNTERS = {
    # D
    "verified": "vllm:kv_lease_verified_loads_total",
    "failed_checks": "vllm:kv_lease_failed_checks_total",
    "unverified": "vllm:kv_lease_unverified_loads_total",
    "failed_transfers": "vllm:nixl_num_failed_transfers_total",
    "late_rounds": "vllm:kv_lease_late_heartbeat_rounds_total",
    # P
    "expired": "vllm:kv_lease_expired_total",
    "stock_expired": "vllm:nixl_num_kv_expired_reqs_total",
}


def counters(inst, settle: bool = True, names: dict[str, str] = COUNTERS) -> dict[str, float]:
    """An instance's lease counters (0 for those it does not export), read
    once they stopped moving: a step's stats reach /metrics with the engine's
    next output batch, a moment after the answer that step produced."""
    last = None
    for _ in range(20 if settle else 1):
        now = {}
        for key, metric in names.items():
            try:
                now[key] = inst.metric(metric)
            except KeyError:
                now[key] = 0.0
        if now == last:
            break
        last = now
        time.sleep(0.5)
    return last


def delta(after: dict, before: dict, *keys: str) -> dict[str, float]:
    return {k: after[k] - before[k] for k in keys}


def p_usage_back(p, baseline: float, timeout: float) -> float | None:
    """Seconds until P's KV usage is back at ``baseline``, or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if p.kv_usage() <= baseline + 1e-9:
            return time.monotonic() - t0
        time.sleep(0.25)
    return None


def per_engine(inst, name: str) -> dict[str, float]:
    """``name``'s samples by vLLM's ``engine`` label (the DP rank's
    EngineCore), summed over the other labels."""
    out: dict[str, float] = {}
    for key, value in inst.metrics().items():
        if key == name or key.startswith(name + "{"):
            m = re.search(r'engine="([^"]*)"', key)
            rank = m.group(1) if m else "?"
            out[rank] = out.get(rank, 0.0) + value
    return out
