"""The lease adverts of the P ranks a D worker handshakes with, read from
the replies of vLLM's own handshake.

Owns: capturing the reply payloads of vLLM's ``_nixl_handshake`` (one per P
rank it queried) and decoding each one's advert; the fallback query when the
replies could not be captured; and the outcome of each: an advert (its slot
array, and whether it accepts compact heartbeats), ``None``
(a P that exports no lease slots: stock vLLM), or :data:`UNKNOWN` (the advert
could not be read). May not fail a handshake: vLLM's handshake result is
vLLM's, and a missing advert costs only the verification of that P rank
(``load_checks.py`` fails closed the loads that carry lease fields from it).

Why capture instead of asking again: a P worker's advert already rides in
the payload its listener sends back for vLLM's ``GET_META`` query
(``metadata.KvLeaseHandshakePayload``), but vLLM decodes that payload into its
own class, which drops the field. Asking P's listener a second time costs a
round trip per P rank on the handshake thread, and under load that listener
(a thread of P's busy EngineCore) can take seconds to answer: on a 2-core
machine the second query timed out after 5 s and failed the whole handshake
(docs/vllm.md, finding 6). Here vLLM's handshake runs with the module's
``zmq_ctx`` wrapped for the current thread only, so the very bytes vLLM
received are decoded once more with our payload class; nothing else about
the handshake changes.

The wrapper is installed once per process (``install``) and is inert on
every thread that is not inside :func:`recording`: vLLM's own use of
``zmq_ctx`` elsewhere gets the original socket.

Push mode reads one thing more from the same replies: the clock reading
each listener sends beside its payload (vLLM's second frame, its
``perf_counter`` at the reply), stamped with this thread's monotonic clock
right before the query left and right after the reply came
(:class:`ClockRound`): a push P's sample of D's clock
(``push_writes.py``), with no query of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import zmq

from .._native import (
    advert_accepts_compact_heartbeats,
    advert_accepts_packed_heartbeats,
    decode_lease_advert,
)
from .metadata import KvLeaseHandshakePayload

logger = logging.getLogger("vllm.kvlease.handshake")

#: An advert that could not be read (neither captured nor queried).
UNKNOWN = "unknown"
#: How long the fallback query waits for P's side channel (ms).
QUERY_TIMEOUT_MS = 5000

_local = threading.local()
_DECODER = msgspec.msgpack.Decoder(KvLeaseHandshakePayload)


class SlotAdvert(tuple):
    """A P rank's advert: ``(base, nbytes, count)`` of its slot array, a
    plain 3-tuple to whoever reads those, and whether the rank renews on
    compact (``HBC:``) and on packed (``HBP:``) heartbeats."""

    compact_heartbeats: bool
    packed_heartbeats: bool

    def __new__(
        cls, slots: tuple[int, int, int], compact_heartbeats: bool, packed_heartbeats: bool = False
    ) -> "SlotAdvert":
        self = super().__new__(cls, slots)
        self.compact_heartbeats = compact_heartbeats
        self.packed_heartbeats = packed_heartbeats
        return self

    def __getnewargs__(self) -> tuple:
        return (tuple(self), self.compact_heartbeats, self.packed_heartbeats)


class ClockRound(tuple):
    """One query and its reply: ``(sent, remote, received)``, the first and
    last on this process's ``time.monotonic()``, ``remote`` the listener's
    clock reading from the reply (None when the reply had none that
    decodes). ``remote`` was read between the two stamps."""

    @property
    def sent(self) -> float:
        return self[0]

    @property
    def remote(self) -> float | None:
        return self[1]

    @property
    def received(self) -> float:
        return self[2]


def _remote_clock(frame: bytes) -> float | None:
    try:
        value = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, ValueError):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class _ReplyRecorder:
    """A ZMQ socket that keeps the first frame of every multipart reply,
    and the clock round of each (see :class:`ClockRound`)."""

    def __init__(self, sock: Any, replies: list[bytes], rounds: list[ClockRound]) -> None:
        self._sock = sock
        self._replies = replies
        self._rounds = rounds
        self._sent: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def send(self, *args: Any, **kwargs: Any) -> Any:
        # Stamped before the send: the listener's reading comes after it.
        self._sent = time.monotonic()
        return self._sock.send(*args, **kwargs)

    def recv_multipart(self, *args: Any, **kwargs: Any) -> list:
        parts = self._sock.recv_multipart(*args, **kwargs)
        received = time.monotonic()
        self._replies.append(bytes(parts[0]) if parts else b"")
        if self._sent is not None:
            remote = _remote_clock(bytes(parts[1])) if len(parts) > 1 else None
            self._rounds.append(ClockRound((self._sent, remote, received)))
            self._sent = None
        return parts


def install(module: Any) -> None:
    """Wraps ``module.zmq_ctx`` (vLLM's NIXL worker module) so that sockets
    opened inside :func:`recording` keep their replies. Idempotent."""
    original = getattr(module, "zmq_ctx", None)
    if original is None or getattr(original, "_kvlease_recording", False):
        return

    @contextmanager
    def zmq_ctx(socket_type: Any, addr: str) -> Iterator[Any]:
        with original(socket_type, addr) as sock:
            replies = getattr(_local, "replies", None)
            rounds = getattr(_local, "rounds", None)
            if replies is None or rounds is None:
                yield sock
            else:
                yield _ReplyRecorder(sock, replies, rounds)

    zmq_ctx._kvlease_recording = True  # type: ignore[attr-defined]
    zmq_ctx.__wrapped__ = original  # type: ignore[attr-defined]
    module.zmq_ctx = zmq_ctx


@contextmanager
def recording() -> Iterator[list[bytes]]:
    """Keeps the replies received on this thread inside the block."""
    with capturing() as (replies, _rounds):
        yield replies


@contextmanager
def capturing() -> Iterator[tuple[list[bytes], list[ClockRound]]]:
    """Keeps the replies received on this thread inside the block, and the
    clock round of each."""
    _local.replies = []
    _local.rounds = []
    try:
        yield _local.replies, _local.rounds
    finally:
        _local.replies = None
        _local.rounds = None


def decode(payload: bytes) -> SlotAdvert | None | str:
    """The advert in one handshake payload: a :class:`SlotAdvert`, None
    when the payload has none (stock P), :data:`UNKNOWN` when it does not
    decode (never raises: the payload is outside input)."""
    try:
        advert = _DECODER.decode(payload).kv_lease_advert
    except (msgspec.DecodeError, msgspec.ValidationError):
        return UNKNOWN
    if not advert:
        return None
    try:
        slots = decode_lease_advert(advert)
        compact = advert_accepts_compact_heartbeats(advert)
        packed = advert_accepts_packed_heartbeats(advert)
    except Exception:
        return UNKNOWN
    # An advert without slots (a P that exports none) is a stock P's to D.
    return None if slots is None else SlotAdvert(slots, compact, packed)


def push_guard(payload: bytes) -> int:
    """The push guard version a handshake payload advertises (0: none, or
    a payload that does not decode). Never raises."""
    try:
        version = _DECODER.decode(payload).kv_push_guard
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0
    return version if isinstance(version, int) and version > 0 else 0


def from_replies(keys: list[tuple[int, int]], replies: list[bytes]) -> dict | None:
    """Adverts by ``(pp, tp)`` rank from the captured replies, which vLLM
    received in the order of ``keys`` (the order of its result dict). None
    when the capture does not match (vLLM read its replies another way)."""
    if len(replies) != len(keys):
        return None
    return {key: decode(payload) for key, payload in zip(keys, replies)}


def query(host: str, port: int, keys: list[tuple[int, int]], base_worker: Any,
          get_meta: Any) -> dict:
    """The fallback: asks P's side channel again for each rank's payload.
    Never raises; a rank whose reply does not come is :data:`UNKNOWN`."""
    out: dict = {}
    path = base_worker.make_zmq_path("tcp", host, port)
    try:
        with base_worker.zmq_ctx(zmq.REQ, path) as sock:
            sock.setsockopt(zmq.RCVTIMEO, QUERY_TIMEOUT_MS)
            for key in keys:
                sock.send(msgspec.msgpack.encode((get_meta, key[0], key[1])))
                out[key] = decode(bytes(sock.recv_multipart()[0]))
    except Exception as e:  # a timeout, a closed listener: verification only
        logger.warning("kvlease: could not read the lease advert of %s:%d (%s): loads "
                       "from it that carry lease fields fail closed", host, port, e)
    for key in keys:
        out.setdefault(key, UNKNOWN)
    return out


def clock_rounds(host: str, port: int, base_worker: Any, get_meta: Any) -> list[ClockRound]:
    """One more query of a peer's side channel (vLLM's ``GET_META`` for rank
    (0, 0)), for the clock reading beside its reply: push mode re-samples
    D's clock with it. Never raises; [] when no reply came."""
    path = base_worker.make_zmq_path("tcp", host, port)
    try:
        with capturing() as (_replies, rounds), base_worker.zmq_ctx(zmq.REQ, path) as sock:
            sock.setsockopt(zmq.RCVTIMEO, QUERY_TIMEOUT_MS)
            sock.send(msgspec.msgpack.encode((get_meta, 0, 0)))
            sock.recv_multipart()
            return list(rounds)
    except Exception as e:  # a timeout, a closed listener: the old sample stays
        logger.info("kvlease: no clock sample from %s:%d this time (%s)", host, port, e)
        return []
