"""The names of push mode's peers: the 16-bit peer id each peer engine has
in the Rust roles, and the engine each NIXL agent belongs to.

Owns: two tables with two lifetimes (:class:`PeerNames`).

- **Peer ids**, at most ``kv_lease_max_peers`` at once. Engine ids change
  at every restart and each data-parallel rank is an engine of its own, so
  a long-lived worker meets far more engines than it talks to at once. When
  the table is full, the least recently used engine that no live state of
  the role names (``peers_in_use()``: D's open permits, P's held, posted
  and remembered registrations) gives its id up. Only when every id is in
  use is a new engine refused (``None``: the caller fails closed, counted in
  ``table_full``). An id is never taken from an engine the role still
  names, so no answer or renewal can reach the wrong engine's state.
- **Agent names**: which engine sent a notification. Kept for as long as
  vLLM keeps the engine (until ``forget_engine``, from vLLM's own eviction
  of a remote engine), not as long as its peer id: vLLM does not handshake
  again with an engine it still knows, so an engine whose id went idle and
  was given up must still be recognised when it speaks again (it gets a
  new id then).

May not decide anything about a permit: ``push_permits.py`` (D) and
``push_writes.py`` (P) do; they call in under their own lock, so nothing
here locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any


class PeerNames:
    """Peer engine id <-> the 16-bit peer id of the Rust roles, and agent
    name -> engine id (see the module docs). ``in_use`` returns the peer
    ids the role's live state names (None: every id counts as in use, so
    none is ever given up); ``on_release(engine, peer)`` runs when an
    engine gives its id up."""

    def __init__(
        self,
        capacity: int,
        in_use: Callable[[], Collection[int]] | None = None,
        on_release: Callable[[str, int], None] | None = None,
    ) -> None:
        self.capacity = max(1, min(int(capacity), 1 << 16))
        self._in_use = in_use
        self._on_release = on_release
        #: engine -> id, least recently used first.
        self._ids: OrderedDict[str, int] = OrderedDict()
        self._engines: list[str | None] = []
        self._free: list[int] = []
        #: Engines vLLM forgot while the role still named them: they give
        #: their id up first, whatever their last use.
        self._leaving: set[str] = set()
        self._agents: dict[str, str] = {}
        self._agents_of: dict[str, set[str]] = {}
        #: Ids given up to make room, and new engines refused (all in use).
        self.released = 0
        self.table_full = 0

    def __len__(self) -> int:
        return len(self._ids)

    def id_of(self, engine: str) -> int | None:
        """The id of ``engine``, given one now if it has none (making room
        when the table is full); None when every id is in use."""
        peer = self._ids.get(engine)
        if peer is not None:
            self._ids.move_to_end(engine)
            return peer
        if len(self._ids) >= self.capacity and not self._make_room():
            self.table_full += 1
            return None
        if self._free:
            peer = self._free.pop()
            self._engines[peer] = engine
        else:
            peer = len(self._engines)
            self._engines.append(engine)
        self._ids[engine] = peer
        self._leaving.discard(engine)
        return peer

    def get(self, engine: str) -> int | None:
        """The id of ``engine`` if it has one; never gives one (for
        messages: state can only name an engine that has an id)."""
        return self._ids.get(engine)

    def engine(self, peer: int) -> str | None:
        return self._engines[peer] if 0 <= peer < len(self._engines) else None

    def note_agents(self, engine: str, agent_names: Any) -> None:
        """The agents of ``engine`` this worker talks to (a handshake's result)."""
        mine = self._agents_of.setdefault(engine, set())
        for name in agent_names:
            text = name.decode() if isinstance(name, bytes) else str(name)
            self._agents[text] = engine
            mine.add(text)

    def engine_of_agent(self, name: str) -> str | None:
        return self._agents.get(name)

    def forget_engine(self, engine: str) -> None:
        """vLLM forgot ``engine`` (its own eviction of a remote engine, or a
        replacement): its agents go now, its id as soon as nothing names it."""
        for name in self._agents_of.pop(engine, ()):
            if self._agents.get(name) == engine:
                del self._agents[name]
        if engine not in self._ids:
            return
        if self._ids[engine] in self._busy():
            self._leaving.add(engine)
        else:
            self._release(engine)

    def _busy(self) -> Collection[int]:
        if self._in_use is None:
            return range(len(self._engines))
        return set(self._in_use())

    def _make_room(self) -> bool:
        """Gives up the id of a leaving engine, else of the least recently
        used one, that no live state names. False when every id is in use."""
        busy = self._busy()
        for engine in [e for e in self._leaving if self._ids[e] not in busy]:
            self._release(engine)
        if len(self._ids) < self.capacity:
            return True
        for engine, peer in self._ids.items():
            if peer not in busy:
                self._release(engine)
                return True
        return False

    def _release(self, engine: str) -> None:
        peer = self._ids.pop(engine)
        self._leaving.discard(engine)
        self._engines[peer] = None
        self._free.append(peer)
        self.released += 1
        if self._on_release is not None:
            self._on_release(engine, peer)
