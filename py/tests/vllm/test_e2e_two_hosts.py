"""End to end across two "hosts" whose monotonic clocks differ by 10^5 s
(issue 37, item 1, in the harness): P's and D's node processes each in a
network namespace of their own, UCX over TCP between them, and one of the two
in a time namespace whose ``CLOCK_MONOTONIC`` runs 100,000 s ahead
(``harness/hosts.py``). Once with D's host ahead, once with P's.

Cases, pull and push, kvlease beside stock vLLM:

- pull, happy path: the READ verified, P frees on the read-done;
- pull, late arrival with blocks reused: A's lease lapses, B takes its
  blocks, D reads A: kvlease fails the check and recomputes, stock serves
  B's bytes as A's;
- push, happy path: the WRITE lands, and P's estimate of D's clock (taken
  from vLLM's side channel, across the hosts) is within the error bound it
  claims of the true offset;
- push, a registration that reaches P after P let the request go: kvlease
  refuses it at once, stock D waits for good.

The stock controls run in the first orientation only: stock vLLM has no
clock in these paths, so the orientation cannot change what it does, and
step 10's time is the gate's. Every kvlease case runs in both. Needs root,
``ip`` and ``unshare``: skipped without them, failed under
``KVLEASE_REQUIRE_NIXL=1`` (``.ci/run``).
"""

from __future__ import annotations

import itertools
import os

import pytest
from harness import hosts
from harness.cluster import NodeProcess
from harness.ports import free_port
from harness.figures import figure
from test_e2e import _lapse_scenario, _reused_values
from test_e2e import assert_no_leaks as assert_pull_clean
from test_e2e import expected as pull_expected
from test_e2e import spec as pull_spec
from test_e2e_push import (
    CONNECTORS,
    FENCE,
    HANG_S,
    LEASE,
    PROMPT,
    assert_no_leaks,
    counter,
    decode,
    expected,
    held,
    spec,
    stock_hung,
    teardown,
)

OFFSET = 100_000
#: The orientations: whose host's clock runs ahead. Stock runs in the first.
AHEAD = ("D", "P")
_keys = itertools.count(9000)


@pytest.fixture(scope="module", params=AHEAD, ids=lambda a: f"{a}-ahead")
def two_hosts(request, tmp_path_factory):
    why = hosts.available()
    if why is not None:
        if os.environ.get("KVLEASE_REQUIRE_NIXL") == "1":
            pytest.fail(f"two hosts cannot be made here ({why}); KVLEASE_REQUIRE_NIXL=1")
        pytest.skip(f"two hosts cannot be made here: {why}")
    logs = tmp_path_factory.mktemp(f"nodes-2h-{request.param}")
    with hosts.TwoHosts(ahead=request.param, offset=OFFSET) as h:
        p = NodeProcess("P-2h", h.p.env(), logs, wrap=h.p.wrap, listen_host=h.gateway)
        d = NodeProcess("D-2h", h.d.env(), logs, wrap=h.d.wrap, listen_host=h.gateway)
        try:
            yield h, p, d, request.param == AHEAD[0]
        finally:
            p.close()
            d.close()


def connectors(with_stock: bool) -> list[str]:
    return list(CONNECTORS) if with_stock else ["kvlease"]


def test_the_hosts_clocks_differ_by_the_offset(two_hosts):
    """The setting itself: each node reads its own monotonic clock."""
    h, P, D, _ = two_hosts
    p_now = P.call("monotonic")
    d_now = D.call("monotonic")
    # Read one after the other: within the time the two calls took.
    assert abs((d_now - p_now) - h.true_offset) < 5.0, (d_now, p_now, h.true_offset)


def test_pull_happy_path_and_late_arrival_across_hosts(two_hosts):
    h, P, D, with_stock = two_hosts
    figures = []
    # Happy: verified (kvlease), or read as stock reads.
    for conn in ("kvlease", "stock") if with_stock else ("kvlease",):
        tag = f"2h-pull-{conn}-{h.true_offset}"
        pe, de = f"p-{tag}", f"d-{tag}"
        P.call("setup", spec=pull_spec("tcp", pe, "P", connector=conn,
                                       side_channel_port=free_port()))
        D.call("setup", spec=pull_spec("tcp", de, "D", connector=conn))
        key = next(_keys)
        pre = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
        got = D.call("decode", engine=de, key=key, tokens=PROMPT, params=pre["params"],
                     timeout=30)
        assert not got["timeout"] and got["seen"] == pull_expected(pre["prompt"]), conn
        assert not got["load_failed"]
        P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=30)
        prep, drep = assert_pull_clean(P, pe), assert_pull_clean(D, de)
        if conn == "kvlease":
            assert drep["counters"]["check0"]["verified"] == 1
            assert prep["counters"]["scheduler"]["released_read"] == 1
        teardown(P, pe)
        teardown(D, de)
    figures.append("happy: verified")
    # Late arrival, blocks reused: kvlease fails closed and recomputes.
    pe, de, a, b, got, _freed = _lapse_scenario(P, D, "tcp", f"2h-lapse-{h.true_offset}")
    wrong, right = _reused_values(a["params"], b), pull_expected(a["prompt"])
    assert got["read_bytes"] == wrong, "the READ did not land B's KV: the case proves nothing"
    assert got["load_failed"] and got["recomputed"] and got["seen"] == right
    got_b = D.call("decode", engine=de, key=b["key"], tokens=8 * 32, params=b["params"],
                   timeout=30)
    assert got_b["seen"] == pull_expected(b["prompt"]) and not got_b["load_failed"]
    P.call("wait_freed", engine=pe, request_id=b["request_id"], timeout=30)
    assert_pull_clean(P, pe)
    assert_pull_clean(D, de)
    teardown(P, pe)
    teardown(D, de)
    figures.append("late arrival: check failed, recomputed, A's own KV")
    if with_stock:
        pe, de, a, b, got, _ = _lapse_scenario(P, D, "tcp", f"2h-lapse-stock-{h.true_offset}",
                                               connector="stock")
        assert not got["load_failed"] and got["seen"] == _reused_values(a["params"], b), (
            "stock did not serve B's bytes as A's: the control proves nothing")
        teardown(P, pe)
        teardown(D, de)
        figures.append("stock: B's KV served as A's")
    figure(f"[two hosts, {h.true_offset:+d} s] pull: " + "; ".join(figures))


def test_push_happy_path_and_ps_estimate_of_ds_clock(two_hosts):
    h, P, D, with_stock = two_hosts
    for conn in connectors(with_stock):
        pe, de = f"p-2h-push-{conn}-{h.true_offset}", f"d-2h-push-{conn}-{h.true_offset}"
        P.call("setup", spec=spec(pe, "P", conn))
        D.call("setup", spec=spec(de, "D", conn))
        key = next(_keys)
        pre = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
        rid = D.call("add_decode", engine=de, key=key, tokens=PROMPT, params=pre["params"])
        got = D.call("result", engine=de, request_id=rid, timeout=30)
        assert not got["timeout"], f"{conn}: the push never completed"
        assert got["seen"] == expected(pre["prompt"]) and not got["load_failed"], conn
        P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=30)
        prep, drep = assert_no_leaks(P, pe), assert_no_leaks(D, de)
        assert prep["wire"]["posted"] == 1
        if conn == "kvlease":
            assert counter(drep, "permits0")["written"] == 1
            est = P.call("clock_estimates", engine=pe)["estimates"]
            ((offset, bound),) = est[0].values()  # the one D engine P met
            error = offset - h.true_offset
            assert abs(error) <= bound, (
                f"P's estimate of D's clock is {error * 1e3:+.2f} ms off the true offset, "
                f"outside the {bound * 1e3:.2f} ms it claims")
            figure(f"[two hosts, {h.true_offset:+d} s] push: written; P's estimate of D's "
                   f"clock {offset:+.6f} s, {error * 1e3:+.3f} ms off the true offset, "
                   f"bound {bound * 1e3:.3f} ms")
        teardown(P, pe)
        teardown(D, de)


def test_push_late_registration_across_hosts(two_hosts):
    h, P, D, with_stock = two_hosts
    for conn in connectors(with_stock):
        pe, de = f"p-2h-late-{conn}-{h.true_offset}", f"d-2h-late-{conn}-{h.true_offset}"
        P.call("setup", spec=spec(pe, "P", conn))
        D.call("setup", spec=spec(de, "D", conn))
        key = next(_keys)
        pre = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
        freed = P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=LEASE + 20)
        assert not freed["timeout"], f"{conn}: P never let the request go"
        t0, got, drep = decode(D, de, key, pre)
        if conn == "stock":
            figure(f"[two hosts, {h.true_offset:+d} s] push late registration: stock "
                   f"{stock_hung(got, drep)}")
            teardown(D, de)
            teardown(P, pe)
            continue
        assert not got["timeout"] and got["load_failed"] and got["recomputed"]
        assert got["seen"] == expected(pre["prompt"])
        took = got["loaded_at"] - t0  # both D's wall clock
        assert counter(drep, "permits0")["failed"] == {"refused": 1}
        assert took < FENCE - 3, f"the refusal took {took:.1f} s"
        assert drep["leaks"] == {} and held(drep) == 0
        prep = assert_no_leaks(P, pe)
        assert prep["wire"]["posted"] == 0
        figure(f"[two hosts, {h.true_offset:+d} s] push late registration: kvlease refused, "
               f"load failed {took:.2f} s after the registration, recomputed")
        teardown(P, pe)
        teardown(D, de)
