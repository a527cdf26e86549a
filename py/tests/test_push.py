"""Push mode's guard from Python: D grants a write permit with each
registration, P posts its WRITE only through the gate, and every push ends
(written, refused, revoked or lapsed) with D told exactly once.

The two sides run in one process here; in an engine the bytes of ``poll``
and ``on_message`` travel as NIXL notifications, and the registration field
with vLLM's ``PUSH_REG``. D's clock reads 1,000 s more than P's.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlease
from kvlease import ClockEstimate, PushConfig, PushError, PushPermits, PushWrites, WireError

P_PEER = 5  # D's name for P
D_PEER = 3  # P's name for D
SKEW = 1000.0  # D's clock minus P's


class Pair:
    """One D and one P with a perfect network, stepped by hand."""

    def __init__(self, duration: float = 12.0, **kw) -> None:
        self.config = PushConfig(duration, capacity=8, **kw)
        self.d = PushPermits(self.config, seed=7)
        self.p = PushWrites(self.config, hash_key=11)
        self.clock = ClockEstimate()
        # One round trip at P's 0.998 -> 1.0, D answering at its 1000.999.
        assert self.clock.observe(0.998, 0.999 + SKEW, 1.0) == "adopted"
        self.ended: list[tuple[int, int, int, str]] = []

    def register(self, t: float, live: bool = True):
        slot, nonce, field = self.d.register(P_PEER, t + SKEW)
        handle, refusal = self.p.register(D_PEER, field, live, self.clock, t)
        return (slot, nonce), handle, refusal

    def step(self, t: float) -> None:
        """P's step, its messages to D, D's step, its messages to P."""
        for peer, msg in self.p.poll({D_PEER: self.clock}, t):
            assert peer == D_PEER
            self.ended += self.d.on_message(P_PEER, msg, t + SKEW)
        to_p, fenced = self.d.poll(t + SKEW)
        self.ended += fenced
        for peer, msg in to_p:
            assert peer == P_PEER
            self.p.on_message(D_PEER, msg)


def test_a_write_that_lands_is_a_loaded_push():
    x = Pair()
    (slot, nonce), handle, refusal = x.register(1.0)
    assert refusal is None and handle is not None
    assert x.p.begin_write(handle, x.clock, 1.1) is None  # post the WRITE now
    assert x.p.begin_write(handle, x.clock, 1.1) == "already_posted"
    assert x.p.write_done(handle, True, 1.2)
    x.step(1.2)
    assert x.ended == [(slot, nonce, P_PEER, "written")]
    assert x.d.live == 0
    assert x.p.counters()["written"] == 1


def test_a_registration_after_p_let_the_request_go_is_refused_at_once():
    x = Pair()
    (slot, nonce), handle, refusal = x.register(30.0, live=False)
    assert (handle, refusal) == (None, "request_gone")
    x.step(30.0)
    # D frees on P's answer, not at a deadline 12 s away.
    assert x.ended == [(slot, nonce, P_PEER, "refused")]


def test_d_aborts_while_the_write_is_in_flight_and_waits_for_it():
    x = Pair()
    (slot, nonce), handle, _ = x.register(1.0)
    assert x.p.begin_write(handle, x.clock, 1.0) is None
    x.d.revoke(slot, nonce)
    for t in (1.5, 2.0, 3.0):  # P hears the revocation; the WRITE still flies
        x.step(t)
    assert x.ended == [], "no end while a WRITE of P can still land"
    assert x.p.write_done(handle, False, 3.5)
    x.step(3.5)
    assert x.ended == [(slot, nonce, P_PEER, "revoked")]


def test_a_dead_p_is_waited_out_to_the_fence_and_no_longer():
    x = Pair()
    (slot, nonce), handle, _ = x.register(1.0)
    assert handle is not None
    deadline = x.d.deadline(slot, nonce)
    fence = x.d.fence(deadline)
    assert fence == pytest.approx(deadline + x.config.write_bound, abs=0.01)
    # P dies: from now on only D steps.
    _, ended = x.d.poll(fence - 0.5)
    assert ended == []
    _, ended = x.d.poll(fence)
    assert ended == [(slot, nonce, P_PEER, "lapsed")]
    assert x.d.counters()["lapsed"] == 1


def test_p_heartbeats_renew_the_permit_while_it_holds_it():
    x = Pair()
    (slot, nonce), handle, _ = x.register(1.0)
    first = x.d.deadline(slot, nonce)
    for t in range(2, 40):  # P holds it, never writes; its PHB: renew D's permit
        x.step(float(t))
    assert x.d.deadline(slot, nonce) > first + 20
    assert x.d.counters()["renewed"] > 0 and x.ended == []


def test_no_clock_estimate_means_no_write():
    x = Pair()
    slot, nonce, field = x.d.register(P_PEER, 1.0 + SKEW)
    handle, refusal = x.p.register(D_PEER, field, True, ClockEstimate(), 1.0)
    assert (handle, refusal) == (None, "no_clock")


def test_out_of_permits_fails_the_load():
    x = Pair()
    for _ in range(8):
        x.d.register(P_PEER, 1.0 + SKEW)
    with pytest.raises(PushError) as e:
        x.d.register(P_PEER, 1.0 + SKEW)
    assert e.value.reason == "Exhausted"


def test_the_push_keys_are_parsed_once_with_the_rest():
    # What the vLLM plugin does: one parse, in Rust, of every kv_lease_* key.
    config = kvlease.LeaseConfig.parse(
        {"kv_lease_duration": 45.5, "kv_lease_push_write_bound": 4.5,
         "kv_lease_push_capacity": 64}, 1024, 64)
    assert config.unknown_keys == []
    push = config.push_config()
    assert (push.duration, push.write_bound, push.capacity) == (45.5, 4.5, 64)
    # One derivation: the pull side's floors, 7 s and 30 s of 45.5 s.
    assert (push.heartbeat_interval, push.extension) == (7.0, 30.0)
    assert (push.heartbeat_interval, push.extension) == (
        config.heartbeat_interval, config.lease_extension)
    for bad in ({"kv_lease_push_write_bound": "ten"}, {"kv_lease_push_capacity": 0},
                {"kv_lease_push_capacity": True}):
        with pytest.raises(kvlease.ConfigError, match=next(iter(bad))):
            kvlease.LeaseConfig.parse(bad, 1024, 64)


def test_bad_settings_and_bad_bytes_are_typed_errors():
    with pytest.raises(kvlease.ConfigError):
        PushConfig(12.0, heartbeat_interval=9.0)  # not shorter than the extension
    with pytest.raises(ValueError):
        PushConfig(-1.0)
    x = Pair()
    with pytest.raises(WireError):
        x.p.register(D_PEER, b"not forty hex digits", True, x.clock, 1.0)
    with pytest.raises(WireError):
        x.d.on_message(P_PEER, b"PEND:zz", 1.0 + SKEW)
    with pytest.raises(TypeError):
        x.p.on_message(D_PEER, "PRV:")  # str is not bytes
    with pytest.raises(ValueError):
        x.d.revoke(0, 0)  # nonce 0 names no permit


@settings(max_examples=1500, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.binary(max_size=200).map(lambda b: b"PEND:" + b),
                 st.binary(max_size=200).map(lambda b: b"PHB:" + b),
                 st.binary(max_size=200).map(lambda b: b"PRV:" + b),
                 st.binary(max_size=200).map(lambda b: b"PRN:" + b)))
def test_random_bytes_are_a_typed_error_or_nothing(msg):
    x = Pair()
    x.register(1.0)
    for call in (lambda: x.d.on_message(P_PEER, msg, 2.0 + SKEW),
                 lambda: x.p.on_message(D_PEER, msg),
                 lambda: x.p.register(D_PEER, msg, True, x.clock, 2.0)):
        try:
            call()
        except WireError:
            pass
    x.step(3.0)
