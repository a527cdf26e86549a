"""Compact heartbeats between kvlease peers: D renews a kvlease P's leases
with (slot, nonce) records, packed (``HBP:``, 16 bytes a record), instead of
vLLM's ``HB:`` request ids.

Owns: on D's scheduler, the lease fields of every heartbeated request
(:class:`HeartbeatLeases`, kept beside vLLM's own heartbeat sets) and their
encoding, once per heartbeat round and P engine, into a
:class:`CompactRound`; on D's workers, the choice of message per P agent
while vLLM's ``_send_heartbeats`` runs (:class:`CompactSends`). May not change
what a P without the advert receives: an agent whose lease advert does not
accept packed heartbeats (stock vLLM, an advert that could not be read, or a
kvlease build from before ``HBP:``, which accepted only ``HBC:``) gets vLLM's
``HB:`` message byte for byte, and a request without lease fields is renewed
by id, in vLLM's ``HB:`` form, on every agent.

Why: P parses a text heartbeat id by id (UTF-8, split, hash, lookup), about
30 ns an id in the library and 6 ms a heartbeat step at 100k leases; a
record names the lease's slot, so P renews it with one array access and a
nonce compare, and a record whose nonce is not the slot's lease renews
nothing (``docs/wire-formats.md``). Packed, not hex (``HBC:``): P decodes
a packed record without hex arithmetic, which took the step at 100k leases
from about 1.6 ms to under 0.5 ms (``py/bench/bookkeeping.py``).

Why the scheduler encodes: once per round for all of the engine's workers,
instead of once per worker; and what it ships is immutable bytes, while
``meta.heartbeat_by_engine`` is vLLM's live dict (``py/VLLM_MAP.md``, hazard
5). Between rounds the book costs one dict write per request tracked and one
per request stopped, never a pass over all of them.

Why a stand-in agent during vLLM's ``_send_heartbeats`` and not an
override that sends by itself: vLLM's method also starts the handshakes,
skips the engines whose handshake is pending and refreshes each engine's
idle timer; with the stand-in all of that stays vLLM's, and only the bytes
sent to an advertising agent change (as ``read_gate.py`` does for the
read-done).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._native import encode_compact_heartbeats

#: Largest packed message: the library's own heartbeat sender's limit
#: (``consumer::sender::MAX_MESSAGE_LEN``), 4,095 records.
MAX_MESSAGE_LEN = 64 * 1024


@dataclass(frozen=True)
class CompactRound:
    """One P engine's heartbeat for agents that accept packed heartbeats."""

    #: ``HBP:`` messages naming the (slot, nonce) of every heartbeated
    #: request of the engine that has lease fields.
    messages: tuple[bytes, ...]
    #: vLLM's ``HB:`` message for the engine's requests without lease
    #: fields (b"" when every request has them).
    text: bytes = b""


class HeartbeatLeases:
    """D scheduler: ``{P engine: {P-side request id: (slot, nonce)}}`` of the
    requests vLLM heartbeats. Its ids per engine are always a subset of
    vLLM's ``HeartbeatInfo.req_ids`` for that engine: an id enters after vLLM
    added it (``on_new_request``) and leaves when vLLM discards it
    (``_stop_heartbeat``), so the two are the same size exactly when every
    heartbeated request has lease fields."""

    def __init__(self) -> None:
        self._by_engine: dict[str, dict[str, tuple[int, int]]] = {}

    def track(self, engine_id: str, remote_id: str, fields: tuple[int, int] | None) -> None:
        """vLLM started heartbeating ``remote_id`` on ``engine_id``; its lease
        fields, or None when it has none (a stock P, an unslotted lease)."""
        if fields is not None:
            self._by_engine.setdefault(engine_id, {})[remote_id] = fields
        else:
            # The same P id again, now without fields: it is renewed by id.
            self.stop(engine_id, remote_id)

    def stop(self, engine_id: str, remote_id: str) -> None:
        """vLLM stopped heartbeating ``remote_id`` on ``engine_id``."""
        book = self._by_engine.get(engine_id)
        if book is not None and book.pop(remote_id, None) is not None and not book:
            del self._by_engine[engine_id]

    def round(self, heartbeat_by_engine: Mapping[str, Any]) -> dict[str, CompactRound]:
        """The compact form of this round's heartbeats (vLLM's
        ``meta.heartbeat_by_engine``), for the engines with at least one
        request with lease fields. Raises ``WireError`` only for a nonce of 0,
        which ``scheduler.read_fields`` never lets in."""
        out: dict[str, CompactRound] = {}
        for engine_id, info in heartbeat_by_engine.items():
            book = self._by_engine.get(engine_id)
            if not book:
                continue
            ids = info.req_ids
            text = b""
            if len(book) != len(ids):
                # vLLM's own expression, over the ids P must renew by id.
                text = ("HB:" + ",".join(r for r in ids if r not in book)).encode()
            messages = encode_compact_heartbeats(book.values(), MAX_MESSAGE_LEN, packed=True)
            out[engine_id] = CompactRound(tuple(messages), text)
        return out

    def engines(self) -> int:
        """P engines with at least one request with lease fields."""
        return len(self._by_engine)

    def size(self) -> int:
        """Requests with lease fields, over all engines."""
        return sum(len(b) for b in self._by_engine.values())


def compact_targets(
    rounds: Mapping[str, CompactRound],
    remote_agents: Mapping[str, Mapping[Any, Any]],
    accepts_packed: Callable[[Any], bool],
) -> dict[Any, CompactRound]:
    """D worker: the agents of this round's engines that accept packed
    heartbeats, each with its engine's round."""
    targets: dict[Any, CompactRound] = {}
    for engine_id, rnd in rounds.items():
        for agent_name in remote_agents.get(engine_id, {}).values():
            if accepts_packed(agent_name):
                targets[agent_name] = rnd
    return targets


class CompactSends:
    """A stand-in for the D worker's agent during vLLM's ``_send_heartbeats``:
    vLLM's ``HB:`` message to an agent in ``targets`` becomes that engine's
    compact messages (and the text heartbeat of its requests without lease
    fields); every other call goes to the real agent unchanged."""

    def __init__(self, agent: Any, targets: Mapping[Any, CompactRound]) -> None:
        object.__setattr__(self, "agent", agent)
        object.__setattr__(self, "_targets", targets)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.agent, name, value)

    def send_notif(self, agent_name: Any, notif_msg: bytes = b"", **kwargs: Any) -> Any:
        rnd = self._targets.get(agent_name)
        if rnd is None or not bytes(notif_msg).startswith(b"HB:"):
            return self.agent.send_notif(agent_name, notif_msg=notif_msg, **kwargs)
        # A failed send raises into vLLM's loop, which logs it and goes on
        # with the next agent, as for its own heartbeat.
        for msg in rnd.messages:
            self.agent.send_notif(agent_name, notif_msg=msg, **kwargs)
        if rnd.text:
            self.agent.send_notif(agent_name, notif_msg=rnd.text, **kwargs)
        return None
