"""Scratch calibration: start ref + P + D (kvlease), send prompts, compare."""
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from instances import InstanceSpec, start_all
from routers import RouterProcess
import workload

model = os.environ["ENGINE_MODEL"]
logs = Path("/tmp/calib-logs")
conn = sys.argv[1] if len(sys.argv) > 1 else "kvlease"
extra = {"kv_lease_duration": 12}
t0 = time.monotonic()
specs = [InstanceSpec("ref"),
         InstanceSpec("p", connector=conn, extra=extra, num_blocks=48, args=["--max-num-batched-tokens", "64"]),
         InstanceSpec("d", connector=conn, extra=extra)]
insts = start_all(specs, model, logs)
print("started in", time.monotonic() - t0, [i.ready_after_s for i in insts], flush=True)
ref, p, d = insts
try:
    prompts = workload.make_prompts(model, 24, seed=1)
    t = time.monotonic()
    refs = workload.run(workload.complete_all(ref.url, prompts, concurrency=4))
    print("ref", time.monotonic() - t, [a.latency_s for a in refs][:5], flush=True)
    for i in range(3):
        print(repr(refs[i].text))
    toy = RouterProcess("toy", [p], [d], logs).start()
    f64 = RouterProcess("float64", [p], [d], logs).start()
    for r in (toy, f64):
        t = time.monotonic()
        ans = workload.run(workload.complete_all(r.url, prompts, concurrency=4))
        eq = sum(a.text == b.text for a, b in zip(ans, refs))
        print(r.kind, "equal", eq, "of", len(prompts), "in", time.monotonic() - t, flush=True)
        for a, b in zip(ans, refs):
            if a.text != b.text:
                print(" differs:", a.status, repr(a.text)[:80], "vs", repr(b.text)[:80], a.error)
    print("P usage", p.kv_usage(), "D usage", d.kv_usage())
    m = d.metrics()
    print({k: v for k, v in m.items() if "kv_lease" in k or "nixl" in k})
    toy.stop(); f64.stop()
    if len(sys.argv) > 2:
        input("press enter to stop")
finally:
    for i in insts:
        i.stop(grace=5)
