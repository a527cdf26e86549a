"""Rate-limited log lines for per-request events.

Owns: deciding whether a log line of one kind is written now or suppressed,
and saying how many were suppressed in the next line written. May not count
events for the metrics: the callers record every event in their stats before
they log, so the counters stay exact whatever is suppressed here.

Why: the per-request warnings (no free slot, a lease expired, a failed
check) come in bursts exactly when the engine is busiest (a surge, D
overloaded, heartbeats lost); one line per request then floods the log and
costs the engine step time. One line per kind per interval, naming one
request and the number of others, keeps the log readable and cheap; the
counters (``stats.py``, Prometheus) have the exact figures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

#: At most one line of a kind per this many seconds.
LOG_INTERVAL_S = 10.0


class RateLimitedLog:
    """At most one line per ``interval`` seconds for each kind of event; the
    next line written for a kind says how many of that kind were suppressed
    since the last one. Times are ``clock()`` seconds (monotonic)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        #: kind -> when its next line may be written.
        self._next: dict[str, float] = {}
        #: kind -> lines suppressed since its last line.
        self._suppressed: dict[str, int] = {}

    def log(self, kind: str, level: int, msg: str, *args: object) -> bool:
        """Writes ``msg % args`` at ``level`` unless a line of ``kind`` was
        written less than ``interval`` seconds ago; returns whether it was
        written."""
        now = self._clock()
        if now < self._next.get(kind, float("-inf")):
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return False
        self._next[kind] = now + self.interval
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            msg += " (and %d more like it in the last %.0f s, not logged; the counters have them all)"
            args = (*args, suppressed, self.interval)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        return self.log(kind, logging.WARNING, msg, *args)

    def error(self, kind: str, msg: str, *args: object) -> bool:
        return self.log(kind, logging.ERROR, msg, *args)

    def suppressed(self, kind: str) -> int:
        """Lines of ``kind`` suppressed since its last line."""
        return self._suppressed.get(kind, 0)
