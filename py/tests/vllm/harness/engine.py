"""One vLLM engine, driven the way vLLM 0.34's engine core and CPU model
runner drive a KV connector, with real NIXL agents and CPU KV caches.

Owns: the engine's ``VllmConfig`` (built by upstream's ``create_vllm_config``),
its real ``Scheduler`` (upstream's ``create_scheduler``: the connector comes
from ``KVConnectorFactory``, i.e. from ``kv_connector_module_path`` exactly as
``vllm serve`` loads it), one worker connector per TP rank, their KV tensors
(registered with NIXL as DRAM), a stand-in model that writes each prompt's
KV pattern (``kv_pattern.py``), and the step: ``schedule`` ->
``bind_connector_metadata`` -> model -> ``start_load_kv`` ->
``get_transfer_results`` / ``get_block_ids_with_load_errors`` /
``get_kv_connector_stats`` / ``build_connector_worker_meta`` ->
``clear_connector_metadata`` (vllm/v1/worker/cpu/kv_connector.py), vLLM's
``KVOutputAggregator`` across the ranks, then ``update_from_output``.
May not reach into kvlease's state except to report it (``leak_report``).

TP ranks share this process: each worker is built with vLLM's TP rank and
size functions patched to its rank (the one thing a process per rank would
give it); they have their own NIXL agents, as in vLLM.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any
from unittest.mock import patch

import torch

# Upstream's test stubs (the sdist's tests/, on sys.path via VLLM_TESTS_DIR).
from tests.v1.attention.utils import dense_kv_cache_views
from tests.v1.kv_connector.unit.utils import (
    assert_scheduler_empty,
    create_request,
    create_scheduler,
    create_vllm_config,
)
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.v1.attention.backends.utils import KVCacheLayout
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from .kv_pattern import block_bytes, block_value, fill_block

BLOCK_SIZE = 32
NUM_LAYERS = 2
# facebook/opt-125m (the model config upstream's tests use): 12 KV heads of 64.
MODEL_KV_HEADS = 12
HEAD_SIZE = 64
SAMPLED_TOKEN = 1


def use_real_nixl() -> str:
    """vLLM's worker builds its agent from base_worker.NixlWrapper, which is
    None here (torch is a CUDA 13 build, so ``import nixl`` asks for
    nixl-cu13); put nixl_cu12's agent in its place, as upstream's tests put
    their fake there (VLLM_MAP.md hazard 1)."""
    from nixl_cu12 import _api

    base_worker.NixlWrapper = _api.nixl_agent
    base_worker.nixl_agent_config = _api.nixl_agent_config
    _pause_progress_thread(_api, int(os.environ.get(PROGRESS_DELAY_ENV, "1000")))
    return _api.__name__


#: The pause of each agent's progress thread between two progress calls, in
#: microseconds (0: NIXL's own, a spin).
PROGRESS_DELAY_ENV = "KVLEASE_HARNESS_NIXL_PROGRESS_DELAY_US"


def _pause_progress_thread(api: Any, delay_us: int) -> None:
    """A test-environment switch, as in the real-engine cases
    (py/engine/plugins): NIXL's Python agent sets ``pthrDelay = 0``, so each
    agent's progress thread spins a whole core, busy or idle. Two nodes took
    both cores of the 2-core CI host (measured: 85-89 % each, while the test
    process waited on them); with a 1 ms pause they give the cores back, and
    UCX still progresses on every NIXL call of the worker's own step."""
    if delay_us <= 0:
        return
    original = api.nixlBind.nixlAgent

    def agent(name: str, config: Any, *args: Any, **kwargs: Any) -> Any:
        config.pthrDelay = delay_us
        return original(name, config, *args, **kwargs)

    api.nixlBind.nixlAgent = agent


_DIST_READY = False


def init_dist() -> None:
    """What upstream's ``dist_init`` fixture does: a 1-process gloo group."""
    global _DIST_READY
    if _DIST_READY:
        return
    from tests.utils import ensure_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    fd, path = tempfile.mkstemp()
    os.close(fd)
    with ensure_current_vllm_config():
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"file://{path}",
            local_rank=0, backend="gloo",
        )
        initialize_model_parallel(1, 1)
    _DIST_READY = True


@dataclass
class EngineSpec:
    """What a test asks of one engine."""

    name: str
    role: str  # "P" or "D"
    #: "kvlease" (KvLeaseNixlConnector from kvlease.vllm) or "stock"
    #: (NixlConnector); push mode: "kvlease-push" (KvLeaseNixlPushConnector)
    #: or "stock-push" (NixlPushConnector)
    connector: str = "kvlease"
    tp: int = 1
    num_blocks: int = 64
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 1024
    #: vLLM's ``--long-prefill-token-threshold`` (0: vLLM's default): caps
    #: each prefill's chunk so that several prefills share a step.
    long_prefill_token_threshold: int = 0
    lease_duration: int = 6
    verification: bool = True
    ucx_backend_params: dict[str, str] | None = None
    side_channel_port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def transfer_config(self) -> dict[str, Any]:
        """The --kv-transfer-config of this engine, as ``vllm serve`` takes it."""
        extra: dict[str, Any] = {"kv_lease_duration": self.lease_duration, **self.extra}
        if self.ucx_backend_params:
            extra["ucx_backend_params"] = dict(self.ucx_backend_params)
        cfg: dict[str, Any] = {
            "kv_role": "kv_producer" if self.role == "P" else "kv_consumer",
            "kv_connector_extra_config": extra,
        }
        if self.role == "D":
            cfg["kv_load_failure_policy"] = "recompute"
        names = {
            "kvlease": "KvLeaseNixlConnector", "stock": "NixlConnector",
            "kvlease-push": "KvLeaseNixlPushConnector", "stock-push": "NixlPushConnector",
        }
        cfg["kv_connector"] = names[self.connector]
        if self.connector.startswith("kvlease"):
            cfg["kv_connector_module_path"] = "kvlease.vllm"
            if not self.verification:
                extra["kv_lease_verification"] = False
        return cfg

    @property
    def push(self) -> bool:
        return self.connector.endswith("-push")


@dataclass
class Tracked:
    """A request this engine runs, and what the test learns about it."""

    request: Any
    prompt: list[int]
    #: P: the kv_transfer_params its request_finished returned.
    params: dict[str, Any] | None = None
    finished_at: float | None = None
    #: D: the block values seen after its KV was loaded (or recomputed).
    seen: list[set[int]] | None = None
    #: D: the model computed its prompt from token 0 (a recompute).
    recomputed: bool = False
    #: D: its load was reported failed (failed_recving) at least once.
    load_failed: bool = False
    #: D: the block values a failed load left, before the recompute.
    read_bytes: list[set[int]] | None = None
    freed_at: float | None = None
    #: D: when its load was reported done (received or failed).
    loaded_at: float | None = None


class Engine:
    """One engine (see the module docs)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        tc = spec.transfer_config()
        self.vllm_config = create_vllm_config(
            block_size=BLOCK_SIZE,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            kv_connector=tc["kv_connector"],
            kv_connector_module_path=tc.get("kv_connector_module_path"),
            kv_role=tc["kv_role"],
            kv_load_failure_policy=tc.get("kv_load_failure_policy", "fail"),
            kv_connector_extra_config=tc["kv_connector_extra_config"],
        )
        vc = self.vllm_config
        vc.cache_config.kv_cache_layout = "LBHNC"  # vLLM's choice for NIXL
        vc.kv_transfer_config.kv_buffer_device = "cpu"
        vc.parallel_config.tensor_parallel_size = spec.tp
        if spec.long_prefill_token_threshold:
            vc.scheduler_config.long_prefill_token_threshold = spec.long_prefill_token_threshold
        self.kv_cache_config = self._kv_cache_config(spec.tp)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
        self.scheduler = create_scheduler(
            vc, num_blocks=spec.num_blocks, kv_cache_config=self.kv_cache_config
        )
        self.connector = self.scheduler.get_kv_connector()
        self.workers: list[Any] = []
        self.caches: list[list[torch.Tensor]] = []
        with set_current_vllm_config(vc):
            for rank in range(spec.tp):
                self._add_worker(rank)
        # Affinity: vLLM's CPU worker pins itself to one core per NUMA node;
        # the test process needs both cores for two engines' loops.
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        # vLLM's engine core starts every engine's handshake listener; the
        # pull tests need P's only, push mode D's too (P handshakes back to
        # D before its WRITE).
        if spec.role == "P" or spec.push:
            self.connector.set_xfer_handshake_metadata_pp_aware(
                {(0, r): w.get_handshake_metadata() for r, w in enumerate(self.workers)}
            )
        self.aggregator = KVOutputAggregator(spec.tp)
        self.tracked: dict[str, Tracked] = {}
        self.steps = 0
        # The connector stats vLLM's scheduler hands to its loggers
        # (SchedulerStats.kv_connector_stats), rebuilt and summed the way its
        # logging does (KVConnectorLogging.observe).
        self.connector_cls = type(self.connector)
        self.stats = self.connector_cls.build_kv_connector_stats()

    def _kv_cache_config(self, tp: int) -> KVCacheConfig:
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=MODEL_KV_HEADS // tp,
            head_size=HEAD_SIZE,
            dtype=torch.float16,
        )
        return KVCacheConfig(
            num_blocks=self.spec.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"layer{i}" for i in range(NUM_LAYERS)], spec)],
        )

    def _add_worker(self, rank: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cls = KVConnectorFactory.get_connector_class(self.vllm_config.kv_transfer_config)
        with (
            patch.object(base_worker, "get_tensor_model_parallel_rank", return_value=rank),
            patch.object(
                base_worker, "get_tensor_model_parallel_world_size", return_value=self.spec.tp
            ),
        ):
            worker = cls(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec
            n = self.spec.num_blocks
            raw = torch.zeros(spec.page_size_bytes * n * NUM_LAYERS, dtype=torch.int8)
            layers = dense_kv_cache_views(raw, spec, n, NUM_LAYERS, KVCacheLayout.LBHNC)
            worker.register_kv_caches({f"layer{i}": t for i, t in enumerate(layers)})
        self.workers.append(worker)
        self.caches.append(layers)

    # -- requests -----------------------------------------------------------------

    def _push_id(self, key: int) -> str:
        """Push mode: P matches D's registration by the request id with
        vLLM's ``-<8 hex>`` suffix stripped (``get_base_request_id``), the id
        a router sends both legs as ``X-Request-Id``; each engine adds a
        suffix of its own, as vLLM's input processor does."""
        return f"push{key}-{secrets.token_hex(4)}"

    def add_prefill(self, key: int, num_tokens: int) -> str:
        """P: a do_remote_decode request for prompt ``key`` (max_tokens 1)."""
        req = create_request(
            request_id=key, num_tokens=num_tokens, do_remote_decode=True, block_size=BLOCK_SIZE
        )
        if self.spec.push:
            req.request_id = self._push_id(key)
        self.tracked[req.request_id] = Tracked(req, list(req.prompt_token_ids))
        self.scheduler.add_request(req)
        return req.request_id

    def add_decode(self, key: int, num_tokens: int, params: dict[str, Any]) -> str:
        """D: a do_remote_prefill request for prompt ``key`` with P's params."""
        req = create_request(
            request_id=key, num_tokens=num_tokens, max_tokens=2, block_size=BLOCK_SIZE,
            do_remote_prefill=True,
        )
        req.request_id = self._push_id(key) if self.spec.push else f"d-{key}"
        req.kv_transfer_params = dict(params, do_remote_prefill=True, do_remote_decode=False)
        self.tracked[req.request_id] = Tracked(req, list(req.prompt_token_ids))
        self.scheduler.add_request(req)
        return req.request_id

    def add_local(self, key: int, num_tokens: int, max_tokens: int) -> str:
        """A request computed here (a blocker that keeps D's batch full)."""
        req = create_request(
            request_id=key, num_tokens=num_tokens, max_tokens=max_tokens, block_size=BLOCK_SIZE
        )
        req.request_id = f"local-{key}"
        self.tracked[req.request_id] = Tracked(req, list(req.prompt_token_ids))
        self.scheduler.add_request(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    # -- the step -------------------------------------------------------------------

    def step(self) -> None:
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        for w in self.workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
        self._model(so)
        req_ids = list(so.num_scheduled_tokens)
        # A chunk of a prefill samples nothing (vLLM's runners discard it).
        sampled = [
            [] if (t := self.tracked.get(rid)) is not None
            and t.request.num_computed_tokens < len(t.prompt) else [SAMPLED_TOKEN]
            for rid in req_ids
        ]
        outputs = []
        for w in self.workers:
            w.start_load_kv(None)
            w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)
            kvo = KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
                kv_cache_events=w.get_kv_connector_kv_cache_events(),
                kv_connector_worker_meta=w.build_connector_worker_meta(),
            )
            w.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    sampled_token_ids=[list(x) for x in sampled],
                    kv_connector_output=kvo,
                )
            )
        out = self.aggregator.aggregate(outputs)
        kvo = out.kv_connector_output
        if kvo is not None:
            for rid in kvo.finished_recving or ():
                t = self.tracked.get(rid)
                if t is not None and t.loaded_at is None:
                    t.loaded_at = time.time()
            for rid in kvo.failed_recving or ():
                t = self.tracked.get(rid)
                if t is not None:
                    t.load_failed = True
                    if t.read_bytes is None:
                        # What the failed load put in the blocks, before the
                        # scheduler hands them to the recompute.
                        t.read_bytes = self.blocks_of(rid, len(t.prompt))
        engine_outputs = self.scheduler.update_from_output(so, out)
        now = time.time()
        for eco in engine_outputs.values():
            ss = eco.scheduler_stats
            if ss is not None and ss.kv_connector_stats:
                self.stats = self.stats.aggregate(
                    self.connector_cls.build_kv_connector_stats(ss.kv_connector_stats)
                )
            for o in eco.outputs:
                t = self.tracked.get(o.request_id)
                if t is not None and o.finish_reason is not None and t.finished_at is None:
                    t.finished_at = now
                    t.params = o.kv_transfer_params
        for rid, t in self.tracked.items():
            if t.freed_at is None and t.finished_at is not None and rid not in self.scheduler.requests:
                t.freed_at = now
        self.steps += 1

    def _model(self, so: Any) -> None:
        """Writes each prompt's pattern into the blocks whose first token this
        step computes (a loaded block is never rewritten, so D shows what it
        loaded), and snapshots D's loaded blocks once the request runs."""
        for rid, n in so.num_scheduled_tokens.items():
            t = self.tracked.get(rid)
            if t is None or n <= 0:
                continue
            req = t.request
            # schedule() already advanced num_computed_tokens by n.
            end = req.num_computed_tokens
            start = end - n
            if start == 0 and self.spec.role == "D" and not rid.startswith("local-"):
                t.recomputed = True
            blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            for i, b in enumerate(blocks):
                first = i * BLOCK_SIZE
                if start <= first < min(end, len(t.prompt)):
                    for layers in self.caches:
                        fill_block(layers, b, block_value(t.prompt, i))
            if self.spec.role == "D" and t.seen is None and end >= len(t.prompt) and not rid.startswith("local-"):
                t.seen = self.blocks_of(rid, len(t.prompt))

    def blocks_of(self, rid: str, num_tokens: int) -> list[set[int]]:
        """The byte values of the first blocks of ``rid`` (union over ranks)."""
        blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
        count = -(-num_tokens // BLOCK_SIZE)
        out = []
        for b in blocks[:count]:
            vals: set[int] = set()
            for layers in self.caches:
                vals |= block_bytes(layers, b)
            out.append(vals)
        return out

    # -- inspection -------------------------------------------------------------------

    def leak_report(self) -> dict[str, Any]:
        """Everything that must be empty after a case (empty dict values)."""
        s = self.scheduler
        rep: dict[str, Any] = {}
        try:
            assert_scheduler_empty(s)
        except AssertionError as e:
            rep["scheduler"] = f"not empty: {e!r}; requests={list(s.requests)}"
        cs = self.connector.connector_scheduler
        prefill = getattr(cs, "_kvl_prefill", None)
        if prefill is not None:
            if prefill.fields or prefill.delayed:
                rep["p_scheduler_leases"] = {"fields": list(prefill.fields), "delayed": list(prefill.delayed)}
            if prefill.sched.held:
                rep["p_scheduler_held"] = prefill.sched.held
        if cs._reqs_need_send:
            rep["stock_reqs_need_send"] = list(cs._reqs_need_send)
        book = getattr(cs, "_kvl_heartbeats", None)
        if book is not None and book.size():
            # Lease fields of requests D no longer heartbeats.
            rep["d_heartbeat_fields"] = book.size()
        for r, w in enumerate(self.workers):
            cw = w.connector_worker
            if cw._reqs_to_send:
                rep[f"rank{r}_stock_leases"] = list(cw._reqs_to_send)
            if cw._reqs_to_process:
                rep[f"rank{r}_stock_to_process"] = list(cw._reqs_to_process)
            if cw._recving_transfers:
                rep[f"rank{r}_recving"] = list(cw._recving_transfers)
            rank = getattr(cw, "_kvl_rank", None)
            if rank is not None:
                if rank.rank.held:
                    rep[f"rank{r}_kvlease_held"] = rank.rank.held
                nonzero = [s for s in range(rank.rank.slot_count) if rank.rank.slot_word(s)]
                if nonzero:
                    rep[f"rank{r}_slots_nonzero"] = nonzero
            checks = getattr(cw, "_kvl_checks", None)
            if checks is not None and not checks.idle():
                rep[f"rank{r}_checks_busy"] = True
            if self.spec.push:
                rep.update(self._push_leaks(r, cw))
        return rep

    def _push_leaks(self, r: int, cw: Any) -> dict[str, Any]:
        """Push mode: registrations, WRITEs and permits still held."""
        rep: dict[str, Any] = {}
        for name in ("_pending_d_registrations", "_push_finished_blocks", "_recving_metadata"):
            if getattr(cw, name, None):
                rep[f"rank{r}{name}"] = list(getattr(cw, name))
        d = getattr(cw, "_kvl_d", None)
        if d is not None and d.live:
            rep[f"rank{r}_kvlease_permits_live"] = d.live
        p = getattr(cw, "_kvl_p", None)
        if p is not None and p._held:
            rep[f"rank{r}_kvlease_registrations_held"] = list(p._held)
        for name in ("_kvl_writing", "_kvl_held_back"):
            if getattr(cw, name, None):
                rep[f"rank{r}{name}"] = list(getattr(cw, name))
        return rep

    def free_blocks(self) -> int:
        """Blocks free in the scheduler's pool (vLLM's ``kv_cache_usage``
        counts the rest)."""
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def counters(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        cs = self.connector.connector_scheduler
        prefill = getattr(cs, "_kvl_prefill", None)
        if prefill is not None:
            out["scheduler"] = prefill.sched.counters()
        for r, w in enumerate(self.workers):
            cw = w.connector_worker
            rank = getattr(cw, "_kvl_rank", None)
            if rank is not None:
                out[f"rank{r}"] = rank.rank.counters()
            checks = getattr(cw, "_kvl_checks", None)
            if checks is not None:
                out[f"check{r}"] = checks.checker.counters()
            d = getattr(cw, "_kvl_d", None)
            if d is not None:
                out[f"permits{r}"] = dict(vars(d.counts))
            p = getattr(cw, "_kvl_p", None)
            if p is not None:
                out[f"writes{r}"] = dict(p.counters(), **vars(p.counts))
        return out

    def shutdown(self) -> None:
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.shutdown()
        with contextlib.suppress(Exception):
            self.connector.shutdown()
