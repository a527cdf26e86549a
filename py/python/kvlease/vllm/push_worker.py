"""The worker side of ``KvLeaseNixlPushConnector``: vLLM's NIXL push worker
with kvlease's push guard hooked in (docs/push.md).

Owns: the overrides of vLLM's push worker and the hand-over between vLLM's
state and the guard's two roles (``push_permits.DecodePushGuard`` on D,
``push_writes.PrefillPushGuard`` on P; an engine with ``kv_both`` runs
both). May not change what vLLM does for a push the guard does not cover:
a ``PUSH_REG`` without a permit is vLLM's on P, and a P that does not
advertise the guard gets vLLM's ``PUSH_REG`` from D (with
``kv_lease_require_verification``, no registration and a failed load
instead).

D, per registration (vLLM's writer thread, ``_do_send_reg_notif``): a
permit is taken and its field rides in the ``PUSH_REG`` dict
(``kvlease_permit``). No permit to be had: nothing is sent and the load
fails (``kv_load_failure_policy``): P never writes, so the blocks are safe
to reuse. Per step (main thread): P's ``PEND:``/``PHB:`` and the fences end
permits; a load whose permit ended any way but ``written`` fails now, when
no WRITE of P can land; the scheduler's revocations (abort, watchdog) go to
P as ``PRV:``.

P, per registration (writer thread, ``_handle_push_reg_notif``): with a
permit, P first needs a clock sample of that D (the clock reading of its
own handshake back to D; until then the registration waits, and is put back
once the handshake is done); then the registration is accepted (held until
its WRITE) or refused (``PEND:R``: P let the request go). Right before the
WRITE (``_xfer_blocks_for_req``), the gate; its end (``_pop_done_transfers``)
is reported. Every drain of the writer: D's ``PRN:``/``PRV:`` in, ``PEND:``
and ``PHB:`` out. A ticker wakes the writer every quarter heartbeat
interval, because a P whose leases all ended steps no more, and vLLM's
writer then sleeps until the next request.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    PUSH_REG_NOTIF_PREFIX,
    NixlConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from . import handshake_adverts
from .clock import now as _now
from .compat import check_vllm_version
from .log_limit import RateLimitedLog
from .metadata import STEP_ATTR, KvLeaseHandshakePayload
from .push_notifs import TO_D, TO_P, NotifTap, PostGate
from .push_permits import GUARD_VERSION, PERMIT_KEY, DecodePushGuard, clock_is_shared
from .push_writes import PrefillPushGuard
from .scheduler_clock import SchedulerClock
from .settings import lease_settings
from .stats import KvLeaseConnectorStats

logger = logging.getLogger("vllm.kvlease.push")

#: The key P keeps its handle under in a registration dict (never sent).
_HANDLE_KEY = "_kvlease_handle"


class KvLeasePushWorker(NixlPushConnectorWorker):
    """vLLM's NIXL push worker with kvlease's push guard (module docs)."""

    # Class defaults: an instance that skipped __init__ is vLLM's worker.
    _kvl_d: DecodePushGuard | None = None
    _kvl_p: PrefillPushGuard | None = None
    _kvl_tap: NotifTap | None = None
    _kvl_require: bool = False
    _kvl_log: RateLimitedLog = RateLimitedLog(logger)
    _kvl_sched: SchedulerClock  # set with _kvl_d

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        check_vllm_version()
        super().__init__(vllm_config, engine_id, kv_cache_config)
        settings = lease_settings(vllm_config, kv_cache_config)
        if settings is None:
            logger.info("kvlease: kv_lease_verification is false: vLLM's own push mode")
            return
        config = settings.config.push_config()
        self.xfer_stats = KvLeaseConnectorStats()
        self._kvl_log = RateLimitedLog(logger)
        self._kvl_require = settings.config.require_verification
        self._kvl_inbox: list[tuple[str, bytes]] = []
        self._kvl_inbox_lock = threading.Lock()
        #: Clock asks of D engines, one thread per lane (push_clocks.py).
        self._kvl_samplers: dict[str, ThreadPoolExecutor] = {}
        #: The ask of each D engine's clock in flight (at most one each).
        self._kvl_asks: dict[str, Future] = {}
        #: Registrations put back after waiting for D's clock: not deferred
        #: again (until handled).
        self._kvl_replaying: set[str] = set()
        if settings.consumer:
            if clock_is_shared():
                self._kvl_d = DecodePushGuard(config, settings.config.max_peers)
                self._kvl_sched = SchedulerClock(config.drift_ppm)
            else:
                logger.warning(
                    "kvlease: perf_counter and monotonic are different clocks here: D "
                    "cannot give P a clock sample, so its pushes are not guarded%s",
                    " and fail" if self._kvl_require else "",
                )
        if settings.producer:
            self._kvl_p = PrefillPushGuard(
                config, settings.config.max_peers, hold_limit=config.duration
            )
            # P requests whose guarded WRITE may read P's blocks (since
            # when, P's clock), and the releases held back for them (see
            # _kvl_release), for at most the hold bound.
            self._kvl_release_lock = threading.Lock()
            self._kvl_hold_bound = config.hold_bound
            #: The P request whose guarded WRITE vLLM is posting on this thread.
            self._kvl_guarded = threading.local()
            self._kvl_writing: dict[str, float] = {}
            self._kvl_held_back: set[str] = set()
            self._kvl_done_back: set[str] = set()
            #: Released P requests for the writer to take out of vLLM's table.
            self._kvl_evict: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._kvl_tap = NotifTap(self.nixl_wrapper, self._kvl_on_messages, self._kvl_on_drain)
        self.nixl_wrapper = self._kvl_tap
        self._kvl_stop = threading.Event()
        if self._kvl_p is not None:
            tick = max(0.05, config.heartbeat_interval / 4)
            threading.Thread(
                target=self._kvl_tick, args=(tick,), daemon=True, name="kvlease-push-tick"
            ).start()
        handshake_adverts.install(base_worker)
        logger.info(
            "kvlease: push guard on (%s%s; write bound %.1f s, %d registrations)",
            "D permits" if self._kvl_d is not None else "",
            (", " if self._kvl_d is not None else "") + "P gate" if self._kvl_p else "",
            config.write_bound,
            config.capacity,
        )

    # -- handshakes -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        payload = self.xfer_handshake_metadata
        if self._kvl_p is not None and payload is not None:
            self.xfer_handshake_metadata = KvLeaseHandshakePayload(
                compatibility_hash=payload.compatibility_hash,
                agent_metadata_bytes=payload.agent_metadata_bytes,
                kv_push_guard=GUARD_VERSION,
            )

    def _nixl_handshake(
        self,
        host: str,
        port: int,
        remote_tp_size: int,
        expected_engine_id: str,
        remote_dcp_size: int = 1,
        remote_pp_size: int = 1,
        notif_agents_only: bool = False,
    ) -> tuple[dict[tuple[int, int], str], float]:
        args = (host, port, remote_tp_size, expected_engine_id, remote_dcp_size,
                remote_pp_size, notif_agents_only)
        if self._kvl_tap is None:
            return super()._nixl_handshake(*args)
        with handshake_adverts.capturing() as (replies, rounds):
            agents, offset = super()._nixl_handshake(*args)
        names = list(agents.values())
        d, p = self._kvl_d, self._kvl_p
        if d is not None:
            # What the P engine speaks: every rank D talks to must say so.
            # Any handshake: D's first one with a P engine may be vLLM's
            # heartbeat handshake, which is a full one in 0.32-0.34 (only
            # PUSH_REG's is notification-only), and later ones are skipped.
            versions = [handshake_adverts.push_guard(r) for r in replies]
            version = min(versions) if versions and len(versions) == len(agents) else 0
            d.note_p(expected_engine_id, version)
            d.peers.note_agents(expected_engine_id, names)
            logger.info(
                "kvlease: P engine %s %s", expected_engine_id,
                f"speaks the push guard (v{version}): its pushes are guarded" if version
                else ("does not speak the push guard: its pushes "
                      + ("fail (kv_lease_require_verification)" if self._kvl_require
                         else "are vLLM's own, unguarded")),
            )
        if p is not None and not notif_agents_only:
            # P's handshake back to a D it writes to (D's own handshakes to
            # P engines are notification-only): the clock sample of that D.
            now = _now()
            p.peers.note_agents(expected_engine_id, names)
            p.observe_clock(expected_engine_id, rounds, now)
            p.note_address(expected_engine_id, host, port, now)
        return agents, offset

    # -- D: registrations (writer thread) ----------------------------------------

    def _do_send_reg_notif(self, req_id: str, reg_data: dict[str, Any]) -> None:
        d = self._kvl_d
        if d is None or self._kvl_tap is None:
            if self._kvl_tap is not None and self._kvl_require:
                return self._kvl_unguardable(req_id, "D's clocks cannot be shared with P")
            return super()._do_send_reg_notif(req_id, reg_data)
        engine = reg_data.get("remote_engine_id")
        why = None
        if not isinstance(engine, str) or not d.p_speaks_guard(engine):
            why = "P does not advertise kvlease's push guard"
        elif (reg_data.get("remote_tp_size") != self.world_size
              or reg_data.get("remote_pp_size", 1) != 1 or getattr(self, "pp_size", 1) != 1):
            why = "the guard needs P's TP size equal to D's, and no pipeline parallelism on either"
        if why is not None:
            if self._kvl_require:
                return self._kvl_unguardable(req_id, why)
            d.counts.unguarded += 1
            self._kvl_record("kv_push_unguarded")
            return super()._do_send_reg_notif(req_id, reg_data)
        now = self._kvl_sched.now(_now())
        if now is None:  # before the first step's metadata: cannot happen in vLLM
            return self._kvl_unguardable(req_id, "no reading of D's scheduler clock yet")
        permit = d.register(req_id, engine, now)
        if permit is None:
            return self._kvl_unguardable(req_id, "no write permit (revoked, or none free)")
        self._kvl_record("kv_push_permits")
        # Whether vLLM sent it, from what vLLM did: it tries every agent of
        # P it knows, or (none known) fails the load without a try. One try
        # is enough to keep the permit: a send that raised may still have
        # left, and the permit then ends at P's answer or at the fence.
        self._kvl_tap.count_sends(PUSH_REG_NOTIF_PREFIX)
        try:
            super()._do_send_reg_notif(req_id, {**reg_data, PERMIT_KEY: permit})
        finally:
            tried = self._kvl_tap.sends()
            self._kvl_tap.stop_counting()
            if not tried:
                d.forget(req_id)  # vLLM failed the load: nothing left

    def _kvl_unguardable(self, req_id: str, why: str) -> None:
        """Nothing goes to P, so P never writes: the load fails at once."""
        if self._kvl_d is not None:
            self._kvl_d.counts.unguardable += 1
            self._kvl_d.forget(req_id)
        self._kvl_record("kv_push_failed")
        self._kvl_log.warning(
            "unguardable",
            "kvlease: push of request %s not registered (%s): its KV load fails, "
            "kv_load_failure_policy applies",
            req_id,
            why,
        )
        self._failed_recv_reqs.put(req_id)

    # -- P: registrations and WRITEs (writer thread) -----------------------------

    def _handle_push_reg_notif(self, notif: bytes) -> None:
        p = self._kvl_p
        if p is None:
            return super()._handle_push_reg_notif(notif)
        try:
            reg = msgspec.msgpack.decode(notif[len(PUSH_REG_NOTIF_PREFIX):])
        except Exception:
            reg = None
        permit = reg.get(PERMIT_KEY) if isinstance(reg, dict) else None
        if permit is None:
            return super()._handle_push_reg_notif(notif)  # a stock D: vLLM's
        rid, engine = reg.get("request_id"), reg.get("decode_engine_id")
        if not (isinstance(rid, str) and isinstance(engine, str) and isinstance(permit, str)):
            p.counts.dropped += 1
            return
        if not p.has_clock(engine) and rid not in self._kvl_replaying:
            # P's handshake back to D, or (done, but it gave no clock
            # reading) one ask of D's clock; then the registration comes
            # again (a copy the wire doubled meanwhile waits the same way).
            # The replay itself is not deferred again: without a clock it
            # is refused (PEND:R: D fails the load at once, not at its fence).
            fut = self._kvl_handshake_back(reg)
            if fut is None:
                fut = self._kvl_ask_clock_now(engine)
            if fut is not None:
                p.counts.deferred += 1
                fut.add_done_callback(lambda f, n=notif, r=rid: self._kvl_replay(f, n, r))
                return
        self._kvl_replaying.discard(rid)
        base = get_base_request_id(rid)
        # A P request of this base that holds its blocks first (vLLM's own
        # match: exact id, then base id), so a client's retry with the same
        # X-Request-Id is written; "gone" refuses only a registration that
        # finds none. What P released is out of vLLM's table first: vLLM
        # evicts it only at its writer's next loop.
        self._kvl_evict_released()
        match = self._pop_matching_finished_blocks(rid)
        live = match is not None or not p.is_gone(base)
        handle, refusal = p.register(engine, permit, rid, live, _now())
        logger.debug("kvlease: registration %s from D %s: %s (matched %s)", rid, engine,
                     refusal or "accepted", match is not None)
        if handle is None:
            if match is not None:
                self._push_finished_blocks[match[0]] = match[1]  # P's lease runs on
            if refusal not in ("malformed", "no_peer", "exhausted", "duplicate"):
                if refusal != "already_ended":  # a copy of one answered: answered again
                    self._kvl_record("kv_push_refused")
                self._push_writer_wake.set()  # the answer goes out at the next drain
            return
        reg[_HANDLE_KEY] = handle
        if match is None:
            self._pending_d_registrations[rid] = reg
        else:
            self._do_start_push_kv(match[0], match[1], reg)

    def _kvl_evict_released(self) -> None:
        """Writer thread: P requests P released leave vLLM's table of
        finished blocks waiting for a registration (``_kvl_release`` queues
        them as it lets them go). A registration handled after a release
        cannot match it; one matched before has its registration ended by
        the release, so the gate refuses its post. Either way no WRITE reads
        blocks P freed, and nothing is remembered for it."""
        while True:
            try:
                rid = self._kvl_evict.get_nowait()
            except queue.Empty:
                return
            self._push_finished_blocks.pop(rid, None)

    def _kvl_handshake_back(self, reg: dict[str, Any]) -> Future | None:
        try:
            return self._ensure_handshake(
                reg["decode_engine_id"], reg["decode_host"], reg["decode_port"],
                reg["decode_tp_size"],
            )
        except Exception as e:  # a malformed registration: D's fence ends it
            self._kvl_log.warning("handshake_back", "kvlease: no handshake to D: %s", e)
            return None

    def _kvl_ask_clock_now(self, engine: str) -> Future | None:
        """One ask of ``engine``'s clock now, for a registration that found
        P's handshake back done but no clock reading from it (the future of
        the ask; None when P does not know where D's side channel is)."""
        p = self._kvl_p
        if p is None:
            return None
        asking = self._kvl_asks.get(engine)
        if asking is not None and not asking.done():
            return asking
        due = p.ask_clock_now(engine)
        return self._kvl_resample(*due) if due is not None else None

    def _kvl_replay(self, fut: Future, notif: bytes, rid: str) -> None:
        if fut.exception() is not None:
            # No way to D at all: nothing can answer it; D's fence ends it.
            if self._kvl_p is not None:
                self._kvl_p.counts.dropped += 1
            return
        if self._kvl_tap is not None:
            self._kvl_replaying.add(rid)
            self._kvl_tap.replay(notif)
        self._push_writer_wake.set()

    def _do_start_push_kv(self, request_id: str, local_block_ids: Any,
                          registration_data: dict[str, Any]) -> None:
        p = self._kvl_p
        handle = registration_data.get(_HANDLE_KEY)
        if p is None or handle is None:
            return super()._do_start_push_kv(request_id, local_block_ids, registration_data)
        # vLLM posts this request's WRITE inside this call (now, or when it
        # drives the call again once P's handshake back to D is done): the
        # WRITE is guarded by the registration's own handle, so no memory
        # of what P released is needed (_xfer_blocks_for_req).
        p.bind(request_id, registration_data["request_id"], handle)
        self._kvl_guarded.current = request_id
        try:
            super()._do_start_push_kv(request_id, local_block_ids, registration_data)
        finally:
            self._kvl_guarded.current = None

    def _xfer_blocks_for_req(self, req_id: str, meta: Any) -> None:
        p, tap = self._kvl_p, self._kvl_tap
        guarded = getattr(self._kvl_guarded, "current", None) == req_id
        if p is None or tap is None or not (guarded or p.is_bound(req_id)):
            return super()._xfer_blocks_for_req(req_id, meta)
        # P's own lease: once it expired, P's blocks may hold another
        # request's KV already (vLLM posts such a WRITE; vllm#55470). P's
        # release ends the registration (let_go), so the gate refuses any
        # post after it; and from here the main thread holds a release back
        # while this WRITE may read the blocks (_kvl_release).
        self._kvl_holds(req_id)
        # The gate itself is asked at the post (NotifTap.transfer), not here:
        # vLLM computes descriptors and prepares the transfer in between.
        gate = PostGate(p, req_id, meta.remote.engine_id, self._kvl_posted, _now)
        tap.arm(gate)
        try:
            super()._xfer_blocks_for_req(req_id, meta)
        finally:
            tap.disarm()
            with self._sending_transfers_lock:
                posted = bool(self._sending_transfers.get(req_id))
            if gate.refused:
                if posted:  # a later rank refused: the WRITE is incomplete
                    p.write_failed({req_id})  # X once the posted ones end
                else:
                    self._kvl_write_ended(req_id)
                    self._kvl_gate_closed(req_id)
            elif not posted:
                if gate.passed:  # NIXL refused the post: nothing in flight
                    p.write_failed({req_id})
                    p.write_done(req_id, _now())
                else:  # vLLM posted nothing (no blocks): nothing to gate
                    p.end_unposted(req_id)
                self._kvl_write_ended(req_id)

    def _kvl_posted(self, req_id: str) -> None:
        """The gate let ``req_id``'s WRITE through: P's hold counts from here."""
        with self._kvl_release_lock:
            if req_id in self._kvl_writing:
                self._kvl_writing[req_id] = _now()

    def _kvl_gate_closed(self, req_id: str) -> None:
        logger.debug("kvlease: gate closed for the WRITE of %s", req_id)
        self._kvl_record("kv_push_gate_closed")
        self._push_writer_wake.set()

    # -- both: the writer's drains -------------------------------------------------

    def _kvl_holds(self, req_id: str) -> None:
        """From now until the WRITE of ``req_id`` ended, P's release of its
        blocks waits (at most the hold bound). A release that came first
        ended the registration already: the gate then refuses the post."""
        with self._kvl_release_lock:
            self._kvl_writing[req_id] = _now()

    def _kvl_on_messages(self, msgs: list[tuple[str, bytes]]) -> None:
        to_p = [m for m in msgs if m[1].startswith(TO_P)]
        if to_p and self._kvl_p is not None:
            self._kvl_p.on_messages(to_p)
        to_d = [m for m in msgs if m[1].startswith(TO_D)]
        if to_d and self._kvl_d is not None:
            with self._kvl_inbox_lock:
                self._kvl_inbox.extend(to_d)

    def _kvl_on_drain(self) -> None:
        p = self._kvl_p
        if p is None:
            return
        self._kvl_evict_released()
        now = _now()
        sends = p.poll(now)
        if sends and logger.isEnabledFor(logging.DEBUG):  # the list costs per drain
            logger.debug("kvlease: P sends %s", [(e, m[:12]) for e, m in sends])
        self._kvl_send(sends)
        for due in p.due_resamples(now):
            self._kvl_resample(*due)

    def _kvl_tick(self, period: float) -> None:
        while not self._kvl_stop.wait(period):
            self._push_writer_wake.set()

    def _kvl_resample(self, engine: str, host: str, port: int, lane: str) -> Future:
        """Asks D's side channel once more (vLLM's query), for its clock, on
        the lane's own thread (``push_clocks.py``: a dead D's asks block only
        the asks of other suspect Ds)."""
        sampler = self._kvl_samplers.get(lane)
        if sampler is None:
            sampler = self._kvl_samplers[lane] = ThreadPoolExecutor(
                1, thread_name_prefix=f"kvlease-clock-{lane}"
            )
        p = self._kvl_p

        def sample() -> None:
            rounds: list = []
            try:
                rounds = handshake_adverts.clock_rounds(host, port, base_worker, GET_META_MSG)
            finally:
                self._kvl_asks.pop(engine, None)
                if p is not None:
                    p.resampled(engine, rounds, _now())

        fut = self._kvl_asks[engine] = sampler.submit(sample)
        return fut

    def _cleanup_remote_engine(self, engine_id: str, *, log_eviction: bool = True) -> None:
        # vLLM forgets a remote engine (idle past engine_ttl, replaced, or at
        # shutdown): so do the guard's peer tables, clocks and asks.
        super()._cleanup_remote_engine(engine_id, log_eviction=log_eviction)
        if self._kvl_d is not None:
            self._kvl_d.forget_engine(engine_id)
        if self._kvl_p is not None:
            self._kvl_p.forget_engine(engine_id)

    def _kvl_send(self, sends: list[tuple[str, bytes]]) -> None:
        for engine, msg in sends:
            with self._handshake_lock:
                agents = list((self._remote_agents.get(engine) or {}).values())
            for agent in agents:
                try:
                    self.nixl_wrapper.send_notif(agent, notif_msg=msg)
                except Exception as e:
                    self.xfer_stats.record_failed_notification()
                    self._kvl_log.warning(
                        "push_notif_failed", "kvlease: push notification to %s failed: %s",
                        agent, e,
                    )

    # -- every step (main thread) --------------------------------------------------

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        d = self._kvl_d
        if d is not None:
            # Before vLLM's own part, which may hand registrations to the
            # writer thread: they are stamped on this reading.
            self._kvl_sched.observe(getattr(metadata, "scheduler_clock", 0.0), _now())
        step = getattr(metadata, STEP_ATTR, None)
        if d is not None and step is not None:
            for rid in getattr(step, "push_revokes", ()):
                d.revoke(rid)
        super().start_load_kv(metadata)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        d = self._kvl_d
        now = self._kvl_sched.now(_now()) if d is not None else None
        if d is not None and now is not None:  # no permit exists before a reading
            with self._kvl_inbox_lock:
                msgs, self._kvl_inbox = self._kvl_inbox, []
            ended = d.on_messages(msgs, now) if msgs else []
            if msgs and logger.isEnabledFor(logging.DEBUG):
                logger.debug("kvlease: D got %s -> %s", [(a, m[:12]) for a, m in msgs], ended)
            sends, fenced = d.poll(now)
            self._kvl_send(sends)
            for rid, end in ended + fenced:
                if rid not in self._recving_metadata:
                    continue  # reported already (vLLM's failure path)
                self._kvl_record("kv_push_failed")
                self._kvl_log.warning(
                    "push_failed",
                    "kvlease: push of request %s ended %s: no WRITE of P can land any "
                    "more; its KV load fails, kv_load_failure_policy applies",
                    rid,
                    end,
                )
                self._failed_recv_reqs.put(rid)
        results = super().get_transfer_results()
        if d is not None:
            for rid in results.finished_recving:
                d.received(rid)
        p = self._kvl_p
        if p is not None:
            self._kvl_release(results)
        return results

    def _kvl_release(self, results: KVConnectorTransferResults) -> None:
        """P's blocks go back to vLLM (``finished_sending``) only when no
        guarded WRITE reads them: an expiry that comes while one flies is
        held back until it ended (``_pop_done_transfers``)."""
        p = self._kvl_p
        assert p is not None
        with self._kvl_release_lock:
            for rid in list(results.finished_sending):
                if rid in self._kvl_writing:
                    results.finished_sending.discard(rid)
                    self._kvl_held_back.add(rid)
            self._kvl_end_overdue_holds(_now())
            results.finished_sending.update(self._kvl_done_back)
            self._kvl_done_back.clear()
            # Under the lock: a post that starts after this finds its
            # registration ended (let_go), whatever vLLM still queues, and a
            # registration handled after this cannot match it.
            for rid in results.finished_sending:
                p.let_go(rid, get_base_request_id(rid))
                self._kvl_evict.put(rid)
        late = p.take_late_writes()
        if late:
            self._kvl_record("kv_push_late_writes", late)
        if results.finished_sending:
            self._push_writer_wake.set()

    def _kvl_end_overdue_holds(self, now: float) -> None:
        """Held-back releases whose WRITE is past the hold bound go back
        (``PushConfig.hold_bound``: D's fence has passed, so the blocks
        protect nothing any more). Under ``_kvl_release_lock``; one look at
        each held-back release, which are few (WRITEs outliving P's lease)."""
        for rid in list(self._kvl_held_back):
            since = self._kvl_writing.get(rid)
            if since is None or now - since <= self._kvl_hold_bound:
                continue
            del self._kvl_writing[rid]
            self._kvl_held_back.discard(rid)
            self._kvl_done_back.add(rid)
            self._kvl_record("kv_push_holds_ended")
            self._kvl_log.warning(
                "hold_ended",
                "kvlease: the guarded WRITE of request %s has not ended %.0f s after "
                "its post (hold bound): D's fence has passed, P's blocks go back",
                rid, now - since,
            )

    def _pop_done_transfers(self, transfers: Any) -> tuple[set[str], set[str]]:
        done, failed = super()._pop_done_transfers(transfers)
        p = self._kvl_p
        if p is not None and transfers is self._sending_transfers and (done or failed):
            now = _now()
            p.write_failed(failed)
            for rid in done:
                if p.write_done(rid, now):
                    self._kvl_record("kv_push_written")
                self._kvl_write_ended(rid)
            self._push_writer_wake.set()
        return done, failed

    def _kvl_write_ended(self, rid: str) -> None:
        with self._kvl_release_lock:
            self._kvl_writing.pop(rid, None)
            if rid in self._kvl_held_back:
                self._kvl_held_back.discard(rid)
                self._kvl_done_back.add(rid)

    def _kvl_record(self, key: str, count: int = 1) -> None:
        stats = self.xfer_stats
        if isinstance(stats, KvLeaseConnectorStats):
            stats.record_lease(key, count)

    def shutdown(self) -> None:
        stop = getattr(self, "_kvl_stop", None)
        if stop is not None:
            stop.set()
        for sampler in getattr(self, "_kvl_samplers", {}).values():
            sampler.shutdown(wait=False)
        super().shutdown()
