"""Free ports for the processes the tests start: the harness's node
processes and side channels, and the real-engine step's ``vllm serve``
instances and routers (py/engine imports this module).

Owns: which ports this process hands out. May not bind them for good: the
process that was told a port binds it.

Why not ``bind(0)``: that hands out an ephemeral port and frees it, and
until the process that was told it binds it, any of the dozens of sockets a
fleet opens meanwhile (vLLM's ZMQ queues, UCX's TCP endpoints, gloo) may be
given the same port: once, a stock D's NIXL side channel found its port
taken ("Address already in use") and the instance never answered. The
kernel never hands out a port below its ephemeral range by itself, so a port
found free there stays free until the process that was told it binds it.

Two test processes at once (``py/ci/run-vllm.sh`` runs the push end-to-end
cases beside the rest) search from bases set apart with
``KVLEASE_PORT_BASE``; without it the base is spread by pid.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

LOWEST = 10000


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (Linux's default
    range starts at 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _base() -> int:
    try:
        return max(LOWEST, int(os.environ["KVLEASE_PORT_BASE"]))
    except (KeyError, ValueError):
        return LOWEST + (os.getpid() * 7919) % 10000


#: Ports this process handed out (never handed twice in one run).
_handed: set[int] = set()
#: Where the next search starts.
_next = [_base()]


def free_port(span: int = 1) -> int:
    """The first of ``span`` consecutive ports nothing listens on, below the
    kernel's ephemeral range (see the module docs)."""
    high = min(_ephemeral_low(), 65536) - span
    for _ in range(20000):
        port = _next[0]
        _next[0] = port + span if port + span < high else LOWEST
        ports = range(port, port + span)
        if any(p in _handed for p in ports) or not all(_bindable(p) for p in ports):
            continue
        _handed.update(ports)
        return port
    raise RuntimeError(f"no {span} free consecutive ports below {high + span}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
