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
from pathlib import Path

import pytest
from conftest import TRANSPORTS
from harness.cluster import NodeProcess, free_port
from harness.kv_pattern import block_value

LEASE = 6
INTERVAL = LEASE // 6
EXTENSION = LEASE * 2 // 3
PROMPT = 80  # 3 blocks of 32; the last token does not start a block
_keys = itertools.count(100)

# One figure per case, printed at the end of the run (run-vllm.sh keeps it).
FIGURES: list[str] = []


def figure(text: str) -> None:
    FIGURES.append(text)
    print(text)


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
    figure(
        f"[{transport}] happy path: held {held:.1f} s by {rank['renewed']} renewals "
        f"({freed['heartbeats']} heartbeats drained), verified; P freed "
        f"{(freed['freed_at'] - got['loaded_at']) * 1e3:.0f} ms after D reported the load"
    )
    teardown(P, pe)
    teardown(D, de)
