"""The D roles from Python: the tracker, outcome messages, and the slot
check over READs that Python performs (here: a memory copy, what NIXL does)."""

from __future__ import annotations

import ctypes

import pytest

import kvlease
from kvlease import HeartbeatTracker, IpcError, PrefillRank, PrefillScheduler, SlotChecker


def params(p_id, slot=None, nonce=None, tp=1):
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_request_id": p_id,
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "tp_size": tp,
        "remote_lease_slot": slot,
        "remote_lease_nonce": nonce,
    }


def test_a_request_is_received_only_when_every_worker_verified(config, clock):
    t = HeartbeatTracker(config, 2)
    assert t.on_new_request("d-1", params("p-1", 3, 99, tp=2), clock.now) == "started"
    assert t.on_new_request("d-2", {"do_remote_prefill": False}, clock.now) == "not_remote_prefill"
    assert t.on_new_request("d-3", {"do_remote_prefill": True}, clock.now) == "missing:remote_engine_id"
    assert t.apply_outcomes(kvlease.encode_outcomes(0, 0, [("d-1", "verified")])) == []
    assert t.apply_outcomes(kvlease.encode_outcomes(1, 0, [("d-1", "verified")])) == [
        ("d-1", "verified")
    ]
    assert t.tracked == 0
    assert t.counters()["loads_verified"] == 1


def test_an_outcome_from_a_worker_the_tracker_does_not_know_fails_loudly(config, clock):
    t = HeartbeatTracker(config, 1)
    t.on_new_request("d-1", params("p-1"), clock.now)
    with pytest.raises(IpcError) as e:
        t.apply_outcomes(kvlease.encode_outcomes(1, 0, [("d-1", "verified")]))
    assert e.value.reason == "UnknownWorker"
    assert t.tracked == 0, "its requests failed"
    assert t.counters()["loads_failed"] == 1


def test_a_negative_int64_nonce_from_a_foreign_p_is_accepted(config, clock):
    t = HeartbeatTracker(config, 1)
    assert t.on_new_request("d-1", params("p-1", 3, -5), clock.now) == "started"


def copy_read(checker, remote_ranks):
    """Python's side: perform every posted slot READ as a memory copy from
    the P rank's slot array, and report it."""
    for xfer, peer, descs in checker.take_reads():
        rank = remote_ranks[peer]
        for local, remote_offset, nbytes in descs:
            ctypes.memmove(local, rank.slots_address + remote_offset, nbytes)
        checker.complete(xfer, True)


def test_the_slot_check_over_python_reads(config, clock):
    sched = PrefillScheduler(config, 2, clock.now)
    ranks = [PrefillRank(config, r, clock.now) for r in range(2)]
    held = sched.grant("p-1", clock.now)
    lapsed = sched.grant("p-2", clock.now)
    msg = sched.encode_directives(clock.now)
    for r in ranks:
        r.apply_directives(msg, clock.now)
    # p-2's lease lapses on rank 1 only: its slot is zeroed there.
    ranks[1].on_notification("x", kvlease.encode_read_done("p-2", 1, lapsed[1], True), clock.now)
    checker = SlotChecker(config, 16, 4)
    peers = {checker.add_peer(f"p{r.rank}", r.slot_count): r for r in ranks}
    assert checker.landing_regions(), "buffers to register with nixl_agent"
    checker.submit(1, held[0], held[1], list(peers))
    checker.submit(2, lapsed[0], lapsed[1], list(peers))
    checker.submit(3, None, None, list(peers))
    first = checker.step(clock.now)
    assert first == [(3, "unverifiable")], "no lease fields: no READ needed"
    copy_read(checker, peers)
    assert sorted(checker.step(clock.now)) == [(1, "verified"), (2, "lapsed")]
    c = checker.counters()
    assert c["slot_reads"] == 2, "one READ per P rank for both checks"


def test_a_failed_read_fails_the_check(config, clock):
    checker = SlotChecker(config, 4, 2)
    peer = checker.add_peer("p0", 64)
    checker.submit(7, 1, 42, [peer])
    checker.step(clock.now)
    for xfer, _, _ in checker.take_reads():
        checker.complete(xfer, False, "NIXL_ERR_REMOTE_DISCONNECT")
    verdicts = checker.step(clock.now)
    assert verdicts and verdicts[0][0] == 7 and verdicts[0][1].startswith("read_failed")


def test_verification_off_accepts_unchecked(clock):
    off = kvlease.LeaseConfig.parse({"kv_lease_verification": False}, 64, 8)
    checker = SlotChecker(off, 4, 2)
    checker.submit(1, None, None, [])
    assert checker.step(clock.now) == [(1, "unchecked")]
    assert checker.take_reads() == []
