"""Where push mode's guard meets vLLM's notifications: the tap on the
writer thread's ``get_new_notifs``, and the names of the peers.

Owns: taking kvlease's push messages (``PEND:``/``PHB:`` for D, ``PRN:``/
``PRV:`` for P) out of what vLLM's ``nixl-push-writer`` thread drains,
*with* the agent that sent them (vLLM's writer keeps only the bytes), and
putting registrations back that P deferred until it had a clock sample of
their D (:class:`NotifTap`); the small table that names each peer engine
with the 16-bit peer id the Rust roles use (:class:`PeerNames`). May not
decide anything about a permit: ``push_permits.py`` (D) and
``push_writes.py`` (P) do.

Why a tap on the agent and not an override: vLLM's writer loop is one
private method that drains NIXL, routes ``PUSH_REG`` and forwards the rest
as bare bytes to the main thread; the sender is gone by then, and the loop
itself changed between 0.32 and 0.34. Its one call into NIXL,
``nixl_wrapper.get_new_notifs()``, did not. The tap stands in for the agent
object (every other attribute is the agent's own) and runs its hooks on the
writer thread, once per loop: P's guard answers and heartbeats from there,
because an idle P steps no more (``push_worker.py``).
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

#: Prefixes of the guard's messages to D (from P) and to P (from D).
TO_D = (b"PEND:", b"PHB:")
TO_P = (b"PRN:", b"PRV:")
_ALL = TO_D + TO_P
#: The sender name of a registration put back by P (no agent sent it again).
REPLAY = "kvlease-replay"


class NotifTap:
    """vLLM's NIXL agent, with kvlease's push messages taken out of
    ``get_new_notifs`` and handed to ``on_messages`` (on the calling thread,
    vLLM's writer), and deferred registrations put back in."""

    def __init__(
        self,
        agent: Any,
        on_messages: Callable[[list[tuple[str, bytes]]], None],
        on_drain: Callable[[], None] | None = None,
    ) -> None:
        self._agent = agent
        self._on_messages = on_messages
        self._on_drain = on_drain
        self._replay: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    @property
    def agent(self) -> Any:
        """vLLM's agent itself."""
        return self._agent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def replay(self, notif: bytes) -> None:
        """Hands ``notif`` (a ``PUSH_REG``) to vLLM's writer again at its next
        drain. Any thread."""
        self._replay.put(notif)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        got = self._agent.get_new_notifs()
        out: dict[str, list[bytes]] = {}
        ours: list[tuple[str, bytes]] = []
        for sender, msgs in got.items():
            name = sender.decode("utf-8", "replace") if isinstance(sender, bytes) else sender
            keep = []
            for msg in msgs:
                raw = msg.encode("utf-8", "surrogateescape") if isinstance(msg, str) else msg
                if raw.startswith(_ALL):
                    ours.append((name, bytes(raw)))
                else:
                    keep.append(msg)
            if keep:
                out[sender] = keep
        while True:
            try:
                notif = self._replay.get_nowait()
            except queue.Empty:
                break
            out.setdefault(REPLAY, []).append(notif)
        if ours:
            self._on_messages(ours)
        if self._on_drain is not None:
            self._on_drain()
        return out


class PeerNames:
    """Peer engine id <-> the 16-bit peer id of the Rust roles, and agent
    name -> engine id. At most ``capacity`` engines: one more is ``None``
    (the caller fails closed), never an eviction that could hand a live
    peer's id to another."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, min(int(capacity), 1 << 16))
        self._ids: dict[str, int] = {}
        self._engines: list[str] = []
        self._agents: dict[str, str] = {}

    def id_of(self, engine: str) -> int | None:
        peer = self._ids.get(engine)
        if peer is None and len(self._engines) < self.capacity:
            peer = len(self._engines)
            self._ids[engine] = peer
            self._engines.append(engine)
        return peer

    def engine(self, peer: int) -> str | None:
        return self._engines[peer] if 0 <= peer < len(self._engines) else None

    def note_agents(self, engine: str, agent_names: Any) -> None:
        """The agents of ``engine`` this worker talks to (a handshake's result)."""
        for name in agent_names:
            self._agents[name.decode() if isinstance(name, bytes) else str(name)] = engine

    def engine_of_agent(self, name: str) -> str | None:
        return self._agents.get(name)
