"""The test side of the end-to-end harness: starts node processes
(``node.py``) with a given UCX transport, sends them commands, waits for
their answers, and kills them when a case asks for it.

Owns: process lifetime, the command channel, free ports. May not assert:
tests do.
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener
from collections.abc import Callable
from pathlib import Path
from typing import Any

HARNESS_PARENT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180.0
#: Slack on every answer (seconds). A shared, loaded machine (other engines,
#: builds) can take longer than the default to build an engine; raise it
#: there rather than lengthen a bound the tests assert.
CALL_SLACK_S = float(os.environ.get("KVLEASE_E2E_CALL_SLACK_S", "60"))


class NodeError(RuntimeError):
    pass


class NodeProcess:
    """One node process and its command channel."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        log_dir: Path,
        wrap: Callable[[list[str]], list[str]] | None = None,
        listen_host: str = "127.0.0.1",
    ) -> None:
        """``wrap``: starts the node on another host (``hosts.Host.wrap``),
        whose process tree is then killed as a group; ``listen_host``: the
        address of the command channel that host reaches."""
        self.name = name
        self._group = wrap is not None
        authkey = secrets.token_bytes(16)
        self._listener = Listener((listen_host, 0), authkey=authkey)
        host, port = self._listener.address
        child_env = dict(os.environ)
        child_env.update(env)
        tests_dir = os.environ.get("VLLM_TESTS_DIR", "")
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HARNESS_PARENT), tests_dir, child_env.get("PYTHONPATH", "")) if p
        )
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "harness.node", f"{host}:{port}", authkey.hex()]
        self.proc = subprocess.Popen(
            wrap(cmd) if wrap is not None else cmd,
            env=child_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=tests_dir or None,
            start_new_session=self._group,
        )
        accepted: list[Any] = []
        t = threading.Thread(target=lambda: accepted.append(self._listener.accept()), daemon=True)
        t.start()
        t.join(START_TIMEOUT_S)
        if not accepted:
            self.proc.kill()
            self._listener.close()
            raise NodeError(f"{name} did not connect in {START_TIMEOUT_S} s; log: {self.tail()}")
        self.conn = accepted[0]
        self._ids = itertools.count(1)

    def call(self, cmd: str, **args: Any) -> Any:
        """Sends ``cmd`` and waits for its answer: the command's own
        ``timeout``/``seconds`` argument plus ``CALL_SLACK_S``."""
        msg_id = next(self._ids)
        self.conn.send((msg_id, cmd, args))
        deadline = time.time() + CALL_SLACK_S + float(args.get("timeout", 0) or args.get("seconds", 0))
        while True:
            left = deadline - time.time()
            if left <= 0 or self.proc.poll() is not None and not self.conn.poll(0):
                raise NodeError(
                    f"{self.name}: no answer to {cmd} (exit={self.proc.poll()}); log: {self.tail()}"
                )
            if self.conn.poll(min(left, 0.5)):
                got_id, value = self.conn.recv()
                if got_id != msg_id:
                    raise NodeError(f"{self.name}: answer {got_id} for call {msg_id}")
                if isinstance(value, dict) and "error" in value:
                    raise NodeError(f"{self.name}: {cmd} failed:\n{value['error']}")
                return value

    def kill(self) -> None:
        """SIGKILL: the process dies without any cleanup (a crashed D)."""
        if self._group:  # the node runs under `unshare --fork`: the whole group
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit")
            except Exception:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.conn.close()
        self._listener.close()
        self._log.close()

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""
