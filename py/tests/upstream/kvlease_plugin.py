"""The real kvlease plugin classes as the substitutes of vLLM's NIXL pull
connector, scheduler and worker, for ``py/ci/run-upstream.sh plugin``.

Owns: naming ``kvlease.vllm``'s classes in ``UPSTREAM_SUBSTITUTES`` (the very
classes ``kv_connector_module_path`` loads, not subclasses of them) and
counting, per hook, how often vLLM's tests called one of their overrides and
how often the call found kvlease state active (``CALLS``: ``Class.hook`` and
``Class.hook [kvlease]``). May not change any behaviour: each counting
wrapper calls the override it wraps.

Why wrap in place: a counting subclass would put a class under vLLM's tests
that users never load. The wrappers are installed once, on import, only in
the pytest process that runs the substituted tests.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

from kvlease.vllm import KvLeaseNixlConnector, KvLeaseScheduler, KvLeaseWorker

CALLS: Counter[str] = Counter()


def _active(obj: Any) -> bool:
    return bool(
        getattr(obj, "_kvl_rank", None)
        or getattr(obj, "_kvl_checks", None)
        or getattr(obj, "_kvl_prefill", None)
        or getattr(obj, "_kvl_forward_fields", False)
    )


def _count(cls: type) -> None:
    for name, fn in list(vars(cls).items()):
        if not callable(fn) or isinstance(fn, (classmethod, staticmethod, type)):
            continue
        if name.startswith("__") and name != "__init__":
            continue

        def make(name: str = name, fn: Any = fn):
            @functools.wraps(fn)
            def wrapper(self, *args, **kwargs):
                CALLS[f"{cls.__name__}.{name}"] += 1
                result = fn(self, *args, **kwargs)
                if _active(self) or _active(getattr(self, "connector_worker", None)) or _active(
                    getattr(self, "connector_scheduler", None)
                ):
                    CALLS[f"{cls.__name__}.{name} [kvlease]"] += 1
                return result

            return wrapper

        setattr(cls, name, make())


for _cls in (KvLeaseNixlConnector, KvLeaseScheduler, KvLeaseWorker):
    _count(_cls)

UPSTREAM_SUBSTITUTES = {
    "connector": KvLeaseNixlConnector,
    "scheduler": KvLeaseScheduler,
    "worker": KvLeaseWorker,
}
