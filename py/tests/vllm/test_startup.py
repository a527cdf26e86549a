"""Start-up: a verifying instance that cannot register its lease slots (P)
or its check buffers (D) with NIXL does not start; with
``kv_lease_verification: false`` nothing of kvlease is built."""

from __future__ import annotations

import contextlib
import os
from unittest.mock import patch

import pytest
import torch
from harness.engine import init_dist
from tests.v1.kv_connector.unit.utils import create_vllm_config
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvlease.errors import ConfigError
from kvlease.vllm import KvLeaseNixlConnector


class Agent:
    """The agent calls a worker makes while it is built."""

    refuse = False
    registered: list = []

    def __init__(self, name, config=None):
        self.name = name

    def get_reg_descs(self, regions, mem_type):
        return [(tuple(r), mem_type) for r in regions]

    def register_memory(self, descs, backends=None):
        if Agent.refuse:
            raise RuntimeError("NIXL_ERR_BACKEND: cannot register")
        Agent.registered.extend(descs)


def build(role: str, **extra):
    init_dist()
    config = create_vllm_config(
        block_size=32,
        kv_connector="KvLeaseNixlConnector",
        kv_connector_module_path="kvlease.vllm",
        kv_role=role,
        kv_connector_extra_config={"kv_lease_duration": 6, **extra},
    )
    kv = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer0"], FullAttentionSpec(block_size=32, num_kv_heads=12, head_size=64, dtype=torch.float16)
            )
        ],
    )
    affinity = os.sched_getaffinity(0)
    try:
        with patch.object(base_worker, "NixlWrapper", Agent), patch.object(
            base_worker, "nixl_agent_config", None
        ), set_current_vllm_config(config):
            return KvLeaseNixlConnector(config, KVConnectorRole.WORKER, kv)
    finally:
        # vLLM's CPU worker pins the process to one core; give it back.
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, affinity)


@pytest.mark.parametrize("role,what", [("kv_producer", "lease slots"), ("kv_consumer", "lease-check buffers")])
def test_a_verifying_instance_that_cannot_register_does_not_start(role, what):
    Agent.refuse = True
    try:
        with pytest.raises(RuntimeError, match=f"the {what} could not be registered.*does not start"):
            build(role)
    finally:
        Agent.refuse = False


def test_slots_and_buffers_are_registered_as_dram():
    Agent.registered = []
    c = build("kv_both")
    w = c.connector_worker
    assert w._kvl_rank is not None and w._kvl_checks is not None
    dram = [d for d in Agent.registered if d[1] == "DRAM"]
    assert any(d[0][0] == w._kvl_rank.rank.slots_address for d in dram)
    assert len(dram) == 1 + len(w._kvl_checks.checker.landing_regions())


def test_verification_off_builds_nothing_of_kvlease():
    Agent.registered = []
    c = build("kv_both", kv_lease_verification=False)
    w = c.connector_worker
    assert w._kvl_rank is None and w._kvl_checks is None
    assert type(w.xfer_stats) is NixlKVConnectorStats
    assert Agent.registered == []


def test_d_settings_reach_the_worker():
    w = build("kv_consumer").connector_worker
    assert w._kvl_checks.max_peers == 256 and not w._kvl_require
    w = build(
        "kv_consumer", kv_lease_max_peers=7, kv_lease_require_verification=True
    ).connector_worker
    assert w._kvl_checks.max_peers == 7 and w._kvl_require


@pytest.mark.parametrize(
    "extra,key",
    [
        ({"kv_lease_max_peers": 0}, "kv_lease_max_peers"),
        ({"kv_lease_max_peers": 5000}, "kv_lease_max_peers"),
        ({"kv_lease_require_verification": "yes"}, "kv_lease_require_verification"),
        # Requiring verification with it switched off is refused, not ignored.
        (
            {"kv_lease_verification": False, "kv_lease_require_verification": True},
            "kv_lease_require_verification",
        ),
    ],
)
def test_bad_d_settings_stop_the_instance_naming_the_key(extra, key):
    with pytest.raises(ConfigError, match=key):
        build("kv_consumer", **extra)
