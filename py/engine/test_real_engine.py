"""kvlease in a real vLLM engine: ``vllm serve`` P and D (vLLM's CPU build,
real NIXL), routers in front, a plain ``vllm serve`` as the reference, and
stock ``NixlConnector`` as the control wherever a failure should show.

Every case is a claim an operator cares about, measured on real processes in
real time. Bounds are generous (2 cores, each idle NIXL worker burns half a
core), and every control must show the failure the case is about: a control
that shows nothing fails the case, because then it tests nothing.

The cases run in this file's order, which keeps instance swaps few
(``fleet.py``): kvlease P + kvlease D first, then the mixed fleets and stock,
then P with TP 2, then async scheduling. Figures go to
``.engine/results/cases.jsonl``; ``report.py`` prints the table.

Texts are compared with the plain reference's greedy text for the same token
ids and ``max_tokens``. A wrong answer is an HTTP 200 whose text differs.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

import workload
from instances import InstanceSpec
from workload import Answer, complete, complete_all, make_prompts, run

#: kv_lease_duration (s): heartbeat every 2 s, extension 8 s. 12 s or more on
#: 2 cores (docs/vllm.md): P's HTTP replies alone took up to 6 s under load.
LEASE = 12.0
INTERVAL = LEASE // 6
EXTENSION = LEASE * 2 // 3
EXTRA = {"kv_lease_duration": int(LEASE)}
#: P's KV cache in blocks of 32 tokens: small, so freed blocks are reused at
#: once (the late-arrival and soak controls need that), and smaller than four
#: long prompts (the preemption case: 4 running x 13 blocks > 40).
P_BLOCKS = 40
#: P prefills up to four requests at once in chunks of 32 tokens, so
#: concurrent long prompts run out of blocks mid-prefill and vLLM preempts
#: them (the preemption case).
P_ARGS = ["--max-num-batched-tokens", "128", "--long-prefill-token-threshold", "32"]


def p_spec(connector: str, tp: int = 1, **kw) -> InstanceSpec:
    name = f"p-{connector}" + (f"-tp{tp}" if tp > 1 else "")
    return InstanceSpec(name=name, connector=connector, extra=dict(EXTRA), tp=tp,
                        num_blocks=P_BLOCKS, args=list(P_ARGS), **kw)


def d_spec(connector: str, **kw) -> InstanceSpec:
    name = f"d-{connector}" + (f"-{kw['num_blocks']}blocks" if "num_blocks" in kw else "")
    return InstanceSpec(name=name, connector=connector, extra=dict(EXTRA), **kw)


REF = InstanceSpec(name="ref")

# ---- the prompt sets, all known up front so one plain instance answers them --

HAPPY = ("happy", 24, 1, {})
LATE_A = ("late-a", 1, 2, {})
FILLER = ("filler", 14, 3, {})
OVERLOAD = ("overload", 24, 4, {"min_len": 40, "max_len": 60, "max_tokens": 300})
PREEMPT = ("preempt", 6, 5, {"min_len": 380, "max_len": 420, "max_tokens": 8})
SOAK = ("soak", 200, 6, {"max_tokens": 12})
KILL = ("kill", 8, 7, {"max_tokens": 200})
AFTER = ("after", 8, 8, {})
MIXED = ("mixed", 12, 9, {})
TP2 = ("tp2", 12, 10, {})
ASYNC = ("async", 12, 11, {})
SETS = [HAPPY, LATE_A, FILLER, OVERLOAD, PREEMPT, SOAK, KILL, AFTER, MIXED, TP2, ASYNC]


class PromptSet:
    def __init__(self, model: str, spec) -> None:
        name, n, seed, opts = spec
        opts = dict(opts)
        self.name = name
        self.max_tokens = opts.pop("max_tokens", workload.MAX_TOKENS)
        self.prompts = make_prompts(model, n, seed, **opts)
        self.reference: list[str] = []


@pytest.fixture(scope="session")
def sets(fleet) -> dict[str, PromptSet]:
    """Every prompt set with its reference texts from a plain ``vllm serve``,
    started beside the first P and D and stopped once it answered."""
    out = {s[0]: PromptSet(fleet.model, s) for s in SETS}
    fleet.ensure(ref=REF, p=p_spec("kvlease"), d=d_spec("kvlease"))
    ref = fleet.running["ref"]
    for ps in out.values():
        answers = run(complete_all(ref.url, ps.prompts, concurrency=4, max_tokens=ps.max_tokens,
                                   prefix=f"ref-{ps.name}"))
        bad = [a for a in answers if not a.ok]
        assert not bad, f"the plain reference failed: {bad[0].error}"
        ps.reference = [a.text for a in answers]
    fleet.stop("ref")
    return out


def compare(answers: list[Answer], reference: list[str]) -> dict[str, int]:
    equal = sum(a.ok and a.text == r for a, r in zip(answers, reference))
    wrong = sum(a.ok and a.text != r for a, r in zip(answers, reference))
    failed = sum(not a.ok for a in answers)
    return {"requests": len(answers), "texts_equal": equal, "wrong_answers": wrong,
            "http_errors": failed}


def d_counters(d, settle: bool = True) -> dict[str, float]:
    """D's kvlease counters (0 on a stock D, which exports none), read once
    they stopped moving: a step's stats reach /metrics with the engine's next
    output batch, a moment after the answer that step produced."""
    last = None
    for _ in range(20 if settle else 1):
        now = _d_counters_once(d)
        if now == last:
            break
        last = now
        time.sleep(0.5)
    return last


def _d_counters_once(d) -> dict[str, float]:
    out = {}
    for key, metric in (("verified", "vllm:kv_lease_verified_loads_total"),
                        ("failed_checks", "vllm:kv_lease_failed_checks_total"),
                        ("unverified", "vllm:kv_lease_unverified_loads_total"),
                        ("failed_transfers", "vllm:nixl_num_failed_transfers_total")):
        try:
            out[key] = d.metric(metric)
        except KeyError:
            out[key] = 0.0
    return out


def p_usage_back(p, baseline: float, timeout: float) -> float | None:
    """Seconds until P's KV usage is back at ``baseline``, or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if p.kv_usage() <= baseline + 1e-9:
            return time.monotonic() - t0
        time.sleep(0.25)
    return None


def log_count(inst, pattern: str) -> int:
    return inst.count_in_log(pattern)


# ---- kvlease P + kvlease D -----------------------------------------------------


def test_happy_path_kvlease_through_vllms_toy_proxy(fleet, sets, record):
    """24 prompts through vLLM's own toy proxy, unmodified: every text equals
    the plain reference, and every load was verified."""
    fleet.ensure(p=p_spec("kvlease"), d=d_spec("kvlease"))
    d = fleet.running["d"]
    before = d_counters(d)
    ps = sets["happy"]
    answers = run(complete_all(fleet.router("toy").url, ps.prompts, concurrency=4,
                               max_tokens=ps.max_tokens, prefix="happy-toy"))
    after = d_counters(d)
    figures = compare(answers, ps.reference)
    figures["verified"] = after["verified"] - before["verified"]
    figures["failed_checks"] = after["failed_checks"] - before["failed_checks"]
    record.write("happy (toy proxy)", "kvlease", **figures)
    assert figures["texts_equal"] == len(ps.prompts), figures
    assert figures["verified"] >= len(ps.prompts) and figures["failed_checks"] == 0, figures


def test_nonces_survive_a_float64_router(fleet, sets, record):
    """The same prompts through a router that decodes kv_transfer_params as
    float64 (llm-d's sidecar, JavaScript proxies): the nonces arrive intact
    (all below 2^53), so every check passes and every read-done frees."""
    fleet.ensure(p=p_spec("kvlease"), d=d_spec("kvlease"))
    d = fleet.running["d"]
    router = fleet.router("float64")
    before = d_counters(d)
    ps = sets["happy"]
    answers = run(complete_all(router.url, ps.prompts, concurrency=4,
                               max_tokens=ps.max_tokens, prefix="happy-f64"))
    after = d_counters(d)
    figures = compare(answers, ps.reference)
    figures["verified"] = after["verified"] - before["verified"]
    figures["failed_checks"] = after["failed_checks"] - before["failed_checks"]
    record.write("happy (float64 router)", "kvlease", **figures)
    assert figures["texts_equal"] == len(ps.prompts), figures
    assert figures["verified"] >= len(ps.prompts) and figures["failed_checks"] == 0, figures


def late_arrival(fleet, sets) -> dict:
    """Prefill A, hold it at the router until P let its lease go, prefill
    other requests that reuse A's blocks, then send A to D."""
    p, d = fleet.running["p"], fleet.running["d"]
    router = fleet.router("float64")
    a, filler = sets["late-a"], sets["filler"]
    before = d_counters(d)
    key = f"late-{random.getrandbits(32):08x}"

    async def scenario() -> tuple[Answer, list[Answer], float]:
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(complete(session, router.url, a.prompts[0],
                                                max_tokens=a.max_tokens, hold_key=key,
                                                request_id=key))
            t_p = await asyncio.to_thread(router.wait_held, key)
            t0 = time.monotonic()
            # P lets A go LEASE after its prefill; wait past that, plus a step.
            await asyncio.sleep(LEASE + 3.0)
            fill = await complete_all(router.url, filler.prompts, concurrency=2,
                                      max_tokens=filler.max_tokens, prefix=f"{key}-fill")
            router.release(key)
            return await task, fill, time.monotonic() - t0

    ans, fill, held = run(scenario())
    after = d_counters(d)
    return {
        "a_equal": int(ans.ok and ans.text == a.reference[0]),
        "a_wrong": int(ans.ok and ans.text != a.reference[0]),
        "a_status": ans.status,
        "held_s": round(held, 1),
        "filler_equal": compare(fill, filler.reference)["texts_equal"],
        "failed_checks": after["failed_checks"] - before["failed_checks"],
        "recomputes": after["failed_checks"] - before["failed_checks"],
    }


def test_late_arrival_kvlease_fails_the_check_and_recomputes(fleet, sets, record):
    fleet.ensure(p=p_spec("kvlease"), d=d_spec("kvlease"))
    figures = late_arrival(fleet, sets)
    record.write("late arrival", "kvlease", **figures)
    assert figures["a_status"] == 200 and figures["a_equal"] == 1, figures
    assert figures["failed_checks"] >= 1, f"the lapse was not caught: {figures}"
    assert figures["filler_equal"] == len(sets["filler"].prompts), figures


def test_overload_heartbeats_keep_queued_requests_alive(fleet, sets, record):
    """24 requests with long decodes: most wait in D's queue longer than the
    lease, and D's heartbeats keep P's blocks: 0 premature frees, every text
    equal. The case fails if no request waited longer than the lease (then it
    tested nothing)."""
    fleet.ensure(p=p_spec("kvlease"), d=d_spec("kvlease"))
    p, d = fleet.running["p"], fleet.running["d"]
    ps = sets["overload"]
    before = d_counters(d)
    expired_before = log_count(p, r"kvlease: lease of request \S+ expired")
    answers = run(complete_all(fleet.router("float64").url, ps.prompts, concurrency=len(ps.prompts),
                               max_tokens=ps.max_tokens, prefix="overload"))
    after = d_counters(d)
    figures = compare(answers, ps.reference)
    figures["longest_s"] = round(max(a.latency_s for a in answers), 1)
    figures["premature_frees"] = log_count(p, r"kvlease: lease of request \S+ expired") - expired_before
    figures["failed_checks"] = after["failed_checks"] - before["failed_checks"]
    record.write("overload", "kvlease", **figures)
    assert figures["longest_s"] > LEASE + INTERVAL, f"no request waited past the lease: {figures}"
    assert figures["premature_frees"] == 0 and figures["failed_checks"] == 0, figures
    assert figures["texts_equal"] == len(ps.prompts), figures


def test_preemption_on_p_then_a_lapse_does_not_crash_p(fleet, sets, record):
    """Concurrent long prompts on P's small cache, prefilled in 64-token
    chunks: vLLM preempts do_remote_decode requests mid-prefill and schedules
    them again. Then every one is held past its lease and D's read-dones
    arrive late. P must not crash (vLLM's `assert req_id in self.requests`),
    must hold no block afterwards, and must keep serving."""
    fleet.ensure(p=p_spec("kvlease"), d=d_spec("kvlease"))
    p, d = fleet.running["p"], fleet.running["d"]
    router = fleet.router("float64")
    ps = sets["preempt"]
    preempted_before = p.metric("vllm:num_preemptions_total")
    keys = [f"pre-{i}-{random.getrandbits(24):06x}" for i in range(len(ps.prompts))]

    async def scenario():
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(complete(session, router.url, pr, hold_key=k,
                                                  request_id=k, max_tokens=ps.max_tokens))
                     for pr, k in zip(ps.prompts, keys)]
            for k in keys:
                await asyncio.to_thread(router.wait_held, k, 300)
            await asyncio.sleep(LEASE + 3.0)
            for k in keys:
                router.release(k)
            return await asyncio.gather(*tasks)

    answers = run(scenario())
    figures = compare(answers, ps.reference)
    figures["preemptions"] = int(p.metric("vllm:num_preemptions_total") - preempted_before)
    time.sleep(2 * INTERVAL)  # the late read-dones reach P on its next steps
    figures["p_alive"] = int(p.alive())
    figures["p_usage_after"] = p.kv_usage() if p.alive() else None
    # P keeps serving.
    more = run(complete_all(router.url, sets["happy"].prompts[:4], concurrency=4,
                            max_tokens=sets["happy"].max_tokens, prefix="pre-after"))
    figures["after_equal"] = compare(more, sets["happy"].reference[:4])["texts_equal"]
    figures["p_crashes"] = len(fleet.check_crashes())
    record.write("preemption on P + lapse", "kvlease", **figures)
    assert figures["preemptions"] > 0, f"nothing was preempted: the case tested nothing ({figures})"
    assert figures["p_alive"] == 1 and figures["p_crashes"] == 0, p.log_tail()
    assert figures["texts_equal"] == len(ps.prompts), figures
    assert figures["p_usage_after"] == 0.0, figures
    assert figures["after_equal"] == 4, figures


def soak(fleet, sets, seed: int) -> tuple[dict, list[Answer]]:
    """200 requests at concurrency 12, router holds spread around the lease:
    70 % go straight through, 20 % wait up to half a lease, 10 % wait 1.2 to
    2 leases (those lapse on P)."""
    ps = sets["soak"]
    rng = random.Random(seed)
    holds = []
    for _ in ps.prompts:
        x = rng.random()
        holds.append(0.0 if x < 0.7 else rng.uniform(0, LEASE / 2) if x < 0.9
                     else rng.uniform(1.2 * LEASE, 2 * LEASE))
    p, d = fleet.running["p"], fleet.running["d"]
    before = d_counters(d)
    t0 = time.monotonic()
    answers = run(complete_all(fleet.router("float64").url, ps.prompts, concurrency=12,
                               holds=holds, max_tokens=ps.max_tokens, prefix=f"soak{seed}"))
    figures = compare(answers, ps.reference)
    after = d_counters(d)
    figures["wall_s"] = round(time.monotonic() - t0, 1)
    figures["held_past_lease"] = sum(h > LEASE for h in holds)
    figures["failed_checks"] = after["failed_checks"] - before["failed_checks"]
    figures["recomputes"] = figures["failed_checks"]
    back = p_usage_back(p, 0.0, LEASE + EXTENSION + 10)
    figures["p_usage_back_s"] = None if back is None else round(back, 1)
    figures["p_usage_end"] = p.kv_usage()
    return figures, answers


def test_soak_kvlease_gives_no_wrong_answer(fleet, sets, record):
    fleet.ensure(p=p_spec("kvlease"), d=d_spec("kvlease"))
    figures, _ = soak(fleet, sets, seed=1)
    record.write("soak", "kvlease", **figures)
    assert figures["wrong_answers"] == 0 and figures["http_errors"] == 0, figures
    assert figures["texts_equal"] == len(sets["soak"].prompts), figures
    assert figures["p_usage_end"] == 0.0, figures


def test_p_killed_mid_flight_d_fails_those_loads_and_serves_on(fleet, sets, record):
    """Requests prefilled on P and held at the router; P is SIGKILLed; the
    requests reach D: D fails those loads and recomputes (no hang), and once
    a new P is up D serves what follows."""
    fleet.ensure(p=p_spec("kvlease"), d=d_spec("kvlease"))
    router = fleet.router("float64")
    d = fleet.running["d"]
    ps = sets["happy"]
    prompts, reference = ps.prompts[:6], ps.reference[:6]
    keys = [f"pk-{i}-{random.getrandbits(24):06x}" for i in range(len(prompts))]
    before = d_counters(d)

    async def scenario():
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(complete(session, router.url, pr, hold_key=k,
                                                  request_id=k, max_tokens=ps.max_tokens,
                                                  timeout_s=240))
                     for pr, k in zip(prompts, keys)]
            for k in keys:
                await asyncio.to_thread(router.wait_held, k)
            fleet.kill("p")
            t0 = time.monotonic()
            for k in keys:
                router.release(k)
            answers = await asyncio.gather(*tasks)
            return answers, time.monotonic() - t0

    answers, took = run(scenario())
    after = d_counters(d)
    figures = compare(answers, reference)
    figures["took_s"] = round(took, 1)
    figures["failed_checks"] = after["failed_checks"] - before["failed_checks"]
    # P's death fails vLLM's own READs (a failed transfer, recomputed).
    figures["failed_transfers"] = after["failed_transfers"] - before["failed_transfers"]
    # A new P (new engine id); the same D serves what follows.
    fleet.ensure(p=p_spec("kvlease"), d=d_spec("kvlease"))
    more = run(complete_all(fleet.router("float64").url, sets["after"].prompts, concurrency=4,
                            max_tokens=sets["after"].max_tokens, prefix="after-pkill"))
    figures["after_equal"] = compare(more, sets["after"].reference)["texts_equal"]
    figures["d_crashes"] = len(fleet.check_crashes())
    record.write("P killed mid-flight", "kvlease", **figures)
    assert figures["texts_equal"] == len(prompts), figures
    assert figures["failed_checks"] + figures["failed_transfers"] >= 1, (
        f"no load failed after P died: the case tested nothing ({figures})")
    assert figures["after_equal"] == len(sets["after"].prompts), figures
    assert figures["d_crashes"] == 0, figures


def test_d_killed_p_reclaims_within_the_bound(fleet, sets, record):
    """Requests queued on D (long decodes), D SIGKILLed: P's KV usage (its
    /metrics) returns to its baseline within max(lease, extension +
    interval) plus a step."""
    # A D with a small KV cache (24 blocks: one or two of these requests at a
    # time), so the others wait in D's queue, heartbeated, their blocks held
    # on P; a D with room for all of them would read them at once.
    fleet.ensure(p=p_spec("kvlease"), d=d_spec("kvlease", num_blocks=24))
    p = fleet.running["p"]
    router = fleet.router("float64")
    ps = sets["kill"]
    baseline = p.kv_usage()

    async def scenario():
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(complete(session, router.url, pr, timeout_s=60,
                                                  max_tokens=ps.max_tokens,
                                                  request_id=f"dk-{i}-{random.getrandbits(24):06x}"))
                     for i, pr in enumerate(ps.prompts)]
            # Until P holds the queued requests' blocks.
            for _ in range(240):
                if p.kv_usage() > baseline:
                    break
                await asyncio.sleep(0.25)
            await asyncio.sleep(2 * INTERVAL)
            held = p.kv_usage()
            fleet.kill("d")
            t_kill = time.monotonic()
            back = await asyncio.to_thread(p_usage_back, p, baseline, 3 * LEASE)
            for t in tasks:
                t.cancel()
            return held, back, t_kill

    held, back, _ = run(scenario())
    bound = max(LEASE, EXTENSION + INTERVAL) + 1.0
    figures = {"p_usage_held": held, "p_usage_baseline": baseline,
               "reclaim_s": None if back is None else round(back, 2), "bound_s": bound,
               "p_crashes": len(fleet.check_crashes())}
    record.write("D killed", "kvlease", **figures)
    assert held > baseline, f"P held nothing when D was killed: the case tested nothing ({figures})"
    assert back is not None and back <= bound, figures


# ---- mixed fleets and stock --------------------------------------------------


def mixed(fleet, sets, record, p_conn: str, d_conn: str) -> None:
    fleet.ensure(p=p_spec(p_conn), d=d_spec(d_conn))
    d = fleet.running["d"]
    before = d_counters(d)
    ps = sets["mixed"]
    answers = run(complete_all(fleet.router("float64").url, ps.prompts, concurrency=4,
                               max_tokens=ps.max_tokens, prefix=f"mixed-{p_conn}-{d_conn}"))
    after = d_counters(d)
    figures = compare(answers, ps.reference)
    figures.update({k: after[k] - before[k] for k in after})
    record.write(f"mixed: {p_conn} P + {d_conn} D", f"{p_conn}/{d_conn}", **figures)
    assert figures["texts_equal"] == len(ps.prompts), figures
    if d_conn == "kvlease":
        # A stock P advertises no slots: D reads as vLLM reads, counted unverified.
        assert figures["unverified"] >= len(ps.prompts) and figures["failed_checks"] == 0, figures


def test_mixed_kvlease_p_with_stock_d(fleet, sets, record):
    mixed(fleet, sets, record, "kvlease", "stock")


def test_happy_path_stock_through_vllms_toy_proxy(fleet, sets, record):
    fleet.ensure(p=p_spec("stock"), d=d_spec("stock"))
    ps = sets["happy"]
    answers = run(complete_all(fleet.router("toy").url, ps.prompts, concurrency=4,
                               max_tokens=ps.max_tokens, prefix="happy-stock"))
    figures = compare(answers, ps.reference)
    record.write("happy (toy proxy)", "stock", **figures)
    assert figures["texts_equal"] == len(ps.prompts), figures


def test_late_arrival_stock_control_answers_with_another_requests_kv(fleet, sets, record):
    """The control: stock vLLM answers the late request with HTTP 200 and
    another request's text. If it does not, the late-arrival case tests
    nothing, and this fails."""
    fleet.ensure(p=p_spec("stock"), d=d_spec("stock"))
    figures = late_arrival(fleet, sets)
    p = fleet.running["p"]
    figures["p_logged_expired"] = log_count(p, "Releasing expired KV blocks")
    record.write("late arrival", "stock", **figures)
    assert figures["a_status"] == 200 and figures["a_wrong"] == 1, (
        f"the control did not show the corruption: {figures}")


def test_soak_stock_control_counts_wrong_answers(fleet, sets, record):
    fleet.ensure(p=p_spec("stock"), d=d_spec("stock"))
    figures, _ = soak(fleet, sets, seed=1)
    record.write("soak", "stock", **figures)
    assert figures["wrong_answers"] > 0, f"the stock control gave no wrong answer: {figures}"


def test_mixed_stock_p_with_kvlease_d(fleet, sets, record):
    mixed(fleet, sets, record, "stock", "kvlease")


# ---- heterogeneous TP: P with TP 2 (two worker processes), D with TP 1 ---------


def test_heterogeneous_tp_p2_d1(fleet, sets, record):
    """P's two workers each hold a share; vLLM's KV-output aggregation must
    see both ranks' reports before the blocks go. Texts equal, verified; then
    one late arrival is caught."""
    fleet.ensure(p=p_spec("kvlease", tp=2), d=d_spec("kvlease"))
    d = fleet.running["d"]
    before = d_counters(d)
    ps = sets["tp2"]
    answers = run(complete_all(fleet.router("float64").url, ps.prompts, concurrency=4,
                               max_tokens=ps.max_tokens, prefix="tp2"))
    after = d_counters(d)
    figures = compare(answers, ps.reference)
    figures["verified"] = after["verified"] - before["verified"]
    late = late_arrival(fleet, sets)
    figures["late_equal"] = late["a_equal"]
    figures["late_failed_checks"] = late["failed_checks"]
    p = fleet.running["p"]
    figures["p_usage_back_s"] = p_usage_back(p, 0.0, LEASE + EXTENSION)
    record.write("heterogeneous TP (P 2, D 1)", "kvlease", **figures)
    assert figures["texts_equal"] == len(ps.prompts) and figures["verified"] >= len(ps.prompts), figures
    assert figures["late_equal"] == 1 and figures["late_failed_checks"] >= 1, figures
    assert figures["p_usage_back_s"] is not None, figures


# ---- async scheduling (vLLM's GPU default), turned back on in the CPU engine ---

ASYNC_ENV = {"KVLEASE_ENGINE_ASYNC_SCHEDULING": "1"}


def test_async_scheduling_happy_lapse_and_abort(fleet, sets, record):
    """With async scheduling (plugins/kvlease_engine_plugins.py), the
    metadata of step N+1 is built before the output of step N is applied.
    Happy path, a late arrival, and requests aborted by their client while D
    waits for their KV: texts equal, the lapse caught, nothing leaked."""
    fleet.ensure(p=p_spec("kvlease", env=dict(ASYNC_ENV)), d=d_spec("kvlease", env=dict(ASYNC_ENV)))
    p, d = fleet.running["p"], fleet.running["d"]
    for inst in (p, d):
        assert inst.count_in_log("async scheduling re-enabled on CPU") >= 1, inst.log_tail()
    before = d_counters(d)
    ps = sets["async"]
    router = fleet.router("float64")
    answers = run(complete_all(router.url, ps.prompts, concurrency=4,
                               max_tokens=ps.max_tokens, prefix="async"))
    after = d_counters(d)
    figures = compare(answers, ps.reference)
    figures["verified"] = after["verified"] - before["verified"]
    late = late_arrival(fleet, sets)
    figures["late_equal"] = late["a_equal"]
    figures["late_failed_checks"] = late["failed_checks"]

    async def aborts():
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(complete(session, router.url, pr, max_tokens=200,
                                                  request_id=f"abort-{i}"))
                     for i, pr in enumerate(ps.prompts[:4])]
            await asyncio.sleep(1.0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(aborts())
    back = p_usage_back(p, 0.0, LEASE + EXTENSION + 5)
    figures["p_usage_back_after_aborts_s"] = None if back is None else round(back, 1)
    more = run(complete_all(router.url, sets["after"].prompts[:4], concurrency=4,
                            max_tokens=sets["after"].max_tokens, prefix="async-after"))
    figures["after_equal"] = compare(more, sets["after"].reference[:4])["texts_equal"]
    figures["crashes"] = len(fleet.check_crashes())
    record.write("async scheduling: happy, lapse, abort", "kvlease", **figures)
    assert figures["texts_equal"] == len(ps.prompts), figures
    assert figures["late_equal"] == 1 and figures["late_failed_checks"] >= 1, figures
    assert figures["p_usage_back_after_aborts_s"] is not None, figures
    assert figures["after_equal"] == 4 and figures["crashes"] == 0, figures


def test_no_instance_crashed(fleet, record):
    """Last: no instance exited without a case asking it to."""
    fleet.check_crashes()
    record.write("crashes (whole run)", "all", crashes=len(fleet.crashes))
    assert not fleet.crashes, fleet.crashes
