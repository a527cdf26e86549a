"""The type stubs (``kvlease/_native.pyi``) declare what the native module
has: every public class and function, and for each class its public
methods and properties, so that a type checker sees the real API."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kvlease
from kvlease import _native

STUB = Path(kvlease.__file__).with_name("_native.pyi")


def stub_names() -> dict[str, set[str]]:
    tree = ast.parse(STUB.read_text())
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = set()
    return out


def test_every_native_class_and_function_is_in_the_stubs():
    stubs = stub_names()
    public = [n for n in dir(_native) if not n.startswith("_")]
    missing = [n for n in public if n not in stubs and not isinstance(getattr(_native, n), str)]
    assert not missing, f"in _native but not in _native.pyi: {missing}"
    extra = [n for n in stubs if not hasattr(_native, n)]
    assert not extra, f"in _native.pyi but not in _native: {extra}"


def test_every_public_member_of_a_native_class_is_in_its_stub():
    stubs = stub_names()
    gaps = []
    for name, members in stubs.items():
        obj = getattr(_native, name, None)
        if not inspect.isclass(obj):
            continue
        for m in dir(obj):
            if m.startswith("_") or m in members:
                continue
            gaps.append(f"{name}.{m}")
    assert not gaps, f"members missing from _native.pyi: {gaps}"
