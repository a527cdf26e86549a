"""kvlease: KV-cache leases for disaggregated prefill/decode serving over NIXL.

The lease roles of the Rust library, as classes that take and return bytes:

- P (prefill): :class:`PrefillScheduler` in the scheduler process,
  :class:`PrefillRank` in each worker (it owns the lease-slot array that the
  worker's ``nixl_agent`` registers);
- D (decode): :class:`HeartbeatTracker` in the scheduler process,
  :class:`SlotChecker` in each worker (the post-READ slot check that turns a
  lapsed lease into a failed KV load);
- the codecs: :func:`encode_read_done`, :func:`encode_heartbeats`,
  :func:`encode_compact_heartbeats`, :func:`decode_notification`,
  :func:`encode_outcomes`, :func:`decode_outcomes`, :func:`lease_advert`;
- :class:`LeaseConfig`, parsed from vLLM's ``kv_connector_extra_config``;
- push mode's guard: :class:`PushPermits` (D), :class:`PushWrites` (P),
  :class:`PushConfig`, and :class:`ClockEstimate` (P's view of D's clock).

Times are ``now: float`` seconds of one monotonic clock per process
(``time.monotonic()``). Nonces are Python ints in the seed's int64 form
(``remote_lease_nonce``). Errors are :mod:`kvlease.errors` exceptions.

The vLLM connector is :mod:`kvlease.vllm` (``KvLeaseNixlConnector``).
"""

from __future__ import annotations

from ._native import (
    ClockEstimate,
    HeartbeatTracker,
    LeaseConfig,
    PrefillRank,
    PrefillScheduler,
    PushConfig,
    PushPermits,
    PushWrites,
    SlotChecker,
    SlotTicket,
    WriteHandle,
    __version__,
    advert_accepts_compact_heartbeats,
    advert_accepts_packed_heartbeats,
    decode_lease_advert,
    decode_notification,
    decode_outcomes,
    encode_compact_heartbeats,
    encode_heartbeats,
    encode_outcomes,
    encode_read_done,
    lease_advert,
    read_done_form,
)
from .errors import (
    ConfigError,
    FabricError,
    GrantError,
    IpcError,
    KvLeaseError,
    PushError,
    StartError,
    TrackError,
    VerifyError,
    WireError,
)

__all__ = [
    "__version__",
    "LeaseConfig",
    "PrefillScheduler",
    "PrefillRank",
    "SlotTicket",
    "HeartbeatTracker",
    "SlotChecker",
    "PushConfig",
    "PushPermits",
    "PushWrites",
    "WriteHandle",
    "ClockEstimate",
    "encode_read_done",
    "encode_heartbeats",
    "encode_compact_heartbeats",
    "decode_notification",
    "encode_outcomes",
    "decode_outcomes",
    "lease_advert",
    "decode_lease_advert",
    "advert_accepts_compact_heartbeats",
    "advert_accepts_packed_heartbeats",
    "read_done_form",
    "KvLeaseError",
    "ConfigError",
    "GrantError",
    "StartError",
    "IpcError",
    "WireError",
    "PushError",
    "TrackError",
    "VerifyError",
    "FabricError",
]
