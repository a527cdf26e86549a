"""Where push mode's guard meets vLLM's notifications: the tap on the
writer thread's ``get_new_notifs``.

Owns: taking kvlease's push messages (``PEND:``/``PHB:`` for D, ``PRN:``/
``PRV:`` for P) out of what vLLM's ``nixl-push-writer`` thread drains,
*with* the agent that sent them (vLLM's writer keeps only the bytes), and
putting registrations back that P deferred until it had a clock sample of
their D; and the post of each guarded WRITE, which reaches NIXL only if
the gate the worker armed on that thread lets it through at that very call
(:meth:`NotifTap.transfer`). May not decide anything about a permit:
``push_permits.py`` (D) and ``push_writes.py`` (P) do; the peers' names
are ``push_peers.py``'s.

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
import logging
import threading
from collections.abc import Callable
from typing import Any

from .log_limit import RateLimitedLog

logger = logging.getLogger("vllm.kvlease.push")

#: Prefixes of the guard's messages to D (from P) and to P (from D).
TO_D = (b"PEND:", b"PHB:")
TO_P = (b"PRN:", b"PRV:")
_ALL = TO_D + TO_P
#: The sender name of a registration put back by P (no agent sent it again).
REPLAY = "kvlease-replay"


class GateClosed(RuntimeError):
    """A guarded WRITE's post refused at the post itself: vLLM's WRITE
    submission fails (it logs it and releases the transfer handle), and
    nothing reaches NIXL."""


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
        #: Drains whose kvlease hook raised (vLLM's notifications were
        #: delivered all the same).
        self.hook_failures = 0
        self._log = RateLimitedLog(logger)
        self._local = threading.local()

    @property
    def agent(self) -> Any:
        """vLLM's agent itself."""
        return self._agent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def arm(self, gate: Callable[[], bool]) -> None:
        """Every ``transfer`` on this thread asks ``gate`` first, until
        :meth:`disarm` (the worker arms it around vLLM's posting of one
        guarded request)."""
        self._local.gate = gate

    def disarm(self) -> None:
        self._local.gate = None

    def count_sends(self, prefix: bytes) -> None:
        """From now on this thread counts its ``send_notif`` calls whose
        message starts with ``prefix`` (:meth:`sends`), until
        :meth:`stop_counting`: what vLLM did, not what it was about to do."""
        self._local.count_prefix = prefix
        self._local.sends = 0

    def sends(self) -> int:
        return getattr(self._local, "sends", 0)

    def stop_counting(self) -> None:
        self._local.count_prefix = None

    def send_notif(self, agent_name: Any, *args: Any, **kwargs: Any) -> Any:
        prefix = getattr(self._local, "count_prefix", None)
        if prefix is not None:
            msg = kwargs.get("notif_msg", args[0] if args else b"")
            raw = msg.encode() if isinstance(msg, str) else msg
            if isinstance(raw, (bytes, bytearray)) and raw.startswith(prefix):
                self._local.sends += 1  # an attempt: one that raised may have left
        return self._agent.send_notif(agent_name, *args, **kwargs)

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        """NIXL's post of a prepared transfer, behind the armed gate: the
        gate is checked here, right before NIXL's own call, not where vLLM
        decided to write (a stall between the two, GIL or oneDNN, cannot
        carry a WRITE past D's deadline)."""
        gate = getattr(self._local, "gate", None)
        if gate is not None and not gate():
            raise GateClosed("kvlease: the push gate closed before this WRITE's post")
        return self._agent.transfer(handle, *args, **kwargs)

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
        # vLLM's own notifications are in ``out`` already, and NIXL gave the
        # batch out once: an exception of kvlease's hooks must not cost
        # vLLM any of it. The guard's own messages of a failed hook are
        # lost like a dropped notification, which the guard survives (D's
        # fence, P's hold limit); the failure is counted and logged.
        if ours:
            self._run_hook(self._on_messages, ours)
        if self._on_drain is not None:
            self._run_hook(self._on_drain)
        return out

    def _run_hook(self, hook: Callable[..., None], *args: Any) -> None:
        try:
            hook(*args)
        except Exception as e:
            self.hook_failures += 1
            self._log.warning(
                "tap_hook", "kvlease: the push guard's notification hook failed (%r); "
                "vLLM's notifications of this drain are delivered", e,
            )


class PostGate:
    """The gate of one guarded request's WRITE (P's guard is
    ``push_writes.PrefillPushGuard``), asked by the tap at each post on the
    writer thread. The guard requires P's TP size equal to D's
    and no pipeline parallelism, so a request posts one transfer: the first
    post asks P's guard (``PrefillPushGuard.begin_write``), and any further
    post of the same request is refused (fail closed: an incomplete WRITE
    is answered ``X`` once the posted part ended)."""

    def __init__(self, p: Any, req_id: str, engine: str, on_pass: Callable[[str], None],
                 clock: Callable[[], float]) -> None:
        self._p, self._req_id, self._engine, self._on_pass = p, req_id, engine, on_pass
        self._clock = clock
        self.passed = False
        self.refused = False

    def __call__(self) -> bool:
        if self.passed or self.refused:
            self.refused = True
            return False
        if self._p.begin_write(self._req_id, self._engine, self._clock()):
            self.passed = True
            self._on_pass(self._req_id)
            return True
        self.refused = True
        return False
