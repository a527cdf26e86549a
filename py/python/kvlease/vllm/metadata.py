"""What kvlease adds to vLLM's connector channels, as plain picklable objects.

Owns: the per-step lease message from the scheduler to every worker
(:class:`LeaseStep`, an attribute of vLLM's ``NixlConnectorMetadata``: P's
directives, D's lease fields and compact heartbeats), the
per-step reports from the P workers to the scheduler (:class:`LeaseReports`,
vLLM's worker-metadata channel), and the handshake payload that carries a P
worker's lease advert (:class:`KvLeaseHandshakePayload`). May not interpret
any of the bytes: the Rust roles encode and decode them.

Why an attribute and not a subclass for the step message: vLLM's scheduler
builds the ``NixlConnectorMetadata`` object itself (``build_connector_meta``),
and the object is pickled to the workers with its ``__dict__``, so an
attribute travels with it unchanged.

Why the advert rides in the handshake payload: a stock vLLM D decodes the
payload with ``msgspec`` into ``NixlHandshakePayload``, which ignores fields
it does not know (tested in ``py/tests/vllm/test_metadata.py``), and a stock P
simply has no such field, which a kvlease D reads as "no lease slots".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

from .compact_heartbeats import CompactRound

#: The attribute of ``NixlConnectorMetadata`` that holds this step's :class:`LeaseStep`.
STEP_ATTR = "kv_lease"


@dataclass
class LeaseStep:
    """The scheduler's lease message for this step, identical for every worker."""

    #: P: ``PrefillScheduler.encode_directives`` (b"" when none).
    directives: bytes = b""
    #: D: ``{local request id: (remote_lease_slot, remote_lease_nonce)}`` of
    #: the requests whose READs start this step, as P exported them (the
    #: keys of ``kv_transfer_params`` vLLM drops on the way to the worker).
    read_fields: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: D, in a heartbeat round only: ``{P engine id: CompactRound}``, the
    #: round's heartbeats for the P agents that accept packed ones
    #: (``compact_heartbeats.py``).
    heartbeats: dict[str, CompactRound] = field(default_factory=dict)
    #: D in push mode: the requests whose write permit D revokes this step
    #: (aborted while waiting for P's WRITE, or past vLLM's registration
    #: watchdog): ``push_permits.py``.
    push_revokes: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return (
            not self.directives
            and not self.read_fields
            and not self.heartbeats
            and not self.push_revokes
        )


class LeaseReports(KVConnectorWorkerMetadata):
    """The P workers' lease reports of one step, as ``(rank, bytes)`` pairs
    (``PrefillRank.encode_reports``). vLLM folds the ranks' objects with
    :meth:`aggregate`."""

    def __init__(self, reports: list[tuple[int, bytes]] | None = None) -> None:
        self.reports: list[tuple[int, bytes]] = list(reports or ())

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, LeaseReports):
            # A list, not a dict by rank: two workers claiming one rank would
            # be a bug, and the scheduler's sequence check must see both.
            self.reports.extend(other.reports)
        return self

    def __repr__(self) -> str:
        return f"LeaseReports({[(r, len(m)) for r, m in self.reports]})"


@dataclass
class KvLeaseHandshakePayload(NixlHandshakePayload):
    """vLLM's handshake payload plus this worker's lease advert
    (``kvlease.lease_advert``: its slot array's address, size and count;
    b"" when it exports none)."""

    kv_lease_advert: bytes = b""
    #: Push mode: the version of kvlease's push guard this worker's P side
    #: speaks (``push_writes.py``; 0: none, so a kvlease D sends it vLLM's
    #: own ``PUSH_REG``).
    kv_push_guard: int = 0
