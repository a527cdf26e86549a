"""kvlease in a real vLLM engine, fleet shapes (issue 37): phase G, P and D
on two hosts whose monotonic clocks differ by 10^5 s.

Each "host" is a network namespace on a bridge the cases reach from this
machine's own namespace, and one of them also sits in a time namespace
whose ``CLOCK_MONOTONIC`` (and boot time) runs 10^5 s ahead
(``py/tests/vllm/harness/hosts.py``, the harness's own two hosts). Between
them UCX runs over TCP (``UCX_TLS=tcp``), the transport between hosts
without RDMA, and vLLM's side channels listen on the hosts' addresses. The
routers run on this machine, as a fleet's router runs on a host of its own.

=====  =========================================  ===============================================
phase  instances (role: connector, host)          cases
=====  =========================================  ===============================================
G1     D's host 10^5 s ahead. gp, gd: kvlease      pull happy path (toy proxy), late arrival with
       pull; gp_push, gd_push: kvlease push         P's blocks reused; push happy path and P's
                                                   estimate of D's clock; a push registration
                                                   that reaches P late
G1s    the same hosts, the stock pairs (only       the stock controls of the late arrival and
       when a control must be measured)            the late registration
G2     P's host ahead instead. gp, gd, gp_push,    pull happy path; push happy path and P's
       gd_push as in G1                            estimate of D's clock
=====  =========================================  ===============================================

Why these: across hosts nothing but the push guard reads the other side's
clock (P gates each WRITE on its estimate of D's clock, which it samples
over the side channel); the pull lease is P's own clock and D's heartbeats.
So the pull cases show that a clock 10^5 s off changes nothing there, and
the push cases show the gate right both ways round: the estimate within
the bound it claims of the true offset (which the time namespace makes
exactly 10^5 s), pushes written, and a late registration refused at once.

The stock controls are reused while nothing they read changed
(``controls.py``), as phase F's are; measured, they run on stock pairs
started on the same hosts once the kvlease pairs are stopped (8 instances
at once do not fit in 24 GiB).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from harness import hosts
from instances import InstanceSpec
from measures import counters
from push_pairs import PUSH_LEASE, d_leak, push_round, stock_hangs_and_leaks
from scenarios import every_load_verified_or_lapsed, happy, late_arrival
from shapes import d_spec, p_spec, push_spec

#: The time namespace's offset (s): D's clock minus P's is exactly this (G1)
#: or minus this (G2).
OFFSET = 100_000
#: The bridges' subnets (10.N.0.0/24) of G1 and G2: not the harness's (78),
#: so a step 10 left running beside cannot collide.
SUBNETS = {"D": 79, "P": 80}

#: P's log line for its first sample of a D engine's clock (push_clocks.py).
ESTIMATE = re.compile(r"kvlease: P's first estimate of D engine (\S+)'s clock: "
                      r"([+-][\d.]+) s from P's, error bound ([\d.]+) ms")


def on(spec: InstanceSpec, host) -> InstanceSpec:
    """``spec`` started on ``host`` (its log named after the host)."""
    return dataclasses.replace(spec, name=f"{spec.name}-on-{host.name}", host=host)


def kvlease_pairs(h) -> dict[str, InstanceSpec]:
    return dict(gp=on(p_spec("kvlease"), h.p), gd=on(d_spec("kvlease"), h.d),
                gp_push=on(push_spec("p", "kvlease-push"), h.p),
                gd_push=on(push_spec("d", "kvlease-push"), h.d))


def stock_pairs(h) -> dict[str, InstanceSpec]:
    return dict(gp_stock=on(p_spec("stock"), h.p), gd_stock=on(d_spec("stock"), h.d),
                gp_push_stock=on(push_spec("p", "stock-push"), h.p),
                gd_push_stock=on(push_spec("d", "stock-push"), h.d))


PUSH_ROLES = {"kvlease": ("gp_push", "gd_push"), "stock": ("gp_push_stock", "gd_push_stock")}


def two_hosts(fleet, ahead: str):
    """The two hosts (``ahead``: whose clock runs ahead) for one module-long
    phase; every instance on them is stopped before they are removed."""
    why = hosts.available()
    if why is not None:
        pytest.fail(f"two hosts cannot be made here: {why}")
    h = hosts.TwoHosts(ahead=ahead, offset=OFFSET, subnet=SUBNETS[ahead])
    with h:
        try:
            yield h
        finally:
            fleet.only()


@pytest.fixture(scope="module")
def d_ahead(fleet):
    yield from two_hosts(fleet, "D")


def estimates(p_inst, h) -> list[dict]:
    """P's estimates of D's clock from its log, each against the true offset."""
    out = []
    for engine, offset, bound_ms in ESTIMATE.findall(p_inst.log_text()):
        error_ms = abs(float(offset) - h.true_offset) * 1e3
        out.append({"engine": engine, "offset_s": float(offset),
                    "true_offset_s": h.true_offset, "error_ms": round(error_ms, 3),
                    "bound_ms": float(bound_ms)})
    return out


def push_happy_and_estimate(fleet, sets, h, label: str) -> dict:
    figures = push_round(fleet, "kvlease", sets["push-happy"], f"g-push-{label}",
                         roles=PUSH_ROLES["kvlease"])
    figures.update(d_leak(fleet.running["gd_push"], settle_s=0))
    est = estimates(fleet.running["gp_push"], h)
    figures["estimates"] = len(est)
    if est:
        worst = max(est, key=lambda e: e["error_ms"] - e["bound_ms"])
        figures.update(clock_offset_s=worst["offset_s"], true_offset_s=worst["true_offset_s"],
                       clock_error_ms=worst["error_ms"], clock_bound_ms=worst["bound_ms"])
    figures["crashes"] = len(fleet.check_crashes())
    return figures


def assert_push_happy(f: dict) -> None:
    assert f["texts_equal"] == f["requests"] - f["p_leg_failures"] and f["hangs"] == 0, f
    assert f["p_leg_failures"] <= 1 and f["wrong_answers"] == 0, f
    assert f["written"] >= 1 and f["permits"] >= f["requests"], f
    assert f["estimates"] >= 1, f"P logged no estimate of D's clock: {f}"
    assert f["clock_error_ms"] <= f["clock_bound_ms"], (
        f"P's estimate of D's clock is further off the true offset than it claims: {f}")
    assert f["crashes"] == 0, f


# ---- G1: D's host ahead ----------------------------------------------------------


def test_two_hosts_pull_happy_path_and_late_arrival(fleet, sets, record, d_ahead):
    """Pull across hosts, D's clock 10^5 s ahead: every load verified, and a
    request that reaches D after P let its lease go and reused its blocks
    fails the check and is recomputed (A's own text)."""
    fleet.only(**kvlease_pairs(d_ahead))
    figures = happy(fleet, sets["happy"], "toy", "gp", "gd")
    figures.update({f"late_{k}": v for k, v in late_arrival(fleet, sets, "gp", "gd").items()})
    figures["p_usage_end"] = fleet.running["gp"].kv_usage()
    figures["crashes"] = len(fleet.check_crashes())
    record.write("two hosts, D +1e5 s: pull happy + late arrival", "kvlease", **figures)
    assert figures["texts_equal"] == figures["requests"], figures
    every_load_verified_or_lapsed(figures)
    assert figures["late_a_equal"] == 1 and figures["late_a_wrong"] == 0, figures
    assert figures["late_failed_checks"] >= 1, figures
    assert figures["crashes"] == 0, figures


def test_two_hosts_push_happy_path_and_ps_estimate_of_ds_clock(fleet, sets, record, d_ahead):
    """Push across hosts, D's clock 10^5 s ahead: every push guarded and
    written or recomputed, none hangs, and P's estimate of D's clock is
    within the bound it claims of the true offset (+10^5 s)."""
    fleet.only(**kvlease_pairs(d_ahead))
    figures = push_happy_and_estimate(fleet, sets, d_ahead, "d-ahead")
    record.write("two hosts, D +1e5 s: push happy + clock estimate", "kvlease", **figures)
    assert_push_happy(figures)


def test_two_hosts_push_late_registration(fleet, sets, record, d_ahead):
    """A push registration that reaches P after P let the request go: P
    refuses it at once (its gate reads D's deadline through the estimate),
    D fails the load and recomputes, and D's blocks come back."""
    fleet.only(**kvlease_pairs(d_ahead))
    ps = sets["push-late"]
    figures = push_round(fleet, "kvlease", ps, "g-push-late", concurrency=len(ps.prompts),
                         between_s=PUSH_LEASE + 10, roles=PUSH_ROLES["kvlease"])
    figures.update(d_leak(fleet.running["gd_push"]))
    figures["crashes"] = len(fleet.check_crashes())
    record.write("two hosts, D +1e5 s: push late registration", "kvlease", **figures)
    assert figures["texts_equal"] == figures["requests"] - figures["p_leg_failures"], figures
    assert figures["hangs"] == 0 and figures["p_leg_failures"] <= 1, figures
    assert figures["push_failed"] >= 1 and figures["d_usage_end"] == 0, figures
    assert figures["crashes"] == 0, figures


def test_two_hosts_stock_controls(fleet, sets, record, controls, d_ahead):
    """Stock vLLM on the same two hosts: the late arrival is answered with
    another request's KV (HTTP 200, a wrong text), and the late push
    registration hangs with D's blocks held. Reused while nothing they read
    changed; a control that shows nothing fails the case."""
    late_case = "two hosts, D +1e5 s: late arrival"
    push_case = "two hosts, D +1e5 s: push late registration"
    late, push = controls.reused(late_case), controls.reused(push_case)
    if late is None or push is None:
        fleet.only(**stock_pairs(d_ahead))
    if late is None:
        before = counters(fleet.running["gp_stock"])
        late = late_arrival(fleet, sets, "gp_stock", "gd_stock")
        late["stock_expired"] = (counters(fleet.running["gp_stock"])["stock_expired"]
                                 - before["stock_expired"])
        controls.store(late_case, late, shows=late["a_wrong"] >= 1)
    if push is None:
        ps = sets["push-late"]
        push = push_round(fleet, "stock", ps, "g-push-late", concurrency=len(ps.prompts),
                          between_s=PUSH_LEASE + 10, roles=PUSH_ROLES["stock"])
        push.update(d_leak(fleet.running["gd_push_stock"]))
        controls.store(push_case, push, shows=stock_hangs_and_leaks(push))
    record.write(late_case, "stock", **late)
    record.write(push_case, "stock", **push)
    assert late["a_wrong"] >= 1, f"stock answered the late arrival right: tests nothing ({late})"
    assert stock_hangs_and_leaks(push), f"stock's late registration neither hung nor leaked: {push}"


# ---- G2: P's host ahead ----------------------------------------------------------


@pytest.fixture(scope="module")
def p_ahead(fleet):
    yield from two_hosts(fleet, "P")


def test_two_hosts_p_ahead_pull_and_push_happy(fleet, sets, record, p_ahead):
    """P's clock 10^5 s ahead instead: pull verified, pushes written, and
    P's estimate of D's clock within its bound of the true offset (-10^5 s)."""
    fleet.only(**kvlease_pairs(p_ahead))
    pull = happy(fleet, sets["mixed"], "float64", "gp", "gd")
    record.write("two hosts, P +1e5 s: pull happy", "kvlease", **pull)
    assert pull["texts_equal"] == pull["requests"], pull
    every_load_verified_or_lapsed(pull)
    push = push_happy_and_estimate(fleet, sets, p_ahead, "p-ahead")
    record.write("two hosts, P +1e5 s: push happy + clock estimate", "kvlease", **push)
    assert_push_happy(push)


def test_no_instance_crashed_on_two_hosts(fleet, record):
    """Last: no instance exited without a case asking it to (the whole run)."""
    fleet.only()
    fleet.check_crashes()
    record.write("crashes (whole run, phase G included)", "all", crashes=len(fleet.crashes))
    assert not fleet.crashes, fleet.crashes
