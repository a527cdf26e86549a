"""The pull scenarios, run against any P and D of the fleet: the happy path
through a router, a late arrival whose blocks P reused, the soak.

Owns: what each scenario sends and the figures it reads. May not judge a
case, except :func:`every_load_verified_or_lapsed`, the check every happy
path shares.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

from measures import compare, counters, delta, p_usage_back
from prompt_sets import PromptSet
from shapes import EXTENSION, LEASE
from workload import complete, complete_all, run


def happy(fleet, ps: PromptSet, kind: str, p: str = "p", d: str = "d") -> dict:
    p_inst, d_inst = fleet.running[p], fleet.running[d]
    p_before, d_before = counters(p_inst), counters(d_inst)
    answers = run(complete_all(fleet.router(kind, p, d).url, ps.prompts, concurrency=4,
                               max_tokens=ps.max_tokens, prefix=f"{ps.name}-{kind}-{p}-{d}"))
    figures = compare(answers, ps.reference)
    figures.update(delta(counters(d_inst), d_before, "verified", "failed_checks", "unverified"))
    figures.update(delta(counters(p_inst), p_before, "expired"))
    return figures


def every_load_verified_or_lapsed(figures: dict) -> None:
    """Each load was verified, or failed its check because P's lease had
    really expired (a D step seconds late on a loaded machine): a check that
    failed while P still held the lease would be a false alarm, and fails."""
    assert figures["verified"] + figures["failed_checks"] >= figures["requests"], figures
    assert figures["failed_checks"] <= figures["expired"], figures
    assert figures["verified"] >= 1, figures


async def late_arrival_async(fleet, sets, p: str = "p", d: str = "d") -> dict:
    """Prefill A, hold it at the router until P let its lease go, prefill
    other requests that reuse A's blocks, then send A to D."""
    router = fleet.router("float64", p, d)
    d_inst = fleet.running[d]
    a, filler = sets["late-a"], sets["filler"]
    before = await asyncio.to_thread(counters, d_inst)
    key = f"late-{random.getrandbits(32):08x}"
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(complete(session, router.url, a.prompts[0],
                                            max_tokens=a.max_tokens, hold_key=key,
                                            request_id=key))
        await asyncio.to_thread(router.wait_held, key)
        t0 = time.monotonic()
        # P lets A go LEASE after its prefill; wait past that, plus a step.
        await asyncio.sleep(LEASE + 3.0)
        fill = await complete_all(router.url, filler.prompts, concurrency=2,
                                  max_tokens=filler.max_tokens, prefix=f"{key}-fill")
        router.release(key)
        ans = await task
        held = time.monotonic() - t0
    after = await asyncio.to_thread(counters, d_inst)
    return {
        "a_equal": int(ans.ok and ans.text == a.reference[0]),
        "a_wrong": int(ans.ok and ans.text != a.reference[0]),
        "a_status": ans.status,
        "held_s": round(held, 1),
        "filler_equal": compare(fill, filler.reference)["texts_equal"],
        "failed_checks": after["failed_checks"] - before["failed_checks"],
    }


def late_arrival(fleet, sets, p: str = "p", d: str = "d") -> dict:
    return run(late_arrival_async(fleet, sets, p, d))


async def soak_async(fleet, sets, seed: int, p: str = "p", d: str = "d") -> dict:
    """200 requests at concurrency 16, router holds spread around the lease:
    75 % go straight through, 20 % wait up to a quarter lease, 5 % wait 1.1
    to 1.3 leases (those lapse on P)."""
    ps = sets["soak"]
    rng = random.Random(seed)
    holds = []
    for _ in ps.prompts:
        x = rng.random()
        holds.append(0.0 if x < 0.75 else rng.uniform(0, LEASE / 4) if x < 0.95
                     else rng.uniform(1.1 * LEASE, 1.3 * LEASE))
    p_inst, d_inst = fleet.running[p], fleet.running[d]
    before = await asyncio.to_thread(counters, d_inst)
    t0 = time.monotonic()
    answers = await complete_all(fleet.router("float64", p, d).url, ps.prompts, concurrency=16,
                                 holds=holds, max_tokens=ps.max_tokens, prefix=f"soak-{p}")
    figures = compare(answers, ps.reference)
    figures["wall_s"] = round(time.monotonic() - t0, 1)
    figures["held_past_lease"] = sum(h > LEASE for h in holds)
    figures.update(delta(await asyncio.to_thread(counters, d_inst), before, "failed_checks"))
    # Where the time went (the float64 router's leg timings): a lapse the
    # holds did not cause is a P leg plus a D leg longer than the lease.
    p_legs = sorted(a.p_leg_s for a in answers if a.p_leg_s is not None)
    d_legs = sorted(a.d_leg_s for a in answers if a.d_leg_s is not None)
    if p_legs and d_legs:
        figures["p_leg_p50_s"] = round(p_legs[len(p_legs) // 2], 2)
        figures["p_leg_max_s"] = round(p_legs[-1], 2)
        figures["d_leg_p50_s"] = round(d_legs[len(d_legs) // 2], 2)
        figures["d_leg_max_s"] = round(d_legs[-1], 2)
    back = await asyncio.to_thread(p_usage_back, p_inst, 0.0, LEASE + EXTENSION + 10)
    figures["p_usage_back_s"] = None if back is None else round(back, 1)
    figures["p_usage_end"] = p_inst.kv_usage()
    return figures


async def both(a, b):
    return await asyncio.gather(a, b)
