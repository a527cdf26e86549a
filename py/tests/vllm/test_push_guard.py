"""Push mode's guard as the plugin runs it: D's permits
(``push_permits.DecodePushGuard``) and P's registrations
(``push_writes.PrefillPushGuard``) talking through the plugin's own
notification tap, with vLLM's threads and NIXL replaced by plain calls.

Each test is one fault case of docs/push.md, told from the engine's side:
which loads D fails, and when. D's clock reads 500 s more than P's.
"""

from __future__ import annotations

import threading

import msgspec

from kvlease import PushConfig
from kvlease.vllm import handshake_adverts
from kvlease.vllm.handshake_adverts import ClockRound
from kvlease.vllm.metadata import KvLeaseHandshakePayload
from kvlease.vllm.push_notifs import REPLAY, NotifTap
from kvlease.vllm.push_peers import PeerNames
from kvlease.vllm.push_permits import PERMIT_KEY, DecodePushGuard
from kvlease.vllm.push_writes import PrefillPushGuard

SKEW = 500.0  # D's clock minus P's
P_ENGINE, D_ENGINE = "p-engine", "d-engine"
P_AGENT, D_AGENT = "p-agent-0", "d-agent-0"


class Link:
    """One D worker and one P worker, the bytes between them carried by hand."""

    def __init__(self, duration: float = 12.0, capacity: int = 16) -> None:
        self.config = PushConfig(duration, capacity=capacity)
        self.d = DecodePushGuard(self.config, max_peers=4, seed=3)
        self.p = PrefillPushGuard(self.config, max_peers=4, hold_limit=duration)
        # The handshakes: D learns P speaks the guard, P samples D's clock.
        self.d.note_p(P_ENGINE, 1)
        self.d.peers.note_agents(P_ENGINE, [P_AGENT])
        self.p.peers.note_agents(D_ENGINE, [D_AGENT])
        self.p.observe_clock(D_ENGINE, [ClockRound((0.9, 1.0 + SKEW, 1.1))], 1.1)
        self.failed: list[tuple[str, str]] = []

    def register(self, rid: str, t: float, *, live: bool = True):
        """D registers ``rid`` at P's time ``t``; P receives it at once."""
        permit = self.d.register(rid, P_ENGINE, t + SKEW)
        assert permit is not None and len(permit) == 40
        return self.p.register(D_ENGINE, permit, rid, live, t)

    def step(self, t: float, *, p_alive: bool = True) -> None:
        """P's writer drain, then D's step: what D fails now lands in ``failed``."""
        to_d = self.p.poll(t) if p_alive else []
        msgs = [(P_AGENT, m) for engine, m in to_d if engine == D_ENGINE]
        self.failed += self.d.on_messages(msgs, t + SKEW)
        to_p, ended = self.d.poll(t + SKEW)
        self.failed += ended
        if p_alive:
            self.p.on_messages([(D_AGENT, m) for engine, m in to_p if engine == P_ENGINE])


def test_a_guarded_push_is_written_and_vllm_finishes_the_load():
    x = Link()
    handle, refusal = x.register("req-a", 1.0)
    assert refusal is None
    x.p.bind("p-req-a", "req-a", handle)
    assert x.p.begin_write("p-req-a", D_ENGINE, 1.1)  # the gate lets it through
    assert x.p.write_done("p-req-a", 1.2)
    x.d.received("req-a")  # vLLM's completion notification came
    for t in (1.2, 2.0, 30.0, 60.0):
        x.step(t)
    assert x.failed == [], "a written push is vLLM's load; D fails nothing"
    assert x.d.counts.written == 1 and x.d.live == 0


def test_a_registration_after_p_let_the_request_go_fails_the_load_at_once():
    x = Link()
    x.p.let_go("p-req-b", "req-b")
    handle, refusal = x.register("req-b", 40.0, live=not x.p.is_gone("req-b"))
    assert (handle, refusal) == (None, "request_gone")
    x.step(40.0)
    assert x.failed == [("req-b", "refused")], "answered at once, not at a deadline"


def test_p_dead_d_fails_the_load_at_the_fence_and_not_before():
    x = Link()
    x.register("req-c", 1.0)
    fence = 1.0 + x.config.duration + x.config.write_bound
    x.step(fence - 0.5, p_alive=False)
    assert x.failed == []
    x.step(fence + 0.01, p_alive=False)
    assert x.failed == [("req-c", "lapsed")]


def test_d_aborts_while_the_write_flies_and_frees_only_after_it_ended():
    x = Link()
    handle, _ = x.register("req-d", 1.0)
    x.p.bind("p-req-d", "req-d", handle)
    assert x.p.begin_write("p-req-d", D_ENGINE, 1.0)
    x.d.revoke("req-d")  # the client gave up: vLLM's abort
    for t in (1.5, 3.0, 5.0):
        x.step(t)
    assert x.failed == [], "P's WRITE can still land: the blocks stay"
    x.p.write_failed({"p-req-d"})
    assert x.p.write_done("p-req-d", 5.5)
    x.step(5.5)
    assert x.failed == [("req-d", "revoked")]


def test_a_registration_delivered_twice_is_held_once():
    """The wire doubled D's PUSH_REG: the second copy is a ``duplicate``,
    not a second registration for vLLM's table (a real-NIXL case found one
    parked there for good), and after the WRITE it changes nothing."""
    x = Link()
    permit = x.d.register("req-e", P_ENGINE, 1.0 + SKEW)
    handle, refusal = x.p.register(D_ENGINE, permit, "req-e", True, 1.0)
    assert refusal is None
    assert x.p.register(D_ENGINE, permit, "req-e", True, 1.01) == (None, "duplicate")
    x.p.bind("p-req-e", "req-e", handle)
    assert x.p.begin_write("p-req-e", D_ENGINE, 1.1)
    assert x.p.register(D_ENGINE, permit, "req-e", True, 1.2) == (None, "duplicate")
    assert x.p.write_done("p-req-e", 1.3)
    x.d.received("req-e")
    _, again = x.p.register(D_ENGINE, permit, "req-e", True, 1.4)
    assert again not in (None, "duplicate"), "an ended registration is answered again"
    for t in (1.5, 30.0):
        x.step(t)
    assert x.failed == [] and x.d.counts.written == 1 and x.d.live == 0
    assert x.p.counters()["duplicates"] == 3 and x.p.counters()["posted"] == 1


def test_p_holds_an_unmatched_registration_alive_then_ends_it_at_its_hold_limit():
    x = Link()
    x.register("req-e", 1.0)
    for t in range(2, 12):  # P holds it: its heartbeats keep D's permit open
        x.step(float(t))
    assert x.failed == []
    for t in (13.5, 14.0):  # past hold_limit (12 s): P ends it (X)
        x.step(t)
    assert x.failed == [("req-e", "ended_by_p")]
    assert x.p.counts.held_too_long == 1


def test_p_letting_its_request_go_ends_the_registration_matched_to_it():
    x = Link()
    handle, _ = x.register("req-f", 1.0)
    x.p.bind("p-req-f", "req-f", handle)  # matched; vLLM has not posted yet
    x.p.let_go("p-req-f", "req-f")  # P's lease expired first
    x.step(1.5)
    assert x.failed == [("req-f", "ended_by_p")]
    # vLLM's queues may still drive the WRITE: the gate refuses it now.
    x.p.bind("p-req-f", "req-f", handle)
    assert not x.p.begin_write("p-req-f", D_ENGINE, 1.6)


def test_a_write_whose_completion_never_comes_fails_the_load_after_the_write_bound():
    x = Link()
    handle, _ = x.register("req-g", 1.0)
    x.p.bind("p-req-g", "req-g", handle)
    assert x.p.begin_write("p-req-g", D_ENGINE, 1.0)
    assert x.p.write_done("p-req-g", 1.1)
    x.step(1.1)
    assert x.failed == []  # vLLM's notification may still come ...
    x.step(1.1 + x.config.write_bound + 0.1)
    assert x.failed == [("req-g", "written_unreported")]  # ... it did not


def test_no_clock_sample_of_d_no_write():
    config = PushConfig(12.0, capacity=4)
    d = DecodePushGuard(config, 4)
    p = PrefillPushGuard(config, 4, hold_limit=12.0)
    permit = d.register("req-h", P_ENGINE, 1.0)
    assert not p.has_clock(D_ENGINE)
    assert p.register(D_ENGINE, permit, "req-h", True, 1.0) == (None, "no_clock")


def test_bad_permit_bytes_are_dropped_and_counted_never_raised():
    x = Link()
    for bad in ("", "zz" * 20, "0" * 39, "\u00e9" * 40):
        assert x.p.register(D_ENGINE, bad, "req-i", True, 1.0) == (None, "malformed")
    assert x.p.counts.dropped == 4
    x.d.on_messages([(P_AGENT, b"PEND:not hex"), ("unknown-agent", b"PHB:")], SKEW + 1.0)
    assert x.d.counts.malformed == 2


def test_a_revocation_before_the_registration_left_means_it_never_leaves():
    x = Link()
    x.d.revoke("req-j")
    assert x.d.register("req-j", P_ENGINE, SKEW + 1.0) is None  # the worker fails the load


def test_out_of_permits_or_peer_ids_the_push_cannot_be_guarded():
    d = DecodePushGuard(PushConfig(12.0, capacity=1), max_peers=1)
    assert d.register("r1", P_ENGINE, 1.0) is not None
    assert d.register("r2", P_ENGINE, 1.0) is None  # no permit free
    assert d.register("r3", "another-p", 1.0) is None  # no peer id free
    names = PeerNames(2)
    assert [names.id_of("a"), names.id_of("b"), names.id_of("c"), names.id_of("a")] == [0, 1, None, 0]


def test_the_tap_hands_guard_messages_over_with_their_sender_and_keeps_the_rest():
    class Agent:
        def __init__(self) -> None:
            self.sent: list = []

        def get_new_notifs(self):
            return {P_AGENT: [b"PEND:x", b"req-1:1", b"HB:req-2"], D_AGENT: [b"PRV:y"]}

        def send_notif(self, name, notif_msg):
            self.sent.append((name, notif_msg))

    seen: list = []
    drains: list = []
    tap = NotifTap(Agent(), seen.extend, lambda: drains.append(1))
    tap.replay(b"PUSH_REG:...")
    out = tap.get_new_notifs()
    assert out == {P_AGENT: [b"req-1:1", b"HB:req-2"], REPLAY: [b"PUSH_REG:..."]}
    assert seen == [(P_AGENT, b"PEND:x"), (D_AGENT, b"PRV:y")]
    assert drains == [1]
    tap.send_notif("x", notif_msg=b"m")  # every other call is the agent's
    assert tap.agent.sent == [("x", b"m")]


def test_the_handshake_capture_keeps_each_replys_clock_round():
    class Sock:
        def send(self, msg):
            return None

        def recv_multipart(self):
            return [b"payload", msgspec.msgpack.encode(1234.5)]

    with handshake_adverts.capturing() as (replies, rounds):
        sock = handshake_adverts._ReplyRecorder(Sock(), replies, rounds)
        sock.send(b"q")
        sock.recv_multipart()
    assert replies == [b"payload"]
    (r,) = rounds
    assert r.remote == 1234.5 and r.sent <= r.received


def test_the_handshake_payload_says_whether_p_speaks_the_guard():
    payload = KvLeaseHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"",
                                      kv_push_guard=1)
    assert handshake_adverts.push_guard(msgspec.msgpack.encode(payload)) == 1
    stock = KvLeaseHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"")
    assert handshake_adverts.push_guard(msgspec.msgpack.encode(stock)) == 0
    assert handshake_adverts.push_guard(b"\xff not msgpack") == 0


def test_the_permit_rides_in_vllms_registration_dict():
    x = Link()
    reg = {"request_id": "req-k", "remote_engine_id": P_ENGINE}
    sent = {**reg, PERMIT_KEY: x.d.register("req-k", P_ENGINE, SKEW + 1.0)}
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(sent))
    handle, refusal = x.p.register(D_ENGINE, back[PERMIT_KEY], "req-k", True, 1.0)
    assert refusal is None and handle is not None


def test_the_guards_take_calls_from_two_threads():
    x = Link(duration=60.0, capacity=256)
    errors: list = []

    def writer() -> None:
        try:
            for i in range(200):
                x.register(f"w-{i}", 1.0 + i * 0.001)
        except Exception as e:  # pragma: no cover - the assertion reports it
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    for i in range(200):
        x.step(1.0 + i * 0.001)
    t.join()
    assert errors == [] and x.failed == []

