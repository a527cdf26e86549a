"""``KvLeaseNixlConnector``: vLLM's NIXL pull connector (vLLM 0.32 to 0.34)
with kvlease's lease slots, nonces and post-READ verification, loaded through
``kv_connector_module_path``.

Owns: building kvlease's scheduler or worker for the process's role, and the
connector-level hooks vLLM's NIXL facade does not forward (the worker
metadata, the scheduler's stats, the stats and metrics classes). May not do
lease work itself: ``scheduler.py`` and ``worker.py`` do.

Why ``NixlBaseConnector.__init__`` and not ``super().__init__``:
``NixlPullConnector.__init__`` builds vLLM's own scheduler or worker, and a
worker opens a NIXL agent; building that and replacing it would leave an agent
behind. This class builds its own instead, as ``NixlPullConnector`` does.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)

from .compat import check_vllm_version
from .composition import refuse_multi_connector_on_p
from .scheduler import KvLeaseScheduler
from .stats import KvLeaseStatsHooks
from .worker import KvLeaseWorker


class KvLeaseNixlConnector(KvLeaseStatsHooks, NixlPullConnector):
    """vLLM's NIXL pull connector with verified KV loads. Configure it with
    ``{"kv_connector": "KvLeaseNixlConnector", "kv_connector_module_path":
    "kvlease.vllm"}`` (see ``docs/vllm.md``)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        check_vllm_version()
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvLeaseScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvLeaseWorker(vllm_config, self.engine_id, kv_cache_config)

    def register_kv_caches(self, kv_caches: Any) -> None:
        worker = self.connector_worker
        if isinstance(worker, KvLeaseWorker) and worker.kvl_holds_leases():
            refuse_multi_connector_on_p(self)
        super().register_kv_caches(kv_caches)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        worker = self.connector_worker
        if isinstance(worker, KvLeaseWorker):
            return worker.kvl_worker_meta()
        return None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector_worker is not None:
            return super().get_kv_connector_stats()
        scheduler = self.connector_scheduler
        if isinstance(scheduler, KvLeaseScheduler):
            return scheduler.kvl_take_stats()
        return None

