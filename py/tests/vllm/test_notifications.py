"""P worker's notification path (``KvLeaseWorker._get_new_notifs`` and the
heartbeat and expiry hooks): kvlease's leases and vLLM's own leases side by
side, and outside bytes that never raise (hypothesis)."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlease
import kvlease.vllm.worker as worker_mod
from kvlease.vllm.rank_leases import RankLeases
from kvlease.vllm.scheduler import read_fields
from kvlease.vllm.stats import KvLeaseConnectorStats
from kvlease.vllm.worker import KvLeaseWorker, _parse_read_done

CONFIG = kvlease.LeaseConfig.parse({"kv_lease_duration": 6}, 64, 8)


class FakeAgent:
    """The one agent call the notification path makes."""

    def __init__(self) -> None:
        self.pending: dict[str, list[bytes]] = {}

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out, self.pending = self.pending, {}
        return out


def p_worker() -> KvLeaseWorker:
    """A P worker's notification state, built as vLLM's tests build theirs
    (``object.__new__``), with kvlease's rank added."""
    w = object.__new__(KvLeaseWorker)
    w._kvl_rank = RankLeases(CONFIG, 0, time.monotonic())
    w._reqs_to_send = {}
    w._reqs_to_process = set()
    w.consumer_notification_counts_by_req = defaultdict(int)
    w.expected_consumer_notifications_by_req = {}
    w.xfer_stats = KvLeaseConnectorStats()
    w._lease_extension = 4
    w.nixl_wrapper = FakeAgent()
    return w


def lease(w: KvLeaseWorker, sched: kvlease.PrefillScheduler, rid: str) -> tuple[int, int]:
    now = time.monotonic()
    fields = sched.assign(rid, now)
    sched.start(rid, now)
    w._kvl_rank.apply_directives(sched.encode_directives(now), now)
    return fields


def drain(w: KvLeaseWorker, sender: str, *msgs: bytes) -> set[str]:
    w.nixl_wrapper.pending = {sender: list(msgs)}
    return w._get_new_notifs()


def later(monkeypatch, seconds: float) -> None:
    """The worker's clock, ``seconds`` ahead (past the initial lease's end
    minus the extension, so that a renewal shows)."""
    t = time.monotonic() + seconds
    monkeypatch.setattr(worker_mod, "_now", lambda: t)


def test_heartbeat_renews_both_kinds_of_lease(monkeypatch):
    w = p_worker()
    sched = kvlease.PrefillScheduler(CONFIG, 1, time.monotonic())
    lease(w, sched, "kv")
    w._reqs_to_send["stock"] = time.perf_counter() + 0.5
    before = w._kvl_rank.rank.expiry("kv")
    later(monkeypatch, 5)
    assert drain(w, "d", b"HB:kv,stock,unknown") == set()
    assert w._kvl_rank.rank.expiry("kv") > before
    assert w._reqs_to_send["stock"] >= time.perf_counter() + 3.5


def test_nonce_read_done_releases_through_the_scheduler_not_finished_sending():
    w = p_worker()
    sched = kvlease.PrefillScheduler(CONFIG, 1, time.monotonic())
    slot, nonce = lease(w, sched, "kv")
    assert w._kvl_rank.rank.slot_word(slot) == nonce
    stale = kvlease.encode_read_done("kv", 1, nonce ^ 1, True)
    assert drain(w, "d", stale) == set()
    assert w._kvl_rank.rank.held == 1
    done = drain(w, "d", kvlease.encode_read_done("kv", 1, nonce, True))
    assert done == set()  # the scheduler reports it, once every rank let go
    assert w._kvl_rank.rank.slot_word(slot) == 0
    sched.apply_reports(0, w._kvl_rank.reports())
    assert [(r[0], r[2]) for r in sched.drain_released()] == [("kv", "read_done")]


def test_stock_leases_keep_vllms_counting():
    w = p_worker()
    w._reqs_to_send["s"] = time.perf_counter() + 30
    w._reqs_to_process.add("s")
    assert drain(w, "d1", b"s:2") == set()
    assert drain(w, "d2", b"s:2:nonce=00000000000000aa") == {"s"}
    assert "s" not in w._reqs_to_send and "s" not in w._reqs_to_process


def test_read_done_for_nothing_held_counts_as_after_expiry():
    w = p_worker()
    assert drain(w, "d", b"gone:1") == set()
    assert w.xfer_stats.data["num_notifications_after_expiry"] == [1]


@pytest.mark.parametrize("msg", [b"", b"\xff\xfe:1", b"no-colon", b"id:x", b"id:0", b"id:-1", b":1", b"HB:\xff"])
def test_malformed_notifications_are_dropped(msg):
    w = p_worker()
    w._reqs_to_send["id"] = time.perf_counter() + 30
    w._reqs_to_process.add("id")
    assert drain(w, "d", msg) == set()
    assert w._reqs_to_send  # nothing released by garbage


def test_expiry_is_the_ranks_poll_and_vllms_reaper_for_its_own():
    w = p_worker()
    sched = kvlease.PrefillScheduler(CONFIG, 1, time.monotonic())
    lease(w, sched, "kv")
    w._reqs_to_send["stock"] = time.perf_counter() - 1
    w._reqs_to_process.add("stock")
    done: set[str] = set()
    w._kvl_rank.poll(time.monotonic() + 60)  # as if 60 s passed
    w._reap_expired_send_leases(done)
    assert done == {"stock"}  # kvlease's expiry reaches vLLM through the scheduler
    sched.apply_reports(0, w._kvl_rank.reports())
    assert [(r[0], r[2]) for r in sched.drain_released()] == [("kv", "expired")]


def test_direct_heartbeat_call_works_with_and_without_kvlease(monkeypatch):
    w = p_worker()
    sched = kvlease.PrefillScheduler(CONFIG, 1, time.monotonic())
    lease(w, sched, "kv")
    before = w._kvl_rank.rank.expiry("kv")
    later(monkeypatch, 5)
    w._handle_heartbeat("kv")
    assert w._kvl_rank.rank.expiry("kv") > before
    stock = object.__new__(KvLeaseWorker)  # vLLM's tests' stub: no kvlease state
    stock._reqs_to_send = {"a": 0.0}
    stock._lease_extension = 20
    stock._handle_heartbeat("a")
    assert stock._reqs_to_send["a"] > 0.0


# -- hypothesis -------------------------------------------------------------------

SETTINGS = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ids = st.sampled_from(["kv0", "kv1", "s0", "s1", "x", "a:b"]) | st.text(max_size=12)
messages = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda b: b"HB:" + b, st.binary(max_size=100)),
    st.builds(lambda b: b"HBC:" + b, st.binary(max_size=100)),
    st.builds(lambda b: b"HBP:" + b, st.binary(max_size=100)),
    st.builds(lambda i: ("HB:" + ",".join(i)).encode("utf-8", "surrogatepass"), st.lists(ids, max_size=5)),
    st.builds(
        lambda i, n, nonce: (f"{i}:{n}" + (f":nonce={nonce:016x}" if nonce is not None else "")).encode(
            "utf-8", "surrogatepass"
        ),
        ids,
        st.integers(min_value=-2, max_value=4),
        st.none() | st.integers(min_value=0, max_value=2**64 - 1),
    ),
)


@SETTINGS
@given(st.lists(st.tuples(st.text(max_size=8) | st.binary(max_size=8), messages), max_size=12))
def test_random_notifications_never_raise(batch):
    w = p_worker()
    sched = kvlease.PrefillScheduler(CONFIG, 1, time.monotonic())
    lease(w, sched, "kv0")
    lease(w, sched, "kv1")
    for sid in ("s0", "s1"):
        w._reqs_to_send[sid] = time.perf_counter() + 30
        w._reqs_to_process.add(sid)
    pending: dict = {}
    for sender, msg in batch:
        pending.setdefault(sender, []).append(msg)
    w.nixl_wrapper.pending = pending
    done = w._get_new_notifs()
    assert done <= {"s0", "s1"}
    w._reap_expired_send_leases(set())
    sched.apply_reports(0, w._kvl_rank.reports())
    sched.drain_released()


@SETTINGS
@given(st.binary(max_size=120))
def test_read_done_parser_never_raises(msg):
    got = _parse_read_done(msg)
    assert got is None or (got[0] and got[1] > 0)


@SETTINGS
@given(
    st.dictionaries(
        st.sampled_from(["remote_lease_slot", "remote_lease_nonce", "other"]),
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5)),
    )
)
def test_lease_fields_from_params_never_raise(params):
    got = read_fields(params)
    if got is not None:
        slot, nonce = got
        assert type(slot) is int and type(nonce) is int
        assert 0 <= slot < 2**32 and nonce != 0 and -(2**63) <= nonce < 2**63


def test_lease_fields_written_back_as_doubles_are_read():
    # A router that re-encodes every number as a double may write 7.0.
    assert read_fields({"remote_lease_slot": 7.0, "remote_lease_nonce": 2.0**52 + 1}) == (
        7, 2**52 + 1)
    # A fraction, a double past 2^53 (not exact any more), a bool: not lease fields.
    assert read_fields({"remote_lease_slot": 7.5, "remote_lease_nonce": 9}) is None
    assert read_fields({"remote_lease_slot": 7, "remote_lease_nonce": 2.0**60}) is None
    assert read_fields({"remote_lease_slot": True, "remote_lease_nonce": 9}) is None
