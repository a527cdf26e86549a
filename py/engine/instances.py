"""Real ``vllm serve`` processes for the real-engine cases: start one, wait
until it answers, read its ``/metrics``, send it signals, stop it.

Owns: the command line and environment of one instance (P, D or a plain
reference), its process group, its log file and its ports. May not decide
what a case does with an instance: the cases (``test_real_engine.py``) do.

Why a process group per instance: ``vllm serve`` is an API server process
that starts EngineCore, which starts one worker per TP rank (the multiproc
executor). Killing "D" must kill all of them at once, as a crashed host
would; ``os.killpg`` does, and stopping by group leaves nothing behind.

Every timing here is generous: on a 2-core machine an instance takes 30-50 s
to start, and each idle NIXL worker burns about half a core (its UCX
progress thread polls with timeout 0).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The harness's port picker and hosts (py/tests/vllm/harness), shared with
# the end-to-end cases.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
from harness.ports import free_port  # noqa: E402

#: Flags every instance gets (docs/vllm.md, "A real vllm serve on CPU").
COMMON_FLAGS = [
    "--dtype", "float32",
    "--enforce-eager",
    "--max-model-len", "512",
    "--block-size", "32",
    "--max-num-seqs", "4",
    "--no-enable-prefix-caching",
]

#: The pause of NIXL's progress thread between progress calls, in
#: microseconds (0: NIXL's own busy loop).
NIXL_PROGRESS_DELAY_US = 1000
#: How long an idle reader of vLLM's shared-memory step queue sleeps before
#: it looks again without a wake-up, in ms (vLLM: 5,000; a missed wake-up
#: stalled D for multiples of 5 s: plugins/kvlease_engine_plugins.py).
SHM_RECHECK_MS = 50
#: How long a P's readers of that queue spin after a read before they sleep
#: on the writer's wake-up, in ms (vLLM: 1,000 ms, kept for every other
#: instance). A P that holds blocks for D steps continuously, so its readers
#: never stopped spinning: plugins/kvlease_engine_plugins.py.
P_SHM_SPIN_MS = 0

#: How long an instance may take to answer /health after it starts.
START_TIMEOUT_S = 240.0


@dataclass
class InstanceSpec:
    """What one ``vllm serve`` runs as."""

    name: str
    #: "plain" (no KV transfer), "stock" (vLLM's NixlConnector), "kvlease",
    #: or push mode: "stock-push" (vLLM's NixlPushConnector), "kvlease-push".
    connector: str = "plain"
    #: kv_connector_extra_config (kv_lease_duration, ...).
    extra: dict[str, Any] = field(default_factory=dict)
    tp: int = 1
    #: --data-parallel-size: each DP rank is an EngineCore of its own (its
    #: own scheduler, connector and lease book), behind one API server.
    dp: int = 1
    #: --num-gpu-blocks-override: a small P cache makes freed blocks reused at once.
    num_blocks: int | None = None
    max_num_seqs: int = 4
    kv_load_failure_policy: str = "recompute"
    #: A prefill instance (P): its step queue does not spin (P_SHM_SPIN_MS).
    prefill: bool = False
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    #: The "host" it runs on: a ``harness.hosts.Host`` (a network namespace,
    #: maybe a time namespace; py/tests/vllm/harness/hosts.py), or None for
    #: this machine's own.
    host: Any = None

    def kv_transfer_config(self) -> dict[str, Any] | None:
        if self.connector == "plain":
            return None
        cfg: dict[str, Any] = {
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": self.kv_load_failure_policy,
            "kv_connector_extra_config": dict(self.extra),
        }
        if self.connector == "stock":
            cfg["kv_connector"] = "NixlConnector"
        elif self.connector == "kvlease":
            cfg["kv_connector"] = "KvLeaseNixlConnector"
            cfg["kv_connector_module_path"] = "kvlease.vllm"
        elif self.connector == "stock-push":
            cfg["kv_connector"] = "NixlPushConnector"
        elif self.connector == "kvlease-push":
            cfg["kv_connector"] = "KvLeaseNixlPushConnector"
            cfg["kv_connector_module_path"] = "kvlease.vllm"
        else:
            raise ValueError(f"unknown connector {self.connector!r}")
        return cfg


class Instance:
    """One running ``vllm serve`` (see the module docs)."""

    def __init__(self, spec: InstanceSpec, model: str, logs: Path) -> None:
        self.spec = spec
        self.model = model
        self.port = free_port()
        # vLLM's NIXL side channel: one port per TP rank from this one, and
        # per DP rank (vLLM adds the DP index to the base port).
        self.side_channel_port = free_port(span=max(spec.tp, 1) * max(spec.dp, 1))
        self.log_path = logs / f"{spec.name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_after_s: float | None = None

    @property
    def address(self) -> str:
        """Where the instance listens (its host's address, or loopback)."""
        return self.spec.host.ip if self.spec.host is not None else "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def command(self) -> list[str]:
        python = os.environ.get("ENGINE_PYTHON", "python")
        spec = self.spec
        cmd = [
            python, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
            "--host", self.address, "--port", str(self.port),
            "--served-model-name", "tiny",
            *COMMON_FLAGS,
        ]
        cmd[cmd.index("--max-num-seqs") + 1] = str(spec.max_num_seqs)
        if spec.tp > 1:
            cmd += ["--tensor-parallel-size", str(spec.tp)]
        if spec.dp > 1:
            cmd += ["--data-parallel-size", str(spec.dp)]
        if spec.num_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(spec.num_blocks)]
        ktc = spec.kv_transfer_config()
        if ktc is not None:
            cmd += ["--kv-transfer-config", json.dumps(ktc)]
        cmd += list(spec.args)
        return spec.host.wrap(cmd) if spec.host is not None else cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS="1",
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port),
            VLLM_LOGGING_LEVEL=env.get("ENGINE_LOG_LEVEL", "INFO"),
            PYTHONUNBUFFERED="1",
            # NIXL's progress thread spins a core per agent otherwise
            # (plugins/kvlease_engine_plugins.py); "0" keeps NIXL's own.
            KVLEASE_ENGINE_NIXL_PROGRESS_DELAY_US=env.get(
                "ENGINE_NIXL_PROGRESS_DELAY_US", str(NIXL_PROGRESS_DELAY_US)),
            # A missed wake-up in vLLM's step queue costs 5 s otherwise
            # (plugins/kvlease_engine_plugins.py); "" keeps vLLM's 5 s.
            KVLEASE_ENGINE_SHM_RECHECK_MS=env.get("ENGINE_SHM_RECHECK_MS", str(SHM_RECHECK_MS)),
            # A P holding blocks for D takes most of a core per process
            # otherwise (plugins/kvlease_engine_plugins.py); "" keeps vLLM's 1 s.
            KVLEASE_ENGINE_SHM_SPIN_MS=(env.get("ENGINE_P_SHM_SPIN_MS", str(P_SHM_SPIN_MS))
                                        if self.spec.prefill else ""),
        )
        if self.spec.host is not None:
            # Its side channel on the host's address, UCX over TCP; and the
            # address vLLM would otherwise guess from a route to the
            # internet, which a host namespace does not have.
            env.update(self.spec.host.env(), VLLM_HOST_IP=self.spec.host.ip)
        env.update(self.spec.env)
        return env

    def start(self) -> "Instance":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )
        log.close()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "Instance":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.spec.name} exited with {self.proc.returncode} while starting:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.ready_after_s = time.monotonic() - self.started_at
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.spec.name} did not answer /health in {timeout:.0f} s:\n"
                           + self.log_tail())

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signals the whole instance (API server, EngineCore, workers)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # Whatever of the group is left (workers outlive a killed leader).
        self.kill(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    # -- what it says --------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def count_in_log(self, pattern: str) -> int:
        return len(re.findall(pattern, self.log_text()))

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{"name{labels}": value}``, summed over nothing."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
        return out

    def metric(self, name: str) -> float:
        """The sum of every sample of ``name`` (any labels)."""
        total, seen = 0.0, False
        for key, value in self.metrics().items():
            if key == name or key.startswith(name + "{"):
                total += value
                seen = True
        if not seen:
            raise KeyError(f"{self.spec.name} exports no metric {name}")
        return total

    def kv_usage(self) -> float:
        """KV-cache usage, 0..1 (vLLM's ``vllm:kv_cache_usage_perc``)."""
        return self.metric("vllm:kv_cache_usage_perc")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by every live process of the
        instance (API server, EngineCore, workers: one process group), read
        from ``/proc``; 0.0 where there is no ``/proc``."""
        if self.proc is None:
            return 0.0
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # exited meanwhile
                continue
            # Fields after the command name, which may hold spaces: state is
            # field 3, pgrp field 5, utime and stime fields 14 and 15.
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[2]) == self.proc.pid:
                total += int(fields[11]) + int(fields[12])
        return total / ticks

    def busy_cores(self, window_s: float = 3.0) -> float:
        """How many cores the instance kept busy over the next ``window_s``
        seconds (1.0: one core all the time)."""
        before = self.cpu_seconds()
        time.sleep(window_s)
        return (self.cpu_seconds() - before) / window_s


def start_all(specs: list[InstanceSpec], model: str, logs: Path) -> list[Instance]:
    """Starts every instance at once (they start in parallel), then waits for
    each; stops them all if one fails."""
    insts = [Instance(s, model, logs).start() for s in specs]
    try:
        for inst in insts:
            inst.wait_ready()
    except BaseException:
        for inst in insts:
            inst.stop(grace=5)
        raise
    return insts
