"""Random bytes into every entry point that takes outside input: a typed
exception or a result, never a crash of the interpreter."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlease
from kvlease import KvLeaseError

SETTINGS = settings(
    max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
OK_ERRORS = (KvLeaseError, ValueError, TypeError, OverflowError)

# Small capacities: every example builds fresh roles.
CONFIG = kvlease.LeaseConfig.parse({"kv_lease_max_tracked_requests": 256}, 64, 8)


def prefixed(prefix: bytes):
    return st.binary(max_size=300).map(lambda b: prefix + b)


messages = st.one_of(
    st.binary(max_size=400),
    prefixed(b"HB:"),
    prefixed(b"HBC:"),
    prefixed(b"HBP:"),
    prefixed(b"KVLR"),  # role-message magic-ish starts
    st.text(max_size=200).map(str.encode),
)


@SETTINGS
@given(messages, st.text(max_size=40))
def test_rank_inputs(msg, sender):
    rank = kvlease.PrefillRank(CONFIG, 0, 1.0)
    for call in (
        lambda: rank.on_notification(sender, msg, 2.0),
        lambda: rank.apply_directives(msg, 2.0),
    ):
        try:
            call()
        except OK_ERRORS:
            pass
    rank.poll(1000.0)
    rank.encode_reports()


@SETTINGS
@given(messages, st.integers(min_value=0, max_value=70))
def test_scheduler_and_tracker_inputs(msg, rank):
    sched = kvlease.PrefillScheduler(CONFIG, 2, 1.0)
    tracker = kvlease.HeartbeatTracker(CONFIG, 2)
    for call in (
        lambda: sched.apply_reports(rank, msg),
        lambda: tracker.apply_outcomes(msg),
        lambda: kvlease.decode_outcomes(msg),
        lambda: kvlease.decode_notification(msg),
        lambda: kvlease.decode_lease_advert(msg),
        lambda: kvlease.advert_accepts_compact_heartbeats(msg),
    ):
        try:
            call()
        except OK_ERRORS:
            pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@SETTINGS
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "kv_lease_duration",
                "kv_lease_verification",
                "kv_lease_slots",
                "kv_lease_max_hold",
                "kv_lease_max_pin",
                "kv_lease_max_fan_out",
                "decoder_kv_blocks_ttl",
                "other",
            ]
        ),
        json_values,
        max_size=4,
    )
)
def test_config_inputs(extra):
    try:
        kvlease.LeaseConfig.parse(extra, 64, 8)
    except OK_ERRORS:
        pass


@SETTINGS
@given(st.dictionaries(st.text(max_size=20), json_values, max_size=12), st.text(max_size=30))
def test_tracker_params(params, request_id):
    tracker = kvlease.HeartbeatTracker(CONFIG, 1)
    try:
        tracker.on_new_request(request_id, params, 1.0)
    except OK_ERRORS:
        pass


@SETTINGS
@given(
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=6),
    st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**63 - 1)),
    st.one_of(st.none(), st.integers(min_value=0, max_value=2**32 - 1)),
)
def test_slot_checker_inputs(peers, nonce, slot):
    checker = kvlease.SlotChecker(CONFIG, 4, 2)
    checker.add_peer("p0", 64)
    for call in (
        lambda: checker.submit(1, slot, nonce, peers),
        lambda: checker.complete(abs(peers[0]) if peers else 0, True),
    ):
        try:
            call()
        except OK_ERRORS:
            pass
    checker.step(1.0)
    checker.take_reads()


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(), st.integers()), max_size=40),
    st.integers(min_value=-1, max_value=2**70),
)
def test_compact_heartbeat_encoding_refuses_or_round_trips(entries, max_len):
    try:
        msgs = kvlease.encode_compact_heartbeats(entries, max_len)
    except OK_ERRORS:
        return
    assert all(len(m) <= max_len for m in msgs)
    assert [e for m in msgs for e in kvlease.decode_notification(m)[1]] == entries
