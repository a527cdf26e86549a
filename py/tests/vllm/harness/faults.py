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
