"""kvlease's counters in vLLM's KV connector stats and Prometheus metrics.

Owns: the stats class the connector reports through vLLM's hooks (a
``NixlKVConnectorStats`` with kvlease's keys added, so vLLM's own NIXL
figures keep flowing unchanged) and the Prometheus counters for those keys.
May not decide anything: the roles record events here.

Each key holds one list entry per event (the count of the event, usually 1),
the convention of vLLM's NIXL stats: ``aggregate`` concatenates the lists of
the workers and the scheduler, ``reduce`` sums them for the log line, and
Prometheus counters are incremented by every entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

#: key -> (log label, Prometheus name, Prometheus help). The first five are
#: recorded on P's scheduler, the next four on D's workers, the next on D's
#: scheduler; the ``kv_push_*`` keys by push mode's workers
#: (``push_worker.py``).
LEASE_KEYS: dict[str, tuple[str, str, str]] = {
    "kv_lease_granted": (
        "KV leases granted",
        "vllm:kv_lease_granted",
        "P: leases granted with a lease slot (verifiable by D).",
    ),
    "kv_lease_unslotted": (
        "KV leases without slot",
        "vllm:kv_lease_unslotted",
        "P: requests served without lease fields (no free slot, an id kvlease "
        "cannot hold, or its capacity reached); verifying decoders fail their loads.",
    ),
    "kv_lease_released_read": (
        "KV leases read",
        "vllm:kv_lease_released_read",
        "P: leases released because every reader reported its READ done.",
    ),
    "kv_lease_expired": (
        "KV leases expired",
        "vllm:kv_lease_expired",
        "P: leases reclaimed because no heartbeat renewed them (D gone or slow).",
    ),
    "kv_lease_cancelled": (
        "KV leases cancelled",
        "vllm:kv_lease_cancelled",
        "P: leases of requests aborted on P.",
    ),
    "kv_lease_verified": (
        "KV loads verified",
        "vllm:kv_lease_verified_loads",
        "D: KV loads whose lease slot still held the nonce after the READ.",
    ),
    "kv_lease_failed_checks": (
        "KV lease checks failed",
        "vllm:kv_lease_failed_checks",
        "D: KV loads failed by the lease check (lapsed lease, missing lease "
        "fields, failed slot READ, no room in the checker, or a P without lease "
        "slots under kv_lease_require_verification); kv_load_failure_policy applied.",
    ),
    "kv_lease_unverified": (
        "KV loads unverified",
        "vllm:kv_lease_unverified_loads",
        "D: KV loads from a P that exports no lease slots (stock vLLM), used as "
        "stock vLLM uses them (kv_lease_require_verification off).",
    ),
    "kv_lease_advert_unknown": (
        "KV lease adverts unreadable",
        "vllm:kv_lease_advert_unknown",
        "D: P ranks whose lease advert could not be read at handshake; loads from "
        "them fail closed (kv_load_failure_policy applies).",
    ),
    "kv_lease_late_heartbeat_rounds": (
        "KV lease heartbeat rounds late",
        "vllm:kv_lease_late_heartbeat_rounds",
        "D: heartbeat rounds that went out more than the lease extension minus the "
        "heartbeat interval after the last one (a stalled or starved engine); P may "
        "have let the waiting requests' leases go.",
    ),
    "kv_push_permits": (
        "KV push permits",
        "vllm:kv_push_permits",
        "D (push): registrations sent to P with a write permit.",
    ),
    "kv_push_failed": (
        "KV pushes failed",
        "vllm:kv_push_failed",
        "D (push): KV loads failed because the push cannot come (P refused it, ended "
        "it unwritten, or its permit lapsed or was revoked) or could not be guarded; "
        "each once no WRITE of P could land; kv_load_failure_policy applied.",
    ),
    "kv_push_unguarded": (
        "KV pushes unguarded",
        "vllm:kv_push_unguarded",
        "D (push): registrations sent to a P without the push guard (stock vLLM), "
        "as stock vLLM sends them (kv_lease_require_verification off).",
    ),
    "kv_push_written": (
        "KV push WRITEs",
        "vllm:kv_push_written",
        "P (push): guarded WRITEs that reached their end (completed or failed).",
    ),
    "kv_push_refused": (
        "KV push registrations refused",
        "vllm:kv_push_refused",
        "P (push): registrations answered at once without a WRITE (P let the "
        "request go, no clock sample of D, or D's deadline already past).",
    ),
    "kv_push_late_writes": (
        "KV push WRITEs late",
        "vllm:kv_push_late_writes",
        "P (push): guarded WRITEs that ended more than kv_lease_push_write_bound after "
        "P posted them. Past that bound D may have freed the blocks: raise the bound "
        "above the transport's own give-up time (docs/push.md).",
    ),
    "kv_push_holds_ended": (
        "KV push holds ended",
        "vllm:kv_push_holds_ended",
        "P (push): releases of P's blocks held back for a guarded WRITE that never "
        "ended, let go at the hold bound (2 x write bound + extension + write bound "
        "after the post): D's fence has passed by then (docs/push.md).",
    ),
    "kv_push_gate_closed": (
        "KV push WRITEs not posted",
        "vllm:kv_push_gate_closed",
        "P (push): WRITEs the gate did not let through (revoked, or D's deadline too "
        "close on P's clock); D was told, nothing was written.",
    ),
}


@dataclass
class KvLeaseConnectorStats(NixlKVConnectorStats):
    """vLLM's NIXL stats plus kvlease's event counts."""

    def reset(self) -> None:
        super().reset()
        for key in LEASE_KEYS:
            self.data[key] = []

    def record_lease(self, key: str, count: int = 1) -> None:
        """Records ``count`` events of ``key`` (one of :data:`LEASE_KEYS`)."""
        if count:
            self.data.setdefault(key, []).append(count)

    def lease_total(self, key: str) -> int:
        return int(sum(self.data.get(key, ())))

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(k) for k in LEASE_KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for k, v in other.data.items():
                # setdefault: a peer object built from data without some key
                # (an older worker) must not raise here.
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        out = super().reduce()
        # Data of an engine that runs without kvlease (verification off) has
        # none of these keys: its log line stays vLLM's.
        if any(key in self.data for key in LEASE_KEYS):
            for key, (label, _, _) in LEASE_KEYS.items():
                out[label] = self.lease_total(key)
        return out


class KvLeasePromMetrics(NixlPromMetrics):
    """vLLM's NIXL metrics plus one counter per kvlease key."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.kv_lease_counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                self.per_engine_labelvalues,
            )
            for key, (_, name, doc) in LEASE_KEYS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        super().observe(transfer_stats_data, engine_idx)
        for key, counter in self.kv_lease_counters.items():
            for n in transfer_stats_data.get(key, ()):
                counter[engine_idx].inc(n)


class KvLeaseStatsHooks:
    """The connector-level hooks that hand vLLM kvlease's stats and metrics
    classes; both connectors (pull and push) inherit them."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KvLeaseConnectorStats(data=data) if data is not None else KvLeaseConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvLeasePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
