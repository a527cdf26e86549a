"""vLLM general plugins for the real-engine cases (entry point group
``vllm.general_plugins``, installed into .venv-engine by py/engine/env.sh).

Owns: turning async scheduling back on in vLLM's CPU engine, when
``KVLEASE_ENGINE_ASYNC_SCHEDULING=1``. Nothing else; with the variable unset
the plugin changes nothing, so every other case runs stock vLLM.

Why: vLLM's CPU platform switches async scheduling off ("not required on
CPU", ``CpuPlatform.check_and_update_config``), while GPU builds of vLLM
0.32-0.34 turn it on by default. With it on, EngineCore uses the
``AsyncScheduler`` and a two-deep batch queue: the metadata of step N+1 is
built before the output of step N is applied, an ordering the connector must
survive. vLLM loads general plugins in the API server before it builds the
config (``EngineArgs.create_engine_config``), so wrapping the platform hook
there decides the config every other process receives.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm.kvlease.engine_plugins")

ENV = "KVLEASE_ENGINE_ASYNC_SCHEDULING"


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, "_kvlease_async", False):
        return

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True
        logger.warning("kvlease engine plugin: async scheduling re-enabled on CPU (%s=1)", ENV)

    check_and_update_config._kvlease_async = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
