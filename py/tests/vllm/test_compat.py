"""The vLLM version pin: ``>=0.34,<0.35``, refused with a clear message
outside it, at import of ``kvlease.vllm`` and when a connector is built."""

from __future__ import annotations

import importlib

import pytest
import vllm

from kvlease.vllm import compat


@pytest.mark.parametrize("version", ["0.34.0", "0.34.1", "0.34.2rc1", "0.34.0+cu130", "0.34.1.dev7+gabc"])
def test_supported_versions(version):
    assert compat.check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.33.9", "0.35.0", "0.35.0rc1", "1.0.0", "0.3.4", "", "unknown", "v"])
def test_other_versions_are_refused_with_the_range(version):
    with pytest.raises(compat.UnsupportedVllmVersion) as e:
        compat.check_vllm_version(version)
    msg = str(e.value)
    assert ">=0.34,<0.35" in msg and f"installed vLLM is {version}" in msg


def test_installed_vllm_is_supported():
    assert compat.check_vllm_version() == vllm.__version__


def test_import_fails_on_another_vllm(monkeypatch):
    import kvlease.vllm as plugin

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(compat.UnsupportedVllmVersion, match="installed vLLM is 0.35.0"):
        importlib.reload(plugin)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    importlib.reload(plugin)


def test_connector_construction_fails_on_another_vllm(monkeypatch):
    from kvlease.vllm import KvLeaseNixlConnector

    monkeypatch.setattr(vllm, "__version__", "0.33.2")
    with pytest.raises(compat.UnsupportedVllmVersion, match="0.33.2"):
        KvLeaseNixlConnector(None, None, None)
