"""Push mode's guard in a fleet, told from the engine's side: engines that
restart with new ids (the peer tables), Ds that die (P's clock asks), a D
whose first handshake gave no clock reading, a D worker whose clock is not
its scheduler's (the permits' clock), and the notification tap when
kvlease's own hook fails. vLLM's threads and NIXL are replaced by plain
calls, as in ``test_push_guard.py``; each test names the defect it pins
(issue 37, issue 38 items 5 and 10).
"""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)

from kvlease import PushConfig
from kvlease.vllm.handshake_adverts import ClockRound
from kvlease.vllm.push_clocks import CLOCK_RESAMPLE_S, MAX_FAILED_ASKS, NO_SAMPLE_RETRY_S
from kvlease.vllm.push_notifs import NotifTap
from kvlease.vllm.push_permits import DecodePushGuard
from kvlease.vllm.push_worker import KvLeasePushWorker
from kvlease.vllm.push_writes import PrefillPushGuard
from kvlease.vllm.scheduler_clock import SchedulerClock

SKEW = 500.0  # D's (scheduler's) clock minus P's
MAX_PEERS = 4


def sample(t: float, skew: float = SKEW) -> list[ClockRound]:
    """One handshake's clock round at P's time ``t`` (2 ms round trip)."""
    return [ClockRound((t - 0.002, t - 0.001 + skew, t))]


def push_once(d: DecodePushGuard, p: PrefillPushGuard, rid: str, p_engine: str,
              d_engine: str, t: float) -> list[tuple[str, str]]:
    """One guarded push from D to P at P's time ``t``, written and
    answered; returns what D ended (``[(rid, "written")]`` is not failed)."""
    permit = d.register(rid, p_engine, t + SKEW)
    assert permit is not None, f"{rid}: D could not guard the push to {p_engine}"
    handle, refusal = p.register(d_engine, permit, rid, True, t)
    assert refusal is None, f"{rid}: P refused it ({refusal})"
    p.bind("p-" + rid, rid, handle)
    assert p.begin_write("p-" + rid, d_engine, t + 0.01)
    assert p.write_done("p-" + rid, t + 0.02)
    ended = []
    for engine, msg in p.poll(t + 0.03):
        assert engine == d_engine
        ended += d.on_messages([(f"{p_engine}/agent", msg)], t + 0.04 + SKEW)
    d.received(rid)
    return ended


def meet(d: DecodePushGuard, p: PrefillPushGuard, p_engine: str, d_engine: str,
         t: float, skew: float = SKEW) -> None:
    """The handshakes: D learns P speaks the guard; P samples D's clock
    (``skew`` ahead of P's)."""
    d.note_p(p_engine, 1)
    d.peers.note_agents(p_engine, [f"{p_engine}/agent"])
    p.peers.note_agents(d_engine, [f"{d_engine}/agent"])
    p.observe_clock(d_engine, sample(t, skew), t)
    p.note_address(d_engine, "10.0.0.1", 5600, t)


# -- issue 37: the push peer tables let a peer go --------------------------------


def test_a_long_lived_d_guards_the_pushes_of_ten_times_max_peers_p_restarts():
    """Before: D kept every P engine id for good, and the fifth P engine
    (``kv_lease_max_peers`` 4 here) found no peer id: its pushes failed."""
    config = PushConfig(12.0, capacity=16)
    d = DecodePushGuard(config, max_peers=MAX_PEERS, seed=1)
    t = 1.0
    for restart in range(10 * MAX_PEERS):
        p_engine = f"p-engine-{restart}"  # a new id at every restart
        p = PrefillPushGuard(config, max_peers=MAX_PEERS, hold_limit=12.0)
        meet(d, p, p_engine, "d-engine", t)
        ended = push_once(d, p, f"req-{restart}", p_engine, "d-engine", t)
        assert ended == [], "written: the load is vLLM's, D fails nothing"
        vllm_forgets = restart % 2 == 0  # vLLM evicts half of them (engine_ttl)
        if vllm_forgets:
            d.forget_engine(p_engine)
        assert len(d.peers) <= MAX_PEERS
        t += 1.0
    assert d.counts.written == 10 * MAX_PEERS and d.live == 0
    assert d.peers.table_full == 0
    assert d.peers.released == 10 * MAX_PEERS - len(d.peers)


def test_an_engine_whose_id_was_given_up_is_still_heard_when_it_speaks_again():
    """vLLM does not handshake again with an engine it still knows: one
    whose peer id went idle and was given up gets a new id, and its agents'
    answers still reach D."""
    config = PushConfig(12.0, capacity=16)
    d = DecodePushGuard(config, max_peers=2, seed=2)
    first = PrefillPushGuard(config, max_peers=2, hold_limit=12.0)
    meet(d, first, "p-first", "d-engine", 1.0)
    assert push_once(d, first, "req-a", "p-first", "d-engine", 1.0) == []
    for i in range(3):  # two more P engines push, and take both ids
        other = PrefillPushGuard(config, max_peers=2, hold_limit=12.0)
        meet(d, other, f"p-other-{i}", "d-engine", 2.0 + i)
        assert push_once(d, other, f"req-o{i}", f"p-other-{i}", "d-engine", 2.0 + i) == []
    assert d.peers.get("p-first") is None, "its id was given up"
    assert push_once(d, first, "req-b", "p-first", "d-engine", 10.0) == []
    assert d.counts.written == 5


def test_when_every_peer_id_is_in_use_a_new_engine_fails_closed_until_one_is_free():
    config = PushConfig(12.0, capacity=16)
    d = DecodePushGuard(config, max_peers=2, seed=3)
    for p_engine in ("p-a", "p-b"):
        d.note_p(p_engine, 1)
        assert d.register(f"open-{p_engine}", p_engine, 1.0) is not None
    d.note_p("p-c", 1)
    assert d.register("req-c", "p-c", 1.0) is None, "no id may be taken from a live permit"
    assert d.peers.table_full == 1
    # p-a's permit ends at its fence (P never answered): its id is free.
    _sends, ended = d.poll(1.0 + 12.0 + 10.0 + 0.1)
    assert sorted(r for r, _ in ended) == ["open-p-a", "open-p-b"]
    assert d.register("req-c", "p-c", 30.0) is not None


def test_a_long_lived_p_answers_the_registrations_of_ten_times_max_peers_d_restarts():
    """Before: P kept every D engine id for good; from the fifth D on it
    dropped each registration ("no_peer") without an answer, and D waited
    for its fence and failed the load."""
    config = PushConfig(12.0, capacity=16)
    p = PrefillPushGuard(config, max_peers=MAX_PEERS, hold_limit=12.0)
    t = 1.0
    for restart in range(10 * MAX_PEERS):
        d_engine = f"d-engine-{restart}"
        d = DecodePushGuard(config, max_peers=MAX_PEERS, seed=restart)
        meet(d, p, "p-engine", d_engine, t)
        assert push_once(d, p, f"req-{restart}", "p-engine", d_engine, t) == []
        # P keeps an ended registration until its deadline surely passed
        # (a copy must be answered the same): a D's id is free after that.
        t += 13.0
        p.poll(t)
        p.forget_engine(f"d-engine-{restart - 2}")  # vLLM's engine_ttl, later
        assert len(p.peers) <= MAX_PEERS
        assert len(p.clocks) <= 3, "clocks go with vLLM's engines"
    assert p.peers.table_full == 0 and p.counts.dropped == 0
    assert p.counters()["written"] == 10 * MAX_PEERS


# -- issue 37: dead Ds are not asked for their clock forever -----------------------


def test_dead_ds_are_asked_a_bounded_number_of_times_and_never_delay_a_live_one():
    """Before: every D engine P ever met was asked again every 60 s for
    good, on one thread where each ask of a dead D blocks 5 s: with more
    than 12 dead Ds the queue grew without bound and the live D's estimate
    went stale."""
    p = PrefillPushGuard(PushConfig(12.0, capacity=16), max_peers=64, hold_limit=12.0)
    dead = [f"dead-{i}" for i in range(20)]
    for engine in [*dead, "live"]:
        p.observe_clock(engine, sample(1.0), 1.0)
        p.note_address(engine, "10.0.0.2", 5600, 1.0)
    asks = {engine: 0 for engine in [*dead, "live"]}
    lanes: dict[str, set[str]] = {engine: set() for engine in asks}
    t = 1.0
    while t < 3600.0:
        t += 1.0
        due = p.due_resamples(t)
        assert len({engine for engine, *_ in due}) == len(due), "one ask per engine"
        for engine, _host, _port, lane in due:
            asks[engine] += 1
            lanes[engine].add(lane)
            answered = engine == "live"
            assert p.resampled(engine, sample(t) if answered else [], t + 5.0) == answered
    assert all(asks[engine] == MAX_FAILED_ASKS for engine in dead)
    assert asks["live"] >= 3600.0 / (CLOCK_RESAMPLE_S + 5.0) - 1
    assert lanes["live"] == {"fresh"}, "a live D is never asked behind dead ones"
    assert all(lanes[e] == {"fresh", "suspect"} for e in dead)
    assert p.clocks.stats()["given_up"] == 20
    # A handshake that succeeds again (vLLM met the engine anew) resumes it.
    p.note_address("dead-0", "10.0.0.2", 5600, t)
    p.observe_clock("dead-0", sample(t), t)
    assert "dead-0" in [e for e, *_ in p.due_resamples(t + CLOCK_RESAMPLE_S)]


def test_an_ask_in_flight_is_not_asked_again_and_a_quiet_drain_asks_nothing():
    p = PrefillPushGuard(PushConfig(12.0, capacity=16), max_peers=8, hold_limit=12.0)
    p.observe_clock("d", sample(0.0 + 1.0), 0.0)
    p.note_address("d", "10.0.0.3", 5600, 0.0)
    assert p.due_resamples(CLOCK_RESAMPLE_S - 0.1) == []
    assert [e for e, *_ in p.due_resamples(CLOCK_RESAMPLE_S)] == ["d"]
    assert p.due_resamples(CLOCK_RESAMPLE_S + 30.0) == [], "its ask has not come back"
    assert p.ask_clock_now("d") is None
    p.resampled("d", sample(CLOCK_RESAMPLE_S + 31.0), CLOCK_RESAMPLE_S + 31.0)
    assert p.due_resamples(CLOCK_RESAMPLE_S + 32.0) == []


# -- issue 38, item 10: a D whose first handshake gave no clock reading -------------


def test_a_d_whose_handshake_gave_no_clock_reading_is_asked_at_once():
    """Before: such a D was never asked again, so P refused each of its
    pushes for want of a clock, for good."""
    config = PushConfig(12.0, capacity=16)
    p = PrefillPushGuard(config, max_peers=8, hold_limit=12.0)
    d = DecodePushGuard(config, max_peers=8, seed=4)
    d.note_p("p-engine", 1)
    p.observe_clock("d-engine", [ClockRound((0.9, None, 1.1))], 1.1)  # no reading
    p.note_address("d-engine", "10.0.0.4", 5600, 1.1)
    assert not p.has_clock("d-engine")
    (due,) = p.due_resamples(1.1)
    assert due[0] == "d-engine"
    assert not p.resampled("d-engine", [], 2.0)  # unanswered: soon again
    assert p.due_resamples(2.0 + NO_SAMPLE_RETRY_S - 0.1) == []
    assert [e for e, *_ in p.due_resamples(2.0 + NO_SAMPLE_RETRY_S)] == ["d-engine"]
    assert p.resampled("d-engine", sample(4.5), 4.5)
    permit = d.register("req", "p-engine", 5.0 + SKEW)
    handle, refusal = p.register("d-engine", permit, "req", True, 5.0)
    assert refusal is None and handle is not None


# -- issue 37: the permits' clock is D's scheduler's, the one P samples ------------


#: D's scheduler's clock minus P's in :class:`SplitD` (boot times differ).
SPLIT_SKEW = 2e5


class SplitD:
    """A D whose worker runs on a host ``worker_ahead`` seconds ahead of its
    scheduler's, which P samples (the side channel runs in the scheduler).
    P's time is ``t``; the scheduler reads ``t + SPLIT_SKEW``."""

    def __init__(self, worker_ahead: float, rebase: bool) -> None:
        self.config = PushConfig(12.0, capacity=8)
        self.ahead = worker_ahead
        self.rebase = rebase
        self.d = DecodePushGuard(self.config, max_peers=4, seed=5)
        self.p = PrefillPushGuard(self.config, max_peers=4, hold_limit=60.0)
        meet(self.d, self.p, "p-engine", "d-engine", 0.5, SPLIT_SKEW)
        self.sched = SchedulerClock(self.config.drift_ppm)

    def d_now(self, t: float) -> float:
        """What D's guard is told the time is, at P's time ``t``."""
        worker = t + SPLIT_SKEW + self.ahead
        if not self.rebase:
            return worker  # the defect: the worker's own clock
        # Each step: the scheduler's reading, 3 ms in transit to the worker.
        self.sched.observe(t - 0.003 + SPLIT_SKEW, worker)
        now = self.sched.now(worker)
        assert now is not None and now <= t + SPLIT_SKEW, "never later than the scheduler's clock"
        return now

    def register(self, t: float):
        permit = self.d.register("req", "p-engine", self.d_now(t))
        handle, refusal = self.p.register("d-engine", permit, "req", True, t)
        if handle is not None:
            self.p.bind("p-req", "req", handle)
        return refusal

    def fenced_at(self, t0: float, t1: float) -> float | None:
        """P's time at which D's permit lapsed (P's heartbeats lost), None
        when it did not between ``t0`` and ``t1``."""
        t = t0
        while t <= t1:
            _sends, ended = self.d.poll(self.d_now(t))
            if ended:
                return t
            t += 0.25
        return None


@pytest.mark.parametrize("ahead", [1e5, -1e5])
def test_a_d_worker_on_another_clock_than_its_scheduler_is_guarded_end_to_end(ahead):
    x = SplitD(ahead, rebase=True)
    assert x.register(1.0) is None, "accepted"
    fence = x.fenced_at(1.0, 60.0)
    # D's fence, 12 s + 10 s (+ drift) after registering, on the true clock.
    assert fence is not None and 23.0 <= fence <= 23.5
    assert not x.p.begin_write("p-req", "d-engine", fence), "no WRITE at or past the fence"


def test_before_the_rebase_a_worker_behind_its_scheduler_had_every_push_refused():
    x = SplitD(-1e5, rebase=False)
    assert x.register(1.0) == "past_deadline"


def test_before_the_rebase_a_worker_ahead_of_its_scheduler_let_p_write_after_the_fence():
    x = SplitD(1e5, rebase=False)
    assert x.register(1.0) is None
    fence = x.fenced_at(1.0, 60.0)
    assert fence is not None and fence < 24.0
    # D freed the blocks at its fence; P's gate still let the WRITE through.
    assert x.p.begin_write("p-req", "d-engine", fence + 5.0)


def test_the_scheduler_clock_is_a_lower_bound_that_keeps_its_best_sample():
    c = SchedulerClock(drift_ppm=100)
    assert c.now(5.0) is None
    c.observe(0.0, 5.0)  # no reading stamped (vLLM's default): ignored
    assert c.now(5.0) is None
    c.observe(1000.0 - 0.5, 10.0)  # a step 0.5 s in transit
    c.observe(1000.0 + 1.0 - 0.001, 11.0)  # 1 ms in transit: the better one
    assert c.now(11.0) == pytest.approx(1001.0 - 0.001)
    c.observe(1000.0 + 2.0 - 3.0, 12.0)  # a 3 s stall: the older bound stays
    later = c.now(12.0)
    assert later is not None and 1001.998 < later <= 1002.0
    # An hour on, the kept bound has aged by at most the drift.
    assert c.now(3612.0) == pytest.approx(1000.0 + 3612.0 - 10.0 - 0.001 - 3600.0 * 1e-4, abs=1e-3)


# -- issue 38, item 5: the tap never costs vLLM a notification -----------------------


def test_an_exception_in_kvleases_hooks_costs_vllm_no_notification():
    """Before: the exception left the tap with NIXL's batch already taken:
    vLLM's completions, HB and PUSH_REG of that drain were lost."""

    class Agent:
        def get_new_notifs(self):
            return {"p-agent": [b"req-1:1", b"PEND:x", b"HB:req-2"], "d-agent": [b"PUSH_REG:y"]}

    def boom(*_args):
        raise RuntimeError("cannot schedule new futures after shutdown")

    tap = NotifTap(Agent(), boom, boom)
    out = tap.get_new_notifs()
    assert out == {"p-agent": [b"req-1:1", b"HB:req-2"], "d-agent": [b"PUSH_REG:y"]}
    assert tap.hook_failures == 2


# -- issue 37: vLLM's eviction of a remote engine reaches the guard -----------------


def test_vllms_eviction_of_a_remote_engine_clears_the_guards_state_of_it(monkeypatch):
    forgotten: list[str] = []
    monkeypatch.setattr(NixlPushConnectorWorker, "_cleanup_remote_engine",
                        lambda self, engine_id, log_eviction=True: forgotten.append(engine_id))
    config = PushConfig(12.0, capacity=8)
    w = object.__new__(KvLeasePushWorker)
    w._kvl_d = DecodePushGuard(config, max_peers=4, seed=6)
    w._kvl_p = PrefillPushGuard(config, max_peers=4, hold_limit=12.0)
    meet(w._kvl_d, w._kvl_p, "gone-engine", "gone-engine", 0.5)
    w._kvl_p.register("gone-engine", "0" * 40, "r", True, 0.5)  # any id use
    assert w._kvl_d.p_speaks_guard("gone-engine") and len(w._kvl_p.clocks) == 1
    w._cleanup_remote_engine("gone-engine")
    assert forgotten == ["gone-engine"]
    assert not w._kvl_d.p_speaks_guard("gone-engine")
    assert len(w._kvl_p.clocks) == 0 and len(w._kvl_p.peers) == 0
    assert w._kvl_p.peers.engine_of_agent("gone-engine/agent") is None
