"""``KvLeaseNixlPushConnector``: vLLM's NIXL push connector (vLLM 0.32 to
0.34) with kvlease's push guard, loaded through ``kv_connector_module_path``.

Owns: building kvlease's push scheduler or worker for the process's role,
and the connector-level hooks (stats). May not guard anything itself:
``push_scheduler.py`` and ``push_worker.py`` do (docs/push.md).

Why ``NixlBaseConnector.__init__`` and not ``super().__init__``: as for the
pull connector (``connector.py``), ``NixlPushConnector.__init__`` builds
vLLM's own worker, which opens a NIXL agent and starts vLLM's writer thread;
this class builds its own instead.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPushConnector,
)

from .compat import check_vllm_version
from .push_scheduler import KvLeasePushScheduler
from .push_worker import KvLeasePushWorker
from .stats import KvLeaseStatsHooks


class KvLeaseNixlPushConnector(KvLeaseStatsHooks, NixlPushConnector):
    """vLLM's NIXL push connector with kvlease's write permits: D never waits
    for good on a push that cannot come, and never frees blocks a WRITE of P
    can still land in. Configure it with ``{"kv_connector":
    "KvLeaseNixlPushConnector", "kv_connector_module_path": "kvlease.vllm"}``
    on both P and D (see ``docs/push.md``)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        check_vllm_version()
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError(
                "KvLeaseNixlPushConnector (like NixlPushConnector) does not support "
                "decode_context_parallel_size > 1."
            )
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvLeasePushScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KvLeasePushWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")

