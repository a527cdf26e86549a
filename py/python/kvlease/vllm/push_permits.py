"""D's side of push mode's guard in vLLM: one write permit per registration
a D worker sends, and the request it belongs to.

Owns: ``kvlease.PushPermits`` (the Rust role: permits, deadlines, fences,
``PRN:``/``PRV:`` out, ``PEND:``/``PHB:`` in) behind one lock, the map
between vLLM request ids and permits, which P engines speak the guard (their
handshake payload's ``kv_push_guard``), and what each ended permit means for
its load. May not touch vLLM's state or NIXL: ``push_worker.py`` reports
the loads and sends the bytes.

The rule it keeps (docs/push.md): a load whose permit ended any way but
``written`` is failed, and only then, because only then can no WRITE of P
still land in its blocks (P answered after its WRITE ended or without one,
or D's fence passed). A permit that ended ``written`` leaves the load to
vLLM's own completion notification; if that never comes, the load fails
``write_bound`` later (P's WRITE had ended, so nothing can land).

Threads: ``register`` runs on vLLM's ``nixl-push-writer`` thread (it sends
``PUSH_REG``), the rest on the engine's main thread; the lock makes each
call whole. Clock: D's *scheduler's* clock, the one vLLM's side channel
reads for P's sample of D (its ``perf_counter``), as the worker reads it
through ``scheduler_clock.SchedulerClock``: the worker may run on another
host than the scheduler. Within the scheduler process ``perf_counter`` and
``time.monotonic()`` must be one clock (:func:`clock_is_shared`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .._native import PushConfig, PushPermits
from ..errors import KvLeaseError, PushError
from .push_peers import PeerNames

#: The guard version this build speaks (the handshake's ``kv_push_guard``).
GUARD_VERSION = 1
#: The ``PUSH_REG`` key that carries the permit (40 hex digits).
PERMIT_KEY = "kvlease_permit"


def clock_is_shared() -> bool:
    """Whether vLLM's ``perf_counter`` (the side channel's clock reading)
    and ``time.monotonic`` (the permits' clock) are one clock here."""
    info = time.get_clock_info
    return info("perf_counter").implementation == info("monotonic").implementation


@dataclass
class PermitCounts:
    """What D's guard did, for the connector's stats."""

    sent: int = 0
    written: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    #: Loads failed because the push could not be guarded.
    unguardable: int = 0
    #: Pushes to a P without the guard, left to vLLM (require off).
    unguarded: int = 0
    malformed: int = 0


class DecodePushGuard:
    """One D worker's write permits (see the module docs)."""

    def __init__(self, config: PushConfig, max_peers: int, seed: int | None = None) -> None:
        self.config = config
        self._permits = PushPermits(config, seed)
        self._lock = threading.Lock()
        self.peers = PeerNames(max_peers, self._permits.peers_in_use)
        self._guard_of_p: dict[str, int] = {}
        self._by_req: dict[str, tuple[int, int]] = {}
        self._by_permit: dict[tuple[int, int], str] = {}
        #: Revoked before their registration left: never sent (bounded: a
        #: registration that never leaves is failed by vLLM anyway).
        self._revoked_early: dict[str, None] = {}
        #: Written by P, waiting for vLLM's completion notification.
        self._written: dict[str, float] = {}
        #: Reported received by vLLM while their permit was still open.
        self._received: set[str] = set()
        self.counts = PermitCounts()

    # -- what P speaks (handshake thread) ---------------------------------------

    def note_p(self, engine: str, version: int) -> None:
        self._guard_of_p[engine] = version

    def p_speaks_guard(self, engine: str) -> bool:
        return self._guard_of_p.get(engine, 0) >= GUARD_VERSION

    def forget_engine(self, engine: str) -> None:
        """vLLM forgot the P engine ``engine`` (its eviction of a remote
        engine): what it speaks and its agents go now, its peer id once no
        permit names it."""
        with self._lock:
            self._guard_of_p.pop(engine, None)
            self.peers.forget_engine(engine)

    # -- the writer thread -----------------------------------------------------

    def register(self, rid: str, p_engine: str, now: float) -> str | None:
        """The permit field for the registration of ``rid`` to ``p_engine``,
        or None: the push cannot be guarded (no free permit, no peer id, or
        ``rid`` was revoked before it left), so send nothing and fail the load."""
        with self._lock:
            if rid in self._revoked_early:
                del self._revoked_early[rid]
                return None
            peer = self.peers.id_of(p_engine)
            if peer is None:
                return None
            try:
                slot, nonce, fld = self._permits.register(peer, now)
            except PushError:
                return None
            self._by_req[rid] = (slot, nonce)
            self._by_permit[(slot, nonce)] = rid
            self.counts.sent += 1
            return fld.decode("ascii")

    def forget(self, rid: str) -> None:
        """The registration of ``rid`` never left (vLLM failed the load):
        the permit is revoked, so its end changes nothing."""
        with self._lock:
            permit = self._by_req.pop(rid, None)
            if permit is not None:
                self._by_permit.pop(permit, None)
                self._revoke(permit)

    # -- the main thread -------------------------------------------------------

    def revoke(self, rid: str) -> None:
        """D let ``rid`` go while it waits (abort, watchdog): P must not
        write; its blocks come back when the permit ends."""
        with self._lock:
            permit = self._by_req.get(rid)
            if permit is None:
                self._revoked_early[rid] = None
                if len(self._revoked_early) > self.config.capacity:
                    del self._revoked_early[next(iter(self._revoked_early))]
                return
            self._revoke(permit)

    def _revoke(self, permit: tuple[int, int]) -> None:
        try:
            self._permits.revoke(*permit)
        except PushError:
            pass  # it ended already (UnknownPermit): nothing left to stop

    def on_messages(self, msgs: list[tuple[str, bytes]], now: float) -> list[tuple[str, str]]:
        """``PEND:``/``PHB:`` from P agents: the loads that end, as
        ``(request id, end)``."""
        out: list[tuple[str, str]] = []
        with self._lock:
            for agent, msg in msgs:
                engine = self.peers.engine_of_agent(agent)
                peer = self.peers.get(engine) if engine is not None else None
                if peer is None:
                    self.counts.malformed += 1
                    continue
                try:
                    ended = self._permits.on_message(peer, msg, now)
                except KvLeaseError:  # WireError: counted, nothing changed
                    self.counts.malformed += 1
                    continue
                self._ended(ended, now, out)
        return out

    def poll(self, now: float) -> tuple[list[tuple[str, bytes]], list[tuple[str, str]]]:
        """This step: ``(P engine, message)`` to send, and the loads that end
        (fenced permits; written ones whose notification never came)."""
        out: list[tuple[str, str]] = []
        with self._lock:
            to_p, fenced = self._permits.poll(now)
            self._ended(fenced, now, out)
            late = [r for r, t in self._written.items() if now - t > self.config.write_bound]
            for rid in late:
                del self._written[rid]
                out.append((rid, "written_unreported"))
            sends = []
            for peer, msg in to_p:
                engine = self.peers.engine(peer)
                if engine is not None:
                    sends.append((engine, msg))
        return sends, out

    def received(self, rid: str) -> None:
        """vLLM reported ``rid`` received (its completion notification, or a
        failed load): the permit's end changes nothing for it any more."""
        with self._lock:
            self._written.pop(rid, None)
            if rid in self._by_req:
                self._received.add(rid)

    def _ended(self, ended: list, now: float, out: list[tuple[str, str]]) -> None:
        for slot, nonce, _peer, end in ended:
            rid = self._by_permit.pop((slot, nonce), None)
            if rid is None:
                continue  # forgotten: its load was failed already
            self._by_req.pop(rid, None)
            if rid in self._received:
                self._received.discard(rid)
                if end == "written":
                    self.counts.written += 1
                continue
            if end == "written":
                self.counts.written += 1
                self._written[rid] = now
                continue
            self.counts.failed[end] = self.counts.failed.get(end, 0) + 1
            out.append((rid, end))

    @property
    def live(self) -> int:
        with self._lock:
            return self._permits.live
