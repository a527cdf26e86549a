"""The worker side of ``KvLeaseNixlConnector``: vLLM 0.34's pull worker with
P's lease rank and D's lease check hooked in.

Owns: the overrides of vLLM's worker hooks and the hand-over between vLLM's
state and kvlease's two worker roles (``rank_leases.RankLeases`` on P,
``load_checks.LoadChecks`` on D). May not change what vLLM does for a request
kvlease does not hold: every override falls through to vLLM's own method
then, and an instance built without ``__init__`` (vLLM's unit tests build
workers with ``object.__new__``) has no kvlease state at all and is vLLM's
worker.

P, per step (vLLM's call order): ``start_load_kv`` applies the scheduler's
directives (nonces into slots, lease starts, cancels) before vLLM's own work;
``get_transfer_results`` drains the notifications (heartbeats and read-dones
of kvlease's leases to the rank, anything else to vLLM's handling, nothing
raises on outside bytes) and polls the rank for expiry instead of scanning
every lease; the rank's reports leave through ``build_connector_worker_meta``
(the connector's). Requests kvlease holds never enter vLLM's lease dict, so
this worker never reports them in ``finished_sending``: the scheduler does,
once every rank let go (no double report).

D: heartbeats to a P agent whose advert accepts packed heartbeats go out
as ``HBP:`` (slot, nonce) records for the requests with lease fields
(``compact_heartbeats.py``); every other agent, and every request without
lease fields, gets vLLM's ``HB:`` message.

D: the block READs of a request read from a P that advertises lease slots
are posted without their read-done; when they all completed the request is
held out of ``finished_recving`` until its slot check decides; then it is
reported received (verified) or failed (its blocks invalid, so vLLM's
``kv_load_failure_policy`` applies), and the read-dones go out in the nonce
form. After a failed check they go out too: the nonce makes them no-ops on a
P whose lease lapsed, and they free the blocks at once on a P that still
holds them (a load that failed for missing lease fields or a failed slot
READ). A P that advertises no slots (stock vLLM) is read exactly as vLLM
reads it, and its loads are counted unverified; with
``kv_lease_require_verification`` such a load fails instead (the seed's
rule: a pull that cannot be verified fails), counted with the failed checks.

The per-request warnings are rate-limited (``log_limit.py``); the counters
count every event.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

from ..errors import KvLeaseError
from . import handshake_adverts
from .clock import now as _now
from .compact_heartbeats import CompactSends, compact_targets
from .compat import check_vllm_version
from .load_checks import LeaseRead, LoadChecks
from .log_limit import RateLimitedLog
from .metadata import STEP_ATTR, KvLeaseHandshakePayload, LeaseReports
from .rank_leases import RankLeases
from .read_gate import HeldReadDones
from .settings import lease_settings
from .stats import KvLeaseConnectorStats

logger = logging.getLogger("vllm.kvlease.worker")



class KvLeaseWorker(NixlPullConnectorWorker):
    """vLLM's NIXL pull worker with kvlease's roles (see the module docs)."""

    # Class defaults: an instance that skipped __init__ is vLLM's worker.
    _kvl_rank: RankLeases | None = None
    _kvl_checks: LoadChecks | None = None
    #: kv_lease_require_verification: fail loads from a P without lease slots.
    _kvl_require: bool = False
    #: Shared by instances built without __init__ (tests); __init__ gives
    #: each worker its own.
    _kvl_log: RateLimitedLog = RateLimitedLog(logger)

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        check_vllm_version()
        super().__init__(vllm_config, engine_id, kv_cache_config)
        settings = lease_settings(vllm_config, kv_cache_config)
        if settings is None:
            logger.info("kvlease: kv_lease_verification is false: vLLM's own NIXL leases")
            return
        now = _now()
        self.xfer_stats = KvLeaseConnectorStats()
        self._kvl_log = RateLimitedLog(logger)
        if settings.producer and self.pcp_size > 1:
            logger.warning(
                "kvlease: prefill context parallelism is not supported; this engine "
                "keeps vLLM's own leases and its KV cannot be verified"
            )
        elif settings.producer:
            rank = self._kvl_pp_rank() * self.world_size + self.tp_rank
            leases = RankLeases(settings.config, rank, now)
            try:
                leases.register(self.nixl_wrapper, self.nixl_backends)
            except Exception as e:
                raise RuntimeError(
                    "kvlease: the lease slots could not be registered with NIXL as DRAM "
                    f"({e}); kv_lease_verification is on, so this instance does not "
                    "start (set kv_lease_verification to false to run as stock vLLM)"
                ) from e
            self._kvl_rank = leases
            logger.info(
                "kvlease: P rank %d exports %d lease slots (%d bytes at %#x)",
                rank,
                leases.rank.slot_count,
                leases.rank.slots_nbytes,
                leases.rank.slots_address,
            )
        if settings.consumer:
            capacity = int(kv_cache_config.num_blocks) + int(
                vllm_config.scheduler_config.max_num_seqs
            )
            checks = LoadChecks(
                settings.config,
                capacity,
                settings.config.max_peers,
                f"kvlease-d-{self.tp_rank}",
            )
            try:
                checks.register_landing(self.nixl_wrapper, self.nixl_backends)
            except Exception as e:
                raise RuntimeError(
                    "kvlease: the lease-check buffers could not be registered with NIXL "
                    f"as DRAM ({e}); kv_lease_verification is on, so this instance does "
                    "not start (set kv_lease_verification to false to run as stock vLLM)"
                ) from e
            self._kvl_checks = checks
            handshake_adverts.install(base_worker)
            self._kvl_require = settings.config.require_verification
            logger.info(
                "kvlease: D verifies KV loads (up to %d checks at once, %d P ranks%s)",
                capacity,
                settings.config.max_peers,
                "; loads from a P without lease slots fail" if self._kvl_require else "",
            )

    def _kvl_pp_rank(self) -> int:
        if self.pp_size <= 1:
            return 0
        from vllm.distributed.parallel_state import get_pp_group

        return get_pp_group().rank_in_group

    # -- handshake ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        rank = self._kvl_rank
        payload = self.xfer_handshake_metadata
        if rank is not None and payload is not None:
            self.xfer_handshake_metadata = KvLeaseHandshakePayload(
                compatibility_hash=payload.compatibility_hash,
                agent_metadata_bytes=payload.agent_metadata_bytes,
                kv_lease_advert=rank.advert(),
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
        checks = self._kvl_checks
        if checks is None or notif_agents_only:
            return super()._nixl_handshake(*args)
        # The adverts ride in the replies vLLM's handshake receives
        # (handshake_adverts.py): no second round trip, and no way for a
        # missing advert to fail vLLM's handshake.
        with handshake_adverts.recording() as replies:
            agents, offset = super()._nixl_handshake(*args)
        if agents:
            keys = list(agents)
            adverts = handshake_adverts.from_replies(keys, replies)
            if adverts is None:
                adverts = handshake_adverts.query(host, port, keys, base_worker, GET_META_MSG)
            unknown = sum(a == handshake_adverts.UNKNOWN for a in adverts.values())
            if unknown:
                self.xfer_stats.record_lease("kv_lease_advert_unknown", unknown)
            checks.record_adverts(agents, adverts)
        return agents, offset

    def _cleanup_remote_engine(self, engine_id: str, *, log_eviction: bool = True) -> None:
        names = list(self._remote_agents.get(engine_id, {}).values())
        super()._cleanup_remote_engine(engine_id, log_eviction=log_eviction)
        if self._kvl_checks is not None:
            self._kvl_checks.forget(names)

    # -- every step ----------------------------------------------------------------

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        step = getattr(metadata, STEP_ATTR, None)
        rank = self._kvl_rank
        if rank is not None and step is not None:
            rank.apply_directives(step.directives, _now())
        checks = self._kvl_checks
        if checks is not None:
            fields = step.read_fields if step is not None else {}
            for rid, meta in metadata.reqs_to_recv.items():
                # vLLM awaits a receive only for these (others only notify P).
                if meta.remote is None or not (meta.awaiting_kvs or any(meta.local_block_ids)):
                    continue
                checks.recording[rid] = LeaseRead(
                    request_id=rid,
                    remote_request_id=meta.remote.request_id,
                    fields=fields.get(rid),
                    blocks=(
                        None
                        if self._is_hma_required
                        else [b for b in (meta.local_block_ids or ((),))[0]]
                    ),
                )
        super().start_load_kv(metadata)

    def _read_blocks(
        self,
        read_spec: Any,
        dst_engine_id: str,
        request_id: str,
        remote_request_id: str,
        local_xfer_side_handle: int,
        local_dram_handle: int | None,
        remote_xfer_side_handle: int,
        expected_consumers: int,
        awaiting_kvs: bool,
    ) -> bool:
        kwargs = dict(
            read_spec=read_spec,
            dst_engine_id=dst_engine_id,
            request_id=request_id,
            remote_request_id=remote_request_id,
            local_xfer_side_handle=local_xfer_side_handle,
            local_dram_handle=local_dram_handle,
            remote_xfer_side_handle=remote_xfer_side_handle,
            expected_consumers=expected_consumers,
            awaiting_kvs=awaiting_kvs,
        )
        checks = self._kvl_checks
        lease = checks.recording.get(request_id) if checks is not None else None
        if lease is None:
            return super()._read_blocks(**kwargs)
        agent_name = self._remote_agents[dst_engine_id][(0, read_spec.remote_rank)]
        try:
            peer = checks.peer_for(agent_name, _now(), leased=lease.fields is not None)
        except KvLeaseError as e:
            # No room to check this P rank (every peer of a full table busy),
            # or no advert of it to check against (unread or never recorded):
            # the READ goes on with its read-done held, and the load fails
            # (never used unchecked), counted at the verdict.
            why = "peer table full" if e.reason == "Full" else "no lease advert"
            lease.refused = f"refused: {why} ({e.reason})"
            self._kvl_log.error(
                "peer_table_full", "kvlease: cannot check P agent %s: %s", agent_name, e
            )
            peer = (-1, 0)
        if peer is None:
            # P exports no lease slots (stock vLLM): read as vLLM reads.
            lease.unverified = True
            return super()._read_blocks(**kwargs)
        gate = HeldReadDones(self.nixl_wrapper, lambda _msg: lease.read_done(expected_consumers))
        pending = self._pending_recv_notifs.get(request_id)
        before = len(pending) if pending is not None else 0
        self.nixl_wrapper = gate
        try:
            ok = super()._read_blocks(**kwargs)
        finally:
            self.nixl_wrapper = gate.agent
        # Split DRAM/VRAM reads defer their read-done to vLLM's pending list:
        # take ours out of it, it is held for the verdict as well.
        pending = self._pending_recv_notifs.get(request_id)
        held_split = False
        if pending is not None and len(pending) > before:
            del pending[before:]
            held_split = True
            if not pending:
                del self._pending_recv_notifs[request_id]
        if gate.stripped or held_split:
            lease.reads.append((agent_name, peer[0], expected_consumers))
        return ok

    def _send_heartbeats(self, metadata: NixlConnectorMetadata) -> None:
        checks = self._kvl_checks
        step = getattr(metadata, STEP_ATTR, None)
        rounds = step.heartbeats if step is not None else None
        if checks is None or not rounds:
            return super()._send_heartbeats(metadata)
        targets = compact_targets(rounds, self._remote_agents, checks.accepts_packed)
        if not targets:
            return super()._send_heartbeats(metadata)
        # vLLM's method with the agent swapped for its length: its HB:
        # message to an agent that accepts packed heartbeats becomes the
        # engine's HBP: messages (compact_heartbeats.py); every other agent
        # gets vLLM's bytes.
        sends = CompactSends(self.nixl_wrapper, targets)
        self.nixl_wrapper = sends
        try:
            super()._send_heartbeats(metadata)
        finally:
            self.nixl_wrapper = sends.agent

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = super().get_transfer_results()
        checks = self._kvl_checks
        if checks is None:
            return results
        for rid in list(results.finished_recving):
            lease = checks.recording.pop(rid, None)
            if lease is None or rid in results.failed_recving:
                continue  # vLLM's own failure path: nothing was verified
            if lease.unverified and self._kvl_require:
                # A P without lease slots (stock vLLM), and this D requires
                # every load verified: the seed's rule, the load fails.
                self._kvl_load_failed(
                    results,
                    lease,
                    "unverifiable: P advertises no lease slots, and "
                    "kv_lease_require_verification is on",
                )
                self._kvl_send_read_dones(lease)
                continue
            if not lease.reads:
                if lease.unverified:
                    self.xfer_stats.record_lease("kv_lease_unverified")
                continue
            results.finished_recving.discard(rid)
            checks.submit(lease)
        for lease, verdict in checks.step(self.nixl_wrapper, _now()):
            rid = lease.request_id
            results.finished_recving.add(rid)
            if verdict == "verified":
                self.xfer_stats.record_lease("kv_lease_verified")
            else:
                self._kvl_load_failed(results, lease, verdict)
            self._kvl_send_read_dones(lease)
        return results

    def _kvl_load_failed(
        self, results: KVConnectorTransferResults, lease: LeaseRead, why: str
    ) -> None:
        """Reports the load of ``lease`` failed (its blocks invalid, so
        ``kv_load_failure_policy`` applies) and counts it."""
        rid = lease.request_id
        results.failed_recving.add(rid)
        if lease.blocks is not None:
            self._invalid_block_ids.put(set(lease.blocks))
        self.xfer_stats.record_lease("kv_lease_failed_checks")
        self._kvl_log.warning(
            "failed_check",
            "kvlease: KV load of request %s (P request %s) failed its lease "
            "check (%s): the KV is not used; kv_load_failure_policy applies",
            rid,
            lease.remote_request_id,
            why,
        )

    def _kvl_send_read_dones(self, lease: LeaseRead) -> None:
        """The read-dones held for the verdict, in the nonce form."""
        for agent_name, _peer, consumers in lease.reads:
            try:
                self.nixl_wrapper.send_notif(agent_name, notif_msg=lease.read_done(consumers))
            except Exception as e:
                self.xfer_stats.record_failed_notification()
                self._kvl_log.warning(
                    "read_done_failed", "kvlease: read-done to %s failed: %s", agent_name, e
                )

    def _get_new_notifs(self) -> set[str]:
        rank = self._kvl_rank
        if rank is None:
            return super()._get_new_notifs()
        done: set[str] = set()
        now = _now()
        for sender, msgs in self.nixl_wrapper.get_new_notifs().items():
            if isinstance(sender, bytes):
                sender = sender.decode("utf-8", "replace")
            for msg in msgs:
                if isinstance(msg, str):
                    msg = msg.encode("utf-8", "surrogateescape")
                if msg.startswith((b"HB:", b"HBC:", b"HBP:")):
                    rank.on_heartbeat(sender, msg, now)
                    if self._reqs_to_send and msg.startswith(b"HB:"):
                        super()._handle_heartbeat(msg[3:].decode("utf-8", "replace"))
                elif not rank.on_read_done(sender, msg, now):
                    self._kvl_plain_read_done(msg, done)
        return done

    def _kvl_plain_read_done(self, msg: bytes, done: set[str]) -> None:
        """A read-done for a request kvlease does not hold: vLLM's counting
        (``{id}:{consumers}``, freed when every consumer reported), parsed
        without raising: a message that is no read-done is counted and dropped."""
        parsed = _parse_read_done(msg)
        rank = self._kvl_rank
        if parsed is None:
            if rank is not None:
                rank.malformed += 1
            logger.debug("kvlease: dropped a notification that is no read-done: %r", msg[:80])
            return
        req_id, consumers = parsed
        if req_id not in self._reqs_to_send and req_id not in self._reqs_to_process:
            self.xfer_stats.record_notification_after_expiry()
            # vLLM's line, rate-limited: late read-dones come in bursts when
            # leases lapse under load.
            self._kvl_log.error(
                "after_expiry",
                "Potentially invalid KV blocks for unrecognized request %s were "
                "retrieved by a decode worker. They may have expired.",
                req_id,
            )
            return
        self.expected_consumer_notifications_by_req[req_id] = consumers
        seen = self.consumer_notification_counts_by_req.get(req_id, 0) + 1
        self.consumer_notification_counts_by_req[req_id] = seen
        if seen == consumers:
            done.add(req_id)
            del self.consumer_notification_counts_by_req[req_id]
            del self.expected_consumer_notifications_by_req[req_id]
            self._reqs_to_process.discard(req_id)
            self._reqs_to_send.pop(req_id, None)

    def _handle_heartbeat(self, payload: str) -> None:
        rank = self._kvl_rank
        if rank is not None:
            rank.on_heartbeat("", ("HB:" + payload).encode("utf-8", "surrogateescape"), _now())
        super()._handle_heartbeat(payload)

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        rank = self._kvl_rank
        if rank is not None:
            rank.poll(_now())
        # vLLM's reaper for the leases vLLM holds (none, unless kvlease
        # refused one); it returns at once on an empty dict.
        super()._reap_expired_send_leases(done_sending)

    def kvl_holds_leases(self) -> bool:
        """Whether this worker holds P leases (a kvlease P rank)."""
        return self._kvl_rank is not None

    def kvl_worker_meta(self) -> LeaseReports | None:
        """This step's lease reports for the scheduler (None when none)."""
        rank = self._kvl_rank
        if rank is None:
            return None
        msg = rank.reports()
        return LeaseReports([(rank.index, msg)]) if msg else None

    def shutdown(self) -> None:
        agent = getattr(self, "nixl_wrapper", None)
        if agent is not None and self._kvl_checks is not None:
            self._kvl_checks.release_reads(agent)
        # The slot array and the landing buffers stay registered: they live
        # as long as this worker, and the agent drops its registrations when
        # it is destroyed. A D still reading a slot during our shutdown then
        # reads a word, not an unregistered address.
        super().shutdown()


def _parse_read_done(msg: bytes) -> tuple[str, int] | None:
    """``(request id, consumers)`` of ``{id}:{consumers}`` (an optional
    ``:nonce=<hex>`` suffix is ignored; ids may hold ``:``), or None."""
    try:
        text = msg.decode("utf-8")
    except UnicodeDecodeError:
        return None
    req_id, sep, count = text.rpartition(":")
    if sep and count.startswith("nonce="):
        req_id, sep, count = req_id.rpartition(":")
    if not sep or not req_id or not count.isascii() or not count.isdigit():
        return None
    consumers = int(count)
    return (req_id, consumers) if consumers > 0 else None

