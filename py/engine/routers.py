"""The routers in front of P and D, as processes: vLLM's own toy proxy
(unmodified, from vLLM's source distribution) and kvlease's float64 router
(``float64_router.py``).

Owns: their command lines, readiness and shutdown, and the float64 router's
hold controls. May not route anything itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from instances import Instance, free_port

HERE = Path(__file__).resolve().parent


class RouterProcess:
    """One router process in front of ``prefill`` and ``decode`` instances."""

    def __init__(self, kind: str, prefill: list[Instance], decode: list[Instance],
                 logs: Path) -> None:
        self.kind = kind
        self.port = free_port()
        self.log_path = logs / f"router-{kind}-{self.port}.log"
        python = os.environ.get("ENGINE_PYTHON", sys.executable)
        if kind == "toy":
            proxy = os.environ["ENGINE_TOY_PROXY"]
            self.cmd = [python, proxy, "--host", "127.0.0.1", "--port", str(self.port),
                        "--prefiller-hosts", *[i.address for i in prefill],
                        "--prefiller-ports", *[str(i.port) for i in prefill],
                        "--decoder-hosts", *[i.address for i in decode],
                        "--decoder-ports", *[str(i.port) for i in decode]]
            self.health = "/healthcheck"
        elif kind == "float64":
            self.cmd = [python, str(HERE / "float64_router.py"), "--port", str(self.port),
                        "--prefill", *[i.url for i in prefill],
                        "--decode", *[i.url for i in decode]]
            self.health = "/healthcheck"
        else:
            raise ValueError(kind)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "RouterProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, "OPENAI_API_KEY": "none"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router {self.kind} exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"router {self.kind} did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    # -- the float64 router's holds ------------------------------------------

    def release(self, key: str) -> None:
        req = urllib.request.Request(f"{self.url}/router/release?key={key}", method="POST",
                                     data=b"")
        with urllib.request.urlopen(req, timeout=10):
            pass

    def held(self) -> dict[str, dict]:
        with urllib.request.urlopen(self.url + "/router/held", timeout=10) as r:
            return json.loads(r.read())

    def wait_held(self, key: str, timeout: float = 120.0) -> dict:
        """Waits until the request holding ``key`` finished its P leg; returns
        its request id and the kv_transfer_params P gave (after float64)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.held().get(key)
            if found is not None:
                return found
            time.sleep(0.2)
        raise TimeoutError(f"no request held under {key!r} after {timeout:.0f} s")
