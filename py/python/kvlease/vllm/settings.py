"""The lease settings of one vLLM engine, read from its ``VllmConfig``.

Owns: which kvlease roles an engine runs (from ``kv_role`` and
``kv_lease_verification``), the parsed :class:`kvlease.LeaseConfig`, and the
warning for misspelt ``kv_lease_*`` keys. May not construct any role or touch
NIXL.

``kv_lease_verification: false`` means "exactly stock vLLM": nothing of
kvlease is built, so every override of the connector falls through to vLLM's
own code. The value is then taken as vLLM would (no kvlease validation of the
other keys either: stock vLLM accepts, e.g., a ``kv_lease_duration`` under 6 s),
except ``kv_lease_require_verification``: requiring verification while
switching it off is refused at start (``ConfigError``), not silently dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .._native import LeaseConfig

logger = logging.getLogger("vllm.kvlease.settings")

PRODUCER_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class LeaseSettings:
    """What kvlease runs in one engine."""

    config: LeaseConfig
    #: P: leases, slots and nonces for ``do_remote_decode`` requests.
    producer: bool
    #: D: the slot check after the block READs of ``do_remote_prefill`` requests.
    consumer: bool


def verification_requested(extra: dict[str, Any] | None) -> bool:
    """``kv_lease_verification`` as given (default true). Anything but an
    explicit JSON ``false`` keeps kvlease on, and a non-boolean is refused
    later by :meth:`LeaseConfig.parse`."""
    return (extra or {}).get("kv_lease_verification", True) is not False


def lease_settings(vllm_config: Any, kv_cache_config: Any) -> LeaseSettings | None:
    """The settings of the engine ``vllm_config`` describes, or ``None``
    when kvlease stays off (verification disabled). Raises
    :class:`kvlease.errors.ConfigError` for a bad ``kv_lease_*`` value: a
    verifying instance must not start half-configured."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {})
    num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
    if not verification_requested(extra):
        if extra.get("kv_lease_require_verification", False) is not False:
            # Raises: the library refuses the contradiction by the key's name.
            LeaseConfig.parse(extra, num_blocks, max_num_seqs)
        return None
    role = ktc.kv_role
    config = LeaseConfig.parse(extra, num_blocks, max_num_seqs)
    odd = [k for k in config.unknown_keys if k.startswith("kv_lease")]
    if odd:
        logger.warning(
            "kvlease: unknown kv_connector_extra_config keys %s (misspelt? their "
            "defaults stay in force)",
            odd,
        )
    return LeaseSettings(
        config=config,
        producer=role in PRODUCER_ROLES,
        consumer=role in CONSUMER_ROLES,
    )

