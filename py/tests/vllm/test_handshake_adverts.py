"""D reads each P rank's lease advert from the reply vLLM's own handshake
received (issue 28, finding 6): no second GET_META round trip, and a P whose
listener answers slowly or only once never fails the handshake.

A P listener is played by a real ZMQ ROUTER thread that answers like vLLM's
(``[payload, perf_counter]``), counts the queries, and can go silent after
its first answer (the 2-core real-engine failure: the advert query timed out
after 5 s and took vLLM's handshake down with it). vLLM's handshake I/O is
played by ``_vllm_like_handshake``, which opens ``base_worker.zmq_ctx`` as
vLLM 0.32-0.34's ``_nixl_handshake`` does.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

import kvlease
from kvlease.vllm import handshake_adverts
from kvlease.vllm.metadata import KvLeaseHandshakePayload
from kvlease.vllm.stats import KvLeaseConnectorStats
from kvlease.vllm.worker import KvLeaseWorker

ADVERTS = {0: (0x1000, 4096, 512), 1: (0x9000, 8192, 1024)}


class FakeListener(threading.Thread):
    """P's side channel: answers GET_META for tp ranks 0 and 1; with
    ``answers`` set, goes silent after that many."""

    def __init__(self, stock: bool = False, answers: int | None = None) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.stock, self.answers = stock, answers
        self.queries = 0
        self.stop = threading.Event()

    def payload(self, tp: int) -> bytes:
        if self.stock:
            return msgspec.msgpack.encode(NixlHandshakePayload("h", b"md"))
        advert = kvlease.lease_advert(*ADVERTS[tp])
        return msgspec.msgpack.encode(KvLeaseHandshakePayload("h", b"md", kv_lease_advert=advert))

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                ident, _, msg = self.sock.recv_multipart()
            except zmq.Again:
                continue
            self.queries += 1
            if self.answers is not None and self.queries > self.answers:
                continue
            _, _pp, tp = msgspec.msgpack.decode(msg)
            self.sock.send_multipart([ident, b"", self.payload(tp),
                                      msgspec.msgpack.encode(time.perf_counter())])

    def close(self) -> None:
        self.stop.set()
        self.join(2)
        self.sock.close(0)
        self.ctx.term()


def _vllm_like_handshake(self, host, port, remote_tp_size, expected_engine_id,
                         remote_dcp_size=1, remote_pp_size=1, notif_agents_only=False):
    """vLLM's handshake I/O: one GET_META per rank on one REQ socket opened
    with base_worker.zmq_ctx, replies read with recv_multipart."""
    agents = {}
    with base_worker.zmq_ctx(zmq.REQ, base_worker.make_zmq_path("tcp", host, port)) as sock:
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        for tp in range(remote_tp_size):
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, tp)))
            parts = sock.recv_multipart()
            msgspec.msgpack.Decoder(NixlHandshakePayload).decode(parts[0])
            agents[(0, tp)] = f"agent-{tp}"
    return agents, 0.0


class Checks:
    def __init__(self) -> None:
        self.adverts = {}

    def record_adverts(self, agents, adverts):
        for key, name in agents.items():
            self.adverts[name] = adverts.get(key)


@pytest.fixture
def worker(monkeypatch):
    monkeypatch.setattr(NixlPullConnectorWorker, "_nixl_handshake", _vllm_like_handshake)
    handshake_adverts.install(base_worker)
    w = object.__new__(KvLeaseWorker)
    w._kvl_checks = Checks()
    w.xfer_stats = KvLeaseConnectorStats()
    return w


def test_the_advert_comes_from_vllms_own_reply_with_no_second_query(worker):
    p = FakeListener()
    p.start()
    try:
        agents, _ = worker._nixl_handshake("127.0.0.1", p.port, 2, "engine")
    finally:
        p.close()
    assert agents == {(0, 0): "agent-0", (0, 1): "agent-1"}
    assert worker._kvl_checks.adverts == {"agent-0": ADVERTS[0], "agent-1": ADVERTS[1]}
    assert p.queries == 2, "one GET_META per P rank, as vLLM alone asks"


def test_a_listener_that_answers_once_per_rank_does_not_fail_the_handshake(worker):
    # Before the fix, D asked again for the advert; a listener that did not
    # answer in 5 s failed vLLM's whole handshake (handshake_setup_failed).
    p = FakeListener(answers=2)
    p.start()
    try:
        t0 = time.monotonic()
        agents, _ = worker._nixl_handshake("127.0.0.1", p.port, 2, "engine")
        took = time.monotonic() - t0
    finally:
        p.close()
    assert len(agents) == 2 and took < 4.0
    assert worker._kvl_checks.adverts["agent-1"] == ADVERTS[1]


def test_a_stock_p_gives_no_advert(worker):
    p = FakeListener(stock=True)
    p.start()
    try:
        worker._nixl_handshake("127.0.0.1", p.port, 1, "engine")
    finally:
        p.close()
    assert worker._kvl_checks.adverts == {"agent-0": None}


def test_recording_is_inert_outside_a_handshake():
    handshake_adverts.install(base_worker)
    with base_worker.zmq_ctx(zmq.REQ, "tcp://127.0.0.1:1") as sock:
        assert not isinstance(sock, handshake_adverts._ReplyRecorder)
    with handshake_adverts.recording():
        with base_worker.zmq_ctx(zmq.REQ, "tcp://127.0.0.1:1") as sock:
            assert isinstance(sock, handshake_adverts._ReplyRecorder)


@pytest.mark.parametrize("payload", [b"", b"\xff\x00garbage", msgspec.msgpack.encode([1, 2, 3])])
def test_a_reply_that_does_not_decode_is_unknown_and_never_raises(payload):
    assert handshake_adverts.decode(payload) == handshake_adverts.UNKNOWN


def test_replies_that_do_not_match_the_ranks_fall_back():
    assert handshake_adverts.from_replies([(0, 0), (0, 1)], [b"x"]) is None


def test_the_fallback_query_never_raises_and_marks_the_rank_unknown():
    p = FakeListener(answers=0)
    p.start()
    old = handshake_adverts.QUERY_TIMEOUT_MS
    handshake_adverts.QUERY_TIMEOUT_MS = 300
    try:
        out = handshake_adverts.query("127.0.0.1", p.port, [(0, 0)], base_worker, GET_META_MSG)
    finally:
        handshake_adverts.QUERY_TIMEOUT_MS = old
        p.close()
    assert out == {(0, 0): handshake_adverts.UNKNOWN}
