"""P's scheduler-side lease bookkeeping, between vLLM's hooks and the Rust
``PrefillScheduler``.

Owns: which requests kvlease holds (assigned at first scheduling, started at
``request_finished``), the lease fields exported in ``kv_transfer_params``,
the per-step directives, the application of the workers' reports, and the
hand-back of released requests as vLLM's ``finished_sending`` and of their
slots to the pool. May not touch vLLM's own state: the scheduler subclass
(``scheduler.py``) decides what of vLLM's it changes.

A request kvlease cannot hold (its id too long, the capacity reached) falls
back to vLLM's own lease dict and reaper, unchanged: it then gets no lease
fields, which a verifying decoder fails. Those are counted
(``kv_lease_unslotted``).

Why ``finished_sending`` from the workers is filtered here: vLLM's
``Scheduler._update_from_kv_xfer_finished`` asserts that every id in it is
still a request and frees its blocks, so one id too many kills the engine
(or frees the blocks of a running request). vLLM's scheduler waits for
exactly the ids whose ``request_finished`` returned ``delay_free=True``, once
each; kvlease reports its own (``delayed``) when their leases are released,
and lets through from the workers only vLLM's (``vllm_delayed``). Anything
else (a worker that took a late read-done for an id kvlease held, a second
report of one id) is dropped, counted and logged: a bug upstream of here,
never an engine crash.

The per-request warnings are rate-limited (``log_limit.py``); the counters
count every event.

Why ``finished_sending`` is added here and the slot given back at once: vLLM's
``Scheduler._update_from_kv_xfer_finished`` calls ``update_connector_output``
and then, in the same call, frees the blocks of every id in
``finished_sending``. The next lease that may take the released slot is
assigned in a later ``build_connector_meta``, so by then the blocks are free
(or, with vLLM's deferred frees, queued for a free no new write can
precede); and every rank zeroed the slot before it reported, so no reader can
match the old nonce in it, whoever holds the slot next.
"""

from __future__ import annotations

import logging
from typing import Any

from .._native import LeaseConfig, PrefillScheduler
from ..errors import GrantError, IpcError, StartError
from .log_limit import RateLimitedLog
from .stats import KvLeaseConnectorStats

logger = logging.getLogger("vllm.kvlease.prefill")

#: kv_transfer_params keys of the seed.
SLOT_KEY = "remote_lease_slot"
NONCE_KEY = "remote_lease_nonce"


class PrefillLeases:
    """One P engine's leases (see the module docs). Times are
    ``time.monotonic()`` seconds of the scheduler process."""

    def __init__(self, config: LeaseConfig, ranks: int, now: float) -> None:
        self.sched = PrefillScheduler(config, ranks, now)
        self.ranks = ranks
        #: Scheduled for the first time since the last build_connector_meta.
        self._to_assign: set[str] = set()
        #: Assigned (or started): request id -> (slot, nonce) or None.
        self.fields: dict[str, tuple[int, int] | None] = {}
        #: Taken out of vLLM's worker tracking at assignment (reqs_in_batch)
        #: and not finished yet: if kvlease lets one of them go before its
        #: prefill ends, vLLM's worker must track it again (``finished``).
        self.untracked: set[str] = set()
        #: request_finished returned delay_free=True for these; each goes to
        #: finished_sending exactly once, when its lease is released.
        self.delayed: set[str] = set()
        #: request_finished returned delay_free=True for these and vLLM's own
        #: lease keeps their blocks: the workers report each in
        #: finished_sending once (module docs).
        self.vllm_delayed: set[str] = set()
        #: finished_sending ids from the workers that vLLM's scheduler does
        #: not wait for, dropped (module docs).
        self.unexpected_finished = 0
        self.log = RateLimitedLog(logger)
        #: Released while no connector output was at hand (drained in
        #: build_connector_meta): reported at the next update_connector_output.
        self._release_pending: set[str] = set()
        self.stats = KvLeaseConnectorStats()

    # -- hooks -------------------------------------------------------------

    def on_scheduled(self, request_id: str) -> None:
        """A do_remote_decode request got blocks (``update_state_after_alloc``)."""
        if request_id not in self.fields:
            self._to_assign.add(request_id)

    def assign_scheduled(self, now: float) -> set[str]:
        """Assigns a lease to every request scheduled this step; returns the
        ids kvlease now holds (vLLM's worker must not track them)."""
        held: set[str] = set()
        for rid in self._to_assign:
            try:
                self.fields[rid] = self.sched.assign(rid, now)
            except GrantError as e:
                # Stock vLLM's lease for this one (module docs).
                self.stats.record_lease("kv_lease_unslotted")
                self.log.warning(
                    "no_lease",
                    "kvlease: no lease for request %s (%s): vLLM's own lease "
                    "applies and its KV cannot be verified",
                    rid,
                    e.reason,
                )
                continue
            held.add(rid)
        self._to_assign.clear()
        self.untracked |= held
        return held

    def directives(self, now: float) -> bytes:
        # The backstop first: its probes ride this step's message.
        self.sched.poll(now)
        return self.sched.encode_directives(now)

    def holds(self, request_id: str) -> bool:
        return request_id in self.fields

    def finished(
        self, request_id: str, delay_free: bool, params: dict[str, Any] | None, now: float
    ) -> str:
        """``request_finished`` of a request: start its lease and export its
        fields when vLLM keeps the blocks for D, cancel it otherwise.
        Returns ``"held"`` (kvlease holds the blocks: the caller drops vLLM's
        deadline), ``"vllm"`` (vLLM's lease as usual), or ``"returned"``
        (kvlease let go of it before its prefill ended, so vLLM's lease
        applies and vLLM's worker must track the request again)."""
        outcome = self._finished(request_id, delay_free, params, now)
        if delay_free and outcome != "held":
            # vLLM's lease keeps the blocks: its workers report the id.
            self.vllm_delayed.add(request_id)
        return outcome

    def _finished(
        self, request_id: str, delay_free: bool, params: dict[str, Any] | None, now: float
    ) -> str:
        self._to_assign.discard(request_id)
        untracked = request_id in self.untracked
        self.untracked.discard(request_id)
        if request_id not in self.fields:
            if not (untracked and delay_free):
                return "vllm"
            # Its pinned lease lapsed during a prefill longer than
            # kv_lease_max_pin, and the release was already reported.
            self.stats.record_lease("kv_lease_unslotted")
            self.log.warning(
                "lapsed_in_prefill",
                "kvlease: lease of request %s lapsed during its prefill: vLLM's own "
                "lease applies and its KV cannot be verified",
                request_id,
            )
            return "returned"
        if not delay_free or params is None:
            self.cancel(request_id)
            return "vllm"
        fields = self.fields[request_id]
        try:
            self.sched.start(request_id, now)
        except StartError as e:
            # Its pinned lease lapsed during a prefill longer than
            # kv_lease_max_pin: vLLM's own lease takes over.
            self.fields.pop(request_id, None)
            self.stats.record_lease("kv_lease_unslotted")
            self.log.warning(
                "not_started",
                "kvlease: lease of request %s could not start (%s): vLLM's own "
                "lease applies and its KV cannot be verified",
                request_id,
                e.reason,
            )
            return "returned"
        if fields is not None:
            params[SLOT_KEY], params[NONCE_KEY] = fields
            self.stats.record_lease("kv_lease_granted")
        else:
            self.stats.record_lease("kv_lease_unslotted")
        self.delayed.add(request_id)
        return "held"

    def cancel(self, request_id: str) -> None:
        """The request ended without handing its blocks to D (aborted,
        preempted for good, or finished without blocks)."""
        self._to_assign.discard(request_id)
        self.untracked.discard(request_id)
        if request_id in self.fields:
            del self.fields[request_id]
            self.sched.cancel(request_id)

    def apply_reports(self, reports: list[tuple[int, bytes]]) -> None:
        for rank, msg in reports:
            try:
                self.sched.apply_reports(rank, msg)
            except IpcError as e:
                logger.error("kvlease: report of rank %d refused: %s", rank, e)

    def release(self, finished_sending: set[str] | None) -> set[str] | None:
        """Keeps of the workers' ``finished_sending`` only the ids vLLM's
        scheduler waits for from them (module docs), then drains the released
        leases: their ids join it (created when ``None`` and needed), their
        slots go back. Returns the set to use as ``finished_sending``."""
        if finished_sending:
            reported = set(finished_sending)
            expected = reported & self.vllm_delayed
            if len(expected) != len(reported):
                self._drop_unexpected(reported - expected)
            self.vllm_delayed -= expected
            finished_sending = expected
        done = self._drain()
        if done:
            finished_sending = set(finished_sending or ()) | done
        return finished_sending

    def _drop_unexpected(self, ids: set[str]) -> None:
        self.unexpected_finished += len(ids)
        self.log.error(
            "unexpected_finished",
            "kvlease: the workers reported %d request(s) done sending that vLLM's "
            "scheduler does not wait for (e.g. %s); dropped, since vLLM would "
            "assert on them or free blocks still in use",
            len(ids),
            next(iter(ids)),
        )

    def drain_between_steps(self) -> None:
        """Drains releases that need no report (a lease cancelled before any
        rank heard of it); ids vLLM waits for are kept for :meth:`release`."""
        self._release_pending |= self._drain()

    def _drain(self) -> set[str]:
        done = self._release_pending
        self._release_pending = set()
        for rid, _nonce, reason, ticket in self.sched.drain_released():
            self.fields.pop(rid, None)
            if rid in self.delayed:
                self.delayed.discard(rid)
                done.add(rid)
            if reason == "read_done":
                self.stats.record_lease("kv_lease_released_read")
            elif reason == "expired":
                self.stats.record_lease("kv_lease_expired")
                # vLLM's own counter of reclaimed requests, as its reaper keeps it.
                self.stats.record_kv_expired_req()
                self.log.warning(
                    "expired",
                    "kvlease: lease of request %s expired (no heartbeat, or a prefill "
                    "longer than kv_lease_max_pin): its lease slot is released",
                    rid,
                )
            elif reason == "cancelled":
                self.stats.record_lease("kv_lease_cancelled")
            if ticket is not None:
                # The blocks of `rid` are freed by vLLM right after this call
                # returns (module docs), or were freed at request_finished
                # (cancelled), or never held (an id vLLM does not wait for).
                self.sched.blocks_freed(ticket)
        return done

    def take_stats(self) -> KvLeaseConnectorStats | None:
        if self.stats.is_empty():
            return None
        return self.stats.clone_and_reset()

    def shutdown(self) -> None:
        for rid in list(self.fields):
            self.sched.cancel(rid)
        self.fields.clear()
        self.untracked.clear()
        self.vllm_delayed.clear()
