"""A trace of every heartbeat round and renewal, for diagnosing lapses in
the real-engine cases (``KVLEASE_ENGINE_TRACE_HEARTBEATS=1``; off by
default, never in CI).

Owns: wrappers, installed in every vLLM process of an instance, that log at
WARNING (vLLM's default level shows them):

- D's scheduler: each heartbeat round (``HeartbeatLeases.round``): per P
  engine, vLLM's ids, kvlease's lease fields, and the compact message sizes;
- D's worker: each ``_send_heartbeats`` with a round, and each ``HB:`` it
  turns into compact messages (``CompactSends``);
- P's worker: each heartbeat with what it renewed (the rank's counters
  before and after: renewed, capped, unknown slot, stale nonce), each
  directive message, each poll that expired leases, and each gap of over
  1 s between two polls (a worker that took no step).

May not change behaviour: each wrapper calls the original and only logs.
Why: the overload case's lapses (issue 28) were diagnosed with it: D's
rounds went out up to 11.6 s apart (interval 3 s, extension 12 s) while P
renewed every record it got, which moved D's warning from step gaps to
round gaps (``scheduler.py``, ``_kvl_note_round``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("vllm.kvlease.heartbeat_trace")

#: The rank counters a heartbeat or a poll moves.
COUNTERS = ("renewed", "renew_capped", "renew_unknown", "renew_nonce_mismatch", "expired")


def install() -> None:
    from kvlease.vllm import compact_heartbeats, rank_leases, worker

    _trace_rank(rank_leases.RankLeases)
    _trace_rounds(compact_heartbeats.HeartbeatLeases, compact_heartbeats.CompactSends)
    _trace_sends(worker.KvLeaseWorker, worker.STEP_ATTR)
    logger.warning("kvlease heartbeat trace on")


def _moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in COUNTERS if after.get(k) != before.get(k)}


def _trace_rank(cls: Any) -> None:
    on_heartbeat, poll, apply_directives = cls.on_heartbeat, cls.poll, cls.apply_directives

    def traced_heartbeat(self, sender, msg, now):
        before = self.rank.counters()
        on_heartbeat(self, sender, msg, now)
        logger.warning("trace P heartbeat t=%.3f bytes=%d kind=%s moved=%s", now, len(msg),
                       bytes(msg[:4]), _moved(before, self.rank.counters()))

    def traced_poll(self, now):
        last = getattr(self, "_trace_last_poll", None)
        if last is not None and now - last > 1.0:
            logger.warning("trace P no poll for %.2f s (t=%.3f)", now - last, now)
        self._trace_last_poll = now
        before = self.rank.counters()
        poll(self, now)
        moved = _moved(before, self.rank.counters())
        if moved:
            logger.warning("trace P poll t=%.3f moved=%s", now, moved)

    def traced_directives(self, msg, now):
        if msg:
            logger.warning("trace P directives t=%.3f bytes=%d", now, len(msg))
        apply_directives(self, msg, now)

    cls.on_heartbeat, cls.poll, cls.apply_directives = (
        traced_heartbeat, traced_poll, traced_directives)


def _trace_rounds(book_cls: Any, sends_cls: Any) -> None:
    round_, send_notif = book_cls.round, sends_cls.send_notif

    def traced_round(self, heartbeat_by_engine):
        out = round_(self, heartbeat_by_engine)
        logger.warning(
            "trace D round t=%.3f engines=%s", time.monotonic(),
            {e: dict(ids=len(info.req_ids), fields=len(self._by_engine.get(e, {})),
                     compact=[len(m) for m in out[e].messages] if e in out else None)
             for e, info in heartbeat_by_engine.items()})
        return out

    def traced_send(self, agent_name, notif_msg=b"", **kwargs):
        if bytes(notif_msg).startswith(b"HB:"):
            logger.warning("trace D HB: to %s (compact: %s, %d bytes)", agent_name,
                           agent_name in self._targets, len(notif_msg))
        return send_notif(self, agent_name, notif_msg=notif_msg, **kwargs)

    book_cls.round, sends_cls.send_notif = traced_round, traced_send


def _trace_sends(worker_cls: Any, step_attr: str) -> None:
    send_heartbeats = worker_cls._send_heartbeats

    def traced(self, metadata):
        if metadata.heartbeat_by_engine:
            step = getattr(metadata, step_attr, None)
            logger.warning(
                "trace D send t=%.3f engines=%s compact rounds=%s agents=%s", time.monotonic(),
                {e: len(i.req_ids) for e, i in metadata.heartbeat_by_engine.items()},
                None if step is None else list(step.heartbeats or {}),
                {e: list(a.values()) for e, a in self._remote_agents.items()})
        return send_heartbeats(self, metadata)

    worker_cls._send_heartbeats = traced
