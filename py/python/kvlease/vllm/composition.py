"""kvlease inside vLLM's ``MultiConnector``: what is refused, and the name
vLLM rebuilds kvlease's stats by.

Owns: the start-up refusal of a kvlease P inside a ``MultiConnector`` (for
example NIXL plus an offloading connector), and registering
``KvLeaseNixlConnector`` by name with vLLM's connector factory. May not
change how either connector works.

Why P is refused: ``MultiConnector`` counts a request's ``finished_sending``
per worker, once per child connector that asked to keep the blocks
(``_extra_async_saves``), before vLLM frees them. A kvlease P reports its
released leases from the scheduler, not from the workers, so that count
would be satisfied by the other child alone, or the lease's release would
free blocks an offloading child is still reading, and wrong KV would land in
the offload cache under a prefix hash. Until kvlease reports releases from
its workers, a P composed this way does not start, and says why. A D inside
a ``MultiConnector`` is fine: only one child loads a request, and kvlease's
D reports its loads from its workers as vLLM's does.

Why register the name: ``MultiConnector.build_kv_connector_stats`` rebuilds
each child's stats with ``KVConnectorFactory.get_connector_class_by_name``,
which knows only registered names; an out-of-tree class loaded through
``kv_connector_module_path`` is not one, so vLLM's stats logging raised
``ValueError: Connector 'KvLeaseNixlConnector' is not registered``.
"""

from __future__ import annotations

from typing import Any

MULTI_CONNECTOR_ON_P = (
    "kvlease: KvLeaseNixlConnector on a prefill instance (kv_role kv_producer or kv_both) inside "
    "vLLM's MultiConnector is not supported: MultiConnector counts each request's "
    "finished transfers per worker, while kvlease releases P's blocks from its "
    "scheduler, so blocks could be freed while another connector (an offloader) still "
    "reads them. Run KvLeaseNixlConnector alone on P, or set kv_lease_verification to "
    "false in its kv_connector_extra_config to run it as vLLM's NixlConnector "
    "(docs/vllm.md, Limits)."
)


def refuse_multi_connector_on_p(connector: Any) -> None:
    """Raises ``RuntimeError`` when ``connector`` (a worker-side kvlease
    connector holding P leases) is a child of the process's MultiConnector.
    Called while the worker registers its KV caches, when vLLM has set the
    process's connector."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    if not has_kv_transfer_group():
        return
    group = get_kv_transfer_group()
    if isinstance(group, MultiConnector) and any(c is connector for c in group.sub_connectors):
        raise RuntimeError(MULTI_CONNECTOR_ON_P)


def register_by_name(name: str, module: str) -> None:
    """Registers ``name`` (a class of ``module``) with vLLM's connector
    factory, unless something already holds the name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(name, module, name)
    except ValueError:
        pass  # already registered (this module imported twice, or another copy)
