"""The seams between vLLM's push worker and kvlease's guard, on P: where
vLLM posts a guarded WRITE, what P remembers of the requests it released,
a client's retry under one request id, and how long P holds its own blocks
for a WRITE that never ends (issue 38, items 1, 2, 4 and 9).

The worker is ``KvLeasePushWorker`` itself with vLLM's parts that would need
a model, NIXL and threads replaced: ``_do_start_push_kv`` and
``_xfer_blocks_for_req`` of vLLM's ``NixlPushConnectorWorker`` become the
few lines of theirs that matter here (vLLM's ``_xfer_blocks`` prepares the
transfer, then posts it with ``nixl_wrapper.transfer``, and logs and drops a
post that raises), and the clock is the test's.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict
from types import SimpleNamespace

import msgspec
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)

from kvlease import PushConfig
from kvlease.vllm import push_worker
from kvlease.vllm.handshake_adverts import ClockRound
from kvlease.vllm.log_limit import RateLimitedLog
from kvlease.vllm.push_notifs import NotifTap
from kvlease.vllm.push_permits import PERMIT_KEY, DecodePushGuard
from kvlease.vllm.push_worker import KvLeasePushWorker
from kvlease.vllm.push_writes import PrefillPushGuard
from kvlease.vllm.stats import KvLeaseConnectorStats

SKEW = 500.0  # D's clock minus P's
D_ENGINE, P_ENGINE = "d-engine", "p-engine"


class Clock:
    def __init__(self, t: float = 1.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Agent:
    """NIXL's agent as the tap sees it: records each post."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.posted: list[tuple[int, float]] = []
        self._next = 0

    def make_prepped_xfer(self, *args, **kwargs) -> int:
        self._next += 1
        return self._next

    def transfer(self, handle: int) -> str:
        self.posted.append((handle, self.clock.t))
        return "PROC"

    def get_new_notifs(self) -> dict:
        return {}


class P:
    """One P worker (``KvLeasePushWorker``, P side only) and one D guard."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stall: float = 0.0) -> None:
        self.clock = Clock()
        monkeypatch.setattr(push_worker, "_now", self.clock)
        self.stall = stall
        self.config = PushConfig(12.0, capacity=16)
        self.d = DecodePushGuard(self.config, max_peers=4, seed=7)
        self.d.note_p(P_ENGINE, 1)
        self.agent = Agent(self.clock)
        w = self.w = object.__new__(KvLeasePushWorker)
        w._kvl_p = PrefillPushGuard(self.config, 4, hold_limit=12.0)
        w._kvl_d = None
        w._kvl_tap = NotifTap(self.agent, lambda msgs: None)
        w.nixl_wrapper = w._kvl_tap
        w._kvl_log = RateLimitedLog(logging.getLogger("test"))
        w.xfer_stats = KvLeaseConnectorStats()
        w._kvl_release_lock = threading.Lock()
        w._kvl_hold_bound = self.config.hold_bound
        w._kvl_guarded = threading.local()
        w._kvl_writing, w._kvl_held_back, w._kvl_done_back = {}, set(), set()
        w._kvl_evict = queue.SimpleQueue()
        w._kvl_replaying, w._kvl_asks = set(), {}
        w._sending_transfers = defaultdict(list)
        w._sending_transfers_lock = threading.Lock()
        w._push_writer_wake = threading.Event()
        w._push_finished_blocks = {}
        w._pending_d_registrations = {}
        w._kvl_p.peers.note_agents(D_ENGINE, ["d-agent"])
        w._kvl_p.observe_clock(D_ENGINE, [ClockRound((0.9, 1.0 + SKEW, 1.1))], 1.1)
        test = self

        def do_start_push_kv(self, request_id, local_block_ids, registration_data):
            meta = SimpleNamespace(remote=SimpleNamespace(
                engine_id=registration_data["decode_engine_id"],
                request_id=registration_data["request_id"]))
            self._xfer_blocks_for_req(request_id, meta)

        def xfer_blocks_for_req(self, req_id, meta):
            test.clock.t += test.stall  # descriptors, a GIL stall, ...
            handle = self.nixl_wrapper.make_prepped_xfer("WRITE")
            try:
                self.nixl_wrapper.transfer(handle)
            except Exception:
                return  # vLLM: "Push WRITE submission failed; releasing handle"
            with self._sending_transfers_lock:
                self._sending_transfers[req_id].append(handle)

        monkeypatch.setattr(NixlPushConnectorWorker, "_do_start_push_kv", do_start_push_kv)
        monkeypatch.setattr(NixlPushConnectorWorker, "_xfer_blocks_for_req", xfer_blocks_for_req)

    def prefill(self, p_rid: str) -> None:
        """P finished the prefill of ``p_rid``: its blocks wait for D."""
        self.w._push_finished_blocks[p_rid] = ([1, 2, 3],)

    def registration(self, d_rid: str) -> bytes:
        """D's PUSH_REG for ``d_rid``, with a permit, sent now."""
        permit = self.d.register(d_rid, P_ENGINE, self.clock.t + SKEW)
        assert permit is not None
        reg = {"request_id": d_rid, "decode_engine_id": D_ENGINE, "decode_host": "h",
               "decode_port": 1, "decode_tp_size": 1, "local_block_ids": [[7, 8, 9]],
               PERMIT_KEY: permit}
        return PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(reg)

    def write_ends(self, p_rid: str) -> None:
        """vLLM's ``_pop_done_transfers`` found the WRITE of ``p_rid`` done."""
        self.w._kvl_p.write_done(p_rid, self.clock.t)
        self.w._kvl_write_ended(p_rid)

    def release(self, *p_rids: str) -> set[str]:
        """vLLM's step reports ``p_rids`` finished sending (WRITE done or
        P's lease expired); what P actually gives back."""
        results = KVConnectorTransferResults(finished_sending=set(p_rids))
        self.w._kvl_release(results)
        return set(results.finished_sending)

    def answers(self) -> list[tuple[str, str]]:
        """What D ends on P's answers now."""
        out = []
        for _engine, msg in self.w._kvl_p.poll(self.clock.t):
            out += self.d.on_messages([("p-agent", msg)], self.clock.t + SKEW)
        return out

    def lease_total(self, key: str) -> int:
        return self.w.xfer_stats.lease_total(key)


def _p(monkeypatch, **kw) -> P:
    p = P(monkeypatch, **kw)
    p.d.peers.note_agents(P_ENGINE, ["p-agent"])
    return p


# -- item 4: the gate at the post ---------------------------------------------------


def test_a_stall_between_vllms_decision_and_the_post_cannot_carry_a_write_past_the_gate(
        monkeypatch):
    """Before: the gate was asked when vLLM entered ``_xfer_blocks_for_req``;
    a 20 s stall before NIXL's ``transfer`` (docs/push.md measured 10-20 s
    stalls in this worker) posted the WRITE past D's deadline (12 s)."""
    x = _p(monkeypatch, stall=20.0)
    x.prefill("req-a-aaaa1111")
    x.w._handle_push_reg_notif(x.registration("req-a-bbbb2222"))
    assert x.agent.posted == [], "the gate at the post refused it"
    assert x.lease_total("kv_push_gate_closed") == 1
    assert x.answers() == [("req-a-bbbb2222", "ended_by_p")], "D fails the load at P's answer"
    assert x.w._kvl_writing == {}, "nothing holds P's blocks"


def test_without_a_stall_the_write_is_posted_through_the_gate(monkeypatch):
    x = _p(monkeypatch)
    x.prefill("req-b-aaaa1111")
    x.w._handle_push_reg_notif(x.registration("req-b-bbbb2222"))
    assert [t for _h, t in x.agent.posted] == [1.0]
    x.write_ends("req-b-aaaa1111")
    assert x.answers() == []  # W: vLLM's own completion finishes D's load
    assert x.d.counts.written == 1


# -- item 9: what P released can never be written --------------------------------------


def test_a_deferred_write_driven_after_the_release_is_refused_at_the_post(monkeypatch):
    """Before: P remembered its last 4,096 releases; a WRITE vLLM's deferred
    queue drove after more releases than that read blocks P had freed. Now
    the release ends the registration itself, so the gate refuses."""
    x = _p(monkeypatch)
    x.prefill("req-d-aaaa1111")
    deferred: list = []
    real_start = NixlPushConnectorWorker._do_start_push_kv
    monkeypatch.setattr(NixlPushConnectorWorker, "_do_start_push_kv",
                        lambda self, rid, blocks, rd: deferred.append((rid, blocks, rd)))
    x.w._handle_push_reg_notif(x.registration("req-d-bbbb2222"))
    ((rid, blocks, rd),) = deferred
    assert x.release("req-d-aaaa1111") == {"req-d-aaaa1111"}
    assert x.answers() == [("req-d-bbbb2222", "ended_by_p")], "D fails the load at once"
    x.release(*(f"other-{i}" for i in range(5000)))
    monkeypatch.setattr(NixlPushConnectorWorker, "_do_start_push_kv", real_start)
    x.w._do_start_push_kv(rid, blocks, rd)  # the handshake is done: vLLM drives it
    assert x.agent.posted == [], "P's freed blocks are never written"
    assert x.w._kvl_writing == {}


# -- item 2: a retry under the same request id ------------------------------------------


def test_two_sequential_requests_with_one_base_id_are_both_written(monkeypatch):
    """Before: P refused the second registration at once ("gone" was keyed
    by the base request id), and the retry's load failed."""
    x = _p(monkeypatch)
    for n, (p_rid, d_rid) in enumerate([("chat-7-aaaa1111", "chat-7-bbbb2222"),
                                        ("chat-7-cccc3333", "chat-7-dddd4444")]):
        x.prefill(p_rid)
        x.w._handle_push_reg_notif(x.registration(d_rid))
        assert len(x.agent.posted) == n + 1, f"request {n + 1} was not written"
        x.write_ends(p_rid)
        assert x.release(p_rid) == {p_rid}
        x.clock.t += 1.0
    assert x.answers() == []
    assert x.d.counts.written == 2 and x.lease_total("kv_push_refused") == 0


def test_a_registration_for_a_request_p_let_go_is_still_refused_at_once(monkeypatch):
    x = _p(monkeypatch)
    x.prefill("chat-8-aaaa1111")
    assert x.release("chat-8-aaaa1111") == {"chat-8-aaaa1111"}  # lease expired
    x.w._push_finished_blocks.clear()
    x.w._handle_push_reg_notif(x.registration("chat-8-bbbb2222"))
    assert x.answers() == [("chat-8-bbbb2222", "refused")]


def test_a_registration_right_after_p_released_its_request_matches_nothing(monkeypatch):
    """vLLM takes a released request out of its table of finished blocks
    only at its writer's next loop; a registration handled in between used
    to be kept off it by the 'gone' check before the match. The release now
    takes it out first: refused at once, nothing posted."""
    x = _p(monkeypatch)
    x.prefill("chat-6-aaaa1111")
    assert x.release("chat-6-aaaa1111") == {"chat-6-aaaa1111"}  # P's lease expired
    assert "chat-6-aaaa1111" in x.w._push_finished_blocks  # vLLM has not evicted it yet
    x.w._handle_push_reg_notif(x.registration("chat-6-bbbb2222"))
    assert x.agent.posted == []
    assert x.answers() == [("chat-6-bbbb2222", "refused")]


def test_letting_one_request_go_leaves_a_retrys_held_registration_alone(monkeypatch):
    """Before: ``let_go`` ended every held registration with the same base
    id, a newer request's among them."""
    x = _p(monkeypatch)
    x.prefill("chat-9-aaaa1111")
    x.w._handle_push_reg_notif(x.registration("chat-9-bbbb2222"))
    x.write_ends("chat-9-aaaa1111")
    # The retry's registration comes before the retry's prefill ends: held.
    x.w._handle_push_reg_notif(x.registration("chat-9-dddd4444"))
    assert "chat-9-dddd4444" in x.w._pending_d_registrations
    assert x.release("chat-9-aaaa1111") == {"chat-9-aaaa1111"}
    assert x.answers() == [], "the retry's registration was not ended"
    assert x.w._kvl_p.held == 2  # the first one's ended entry, the retry's held


# -- item 1: P's hold of its own blocks ends ---------------------------------------------


def test_a_write_that_never_ends_holds_ps_blocks_for_at_most_the_hold_bound(monkeypatch):
    """Before: a guarded WRITE stuck in flight (a dead D, UCX error handling
    "none") held P's blocks back for good."""
    x = _p(monkeypatch)
    x.prefill("req-e-aaaa1111")
    x.w._handle_push_reg_notif(x.registration("req-e-bbbb2222"))
    assert len(x.agent.posted) == 1  # posted at 1.0; it never ends
    x.clock.t = 13.0  # P's lease expires: vLLM releases, kvlease holds back
    assert x.release("req-e-aaaa1111") == set()
    x.clock.t = 1.0 + x.config.hold_bound
    assert x.release() == set(), "not before the hold bound"
    x.clock.t += 0.01
    assert x.release() == {"req-e-aaaa1111"}, "the hold ends at the bound"
    assert x.lease_total("kv_push_holds_ended") == 1
    assert x.w._kvl_writing == {} and x.w._kvl_held_back == set()


# -- item 8: sent or not, from what vLLM did -------------------------------------------


class D:
    """One D worker (``KvLeasePushWorker``, D side only)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, vllm_sends: bool) -> None:
        from kvlease.vllm.scheduler_clock import SchedulerClock

        self.clock = Clock(1.0 + SKEW)
        monkeypatch.setattr(push_worker, "_now", self.clock)
        config = PushConfig(12.0, capacity=16)
        self.sent: list = []
        w = self.w = object.__new__(KvLeasePushWorker)
        w._kvl_d = DecodePushGuard(config, max_peers=4, seed=8)
        w._kvl_d.note_p(P_ENGINE, 1)
        w._kvl_d.peers.note_agents(P_ENGINE, ["p-agent"])
        w._kvl_sched = SchedulerClock(config.drift_ppm)
        w._kvl_sched.observe(self.clock.t, self.clock.t)
        w._kvl_require = False
        w._kvl_log = RateLimitedLog(logging.getLogger("test"))
        w.xfer_stats = KvLeaseConnectorStats()
        w.world_size = 1
        w._handshake_lock = threading.Lock()
        w._remote_agents = {}  # the plugin's snapshot sees no agent yet ...
        w._failed_recv_reqs = queue.Queue()
        w._kvl_tap = NotifTap(SimpleNamespace(send_notif=lambda a, notif_msg: self.sent.append(a)),
                              lambda msgs: None)
        w.nixl_wrapper = w._kvl_tap

        def do_send_reg_notif(self, req_id, reg_data):
            # ... while vLLM's own snapshot, a moment later, finds P's agent
            # (a handshake completed in between), or still none.
            if vllm_sends:
                self.nixl_wrapper.send_notif("p-agent", notif_msg=PUSH_REG_NOTIF_PREFIX + b"...")
            else:
                self._failed_recv_reqs.put(req_id)

        monkeypatch.setattr(NixlPushConnectorWorker, "_do_send_reg_notif", do_send_reg_notif)

    def send(self, rid: str) -> None:
        self.w._do_send_reg_notif(rid, {"remote_engine_id": P_ENGINE, "remote_tp_size": 1})


def test_a_registration_vllm_sent_keeps_its_permit_whatever_the_plugin_saw_before(monkeypatch):
    """Before: the plugin decided from its own look at ``_remote_agents``
    before vLLM's; a handshake completing in between sent the PUSH_REG with
    a permit the plugin had forgotten, so P's answer was ignored and D held
    the blocks for good."""
    x = D(monkeypatch, vllm_sends=True)
    x.send("req-s")
    assert x.sent == ["p-agent"]
    assert x.w._kvl_d.live == 1, "the permit P may write under is D's to end"
    x.clock.t += 12.0 + 10.0 + 0.1  # no answer ever came: D's fence
    _sends, fenced = x.w._kvl_d.poll(x.clock.t)
    assert fenced == [("req-s", "lapsed")], "the load fails at the fence, not never"


def test_a_registration_vllm_never_tried_gives_its_permit_back(monkeypatch):
    x = D(monkeypatch, vllm_sends=False)
    x.send("req-t")
    assert x.sent == [] and x.w._failed_recv_reqs.get_nowait() == "req-t"
    x.clock.t += 12.0 + 10.0 + 0.1
    _sends, fenced = x.w._kvl_d.poll(x.clock.t)
    assert fenced == [], "forgotten: vLLM failed the load itself"


# -- item 10: D's own pipeline parallelism ----------------------------------------------


def test_a_d_with_pipeline_parallelism_does_not_guard_its_pushes(monkeypatch):
    """Before: the guard checked P's pipeline parallelism only; a D with PP
    took permits for pushes the guard cannot cover (one WRITE per request)."""
    x = D(monkeypatch, vllm_sends=True)
    x.w.pp_size = 2
    x.send("req-u")
    assert x.sent == ["p-agent"], "vLLM's own push, unguarded (require off)"
    assert x.w._kvl_d.live == 0 and x.w._kvl_d.counts.unguarded == 1
    x.w._kvl_require = True
    x.send("req-v")
    assert x.sent == ["p-agent"] and x.w._failed_recv_reqs.get_nowait() == "req-v"
