"""A P/D router that carries ``kv_transfer_params`` the way a float64 JSON
router does, and can hold a request between P and D.

    python float64_router.py --port 8000 --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 [--decode ...]

Owns: the two-leg request (P with ``max_tokens=1`` and ``do_remote_decode``,
then D with P's ``kv_transfer_params``), the float64 round trip of those
params, and the per-request hold. May not look inside the params beyond
that: it is a router, not a part of kvlease.

Why float64: llm-d's routing sidecar (Go) decodes ``kv_transfer_params`` into
``map[string]any``, where every JSON number becomes a float64, and encodes
it again for D; JavaScript proxies do the same. An integer above 2^53 comes
out as a different integer. This router does exactly that: numbers are
parsed as float64 and integral ones written back as integers in the
shortest form that round-trips (Go's ``encoding/json`` and JavaScript's
``JSON.stringify`` write 2^62+1 as ``4611686018427387904``).

Why a hold: a real router queues, retries and load-balances between the two
legs. The ``X-Router-Hold-S`` header makes a request wait that many seconds
after P answered, so a case can spread arrivals around the lease; the
``X-Router-Hold-Key`` header makes it wait until ``POST /router/release``
names that key, so a case can deliver it to D exactly after something else
happened (its lease ran out, other prefills reused its blocks). A held
request whose P leg finished is listed by ``GET /router/held``.

Request ids: the client's ``X-Request-Id`` (or a fresh uuid) goes to both
legs, as vLLM's toy proxy does. Response headers say what happened:
``X-Router-P-Status``, ``X-Router-Held-S``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

HOLD_HEADER = "X-Router-Hold-S"
KEY_HEADER = "X-Router-Hold-Key"


def float64_roundtrip(value: Any) -> Any:
    """``value`` after a trip through a float64 JSON decoder and back."""
    text = json.dumps(value)
    decoded = json.loads(text, parse_int=float)
    return _integral_floats_as_ints(decoded)


def _integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value) and abs(value) < 1e21:
            return int(value)
        return value
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    return value


class Router:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.prefill = itertools.cycle(prefill)
        self.decode = itertools.cycle(decode)
        self.session: aiohttp.ClientSession | None = None
        #: hold key -> released event; a key is in `held` once its P leg answered.
        self.releases: dict[str, asyncio.Event] = {}
        self.held: dict[str, dict] = {}

    async def start(self, _app: web.Application) -> None:
        # force_close: a new connection per leg. A pooled connection idle
        # through a hold may have been closed by uvicorn's keep-alive timeout
        # (5 s), and a POST on it fails with "Server disconnected".
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
        )

    async def close(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        api = request.path.removeprefix("/v1")
        body = await request.json()
        rid = request.headers.get("X-Request-Id") or str(uuid.uuid4())
        hold = float(request.headers.get(HOLD_HEADER, "0") or 0)
        key = request.headers.get(KEY_HEADER)
        headers = {"X-Request-Id": rid}
        assert self.session is not None

        p_body = dict(body)
        p_body.update(
            stream=False,
            max_tokens=1,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        )
        p_body.pop("stream_options", None)
        t0 = time.monotonic()
        async with self.session.post(next(self.prefill) + "/v1" + api, json=p_body,
                                     headers=headers) as r:
            p_status = r.status
            p_text = await r.text()
        p_s = time.monotonic() - t0
        if p_status != 200:
            return web.Response(status=502, text=f"prefill answered {p_status}: {p_text[:500]}",
                                headers={"X-Router-P-Status": str(p_status)})
        # The float64 decode: every number of P's answer becomes a float64.
        p_json = json.loads(p_text, parse_int=float)
        params = p_json.get("kv_transfer_params")
        if key is not None:
            release = self.releases.setdefault(key, asyncio.Event())
            self.held[key] = {"request_id": rid, "kv_transfer_params": params}
            await release.wait()
            self.held.pop(key, None)
            self.releases.pop(key, None)
        if hold > 0:
            await asyncio.sleep(hold)
        d_body = dict(body)
        if params:
            d_body["kv_transfer_params"] = _integral_floats_as_ints(params)
        t1 = time.monotonic()
        async with self.session.post(next(self.decode) + "/v1" + api, json=d_body,
                                     headers=headers) as r:
            d_status = r.status
            d_text = await r.read()
            d_type = r.headers.get("Content-Type", "application/json")
        return web.Response(
            status=d_status,
            body=d_text,
            content_type=d_type.split(";")[0],
            headers={"X-Router-P-Status": str(p_status), "X-Router-Held-S": f"{hold:g}",
                     "X-Router-P-Leg-S": f"{p_s:.3f}",
                     "X-Router-D-Leg-S": f"{time.monotonic() - t1:.3f}"},
        )

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def release(self, request: web.Request) -> web.Response:
        key = request.query.get("key", "")
        self.releases.setdefault(key, asyncio.Event()).set()
        return web.json_response({"released": key})

    async def list_held(self, _request: web.Request) -> web.Response:
        return web.json_response(self.held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", nargs="+", required=True, help="P base URLs")
    ap.add_argument("--decode", nargs="+", required=True, help="D base URLs")
    args = ap.parse_args()
    router = Router(args.prefill, args.decode)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.close)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.completions)
    app.router.add_get("/healthcheck", router.health)
    app.router.add_post("/router/release", router.release)
    app.router.add_get("/router/held", router.list_held)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
