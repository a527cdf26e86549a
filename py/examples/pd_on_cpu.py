"""The quickstart's driver (``bash py/examples/pd-on-cpu.sh``): P and D
``vllm serve`` with ``KvLeaseNixlConnector``, a router, a few requests, and one
late arrival. Run it through the shell script, which prepares the
environment (``ENGINE_PYTHON``, ``ENGINE_MODEL``, ...).

    --stock   also run stock vLLM's NixlConnector through the same late arrival
    --lease   kv_lease_duration in seconds (default 12)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import aiohttp  # noqa: E402

from instances import InstanceSpec, start_all  # noqa: E402
from routers import RouterProcess  # noqa: E402
from workload import complete, complete_all, make_prompts, run  # noqa: E402


def say(msg: str) -> None:
    print(msg, flush=True)


def pair(connector: str, lease: int, model: str, logs: Path):
    extra = {"kv_lease_duration": lease}
    # A small P cache: freed blocks are reused by the next prefills at once.
    p = InstanceSpec(f"p-{connector}", connector=connector, extra=extra, num_blocks=32,
                     prefill=True)
    d = InstanceSpec(f"d-{connector}", connector=connector, extra=extra)
    return start_all([p, d], model, logs)


def late_arrival(router: RouterProcess, late: list[int], others: list[list[int]],
                 lease: int) -> str:
    async def go() -> str:
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(complete(session, router.url, late, hold_key="late",
                                                request_id="late-request"))
            await asyncio.to_thread(router.wait_held, "late")
            say(f"  request 'late' prefilled on P; the router holds it {lease + 3} s "
                f"(the lease is {lease} s) ...")
            await asyncio.sleep(lease + 3)
            say(f"  {len(others)} other prefills reuse its blocks on P ...")
            await complete_all(router.url, others, concurrency=2, prefix="other")
            router.release("late")
            ans = await task
            return ans.text if ans.ok else f"<HTTP {ans.status}: {ans.error}>"

    return run(go())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stock", action="store_true")
    ap.add_argument("--lease", type=int, default=12)
    args = ap.parse_args()
    model = os.environ["ENGINE_MODEL"]
    logs = Path(os.environ["ENGINE_WORK"]) / "logs" / ("quickstart-" + time.strftime("%H%M%S"))
    prompts = make_prompts(model, 12, seed=7)

    say("starting a plain vllm serve for the reference texts, and P and D with kvlease "
        "(30-60 s each on a laptop) ...")
    ref, p, d = start_all([InstanceSpec("ref")], model, logs) + pair("kvlease", args.lease, model, logs)
    instances = [p, d]
    try:
        reference = [a.text for a in run(complete_all(ref.url, prompts, prefix="ref"))]
        ref.stop(grace=5)
        router = RouterProcess("float64", [p], [d], logs).start()
        say(f"P at {p.url}, D at {d.url}, router at {router.url} (logs in {logs})\n")
        answers = run(complete_all(router.url, prompts[1:5], prefix="hello"))
        for a, r in zip(answers, reference[1:5]):
            say(f"  D answered {a.text!r:40.40} {'== reference' if a.text == r else '!= reference'}")
        say("\nlate arrival with kvlease:")
        text = late_arrival(router, prompts[0], prompts[5:], args.lease)
        caught = d.count_in_log("failed its lease check")
        say(f"  D answered {text!r:40.40} "
            f"({'the right text' if text == reference[0] else 'ANOTHER TEXT'}); "
            f"D's lease checks failed {caught} time(s), and vLLM recomputed the KV")
        router.stop()
        if args.stock:
            for inst in instances:
                inst.stop(grace=5)
            say("\nthe same with stock vLLM (NixlConnector) ...")
            instances = pair("stock", args.lease, model, logs)
            router = RouterProcess("float64", [instances[0]], [instances[1]], logs).start()
            text = late_arrival(router, prompts[0], prompts[5:], args.lease)
            verdict = "the right text" if text == reference[0] else "ANOTHER REQUEST'S TEXT"
            say(f"  stock D answered {text!r:40.40} with HTTP 200: {verdict}")
            router.stop()
    finally:
        for inst in [ref, *instances]:
            inst.stop(grace=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
