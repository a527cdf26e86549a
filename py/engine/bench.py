"""What kvlease costs in a real engine: TTFT and end-to-end latency, p50 and
p99, over the same requests for stock vLLM, kvlease, and kvlease with
verification off. A benchmark, not a test: it asserts nothing and prints a
table (docs/vllm.md has the figures of a run).

    eval "$(py/engine/env.sh)"; $ENGINE_PYTHON py/engine/bench.py [--requests 120]

Each configuration gets a fresh P and D (``vllm serve``, vLLM's CPU build,
real NIXL) behind vLLM's toy proxy; requests stream, so TTFT is the time
to the first token D streams back, through P's prefill, the router, D's KV
load and (kvlease) the lease check. The D step is measured beside it: the
time per output token after the first, (e2e - TTFT) / (max_tokens - 1), per
request (p50), the unit of "verification adds at most one D step to TTFT
p50".

Why rounds: on a small shared host the configurations measured one after
the other drift with the machine (a run's first pair found it quieter).
Each round measures every configuration with half the requests, the second
round in the reverse order (ABC, then CBA), and a configuration's figures
are over both rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from instances import InstanceSpec, start_all  # noqa: E402
from routers import RouterProcess  # noqa: E402
from workload import complete_all, make_prompts, run  # noqa: E402

LEASE = {"kv_lease_duration": 30}
CONFIGS = {
    "stock": ("stock", dict(LEASE)),
    "kvlease": ("kvlease", dict(LEASE)),
    "kvlease, verification off": ("kvlease", {**LEASE, "kv_lease_verification": False}),
}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def histogram_p50(inst, name: str) -> float | None:
    """The median of a vLLM Prometheus histogram, from its buckets."""
    buckets = []
    count = None
    for key, value in inst.metrics().items():
        if key.startswith(name + "_bucket{"):
            le = key.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), value))
        elif key.startswith(name + "_count"):
            count = value
    if not buckets or not count:
        return None
    for le, cum in sorted(buckets):
        if cum >= count / 2:
            return le
    return None


def measure(label: str, connector: str, extra: dict, prompts, max_tokens: int, logs: Path,
            model: str, concurrency: int) -> dict:
    """One fresh P and D of a configuration over ``prompts``: the samples."""
    p_spec = InstanceSpec(f"bench-p-{connector}", connector=connector, extra=extra,
                          prefill=True)
    d_spec = InstanceSpec(f"bench-d-{connector}", connector=connector, extra=extra)
    p, d = start_all([p_spec, d_spec], model, logs)
    # vLLM's toy proxy streams D's answer through; the float64 router reads
    # it whole (it times the D leg), so through it TTFT would equal e2e.
    router = RouterProcess("toy", [p], [d], logs).start()
    try:
        # Warm-up: the handshake and the first steps are not what is measured.
        run(complete_all(router.url, prompts[:4], concurrency=2, max_tokens=max_tokens,
                         stream=True, prefix="warm"))
        t0 = time.monotonic()
        answers = run(complete_all(router.url, prompts, concurrency=concurrency,
                                   max_tokens=max_tokens, stream=True, prefix="bench"))
        wall = time.monotonic() - t0
        ok = [a for a in answers if a.ok and a.ttft_s is not None]
        return {
            "config": label,
            "requests": len(answers),
            "ok": len(ok),
            "ttft_s": [a.ttft_s for a in ok],
            "e2e_s": [a.latency_s for a in ok],
            "tpot_s": [(a.latency_s - a.ttft_s) / max(1, max_tokens - 1) for a in ok],
            "vllm_itl_p50_s": histogram_p50(d, "vllm:inter_token_latency_seconds"),
            "wall_s": wall,
        }
    finally:
        router.stop()
        p.stop(grace=5)
        d.stop(grace=5)


def summary(label: str, runs: list[dict]) -> dict:
    """A configuration's figures over its rounds (ms)."""
    ttft = [x for r in runs for x in r["ttft_s"]]
    e2e = [x for r in runs for x in r["e2e_s"]]
    tpot = [x for r in runs for x in r["tpot_s"]]
    return {
        "config": label,
        "requests": sum(r["requests"] for r in runs),
        "ok": sum(r["ok"] for r in runs),
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p99_ms": 1000 * pct(ttft, 0.99),
        "e2e_p50_ms": 1000 * statistics.median(e2e),
        "e2e_p99_ms": 1000 * pct(e2e, 0.99),
        "tpot_p50_ms": 1000 * statistics.median(tpot),
        "rounds": runs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = os.environ["ENGINE_MODEL"]
    logs = Path(os.environ.get("ENGINE_WORK", ".engine")) / "logs" / ("bench-" + time.strftime("%H%M%S"))
    prompts = make_prompts(model, args.requests, seed=42)
    rounds = max(1, args.rounds)
    runs: dict[str, list[dict]] = {label: [] for label in CONFIGS}
    for k in range(rounds):
        # Every round its share of the prompts; odd rounds in reverse order.
        share = prompts[k::rounds]
        order = list(CONFIGS.items())
        for label, (conn, extra) in (order if k % 2 == 0 else order[::-1]):
            runs[label].append(measure(label, conn, extra, share, args.max_tokens, logs, model,
                                       args.concurrency))
    rows = [summary(label, r) for label, r in runs.items()]
    print(f"\n{args.requests} requests in {rounds} round(s) (ABC, CBA, ...), concurrency "
          f"{args.concurrency}, {args.max_tokens} tokens each, streamed through vLLM's toy "
          "proxy (ms):\n")
    print("| configuration | ok | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 | D step p50 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['ok']}/{r['requests']} | {r['ttft_p50_ms']:.1f} | "
              f"{r['ttft_p99_ms']:.1f} | {r['e2e_p50_ms']:.1f} | {r['e2e_p99_ms']:.1f} | "
              f"{r['tpot_p50_ms']:.1f} |")
    by = {r["config"]: r for r in rows}
    added = by["kvlease"]["ttft_p50_ms"] - by["kvlease, verification off"]["ttft_p50_ms"]
    step = by["kvlease"]["tpot_p50_ms"]
    print(f"\nverification adds {added:.1f} ms to TTFT p50; one D step is {step:.1f} ms "
          f"(kvlease's time per output token, p50): {added / step:.1f} D steps")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "verification_adds_ms": added}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
