"""P's view of each D engine's clock, for push mode's gate: the estimate,
where to ask D again, and when.

Owns: one ``kvlease.ClockEstimate`` per D engine (keyed by engine id, so an
engine keeps its estimate when its peer id is given up: ``push_peers.py``),
the address of D's side channel, and the schedule of the asks that keep
each estimate fresh (:class:`DClocks`). May not ask anything itself:
``push_worker.py`` sends vLLM's ``GET_META`` on its sampler threads and
reports each ask back (:meth:`DClocks.asked`).

The rules:

- An estimate older than :data:`CLOCK_RESAMPLE_S` is asked again; so, at
  once, is a D whose handshake gave no clock reading: without one every
  push to it would be refused.
- One ask per D engine at a time, so the asks of dead Ds cannot queue up.
- A D that left :data:`MAX_FAILED_ASKS` asks in a row unanswered is asked
  no more until a handshake with it succeeds again. vLLM keeps a dead
  engine for an hour (``engine_ttl``), and each ask of a dead D blocks its
  thread for ``QUERY_TIMEOUT_MS``.
- Each ask says its lane: ``"fresh"`` for a D whose last ask was answered,
  ``"suspect"`` for one whose last ask was not. The worker runs each lane
  on its own thread, so dead Ds delay only each other, never the estimate
  of a live D.
- Everything of a D goes when vLLM forgets the engine (:meth:`forget`).
- :meth:`due` is one comparison while nothing is due (every drain of P's
  writer thread, every millisecond while vLLM polls, asks it).

Threads: handshake and sampler threads observe, the writer asks what is
due; the caller (``push_writes.PrefillPushGuard``) holds its lock around
every call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .._native import ClockEstimate

logger = logging.getLogger("vllm.kvlease.push")

#: Re-sample a D's clock once the estimate is this old (s): at the
#: estimator's 100 ppm the bound grows 6 ms a minute.
CLOCK_RESAMPLE_S = 60.0
#: A D whose handshake gave no clock reading is asked again this soon (s).
NO_SAMPLE_RETRY_S = 2.0
#: Unanswered asks in a row after which a D is asked no more (until a
#: handshake with it succeeds again).
MAX_FAILED_ASKS = 3


@dataclass
class _DClock:
    estimate: ClockEstimate
    address: tuple[str, int] | None = None
    sampled_at: float | None = None
    next_ask: float = float("inf")
    asking: bool = False
    failed_asks: int = 0


class DClocks:
    """P's estimates of the D engines' clocks (see the module docs)."""

    def __init__(self, drift_ppm: int) -> None:
        self._drift_ppm = drift_ppm
        self._by_engine: dict[str, _DClock] = {}
        #: No ask is due before this (P's clock).
        self._next_due = float("inf")

    def __len__(self) -> int:
        return len(self._by_engine)

    def _entry(self, engine: str) -> _DClock:
        entry = self._by_engine.get(engine)
        if entry is None:
            entry = self._by_engine[engine] = _DClock(ClockEstimate(self._drift_ppm))
        return entry

    def estimate(self, engine: str) -> ClockEstimate | None:
        """The estimate of ``engine``'s clock, None before any sample."""
        entry = self._by_engine.get(engine)
        return entry.estimate if entry is not None and entry.estimate.has_sample else None

    def observe(self, engine: str, rounds: list, now: float) -> bool:
        """Folds a handshake's or an ask's clock rounds in; whether one of
        them was taken."""
        entry = self._entry(engine)
        took = False
        for r in rounds:
            if r.remote is None:
                continue
            try:
                taken = entry.estimate.observe(r.sent, r.remote, r.received) != "refused"
            except ValueError:  # D's reading off the wire: negative, NaN, inf
                taken = False
            took = took or taken
        if took:
            if entry.sampled_at is None:
                # Once per D engine (a restarted D is a new engine): what
                # an operator compares with the hosts' clocks.
                offset, bound = entry.estimate.offset, entry.estimate.bound(now)
                if offset is not None and bound is not None:
                    logger.info("kvlease: P's first estimate of D engine %s's clock: %+.6f s "
                                "from P's, error bound %.3f ms", engine, offset, bound * 1e3)
            entry.sampled_at = now
            entry.failed_asks = 0
            self._schedule(entry, now + CLOCK_RESAMPLE_S)
        return took

    def note_address(self, engine: str, host: str, port: int, now: float) -> None:
        """A handshake with ``engine`` at ``host:port`` succeeded (after
        :meth:`observe` of its rounds): asks may go there again."""
        entry = self._entry(engine)
        entry.address = (host, port)
        entry.failed_asks = 0
        if entry.sampled_at is None:
            self._schedule(entry, now)

    def due(self, now: float) -> list[tuple[str, str, int, str]]:
        """``(engine, host, port, lane)`` to ask now; each is marked asking
        until :meth:`asked`."""
        if now < self._next_due:
            return []
        out = []
        next_due = float("inf")
        for engine, entry in self._by_engine.items():
            if entry.asking or entry.address is None or entry.failed_asks >= MAX_FAILED_ASKS:
                continue
            if entry.next_ask <= now:
                entry.asking = True
                lane = "suspect" if entry.failed_asks else "fresh"
                out.append((engine, *entry.address, lane))
            else:
                next_due = min(next_due, entry.next_ask)
        self._next_due = next_due
        return out

    def ask_now(self, engine: str) -> tuple[str, str, int, str] | None:
        """``engine`` to ask at once, whatever its schedule (a registration
        waits on it), as :meth:`due` gives it; None when it is being asked
        already, has no address, or was given up on."""
        entry = self._by_engine.get(engine)
        if entry is None or entry.asking or entry.address is None:
            return None
        if entry.failed_asks >= MAX_FAILED_ASKS:
            return None
        entry.asking = True
        return (engine, *entry.address, "suspect" if entry.failed_asks else "fresh")

    def asked(self, engine: str, rounds: list, now: float) -> bool:
        """The ask of ``engine`` came back with ``rounds`` ([] when D did
        not answer); whether it gave a sample. An engine forgotten
        meanwhile stays forgotten."""
        entry = self._by_engine.get(engine)
        if entry is None:
            return False
        entry.asking = False
        if rounds and self.observe(engine, rounds, now):
            return True
        entry.failed_asks += 1
        retry = NO_SAMPLE_RETRY_S if entry.sampled_at is None else CLOCK_RESAMPLE_S
        self._schedule(entry, now + retry)
        return False

    def forget(self, engine: str) -> None:
        """vLLM forgot ``engine``: its estimate and schedule go."""
        self._by_engine.pop(engine, None)

    def _schedule(self, entry: _DClock, at: float) -> None:
        entry.next_ask = at
        if at < self._next_due:
            self._next_due = at

    def estimates(self, now: float) -> dict[str, tuple[float, float]]:
        """``{engine: (offset, bound)}`` of every sampled D: its clock minus
        P's (s), and the estimate's error bound at ``now`` (s). For reports
        and tests; a copy."""
        out = {}
        for engine, entry in self._by_engine.items():
            offset, bound = entry.estimate.offset, entry.estimate.bound(now)
            if offset is not None and bound is not None:
                out[engine] = (offset, bound)
        return out

    def stats(self) -> dict[str, int]:
        """Engines known, asking now, and given up on (for tests and logs)."""
        entries = self._by_engine.values()
        return {
            "engines": len(self._by_engine),
            "asking": sum(e.asking for e in entries),
            "given_up": sum(e.failed_asks >= MAX_FAILED_ASKS for e in entries),
        }
