"""Two "hosts" on this machine for the end-to-end harness: P's and D's node
processes in network namespaces of their own, on a bridge the test process
reaches, and either one in a time namespace whose monotonic clock runs a
given offset ahead of the other's.

Owns: the namespaces, the bridge and the veth pairs (made on entry, removed
on exit), each host's address and device, and the command that starts a
process on a host. May not start nodes: ``cluster.NodeProcess`` does, with
:meth:`Host.wrap` and :attr:`TwoHosts.gateway`.

Why: hosts of a real fleet do not share ``CLOCK_MONOTONIC`` (it counts from
each host's boot), and between hosts UCX runs over TCP. A Linux time
namespace gives a process tree its own monotonic and boot-time offsets
(``unshare --time --monotonic N``), so P's estimate of D's clock can be
compared with the true offset, which is exactly ``N`` (docs/nixl.md notes).
The bridge, not a veth pair between the hosts: the test process, in the
root namespace, must reach both nodes for its command channel; the nodes
talk to each other (side channels, NIXL) over the same bridge.

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux). Addresses are
in 10.x, inside namespaces this module made, and nothing else is reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def available() -> str | None:
    """Why two hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}`"
    return None


@dataclass
class Host:
    name: str
    netns: str
    ip: str
    #: The veth end inside the namespace (UCX_NET_DEVICES).
    dev: str
    #: Seconds this host's monotonic clock runs ahead (0: the machine's own).
    monotonic_ahead: int = 0

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started on this host."""
        prefix = ["ip", "netns", "exec", self.netns]
        if self.monotonic_ahead:
            off = str(self.monotonic_ahead)
            prefix += ["unshare", "--time", "--fork", "--monotonic", off, "--boottime", off, "--"]
        return prefix + cmd

    def env(self) -> dict[str, str]:
        """What a node on this host needs: vLLM's side channel on the host's
        address, UCX over TCP on its device (the transport between hosts
        without RDMA)."""
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": self.ip, "UCX_TLS": "tcp",
                "UCX_NET_DEVICES": self.dev}


class TwoHosts:
    """P's host and D's host (see the module docs); ``ahead`` names the one
    whose monotonic clock runs ``offset`` seconds ahead."""

    def __init__(self, ahead: str, offset: int = 100_000, subnet: int = 78) -> None:
        # The subnet in the names too: two pairs of hosts of one process
        # (the real-engine step's two clock orientations) may coexist.
        tag = f"{subnet % 100}{os.getpid() % 10000}"
        self.bridge = f"kvlbr{tag}"
        self.gateway = f"10.{subnet}.0.1"
        self.p = Host("P", f"kvl-p{tag}", f"10.{subnet}.0.2", f"kvlp{tag}n",
                      offset if ahead == "P" else 0)
        self.d = Host("D", f"kvl-d{tag}", f"10.{subnet}.0.3", f"kvld{tag}n",
                      offset if ahead == "D" else 0)
        #: D's monotonic clock minus P's, exactly.
        self.true_offset = self.d.monotonic_ahead - self.p.monotonic_ahead

    def __enter__(self) -> "TwoHosts":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for h in (self.p, self.d):
                outside = h.dev[:-1] + "h"
                _ip("netns", "add", h.netns)
                _ip("link", "add", outside, "type", "veth", "peer", "name", h.dev,
                    "netns", h.netns)
                _ip("link", "set", outside, "master", self.bridge, "up")
                _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.dev)
                _ip("-n", h.netns, "link", "set", h.dev, "up")
                _ip("-n", h.netns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for h in (self.p, self.d):
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
