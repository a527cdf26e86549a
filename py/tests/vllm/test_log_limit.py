"""Per-request warnings under overload are rate-limited, and the counters
stay exact (issue 28, 3.8): a burst of 10,000 events of a kind logs a bounded
number of lines while the stat counts 10,000."""

from __future__ import annotations

import logging
import queue
import time
from unittest.mock import patch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

import kvlease
from kvlease.vllm.load_checks import LeaseRead
from kvlease.vllm.log_limit import LOG_INTERVAL_S, RateLimitedLog
from kvlease.vllm.prefill_leases import PrefillLeases
from kvlease.vllm.stats import KvLeaseConnectorStats
from kvlease.vllm.worker import KvLeaseWorker

BURST = 10_000
#: Lines a burst may write: one per kind, plus slack for an interval that
#: ends during the burst on a slow machine.
MAX_LINES = 5


class Lines(logging.Handler):
    """Collects what one logger writes (vLLM's "vllm" logger does not
    propagate to the root, so caplog would not see it)."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.DEBUG)
        self.logger = logging.getLogger(name)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "Lines":
        self.logger.addHandler(self)
        self._level = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)

    def count(self, text: str) -> int:
        return sum(text in m for m in self.messages)


def test_one_line_per_interval_per_kind_and_the_next_says_how_many():
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("kvlease.test.limit"), interval=10.0, clock=lambda: now[0])
    with Lines("kvlease.test.limit") as lines:
        written = sum(log.warning("a", "event %d", i) for i in range(BURST))
        assert log.warning("b", "other kind")  # kinds are limited apart
        now[0] = 10.0
        assert log.warning("a", "event %d", BURST)
    assert written == 1
    assert lines.messages[0] == "event 0"
    assert lines.messages[1] == "other kind"
    assert lines.messages[2].startswith(f"event {BURST} (and {BURST - 1} more like it")
    assert len(lines.messages) == 3


def test_a_burst_of_expiries_logs_a_few_lines_and_counts_every_one():
    config = kvlease.LeaseConfig.parse({"kv_lease_duration": 6, "kv_lease_slots": BURST}, 64, 8)
    now = time.monotonic()
    p = PrefillLeases(config, 1, now)
    rank = kvlease.PrefillRank(config, 0, now)
    for i in range(BURST):
        p.on_scheduled(f"r{i}")
    p.assign_scheduled(now)
    for i in range(BURST):
        assert p.finished(f"r{i}", True, {}, now) == "held"
    rank.apply_directives(p.directives(now), now)
    rank.poll(now + 60)  # no heartbeat: every lease lapses on the rank
    with Lines("vllm.kvlease.prefill") as lines:
        p.apply_reports([(0, rank.encode_reports())])
        released = p.release(None)
    assert len(released) == BURST
    assert p.stats.lease_total("kv_lease_expired") == BURST
    assert sum(p.stats.data["num_kv_expired_reqs"]) == BURST
    assert 1 <= lines.count("expired (no heartbeat") <= MAX_LINES, len(lines.messages)


def test_a_burst_without_free_slots_logs_a_few_lines_and_counts_every_one():
    config = kvlease.LeaseConfig.parse({"kv_lease_duration": 6, "kv_lease_slots": 1}, 64, 8)
    now = time.monotonic()
    p = PrefillLeases(config, 1, now)
    for i in range(BURST + 1):
        p.on_scheduled(f"r{i}")
    with Lines("vllm.kvlease.prefill") as lines:
        p.assign_scheduled(now)
    assert p.stats.lease_total("kv_lease_unslotted") == BURST
    assert 1 <= lines.count("no lease for request") <= MAX_LINES, len(lines.messages)


class FailingChecks:
    """A D worker's checker whose every check failed (a lapse storm)."""

    def __init__(self, n: int) -> None:
        self.recording: dict = {}
        self._out = [
            (LeaseRead(request_id=f"d{i}", remote_request_id=f"p{i}", fields=(1, 7), blocks=[i]), "lapsed")
            for i in range(n)
        ]

    def step(self, agent, now):
        out, self._out = self._out, []
        return out


class NoAgent:
    def send_notif(self, *a, **kw):
        return None


def test_a_burst_of_failed_checks_logs_a_few_lines_and_counts_every_one():
    w = object.__new__(KvLeaseWorker)
    w._kvl_checks = FailingChecks(BURST)
    w._kvl_log = RateLimitedLog(logging.getLogger("vllm.kvlease.worker"))
    w._invalid_block_ids = queue.Queue()
    w.xfer_stats = KvLeaseConnectorStats()
    w.nixl_wrapper = NoAgent()
    empty = KVConnectorTransferResults(set(), set(), set())
    with Lines("vllm.kvlease.worker") as lines, patch.object(
        NixlPullConnectorWorker, "get_transfer_results", lambda self: empty
    ):
        results = w.get_transfer_results()
    assert len(results.failed_recving) == BURST == len(results.finished_recving)
    assert w._invalid_block_ids.qsize() == BURST
    assert w.xfer_stats.lease_total("kv_lease_failed_checks") == BURST
    assert 1 <= lines.count("failed its lease check") <= MAX_LINES, len(lines.messages)


def test_the_limit_is_time_not_a_count():
    # A steady trickle of one per interval logs every line.
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("kvlease.test.limit"), clock=lambda: now[0])
    for i in range(5):
        now[0] = i * LOG_INTERVAL_S
        assert log.warning("expired", "event %d", i)

