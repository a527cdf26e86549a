"""End to end: vLLM engines with KvLeaseNixlConnector (and stock vLLM's
NixlConnector, for the mixed fleets), P and D in two processes, real NIXL
agents (nixl_cu12) over UCX shared memory and over TCP, driven the way
vLLM's scheduler and workers call the connector (``harness/engine.py``).

Every case ends with the leak check: no request, block, lease, slot word,
held check or READ left on either side.

Real time with short leases (``kv_lease_duration`` 6 s: heartbeat interval
1 s, extension 4 s); bounds are generous where a bound is asserted.
"""

from __future__ import annotations

import itertools
import time

import pytest
from harness.cluster import NodeProcess
from harness.ports import free_port

import kvlease
from harness.figures import figure
from harness.kv_pattern import block_value
from harness.transports import TRANSPORTS

LEASE = 6
INTERVAL = LEASE // 6
EXTENSION = LEASE * 2 // 3
PROMPT = 80  # 3 blocks of 32; the last token does not start a block
_keys = itertools.count(100)



@pytest.fixture(scope="module", params=sorted(TRANSPORTS))
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def nodes(transport, tmp_path_factory):
    env, _ = TRANSPORTS[transport]
    logs = tmp_path_factory.mktemp(f"nodes-{transport}")
    p = NodeProcess(f"P-{transport}", env, logs)
    d = NodeProcess(f"D-{transport}", env, logs)
    yield p, d
    p.close()
    d.close()


def spec(transport: str, name: str, role: str, **kw) -> dict:
    _, ucx = TRANSPORTS[transport]
    s = dict(name=name, role=role, side_channel_port=free_port(), lease_duration=LEASE,
             ucx_backend_params=ucx)
    s.update(kw)
    return s


def expected(prompt: list[int]) -> list[set[int]]:
    return [{block_value(prompt, i)} for i in range(-(-len(prompt) // 32))]


def assert_no_leaks(node: NodeProcess, engine: str) -> dict:
    rep = node.call("report", engine=engine)
    assert rep["crashed"] is None, f"{engine}'s engine step raised:\n{rep['crashed']}"
    assert rep["leaks"] == {}, f"{engine} leaks: {rep['leaks']}"
    return rep


def teardown(node: NodeProcess, *engines: str) -> None:
    for e in engines:
        node.call("teardown", engine=e)


def test_happy_path_verified_after_waiting(nodes, transport):
    """D keeps the request waiting (its batch is full) for longer than the
    initial lease; heartbeats keep P's blocks; then the READ, the slot check
    (verified), the nonce read-done, and P frees at once."""
    P, D = nodes
    pe, de = f"p-happy-{transport}", f"d-happy-{transport}"
    P.call("setup", spec=spec(transport, pe, "P"))
    D.call("setup", spec=spec(transport, de, "D", max_num_seqs=1))
    blocker = D.call("local", engine=de, key=next(_keys), tokens=32, max_tokens=100000)
    key = next(_keys)
    pre = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
    params = pre["params"]
    assert isinstance(params["remote_lease_slot"], int)
    assert isinstance(params["remote_lease_nonce"], int) and params["remote_lease_nonce"] != 0
    rid = D.call("add_decode", engine=de, key=key, tokens=PROMPT, params=params)
    D.call("sleep", seconds=LEASE + 2.0)  # past the initial lease: only heartbeats hold it
    D.call("abort", engine=de, request_id=blocker)
    got = D.call("result", engine=de, request_id=rid, timeout=30)
    freed = P.call("wait_freed", engine=pe, request_id=pre["request_id"], timeout=30)
    assert not got["timeout"] and not freed["timeout"]
    assert got["seen"] == expected(pre["prompt"]), "D's KV is not P's"
    assert not got["load_failed"] and not got["recomputed"]
    prep, drep = assert_no_leaks(P, pe), assert_no_leaks(D, de)
    held = freed["freed_at"] - pre["finished_at"]
    assert held > LEASE, "P freed before D read: the heartbeats did not hold the lease"
    sched, rank, check = prep["counters"]["scheduler"], prep["counters"]["rank0"], drep["counters"]["check0"]
    assert sched["released_read"] == 1 and sched["expired"] == 0
    assert rank["renewed"] >= LEASE // INTERVAL - 2, rank
    assert rank["read_done"] == 1 and rank["read_done_without_nonce"] == 0
    assert check["verified"] == 1 and check["lapsed"] == 0
    assert drep["stats_reduced"]["KV loads verified"] == 1
    assert prep["stats_reduced"]["KV leases granted"] == 1
    assert prep["stats_reduced"]["KV leases read"] == 1
    # Between two kvlease peers the heartbeats are packed records: every one
    # names this lease's (slot, nonce), none is text, so the renewals that
    # held the lease past its first term came from HBP: over this transport
    # (issue 30, item 3).
    notifs = P.call("notifs", engine=pe)
    packed = [m for m in notifs if m.startswith(b"HBP:")]
    assert packed and not any(m.startswith((b"HB:", b"HBC:")) for m in notifs), notifs
    lease = (params["remote_lease_slot"], params["remote_lease_nonce"])
    assert all(kvlease.decode_notification(m) == ("packed", [lease]) for m in packed)
    assert rank["renew_nonce_mismatch"] == 0 and rank["malformed_notifications"] == 0
    figure(
        f"[{transport}] happy path: held {held:.1f} s by {rank['renewed']} renewals "
        f"({freed['heartbeats']} heartbeats drained, all HBP:), verified; P freed "
        f"{(freed['freed_at'] - got['loaded_at']) * 1e3:.0f} ms after D reported the load"
    )
    teardown(P, pe)
    teardown(D, de)


def _lapse_scenario(P, D, transport, tag, **engine_kw):
    """A's lease lapses while D waits with its heartbeats lost; B is then
    prefilled into A's freed blocks; D finally reads A's block ids. Returns
    (A prefill, B prefill, D's result for A, P's free of A)."""
    pe, de = f"p-{tag}-{transport}", f"d-{tag}-{transport}"
    # 8 usable blocks: B (8 blocks) must take every block A held (3).
    P.call("setup", spec=spec(transport, pe, "P", num_blocks=9, **engine_kw))
    D.call("setup", spec=spec(transport, de, "D", max_num_seqs=1, **engine_kw))
    blocker = D.call("local", engine=de, key=next(_keys), tokens=32, max_tokens=100000)
    D.call("drop_heartbeats", engine=de, on=True)
    ka, kb = next(_keys), next(_keys)
    a = P.call("prefill", engine=pe, key=ka, tokens=PROMPT, timeout=30)
    rid = D.call("add_decode", engine=de, key=ka, tokens=PROMPT, params=a["params"])
    freed_a = P.call("wait_freed", engine=pe, request_id=a["request_id"], timeout=LEASE + 20)
    assert not freed_a["timeout"], "A's lease never lapsed"
    b = P.call("prefill", engine=pe, key=kb, tokens=8 * 32, timeout=30)
    dropped = D.call("drop_heartbeats", engine=de, on=False)
    assert dropped >= 1, "no heartbeat was dropped: the case did not run as intended"
    D.call("abort", engine=de, request_id=blocker)
    got = D.call("result", engine=de, request_id=rid, timeout=30)
    assert not got["timeout"]
    b["key"] = kb
    return pe, de, a, b, got, freed_a


def _reused_values(a_params, b) -> list[set[int]]:
    """What A's block ids hold on P once B overwrote them."""
    a_blocks = list(a_params["remote_block_ids"][0])
    b_blocks = list(b["params"]["remote_block_ids"][0])
    assert set(a_blocks) <= set(b_blocks), (a_blocks, b_blocks)
    return [{block_value(b["prompt"], b_blocks.index(x))} for x in a_blocks]


def test_lapsed_lease_fails_the_check_and_d_recomputes(nodes, transport):
    """The lease lapses while D waits (heartbeats lost); P frees A's blocks
    and B overwrites them; D's READ of A gets B's bytes, its slot check fails,
    vLLM's scheduler recomputes A (kv_load_failure_policy: recompute), and A
    ends with its own KV."""
    P, D = nodes
    pe, de, a, b, got, freed_a = _lapse_scenario(P, D, transport, "lapse")
    held = freed_a["freed_at"] - a["finished_at"]
    assert LEASE - 0.05 <= held <= LEASE + 2.0, f"A held {held:.2f} s, lease {LEASE} s"
    wrong = _reused_values(a["params"], b)
    right = expected(a["prompt"])
    assert wrong != right
    assert got["load_failed"], "the lapsed load was not reported failed"
    assert got["read_bytes"] == wrong, "the READ did not land B's KV: the case proves nothing"
    assert got["recomputed"], "vLLM's scheduler did not recompute A"
    assert got["seen"] == right, "A does not end with its own KV"
    # D reads B as usual afterwards: verified, and P frees B on the read-done.
    got_b = D.call("decode", engine=de, key=b["key"], tokens=8 * 32, params=b["params"],
                   timeout=30)
    assert got_b["seen"] == expected(b["prompt"]) and not got_b["load_failed"]
    P.call("wait_freed", engine=pe, request_id=b["request_id"], timeout=30)
    prep, drep = assert_no_leaks(P, pe), assert_no_leaks(D, de)
    sched, check = prep["counters"]["scheduler"], drep["counters"]["check0"]
    assert sched["expired"] == 1 and sched["released_read"] == 1, sched
    assert check["lapsed"] == 1 and check["verified"] == 1, check
    assert drep["stats_reduced"]["KV lease checks failed"] == 1
    assert prep["stats_reduced"]["KV leases expired"] == 1
    figure(
        f"[{transport}] lapse: A expired after {held:.2f} s (lease {LEASE} s); D's READ landed "
        f"B's bytes {sorted(v for s in got['read_bytes'] for v in s)} where A's are "
        f"{sorted(v for s in right for v in s)}; check: lapsed, load failed, recomputed, "
        f"A ends with its own KV"
    )
    teardown(P, pe)
    teardown(D, de)


@pytest.mark.parametrize("connector", ["stock", "kvlease-off"])
def test_lapse_without_verification_serves_wrong_kv(nodes, transport, connector):
    """The control: the same lapse with stock vLLM (NixlConnector), and with
    KvLeaseNixlConnector at kv_lease_verification: false (which must behave
    exactly as stock). D takes B's bytes as A's KV and reports the load done."""
    if transport != "shm":
        pytest.skip("the control runs over shared memory only (it tests no transport)")
    P, D = nodes
    kw = {"connector": "stock"} if connector == "stock" else {"verification": False}
    pe, de, a, b, got, _ = _lapse_scenario(P, D, transport, f"control-{connector}", **kw)
    wrong = _reused_values(a["params"], b)
    assert "remote_lease_slot" not in a["params"]
    assert not got["load_failed"] and not got["recomputed"]
    assert got["seen"] == wrong, "D did not end with B's KV: the control proves nothing"
    assert got["seen"] != expected(a["prompt"])
    got_b = D.call("decode", engine=de, key=b["key"], tokens=8 * 32, params=b["params"],
                   timeout=30)
    assert got_b["seen"] == expected(b["prompt"])
    P.call("wait_freed", engine=pe, request_id=b["request_id"], timeout=30)
    assert_no_leaks(P, pe)
    assert_no_leaks(D, de)
    figure(f"[{transport}] control ({connector}): D served B's KV as A's, load reported done")
    teardown(P, pe)
    teardown(D, de)


def test_d_killed_p_reclaims(nodes, transport, tmp_path):
    """D heartbeats while its request waits, then its process is killed
    (SIGKILL): P reclaims the blocks within extension + interval."""
    P, _ = nodes
    env, _ = TRANSPORTS[transport]
    Dk = NodeProcess(f"Dkill-{transport}", env, tmp_path)
    try:
        pe, de = f"p-kill-{transport}", f"d-kill-{transport}"
        P.call("setup", spec=spec(transport, pe, "P"))
        Dk.call("setup", spec=spec(transport, de, "D", max_num_seqs=1))
        Dk.call("local", engine=de, key=next(_keys), tokens=32, max_tokens=100000)
        key = next(_keys)
        a = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
        Dk.call("add_decode", engine=de, key=key, tokens=PROMPT, params=a["params"])
        Dk.call("sleep", seconds=LEASE + 2.0)  # heartbeats carry it past the initial lease
        Dk.kill()
        killed = time.time()
        freed = P.call("wait_freed", engine=pe, request_id=a["request_id"], timeout=30)
    finally:
        Dk.close()
    assert not freed["timeout"]
    since_hb = freed["freed_at"] - freed["last_heartbeat"]
    since_kill = freed["freed_at"] - killed
    assert freed["last_heartbeat"] > a["finished_at"] + LEASE - INTERVAL - 1.0
    assert EXTENSION - 0.1 <= since_hb <= EXTENSION + 1.5, f"{since_hb:.2f} s after the last heartbeat"
    assert since_kill <= EXTENSION + INTERVAL + 1.5, f"{since_kill:.2f} s after the kill"
    prep = assert_no_leaks(P, pe)
    assert prep["counters"]["scheduler"]["expired"] == 1
    figure(
        f"[{transport}] D killed: P reclaimed {since_kill:.2f} s after the kill, "
        f"{since_hb:.2f} s after the last heartbeat (extension {EXTENSION} s, interval {INTERVAL} s)"
    )
    teardown(P, pe)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_heterogeneous_tp(nodes, transport, p_tp, d_tp):
    """P TP 2 with D TP 1 (one D rank reads and checks two P ranks), and P
    TP 1 with D TP 2 (two D ranks read one P rank, which waits for both
    read-dones)."""
    P, D = nodes
    pe, de = f"p-tp{p_tp}{d_tp}-{transport}", f"d-tp{p_tp}{d_tp}-{transport}"
    P.call("setup", spec=spec(transport, pe, "P", tp=p_tp))
    D.call("setup", spec=spec(transport, de, "D", tp=d_tp))
    key = next(_keys)
    a = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
    got = D.call("decode", engine=de, key=key, tokens=PROMPT, params=a["params"], timeout=30)
    freed = P.call("wait_freed", engine=pe, request_id=a["request_id"], timeout=30)
    assert not got["timeout"] and not freed["timeout"]
    assert got["seen"] == expected(a["prompt"]) and not got["load_failed"]
    prep, drep = assert_no_leaks(P, pe), assert_no_leaks(D, de)
    c = prep["counters"]
    assert c["scheduler"]["released_read"] == 1 and c["scheduler"]["expired"] == 0
    for r in range(p_tp):
        assert c[f"rank{r}"]["released_read"] == 1
        # One read-done per D rank that read this P rank.
        assert c[f"rank{r}"]["read_done"] == max(1, d_tp // p_tp), c[f"rank{r}"]
    checks = [drep["counters"][f"check{r}"] for r in range(d_tp)]
    assert all(ch["verified"] == 1 for ch in checks), checks
    reads = sum(ch["slot_reads"] for ch in checks)
    assert reads == max(p_tp, d_tp), checks
    figure(
        f"[{transport}] P TP {p_tp} / D TP {d_tp}: verified on {d_tp} D rank(s) with "
        f"{reads} slot READ(s); every P rank released on its read-dones; "
        f"P freed {(freed['freed_at'] - got['loaded_at']) * 1e3:.0f} ms after the load"
    )
    teardown(P, pe)
    teardown(D, de)


@pytest.mark.parametrize(
    "p_conn,d_conn,require",
    [("kvlease", "stock", False), ("stock", "kvlease", False), ("stock", "kvlease", True)],
)
def test_mixed_fleet(nodes, transport, p_conn, d_conn, require):
    """A kvlease P with a stock vLLM D, and a stock P with a kvlease D, behave
    as stock vLLM does; a stock P receives only vLLM's own notification forms.
    A kvlease D with ``kv_lease_require_verification`` fails the load from a
    stock P instead (it cannot be verified): counted as a failed check, and
    vLLM recomputes (issue 28, 3.4)."""
    P, D = nodes
    tag = "-require" if require else ""
    pe, de = f"p-mix-{p_conn}{tag}-{transport}", f"d-mix-{d_conn}{tag}-{transport}"
    d_extra = {"kv_lease_require_verification": True} if require else {}
    P.call("setup", spec=spec(transport, pe, "P", connector=p_conn))
    D.call("setup", spec=spec(transport, de, "D", connector=d_conn, max_num_seqs=1,
                              extra=d_extra))
    blocker = D.call("local", engine=de, key=next(_keys), tokens=32, max_tokens=100000)
    key = next(_keys)
    a = P.call("prefill", engine=pe, key=key, tokens=PROMPT, timeout=30)
    assert ("remote_lease_nonce" in a["params"]) == (p_conn == "kvlease")
    rid = D.call("add_decode", engine=de, key=key, tokens=PROMPT, params=a["params"])
    D.call("sleep", seconds=2.5 * INTERVAL)  # a few heartbeats while it waits
    D.call("abort", engine=de, request_id=blocker)
    got = D.call("result", engine=de, request_id=rid, timeout=30)
    freed = P.call("wait_freed", engine=pe, request_id=a["request_id"], timeout=30)
    assert not got["timeout"] and not freed["timeout"]
    assert got["seen"] == expected(a["prompt"])
    assert got["load_failed"] == require and got["recomputed"] == require
    assert freed["heartbeats"] >= 1
    notifs = P.call("notifs", engine=pe)
    read_dones = [m for m in notifs if not m.startswith(b"HB")]
    assert read_dones == [f"{a['request_id']}:1".encode()], notifs
    assert not any(m.startswith((b"HBC:", b"HBP:")) or b":nonce=" in m for m in notifs)
    prep, drep = assert_no_leaks(P, pe), assert_no_leaks(D, de)
    if p_conn == "kvlease":
        r = prep["counters"]["rank0"]
        assert r["read_done_without_nonce"] == 1 and r["released_read"] == 1 and r["renewed"] >= 1
    else:
        # Exactly one load, counted once: unverified, or failed when required.
        stats = drep["stats_reduced"]
        assert stats["KV loads unverified"] == (0 if require else 1), stats
        assert stats["KV lease checks failed"] == (1 if require else 0), stats
        assert stats["KV loads verified"] == 0, stats
        assert drep["counters"]["check0"]["submitted"] == 0
    figure(
        f"[{transport}] mixed {p_conn} P / {d_conn} D"
        + (" (kv_lease_require_verification)" if require else "")
        + f": {freed['heartbeats']} heartbeats, read-done {read_dones[0].decode()!r}, KV correct"
        + (
            ("; D failed the load (unverifiable) and recomputed" if require
             else "; stock behaviour, D counted the load unverified")
            if d_conn == "kvlease" else "; stock behaviour"
        )
    )
    teardown(P, pe)
    teardown(D, de)



def test_p_abort_cancels_the_lease(nodes, transport):
    """A do_remote_decode request aborted on P mid-prefill (2000 tokens in
    chunks of 1024; opt-125m's context is 2048): its assigned
    lease is cancelled, every rank zeroes its slot, the slot returns, vLLM
    frees the blocks itself (no finished_sending for it)."""
    if transport != "shm":
        pytest.skip("P-local bookkeeping: one transport suffices")
    P, _ = nodes
    pe = f"p-abort-{transport}"
    P.call("setup", spec=spec(transport, pe, "P", tp=2, num_blocks=80))
    got = P.call("abort_prefill", engine=pe, key=next(_keys), tokens=2000, steps=1)
    assert got["status_before_abort"] == "assigned" and 0 < got["computed"] < 2000
    rep = assert_no_leaks(P, pe)
    c = rep["counters"]
    assert c["scheduler"]["cancelled"] == 1 and c["scheduler"]["slots_returned"] == 1
    assert c["rank0"]["cancelled"] == 1 and c["rank1"]["cancelled"] == 1
    assert rep["stats_reduced"]["KV leases cancelled"] == 1
    teardown(P, pe)


def test_prefill_longer_than_max_pin_falls_back_to_vllms_lease(nodes, transport):
    """A lease assigned at first scheduling lapses before the prefill ends
    (``kv_lease_max_pin``): P serves the request with vLLM's own lease and no
    lease fields, a verifying D fails the load as unverifiable and
    recomputes, and vLLM's lease on P is released by D's read-done."""
    if transport != "shm":
        pytest.skip("P-local bookkeeping: one transport suffices")
    P, D = nodes
    pe, de = f"p-pin-{transport}", f"d-pin-{transport}"
    # Chunks of 512: the expiry is reported (step 2) before the prefill ends.
    P.call("setup", spec=spec(transport, pe, "P", num_blocks=80, max_num_batched_tokens=512,
                              extra={"kv_lease_max_pin": 1}))
    D.call("setup", spec=spec(transport, de, "D", num_blocks=80))
    key = next(_keys)
    a = P.call("prefill_paused", engine=pe, key=key, tokens=2000, pause_s=2.0, timeout=30)
    assert "remote_lease_nonce" not in a["params"]
    got = D.call("decode", engine=de, key=key, tokens=2000, params=a["params"], timeout=60)
    freed = P.call("wait_freed", engine=pe, request_id=a["request_id"], timeout=30)
    assert not got["timeout"] and not freed["timeout"]
    assert got["load_failed"] and got["recomputed"] and got["seen"] == expected(a["prompt"])
    prep, drep = assert_no_leaks(P, pe), assert_no_leaks(D, de)
    assert prep["counters"]["rank0"]["pinned_expired"] == 1
    assert prep["stats_reduced"]["KV leases without slot"] == 1
    assert drep["counters"]["check0"]["unverifiable"] == 1
    figure(
        f"[{transport}] prefill past kv_lease_max_pin: vLLM's lease took over, no lease fields, "
        f"D failed the load as unverifiable and recomputed; P freed on D's read-done"
    )
    teardown(P, pe)
    teardown(D, de)


def _rescheduled_on_p(P, D, transport, pe, de, how):
    """Gets a do_remote_decode request B scheduled a second time on P after
    its lease was assigned, the way ``how`` says; returns B's prefill."""
    if how == "preempt":
        # 8 usable blocks, chunks of 64 tokens, two prefills of 160 tokens (5
        # blocks each; each fits alone, so vLLM admits both). Steps 1 and 2:
        # A and B take 64 tokens each (4 blocks each: the cache is full).
        # Step 3: A needs a fifth block, so vLLM preempts B; A finishes, and
        # its lease keeps its blocks. D reads A, P frees A's blocks, and B is
        # scheduled again.
        ka, kb = next(_keys), next(_keys)
        a_rid, b_rid = P.call("add_prefills", engine=pe, items=[(ka, 160), (kb, 160)])
        a = P.call("wait_prefill", engine=pe, request_id=a_rid, timeout=30)
        got_a = D.call("decode", engine=de, key=ka, tokens=160, params=a["params"], timeout=30)
        assert got_a["seen"] == expected(a["prompt"]) and not got_a["load_failed"]
        b = P.call("wait_prefill", engine=pe, request_id=b_rid, timeout=30)
    else:
        # vLLM's RL weight-update path: every running request is preempted.
        kb = next(_keys)
        r = P.call("prefill_reset", engine=pe, key=kb, tokens=400, steps=1)
        assert r["reset"] and 0 < r["computed_before_reset"] < 400, r
        b = P.call("wait_prefill", engine=pe, request_id=r["request_id"], timeout=30)
    assert not b["timeout"]
    assert b["preemptions"] >= 1, "B was not preempted: the case proves nothing"
    b["key"] = kb
    return b


@pytest.mark.parametrize("how", ["preempt", "reset"])
def test_rescheduled_request_lapses_and_a_late_read_done_leaves_p_running(nodes, transport, how):
    """Issue 28, 3.1. A do_remote_decode request B is preempted on P after its
    lease was assigned (by cache pressure, or by vLLM's
    ``reset_prefix_cache(reset_running_requests=True)``) and scheduled again;
    vLLM's scheduler connector then puts it in ``reqs_in_batch`` a second
    time. kvlease must keep it out of vLLM's worker tracking: otherwise the
    worker keeps B in ``_reqs_to_process`` for ever, and once B's lease lapsed
    D's late read-done becomes a ``finished_sending`` for a request the
    scheduler no longer has (``assert req_id in self.requests``: P dies)."""
    if transport != "shm":
        pytest.skip("P-side bookkeeping: one transport suffices")
    P, D = nodes
    pe, de = f"p-resched-{how}-{transport}", f"d-resched-{how}-{transport}"
    P.call("setup", spec=spec(transport, pe, "P", num_blocks=9 if how == "preempt" else 64,
                              max_num_batched_tokens=128, long_prefill_token_threshold=64))
    D.call("setup", spec=spec(transport, de, "D", max_num_seqs=1))
    b = _rescheduled_on_p(P, D, transport, pe, de, how)
    rep = P.call("report", engine=pe)
    leaked = {k: v for k, v in rep["leaks"].items() if k.endswith("_stock_to_process")}
    # B's lease lapses while D waits with its heartbeats lost; then D reads.
    blocker = D.call("local", engine=de, key=next(_keys), tokens=32, max_tokens=100000)
    D.call("drop_heartbeats", engine=de, on=True)
    rid = D.call("add_decode", engine=de, key=b["key"], tokens=len(b["prompt"]), params=b["params"])
    freed = P.call("wait_freed", engine=pe, request_id=b["request_id"], timeout=LEASE + 20)
    assert not freed["timeout"], "B's lease never lapsed"
    D.call("drop_heartbeats", engine=de, on=False)
    D.call("abort", engine=de, request_id=blocker)
    got = D.call("result", engine=de, request_id=rid, timeout=30)
    assert not got["timeout"]
    assert got["load_failed"] and got["recomputed"], "D's late read of B was not failed"
    assert got["seen"] == expected(b["prompt"])
    rep = P.call("report", engine=pe)
    assert rep["crashed"] is None, f"P's engine died on D's late read-done:\n{rep['crashed']}"
    assert not leaked, f"B was left in vLLM's worker tracking after its reschedule: {leaked}"
    prep, _ = assert_no_leaks(P, pe), assert_no_leaks(D, de)
    # D's late read-done reached P and was taken as vLLM takes one for a
    # request it no longer has: logged and counted, nothing freed.
    assert prep["stats_data"]["num_notifications_after_expiry"] == 1, prep["stats_data"]
    assert prep["counters"]["scheduler"]["expired"] == 1
    figure(
        f"[{transport}] B preempted on P "
        f"({'cache pressure' if how == 'preempt' else 'reset_prefix_cache'}) and scheduled "
        f"again: kept out of vLLM's worker "
        f"tracking; its lease lapsed, D's late read-done was counted after expiry, "
        f"P kept running"
    )
    teardown(P, pe)
    teardown(D, de)
