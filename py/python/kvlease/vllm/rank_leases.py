"""One P worker's share of the leases: the Rust ``PrefillRank``, its slot
array registered with the worker's NIXL agent, and the notifications routed
to it.

Owns: the slot array's registration and advert, applying the scheduler's
directives, feeding heartbeats and read-dones to the rank, the per-step poll
(expiry), and the reports back. May not touch vLLM's lease dict: requests
kvlease does not hold keep vLLM's own handling (``worker.py``).

Why no every-entry scan: ``PrefillRank.poll`` fires the leases that are due
from a timer wheel, O(expired + 1) per step; a heartbeat costs O(ids in it).
"""

from __future__ import annotations

import logging
from typing import Any

from .._native import LeaseConfig, PrefillRank, lease_advert
from ..errors import IpcError, KvLeaseError

logger = logging.getLogger("vllm.kvlease.rank")

#: What the rank did with a read-done that settles it as kvlease's.
HANDLED_READ_DONES = frozenset({"share_released", "counted", "stale_nonce", "duplicate_sender"})


class RankLeases:
    """P worker ``rank``'s leases (see the module docs)."""

    def __init__(self, config: LeaseConfig, rank: int, now: float) -> None:
        self.rank = PrefillRank(config, rank, now)
        self.index = rank
        #: Messages that decoded neither as kvlease's nor as vLLM's.
        self.malformed = 0

    def register(self, agent: Any, backends: list[str]) -> None:
        """Registers the slot array with ``agent`` as DRAM, the way vLLM
        registers its KV caches. Raises whatever NIXL raises: a verifying
        instance that cannot register its slots must not start."""
        descs = agent.get_reg_descs(
            [(self.rank.slots_address, self.rank.slots_nbytes, 0, "")], "DRAM"
        )
        agent.register_memory(descs, backends=backends)

    def advert(self) -> bytes:
        """The 32-byte advert a kvlease D reads from the handshake payload.
        It says the rank accepts compact and packed heartbeats: the worker
        hands every ``HBC:`` and ``HBP:`` message to the rank (``worker.py``,
        ``_get_new_notifs``)."""
        r = self.rank
        return lease_advert(
            r.slots_address, r.slots_nbytes, r.slot_count,
            compact_heartbeats=True, packed_heartbeats=True,
        )

    def apply_directives(self, msg: bytes, now: float) -> None:
        if not msg:
            return
        try:
            self.rank.apply_directives(msg, now)
        except IpcError as e:
            logger.error("kvlease: rank %d refused a directive message: %s", self.index, e)

    def on_heartbeat(self, sender: str, msg: bytes, now: float) -> None:
        try:
            self.rank.on_notification(sender, msg, now)
        except KvLeaseError:
            self.malformed += 1

    def on_read_done(self, sender: str, msg: bytes, now: float) -> bool:
        """Whether kvlease settled this read-done (else vLLM's handling runs)."""
        try:
            _, _, outcome = self.rank.on_notification(sender, msg, now)
        except KvLeaseError:
            return False
        return outcome in HANDLED_READ_DONES

    def poll(self, now: float) -> None:
        self.rank.poll(now)

    def reports(self) -> bytes:
        return self.rank.encode_reports()
