"""P's push-mode step in the plugin, per drain of vLLM's writer thread, with
1k and 10k registrations outstanding: kvlease's guard against a naive guard
in plain Python, both measured in this process, same run (issue 38, item 6).

    python py/bench/push_step.py [--short] [--json PATH]

What one drain costs P. vLLM's push writer thread drains NIXL every
millisecond while P holds prefilled blocks no registration matched yet, and
the plugin's tap runs P's guard on each drain (``push_worker._kvl_on_drain``):

- kvlease: ``PrefillPushGuard.poll(now)`` (ends registrations past the hold
  limit, takes the Rust role's ``PEND:``/``PHB:`` to send) and
  ``due_resamples(now)`` (the clock asks due), the plugin's own calls;
- naive: what a guard does that keeps its registrations in a dict and looks
  at every one on every drain: each one's gate (the deadline translated onto
  P's clock less the bound) and hold limit, and every heartbeat interval a
  ``PHB:`` text naming each.

Two kinds of drain: a quiet one (nothing due: almost every drain) and a
heartbeat drain (every ``kv_lease_duration / 6``: ``PHB:`` out naming every
registration held). Each figure is the median over repetitions; nothing ends
during the measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from kvlease import PushConfig
from kvlease.vllm.handshake_adverts import ClockRound
from kvlease.vllm.push_permits import DecodePushGuard
from kvlease.vllm.push_writes import PrefillPushGuard

SIZES = (1_000, 10_000)
SKEW = 500.0
D_ENGINE, P_ENGINE = "d-engine", "p-engine"


def kvlease_guard(n: int) -> PrefillPushGuard:
    """A P guard holding ``n`` registrations of one D (not yet written)."""
    # Long permits, a 1 s heartbeat interval: nothing ends while the clock
    # runs through the repetitions.
    config = PushConfig(100_000.0, capacity=n + 16, heartbeat_interval=1.0)
    d = DecodePushGuard(config, max_peers=4, seed=1)
    p = PrefillPushGuard(config, max_peers=4, hold_limit=1e9)
    p.peers.note_agents(D_ENGINE, ["d-agent"])
    p.observe_clock(D_ENGINE, [ClockRound((0.9, 1.0 + SKEW, 1.1))], 1.1)
    p.note_address(D_ENGINE, "10.0.0.1", 5600, 1.1)
    for i in range(n):
        permit = d.register(f"req-{i}", P_ENGINE, 1.2 + SKEW)
        handle, refusal = p.register(D_ENGINE, permit, f"req-{i}", True, 1.2)
        assert handle is not None, refusal
    p.poll(1.3)  # the first heartbeat and scan are not what is measured
    return p


class NaiveGuard:
    """The same registrations in a dict, every one looked at each drain."""

    def __init__(self, n: int, config: PushConfig) -> None:
        self.config = config
        self.offset, self.bound = SKEW, 0.001
        # rid -> (D's slot, nonce, deadline on D's clock, since)
        deadline = 1.2 + SKEW + config.duration
        self.regs = {f"req-{i}": (i, 1000 + i, deadline, 1.2) for i in range(n)}
        self.next_heartbeat = 0.0

    def poll(self, now: float) -> list[bytes]:
        out = []
        margin = self.bound + self.config.post_margin
        for rid, (_slot, _nonce, deadline, since) in list(self.regs.items()):
            closes = deadline - self.offset - margin
            if now >= closes or now - since > 1e9:
                del self.regs[rid]
                out.append(f"PEND:{rid}X".encode())
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + self.config.heartbeat_interval
            out.append(("PHB:" + ",".join(f"{s:08x}{n:016x}" for s, n, _d, _t in self.regs.values())).encode())
        return out


def median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def measure(n: int, reps: int) -> dict[str, float]:
    p = kvlease_guard(n)
    naive = NaiveGuard(n, p.config)
    now = [2.0]
    interval = p.config.heartbeat_interval

    def quiet(step):
        def run() -> None:
            now[0] += 0.001  # vLLM's writer drains every millisecond
            step(now[0])
        return run

    def heartbeat(step):
        def run() -> None:
            now[0] += interval  # one whole interval: the PHB: is due
            step(now[0])
        return run

    def kvlease_drain(t: float) -> None:
        p.poll(t)
        p.due_resamples(t)

    out = {}
    for name, step in (("kvlease", kvlease_drain), ("naive", naive.poll)):
        now[0] = 2.0
        step(now[0])
        out[f"{name}_quiet_us"] = median_us(quiet(step), reps)
        now[0] = 2.0
        out[f"{name}_heartbeat_us"] = median_us(heartbeat(step), max(5, reps // 20))
    assert p.held == n and len(naive.regs) == n, "something ended during the measurement"
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    reps = 200 if args.short else 2000
    results = {n: measure(n, reps) for n in SIZES}
    print("P's push step per drain of vLLM's writer thread, one worker; medians (us)")
    print("| registrations | kvlease quiet | naive quiet | ratio | kvlease PHB: drain | naive PHB: drain | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in results.items():
        print(f"| {n:,} | {r['kvlease_quiet_us']:.2f} | {r['naive_quiet_us']:.1f} | "
              f"{r['naive_quiet_us'] / r['kvlease_quiet_us']:.0f}x | {r['kvlease_heartbeat_us']:.1f} | "
              f"{r['naive_heartbeat_us']:.1f} | {r['naive_heartbeat_us'] / r['kvlease_heartbeat_us']:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(n): r for n, r in results.items()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
