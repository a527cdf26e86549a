"""Prompts and the client of the real-engine cases.

Owns: the prompts (token-id lists cut from local text, so P, D and the
reference see identical tokens and no tokenizer round trip can differ), and
the HTTP client that sends one completion and reports what came back. May not
start or stop anything.

Why token ids: the completions API takes a list of ids as the prompt, and
the tiny model's tokenizer is made locally; sending ids keeps "the same
prompt" exact across P, D and the plain reference.
"""

from __future__ import annotations

import asyncio
import json
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

#: Standard-library modules whose text the prompts are cut from. None of
#: them is in the model's training corpus (make_model.CORPUS_DIRS), so the
#: prompts are new text to the model.
PROMPT_SOURCES = ("argparse.py", "textwrap.py", "pathlib.py", "shutil.py", "tarfile.py",
                  "datetime.py", "calendar.py", "configparser.py", "difflib.py", "pprint.py")

#: Greedy tokens generated per request: long enough that another request's KV
#: shows in the text, short enough for a 2-core machine.
MAX_TOKENS = 24


def make_prompts(model_dir: str, n: int, seed: int, min_len: int = 96,
                 max_len: int = 200) -> list[list[int]]:
    """``n`` prompts of ``min_len..max_len`` token ids, deterministic for a
    seed, cut at random places of :data:`PROMPT_SOURCES`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    lib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in PROMPT_SOURCES:
        ids.extend(tok.encode((lib / name).read_text(encoding="utf-8", errors="replace")).ids)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start : start + length])
    return out


@dataclass
class Answer:
    """What one request got back."""

    status: int
    text: str | None
    latency_s: float
    #: Time to the first streamed token (streaming requests only).
    ttft_s: float | None = None
    error: str | None = None
    held_s: float = 0.0
    #: Seconds of the P and D legs, when the float64 router answered.
    p_leg_s: float | None = None
    d_leg_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.text is not None


async def complete(session: aiohttp.ClientSession, base_url: str, prompt: list[int], *,
                   max_tokens: int = MAX_TOKENS, request_id: str | None = None,
                   hold_s: float = 0.0, hold_key: str | None = None,
                   timeout_s: float = 180.0, stream: bool = False) -> Answer:
    """One greedy completion of ``prompt`` at ``base_url`` (an instance or a
    router). ``hold_s`` asks the float64 router to hold the request between
    P and D for that long, ``hold_key`` until the key is released. Never raises for an HTTP or connection failure: it is reported
    in the answer."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}
    headers = {}
    if request_id:
        headers["X-Request-Id"] = request_id
    if hold_s:
        headers["X-Router-Hold-S"] = f"{hold_s:.3f}"
    if hold_key:
        headers["X-Router-Hold-Key"] = hold_key
    t0 = time.monotonic()
    try:
        async with session.post(base_url + "/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if not stream or r.status != 200:
                raw = await r.text()
                latency = time.monotonic() - t0
                if r.status != 200:
                    return Answer(r.status, None, latency, error=raw[:300], held_s=hold_s)
                text = json.loads(raw)["choices"][0]["text"]
                legs = [r.headers.get(h) for h in ("X-Router-P-Leg-S", "X-Router-D-Leg-S")]
                p_leg, d_leg = (float(x) if x else None for x in legs)
                return Answer(200, text, latency, held_s=hold_s, p_leg_s=p_leg, d_leg_s=d_leg)
            ttft = None
            parts: list[str] = []
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                piece = chunk["choices"][0].get("text") or ""
                if ttft is None and piece:
                    ttft = time.monotonic() - t0
                parts.append(piece)
            return Answer(200, "".join(parts), time.monotonic() - t0, ttft_s=ttft,
                          held_s=hold_s)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return Answer(0, None, time.monotonic() - t0, error=f"{type(e).__name__}: {e}",
                      held_s=hold_s)


async def complete_push(session: aiohttp.ClientSession, p_url: str, d_url: str,
                        prompt: list[int], *, request_id: str, max_tokens: int = MAX_TOKENS,
                        between_s: float = 0.0, timeout_s: float = 60.0,
                        before_d: "asyncio.Event | None" = None) -> Answer:
    """One push-mode request as a router sends it: to P first (prefill, one
    token, ``do_remote_decode``), then to D with P's ``kv_transfer_params``
    and the same ``X-Request-Id`` (P matches D's registration by that id,
    vLLM's random suffix stripped). ``between_s`` holds the D leg back that
    long (a registration that reaches P late), ``before_d`` until it is set.
    A D leg that does not answer within ``timeout_s`` is a hang (status 0,
    ``p_leg_s`` set): the client gives up, which aborts the request on D. A
    P leg that fails (status 0, no ``p_leg_s``) never reached D. Never
    raises."""
    headers = {"X-Request-Id": request_id}
    base = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "ignore_eos": True,
            "stream": False}
    t0 = time.monotonic()
    p_leg = None  # set once P answered: a failure after it is the D leg's
    try:
        p_body = dict(base, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        async with session.post(p_url + "/v1/completions", json=p_body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=60)) as r:
            raw = await r.text()
            if r.status != 200:
                return Answer(r.status, None, time.monotonic() - t0, error="P: " + raw[:300])
            params = json.loads(raw).get("kv_transfer_params")
        p_leg = time.monotonic() - t0
        if before_d is not None:
            await before_d.wait()
        if between_s:
            await asyncio.sleep(between_s)
        t1 = time.monotonic()
        d_body = dict(base, max_tokens=max_tokens, kv_transfer_params=params)
        async with session.post(d_url + "/v1/completions", json=d_body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            raw = await r.text()
            if r.status != 200:
                return Answer(r.status, None, time.monotonic() - t0, error="D: " + raw[:300],
                              p_leg_s=p_leg)
            text = json.loads(raw)["choices"][0]["text"]
            return Answer(200, text, time.monotonic() - t0, held_s=between_s, p_leg_s=p_leg,
                          d_leg_s=time.monotonic() - t1)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        leg = "P" if p_leg is None else "D"
        return Answer(0, None, time.monotonic() - t0, error=f"{leg}: {type(e).__name__}: {e}",
                      held_s=between_s, p_leg_s=p_leg)


async def push_all(p_url: str, d_url: str, prompts: list[list[int]], *, prefix: str,
                   concurrency: int = 4, **kw) -> list[Answer]:
    """:func:`complete_push` for every prompt, at most ``concurrency`` at once;
    answers in prompt order. Request ids are ``{prefix}-{i}-{8 hex digits}``."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> Answer:
            async with sem:
                return await complete_push(
                    session, p_url, d_url, prompts[i],
                    request_id=f"{prefix}-{i}-{random.getrandbits(32):08x}", **kw)

        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


async def complete_all(base_url: str, prompts: list[list[int]], *, concurrency: int = 4,
                       holds: list[float] | None = None, stream: bool = False,
                       max_tokens: int = MAX_TOKENS, prefix: str = "req",
                       stagger_s: float = 0.0, timeout_s: float = 180.0) -> list[Answer]:
    """Sends every prompt with at most ``concurrency`` in flight, the i-th no
    earlier than ``i * stagger_s`` seconds after the first; answers in prompt
    order, each failed after ``timeout_s``. Request ids are
    ``{prefix}-{i}-{8 hex digits}``."""
    sem = asyncio.Semaphore(concurrency)
    holds = holds or [0.0] * len(prompts)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> Answer:
            if stagger_s > 0:
                await asyncio.sleep(i * stagger_s)
            async with sem:
                return await complete(session, base_url, prompts[i], hold_s=holds[i],
                                      stream=stream, max_tokens=max_tokens, timeout_s=timeout_s,
                                      request_id=f"{prefix}-{i}-{random.getrandbits(32):08x}")

        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def run(coro):
    """Runs a coroutine from synchronous test code."""
    return asyncio.run(coro)
