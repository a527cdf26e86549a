"""The real-engine step's reuse of stock controls (py/engine/controls.py):
reused only under the hash of everything the control read, never when a
byte of it changed, and never a control that showed nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import controls  # noqa: E402
from controls import ControlCache, inputs_key  # noqa: E402

CASE = "push: registration reaches P late"
HUNG = {"hangs": 4, "d_usage_end": 0.0029}


@pytest.fixture
def engine_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "engine"
    (d / "plugins").mkdir(parents=True)
    (d / "test_real_engine.py").write_text("PUSH_LEASE = 12.0\n")
    (d / "plugins" / "kvlease_engine_plugins.py").write_text("# plugin\n")
    monkeypatch.setattr(controls, "ENGINE_DIR", d)
    return d


def test_the_key_changes_with_any_byte_the_control_reads(engine_dir):
    model = "/cache/engine-model-f9d5252074807b0f"
    key = inputs_key(model)
    assert key == inputs_key(model)
    (engine_dir / "plugins" / "kvlease_engine_plugins.py").write_text("# plugin!\n")
    changed_plugin = inputs_key(model)
    assert changed_plugin != key
    assert inputs_key("/cache/engine-model-0000000000000000") != changed_plugin
    (engine_dir / "new_helper.py").write_text("")
    assert inputs_key(model) != changed_plugin


def test_caches_are_left_out_of_the_key(engine_dir):
    key = inputs_key("m")
    (engine_dir / "__pycache__").mkdir()
    (engine_dir / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert inputs_key("m") == key


def test_a_stored_control_is_reused_under_its_key_only(tmp_path):
    ControlCache("a" * 64, root=tmp_path, mode="reuse").store(CASE, HUNG, shows=True)
    reused = ControlCache("a" * 64, root=tmp_path, mode="reuse").reused(CASE)
    assert reused == {**HUNG, "reused_for": "a" * 16}
    assert ControlCache("b" * 64, root=tmp_path, mode="reuse").reused(CASE) is None
    assert ControlCache("a" * 64, root=tmp_path, mode="reuse").reused("push: happy path") is None


def test_a_control_that_showed_nothing_is_not_kept(tmp_path):
    cache = ControlCache("c" * 64, root=tmp_path, mode="reuse")
    cache.store(CASE, {"hangs": 0, "d_usage_end": 0.0}, shows=False)
    assert cache.reused(CASE) is None


def test_rerun_measures_again_and_refreshes_off_touches_nothing(tmp_path):
    ControlCache("d" * 64, root=tmp_path, mode="reuse").store(CASE, HUNG, shows=True)
    rerun = ControlCache("d" * 64, root=tmp_path, mode="rerun")
    assert rerun.reused(CASE) is None
    rerun.store(CASE, {**HUNG, "hangs": 3}, shows=True)
    assert ControlCache("d" * 64, root=tmp_path, mode="reuse").reused(CASE)["hangs"] == 3
    off = ControlCache("e" * 64, root=tmp_path, mode="off")
    off.store(CASE, HUNG, shows=True)
    assert ControlCache("e" * 64, root=tmp_path, mode="reuse").reused(CASE) is None


def test_an_unknown_mode_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="KVLEASE_ENGINE_CONTROLS"):
        ControlCache("f" * 64, root=tmp_path, mode="sometimes")
