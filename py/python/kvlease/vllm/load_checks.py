"""D worker's lease check after the block READs: which P ranks a request was
read from, the slot READs (one per P rank per step, shared by the checks of
that step), and the verdicts.

Owns: the ``SlotChecker``, the lease adverts learnt at handshake (the only
state the handshake thread writes, under a lock), the P ranks as checker
peers, the slot READs posted with the worker's NIXL agent, and the requests
held between their last block READ and their verdict. May not report
anything to vLLM: ``worker.py`` turns verdicts into ``finished_recving``,
``failed_recving`` and invalid blocks.

Why a slot READ has a time limit: with UCX error handling "none" a READ
against a dead peer may never finish; the request would wait forever. Past
``kv_lease_duration`` the READ counts as failed (so the load fails, and
``kv_load_failure_policy`` applies), never as verified.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from .._native import LeaseConfig, SlotChecker, encode_read_done
from ..errors import KvLeaseError

logger = logging.getLogger("vllm.kvlease.check")


@dataclass
class LeaseRead:
    """One request's pull, from its first block READ to its verdict."""

    request_id: str
    remote_request_id: str
    #: (remote_lease_slot, remote_lease_nonce), or None when P exported none.
    fields: tuple[int, int] | None
    #: Its local blocks (group 0), reported invalid when the check fails;
    #: None under vLLM's hybrid allocator, where vLLM reports by request only.
    blocks: list[int] | None
    #: (P agent name, checker peer, consumers) of every READ whose read-done
    #: is held for the verdict.
    reads: list[tuple[str, int, int]] = field(default_factory=list)
    #: Some READ went to a P that exports no lease slots.
    unverified: bool = False

    def read_done(self, consumers: int) -> bytes:
        """The read-done for a P that advertises slots (nonce form)."""
        nonce = self.fields[1] if self.fields else None
        return encode_read_done(self.remote_request_id, consumers, nonce, True)


class LoadChecks:
    """See the module docs. Times are ``time.monotonic()`` seconds."""

    def __init__(
        self, config: LeaseConfig, capacity: int, max_peers: int, name: str
    ) -> None:
        self.checker = SlotChecker(config, capacity, max_peers, name)
        self.read_timeout = config.lease_duration
        self._lock = threading.Lock()
        self._adverts: dict[str | bytes, tuple[int, int, int] | None] = {}
        self._peers: dict[str | bytes, tuple[int, int]] = {}
        self._peer_of: dict[int, tuple[str | bytes, int]] = {}
        #: Requests whose block READs are under way, by local request id.
        self.recording: dict[str, LeaseRead] = {}
        self._checking: dict[int, LeaseRead] = {}
        self._refused: list[tuple[LeaseRead, str]] = []
        #: checker xfer -> (NIXL handle, posted at)
        self._xfers: dict[int, tuple[Any, float]] = {}
        self._next_token = 1

    # -- setup ---------------------------------------------------------------

    def register_landing(self, agent: Any, backends: list[str]) -> None:
        """Registers the buffers slot READs land in (DRAM). Raises what NIXL
        raises: a verifying instance that cannot must not start."""
        regions = self.checker.landing_regions()
        descs = agent.get_reg_descs([(a, n, 0, "") for a, n in regions], "DRAM")
        agent.register_memory(descs, backends=backends)

    def release_reads(self, agent: Any) -> None:
        """Shutdown: releases the slot READs still in flight."""
        for handle, _ in self._xfers.values():
            self._release(agent, handle)
        self._xfers.clear()

    # -- peers (adverts written by the handshake thread) -----------------------

    def record_adverts(
        self, agents: dict[Any, str], adverts: dict[Any, tuple[int, int, int] | None]
    ) -> None:
        with self._lock:
            for key, name in agents.items():
                self._adverts[name] = adverts.get(key)

    def peer_for(self, agent_name: str | bytes) -> tuple[int, int] | None:
        """(checker peer, slot array base) of a P rank that advertises lease
        slots; None for one that does not (stock vLLM)."""
        found = self._peers.get(agent_name)
        if found is not None:
            return found
        with self._lock:
            advert = self._adverts.get(agent_name)
        if advert is None:
            return None
        base, _nbytes, count = advert
        # NIXL hands agent names out as bytes; the checker keys them as text.
        text = agent_name.decode("utf-8", "replace") if isinstance(agent_name, bytes) else agent_name
        peer = self.checker.add_peer(text, count)
        self._peers[agent_name] = (peer, base)
        self._peer_of[peer] = (agent_name, base)
        return peer, base

    def forget(self, agent_names: list[str | bytes]) -> None:
        """P ranks whose agents vLLM removed (engine evicted or replaced)."""
        for name in agent_names:
            with self._lock:
                self._adverts.pop(name, None)
            found = self._peers.pop(name, None)
            if found is not None:
                self._peer_of.pop(found[0], None)
                try:
                    self.checker.remove_peer(found[0])
                except KvLeaseError:
                    logger.debug("kvlease: removing peer %s failed", name, exc_info=True)

    # -- checks -----------------------------------------------------------------

    def submit(self, lease: LeaseRead) -> None:
        """Every block READ of ``lease`` completed: check its slot on every P
        rank it read from."""
        token = self._next_token
        self._next_token += 1
        peers = sorted({peer for _, peer, _ in lease.reads})
        slot, nonce = lease.fields if lease.fields is not None else (None, None)
        try:
            self.checker.submit(token, slot, nonce, peers)
        except KvLeaseError as e:
            self._refused.append((lease, f"refused: {e.reason or e}"))
            return
        self._checking[token] = lease

    def step(self, agent: Any, now: float) -> list[tuple[LeaseRead, str]]:
        """Polls the slot READs, decides what can be decided, posts the
        READs the new checks need, and (a READ over shared memory often
        finishes at once) decides again. Returns ``(lease, verdict)``."""
        out = self._refused
        self._refused = []
        for _ in range(2):
            self._poll(agent, now)
            for token, verdict in self.checker.step(now):
                lease = self._checking.pop(token, None)
                if lease is not None:
                    out.append((lease, verdict))
            if not self._post(agent, now):
                break
        return out

    def _post(self, agent: Any, now: float) -> bool:
        posted = False
        for xfer, peer, descs in self.checker.take_reads():
            found = self._peer_of.get(peer)
            if found is None:
                self.checker.complete(xfer, False, "peer gone")
                continue
            name, base = found
            handle = None
            try:
                local = agent.get_xfer_descs([(a, n, 0) for a, _, n in descs], "DRAM")
                remote = agent.get_xfer_descs([(base + off, n, 0) for _, off, n in descs], "DRAM")
                handle = agent.initialize_xfer("READ", local, remote, name)
                state = agent.transfer(handle)
            except Exception as e:
                logger.warning("kvlease: slot READ from %s could not be posted: %s", name, e)
                if handle is not None:
                    self._release(agent, handle)
                self.checker.complete(xfer, False, str(e))
                continue
            if state == "ERR":
                self._release(agent, handle)
                self.checker.complete(xfer, False, "ERR")
                continue
            self._xfers[xfer] = (handle, now)
            posted = True
        return posted

    def _poll(self, agent: Any, now: float) -> None:
        for xfer, (handle, posted_at) in list(self._xfers.items()):
            try:
                state = agent.check_xfer_state(handle)
            except Exception as e:
                state = f"ERR ({e})"
            if state == "PROC" and now - posted_at < self.read_timeout:
                continue
            if state == "PROC":
                state = "timed out"
            del self._xfers[xfer]
            self._release(agent, handle)
            self.checker.complete(xfer, state == "DONE", None if state == "DONE" else state)

    @staticmethod
    def _release(agent: Any, handle: Any) -> None:
        try:
            agent.release_xfer_handle(handle)
        except Exception:
            logger.debug("kvlease: slot READ handle release failed", exc_info=True)

    def idle(self) -> bool:
        """Nothing recorded, checked, or in flight (the leak check of tests)."""
        return not (
            self.recording or self._checking or self._refused or self._xfers
        ) and self.checker.waiting == 0
