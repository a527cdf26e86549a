"""vLLM general plugins for the real-engine cases (entry point group
``vllm.general_plugins``, installed into .venv-engine by py/engine/env.sh).

Owns five test-environment switches, each off unless its variable is set:

- ``KVLEASE_ENGINE_ASYNC_SCHEDULING=1``: async scheduling back on in vLLM's
  CPU engine;
- ``KVLEASE_ENGINE_NIXL_PROGRESS_DELAY_US=<us>``: the pause of NIXL's
  progress thread between two progress calls;
- ``KVLEASE_ENGINE_SHM_RECHECK_MS=<ms>``: how long an idle reader of vLLM's
  shared-memory message queue sleeps before it looks again without a
  wake-up (vLLM: 5,000 ms);
- ``KVLEASE_ENGINE_SHM_SPIN_MS=<ms>``: how long a reader of that queue
  spins after a read before it sleeps on the writer's wake-up (vLLM:
  1,000 ms);
- ``KVLEASE_ENGINE_TRACE_HEARTBEATS=1``: a log line for every heartbeat
  round, send and renewal (``kvlease_heartbeat_trace.py``), for diagnosing
  lapses; never set by the cases.

Nothing else: with all unset the plugin changes nothing.

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
DELAY_ENV = "KVLEASE_ENGINE_NIXL_PROGRESS_DELAY_US"
RECHECK_ENV = "KVLEASE_ENGINE_SHM_RECHECK_MS"
SPIN_ENV = "KVLEASE_ENGINE_SHM_SPIN_MS"
TRACE_ENV = "KVLEASE_ENGINE_TRACE_HEARTBEATS"


def register() -> None:
    _slow_nixl_progress_thread()
    _shorter_shm_recheck()
    _shorter_shm_spin()
    _async_scheduling()
    if os.environ.get(TRACE_ENV):
        import kvlease_heartbeat_trace

        kvlease_heartbeat_trace.install()


def _shorter_shm_recheck() -> None:
    """Why: EngineCore and its workers hand each step over through vLLM's
    shared-memory queue (``shm_broadcast.py``). A reader spins for 1 s after
    its last read, then sleeps on a ZMQ wake-up the writer publishes, and
    looks again after ``SHM_READER_RECHECK_INTERVAL_MS`` (5 s) if none came.
    On an oversubscribed 2-core machine wake-ups go missing (the writer's
    PUB socket keeps one, with a high-water mark of 1), and each miss costs
    a whole 5 s: D's engine then takes no step, and sends no heartbeat, for
    5, 10, 15 or 20 s (measured: stalls in multiples of 5 s, EngineCore and
    worker both asleep in ``SpinCondition.wait``; issue 28's finding 7, and
    the lead its push-mode trace gave: ``Poller timed out``). The variable
    shortens the recheck, bounding a missed wake-up; the module constant is
    read at every wait, so setting it here, in every vLLM process, is
    enough."""
    ms = os.environ.get(RECHECK_ENV)
    if not ms:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = int(ms)


def _shorter_shm_spin() -> None:
    """Why: a P that holds blocks for D keeps stepping (vLLM's
    ``Scheduler.has_finished_requests``: a finished request whose blocks a
    connector still holds keeps the engine loop going, so that the worker
    polls for D's read-done), and a reader of the step queue spins on
    ``sched_yield`` for a whole second after each read
    (``SpinCondition.busy_loop_s``). Stepping every few milliseconds, such a
    P never stops spinning: measured, a TP 2 P holding leases took its
    EngineCore at 50 % of a core and each worker at 55 %, and D, on the same
    2 cores, made no token and sent no heartbeat round for 15-19 s at a time
    (py-spy: its EngineCore waiting on its worker, the worker in the forward
    pass), and the leases it was reading lapsed. With no spin, a
    reader sleeps on the writer's wake-up (``notify`` after every write),
    bounded by the recheck above. Set for P instances only: every step then
    pays a wake-up, and a plain instance decoding 8 requests at once
    without the spin made 35-157 tokens/s instead of 410-550. The method is
    patched, not the constructor, so that queues made before plugins load
    get it too."""
    ms = os.environ.get(SPIN_ENV)
    if not ms:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    original = cls.wait
    if getattr(original, "_kvlease_spin", False):
        return
    spin_s = int(ms) / 1000.0

    def wait(self, timeout_ms=None):
        self.busy_loop_s = spin_s
        return original(self, timeout_ms)

    wait._kvlease_spin = True
    cls.wait = wait


def _slow_nixl_progress_thread() -> None:
    """Why: NIXL's Python agent sets ``pthrDelay = 0`` (``nixl._api``), so
    every agent's progress thread spins a whole core, busy or idle, and vLLM
    has no knob for it. A P and a D take both cores of a 2-core machine that
    way: vLLM's EngineCore and workers, which hand each step over through
    shared memory with a spin-then-sleep wait, get the CPU seconds late, and
    every timing of a case becomes noise (measured: each idle worker 98 % of
    a core; single requests 0.4-9 s). A pause between progress calls keeps
    the thread's work (UCX progress also runs on every NIXL call of vLLM's
    own step) and gives the cores back. Applied alike to stock and kvlease
    instances."""
    delay = os.environ.get(DELAY_ENV)
    if not delay or delay == "0":
        return
    try:
        from nixl_cu13 import _api
    except ImportError:
        try:
            from nixl import _api
        except ImportError:
            return
    bind = _api.nixlBind
    original = bind.nixlAgent
    if getattr(original, "_kvlease_delay", False):
        return

    def agent(name, config, *args, **kwargs):
        config.pthrDelay = int(delay)
        return original(name, config, *args, **kwargs)

    agent._kvlease_delay = True
    bind.nixlAgent = agent


def _async_scheduling() -> None:
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
