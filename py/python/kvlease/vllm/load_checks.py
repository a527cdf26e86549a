"""D worker's lease check after the block READs: which P ranks a request was
read from, the slot READs (one per P rank per step, shared by the checks of
that step), and the verdicts.

Owns: the ``SlotChecker``, the lease adverts learnt at handshake (the only
state the handshake thread writes, under a lock; the heartbeat sender asks
them which P ranks accept packed heartbeats), the P ranks as checker
peers, the slot READs posted with the worker's NIXL agent, and the requests
held between their last block READ and their verdict. May not report
anything to vLLM: ``worker.py`` turns verdicts into ``finished_recving``,
``failed_recving`` and invalid blocks.

Why a slot READ has a time limit: with UCX error handling "none" a READ
against a dead peer may never finish; the request would wait forever. Past
``kv_lease_duration`` the READ counts as failed (so the load fails, and
``kv_load_failure_policy`` applies), never as verified.

Why idle peers go: the checker has room for ``kv_lease_max_peers`` P ranks,
and vLLM forgets a P engine only when it evicts it (an hour idle), so a fleet
whose P engines come and go (autoscaling, restarts) would fill the table and
every load from a new P rank would fail. A peer with no block READ, check or
slot READ in flight is *idle*; one idle for ``kv_lease_duration`` is removed
at the next step, and when the table is full the least recently used idle
peer makes room at once. Its advert is kept (until vLLM forgets the engine),
so a later READ from it adds it again. Only when every peer in a full table
has something in flight is a new P rank refused: that load cannot be
checked, so it fails (``refused: peer table full``), counted with the failed
checks and in ``table_full``, never used unverified.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .._native import LeaseConfig, SlotChecker, encode_read_done
from ..errors import FabricError, KvLeaseError
from .handshake_adverts import UNKNOWN

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
    #: Why its check cannot run (a P rank the checker had no room for); the
    #: load then fails with this verdict.
    refused: str | None = None

    def read_done(self, consumers: int) -> bytes:
        """The read-done for a P that advertises slots (nonce form)."""
        nonce = self.fields[1] if self.fields else None
        return encode_read_done(self.remote_request_id, consumers, nonce, True)


class LoadChecks:
    """See the module docs. Times are ``time.monotonic()`` seconds."""

    def __init__(
        self,
        config: LeaseConfig,
        capacity: int,
        max_peers: int,
        name: str,
        idle_after: float | None = None,
    ) -> None:
        self.checker = SlotChecker(config, capacity, max_peers, name)
        self.read_timeout = config.lease_duration
        self.max_peers = max_peers
        #: A peer with nothing in flight for this long is let go (module docs).
        self.idle_after = config.lease_duration if idle_after is None else idle_after
        self._lock = threading.Lock()
        self._adverts: dict[str | bytes, tuple[int, int, int] | None] = {}
        self._peers: dict[str | bytes, tuple[int, int]] = {}
        self._peer_of: dict[int, tuple[str | bytes, int]] = {}
        #: peer name -> when a READ from it last started (monotonic s).
        self._last_used: dict[str | bytes, float] = {}
        self._next_sweep = float("-inf")
        #: Idle peers let go (after idle_after, or to make room).
        self.evicted = 0
        #: P ranks refused because every peer of a full table was busy.
        self.table_full = 0
        #: Requests whose block READs are under way, by local request id.
        self.recording: dict[str, LeaseRead] = {}
        self._checking: dict[int, LeaseRead] = {}
        self._refused: list[tuple[LeaseRead, str]] = []
        #: checker xfer -> (NIXL handle, posted at, peer)
        self._xfers: dict[int, tuple[Any, float, int]] = {}
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
        for handle, _, _ in self._xfers.values():
            self._release(agent, handle)
        self._xfers.clear()

    # -- peers (adverts written by the handshake thread) -----------------------

    def record_adverts(
        self, agents: dict[Any, str], adverts: dict[Any, tuple[int, int, int] | None]
    ) -> None:
        with self._lock:
            for key, name in agents.items():
                self._adverts[name] = adverts.get(key)

    def accepts_packed(self, agent_name: str | bytes) -> bool:
        """Whether this P rank's advert says it renews on packed (``HBP:``)
        heartbeats, the form D's rounds are encoded in
        (``compact_heartbeats.py``); False for a rank without an advert, or
        whose advert could not be read."""
        with self._lock:
            advert = self._adverts.get(agent_name)
        return getattr(advert, "packed_heartbeats", False) is True

    def peer_for(
        self, agent_name: str | bytes, now: float | None = None, leased: bool = True
    ) -> tuple[int, int] | None:
        """(checker peer, slot array base) of a P rank that advertises lease
        slots, about to be read at ``now`` (monotonic seconds; the current
        time when None); None for one that does not (stock vLLM). Raises
        :class:`kvlease.errors.FabricError` (reason ``"Full"``) when the
        table is full and no peer in it is idle, and (``"Unrecorded"``) for
        a request with lease fields (``leased``) from a rank whose advert was
        never recorded: the caller must fail the load (module docs)."""
        if now is None:
            now = time.monotonic()
        found = self._peers.get(agent_name)
        if found is not None:
            self._last_used[agent_name] = now
            return found
        with self._lock:
            recorded = agent_name in self._adverts
            advert = self._adverts.get(agent_name)
        if not recorded and leased:
            # A request with lease fields (``leased``) comes from a P that
            # exports them: a P rank whose advert was never recorded (a
            # handshake whose replies kvlease did not see) is not a stock P,
            # and such a load is not used unchecked. Without lease fields it
            # reads as stock vLLM reads, as before.
            raise FabricError(
                "kvlease: no lease advert of this P rank was recorded at handshake; "
                "its loads cannot be checked",
                "Unrecorded",
            )
        if advert is None:
            return None
        if advert == UNKNOWN:
            raise FabricError(
                "kvlease: the lease advert of this P rank could not be read at "
                "handshake; its loads cannot be checked",
                "Unknown",
            )
        base, _nbytes, count = advert
        # NIXL hands agent names out as bytes; the checker keys them as text.
        text = agent_name.decode("utf-8", "replace") if isinstance(agent_name, bytes) else agent_name
        if len(self._peers) >= self.max_peers:
            self._make_room()
        peer = self.checker.add_peer(text, count)
        self._peers[agent_name] = (peer, base)
        self._peer_of[peer] = (agent_name, base)
        self._last_used[agent_name] = now
        return peer, base

    def _make_room(self) -> None:
        """Lets the least recently used idle peer go, or raises when none is."""
        busy = self._busy_peers()
        idle = [name for name, (peer, _) in self._peers.items() if peer not in busy]
        if not idle:
            self.table_full += 1
            raise FabricError(
                f"kvlease: all {self.max_peers} P ranks of the lease checker have "
                "checks in flight (kv_lease_max_peers); this load cannot be checked",
                "Full",
            )
        self._remove(min(idle, key=lambda name: self._last_used.get(name, 0.0)))

    def _busy_peers(self) -> set[int]:
        """Peers with a block READ, a check or a slot READ in flight. A scan
        of what is in flight: run only to make room and once per sweep."""
        busy = {peer for _, peer, _ in self._all_reads()}
        busy.update(peer for _, _, peer in self._xfers.values())
        return busy

    def _all_reads(self):
        for lease in self.recording.values():
            yield from lease.reads
        for lease in self._checking.values():
            yield from lease.reads
        for lease, _ in self._refused:
            yield from lease.reads

    def _sweep(self, now: float) -> None:
        """Lets go of every peer idle for ``idle_after`` (module docs)."""
        self._next_sweep = now + self.idle_after
        if not self._peers:
            return
        busy = self._busy_peers()
        cutoff = now - self.idle_after
        for name, (peer, _) in list(self._peers.items()):
            if peer not in busy and self._last_used.get(name, now) <= cutoff:
                self._remove(name)

    def _remove(self, name: str | bytes, idle: bool = True) -> None:
        found = self._peers.pop(name, None)
        self._last_used.pop(name, None)
        if found is None:
            return
        self.evicted += idle
        self._peer_of.pop(found[0], None)
        try:
            self.checker.remove_peer(found[0])
        except KvLeaseError:
            logger.debug("kvlease: removing peer %s failed", name, exc_info=True)

    @property
    def peers(self) -> int:
        """P ranks in the checker's table now."""
        return len(self._peers)

    def forget(self, agent_names: list[str | bytes]) -> None:
        """P ranks whose agents vLLM removed (engine evicted or replaced)."""
        for name in agent_names:
            with self._lock:
                self._adverts.pop(name, None)
            self._remove(name, idle=False)

    # -- checks -----------------------------------------------------------------

    def submit(self, lease: LeaseRead) -> None:
        """Every block READ of ``lease`` completed: check its slot on every P
        rank it read from."""
        if lease.refused is not None:
            self._refused.append((lease, lease.refused))
            return
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
        if now >= self._next_sweep:
            self._sweep(now)
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
            self._xfers[xfer] = (handle, now, peer)
            posted = True
        return posted

    def _poll(self, agent: Any, now: float) -> None:
        for xfer, (handle, posted_at, _peer) in list(self._xfers.items()):
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
