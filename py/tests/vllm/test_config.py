"""The ``vllm serve`` configurations of docs/vllm.md are valid for vLLM,
load this connector, and are the ones the end-to-end tests run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from harness.engine import EngineSpec
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvlease.vllm import KvLeaseNixlConnector

DOC = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"


def section(title: str, to_end: bool = False) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = -1 if to_end else text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def configs(text: str) -> dict[str, dict]:
    found = re.findall(r"--kv-transfer-config '(\{.*?\})'", text)
    parsed = [json.loads(c) for c in found]
    by_role = {"kv_producer": "P", "kv_consumer": "D"}
    out = {by_role[c["kv_role"]]: c for c in parsed}
    assert len(parsed) == 2 and set(out) == {"P", "D"}, found
    return out


def documented() -> dict[str, dict]:
    """{"P": config, "D": config} from the two `vllm serve` commands of "Run"."""
    return configs(section("Run"))


def test_readme_section_shows_the_same_commands():
    short = configs(section("README section", to_end=True))  # the last section
    for role, cfg in documented().items():
        assert short[role] == {k: v for k, v in cfg.items() if k != "kv_connector_extra_config"}


@pytest.mark.parametrize("role", ["P", "D"])
def test_documented_config_loads_this_connector(role):
    cfg = KVTransferConfig(**documented()[role])
    assert KVConnectorFactory.get_connector_class(cfg) is KvLeaseNixlConnector


@pytest.mark.parametrize("role", ["P", "D"])
def test_end_to_end_tests_run_the_documented_config(role):
    doc = documented()[role]
    ran = EngineSpec(name="x", role=role).transfer_config()
    # The tests differ only in what a test needs: shorter leases, and the UCX
    # parameters of the transport under test.
    for cfg in (doc, ran):
        cfg["kv_connector_extra_config"] = {
            k: v
            for k, v in cfg["kv_connector_extra_config"].items()
            if k not in ("kv_lease_duration", "ucx_backend_params")
        }
    assert ran == doc
