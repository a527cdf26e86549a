"""D's lease checker with many more P ranks than ``kv_lease_max_peers``
(issue 28, 3.5): idle peers go, so a churning fleet never fills the table;
a table full of busy peers fails the load (never unverified), counted.

The agent is a loopback: a slot READ copies from the fake P rank's slot array
(a ctypes array whose address is what the rank advertised) into the
checker's landing buffer, as NIXL would."""

from __future__ import annotations

import ctypes
import itertools

import pytest

import kvlease
from kvlease.errors import FabricError
from kvlease.vllm.load_checks import LeaseRead, LoadChecks

SLOTS = 16
CONFIG = kvlease.LeaseConfig.parse({"kv_lease_duration": 6, "kv_lease_max_peers": 4}, 64, 8)


class LoopbackAgent:
    """The agent calls of LoadChecks; READs complete at once unless ``hold``."""

    def __init__(self) -> None:
        self.hold = False
        self._handles: dict[int, list] = {}
        self._ids = itertools.count(1)

    def get_reg_descs(self, regions, mem_type):
        return regions

    def register_memory(self, descs, backends=None):
        return None

    def get_xfer_descs(self, descs, mem_type):
        return list(descs)

    def initialize_xfer(self, op, local, remote, name):
        h = next(self._ids)
        self._handles[h] = [local, remote, False]
        return h

    def transfer(self, h):
        return self.check_xfer_state(h)

    def check_xfer_state(self, h):
        local, remote, done = self._handles[h]
        if not done and not self.hold:
            for (la, n, _), (ra, rn, _) in zip(local, remote):
                assert n == rn
                ctypes.memmove(la, ra, n)
            self._handles[h][2] = True
        return "DONE" if self._handles[h][2] else "PROC"

    def release_xfer_handle(self, h):
        self._handles.pop(h, None)


class FakeP:
    """One P rank: its slot array, advertised as vLLM's handshake would."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.slots = (ctypes.c_int64 * SLOTS)()
        self.advert = (ctypes.addressof(self.slots), 8 * SLOTS, SLOTS)


def checker(max_peers: int = 4) -> tuple[LoadChecks, LoopbackAgent]:
    checks = LoadChecks(CONFIG, 64, max_peers, "d-test")
    agent = LoopbackAgent()
    checks.register_landing(agent, ["UCX"])
    return checks, agent


_rids = itertools.count()


def start_load(checks: LoadChecks, p: FakeP, now: float | None = None) -> LeaseRead:
    """What the worker does for one request read from ``p``: the lease in
    P's slot, the peer for the READ, the READ recorded (its read-done held)."""
    rid = f"r{next(_rids)}"
    slot, nonce = next(_rids) % SLOTS, 1000 + next(_rids)
    p.slots[slot] = nonce
    checks.record_adverts({(0, 0): p.name}, {(0, 0): p.advert})
    lease = LeaseRead(request_id=rid, remote_request_id=rid, fields=(slot, nonce), blocks=[1])
    peer = checks.peer_for(p.name) if now is None else checks.peer_for(p.name, now)
    assert peer is not None
    lease.reads.append((p.name, peer[0], 1))
    checks.recording[rid] = lease
    return lease


def finish_load(checks: LoadChecks, lease: LeaseRead) -> None:
    """Every block READ of ``lease`` completed: its check goes in."""
    checks.submit(checks.recording.pop(lease.request_id))


def test_a_churning_fleet_of_ten_times_the_capacity_never_fails_a_load():
    checks, agent = checker(max_peers=4)
    fleet = [FakeP(f"p-{i}") for i in range(40)]
    verdicts = []
    for round_ in range(3):
        for p in fleet:
            lease = start_load(checks, p)
            finish_load(checks, lease)
            verdicts += [v for _, v in checks.step(agent, float(round_))]
    assert verdicts == ["verified"] * 120, set(verdicts)
    assert checks.peers <= 4
    assert checks.evicted >= 116 and checks.table_full == 0
    assert checks.idle()


def test_a_peer_with_a_read_in_flight_is_never_the_one_let_go():
    checks, agent = checker(max_peers=4)
    fleet = [FakeP(f"p-{i}") for i in range(5)]
    # p-0 is the least recently used, but its block READs are in flight.
    # (Within one lease duration: no peer is idle long enough for the sweep.)
    busy = start_load(checks, fleet[0], now=1.0)
    for t, p in zip((1.1, 1.2, 1.3), fleet[1:4]):
        finish_load(checks, start_load(checks, p, now=t))
        assert [v for _, v in checks.step(agent, t)] == ["verified"]
    finish_load(checks, start_load(checks, fleet[4], now=1.5))
    assert [v for _, v in checks.step(agent, 1.5)] == ["verified"]
    assert checks.evicted == 1 and "p-1" not in checks._peers and "p-0" in checks._peers
    finish_load(checks, busy)
    assert [v for _, v in checks.step(agent, 1.6)] == ["verified"]


def test_a_table_full_of_busy_peers_fails_the_load_and_counts_it():
    checks, agent = checker(max_peers=4)
    agent.hold = True  # every slot READ stays in flight
    fleet = [FakeP(f"p-{i}") for i in range(5)]
    for p in fleet[:4]:
        finish_load(checks, start_load(checks, p, now=1.0))
    assert checks.step(agent, 1.0) == []  # all four checks wait on their READs
    checks.record_adverts({(0, 0): "p-4"}, {(0, 0): fleet[4].advert})
    with pytest.raises(FabricError) as e:
        checks.peer_for("p-4", 2.0)
    assert e.value.reason == "Full" and checks.table_full == 1
    # The worker then marks the load refused: it fails, never unverified.
    lease = LeaseRead(request_id="x", remote_request_id="x", fields=(1, 7), blocks=[1])
    lease.refused = "refused: peer table full (Full)"
    lease.reads.append(("p-4", -1, 1))
    checks.submit(lease)
    out = checks.step(agent, 2.0)
    assert [(le.request_id, v) for le, v in out] == [("x", "refused: peer table full (Full)")]
    agent.hold = False
    assert sorted(v for _, v in checks.step(agent, 3.0)) == ["verified"] * 4


def test_idle_peers_go_after_a_lease_duration_and_come_back_on_use():
    checks, agent = checker(max_peers=4)
    fleet = [FakeP(f"p-{i}") for i in range(3)]
    for p in fleet:
        finish_load(checks, start_load(checks, p, now=100.0))
    assert len(checks.step(agent, 100.0)) == 3 and checks.peers == 3
    checks.step(agent, 100.0 + CONFIG.lease_duration / 2)
    assert checks.peers == 3, "not idle for a lease duration yet"
    checks.step(agent, 100.0 + CONFIG.lease_duration + 1)
    assert checks.peers == 0 and checks.evicted == 3
    # The adverts stay: the next READ from p-1 adds it again.
    finish_load(checks, start_load(checks, fleet[1], now=200.0))
    assert [v for _, v in checks.step(agent, 200.0)] == ["verified"]
    assert checks.peers == 1


def test_a_p_rank_whose_advert_was_never_recorded_is_not_read_as_a_stock_p():
    """Issue 38, item 10: ``peer_for`` runs only for a request that carries
    lease fields. A P rank with no advert on record (a handshake whose
    replies kvlease did not see) used to read as a stock P (None), and the
    load was used unverified; now it cannot be checked, so it fails.
    A rank recorded as advertising nothing is still a stock P."""
    checks, _agent = checker()
    with pytest.raises(FabricError) as e:
        checks.peer_for("never-seen", 1.0)
    assert e.value.reason == "Unrecorded"
    # A request without lease fields reads it as stock vLLM reads, as before.
    assert checks.peer_for("never-seen", 1.0, leased=False) is None
    checks.record_adverts({(0, 0): "stock-p"}, {(0, 0): None})
    assert checks.peer_for("stock-p", 1.0) is None
