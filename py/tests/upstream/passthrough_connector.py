"""Pass-through subclasses of vLLM 0.34.0's NIXL pull connector, scheduler and
worker: the prototype that proves kvlease_substitute.py puts a subclass under
vLLM's own tests, and that those tests then run through it.

Owns: three subclasses that change no behaviour and count every call of the
hooks a lease plugin overrides (``CALLS``, keyed ``Class.method``). May not
change what any hook returns or does; the real plugin
(kvlease.vllm.connector) takes their place once it exists.

Each hook is wrapped explicitly by name, and a name vLLM no longer defines
fails at import: a vLLM upgrade that renames a hook shows up here first.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

CALLS: Counter[str] = Counter()

SCHEDULER_HOOKS = (
    "__init__",
    "on_new_request",
    "_stop_heartbeat",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)
WORKER_HOOKS = (
    "__init__",
    "_nixl_handshake",
    "start_load_kv",
    "_read_blocks",
    "get_finished",
    "get_transfer_results",
    "_get_new_notifs",
    "_handle_heartbeat",
    "_reap_expired_send_leases",
    "_pop_done_transfers",
    "_send_heartbeats",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
)
CONNECTOR_HOOKS = (
    "__init__",
    "on_new_request",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "start_load_kv",
    "get_finished",
    "get_block_ids_with_load_errors",
)


def _count_calls(cls: type, hooks: tuple[str, ...]) -> type:
    """Override each hook on ``cls`` with a wrapper that counts, then delegates."""
    base = cls.__mro__[1]
    for name in hooks:
        original = getattr(base, name)  # AttributeError: vLLM renamed a hook
        if not callable(original):
            raise TypeError(f"{base.__name__}.{name} is not a method")

        def make(name: str = name, original: Any = original):
            @functools.wraps(original)
            def wrapper(self, *args, **kwargs):
                CALLS[f"{cls.__name__}.{name}"] += 1
                return original(self, *args, **kwargs)

            return wrapper

        setattr(cls, name, make())
    return cls


@functools.partial(_count_calls, hooks=SCHEDULER_HOOKS)
class PassthroughScheduler(NixlPullConnectorScheduler):
    """vLLM's pull scheduler, counted."""


@functools.partial(_count_calls, hooks=WORKER_HOOKS)
class PassthroughWorker(NixlPullConnectorWorker):
    """vLLM's pull worker, counted."""


@functools.partial(_count_calls, hooks=CONNECTOR_HOOKS)
class PassthroughConnector(NixlPullConnector):
    """vLLM's pull connector, counted. Its inherited ``__init__`` builds the
    scheduler and worker from ``nixl.connector``'s globals, which the substitution
    plugin rebinds to the two classes above."""


UPSTREAM_SUBSTITUTES = {
    "connector": PassthroughConnector,
    "scheduler": PassthroughScheduler,
    "worker": PassthroughWorker,
}
