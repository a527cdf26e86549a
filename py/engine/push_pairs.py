"""Phase F of the real-engine cases: the push pairs (vLLM's
NixlPushConnector against kvlease's KvLeaseNixlPushConnector), their
timing constants, and the figures of one push round.

Owns: the push pairs' roles in the fleet, how long a client waits for a D
leg, what counts as a hang, and the stock controls' reuse through
``controls.py``. May not start instances (``test_real_engine.push_phase``
does, with the other phases' shapes) or judge a case.
"""

from __future__ import annotations

import re
import time

from measures import compare, counters, delta, p_usage_back
from workload import Answer, push_all, run

#: kv_lease_duration of the push pairs (s): the lease of the issue's trial.
#: D's write permit lasts as long, so a permit P never renews is fenced
#: PUSH_LEASE + the write bound (kv_lease_push_write_bound, 10 s) after
#: D registered it.
PUSH_LEASE = 12.0
PUSH_WRITE_BOUND = 10.0
PUSH_FENCE = PUSH_LEASE + PUSH_WRITE_BOUND
PUSH_EXTRA = {"kv_lease_duration": int(PUSH_LEASE)}
#: How long a client waits for its D leg before it counts a hang and gives
#: up (which aborts the request on D): past kvlease's worst case, a push
#: fenced (22 s) and recomputed on a 2-core machine whose engines stall for
#: tens of seconds at a time (a recompute's D leg took 44 s once, and more
#: than 60 s twice with every push already failed by D).
PUSH_PATIENCE = 120.0
#: The same for the stock control: stock has no bound at all (its
#: registration watchdog, 480 s, only logs), and it runs on a quiet machine
#: (below), where a push P serves answers in seconds: a D leg with no answer
#: after five of P's leases waits for a WRITE that no longer comes.
STOCK_PUSH_PATIENCE = 60.0


def d_leg_patience(c: str) -> float:
    """How long pair ``c``'s clients wait for a D leg before counting a hang."""
    return PUSH_PATIENCE if c == "kvlease" else STOCK_PUSH_PATIENCE


PUSH_COUNTERS = {
    # D
    "permits": "vllm:kv_push_permits_total",
    "push_failed": "vllm:kv_push_failed_total",
    "unguarded": "vllm:kv_push_unguarded_total",
    # P
    "written": "vllm:kv_push_written_total",
    "refused": "vllm:kv_push_refused_total",
    "gate_closed": "vllm:kv_push_gate_closed_total",
}


#: What a stock vLLM logs for a notification it cannot place (it reads the
#: text before the last ":" as a request id): a guard message that reached it.
STRAY = r"request (PRN|PRV|PEND|PHB) notif|PUSH_REG.*kvlease_permit"

#: P's log line for its first sample of a D engine's clock (push_clocks.py).
ESTIMATE = re.compile(r"kvlease: P's first estimate of D engine (\S+)'s clock: "
                      r"([+-][\d.]+) s from P's, error bound ([\d.]+) ms")

#: The fleet's roles of each push pair.
PAIRS = {"kvlease": ("p_push", "d_push"), "stock": ("p_push_stock", "d_push_stock")}


def stock_control(controls, case: str, measure, shows) -> dict:
    """The stock control of ``case``: reused when nothing it reads changed
    (controls.py; the figures then name the inputs hash in ``reused_for``),
    else ``measure()`` now, kept for next time when ``shows(figures)``."""
    figures = controls.reused(case)
    if figures is None:
        figures = measure()
        controls.store(case, figures, shows=shows(figures))
    return figures


def stock_hangs_and_leaks(figures: dict) -> bool:
    """What the stock push controls are for: a D leg hung, and D kept blocks."""
    return figures["hangs"] >= 1 and figures["d_usage_end"] > 0


def push_counters(inst) -> dict[str, float]:
    return counters(inst, names=PUSH_COUNTERS)


def d_leak(d, settle_s: float = 3.0) -> dict:
    """D's KV usage with nothing running or waiting: what stays held is
    leaked. ``d_busy_cores``: the cores D kept busy meanwhile (stock's D
    spins on the pushes it still waits for)."""
    time.sleep(settle_s)
    return {"d_running": d.metric("vllm:num_requests_running"),
            "d_waiting": d.metric("vllm:num_requests_waiting"),
            "d_usage_end": round(d.kv_usage(), 4),
            "d_busy_cores": round(d.busy_cores(), 2)}


def usage_back(inst, timeout: float) -> float | None:
    """Seconds until ``inst``'s KV usage is 0, or None."""
    return p_usage_back(inst, 0.0, timeout)


def retire_stuck_stock_d(fleet, figures: dict) -> None:
    """Stops the stock D once it was left waiting on a push that cannot come
    (a hang, or KV still held): its engine then steps without end, 1.6-1.7
    cores busy (``d_busy_cores``), which on this 2-core machine starves
    every instance beside it, so that P legs of the next case time out (with
    the pairs at once, one run lost 6 of kvlease's 8 P legs, a gate run 4 of
    a mixed case's 4). The next case's ``push_phase`` starts a fresh one.
    Its figures are recorded first."""
    if figures["hangs"] or figures.get("d_usage_end", 0) > 0:
        fleet.stop(PAIRS["stock"][1])


def push_figures(answers: list[Answer], reference: list[str]) -> dict:
    figures = compare(answers, reference)
    # A hang is a D leg with no answer; a P leg that failed (P's own 60 s
    # patience, on an engine stalling for tens of seconds) never reached D:
    # counted apart, and left out of the texts a push must get right.
    figures["hangs"] = sum(a.status == 0 and a.p_leg_s is not None for a in answers)
    figures["p_leg_failures"] = sum(a.status == 0 and a.p_leg_s is None for a in answers)
    oks = [a.latency_s for a in answers if a.ok]
    figures["latency_max_s"] = round(max(oks), 1) if oks else None
    return figures


def push_round(fleet, c: str, ps, name: str, *, concurrency: int = 2,
               roles: tuple[str, str] | None = None, **kw) -> dict:
    """One push round of ``ps`` on pair ``c`` ("kvlease" or "stock"; its
    roles ``PAIRS[c]`` unless ``roles`` names others): the answers' figures,
    D's permits and failed pushes, P's WRITEs and refusals. Each D leg waits
    ``d_leg_patience(c)``."""
    p, d = (fleet.running[r] for r in (roles or PAIRS[c]))
    pb, db = push_counters(p), push_counters(d)
    answers = run(push_all(p.url, d.url, ps.prompts, prefix=f"{name}-{c}",
                           concurrency=concurrency, max_tokens=ps.max_tokens,
                           timeout_s=d_leg_patience(c), **kw))
    figures = push_figures(answers, ps.reference)
    figures.update(delta(push_counters(d), db, "permits", "push_failed"))
    figures.update(delta(push_counters(p), pb, "written", "refused"))
    return figures


def clock_estimate(p, true_offset: float) -> dict:
    """P's estimates of D's clock from P's log, the one furthest outside its
    claimed bound against ``true_offset`` (D's clock minus P's, exactly, on
    two hosts of shapes.py): ``estimates`` (how many) and, when there is one,
    its offset, the true offset, its error and its bound."""
    found = [(float(offset), float(bound_ms))
             for _engine, offset, bound_ms in ESTIMATE.findall(p.log_text())]
    out: dict = {"estimates": len(found)}
    if found:
        offset, bound_ms = max(found, key=lambda e: abs(e[0] - true_offset) * 1e3 - e[1])
        out.update(clock_offset_s=offset, true_offset_s=true_offset,
                   clock_error_ms=round(abs(offset - true_offset) * 1e3, 3),
                   clock_bound_ms=bound_ms)
    return out


def estimate_within_its_bound(figures: dict) -> None:
    """P logged an estimate of D's clock, and it is no further off the true
    offset than the bound it claims."""
    assert figures["estimates"] >= 1, f"P logged no estimate of D's clock: {figures}"
    assert figures["clock_error_ms"] <= figures["clock_bound_ms"], (
        f"P's estimate of D's clock is further off the true offset than it claims: {figures}")


def every_push_served(f: dict) -> None:
    """Every D leg answered with the reference's text (written, or failed
    and recomputed: a recompute, never a wait), no hang, and at most one P
    leg lost to P's own patience (counted apart: it never reached D)."""
    assert f["texts_equal"] == f["requests"] - f["p_leg_failures"] and f["hangs"] == 0, f
    assert f["p_leg_failures"] <= 1, f
