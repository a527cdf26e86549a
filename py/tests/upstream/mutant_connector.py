"""A deliberately broken substitute: the negative control for
kvlease_substitute.py. Its worker ignores heartbeats and never reaps an
expired lease, so vLLM's own heartbeat tests must fail when it stands in for
vLLM's worker. If they passed, the substitution would not be reaching the code
under test, and a passing substituted run would prove nothing.

Owns: two no-op overrides on an otherwise pass-through worker. Used only by
``py/ci/run-upstream.sh mutant``.
"""

from __future__ import annotations

from passthrough_connector import CALLS, PassthroughConnector, PassthroughScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)


class MutantWorker(NixlPullConnectorWorker):
    """Drops every heartbeat and never reclaims an expired lease."""

    def _handle_heartbeat(self, payload: str) -> None:
        CALLS["MutantWorker._handle_heartbeat"] += 1

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        CALLS["MutantWorker._reap_expired_send_leases"] += 1


UPSTREAM_SUBSTITUTES = {
    "connector": PassthroughConnector,
    "scheduler": PassthroughScheduler,
    "worker": MutantWorker,
}
