"""Compact heartbeats between kvlease peers (issue 30, item 3): D's
scheduler keeps the lease fields of the requests vLLM heartbeats and ships
them as packed ``HBP:`` messages with each heartbeat round; D's worker sends
those to a P agent whose advert accepts them, and vLLM's ``HB:`` message,
byte for byte, to every other agent (a kvlease P from before ``HBP:``
included); requests without lease fields stay in ``HB:``; and P renews on
all three forms.

The scheduler is built as vLLM's heartbeat tests build theirs
(``make_nixl_scheduler``), the worker with ``object.__new__``, and the stock
reference is vLLM's own ``_send_heartbeats`` on the same metadata."""

from __future__ import annotations

import time
from collections import defaultdict
from unittest.mock import MagicMock

import msgspec
import pytest
from tests.v1.kv_connector.unit.utils import create_request, make_nixl_scheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

import kvlease
import kvlease.vllm.worker as worker_mod
from kvlease.vllm import handshake_adverts
from kvlease.vllm.compact_heartbeats import MAX_MESSAGE_LEN, HeartbeatLeases
from kvlease.vllm.load_checks import LoadChecks
from kvlease.vllm.metadata import STEP_ATTR, KvLeaseHandshakePayload
from kvlease.vllm.rank_leases import RankLeases
from kvlease.vllm.scheduler import KvLeaseScheduler
from kvlease.vllm.stats import KvLeaseConnectorStats
from kvlease.vllm.worker import KvLeaseWorker

CONFIG = kvlease.LeaseConfig.parse({"kv_lease_duration": 6}, 64, 8)
ENGINE = "my-engine-id"  # create_request's P engine
STOCK_ENGINE = "stock-engine"


def d_scheduler() -> KvLeaseScheduler:
    """vLLM's heartbeat-test scheduler, as kvlease's D scheduler."""
    s = make_nixl_scheduler(heartbeat=True, kv_lease_duration=6)
    s.__class__ = KvLeaseScheduler
    s._kvl_heartbeats = HeartbeatLeases()
    s._kvl_unannounced = {}
    return s


def d_scheduler_counting_late_rounds() -> KvLeaseScheduler:
    """A D scheduler with the late-round warning on (extension 4 s, limit
    3 s), its counters, and a log that is not rate-limited."""
    import kvlease.vllm.scheduler as sched_mod

    s = d_scheduler()
    s._kvl_extension, s._kvl_round_gap_limit = 4.0, 3.0
    s._kvl_d_stats = sched_mod.KvLeaseConnectorStats()
    s._kvl_log = sched_mod.RateLimitedLog(sched_mod.logger, interval=0.0)
    return s


def d_request(n: int, fields: tuple[int, int] | None = None, engine: str = ENGINE):
    r = create_request(request_id=n, do_remote_prefill=True)
    r.kv_transfer_params["remote_engine_id"] = engine
    if fields is not None:
        r.kv_transfer_params["remote_lease_slot"] = fields[0]
        r.kv_transfer_params["remote_lease_nonce"] = fields[1]
    return r


def heartbeat_round(s: KvLeaseScheduler):
    s._last_heartbeat_time = time.perf_counter() - 10  # past vLLM's throttle
    return s.build_connector_meta(MagicMock())


def compact_entries(msgs) -> list[tuple[int, int]]:
    out = []
    for m in msgs:
        kind, entries = kvlease.decode_notification(m)
        assert kind == "packed"
        out += entries
    return out


def test_a_round_carries_the_fields_of_every_heartbeated_request_with_them():
    s = d_scheduler()
    s.on_new_request(d_request(1, (3, 0x5EED)))
    s.on_new_request(d_request(2, (4, -5)))
    s.on_new_request(d_request(3))  # no lease fields (a stock or unslotted lease)
    s.on_new_request(d_request(4, engine=STOCK_ENGINE))  # an engine without any
    meta = heartbeat_round(s)
    rounds = getattr(meta, STEP_ATTR).heartbeats
    assert set(rounds) == {ENGINE}, "an engine without lease fields is vLLM's alone"
    rnd = rounds[ENGINE]
    assert sorted(compact_entries(rnd.messages)) == [(3, 0x5EED), (4, -5)]
    assert rnd.text == b"HB:prefill-3", "the request without fields is renewed by id"

    # A request that stops being heartbeated leaves the next round.
    s.update_connector_output(MagicMock(finished_recving={"id-1"}))
    s._stop_heartbeat("id-3")
    rnd = getattr(heartbeat_round(s), STEP_ATTR).heartbeats[ENGINE]
    assert compact_entries(rnd.messages) == [(4, -5)] and rnd.text == b""

    # Throttled steps carry nothing of it (vLLM sends no heartbeat then).
    meta = s.build_connector_meta(MagicMock())
    assert not meta.heartbeat_by_engine and getattr(meta, STEP_ATTR, None) is None

    # The last one gone: the book is as empty as vLLM's sets.
    s._stop_heartbeat("id-2")
    s._stop_heartbeat("id-4")
    assert s._heartbeat_by_engine == {} and s._kvl_heartbeats.engines() == 0


def test_a_round_is_a_snapshot_not_vllms_live_dict():
    s = d_scheduler()
    s.on_new_request(d_request(1, (3, 7)))
    meta = heartbeat_round(s)
    assert meta.heartbeat_by_engine is s._heartbeat_by_engine  # vLLM's live dict
    rnd = getattr(meta, STEP_ATTR).heartbeats[ENGINE]
    s.on_new_request(d_request(2, (4, 8)))
    s._stop_heartbeat("id-1")
    assert compact_entries(rnd.messages) == [(3, 7)], "what the round shipped"


def test_a_large_round_is_split_to_the_librarys_limit():
    book = HeartbeatLeases()
    info = MagicMock(req_ids={f"p-{i}" for i in range(6000)})
    for i in range(6000):
        book.track(ENGINE, f"p-{i}", (i, i + 1))
    rnd = book.round({ENGINE: info})[ENGINE]
    assert len(rnd.messages) == 2 and all(len(m) <= MAX_MESSAGE_LEN for m in rnd.messages)
    assert len(compact_entries(rnd.messages)) == 6000 and rnd.text == b""


class SendLog:
    """A NIXL agent that records what is sent, by agent name."""

    def __init__(self) -> None:
        self.sent: dict[str, list[bytes]] = defaultdict(list)

    def send_notif(self, agent_name, notif_msg=b""):
        self.sent[agent_name].append(bytes(notif_msg))


def handshake_advert(advert: bytes | None):
    """What D's handshake reads from a P rank whose payload carries ``advert``."""
    payload = KvLeaseHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"m",
                                      kv_lease_advert=advert or b"")
    return handshake_adverts.decode(msgspec.msgpack.encode(payload))


REMOTE_AGENTS = {
    ENGINE: {(0, 0): "p-kvlease", (0, 1): "p-older-kvlease"},
    STOCK_ENGINE: {(0, 0): "p-stock"},
}


def d_worker(cls: type, checks: LoadChecks | None) -> tuple[object, SendLog]:
    """A D worker's heartbeat state, as vLLM's tests build workers."""
    w = object.__new__(cls)
    w._remote_agents = REMOTE_AGENTS
    w._engine_last_active = {}
    w._hb_handshake_notif_only = False
    w._ensure_handshake = lambda *a, **k: None  # every handshake done
    w.nixl_wrapper = SendLog()
    if checks is not None:
        w._kvl_checks = checks
    return w, w.nixl_wrapper


def test_the_worker_sends_packed_only_to_agents_whose_advert_accepts_it():
    s = d_scheduler()
    s.on_new_request(d_request(1, (3, 0x5EED)))
    s.on_new_request(d_request(2, (4, 9)))
    s.on_new_request(d_request(3))
    s.on_new_request(d_request(4, engine=STOCK_ENGINE))
    meta = heartbeat_round(s)

    checks = LoadChecks(CONFIG, 8, 4, "d-test")
    rank = RankLeases(CONFIG, 0, time.monotonic())  # a kvlease P rank's own advert
    checks.record_adverts(
        {(0, 0): "p-kvlease", (0, 1): "p-older-kvlease", (0, 2): "p-hbc-kvlease",
         (0, 3): "p-stock"},
        {
            (0, 0): handshake_advert(rank.advert()),
            # A kvlease P from before compact heartbeats: slots, no flag.
            (0, 1): handshake_advert(kvlease.lease_advert(0x1000, 4096, 512)),
            # One from before packed heartbeats: HBC: only.
            (0, 2): handshake_advert(
                kvlease.lease_advert(0x1000, 4096, 512, compact_heartbeats=True)),
            (0, 3): handshake_advert(None),
        },
    )
    agents = ("p-kvlease", "p-older-kvlease", "p-hbc-kvlease", "p-stock")
    assert [checks.accepts_packed(a) for a in agents] == [True, False, False, False]

    ours, got = d_worker(KvLeaseWorker, checks)
    ours._send_heartbeats(meta)
    vllms, stock = d_worker(NixlPullConnectorWorker, None)
    vllms._send_heartbeats(meta)

    assert ours.nixl_wrapper is got, "the agent is put back"
    compact, text = got.sent["p-kvlease"][:-1], got.sent["p-kvlease"][-1]
    assert sorted(compact_entries(compact)) == [(3, 0x5EED), (4, 9)]
    assert text == b"HB:prefill-3"
    # Every agent that does not accept them: vLLM's bytes, exactly.
    for agent in ("p-older-kvlease", "p-hbc-kvlease", "p-stock"):
        assert got.sent[agent] == stock.sent[agent], agent
    assert stock.sent["p-stock"] == [b"HB:prefill-4"]
    assert ours._engine_last_active.keys() == vllms._engine_last_active.keys() == {
        ENGINE, STOCK_ENGINE}


def test_without_a_round_or_a_checker_the_worker_is_vllms():
    s = d_scheduler()
    s.on_new_request(d_request(1))  # no fields: no compact round at all
    meta = heartbeat_round(s)
    assert getattr(meta, STEP_ATTR, None) is None
    checks = LoadChecks(CONFIG, 8, 4, "d-test")
    checks.record_adverts({(0, 0): "p-kvlease"},
                          {(0, 0): handshake_advert(RankLeases(CONFIG, 0, 0.0).advert())})
    ours, got = d_worker(KvLeaseWorker, checks)
    ours._send_heartbeats(meta)
    assert got.sent["p-kvlease"] == [b"HB:prefill-1"]
    # A worker built without __init__ (vLLM's tests) has no checker.
    s.on_new_request(d_request(2, (1, 2)))
    meta = heartbeat_round(s)
    bare, got = d_worker(KvLeaseWorker, None)
    bare._send_heartbeats(meta)
    assert sorted(got.sent["p-kvlease"][0][3:].split(b",")) == [b"prefill-1", b"prefill-2"]


class Inbox:
    def __init__(self) -> None:
        self.pending: dict[str, list[bytes]] = {}

    def get_new_notifs(self):
        out, self.pending = self.pending, {}
        return out


def p_worker() -> KvLeaseWorker:
    w = object.__new__(KvLeaseWorker)
    w._kvl_rank = RankLeases(CONFIG, 0, time.monotonic())
    w._reqs_to_send = {}
    w._reqs_to_process = set()
    w.consumer_notification_counts_by_req = defaultdict(int)
    w.expected_consumer_notifications_by_req = {}
    w.xfer_stats = KvLeaseConnectorStats()
    w._lease_extension = 4
    w.nixl_wrapper = Inbox()
    return w


def test_p_renews_on_what_d_sends_and_ignores_a_wrong_nonce(monkeypatch):
    p = p_worker()
    sched = kvlease.PrefillScheduler(CONFIG, 1, time.monotonic())
    now = time.monotonic()
    fields = {}
    for rid in ("a", "b"):
        fields[rid] = sched.assign(rid, now)
        sched.start(rid, now)
    p._kvl_rank.apply_directives(sched.encode_directives(now), now)
    p._reqs_to_send["stock"] = time.perf_counter() + 0.5  # a lease vLLM holds

    d = d_scheduler()
    d.on_new_request(d_request(1, fields["a"]))
    slot_b, nonce_b = fields["b"]
    d.on_new_request(d_request(2, (slot_b, nonce_b + 1)))  # not b's lease any more
    stock = d_request(3)
    stock.kv_transfer_params["remote_request_id"] = "stock"  # vLLM's lease on P
    d.on_new_request(stock)
    checks = LoadChecks(CONFIG, 8, 4, "d-test")
    checks.record_adverts({(0, 0): "p-kvlease"}, {(0, 0): handshake_advert(p._kvl_rank.advert())})
    d_w, sent = d_worker(KvLeaseWorker, checks)
    d_w._send_heartbeats(heartbeat_round(d))
    msgs = sent.sent["p-kvlease"]
    assert msgs[0].startswith(b"HBP:") and msgs[-1] == b"HB:stock"

    before = {rid: p._kvl_rank.rank.expiry(rid) for rid in ("a", "b")}
    t = time.monotonic() + 5
    monkeypatch.setattr(worker_mod, "_now", lambda: t)
    p.nixl_wrapper.pending = {"d-agent": msgs}
    assert p._get_new_notifs() == set()
    c = p._kvl_rank.rank.counters()
    assert p._kvl_rank.rank.expiry("a") > before["a"], "renewed by its (slot, nonce)"
    assert p._kvl_rank.rank.expiry("b") == before["b"], "a stale nonce renews nothing"
    assert c["renewed"] == 1 and c["renew_nonce_mismatch"] == 1 and c["malformed_notifications"] == 0
    assert p._reqs_to_send["stock"] >= time.perf_counter() + 3.5, "HB: still renews vLLM's"


@pytest.mark.parametrize(
    "bad",
    [b"HBC:", b"HBC:0000000", b"HBC:" + b"z" * 24,
     b"HBP:", b"HBP:" + b"@" * 15, b"HBP:" + b"@" * 15 + b"\xff", b"HBP:" + b"@" * 16],
)
def test_a_malformed_compact_heartbeat_is_counted_and_renews_nothing(bad):
    p = p_worker()
    p.nixl_wrapper.pending = {"d-agent": [bad]}
    assert p._get_new_notifs() == set()
    assert p._kvl_rank.malformed == 1


def test_d_warns_when_its_heartbeat_rounds_ran_later_than_the_lease_margin(monkeypatch, caplog):
    """Heartbeats go out from the step loop, one round at the first step an
    interval after the last: a D whose steps stall (a starved engine) sends
    its next round late, and P lets a lease go one extension after the last
    heartbeat it received. D warns when two rounds went out further apart
    than extension - interval (the margin vLLM's design leaves), once per
    late round; steps without a round (vLLM's throttle) and a gap with
    nothing to heartbeat are no late round."""
    import kvlease.vllm.scheduler as sched_mod

    s = d_scheduler_counting_late_rounds()
    clock = [1000.0]
    monkeypatch.setattr(sched_mod, "_now", lambda: clock[0])
    caplog.set_level("WARNING", logger="vllm.kvlease.scheduler")

    def step(after: float, heartbeat_round: bool) -> None:
        clock[0] += after
        # vLLM's throttle (its own clock) decides whether this step is a round.
        s._last_heartbeat_time = -1e9 if heartbeat_round else time.perf_counter() + 1e9
        meta = s.build_connector_meta(MagicMock())
        assert bool(meta.heartbeat_by_engine) == (heartbeat_round and bool(s._heartbeat_by_engine))

    def late_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "went out" in r.getMessage()]

    step(0.0, True)  # nothing to heartbeat
    clock[0] += 30.0  # an idle spell
    s.on_new_request(d_request(1, (3, 77)))
    step(0.0, True)  # the first round after an idle spell: no gap to measure
    step(2.9, False)  # steps between rounds do not count
    step(0.05, True)  # rounds 2.95 s apart: under the margin
    assert not late_lines()
    step(3.5, True)  # the engine stalled 3.5 s: the round is late
    lines = late_lines()
    assert len(lines) == 1 and "3.5 s apart" in lines[0] and "4.0 s" in lines[0], lines
    assert "warned past 3.0 s" in lines[0], lines
    # ... and counts it (vllm:kv_lease_late_heartbeat_rounds_total), once.
    stats = s.kvl_take_stats()
    assert stats is not None and stats.lease_total("kv_lease_late_heartbeat_rounds") == 1
    assert s.kvl_take_stats() is None, "taken: the next report starts from zero"
    s._stop_heartbeat("id-1")  # its KV arrived: nothing waits
    step(0.5, True)
    clock[0] += 20.0  # 20 s without a wait ...
    s.on_new_request(d_request(2, (4, 78)))
    step(0.0, True)  # ... then a new one: no late round
    assert len(late_lines()) == 1


def test_d_counts_a_first_heartbeat_that_went_out_late_after_the_request_reached_it(
        monkeypatch, caplog):
    """The gap between rounds cannot see a request whose first round came
    late: none was due for it (and after an idle D there is no last round).
    A stalled step holds a request D's scheduler took in, and P's lease runs
    all the while; D counts the round that first carries it as late when it
    went out more than extension - interval after the scheduler took it in,
    on the scheduler's own clock. A request's ``arrival_time`` (the API
    server's wall clock, maybe another host's) is not read: an hour of skew
    in it changes nothing (issue 38, item 10; before, it was the measure)."""
    import kvlease.vllm.scheduler as sched_mod

    s = d_scheduler_counting_late_rounds()
    wall = [5000.0]
    monkeypatch.setattr(sched_mod, "_now", lambda: wall[0])
    caplog.set_level("WARNING", logger="vllm.kvlease.scheduler")

    def round_after(seconds: float) -> None:
        wall[0] += seconds
        s._last_heartbeat_time = -1e9  # vLLM's throttle: this step is a round
        assert s.build_connector_meta(MagicMock()).heartbeat_by_engine

    def arrive(n: int):
        r = d_request(n, (n, 70 + n))
        r.arrival_time = wall[0] - 3600.0 * (1 if n % 2 else -1)  # another host's clock
        s.on_new_request(r)
        return r

    def first_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "first heartbeat" in r.getMessage()]

    def late_total() -> int:
        stats = s.kvl_take_stats()
        return 0 if stats is None else int(stats.lease_total("kv_lease_late_heartbeat_rounds"))

    def idle() -> None:
        """Nothing left to heartbeat: the next round has no gap to measure."""
        wall[0] += 0.1
        s._last_heartbeat_time = -1e9
        s.build_connector_meta(MagicMock())

    first = arrive(1)  # on an idle D
    round_after(2.5)  # its first round 2.5 s after it arrived: on time
    assert not first_lines() and late_total() == 0
    s._stop_heartbeat(first.request_id)
    idle()
    second = arrive(2)  # on an idle D again
    round_after(3.6)  # the engine stalled: its first round 3.6 s after
    lines = first_lines()
    assert len(lines) == 1 and "3.6 s after" in lines[0] and "warned past 3.0 s" in lines[0], lines
    assert late_total() == 1
    round_after(1.0)  # carried before: no longer a first round
    assert late_total() == 0 and len(first_lines()) == 1
    s._stop_heartbeat(second.request_id)
    idle()
    # A request whose KV arrived before any round carried it is no first
    # round of anyone's: it does not make a later round late.
    third = arrive(3)
    s._stop_heartbeat(third.request_id)
    arrive(4)
    wall[0] += 10.0
    fifth = arrive(5)
    s._stop_heartbeat(fifth.request_id)
    round_after(0.5)  # request 4 waited 10.5 s on an idle D: late, once
    assert late_total() == 1 and len(first_lines()) == 2
