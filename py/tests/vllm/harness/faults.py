"""Fault injection and instrumentation on a worker's NIXL agent, for the
end-to-end tests only.

Owns: a forwarding stand-in for a worker's agent that drops D's outgoing
heartbeats while switched on (the "notifications to P are lost" case), and
one that timestamps P's incoming heartbeats (to measure how long after the
last heartbeat P reclaims). May not alter anything else: every other call
goes to the real agent.
"""

from __future__ import annotations

import time
from typing import Any


class AgentProxy:
    """Forwards every attribute to the real agent."""

    def __init__(self, agent: Any) -> None:
        object.__setattr__(self, "agent", agent)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.agent, name, value)


#: Every heartbeat form: vLLM's text one, and kvlease's record forms between
#: kvlease peers (the plugin sends ``HBP:``; ``HBC:`` for completeness).
HEARTBEATS = (b"HB:", b"HBC:", b"HBP:")


class DropHeartbeats(AgentProxy):
    """D side: while ``on``, heartbeats (``HB:``, ``HBC:``, ``HBP:``) are not sent."""

    def __init__(self, agent: Any) -> None:
        super().__init__(agent)
        object.__setattr__(self, "on", False)
        object.__setattr__(self, "dropped", 0)

    def send_notif(self, agent_name: Any, notif_msg: bytes = b"", **kw: Any) -> Any:
        if self.on and bytes(notif_msg).startswith(HEARTBEATS):
            object.__setattr__(self, "dropped", self.dropped + 1)
            return None
        return self.agent.send_notif(agent_name, notif_msg=notif_msg, **kw)


class HeartbeatClock(AgentProxy):
    """P side: the wall time of the last heartbeat (either form) drained,
    and their count."""

    def __init__(self, agent: Any) -> None:
        super().__init__(agent)
        object.__setattr__(self, "last", None)
        object.__setattr__(self, "count", 0)
        #: Every notification drained (the mixed-fleet tests read them).
        object.__setattr__(self, "received", [])

    def get_new_notifs(self, *args: Any, **kw: Any) -> dict[Any, list[bytes]]:
        got = self.agent.get_new_notifs(*args, **kw)
        for msgs in got.values():
            self.received.extend(bytes(m) for m in msgs)
            for m in msgs:
                if bytes(m).startswith(HEARTBEATS):
                    object.__setattr__(self, "last", time.time())
                    object.__setattr__(self, "count", self.count + 1)
        return got


def install(worker_connector: Any, cls: type) -> Any:
    """Puts a ``cls`` stand-in around the agent of one worker connector."""
    cw = worker_connector.connector_worker
    proxy = cls(cw.nixl_wrapper)
    cw.nixl_wrapper = proxy
    return proxy


class PushWire(AgentProxy):
    """Push mode, either side: the wire under every layer of the connector
    (installed beneath kvlease's notification tap, so kvlease's own messages
    meet the fault too).

    - ``drop``: outgoing notifications starting with any of these prefixes
      are not sent (counted in ``dropped``);
    - ``duplicate``: every notification drained is delivered twice, in one
      drain (counted in ``duplicated``);
    - ``write_delay``: P's WRITEs are posted this many seconds after vLLM
      posts them (None: at once; ``float('inf')``: never). Until then
      ``check_xfer_state`` says ``PROC``, as for a WRITE still on the wire:
      the bytes land only when the delay ends. ``posted`` counts WRITEs vLLM
      posted, ``landed`` the delayed ones really posted since, with their
      wall times in ``landed_at``.

    Every notification sent (``sent``) and drained (``received``, before
    duplication) is kept, for the mixed-fleet cases' wire checks.
    """

    def __init__(self, agent: Any) -> None:
        super().__init__(agent)
        for k, v in (("drop", ()), ("duplicate", False), ("write_delay", None),
                     ("dropped", 0), ("duplicated", 0), ("posted", 0), ("landed", 0),
                     ("landed_at", []), ("_due", {}), ("sent", []), ("received", [])):
            object.__setattr__(self, k, v)

    def send_notif(self, agent_name: Any, notif_msg: bytes = b"", **kw: Any) -> Any:
        raw = notif_msg.encode() if isinstance(notif_msg, str) else bytes(notif_msg)
        if self.drop and raw.startswith(tuple(self.drop)):
            object.__setattr__(self, "dropped", self.dropped + 1)
            return None
        self.sent.append(raw)
        return self.agent.send_notif(agent_name, notif_msg=notif_msg, **kw)

    def get_new_notifs(self, *args: Any, **kw: Any) -> dict[Any, list[bytes]]:
        got = self.agent.get_new_notifs(*args, **kw)
        for msgs in got.values():
            self.received.extend(m.encode() if isinstance(m, str) else bytes(m) for m in msgs)
        if self.duplicate:
            for sender, msgs in got.items():
                object.__setattr__(self, "duplicated", self.duplicated + len(msgs))
                got[sender] = [m for m in msgs for _ in (0, 1)]
        return got

    def transfer(self, handle: Any, *args: Any, **kw: Any) -> Any:
        object.__setattr__(self, "posted", self.posted + 1)
        if self.write_delay is None:
            return self.agent.transfer(handle, *args, **kw)
        self._due[handle] = (time.time() + self.write_delay, args, kw)
        return "PROC"

    def check_xfer_state(self, handle: Any) -> Any:
        due = self._due.get(handle)
        if due is None:
            return self.agent.check_xfer_state(handle)
        at, args, kw = due
        if time.time() < at:
            return "PROC"
        del self._due[handle]
        state = self.agent.transfer(handle, *args, **kw)
        object.__setattr__(self, "landed", self.landed + 1)
        self.landed_at.append(time.time())
        return "PROC" if state in ("DONE", "PROC") else state

    def counts(self) -> dict[str, Any]:
        return {"dropped": self.dropped, "duplicated": self.duplicated, "posted": self.posted,
                "landed": self.landed, "landed_at": list(self.landed_at),
                "waiting": len(self._due)}


def install_push_wire(worker_connector: Any) -> PushWire:
    """Puts a :class:`PushWire` around a push worker's NIXL agent: beneath
    kvlease's notification tap when there is one, else in place of the
    agent."""
    cw = worker_connector.connector_worker
    tap = cw.nixl_wrapper
    if hasattr(tap, "_on_messages") and hasattr(tap, "_agent"):
        wire = PushWire(tap._agent)
        tap._agent = wire
    else:
        wire = PushWire(tap)
        cw.nixl_wrapper = wire
    return wire
