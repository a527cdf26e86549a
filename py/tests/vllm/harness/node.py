"""A process hosting vLLM engines for the end-to-end tests, steered by the
test over a ``multiprocessing.connection`` channel.

Owns: the process's event loop: between engine steps it takes commands
(build an engine, add requests, inject faults, report) and answers each when
its condition holds (a request finished, freed, loaded ...), or when its
deadline passes. Engines step continuously, as vLLM's engine core does while
it holds requests, so heartbeats, notifications, expiry and READs progress in
real time. May not decide test outcomes: it reports, the test asserts.

    python -m harness.node ADDRESS AUTHKEY_HEX   (the test starts it)
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

IDLE_SLEEP_S = 0.0005


class Node:
    def __init__(self, conn: Any) -> None:
        from .engine import Engine, EngineSpec, init_dist, use_real_nixl

        self.Engine, self.EngineSpec = Engine, EngineSpec
        self.nixl_module = use_real_nixl()
        init_dist()
        self.conn = conn
        self.engines: dict[str, Any] = {}
        self.faults: dict[str, list[Any]] = {}
        self.hb_clocks: dict[str, list[Any]] = {}
        #: push engines: each worker's PushWire (faults.py).
        self.wires: dict[str, list[Any]] = {}
        # (deadline, msg id, condition -> reply or None)
        self.waiters: list[tuple[float, int, Callable[[bool], Any]]] = []
        self.running = True
        #: engine -> wall time until which it does not step (a long step).
        self.paused_until: dict[str, float] = {}
        #: engine -> the traceback of the step that raised (it steps no
        #: more; ``report`` says so, as a real engine core would have died).
        self.crashed: dict[str, str] = {}

    # -- loop ------------------------------------------------------------------------

    def run(self) -> None:
        while self.running:
            while self.running and self.conn.poll(0):
                msg_id, cmd, args = self.conn.recv()
                try:
                    getattr(self, f"cmd_{cmd}")(msg_id, **args)
                except Exception:
                    self.conn.send((msg_id, {"error": traceback.format_exc()}))
            now = time.time()
            for name, e in list(self.engines.items()):
                if name not in self.crashed and self.paused_until.get(name, 0.0) <= now:
                    try:
                        e.step()
                    except Exception:
                        self.crashed[name] = traceback.format_exc()
            self._check_waiters()
            time.sleep(IDLE_SLEEP_S)

    def _check_waiters(self) -> None:
        now = time.time()
        keep = []
        for deadline, msg_id, cond in self.waiters:
            try:
                reply = cond(now >= deadline)
            except Exception:
                reply = {"error": traceback.format_exc()}
            if reply is None:
                keep.append((deadline, msg_id, cond))
            else:
                self.conn.send((msg_id, reply))
        self.waiters = keep

    def _wait(self, msg_id: int, timeout: float, cond: Callable[[bool], Any]) -> None:
        self.waiters.append((time.time() + timeout, msg_id, cond))

    def _reply(self, msg_id: int, value: Any) -> None:
        self.conn.send((msg_id, value))

    # -- commands ----------------------------------------------------------------------

    def cmd_setup(self, msg_id: int, spec: dict[str, Any]) -> None:
        from .faults import DropHeartbeats, HeartbeatClock, install, install_push_wire

        engine = self.Engine(self.EngineSpec(**spec))
        name = engine.spec.name
        self.engines[name] = engine
        if engine.spec.push:
            self.wires[name] = [install_push_wire(w) for w in engine.workers]
        elif engine.spec.role == "D":
            self.faults[name] = [install(w, DropHeartbeats) for w in engine.workers]
        else:
            self.hb_clocks[name] = [install(w, HeartbeatClock) for w in engine.workers]
        self._reply(
            msg_id,
            {
                "engine_id": engine.vllm_config.kv_transfer_config.engine_id,
                "connector": type(engine.connector).__module__ + "." + type(engine.connector).__name__,
                "nixl": self.nixl_module,
                "pid": os.getpid(),
            },
        )

    def cmd_prefill(self, msg_id: int, engine: str, key: int, tokens: int, timeout: float) -> None:
        e = self.engines[engine]
        rid = e.add_prefill(key, tokens)

        def done(expired: bool) -> Any:
            t = e.tracked[rid]
            if t.params is None and not expired:
                return None
            return {"request_id": rid, "params": t.params, "finished_at": t.finished_at,
                    "prompt": t.prompt, "timeout": t.params is None}

        self._wait(msg_id, timeout, done)

    def _result(self, e: Any, request_id: str) -> Callable[[bool], Any]:
        """Answers once D freed ``request_id`` (its run is over)."""

        def done(expired: bool) -> Any:
            t = e.tracked[request_id]
            if t.freed_at is None and not expired:
                return None
            return {"request_id": request_id, "seen": t.seen, "recomputed": t.recomputed,
                    "load_failed": t.load_failed, "freed_at": t.freed_at,
                    "finished_at": t.finished_at, "loaded_at": t.loaded_at,
                    "prompt": t.prompt, "read_bytes": t.read_bytes,
                    "timeout": t.freed_at is None}

        return done

    def cmd_decode(self, msg_id: int, engine: str, key: int, tokens: int,
                   params: dict[str, Any], timeout: float) -> None:
        """Adds a D request and answers when it is over."""
        e = self.engines[engine]
        self._wait(msg_id, timeout, self._result(e, e.add_decode(key, tokens, params)))

    def cmd_add_decode(self, msg_id: int, engine: str, key: int, tokens: int,
                       params: dict[str, Any]) -> None:
        """Adds a D request and answers at once (its result: ``cmd_result``)."""
        self._reply(msg_id, self.engines[engine].add_decode(key, tokens, params))

    def cmd_result(self, msg_id: int, engine: str, request_id: str, timeout: float) -> None:
        self._wait(msg_id, timeout, self._result(self.engines[engine], request_id))

    def cmd_prefill_paused(self, msg_id: int, engine: str, key: int, tokens: int,
                           pause_s: float, timeout: float) -> None:
        """P: a chunked prefill whose engine stalls ``pause_s`` after its
        first step (a prefill outlasting ``kv_lease_max_pin``); answers as
        ``cmd_prefill`` once it finished."""
        e = self.engines[engine]
        rid = e.add_prefill(key, tokens)
        e.step()
        self.paused_until[engine] = time.time() + pause_s

        def done(expired: bool) -> Any:
            t = e.tracked[rid]
            if t.params is None and not expired:
                return None
            return {"request_id": rid, "params": t.params, "finished_at": t.finished_at,
                    "prompt": t.prompt, "timeout": t.params is None}

        self._wait(msg_id, timeout, done)

    def _prefill_done(self, e: Any, rid: str) -> Callable[[bool], Any]:
        """Answers once P's ``rid`` finished (its kv_transfer_params are out)."""

        def done(expired: bool) -> Any:
            t = e.tracked[rid]
            if t.params is None and not expired:
                return None
            return {"request_id": rid, "params": t.params, "finished_at": t.finished_at,
                    "prompt": t.prompt, "timeout": t.params is None,
                    "preemptions": t.request.num_preemptions}

        return done

    def cmd_add_prefills(self, msg_id: int, engine: str, items: list[tuple[int, int]]) -> None:
        """P: adds a do_remote_decode request per ``(key, tokens)``, all before
        the next step (so they are scheduled together); answers their ids."""
        e = self.engines[engine]
        self._reply(msg_id, [e.add_prefill(key, tokens) for key, tokens in items])

    def cmd_wait_prefill(self, msg_id: int, engine: str, request_id: str, timeout: float) -> None:
        """P: answers as ``cmd_prefill`` once ``request_id`` finished, with
        how often vLLM's scheduler preempted it."""
        self._wait(msg_id, timeout, self._prefill_done(self.engines[engine], request_id))

    def cmd_prefill_reset(self, msg_id: int, engine: str, key: int, tokens: int,
                          steps: int) -> None:
        """P: adds a do_remote_decode request, runs ``steps`` engine steps (a
        chunked prefill under way, its lease assigned), then calls vLLM's
        ``reset_prefix_cache(reset_running_requests=True)`` (the RL
        weight-update path), which preempts every running request."""
        e = self.engines[engine]
        rid = e.add_prefill(key, tokens)
        for _ in range(steps):
            e.step()
        computed = e.tracked[rid].request.num_computed_tokens
        ok = e.scheduler.reset_prefix_cache(reset_running_requests=True)
        self._reply(msg_id, {"request_id": rid, "computed_before_reset": computed,
                             "reset": ok, "preemptions": e.tracked[rid].request.num_preemptions})

    def cmd_abort_prefill(self, msg_id: int, engine: str, key: int, tokens: int, steps: int) -> None:
        """P: adds a do_remote_decode request, runs ``steps`` engine steps
        (its chunked prefill under way, its lease assigned), then aborts it."""
        e = self.engines[engine]
        rid = e.add_prefill(key, tokens)
        for _ in range(steps):
            e.step()
        assigned = getattr(e.connector.connector_scheduler, "_kvl_prefill", None)
        status = assigned.sched.status(rid) if assigned is not None else None
        e.abort(rid)
        self._reply(msg_id, {"request_id": rid, "status_before_abort": status,
                             "computed": e.tracked[rid].request.num_computed_tokens})

    def cmd_local(self, msg_id: int, engine: str, key: int, tokens: int, max_tokens: int) -> None:
        self._reply(msg_id, self.engines[engine].add_local(key, tokens, max_tokens))

    def cmd_local_paused(self, msg_id: int, engine: str, key: int, tokens: int,
                         max_tokens: int, pause_s: float) -> None:
        """A local request, computed by one engine step at once, then the
        engine holds still for ``pause_s`` (the request stays live, its
        blocks readable with ``blocks_of``); answers its id."""
        e = self.engines[engine]
        rid = e.add_local(key, tokens, max_tokens)
        e.step()
        self.paused_until[engine] = time.time() + pause_s
        self._reply(msg_id, rid)

    def cmd_abort(self, msg_id: int, engine: str, request_id: str) -> None:
        self.engines[engine].abort(request_id)
        self._reply(msg_id, True)

    def cmd_drop_heartbeats(self, msg_id: int, engine: str, on: bool) -> None:
        for f in self.faults[engine]:
            object.__setattr__(f, "on", on)
        self._reply(msg_id, sum(f.dropped for f in self.faults[engine]))

    def cmd_wait_freed(self, msg_id: int, engine: str, request_id: str, timeout: float) -> None:
        e = self.engines[engine]

        def done(expired: bool) -> Any:
            t = e.tracked[request_id]
            if t.freed_at is None and not expired:
                return None
            clocks = self.hb_clocks.get(engine, [])
            lasts = [c.last for c in clocks if c.last is not None]
            return {"freed_at": t.freed_at, "finished_at": t.finished_at,
                    "last_heartbeat": max(lasts) if lasts else None,
                    "heartbeats": sum(c.count for c in clocks),
                    "timeout": t.freed_at is None}

        self._wait(msg_id, timeout, done)

    def cmd_notifs(self, msg_id: int, engine: str) -> None:
        """Every notification P's workers drained so far."""
        self._reply(msg_id, [m for c in self.hb_clocks.get(engine, []) for m in c.received])

    def cmd_sleep(self, msg_id: int, seconds: float) -> None:
        """Answers after ``seconds`` while the engines keep stepping."""
        self._wait(msg_id, seconds, lambda expired: {"slept": seconds} if expired else None)

    # -- push mode ---------------------------------------------------------------------

    def _wire_counts(self, engine: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for w in self.wires[engine]:
            for k, v in w.counts().items():
                out[k] = out.get(k, [] if isinstance(v, list) else 0) + v
        return out

    def cmd_push_wire(self, msg_id: int, engine: str, **faults: Any) -> None:
        """Sets faults on every worker's wire (``drop``, ``duplicate``,
        ``write_delay``: faults.PushWire); answers the counts so far."""
        for w in self.wires[engine]:
            for k, v in faults.items():
                if k not in ("drop", "duplicate", "write_delay"):
                    raise ValueError(f"no such wire fault: {k}")
                object.__setattr__(w, k, tuple(v) if k == "drop" else v)
        self._reply(msg_id, self._wire_counts(engine))

    def cmd_wire_log(self, msg_id: int, engine: str) -> None:
        """Every notification the engine's workers sent and drained."""
        ws = self.wires[engine]
        self._reply(msg_id, {"sent": [m for w in ws for m in w.sent],
                             "received": [m for w in ws for m in w.received]})

    def cmd_wait_posted(self, msg_id: int, engine: str, count: int, timeout: float) -> None:
        """Answers once ``count`` WRITEs were posted on ``engine`` (P), with
        the wire's counts and the time."""

        def done(expired: bool) -> Any:
            c = self._wire_counts(engine)
            if c["posted"] < count and not expired:
                return None
            return dict(c, at=time.time(), timeout=c["posted"] < count)

        self._wait(msg_id, timeout, done)

    def cmd_wait_free_blocks(self, msg_id: int, engine: str, count: int, timeout: float) -> None:
        """Answers once ``engine``'s pool has ``count`` free blocks, with when."""
        e = self.engines[engine]

        def done(expired: bool) -> Any:
            free = e.free_blocks()
            if free < count and not expired:
                return None
            return {"free": free, "at": time.time(), "timeout": free < count}

        self._wait(msg_id, timeout, done)

    def cmd_blocks_of(self, msg_id: int, engine: str, request_id: str) -> None:
        """The byte values of ``request_id``'s prompt blocks now."""
        e = self.engines[engine]
        t = e.tracked[request_id]
        self._reply(msg_id, {"values": e.blocks_of(request_id, len(t.prompt)),
                             "prompt": t.prompt, "at": time.time()})

    def cmd_report(self, msg_id: int, engine: str, settle_steps: int = 5) -> None:
        e = self.engines[engine]
        if engine not in self.crashed:
            for _ in range(settle_steps):
                try:
                    e.step()
                except Exception:
                    self.crashed[engine] = traceback.format_exc()
                    break
        stats = e.stats
        self._reply(msg_id, {
            "crashed": self.crashed.get(engine),
            "leaks": e.leak_report(),
            "counters": e.counters(),
            "stats_reduced": stats.reduce() if stats is not None else None,
            "stats_data": {k: sum(v) if isinstance(v, list) and all(isinstance(x, (int, float)) for x in v) else v
                           for k, v in (stats.data.items() if stats is not None else ())},
            "steps": e.steps,
            "free_blocks": e.free_blocks(),
            "wire": self._wire_counts(engine) if engine in self.wires else None,
        })

    def cmd_monotonic(self, msg_id: int) -> None:
        """This host's ``time.monotonic()`` (a time namespace offsets it)."""
        self._reply(msg_id, time.monotonic())

    def cmd_clock_estimates(self, msg_id: int, engine: str) -> None:
        """P in push mode: each worker's estimate of each D's clock,
        ``{rank: {d_engine: (offset, bound)}}``, with this host's monotonic
        clock reading (the bound is taken now)."""
        now = time.monotonic()
        out = {}
        for r, w in enumerate(self.engines[engine].workers):
            p = getattr(w.connector_worker, "_kvl_p", None)
            if p is not None:
                out[r] = p.clock_estimates(now)
        self._reply(msg_id, {"estimates": out, "monotonic": now})

    def cmd_teardown(self, msg_id: int, engine: str) -> None:
        e = self.engines.pop(engine)
        self.crashed.pop(engine, None)
        e.shutdown()
        self.faults.pop(engine, None)
        self.hb_clocks.pop(engine, None)
        self.wires.pop(engine, None)
        self._reply(msg_id, True)

    def cmd_exit(self, msg_id: int) -> None:
        for e in self.engines.values():
            e.shutdown()
        self.engines.clear()
        self._reply(msg_id, True)
        self.running = False


def main(argv: list[str]) -> int:
    from multiprocessing.connection import Client

    address, authkey = argv[0], bytes.fromhex(argv[1])
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=authkey)
    try:
        Node(conn).run()
    finally:
        conn.close()
    # vLLM's and NIXL's background threads must not keep the process alive.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
