"""Exceptions raised by kvlease.

Every exception carries ``reason``: the name of the library error's variant
(``"Full"``, ``"BadId"``, ``"UnknownWorker"``, ...), so that code can branch on
it without parsing messages::

    try:
        slot_nonce = scheduler.assign(request_id, now)
    except GrantError as e:
        if e.reason == "Full":
            ...  # answer without remote-decode params

Nothing kvlease does on outside input (bytes off the wire, role messages,
configuration, ids) crashes the interpreter: it raises one of these, or a
``ValueError``/``TypeError``/``OverflowError`` for an argument of the wrong
type or range.
"""

from __future__ import annotations

__all__ = [
    "KvLeaseError",
    "ConfigError",
    "GrantError",
    "StartError",
    "IpcError",
    "WireError",
    "TrackError",
    "VerifyError",
    "FabricError",
    "PushError",
]


class KvLeaseError(Exception):
    """Base of every kvlease error. ``reason`` is the variant name."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason

    def __reduce__(self):  # picklable across vLLM's processes
        return (type(self), (self.message, self.reason))


class ConfigError(KvLeaseError):
    """A bad ``kv_connector_extra_config`` value (the message names the key),
    or roles that cannot be built from it."""


class GrantError(KvLeaseError):
    """A lease was refused (``Full``, ``BadId``, ``Duplicate``,
    ``ReleasePending``, ``NoRanks``): the request is not leased."""


class StartError(KvLeaseError):
    """``start`` of a lease that is unknown, started, or released."""


class IpcError(KvLeaseError):
    """Role-message bytes (directives, reports, plans, outcomes) that do not
    decode, or come from the wrong sender. Nothing was applied."""


class WireError(KvLeaseError):
    """A notification that does not decode, or an id a notification cannot
    carry."""


class TrackError(KvLeaseError):
    """D's tracker refused a request (full, duplicate, a bad field): it is
    not heartbeated."""


class VerifyError(KvLeaseError):
    """A lease check was refused (full, too many P ranks): fail the load."""


class FabricError(KvLeaseError):
    """A peer or READ bookkeeping error of the slot checker."""


class PushError(KvLeaseError):
    """Push mode's guard refused: ``Exhausted`` (no free write permit: fail
    the load and do not register) or ``UnknownPermit`` (no live permit with
    that slot and nonce)."""
