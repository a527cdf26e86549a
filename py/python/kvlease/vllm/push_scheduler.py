"""The scheduler side of ``KvLeaseNixlPushConnector``: vLLM's NIXL push
scheduler, plus the revocations D's workers need.

Owns: deciding which of D's registered requests have their write permit
revoked this step, and handing the list to every worker
(``LeaseStep.push_revokes``). A request is revoked when vLLM lets it go
while it still waits for P's WRITE (an abort: vLLM then keeps its blocks
until the transfer reports, ``_aborted_kv_loads``), or when vLLM's
registration watchdog (``push_registration_timeout``) fires: in stock vLLM
that only logs, here it ends the push, and the load fails once no WRITE can
land (``push_permits.py``). May not free anything itself: the blocks come
back through vLLM's own ``finished_recving`` when the worker reports the
request.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)

from .compat import check_vllm_version
from .metadata import STEP_ATTR, LeaseStep
from .settings import lease_settings


class KvLeasePushScheduler(NixlPushConnectorScheduler):
    """vLLM's NIXL push scheduler with the revocations of the push guard."""

    #: None: no D guard (verification off, or a P-only engine).
    _kvl_revokes: list[str] | None = None

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        check_vllm_version()
        super().__init__(vllm_config, engine_id, kv_cache_config)
        settings = lease_settings(vllm_config, kv_cache_config)
        if settings is not None and settings.consumer:
            self._kvl_revokes = []

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        revokes = self._kvl_revokes
        # Registered and not yet received: vLLM's watchdog still runs for it.
        if revokes is not None and request.request_id in self._push_registration_deadlines:
            revokes.append(request.request_id)
        return super().request_finished(request, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        revokes = self._kvl_revokes
        if revokes is not None:
            # vLLM's watchdog, read before vLLM's own pass drops the entries
            # (same clock, same order: the deadlines are in arrival order).
            now = time.perf_counter()
            for rid, deadline in self._push_registration_deadlines.items():
                if deadline > now:
                    break
                revokes.append(rid)
        meta = super().build_connector_meta(scheduler_output)
        if revokes:
            step = getattr(meta, STEP_ATTR, None)
            if step is None:
                step = LeaseStep()
                setattr(meta, STEP_ATTR, step)
            step.push_revokes = list(revokes)
            revokes.clear()
        return meta
