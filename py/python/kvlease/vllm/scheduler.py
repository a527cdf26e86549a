"""The scheduler side of ``KvLeaseNixlConnector``: vLLM 0.34's pull
scheduler with P's lease assignment and D's lease-field hand-over hooked in.

Owns: the overrides of vLLM's scheduler hooks. P: a ``do_remote_decode``
request gets its slot and nonce when it is first scheduled
(``update_state_after_alloc`` notes it, ``build_connector_meta`` assigns it
and ships the directive to every worker in that same step), its lease starts
at ``request_finished``, which exports ``remote_lease_slot`` /
``remote_lease_nonce`` in ``kv_transfer_params``, and its release comes back
from the workers' reports in ``update_connector_output``
(``prefill_leases.py`` has the ordering argument). D: the lease fields of the
requests whose READs start this step go to the workers with the metadata,
since vLLM drops unknown ``kv_transfer_params`` keys on that way; and those
of every heartbeated request are kept beside vLLM's heartbeat sets, so that
each heartbeat round ships them encoded as packed heartbeats (``HBP:``)
(``compact_heartbeats.py``).

May not change what vLLM does for requests kvlease does not hold. An instance
built without ``__init__`` (vLLM's unit tests use ``object.__new__``) has no
kvlease state and is vLLM's scheduler.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)

from .clock import now as _now
from .compact_heartbeats import HeartbeatLeases
from .compat import check_vllm_version
from .log_limit import RateLimitedLog
from .metadata import STEP_ATTR, LeaseReports, LeaseStep
from .prefill_leases import NONCE_KEY, SLOT_KEY, PrefillLeases
from .settings import lease_settings
from .stats import KvLeaseConnectorStats

logger = logging.getLogger("vllm.kvlease.scheduler")

_U32 = 1 << 32
_I64 = 1 << 63


_F53 = float(1 << 53)


def _as_int(v: Any) -> int | None:
    """An int field as a router may hand it back: an int, or a float with no
    fraction below 2^53 (a router that re-encodes every JSON number as a
    double writes ``7.0``; kvlease's own nonces are below 2^53, so the value
    is exact). Anything else (bools, fractions, NaN, text) is None."""
    if type(v) is int:
        return v
    if type(v) is float and abs(v) < _F53 and v == int(v):
        return int(v)
    return None


def read_fields(params: dict[str, Any] | None) -> tuple[int, int] | None:
    """``(slot, nonce)`` from a request's ``kv_transfer_params``, or None when
    absent or not the seed's form (outside input: a router may mangle it)."""
    if not params:
        return None
    slot, nonce = _as_int(params.get(SLOT_KEY)), _as_int(params.get(NONCE_KEY))
    if slot is None or nonce is None:
        return None
    if not (0 <= slot < _U32) or not (-_I64 <= nonce < _I64) or nonce == 0:
        return None
    return slot, nonce


class KvLeaseScheduler(NixlPullConnectorScheduler):
    """vLLM's NIXL pull scheduler with kvlease's roles (module docs)."""

    # Class defaults: an instance that skipped __init__ is vLLM's scheduler.
    _kvl_prefill: PrefillLeases | None = None
    _kvl_forward_fields: bool = False
    #: D: the lease fields of the heartbeated requests (compact heartbeats).
    _kvl_heartbeats: HeartbeatLeases | None = None
    #: D: when the last heartbeat round went to the workers (None: no
    #: request to heartbeat since), and the longest gap between two rounds
    #: that leaves P's lease its margin (late-heartbeat warning).
    _kvl_last_round: float | None = None
    #: D: the heartbeated requests no round has carried yet, with when this
    #: scheduler took them in (its own monotonic clock).
    _kvl_unannounced: dict[str, float] | None = None
    _kvl_round_gap_limit: float = 0.0
    _kvl_extension: float = 0.0
    #: D: the scheduler's own counters (late heartbeat rounds).
    _kvl_d_stats: KvLeaseConnectorStats | None = None
    _kvl_log: RateLimitedLog = RateLimitedLog(logger)

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        check_vllm_version()
        super().__init__(vllm_config, engine_id, kv_cache_config)
        settings = lease_settings(vllm_config, kv_cache_config)
        if settings is None:
            return
        pc = vllm_config.parallel_config
        if settings.producer and pc.prefill_context_parallel_size > 1:
            logger.warning(
                "kvlease: prefill context parallelism is not supported; this engine "
                "keeps vLLM's own leases and its KV cannot be verified"
            )
        elif settings.producer:
            ranks = pc.tensor_parallel_size * pc.pipeline_parallel_size
            self._kvl_prefill = PrefillLeases(settings.config, ranks, _now())
            logger.info(
                "kvlease: P leases for %d ranks (kv_lease_duration %.1f s, %d slots)",
                ranks,
                settings.config.lease_duration,
                settings.config.lease_slots,
            )
        self._kvl_forward_fields = settings.consumer
        if settings.consumer:
            self._kvl_heartbeats = HeartbeatLeases()
            self._kvl_unannounced = {}
            self._kvl_extension = settings.config.lease_extension
            self._kvl_round_gap_limit = (
                settings.config.lease_extension - settings.config.heartbeat_interval
            )
            self._kvl_d_stats = KvLeaseConnectorStats()
            self._kvl_log = RateLimitedLog(logger)

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        book = self._kvl_heartbeats
        if book is None:
            return
        # vLLM heartbeats the request only if it took it in here.
        key = self._heartbeat_req_engine.get(request.request_id)
        if key is not None:
            book.track(key[0], key[1], read_fields(request.kv_transfer_params))
            if self._kvl_unannounced is not None:
                # This process's clock, not the request's arrival_time: that
                # is the API server's wall clock, which may be another
                # host's (a headless DP engine) or step under NTP, and
                # inflated this count. The time the request spent before
                # this scheduler took it in is not counted (said in the docs).
                self._kvl_unannounced[request.request_id] = _now()

    def _stop_heartbeat(self, req_id: str) -> None:
        book = self._kvl_heartbeats
        key = self._heartbeat_req_engine.get(req_id) if book is not None else None
        super()._stop_heartbeat(req_id)
        if self._kvl_unannounced is not None:
            self._kvl_unannounced.pop(req_id, None)
        if key is not None:
            book.stop(key[0], key[1])

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        prefill = self._kvl_prefill
        params = request.kv_transfer_params
        if prefill is not None and params and params.get("do_remote_decode"):
            prefill.on_scheduled(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        fields: dict[str, tuple[int, int]] = {}
        if self._kvl_forward_fields:
            for rid, entry in self._reqs_need_recv.items():
                f = read_fields(entry[0].kv_transfer_params)
                if f is not None:
                    fields[rid] = f
        prefill = self._kvl_prefill
        now = _now()
        if prefill is not None:
            prefill.assign_scheduled(now)
        meta = super().build_connector_meta(scheduler_output)
        heartbeats = {}
        book = self._kvl_heartbeats
        if book is not None:
            self._kvl_note_round(now, bool(meta.heartbeat_by_engine))
            if meta.heartbeat_by_engine:
                # A heartbeat round (vLLM's throttle chose this step).
                heartbeats = book.round(meta.heartbeat_by_engine)
        directives = b""
        if prefill is not None:
            # Every id kvlease holds stays out of vLLM's worker tracking, not
            # only at its first scheduling: vLLM's update_state_after_alloc
            # puts it in reqs_in_batch again whenever it is scheduled again
            # (after a preemption, or reset_prefix_cache(reset_running_requests=True)),
            # and an id in the worker's _reqs_to_process is never removed and
            # makes a late plain read-done for it a finished_sending.
            ours = {rid for rid in meta.reqs_in_batch if prefill.holds(rid)}
            if ours:
                meta.reqs_in_batch = meta.reqs_in_batch - ours
            prefill.drain_between_steps()
            directives = prefill.directives(now)
        if directives or fields or heartbeats:
            setattr(
                meta,
                STEP_ATTR,
                LeaseStep(directives=directives, read_fields=fields, heartbeats=heartbeats),
            )
        return meta

    def _kvl_note_round(self, now: float, round_now: bool) -> None:
        """D: warns when two heartbeat rounds went out further apart than
        the lease extension minus the heartbeat interval while requests
        waited for P's KV, or when a round carried a request for the first
        time that long after D's scheduler took the request in; both count as a late
        round (``kv_lease_late_heartbeat_rounds``).

        Why rounds and not steps: P lets a lease go one extension after the
        last heartbeat it received, and vLLM sends one only at the first step
        an interval after the last, so a step gap of extension - interval
        can already let a lease lapse (measured in the real engine: rounds
        11.6 s apart, the extension 12 s, while a check of step gaps against
        the extension stayed silent). The limit is the margin vLLM's design
        leaves a heartbeat (extension - interval, half the lease): an early
        warning, since P lets go only an extension after the last heartbeat
        it received. Such loads fail the lease check and are recomputed;
        this line (and its counter) says why, so a lapse without it is a bug."""
        if not self._heartbeat_by_engine:
            # Nothing to heartbeat: the next round starts a new count.
            self._kvl_last_round = None
            return
        if not round_now:
            return
        # A request's first round is late too when it comes that long after
        # D's scheduler took the request in (a stalled or starved step): the
        # gap between rounds does not see it, since none was due for that
        # request (and after an idle D, none at all). The earliest such
        # request in the round stands for the round.
        unannounced = self._kvl_unannounced
        first_wait = 0.0
        if unannounced:
            first_wait = now - min(unannounced.values())
            unannounced.clear()
        last = self._kvl_last_round
        self._kvl_last_round = now
        gap = now - last if last is not None else 0.0
        late_gap = gap > self._kvl_round_gap_limit
        late_first = first_wait > self._kvl_round_gap_limit
        if (late_gap or late_first) and self._kvl_d_stats is not None:
            self._kvl_d_stats.record_lease("kv_lease_late_heartbeat_rounds")
        if late_first and not late_gap:
            self._kvl_log.warning(
                "late_first_heartbeat",
                "kvlease: D's first heartbeat to P for a request went out %.1f s after D's "
                "scheduler took the request in (a stalled or starved engine; warned past %.1f s, the "
                "lease extension less the heartbeat interval). P's lease ran all that time "
                "and before it, from the end of the prefill; if it ran out, that load fails "
                "the lease check and is recomputed",
                first_wait,
                self._kvl_round_gap_limit,
            )
        if late_gap:
            self._kvl_log.warning(
                "late_heartbeat",
                "kvlease: D's heartbeats to P went out %.1f s apart while requests waited "
                "for P's KV (a stalled or starved engine: they go out from the step loop; "
                "warned past %.1f s, the lease extension less the heartbeat interval). P "
                "lets a lease go %.1f s (the extension) after the last heartbeat it "
                "received, so it may have let theirs go; such loads fail the lease check "
                "and are recomputed",
                gap,
                self._kvl_round_gap_limit,
                self._kvl_extension,
            )

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        prefill = self._kvl_prefill
        if prefill is None:
            return delay_free, params
        rid = request.request_id
        outcome = prefill.finished(rid, delay_free, params, _now())
        if outcome == "held":
            # The lease is kvlease's: no deadline for vLLM's worker dict.
            self._reqs_need_send.pop(rid, None)
        elif outcome == "returned":
            # kvlease let it go mid-prefill (kv_lease_max_pin): vLLM's lease
            # applies, and its worker only keeps deadlines of requests it saw
            # in a batch. The next metadata carries both, batch first.
            self._reqs_in_batch.add(rid)
        return delay_free, params

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        prefill = self._kvl_prefill
        if prefill is None:
            return
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, LeaseReports):
            prefill.apply_reports(meta.reports)
        connector_output.finished_sending = prefill.release(connector_output.finished_sending)

    def kvl_take_stats(self) -> KvLeaseConnectorStats | None:
        """The scheduler's counters since the last call: P's leases and D's
        late heartbeat rounds (an engine with ``kv_both`` has both)."""
        prefill = self._kvl_prefill
        out = prefill.take_stats() if prefill is not None else None
        d = self._kvl_d_stats
        if d is not None and not d.is_empty():
            taken = d.clone_and_reset()
            out = taken if out is None else out.aggregate(taken)
        return out

    def shutdown(self) -> None:
        if self._kvl_prefill is not None:
            self._kvl_prefill.shutdown()
        super().shutdown()
