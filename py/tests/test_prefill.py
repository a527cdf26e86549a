"""The P roles from Python, the way a vLLM connector drives them: the
scheduler's directives to every worker as bytes, each worker's reports back
as bytes."""

from __future__ import annotations

import json

import pytest

import kvlease
from kvlease import GrantError, IpcError, PrefillRank, PrefillScheduler, WireError


def engine(config, clock, ranks=2):
    sched = PrefillScheduler(config, ranks, clock.now)
    workers = [PrefillRank(config, r, clock.now) for r in range(ranks)]
    return sched, workers


def step(sched, workers, now, lose=()):
    """The backstop, directives down, poll, reports up, releases drained."""
    sched.poll(now)
    msg = sched.encode_directives(now)
    for w in workers:
        if w.rank not in lose:
            w.apply_directives(msg, now)
        w.poll(now)
    for w in workers:
        sched.apply_reports(w.rank, w.encode_reports())
    return sched.drain_released()


def test_the_nonce_is_in_every_slot_before_the_params_leave(config, clock):
    sched, workers = engine(config, clock)
    slot, nonce = sched.assign("cmpl-1", clock.now)
    assert 0 < nonce < 2**53, "exact as a double (a float64 router), and int64-safe"
    step(sched, workers, clock.now)
    assert all(w.slot_word(slot) == nonce for w in workers)
    assert sched.start("cmpl-1", clock.now) == pytest.approx(clock.now + 30)
    assert sched.status("cmpl-1") == "held"


def test_lease_fields_survive_a_float64_router(config, clock):
    """A router that decodes JSON numbers as float64 (llm-d's Go sidecar,
    JavaScript proxies) and writes them back: every exported nonce comes
    back the same integer, and the read-done D sends with it releases the
    lease. (With nonces drawn up to 2^63, most came back changed.)"""
    sched, workers = engine(config, clock, ranks=1)
    w = workers[0]
    routed_leases = []
    for i in range(config.lease_capacity):
        rid = f"cmpl-{i}"
        slot, nonce = sched.grant(rid, clock.now)
        params = {"remote_lease_slot": slot, "remote_lease_nonce": nonce}
        routed = json.loads(json.dumps(params), parse_int=float)
        assert type(routed["remote_lease_nonce"]) is float
        back = {k: int(v) for k, v in routed.items()}
        assert back == params, f"{rid}: {nonce} came back as {back['remote_lease_nonce']}"
        routed_leases.append((rid, back["remote_lease_slot"], back["remote_lease_nonce"]))
    step(sched, workers, clock.now)
    for rid, slot, nonce in routed_leases:
        assert w.slot_word(slot) == nonce
        done = kvlease.encode_read_done(rid, 1, nonce, True)
        assert w.on_notification("decode-0", done, clock.now)[2] == "share_released"
    released = step(sched, workers, clock.now)
    assert {r[0] for r in released if r[2] == "read_done"} == {r[0] for r in routed_leases}


def test_read_dones_from_each_reader_release_and_the_slot_comes_back(config, clock):
    sched, workers = engine(config, clock)
    slot, nonce = sched.grant("cmpl-1", clock.now)
    step(sched, workers, clock.now)
    done = kvlease.encode_read_done("cmpl-1", 1, nonce, True)
    for w in workers:
        assert w.on_notification("decode-0", done, clock.now) == (0, 0, "share_released")
        assert w.slot_word(slot) == 0, "zeroed before the report"
    released = step(sched, workers, clock.now)
    assert [(r[0], r[1], r[2]) for r in released] == [("cmpl-1", nonce, "read_done")]
    ticket = released[0][3]
    assert ticket.slot == slot
    sched.blocks_freed(ticket)
    with pytest.raises(ValueError):
        sched.blocks_freed(ticket)
    assert sched.held == 0


def test_a_duplicated_read_done_counts_once_per_sender(config, clock):
    sched, workers = engine(config, clock, ranks=1)
    _, nonce = sched.grant("cmpl-1", clock.now)
    step(sched, workers, clock.now)
    w = workers[0]
    two = kvlease.encode_read_done("cmpl-1", 2, nonce, True)
    assert w.on_notification("decode-0", two, clock.now)[2] == "counted"
    assert w.on_notification("decode-0", two, clock.now)[2] == "duplicate_sender"
    assert w.on_notification("decode-1", two, clock.now)[2] == "share_released"


def test_heartbeats_renew_and_silence_expires(config, clock):
    sched, workers = engine(config, clock)
    sched.grant("cmpl-1", clock.now)
    step(sched, workers, clock.now)
    for _ in range(6):
        now = clock.advance(10)
        for w in workers:
            assert w.on_notification("decode-0", b"HB:cmpl-1,unknown", now)[:2] == (1, 1)
        assert step(sched, workers, now) == []
    now = clock.advance(21)
    released = step(sched, workers, now)
    assert [(r[0], r[2]) for r in released] == [("cmpl-1", "expired")]


def test_a_rank_that_missed_its_grant_answers_not_held_so_cancel_ends_the_lease(config, clock):
    sched, workers = engine(config, clock)
    sched.grant("cmpl-1", clock.now)
    step(sched, workers, clock.now, lose={1})
    step(sched, workers, clock.advance(600))
    assert sched.held == 1
    assert sched.cancel("cmpl-1")
    released = step(sched, workers, clock.now)
    assert [(r[0], r[2]) for r in released] == [("cmpl-1", "not_held")]
    assert sched.counters()["not_held"] == 1


def test_the_backstop_ends_a_lease_whose_grant_a_rank_lost_without_a_cancel(config, clock):
    sched, workers = engine(config, clock)
    sched.grant("cmpl-1", clock.now)
    step(sched, workers, clock.now, lose={1})
    step(sched, workers, clock.advance(31))  # rank 0 expires; rank 1 never held it
    step(sched, workers, clock.advance(1))  # the scheduler's next poll sees it
    assert sched.held == 1
    step(sched, workers, clock.advance(29))
    assert sched.held == 1, "a lease duration after rank 0 let go, not before"
    released = step(sched, workers, clock.advance(1))
    assert [(r[0], r[2]) for r in released] == [("cmpl-1", "not_held")]
    assert sched.counters()["backstop_probes"] == 1
    assert sched.counters()["backstop_cancels"] == 0


def test_refusals_are_typed_exceptions(config, clock):
    sched, workers = engine(config, clock)
    with pytest.raises(GrantError) as e:
        sched.assign("", clock.now)
    assert e.value.reason == "BadId"
    sched.assign("x", clock.now)
    with pytest.raises(GrantError) as e:
        sched.assign("x", clock.now)
    assert e.value.reason == "Duplicate"
    with pytest.raises(IpcError):
        workers[0].apply_directives(b"\x00" * 40, clock.now)
    with pytest.raises(IpcError):
        sched.apply_reports(0, b"garbage")
    with pytest.raises(WireError) as e:
        workers[0].on_notification("d", b"no colon here", clock.now)
    assert e.value.reason == "UnknownPrefix"
    with pytest.raises(ValueError):
        sched.assign("y", float("nan"))
    with pytest.raises(kvlease.StartError):
        sched.start("never", clock.now)


def test_the_slot_array_is_there_to_register(config, clock):
    w = PrefillRank(config, 0, clock.now)
    assert w.slot_count == config.lease_slots
    assert w.slots_nbytes == 8 * w.slot_count
    assert w.slots_address > 0
    advert = kvlease.lease_advert(w.slots_address, w.slots_nbytes, w.slot_count)
    assert len(advert) == 32
    assert kvlease.decode_lease_advert(advert) == (w.slots_address, w.slots_nbytes, w.slot_count)


def test_buffers_of_every_kind_are_taken(config, clock):
    sched, workers = engine(config, clock, ranks=1)
    sched.grant("cmpl-1", clock.now)
    msg = sched.encode_directives(clock.now)
    assert workers[0].apply_directives(memoryview(bytearray(msg)), clock.now) == (1, 0, 0)
    hb = bytearray(b"HB:cmpl-1")
    assert workers[0].on_notification("d", hb, clock.now)[0] == 1
