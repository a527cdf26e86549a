"""End to end, push mode: vLLM's NixlPushConnector (stock) beside
KvLeaseNixlPushConnector, P and D in two processes, real NIXL agents
(nixl_cu12) over UCX TCP, driven the way vLLM's scheduler and workers call
the connector (``harness/engine.py``). Every case runs both connectors: stock
is the control that shows the fault.

The faults sit on the wire beneath every layer of the connector
(``harness/faults.py``, ``PushWire``): notifications dropped by prefix or
delivered twice, and P's WRITEs held on the wire (posted by vLLM, landing
seconds later, ``check_xfer_state`` saying ``PROC`` meanwhile).

What kvlease must show in each (issue 29): no hang, no leaked block, no
WRITE landing in a block D freed, and every D request's KV equal to P's
(loaded, or recomputed after a failed load). Real time with short leases:
``kv_lease_duration`` 6 s (P's heartbeat every 1 s) and a write bound of
4 s, so D's fence is 10 s after its last renewal; bounds are generous where
a bound is asserted.
"""

from __future__ import annotations

import itertools
import time

import pytest
from harness.cluster import NodeProcess
from harness.ports import free_port

from harness.figures import figure
from harness.kv_pattern import block_value
from harness.transports import TRANSPORTS

LEASE = 6
WRITE_BOUND = 4
#: D's fence after its last permit renewal: duration + write bound (the
#: drift allowance is 100 ppm: microseconds here).
FENCE = LEASE + WRITE_BOUND
PROMPT = 80  # 3 blocks of 32
#: A stock request that has not ended this long after the fence hangs.
HANG_S = FENCE + 8
TRANSPORT = "tcp"
CONNECTORS = {"stock": "stock-push", "kvlease": "kvlease-push"}
#: D's usable blocks (EngineSpec's 64, less vLLM's null block).
D_USABLE = 63
_keys = itertools.count(5000)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    env, _ = TRANSPORTS[TRANSPORT]
    logs = tmp_path_factory.mktemp("nodes-push")
    p = NodeProcess("P-push", env, logs)
    d = NodeProcess("D-push", env, logs)
    yield p, d
    p.close()
    d.close()


def spec(name: str, role: str, connector: str, **kw) -> dict:
    _, ucx = TRANSPORTS[TRANSPORT]
    extra = dict(kw.pop("extra", {}), kv_lease_push_write_bound=WRITE_BOUND)
    s = dict(name=name, role=role, connector=CONNECTORS[connector],
             side_channel_port=free_port(), lease_duration=LEASE, ucx_backend_params=ucx,
             extra=extra)
    s.update(kw)
    return s


def pair(P, D, tag: str, p_conn: str, d_conn: str | None = None, p_kw=None, d_kw=None):
    pe, de = f"p-{tag}", f"d-{tag}"
    P.call("setup", spec=spec(pe, "P", p_conn, **(p_kw or {})))
    D.call("setup", spec=spec(de, "D", d_conn or p_conn, **(d_kw or {})))
    return pe, de


def expected(prompt: list[int]) -> list[set[int]]:
    return [{block_value(prompt, i)} for i in range(-(-len(prompt) // 32))]


def report(node: NodeProcess, engine: str) -> dict:
    rep = node.call("report", engine=engine, settle_steps=20)
    assert rep["crashed"] is None, f"{engine}'s engine step raised:\n{rep['crashed']}"
    return rep


#: How long the writer threads get to drop what they hold of an ended
#: request (vLLM's push writer evicts P's finished blocks on its next loop;
#: one full run on a loaded 2-core VM found one still there at the first
#: report).
SETTLE_S = 5.0


def assert_no_leaks(node: NodeProcess, engine: str) -> dict:
    deadline = time.time() + SETTLE_S
    rep = report(node, engine)
    while rep["leaks"] and time.time() < deadline:
        node.call("sleep", seconds=0.25)
        rep = report(node, engine)
    assert rep["leaks"] == {}, f"{engine} leaks {SETTLE_S} s on: {rep['leaks']}"
    return rep


def teardown(node: NodeProcess, *engines: str) -> None:
    for e in engines:
        node.call("teardown", engine=e)


def held(rep: dict) -> int:
    """D's blocks not free after the report's settle steps."""
    return D_USABLE - rep["free_blocks"]


def decode(D: NodeProcess, de: str, key: int, pre: dict) -> tuple[float, dict, dict]:
    """D's request for P's ``pre``: when it was added, its result (or a
    timeout after ``HANG_S``), and D's report then."""
    t0 = time.time()
    rid = D.call("add_decode", engine=de, key=key, tokens=PROMPT, params=pre["params"])
    got = D.call("result", engine=de, request_id=rid, timeout=HANG_S)
    return t0, got, report(D, de)


def stock_hung(got: dict, drep: dict, blocks: int = 3) -> str:
    """The control: stock D still waits on a push that cannot come, its
    blocks held. Returns the figure."""
    assert got["timeout"], "stock D ended a push that could not come: the control is void"
    assert held(drep) == blocks, drep["leaks"]
    return f"hung > {HANG_S} s, D holds its {held(drep)} blocks"


def counter(rep: dict, key: str) -> dict:
    return rep["counters"].get(key, {})


def test_push_happy_path(nodes):
    """The control for every case below: both connectors push and D decodes
    P's KV; nothing is left on either side."""
    P, D = nodes
    for conn in CONNECTORS:
        pe, de = pair(P, D, f"happy-{conn}", conn)
        key = next(_keys)
        pre = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
        rid = D.call("add_decode", engine=de, key=key, tokens=PROMPT, params=pre["params"])
        got = D.call("result", engine=de, request_id=rid, timeout=30)
        assert not got["timeout"], f"{conn}: the push never completed"
        assert got["seen"] == expected(pre["prompt"]), f"{conn}: D's KV is not P's"
        assert not got["load_failed"] and not got["recomputed"]
        P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=30)
        prep, drep = assert_no_leaks(P, pe), assert_no_leaks(D, de)
        assert prep["wire"]["posted"] == 1
        if conn == "kvlease":
            assert counter(drep, "permits0")["sent"] == 1
            assert counter(drep, "permits0")["written"] == 1
            assert counter(prep, "writes0")["written"] == 1
        teardown(P, pe)
        teardown(D, de)


def test_late_registration(nodes):
    """D's registration reaches P after P's lease lapsed (the router held
    the D leg): stock D waits for good with its blocks held; kvlease P
    answers at once (``PEND:R``), D's load fails and is recomputed, and its
    blocks come back."""
    P, D = nodes
    figures = {}
    for conn in CONNECTORS:
        pe, de = pair(P, D, f"late-{conn}", conn)
        key = next(_keys)
        pre = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
        freed = P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=LEASE + 20)
        assert not freed["timeout"], f"{conn}: P never let the request go"
        t0, got, drep = decode(D, de, key, pre)
        if conn == "stock":
            figures[conn] = stock_hung(got, drep)
            # Stock D never lets the request go; the engine goes with it.
            teardown(D, de)
            teardown(P, pe)
            continue
        assert not got["timeout"], "kvlease D hung"
        assert got["load_failed"] and got["recomputed"]
        assert got["seen"] == expected(pre["prompt"])
        took = got["loaded_at"] - t0
        permits = counter(drep, "permits0")
        assert permits["failed"] == {"refused": 1}, f"not P's refusal after {took:.1f} s: {permits}"
        # Answered at once (two handshakes first, D to P and P back to D):
        # well before the fence D would otherwise wait for.
        assert took < FENCE - 3, f"the refusal took {took:.1f} s"
        assert drep["leaks"] == {} and held(drep) == 0, drep["leaks"]
        prep = assert_no_leaks(P, pe)
        assert counter(prep, "writes0")["refused_gone"] == 1
        assert prep["wire"]["posted"] == 0
        figures[conn] = f"load failed {took:.2f} s after the registration, recomputed, 0 blocks held"
        teardown(P, pe)
        teardown(D, de)
    figure(f"[push] late registration: stock {figures['stock']}; kvlease {figures['kvlease']}")


def test_abort_while_write_is_delayed(nodes):
    """D aborts its request after P posted the WRITE, while the WRITE is
    still on the wire (held 3 s): D's blocks come back only after the WRITE
    landed, and the request that takes them next (B, all of D's blocks)
    keeps its own bytes."""
    P, D = nodes
    delay = 3.0
    figures = {}
    for conn in CONNECTORS:
        # 8 usable blocks on D: B (8 blocks) takes every block A had.
        pe, de = pair(P, D, f"abort-{conn}", conn, d_kw=dict(num_blocks=9))
        all_free = D.call("wait_free_blocks", engine=de, count=0, timeout=1)["free"]
        P.call("push_wire", engine=pe, write_delay=delay)
        key = next(_keys)
        pre = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
        rid = D.call("add_decode", engine=de, key=key, tokens=PROMPT, params=pre["params"])
        posted = P.call("wait_posted", engine=pe, count=1, timeout=20)
        assert not posted["timeout"], f"{conn}: P never posted the WRITE"
        D.call("abort", engine=de, request_id=rid)
        aborted = time.time()
        back = D.call("wait_free_blocks", engine=de, count=all_free, timeout=FENCE + 10)
        assert not back["timeout"], f"{conn}: D's blocks never came back"
        wire = P.call("push_wire", engine=pe)
        assert wire["landed"] == 1, wire
        landed = wire["landed_at"][0]
        assert aborted < landed, "the abort came after the WRITE: the case did not run"
        assert landed <= back["at"], (
            f"{conn}: D freed {landed - back['at']:.3f} s before P's WRITE landed"
        )
        # B prefills in one step, then D holds still for 2 s with B live:
        # a WRITE landing late would show in B's blocks.
        b = D.call("local_paused", engine=de, key=next(_keys), tokens=8 * 32 - 16,
                   max_tokens=12, pause_s=2.0)
        time.sleep(1.5)
        seen = D.call("blocks_of", engine=de, request_id=b)
        assert seen["values"] == expected(seen["prompt"]), f"{conn}: B's blocks changed"
        P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=FENCE + 10)
        assert_no_leaks(P, pe)
        drep = assert_no_leaks(D, de)
        if conn == "kvlease":
            assert counter(drep, "permits0")["sent"] == 1
        figures[conn] = (
            f"blocks back {back['at'] - aborted:.2f} s after the abort, "
            f"{back['at'] - landed:.3f} s after the WRITE landed"
        )
        teardown(P, pe)
        teardown(D, de)
    figure(f"[push] D abort under a WRITE held {delay:.0f} s: stock {figures['stock']}; "
           f"kvlease {figures['kvlease']}; B's bytes unchanged in both")


def test_p_killed_with_registrations_outstanding(nodes, tmp_path):
    """P dies with two registrations outstanding (their WRITEs posted but
    held on the wire, so nothing lands): stock D waits for good; kvlease D
    frees at its fence, no later than duration + write bound after P's last
    heartbeat, and recomputes."""
    _, D = nodes
    env, _ = TRANSPORTS[TRANSPORT]
    figures = {}
    for conn in CONNECTORS:
        Pk = NodeProcess(f"Pkill-{conn}", env, tmp_path)
        try:
            pe, de = pair(Pk, D, f"kill-{conn}", conn)
            Pk.call("push_wire", engine=pe, write_delay=float("inf"))
            keys = [next(_keys), next(_keys)]
            pres = [Pk.call("prefill", engine=pe, key=k, tokens=PROMPT, timeout=30) for k in keys]
            rids = [D.call("add_decode", engine=de, key=k, tokens=PROMPT, params=p["params"])
                    for k, p in zip(keys, pres)]
            posted = Pk.call("wait_posted", engine=pe, count=2, timeout=20)
            assert not posted["timeout"], f"{conn}: P never posted: {posted}"
            Pk.kill()
            killed = time.time()
        finally:
            Pk.close()
        gots = [D.call("result", engine=de, request_id=r, timeout=HANG_S) for r in rids]
        drep = report(D, de)
        if conn == "stock":
            assert all(g["timeout"] for g in gots), "stock D ended a push from a dead P"
            figures[conn] = "2 of 2 " + stock_hung(gots[0], drep, blocks=6)
            teardown(D, de)
            continue
        for g, p in zip(gots, pres):
            assert not g["timeout"], "kvlease D hung on a dead P"
            assert g["load_failed"] and g["recomputed"]
            assert g["seen"] == expected(p["prompt"])
        since = max(g["loaded_at"] for g in gots) - killed
        assert since <= FENCE + 3, f"D reclaimed {since:.1f} s after P died"
        assert drep["leaks"] == {} and held(drep) == 0, drep["leaks"]
        assert counter(drep, "permits0")["failed"] == {"lapsed": 2}, counter(drep, "permits0")
        figures[conn] = f"2 of 2 reclaimed and recomputed, the last {since:.2f} s after the kill"
        teardown(D, de)
    figure(f"[push] P killed with 2 registrations outstanding (fence {FENCE} s): "
           f"stock {figures['stock']}; kvlease {figures['kvlease']}")


@pytest.mark.parametrize("lost", ["registration", "answers"])
def test_lost_notifications(nodes, lost):
    """``registration``: D's ``PUSH_REG`` never reaches P. ``answers``: a
    late registration whose refusal (and every other word of P's) is lost.
    Either way kvlease D cannot learn that no WRITE comes, so it waits for
    its fence, never less, and then recomputes; stock D waits for good."""
    P, D = nodes
    figures = {}
    for conn in CONNECTORS:
        pe, de = pair(P, D, f"lost-{lost}-{conn}", conn)
        key = next(_keys)
        pre = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
        if lost == "registration":
            D.call("push_wire", engine=de, drop=[b"PUSH_REG:"])
        else:
            P.call("push_wire", engine=pe, drop=[b"PEND:", b"PHB:"])
            P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=LEASE + 20)
        t0, got, drep = decode(D, de, key, pre)
        side = D if lost == "registration" else P
        dropped = side.call("push_wire", engine=de if lost == "registration" else pe)["dropped"]
        if conn == "stock":
            figures[conn] = f"{stock_hung(got, drep)} ({dropped} dropped)"
            teardown(D, de)
            teardown(P, pe)
            continue
        assert dropped >= 1, "nothing was dropped: the case did not run"
        assert not got["timeout"] and got["load_failed"] and got["recomputed"]
        assert got["seen"] == expected(pre["prompt"])
        took = got["loaded_at"] - t0
        assert FENCE - 0.5 <= took <= FENCE + 4, f"D freed {took:.2f} s after registering"
        assert drep["leaks"] == {} and held(drep) == 0, drep["leaks"]
        P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=LEASE + 20)
        assert_no_leaks(P, pe)
        figures[conn] = f"load failed at the fence, {took:.2f} s after registering ({dropped} dropped)"
        teardown(P, pe)
        teardown(D, de)
    figure(f"[push] lost {lost}: stock {figures['stock']}; kvlease {figures['kvlease']}")


def test_duplicated_notifications(nodes):
    """Every notification either side drains arrives twice: the push that
    can come completes once with P's KV, and the one that cannot (a late
    registration) ends on kvlease D as a refused, recomputed load, its
    duplicate answer changing nothing; stock D hangs on it."""
    P, D = nodes
    figures = {}
    for conn in CONNECTORS:
        pe, de = pair(P, D, f"dup-{conn}", conn)
        P.call("push_wire", engine=pe, duplicate=True)
        D.call("push_wire", engine=de, duplicate=True)
        k1, k2 = next(_keys), next(_keys)
        late = P.call("prefill", engine=pe, key=k2, tokens=PROMPT, timeout=30)
        P.call("wait_freed", engine=pe, request_id=late["request_id"], timeout=LEASE + 20)
        pre = P.call("prefill", engine=pe, key=k1, tokens=PROMPT, timeout=30)
        ok = D.call("add_decode", engine=de, key=k1, tokens=PROMPT, params=pre["params"])
        bad = D.call("add_decode", engine=de, key=k2, tokens=PROMPT, params=late["params"])
        got = D.call("result", engine=de, request_id=ok, timeout=30)
        assert not got["timeout"], f"{conn}: the push that could come did not"
        assert got["seen"] == expected(pre["prompt"]), f"{conn}: D's KV is not P's"
        got_late = D.call("result", engine=de, request_id=bad, timeout=HANG_S)
        dup = D.call("push_wire", engine=de)["duplicated"] + P.call("push_wire", engine=pe)["duplicated"]
        assert dup >= 2, "nothing was duplicated: the case did not run"
        drep = report(D, de)
        if conn == "stock":
            p_held = list(report(P, pe)["leaks"])
            figures[conn] = (f"the late one {stock_hung(got_late, drep)}, P holds {p_held} "
                             f"({dup} notifications doubled)")
            teardown(D, de)
            teardown(P, pe)
            continue
        assert not got_late["timeout"] and got_late["load_failed"] and got_late["recomputed"]
        assert got_late["seen"] == expected(late["prompt"])
        assert not got["load_failed"]
        assert drep["leaks"] == {}, drep["leaks"]
        P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=30)
        prep = assert_no_leaks(P, pe)
        assert prep["wire"]["posted"] == 1, "a duplicated registration was written twice"
        assert counter(prep, "writes0")["duplicates"] >= 1
        permits = counter(drep, "permits0")
        assert permits["written"] == 1 and permits["failed"] == {"refused": 1}, permits
        figures[conn] = f"1 written, 1 refused and recomputed, 0 held ({dup} notifications doubled)"
        teardown(P, pe)
        teardown(D, de)
    figure(f"[push] duplicated notifications: stock {figures['stock']}; kvlease {figures['kvlease']}")


@pytest.mark.parametrize("p_conn,d_conn", [("kvlease", "stock"), ("stock", "kvlease")])
def test_mixed_fleet(nodes, p_conn, d_conn):
    """A stock peer gets stock behaviour and stock wire messages: no permit
    in its registrations, none of kvlease's push messages; the push
    completes with P's KV."""
    P, D = nodes
    pe, de = pair(P, D, f"mixed-{p_conn}-{d_conn}", p_conn, d_conn)
    key = next(_keys)
    pre = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
    rid = D.call("add_decode", engine=de, key=key, tokens=PROMPT, params=pre["params"])
    got = D.call("result", engine=de, request_id=rid, timeout=30)
    assert not got["timeout"] and got["seen"] == expected(pre["prompt"])
    assert not got["load_failed"]
    P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=30)
    prep, drep = assert_no_leaks(P, pe), assert_no_leaks(D, de)
    p_log, d_log = P.call("wire_log", engine=pe), D.call("wire_log", engine=de)
    ours = (b"PEND:", b"PHB:", b"PRN:", b"PRV:")
    to_p = [m for m in p_log["received"] if m.startswith(b"PUSH_REG:")]
    assert len(to_p) == 1, p_log["received"]
    assert not any(m.startswith(ours) for m in p_log["received"] + d_log["received"])
    assert not any(m.startswith(ours) for m in p_log["sent"] + d_log["sent"])
    assert b"kvlease_permit" not in to_p[0]
    if d_conn == "kvlease":
        assert counter(drep, "permits0")["unguarded"] == 1
    teardown(P, pe)
    teardown(D, de)


def test_require_verification_refuses_a_stock_p(nodes):
    """kvlease D with ``kv_lease_require_verification``: a P without the
    guard gets no registration at all, and the load fails at once (fail
    closed) and is recomputed."""
    P, D = nodes
    pe, de = pair(P, D, "require", "stock", "kvlease",
                  d_kw=dict(extra={"kv_lease_require_verification": True}))
    key = next(_keys)
    pre = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
    t0 = time.time()
    rid = D.call("add_decode", engine=de, key=key, tokens=PROMPT, params=pre["params"])
    got = D.call("result", engine=de, request_id=rid, timeout=30)
    assert not got["timeout"] and got["load_failed"] and got["recomputed"]
    assert got["seen"] == expected(pre["prompt"])
    assert got["loaded_at"] - t0 < LEASE
    assert not [m for m in P.call("wire_log", engine=pe)["received"] if m.startswith(b"PUSH_REG:")]
    drep = assert_no_leaks(D, de)
    assert counter(drep, "permits0")["unguardable"] == 1
    P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=LEASE + 20)
    # Stock P let the request go at its lease's end; nothing else to check there.
    teardown(P, pe)
    teardown(D, de)
