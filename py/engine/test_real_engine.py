"""kvlease in a real vLLM engine: ``vllm serve`` P and D (vLLM's CPU build,
real NIXL), routers in front, a plain ``vllm serve`` as the reference, and
stock ``NixlConnector`` as the control wherever a failure should show.

Every case is a claim an operator cares about, measured on real processes in
real time. Bounds are generous (2 cores), and every control must show the
failure the case is about: a control that shows nothing fails the case,
because then it tests nothing.

The cases run in this file's order, which keeps instance starts few (about
40 s each on 2 cores, several at once):

=====  ====================================  =========================================
phase  instances (role: connector)           cases
=====  ====================================  =========================================
A      ref: plain (when its texts are not    happy (toy proxy, float64 router), late
       cached), p and d: kvlease,            arrival and soak beside the stock
       p_stock and d_stock: stock            controls, preemption on P, mixed fleets
C      p restarted as data parallel 2,       P killed mid-flight
       d_small started beside it (one
       start for phases C and D)
D      p (DP 2), d and d_small: kvlease,     1 P (DP 2) + 2 D behind the toy proxy
       d_small with a small KV cache;        and a late arrival; overload, D killed
       then d stopped
E      p: kvlease TP 2, d: kvlease, both     heterogeneous TP; async scheduling
       with async scheduling
F      push mode: p_push and d_push:         push happy path, a registration that reaches
       kvlease-push; p_push_stock and        P late, mixed fleets, P killed with
       d_push_stock: stock-push              registrations outstanding and D's aborts
=====  ====================================  =========================================

Every P and D runs on one of two "hosts" whose monotonic clocks differ by
10^5 s, with UCX over TCP between them (``shapes.py``): phases A, C and D
with D's clock ahead, E and F with P's; the routers and the reference run
on this machine's own. ``test_real_engine_fleet.py`` follows with phase G.

Phase E turns async scheduling on for both of its instances, the TP 2 P
included: that is vLLM's default on GPU (the CPU platform turns it off), so
a TP 2 P in production runs with it, and one pair covers both cases instead
of two pairs starting at once (about 80 s of the step's budget). Phases A
to D run vLLM's CPU default, without it.

The stock and kvlease runs of one scenario (late arrival, soak) go at the
same time, on their own P and D: half the wall time, and the same load on
both. Phase F's push runs go one after the other, kvlease first: a stock
push D left waiting on a WRITE that cannot come steps without end, 1.6-1.7
cores busy, and starves everything beside it; it is stopped after the case
that left it so (``retire_stuck_stock_d``) and started afresh for the next.

Phase F's stock controls (happy path, late registration, P killed) run no
kvlease code: their figures are reused while nothing they read changed,
keyed by the SHA-256 of it (``controls.py``; the row then names the hash in
``reused_for``), and the case asserts its control's claim on them all the
same. The stock pair still starts for the mixed fleets; reused, its D is
started once instead of three times. ``KVLEASE_ENGINE_CONTROLS=rerun`` runs
them all again.

Figures go to ``.engine/results/cases.jsonl``; ``report.py`` prints the table.
Texts are compared with the plain reference's greedy text for the same token
ids and ``max_tokens``. A wrong answer is an HTTP 200 whose text differs.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time

import aiohttp
import pytest

import workload
from measures import compare, counters, delta, p_usage_back, per_engine
from push_pairs import (PAIRS, PUSH_COUNTERS, PUSH_FENCE, PUSH_LEASE, STRAY, clock_estimate,
                        d_leak, d_leg_patience, estimate_within_its_bound, every_push_served,
                        push_counters, push_figures, push_round, retire_stuck_stock_d,
                        stock_control, stock_hangs_and_leaks, usage_back)
from scenarios import (both, every_load_verified_or_lapsed, happy, late_arrival,
                       late_arrival_async, soak_async)
from shapes import (ASYNC_ENV, D_SMALL_SPEC, EXTENSION, INTERVAL, LEASE, P_AHEAD, P_DP2,
                    PHASE_A, PHASE_F, d_spec, on, p_spec)
from workload import complete, complete_all, push_all, run

# ---- phase A: kvlease P and D, stock P and D beside them ----------------------


def test_happy_path_kvlease_through_vllms_toy_proxy(fleet, sets, record):
    """24 prompts through vLLM's own toy proxy, unmodified: every text equals
    the plain reference, and every load was verified."""
    fleet.ensure(**PHASE_A)
    figures = happy(fleet, sets["happy"], "toy")
    record.write("happy (toy proxy)", "kvlease", **figures)
    assert figures["texts_equal"] == figures["requests"], figures
    every_load_verified_or_lapsed(figures)


def test_nonces_survive_a_float64_router(fleet, sets, record):
    """The same prompts through a router that decodes kv_transfer_params as
    float64 (llm-d's sidecar, JavaScript proxies): the nonces arrive intact
    (all below 2^53), so every check passes and every read-done frees."""
    fleet.ensure(**PHASE_A)
    figures = happy(fleet, sets["happy"], "float64")
    record.write("happy (float64 router)", "kvlease", **figures)
    assert figures["texts_equal"] == figures["requests"], figures
    every_load_verified_or_lapsed(figures)


def test_late_arrival_kvlease_fails_the_check_and_recomputes_stock_answers_wrong(
        fleet, sets, record):
    """kvlease: the check fails, vLLM recomputes, the text is A's. The
    control, at the same time on its own P and D: stock vLLM answers A with
    HTTP 200 and another request's text. If the control does not show the
    corruption, the case tests nothing, and this fails."""
    fleet.ensure(**PHASE_A)
    p_stock = fleet.running["p_stock"]
    before = counters(p_stock)
    ours, stock = run(both(late_arrival_async(fleet, sets),
                           late_arrival_async(fleet, sets, "p_stock", "d_stock")))
    stock.update(delta(counters(p_stock), before, "stock_expired"))
    record.write("late arrival", "kvlease", **ours)
    record.write("late arrival", "stock", **stock)
    assert ours["a_status"] == 200 and ours["a_equal"] == 1, ours
    assert ours["failed_checks"] >= 1, f"the lapse was not caught: {ours}"
    assert ours["filler_equal"] == len(sets["filler"].prompts), ours
    assert stock["a_status"] == 200 and stock["a_wrong"] == 1, (
        f"the control did not show the corruption: {stock}")


def test_preemption_on_p_then_a_lapse_does_not_crash_p(fleet, sets, record):
    """Concurrent long prompts on P's small cache, prefilled in 32-token
    chunks: vLLM preempts do_remote_decode requests mid-prefill and schedules
    them again. Then every one is held past its lease and D's read-dones
    arrive late. P must not crash (vLLM's `assert req_id in self.requests`),
    must hold no block afterwards, and must keep serving."""
    fleet.ensure(**PHASE_A)
    p = fleet.running["p"]
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
    figures["p_usage_end"] = p.kv_usage() if p.alive() else None
    more = run(complete_all(router.url, sets["happy"].prompts[:4], concurrency=4,
                            max_tokens=sets["happy"].max_tokens, prefix="pre-after"))
    figures["after_equal"] = compare(more, sets["happy"].reference[:4])["texts_equal"]
    figures["p_crashes"] = len(fleet.check_crashes())
    record.write("preemption on P + lapse", "kvlease", **figures)
    assert figures["preemptions"] > 0, f"nothing was preempted: the case tested nothing ({figures})"
    assert figures["p_alive"] == 1 and figures["p_crashes"] == 0, p.log_tail()
    assert figures["texts_equal"] == len(ps.prompts), figures
    assert figures["p_usage_end"] == 0.0, figures
    assert figures["after_equal"] == 4, figures


def test_soak_kvlease_gives_no_wrong_answer_stock_control_counts_them(fleet, sets, record):
    """The same 200 requests and holds through kvlease and, at the same time,
    through stock vLLM: kvlease answers every one right (the lapsed ones are
    recomputed); stock's wrong answers are counted, and there must be some,
    or the soak tests nothing. P's blocks are back at their baseline."""
    fleet.ensure(**PHASE_A)
    ours, stock = run(both(soak_async(fleet, sets, seed=1),
                           soak_async(fleet, sets, seed=1, p="p_stock", d="d_stock")))
    record.write("soak", "kvlease", **ours)
    record.write("soak", "stock", **stock)
    assert ours["wrong_answers"] == 0 and ours["http_errors"] == 0, ours
    assert ours["texts_equal"] == len(sets["soak"].prompts), ours
    assert ours["p_usage_end"] == 0.0, ours
    assert stock["wrong_answers"] > 0, f"the stock control gave no wrong answer: {stock}"


def test_happy_path_stock_through_vllms_toy_proxy(fleet, sets, record):
    fleet.ensure(**PHASE_A)
    figures = happy(fleet, sets["happy"], "toy", "p_stock", "d_stock")
    record.write("happy (toy proxy)", "stock", **figures)
    assert figures["texts_equal"] == figures["requests"], figures


@pytest.mark.parametrize("p,d", [("p", "d_stock"), ("p_stock", "d")],
                         ids=["kvlease-p-stock-d", "stock-p-kvlease-d"])
def test_mixed_fleets(fleet, sets, record, p, d):
    """A stock peer on either side gets stock behaviour: texts equal; a
    kvlease D reading a stock P counts its loads unverified."""
    fleet.ensure(**PHASE_A)
    figures = happy(fleet, sets["mixed"], "float64", p, d)
    p_conn = "stock" if p == "p_stock" else "kvlease"
    d_conn = "stock" if d == "d_stock" else "kvlease"
    record.write(f"mixed: {p_conn} P + {d_conn} D", f"{p_conn}/{d_conn}", **figures)
    assert figures["texts_equal"] == figures["requests"], figures
    if d_conn == "kvlease":
        assert figures["unverified"] >= figures["requests"], figures
        assert figures["failed_checks"] == 0, figures


# ---- phase C: P killed -----------------------------------------------------------


def test_p_killed_mid_flight_d_fails_those_loads_and_serves_on(fleet, sets, record):
    """Requests prefilled on P and held at the router; P is SIGKILLed; the
    requests reach D: D fails those loads and recomputes (no hang), and once
    a new P is up D serves what follows."""
    fleet.ensure(p=PHASE_A["p"], d=PHASE_A["d"], p_stock=None, d_stock=None)
    router = fleet.router("float64")
    d = fleet.running["d"]
    ps = sets["happy"]
    prompts, reference = ps.prompts[:6], ps.reference[:6]
    keys = [f"pk-{i}-{random.getrandbits(24):06x}" for i in range(len(prompts))]
    before = counters(d)

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
    figures = compare(answers, reference)
    figures["took_s"] = round(took, 1)
    # P's death fails vLLM's own READs (a failed transfer, recomputed).
    figures.update(delta(counters(d), before, "failed_checks", "failed_transfers"))
    # A new P (new engine ids: data parallel 2 from here on, P_DP2); the
    # same D serves what follows. Phase D's small D starts beside the new P:
    # one start instead of two in a row.
    fleet.ensure(p=P_DP2, d=PHASE_A["d"], d_small=D_SMALL_SPEC)
    more = run(complete_all(fleet.router("float64").url, sets["after"].prompts, concurrency=4,
                            max_tokens=sets["after"].max_tokens, prefix="after-pkill"))
    figures["after_equal"] = compare(more, sets["after"].reference)["texts_equal"]
    figures["crashes"] = len(fleet.check_crashes())
    record.write("P killed mid-flight", "kvlease", **figures)
    assert figures["texts_equal"] == len(prompts), figures
    assert figures["failed_checks"] + figures["failed_transfers"] >= 1, (
        f"no load failed after P died: the case tested nothing ({figures})")
    assert figures["after_equal"] == len(sets["after"].prompts), figures
    assert figures["crashes"] == 0, figures


# ---- phase D: a D with a small KV cache: 1 P and 2 D, overload, then D killed --


def test_one_dp2_p_two_ds_behind_the_toy_proxy_and_a_late_arrival(fleet, sets, record):
    """A fleet of 1 P and 2 D: phase C's new P, data parallel 2 (two
    EngineCores, each with its own lease book and side-channel port), with
    phase A's D and the small D behind vLLM's toy proxy, which sends the
    requests to the Ds in turn. Every text equals the reference, each D
    verified loads of its own (or failed their check on a lease that really
    lapsed), both DP ranks granted leases and were released by read-dones
    (D heartbeats and verifies against the rank that holds each request),
    and P's blocks all come back. Then a late arrival on whichever DP rank
    takes it: caught and recomputed. Stock is not run beside the happy
    path: it shows nothing wrong on stock either, and kvlease's claim is 0
    wrong answers and 0 stuck blocks (phase A's late arrival has the stock
    control)."""
    fleet.ensure(p=P_DP2, d=PHASE_A["d"], d_small=D_SMALL_SPEC)
    p, ds = fleet.running["p"], {r: fleet.running[r] for r in ("d", "d_small")}
    before = {r: counters(inst) for r, inst in ds.items()}
    p_before = counters(p)
    ranks_before = {k: per_engine(p, f"vllm:kv_lease_{k}_total")
                    for k in ("granted", "released_read")}
    ps = sets["mixed"]
    answers = run(complete_all(fleet.router("toy", "p", tuple(ds)).url, ps.prompts,
                               concurrency=4, max_tokens=ps.max_tokens, prefix="1p2d"))
    figures = compare(answers, ps.reference)
    for r, inst in ds.items():
        for k, v in delta(counters(inst), before[r], "verified", "failed_checks").items():
            figures[f"{k}_{r}"] = v
    figures.update(delta(counters(p), p_before, "expired"))
    for k, was in ranks_before.items():
        now = per_engine(p, f"vllm:kv_lease_{k}_total")
        figures[f"{k}_by_dp_rank"] = {rank: now[rank] - was.get(rank, 0.0) for rank in sorted(now)}
    back = p_usage_back(p, 0.0, LEASE + EXTENSION)
    figures["p_usage_back_s"] = None if back is None else round(back, 1)
    late = late_arrival(fleet, sets, "p", "d")
    figures.update({f"late_{k}": v for k, v in late.items()})
    figures["crashes"] = len(fleet.check_crashes())
    record.write("1 P (DP 2) + 2 D (toy proxy, in turn), late arrival", "kvlease", **figures)
    assert figures["texts_equal"] == figures["requests"], figures
    for r in ds:
        assert figures[f"verified_{r}"] >= 1, f"{r} served no verified load: {figures}"
    assert (sum(figures[f"verified_{r}"] + figures[f"failed_checks_{r}"] for r in ds)
            >= figures["requests"]), figures
    assert sum(figures[f"failed_checks_{r}"] for r in ds) <= figures["expired"], figures
    for k in ranks_before:
        by_rank = figures[f"{k}_by_dp_rank"]
        assert len(by_rank) == 2 and min(by_rank.values()) >= 1, (
            f"a DP rank saw no {k}: {figures}")
    assert figures["late_a_equal"] == 1 and figures["late_failed_checks"] >= 1, figures
    assert figures["p_usage_back_s"] is not None and figures["crashes"] == 0, figures


def test_overload_heartbeats_keep_queued_requests_alive(fleet, sets, record):
    """32 requests with long decodes on a D that runs one at a time: most wait in
    D's queue longer than the lease, and D's heartbeats keep P's blocks: 0
    leases expire, 0 checks fail, every text equal. The case fails if fewer
    than three requests stayed on D (router's D leg) longer than the lease
    and a heartbeat interval (then it tested little).

    Heartbeats go out from D's step loop, one round at the first step a
    heartbeat interval after the last, and on 2 cores D's engine can stop
    stepping for 10-25 s (it and its worker starved by a dozen busy
    processes: measured with py-spy, the worker inside its forward pass and
    EngineCore waiting on it). Rounds then go out late, and P lets a lease go
    one extension after the last heartbeat it received: the lease doing its
    job. D says so in its log when two rounds went out further apart than
    extension - interval (``STALL_LINE``), or when a round first carried a
    request that long after it reached D (held in D's API server and input
    queue behind a stalled step); the case then asks only that
    every text is right and no check failed on a lease P held. A lapse with
    D's rounds on time fails the case.

    What it measures is the queue on D, not the way there: D is warmed by one
    request first (its first handshake with P), and the requests start 0.25 s
    apart, so that P answers each prefill promptly instead of 24 at once on
    2 cores; D runs one at a time whatever the spacing, so the queue still
    outlives the lease. A failure names each expired request with its two
    router legs, which tells a lease that ran out on the way to D (a late
    arrival, the late-arrival case's business) from one D had queued."""
    # The stock pair stops (as in the whole run, where the P-killed case
    # stopped it): each idle NIXL worker polls half a core away from D.
    # Phase A's D stops too: only the small D reads from P here.
    fleet.ensure(p=P_DP2, d=None, d_small=D_SMALL_SPEC, p_stock=None, d_stock=None)
    p, d = fleet.running["p"], fleet.running["d_small"]
    ps = sets["overload"]
    router = fleet.router("float64", "p", "d_small")
    # Shorter than a block (32 tokens), so that no block of it stays cached.
    warm = run(complete_all(router.url, [ps.prompts[0][:16]], max_tokens=4, prefix="overload-warm"))
    assert warm[0].ok, warm
    p_before, d_before = counters(p), counters(d)
    p_log_from = len(p.log_text())
    stalls_before = d.count_in_log(STALL_LINE)
    # The last request waits out the whole queue, one request at a time:
    # 24 x 300 tokens took 174 s in a gate run where D's steps stalled (its
    # heartbeat rounds 10-12 s apart), close to the 180 s every other case
    # allows a request. The case is about leases, not speed.
    answers = run(complete_all(router.url, ps.prompts, concurrency=len(ps.prompts),
                               max_tokens=ps.max_tokens, prefix="overload", stagger_s=0.25,
                               timeout_s=600.0))
    figures = compare(answers, ps.reference)
    figures["longest_s"] = round(max(a.latency_s for a in answers), 1)
    # D had these longer than the lease and a heartbeat interval (queue,
    # then a decode of a few seconds): without D's heartbeats P would have
    # let them go.
    d_legs = [a.d_leg_s or 0.0 for a in answers]
    figures["d_leg_max_s"] = round(max(d_legs), 1)
    figures["waited_past_lease"] = sum(leg > LEASE + INTERVAL for leg in d_legs)
    figures.update(delta(counters(p), p_before, "expired"))
    figures.update(delta(counters(d), d_before, "failed_checks", "late_rounds"))
    # The warning is rate-limited (a line per 10 s); the counter counts all.
    late_lines = d.count_in_log(STALL_LINE) - stalls_before
    record.write("overload", "kvlease", **figures)
    assert figures["waited_past_lease"] >= 3, f"too few requests waited on D past the lease: {figures}"
    assert figures["texts_equal"] == len(ps.prompts), figures
    assert figures["failed_checks"] <= figures["expired"], f"a check failed on a lease P held: {figures}"
    # A line is logged at the event, so lines imply counts (not the reverse:
    # a line can be held back by one logged just before the case).
    assert figures["late_rounds"] >= min(late_lines, 1), (
        f"D warned of {late_lines} late heartbeat round(s) but did not count them: {figures}")
    if (figures["expired"] or figures["failed_checks"]) and not figures["late_rounds"]:
        # Leases lapsed although D's heartbeat rounds went out on time:
        # that is a premature free, the failure this case is for.
        expired = expired_requests(p.log_text()[p_log_from:], "overload")
        legs = {i: (answers[i].p_leg_s, answers[i].d_leg_s, round(answers[i].latency_s, 1))
                for i in expired}
        pytest.fail(f"leases expired under overload with D's heartbeats on time: {figures}; P logged these "
                    f"expired (request: (P leg s, D leg s, total s)): {legs}")


#: D's warning that two heartbeat rounds went out further apart than the
#: lease extension minus the interval, or that a round first carried a
#: request that long after it reached D (a stalled or starved engine): a lapse
#: after it is the lease doing its job, not a premature free (scheduler.py,
#: ``_kvl_note_round``).
STALL_LINE = r"kvlease: D's (?:heartbeats|first heartbeat) to P (?:for a request )?went out"


EXPIRED_LINE = re.compile(r"kvlease: lease of request cmpl-([\w-]+?)-(\d+)-[0-9a-f]{8}\S* expired")


def expired_requests(log: str, prefix: str) -> list[int]:
    """The indices of ``prefix``'s requests (``complete_all``'s ids) whose
    expiry P logged (the line is rate-limited: a flood shows only its first
    lines)."""
    return sorted({int(m.group(2)) for m in EXPIRED_LINE.finditer(log) if m.group(1) == prefix})


def test_d_killed_p_reclaims_within_the_bound(fleet, sets, record):
    """Requests queued on D (long decodes, D's small cache), D SIGKILLed:
    P's KV usage (its /metrics) returns to its baseline within max(lease,
    extension + interval) plus a step."""
    fleet.ensure(p=P_DP2, d=None, d_small=D_SMALL_SPEC)
    p = fleet.running["p"]
    router = fleet.router("float64", "p", "d_small")
    ps = sets["kill"]
    baseline = p.kv_usage()
    answered = p.metric("vllm:request_success_total")

    async def scenario():
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(complete(session, router.url, pr, timeout_s=60,
                                                  max_tokens=ps.max_tokens,
                                                  request_id=f"dk-{i}-{random.getrandbits(24):06x}"))
                     for i, pr in enumerate(ps.prompts)]
            # Until P answered every prefill (its leases all begun), then a
            # heartbeat interval, so that D's heartbeats have renewed them:
            # a lease begun just before the kill runs its whole first term
            # (18 s of the 19 s bound, measured once when the kill came
            # while P still prefilled).
            for _ in range(480):
                if p.metric("vllm:request_success_total") - answered >= len(ps.prompts):
                    break
                await asyncio.sleep(0.25)
            await asyncio.sleep(INTERVAL)
            held = p.kv_usage()
            fleet.kill("d_small")
            back = await asyncio.to_thread(p_usage_back, p, baseline, 3 * LEASE)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return held, back

    held, back = run(scenario())
    bound = max(LEASE, EXTENSION + INTERVAL) + 1.0
    figures = {"p_usage_held": round(held, 3), "p_usage_baseline": baseline,
               "reclaim_s": None if back is None else round(back, 2), "bound_s": bound,
               "p_crashes": len(fleet.check_crashes())}
    record.write("D killed", "kvlease", **figures)
    assert held > baseline, f"P held nothing when D was killed: the case tested nothing ({figures})"
    assert back is not None and back <= bound, figures


# ---- phase E: P with TP 2 (two worker processes); async scheduling -------------

PHASE_E = dict(
    p=on(p_spec("kvlease", tp=2, env=dict(ASYNC_ENV)), P_AHEAD.p),
    d=on(d_spec("kvlease", env=dict(ASYNC_ENV)), P_AHEAD.d),
)


def test_tp2_p_with_async_scheduling_happy_lapse_and_abort(fleet, sets, record):
    """Phase E, one pair: P with TP 2 (two worker processes, each holding a
    share: vLLM's KV-output aggregation must see both ranks' reports before
    the blocks go) and D with TP 1, both with async scheduling (the metadata
    of step N+1 is built before the output of step N is applied;
    plugins/kvlease_engine_plugins.py). Happy path (the TP 2 set, then the
    async set), one late arrival caught, requests aborted by their client
    while D waits for their KV, and the requests after: texts equal, the
    lapse caught, nothing leaked. Two rows of the table, one lapse between
    them (a late arrival waits out a whole lease: one is enough here)."""
    fleet.ensure(**PHASE_E)
    p, d = fleet.running["p"], fleet.running["d"]
    for inst in (p, d):
        assert inst.count_in_log("async scheduling re-enabled on CPU") >= 1, inst.log_tail()
    tp2 = happy(fleet, sets["tp2"], "float64")
    late = late_arrival(fleet, sets)
    tp2["late_equal"] = late["a_equal"]
    tp2["late_failed_checks"] = late["failed_checks"]
    back = p_usage_back(p, 0.0, LEASE + EXTENSION)
    tp2["p_usage_back_s"] = None if back is None else round(back, 1)
    record.write("heterogeneous TP (P 2, D 1)", "kvlease", **tp2)
    assert tp2["texts_equal"] == tp2["requests"], tp2
    every_load_verified_or_lapsed(tp2)
    assert tp2["late_equal"] == 1 and tp2["late_failed_checks"] >= 1, tp2
    assert tp2["p_usage_back_s"] is not None, tp2

    figures = happy(fleet, sets["async"], "float64")
    router = fleet.router("float64")

    async def aborts():
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(complete(session, router.url, pr, max_tokens=200,
                                                  request_id=f"abort-{i}"))
                     for i, pr in enumerate(sets["async"].prompts[:4])]
            await asyncio.sleep(1.0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(aborts())
    back = p_usage_back(p, 0.0, LEASE + EXTENSION + 5)
    figures["late_equal"] = tp2["late_equal"]
    figures["late_failed_checks"] = tp2["late_failed_checks"]
    figures["p_usage_back_after_aborts_s"] = None if back is None else round(back, 1)
    more = run(complete_all(router.url, sets["after"].prompts[:4], concurrency=4,
                            max_tokens=sets["after"].max_tokens, prefix="async-after"))
    figures["after_equal"] = compare(more, sets["after"].reference[:4])["texts_equal"]
    figures["crashes"] = len(fleet.check_crashes())
    record.write("async scheduling: happy, lapse, abort", "kvlease", **figures)
    assert figures["texts_equal"] == figures["requests"], figures
    every_load_verified_or_lapsed(figures)
    assert figures["p_usage_back_after_aborts_s"] is not None, figures
    assert figures["after_equal"] == 4 and figures["crashes"] == 0, figures


# ---- phase F: push mode, kvlease beside stock (push_pairs.py) -----------------

def push_phase(fleet, stock: bool = True) -> None:
    """Phase F's instances; ``stock=False`` stops the stock pair (a case
    whose control was reused, after the mixed fleets that need it)."""
    specs = dict(PHASE_F)
    if not stock:
        specs.update({r: None for r in PAIRS["stock"]})
    fleet.ensure(p=None, d=None, d_small=None, p_stock=None, d_stock=None, ref=None, **specs)


def test_push_happy_path_kvlease_guards_every_push(fleet, sets, record, controls):
    """Push mode (vLLM's NixlPushConnector; kvlease's KvLeaseNixlPushConnector)
    on vLLM's CPU engine: each request to P first, then to D with P's
    kv_transfer_params and the same X-Request-Id. kvlease: every text equals
    the plain reference, nothing hangs, every push went with a write permit,
    D's blocks all come back. A push P could not serve in time (this 2-core
    machine stalls a fresh engine for seconds) ends as a recompute, never a
    wait: counted in push_failed. P's hosts' clock runs 10^5 s ahead of
    D's: P's estimate of D's clock is within its claimed bound of -10^5 s.
    Stock after it, recorded."""
    push_phase(fleet)
    case = "push: happy path"

    def measure(c: str) -> dict:
        d = fleet.running[PAIRS[c][1]]
        f = push_round(fleet, c, sets["push-happy"], "push-happy")
        f.update(d_leak(d, settle_s=0))
        f["d_usage_back_s"] = usage_back(d, PUSH_FENCE + 10)
        if c == "stock":
            retire_stuck_stock_d(fleet, f)
        else:
            f.update(clock_estimate(fleet.running[PAIRS[c][0]], P_AHEAD.true_offset))
        return f

    # Stock's happy path asserts nothing: it is the table's baseline.
    figures = {"kvlease": measure("kvlease"),
               "stock": stock_control(controls, case, lambda: measure("stock"), lambda f: True)}
    for c, f in figures.items():
        record.write(case, c, **f)
    kv = figures["kvlease"]
    every_push_served(kv)
    assert kv["permits"] >= kv["requests"], kv
    assert kv["written"] >= 1, kv
    assert kv["d_usage_back_s"] is not None, kv
    estimate_within_its_bound(kv)


def test_push_late_registration_stock_hangs_kvlease_recomputes(fleet, sets, record, controls):
    """The registration reaches P after P let the request go (the D leg held
    back past P's lease). Stock: D waits for a WRITE that cannot come, the
    client gives up, and D keeps the blocks. kvlease: P answers the
    registration at once (PEND:R), the load fails and is recomputed: the
    text equals the reference, and D's blocks come back."""
    push_phase(fleet)
    ps = sets["push-late"]
    case = "push: registration reaches P late"

    def measure(c: str) -> dict:
        # Every P leg at once, before any D leg: P answers them on a quiet
        # machine, and all the registrations come late together.
        f = push_round(fleet, c, ps, "push-late", concurrency=len(ps.prompts),
                       between_s=PUSH_LEASE + 10)
        f.update(d_leak(fleet.running[PAIRS[c][1]]))
        f["held_s"] = PUSH_LEASE + 10
        if c == "stock":
            retire_stuck_stock_d(fleet, f)
        return f

    figures = {"kvlease": measure("kvlease"),
               "stock": stock_control(controls, case, lambda: measure("stock"),
                                      stock_hangs_and_leaks)}
    for c, f in figures.items():
        record.write(case, c, **f)
    kv, stock = figures["kvlease"], figures["stock"]
    assert stock_hangs_and_leaks(stock), (
        f"the stock control showed no hang and no leak: the case tested nothing ({stock})")
    every_push_served(kv)
    # Each failed at P's answer (R) or, when P's stalled writer read it only
    # after D's fence, at the fence: either way a recompute, never a wait.
    # ("refused" is P's counter, which reaches /metrics with P's next step.)
    assert kv["push_failed"] >= 1, kv
    assert kv["d_usage_end"] == 0, kv


def test_push_mixed_fleets_get_stock_behaviour(fleet, sets, record):
    """A kvlease D with a stock P sends vLLM's own PUSH_REG (no permit, no
    PRN:/PRV:), and a stock D with a kvlease P gets vLLM's own handling (no
    PEND:/PHB:): no wrong answer either way, no guard message at a stock peer."""
    push_phase(fleet)
    ps = sets["push-mixed"]
    for p, d, name in (("p_push_stock", "d_push", "kvlease D, stock P"),
                       ("p_push", "d_push_stock", "stock D, kvlease P")):
        p_inst, d_inst = fleet.running[p], fleet.running[d]
        pb, db = push_counters(p_inst), push_counters(d_inst)
        stray_before = (p_inst.count_in_log(STRAY), d_inst.count_in_log(STRAY))
        answers = run(push_all(p_inst.url, d_inst.url, ps.prompts, prefix=f"mixed-{p}",
                               concurrency=4, max_tokens=ps.max_tokens, timeout_s=30))
        figures = push_figures(answers, ps.reference)
        figures.update(delta(push_counters(d_inst), db, "permits", "unguarded"))
        figures.update(delta(push_counters(p_inst), pb, "written", "refused"))
        figures["guard_messages_at_stock_peer"] = (
            p_inst.count_in_log(STRAY) - stray_before[0]
            + d_inst.count_in_log(STRAY) - stray_before[1])
        record.write(f"push: mixed fleet ({name})", "mixed", **figures)
        if d == PAIRS["stock"][1]:
            retire_stuck_stock_d(fleet, figures)
        assert figures["wrong_answers"] == 0, figures
        # Only D's counter: P's reach /metrics with P's next step, so the
        # WRITEs and refusals of the case before may show here.
        assert figures["permits"] == 0, figures
        assert figures["guard_messages_at_stock_peer"] == 0, figures
        if d == "d_push":
            assert figures["unguarded"] >= figures["requests"] - figures["http_errors"], figures


def test_push_p_killed_with_registrations_outstanding(fleet, sets, record, controls):
    """P answers the prefills, then dies (SIGKILL), and the D legs come. Two
    of them are patient (PUSH_PATIENCE: the fence, then a recompute on a D
    that stalls for tens of seconds at a time on 2 cores), two give up after
    8 s (D aborts them while it waits).
    Stock: every D leg hangs, and D keeps the blocks. kvlease: no WRITE can
    come, so D frees at the fence (the permit's 12 s plus the 10 s write
    bound after it registered): the patient two are recomputed (texts equal
    the reference), the aborted two's blocks come back too."""
    case = "push: P killed, registrations outstanding, D aborts"
    stock_figures = controls.reused(case)
    push_phase(fleet, stock=stock_figures is None)
    ps = sets["push-kill"]

    async def scenario(c: str):
        p_name, d_name = PAIRS[c]
        p, d = fleet.running[p_name], fleet.running[d_name]
        go = asyncio.Event()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            # One push first, so that D and P know each other (both
            # handshakes done) when P dies, as in a fleet that served a
            # while: a D that never met P fails its handshake at once, stock
            # too, and the case would test nothing. (retire_stuck_stock_d
            # may have given stock a fresh D.)
            warm = await workload.complete_push(
                session, p.url, d.url, ps.prompts[0], request_id=f"pk-{c}-warm",
                max_tokens=ps.max_tokens, timeout_s=30)
            answered = await asyncio.to_thread(p.metric, "vllm:request_success_total")
            failed_before = (await asyncio.to_thread(push_counters, d))["push_failed"]
            tasks = [asyncio.create_task(workload.complete_push(
                session, p.url, d.url, pr, request_id=f"pk-{c}-{i}-{random.getrandbits(24):06x}",
                max_tokens=ps.max_tokens, before_d=go,
                timeout_s=8 if i % 2 else d_leg_patience(c)))
                for i, pr in enumerate(ps.prompts)]
            for _ in range(240):
                if p.metric("vllm:request_success_total") - answered >= len(ps.prompts):
                    break
                await asyncio.sleep(0.25)
            fleet.kill(p_name)
            t0 = time.monotonic()
            go.set()
            # Until D let every push go (kvlease: each ended at its fence, the
            # aborted ones included), read off D's counter as it moves.
            ended_s = None
            while time.monotonic() - t0 < PUSH_FENCE + 20 and ended_s is None:
                failed = (await asyncio.to_thread(counters, d, False, PUSH_COUNTERS))["push_failed"]
                if failed - failed_before >= len(ps.prompts):
                    ended_s = round(time.monotonic() - t0, 1)
                await asyncio.sleep(0.5)
            answers = await asyncio.gather(*tasks)
            back = await asyncio.to_thread(usage_back, d, 15.0)
            return (answers, ended_s, (None if back is None else round(time.monotonic() - t0, 1)),
                    warm.ok)

    def measure(c: str) -> dict:
        answers, ended_s, back, warm_ok = run(scenario(c))
        patient = [a for i, a in enumerate(answers) if i % 2 == 0]
        ref = [r for i, r in enumerate(ps.reference) if i % 2 == 0]
        f = push_figures(patient, ref)
        f["aborted"] = len(answers) - len(patient)
        f["warm_push_ok"] = warm_ok
        # The fence: the permit's term after D registered, plus the write
        # bound; on top, D's registration step after the kill and the step
        # that reads the fence, and the metric's 0.5 s poll. A fresh engine
        # on 2 cores stalls 10-20 s at a time: runs measured 23.1, 24.3 and
        # 24.7 s, and one 32.3 s (a stall on one of those two steps). The
        # tight bound is the harness's (py/tests/vllm/test_e2e_push.py).
        f["pushes_ended_s"] = ended_s
        f["bound_s"] = PUSH_FENCE + 18
        f["d_usage_back_s"] = back
        f.update(d_leak(fleet.running[PAIRS[c][1]], settle_s=0))
        return f

    # One pair after the other: stock's D spins once it waits on a push
    # that cannot come (see retire_stuck_stock_d), so kvlease goes first.
    figures = {"kvlease": measure("kvlease")}
    if stock_figures is None:
        stock_figures = measure("stock")
        controls.store(case, stock_figures, shows=stock_hangs_and_leaks(stock_figures))
    figures["stock"] = stock_figures
    for c, f in figures.items():
        record.write(case, c, **f)
    kv, stock = figures["kvlease"], figures["stock"]
    assert stock_hangs_and_leaks(stock), (
        f"the stock control showed no hang and no leak: the case tested nothing ({stock})")
    every_push_served(kv)
    assert kv["pushes_ended_s"] is not None and kv["pushes_ended_s"] <= kv["bound_s"], kv
    assert kv["d_usage_back_s"] is not None and kv["d_usage_end"] == 0, kv


def test_no_instance_crashed(fleet, record):
    """Last: no instance exited without a case asking it to."""
    fleet.check_crashes()
    record.write("crashes (whole run)", "all", crashes=len(fleet.crashes))
    assert not fleet.crashes, fleet.crashes
