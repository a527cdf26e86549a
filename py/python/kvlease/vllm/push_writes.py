"""P's side of push mode's guard in vLLM: the registrations a P worker
accepted, the gate in front of each WRITE, and P's view of each D's clock.

Owns: ``kvlease.PushWrites`` (the Rust role: registrations, the gate,
``PEND:``/``PHB:`` out, ``PRN:``/``PRV:`` in), the D engines' names
(``push_peers.PeerNames``) and clocks (``push_clocks.DClocks``), behind
one lock; which P request each WRITE belongs to; the P requests P let go (by vLLM's base request id,
the key vLLM matches registrations by); and the limit on how long P holds a
registration it has not written. May not touch vLLM's state or NIXL:
``push_worker.py`` posts, sends and reports.

The rules it keeps (docs/push.md):

- A registration that reaches P after P let its request go is refused at
  once (``PEND:R``), so D does not wait for a deadline.
- A WRITE is posted only through the gate: D's deadline, translated onto
  P's clock by the estimate and moved earlier by its error bound and
  ``post_margin``, is still ahead. No estimate of that D: no WRITE.
- A registration P holds but does not write within ``hold_limit`` (its
  request never came, P's handshake back to D failed) is ended (``PEND:X``):
  P's heartbeats would otherwise keep D waiting for good.

Threads: vLLM's ``nixl-push-writer`` registers, gates and polls; the engine's
main thread reports finished WRITEs and the requests P let go; handshake and
sampler threads report clock readings. Clock:
``time.monotonic()``, the clock the handshake's stamps are on
(``handshake_adverts.ClockRound``).
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .._native import ClockEstimate, PushConfig, PushWrites
from ..errors import KvLeaseError
from .push_clocks import DClocks
from .push_peers import PeerNames

#: How many let-go request ids P remembers (a registration later than that
#: finds nothing and is held until ``hold_limit``, then ended: bounded too).
GONE_MEMORY = 65536


@dataclass
class WriteCounts:
    """What P's guard did beyond the Rust role's counters."""

    #: Registrations deferred until P had a clock sample of their D.
    deferred: int = 0
    #: Registrations dropped: malformed field, no peer id, no handshake.
    dropped: int = 0
    #: Held registrations ended at ``hold_limit``.
    held_too_long: int = 0


class PrefillPushGuard:
    """One P worker's registrations (see the module docs)."""

    def __init__(self, config: PushConfig, max_peers: int, hold_limit: float) -> None:
        self.config = config
        self.hold_limit = hold_limit
        self._writes = PushWrites(config, random.getrandbits(64))
        self._lock = threading.Lock()
        self.peers = PeerNames(max_peers, self._writes.peers_in_use, self._peer_released)
        self.clocks = DClocks(config.drift_ppm)
        #: The clock estimates of the D peers that have an id, as the Rust
        #: role's poll takes them (kept in step with ``peers``).
        self._peer_clocks: dict[int, ClockEstimate] = {}
        #: Accepted, not yet posted: D request id -> (handle, since).
        self._held: OrderedDict[str, tuple[Any, float]] = OrderedDict()
        #: P request id -> (handle, D request id), from the match to the end
        #: of its WRITE (or to the gate's refusal). Kept while a match waits
        #: for P's handshake back to D: a WRITE posted after that must meet
        #: the gate, never vLLM's unguarded path. (A handshake that fails
        #: leaves its entry: one per failed handshake.)
        self._bound: dict[str, tuple[Any, str]] = {}
        #: P requests whose WRITE the gate let through, until write_done.
        self._posted: set[str] = set()
        self._failed: set[str] = set()
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._late_seen = 0
        self.counts = WriteCounts()

    # -- clocks (handshake threads) ----------------------------------------------

    def observe_clock(self, d_engine: str, rounds: list, now: float) -> None:
        """Folds the clock rounds of a handshake with ``d_engine`` into P's
        estimate of its clock."""
        with self._lock:
            self.clocks.observe(d_engine, rounds, now)

    def has_clock(self, d_engine: str) -> bool:
        with self._lock:
            return self.clocks.estimate(d_engine) is not None

    def note_address(self, d_engine: str, host: str, port: int, now: float) -> None:
        """P's handshake back to ``d_engine`` succeeded: its side channel is
        where its clock is asked again."""
        with self._lock:
            self.clocks.note_address(d_engine, host, port, now)

    def due_resamples(self, now: float) -> list[tuple[str, str, int, str]]:
        """``(D engine, host, port, lane)`` to ask for its clock now
        (``push_clocks.DClocks.due``); report each with :meth:`resampled`."""
        with self._lock:
            return self.clocks.due(now)

    def clock_estimates(self, now: float) -> dict[str, tuple[float, float]]:
        """``{D engine: (offset, bound)}``: P's estimate of each D's clock
        (its clock minus P's, s) and the error bound it claims at ``now``."""
        with self._lock:
            return self.clocks.estimates(now)

    def ask_clock_now(self, d_engine: str) -> tuple[str, str, int, str] | None:
        """``(D engine, host, port, lane)`` to ask at once
        (``push_clocks.DClocks.ask_now``); report it with :meth:`resampled`."""
        with self._lock:
            return self.clocks.ask_now(d_engine)

    def resampled(self, d_engine: str, rounds: list, now: float) -> bool:
        """The ask of ``d_engine``'s clock came back (``[]``: unanswered)."""
        with self._lock:
            return self.clocks.asked(d_engine, rounds, now)

    def forget_engine(self, d_engine: str) -> None:
        """vLLM forgot ``d_engine``: its clock, its address and (once
        nothing names it) its peer id go."""
        with self._lock:
            self.clocks.forget(d_engine)
            peer = self.peers.get(d_engine)
            if peer is not None:
                self._peer_clocks.pop(peer, None)
            self.peers.forget_engine(d_engine)

    def _peer_released(self, _engine: str, peer: int) -> None:
        # Under self._lock (PeerNames runs inside id_of / forget_engine).
        self._peer_clocks.pop(peer, None)

    def _peer_clock(self, d_engine: str) -> tuple[int | None, ClockEstimate | None]:
        """``d_engine``'s peer id (given one now if needed) and clock
        estimate; the pair is what the Rust role's poll sees. Under the lock."""
        peer = self.peers.id_of(d_engine)
        clock = self.clocks.estimate(d_engine)
        if peer is not None and clock is not None:
            self._peer_clocks[peer] = clock
        return peer, clock

    # -- registrations (writer thread) -------------------------------------------

    def is_gone(self, base_id: str) -> bool:
        return base_id in self._gone

    def register(
        self, d_engine: str, permit: str, rid: str, live: bool, now: float
    ) -> tuple[Any, str | None]:
        """``(handle, None)``: accepted, held until its WRITE; ``(None,
        reason)``: refused (``PEND:R`` goes out at the next poll, except for
        ``exhausted``), dropped (``malformed``, ``no_peer``: D's fence ends
        it), or ``duplicate``: one P holds already, nothing to do."""
        with self._lock:
            peer, clock = self._peer_clock(d_engine)
            if peer is None:
                self.counts.dropped += 1
                return None, "no_peer"
            if clock is None:
                clock = ClockEstimate(self.config.drift_ppm)  # refused: no_clock
            try:
                handle, refusal = self._writes.register(
                    peer, permit.encode("ascii"), live, clock, now
                )
            except (KvLeaseError, UnicodeEncodeError):
                self.counts.dropped += 1
                return None, "malformed"
            if handle is not None:
                self._held[rid] = (handle, now)
            return handle, refusal

    def bind(self, p_rid: str, d_rid: str, handle: Any) -> None:
        """P matched the held registration of ``d_rid`` with its finished
        request ``p_rid``."""
        with self._lock:
            self._bound[p_rid] = (handle, d_rid)

    def is_bound(self, p_rid: str) -> bool:
        return p_rid in self._bound

    def begin_write(self, p_rid: str, d_engine: str, now: float) -> bool:
        """Right before P posts the WRITE of ``p_rid``: whether it may."""
        with self._lock:
            bound = self._bound.get(p_rid)
            _peer, clock = self._peer_clock(d_engine)
            if bound is None or clock is None:
                self._bound.pop(p_rid, None)
                return False
            handle, d_rid = bound
            held = self._held.get(d_rid)
            if held is not None and held[0] == handle:
                del self._held[d_rid]
            if self._writes.begin_write(handle, clock, now) is not None:
                self._bound.pop(p_rid, None)
                return False
            self._posted.add(p_rid)
            return True

    def end_unposted(self, p_rid: str) -> None:
        """P will not post the WRITE of ``p_rid`` (it no longer holds the
        blocks): the registration ends (``PEND:X``). A WRITE already posted
        is not affected (its end is :meth:`write_done`'s)."""
        with self._lock:
            bound = self._bound.get(p_rid)
            if bound is None:
                return
            handle, d_rid = bound
            held = self._held.get(d_rid)
            if held is not None and held[0] == handle:
                del self._held[d_rid]
            if self._writes.cancel(handle) or p_rid not in self._posted:
                del self._bound[p_rid]

    def take_late_writes(self) -> int:
        """WRITEs that ended more than ``write_bound`` after they were let
        through, since the last call (the operator must hear of each: past
        the bound, D may have freed the blocks)."""
        with self._lock:
            total = int(self._writes.counters()["late_writes"])
        new, self._late_seen = total - self._late_seen, total
        return new

    def poll(self, now: float) -> list[tuple[str, bytes]]:
        """``(D engine, message)`` to send: answers, and heartbeats for the
        registrations P holds. Ends those held past ``hold_limit`` first."""
        with self._lock:
            while self._held:
                rid, (handle, since) = next(iter(self._held.items()))
                if now - since < self.hold_limit:
                    break
                del self._held[rid]
                if self._writes.cancel(handle):
                    self.counts.held_too_long += 1
            out = []
            for peer, msg in self._writes.poll(self._peer_clocks, now):
                engine = self.peers.engine(peer)
                if engine is not None:
                    out.append((engine, msg))
            return out

    def on_messages(self, msgs: list[tuple[str, bytes]]) -> None:
        """``PRN:``/``PRV:`` from D agents."""
        with self._lock:
            for agent, msg in msgs:
                engine = self.peers.engine_of_agent(agent)
                peer = self.peers.get(engine) if engine is not None else None
                if peer is None:
                    continue
                try:
                    self._writes.on_message(peer, msg)
                except KvLeaseError:
                    pass  # counted by the role (malformed); nothing changed

    # -- the main thread ----------------------------------------------------------

    def write_failed(self, p_rids: set[str]) -> None:
        with self._lock:
            self._failed.update(r for r in p_rids if r in self._bound)

    def write_done(self, p_rid: str, now: float) -> bool:
        """Every WRITE of ``p_rid`` reached its terminal state (failed ones
        were reported to :meth:`write_failed` first). Whether it was ours."""
        with self._lock:
            bound = self._bound.pop(p_rid, None)
            failed = p_rid in self._failed
            self._failed.discard(p_rid)
            self._posted.discard(p_rid)
            if bound is None:
                return False
            self._writes.write_done(bound[0], not failed, now)
            return True

    def let_go(self, p_rid: str, base_id: str) -> None:
        """P freed the blocks of ``p_rid`` (WRITE done, or its lease
        expired, with no guarded WRITE reading them: ``push_worker.py``
        holds such a release back). Its registration, if one was matched
        and not posted, ends (``X``), so no later post of it can pass the
        gate, whatever vLLM's queues still hold; and a registration that
        finds no P request of ``base_id`` holding blocks is refused from now
        on (``is_gone``). Registrations held for *other* requests of the
        same base id (a client's retry) are not touched. O(1)."""
        self.end_unposted(p_rid)
        with self._lock:
            self._gone[base_id] = None
            self._gone.move_to_end(base_id)
            while len(self._gone) > GONE_MEMORY:
                self._gone.popitem(last=False)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._writes.counters())

    @property
    def held(self) -> int:
        with self._lock:
            return self._writes.held
