"""Scratch: reproduce D's stall after idle; dump every vLLM process's Python
stacks (py-spy) when a round is slow."""
import asyncio, os, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from instances import InstanceSpec, start_all
from routers import RouterProcess
import workload

model = os.environ["ENGINE_MODEL"]
logs = Path("/tmp/stall-logs")
conn = sys.argv[1] if len(sys.argv) > 1 else "kvlease"
idle = float(sys.argv[2]) if len(sys.argv) > 2 else 12
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
extra = {"kv_lease_duration": 30}
p, d = start_all([InstanceSpec("p", connector=conn, extra=extra),
                  InstanceSpec("d", connector=conn, extra=extra, env={"VLLM_LOGGING_LEVEL": "DEBUG"})], model, logs)
print("started", p.ready_after_s, d.ready_after_s, flush=True)
r = RouterProcess("float64", [p], [d], logs).start()
prompts = workload.make_prompts(model, 4 * rounds, seed=1)

def pids(inst):
    out = subprocess.run(["pgrep", "-g", str(inst.proc.pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]

def dump(tag):
    with open(logs / f"pyspy-{tag}.txt", "w") as f:
        for name, inst in (("P", p), ("D", d)):
            for pid in pids(inst):
                cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:80]
                f.write(f"==== {name} pid {pid} {cmd}\n")
                f.write(subprocess.run(["/tmp/pyspy/bin/py-spy", "dump", "--pid", str(pid)],
                                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "/tmp/pyspy"}).stdout)
    print("dumped", tag, flush=True)

async def one_round(rnd):
    task = asyncio.create_task(workload.complete_all(r.url, prompts[rnd*4:rnd*4+4], concurrency=4, prefix=f"r{rnd}"))
    done, _ = await asyncio.wait({task}, timeout=3.0)
    if not done:
        await asyncio.to_thread(dump, f"r{rnd}")
    return await task

try:
    for rnd in range(rounds):
        ans = asyncio.run(one_round(rnd))
        print(f"round {rnd} at {time.strftime('%H:%M:%S')}: latencies", [round(a.latency_s, 2) for a in ans], flush=True)
        time.sleep(idle)
finally:
    r.stop(); p.stop(grace=5); d.stop(grace=5)
