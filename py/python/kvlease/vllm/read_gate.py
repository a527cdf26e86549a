"""A stand-in for the D worker's NIXL agent during one of vLLM's
``_read_blocks`` calls: it posts the block READs without their read-done.

Owns: stripping the notification from ``make_prepped_xfer`` (kept for after
the slot check) and rewriting a standalone read-done (``send_notif``, the
nothing-to-read path) into the nonce form. May not change any other call:
everything else goes to the real agent unchanged.

Why a stand-in and not an override of ``_read_blocks``: vLLM builds the
descriptor ids, the prefix-cache trims and the failure handling inside
``_read_blocks``; swapping the agent for the length of that call keeps all of
it vLLM's, and only the notification changes. The seed requires it: the
read-done of a verified load goes out after the check, never with the READ
(P would zero the slot first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# make_prepped_xfer(operation, local, local_ids, remote, remote_ids, notif_msg, ...)
_NOTIF_POSITION = 5


class HeldReadDones:
    """Forwards every attribute to ``agent`` except the two notification paths."""

    def __init__(self, agent: Any, rewrite: Callable[[bytes], bytes]) -> None:
        object.__setattr__(self, "agent", agent)
        object.__setattr__(self, "_rewrite", rewrite)
        object.__setattr__(self, "stripped", [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.agent, name, value)

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) > _NOTIF_POSITION:
            notif = args[_NOTIF_POSITION]
            args = (*args[:_NOTIF_POSITION], b"", *args[_NOTIF_POSITION + 1 :])
        else:
            notif = kwargs.pop("notif_msg", b"")
            kwargs["notif_msg"] = b""
        if notif:
            self.stripped.append(notif)
        return self.agent.make_prepped_xfer(*args, **kwargs)

    def send_notif(self, agent_name: str, notif_msg: bytes = b"", **kwargs: Any) -> Any:
        return self.agent.send_notif(agent_name, notif_msg=self._rewrite(notif_msg), **kwargs)
