"""Fixtures of kvlease's vLLM tests: the transports, and P and D node
processes per transport (``harness/``).

These tests need vLLM 0.34 and nixl-cu12 (``py/ci/vllm-env.sh``) and the
upstream test stubs (``VLLM_TESTS_DIR``); ``py/ci/run-vllm.sh`` runs them. In
an environment without vLLM (``.ci/run`` step 10 runs ``py/tests`` in a plain
venv) this folder is not collected, and the header says so.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

HAVE_VLLM = (
    importlib.util.find_spec("vllm") is not None
    and importlib.util.find_spec("nixl_cu12") is not None
    and bool(os.environ.get("VLLM_TESTS_DIR"))
)
if not HAVE_VLLM:
    collect_ignore_glob = ["*"]
else:
    here = str(Path(__file__).resolve().parent)
    for p in (here, os.environ["VLLM_TESTS_DIR"]):
        if p not in sys.path:
            sys.path.insert(0, p)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not HAVE_VLLM:
        return
    from harness.figures import FIGURES

    if not FIGURES:
        return
    terminalreporter.section("kvlease end-to-end figures")
    for line in FIGURES:
        terminalreporter.write_line(line)
    path = os.environ.get("KVLEASE_E2E_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write("\n".join(FIGURES) + "\n")


def pytest_report_header(config):
    if not HAVE_VLLM:
        return "py/tests/vllm: not collected (no vLLM / nixl_cu12 / VLLM_TESTS_DIR; run py/ci/run-vllm.sh)"
    return None
