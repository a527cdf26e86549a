"""kvlease for vLLM: ``KvLeaseNixlConnector``, vLLM's NIXL pull connector
with lease slots, nonces and verified KV loads; and
``KvLeaseNixlPushConnector``, vLLM's NIXL push connector with write permits
(docs/push.md).

Load it unmodified through vLLM's ``kv_connector_module_path``::

    --kv-transfer-config '{"kv_connector": "KvLeaseNixlConnector",
                           "kv_connector_module_path": "kvlease.vllm", ...}'

Supported vLLM: ``>=0.32,<0.35`` (checked here, at import, and again when a
connector is built; ``compat.py`` says how the version is read). See
``docs/vllm.md``.
"""

from __future__ import annotations

from .compat import SUPPORTED, UnsupportedVllmVersion, check_vllm_version

check_vllm_version()

from .connector import KvLeaseNixlConnector  # noqa: E402
from .push_connector import KvLeaseNixlPushConnector  # noqa: E402
from .scheduler import KvLeaseScheduler  # noqa: E402
from .stats import KvLeaseConnectorStats, KvLeasePromMetrics  # noqa: E402
from .worker import KvLeaseWorker  # noqa: E402
from .composition import register_by_name  # noqa: E402

# MultiConnector rebuilds a child's stats by its class name (composition.py).
register_by_name("KvLeaseNixlConnector", __name__)
register_by_name("KvLeaseNixlPushConnector", __name__)

__all__ = [
    "KvLeaseNixlConnector",
    "KvLeaseNixlPushConnector",
    "KvLeaseScheduler",
    "KvLeaseWorker",
    "KvLeaseConnectorStats",
    "KvLeasePromMetrics",
    "SUPPORTED",
    "UnsupportedVllmVersion",
    "check_vllm_version",
]
