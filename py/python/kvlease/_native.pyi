"""Type stubs of kvlease's native module (Rust, PyO3). See the package docs."""

from typing import Iterable, Literal, Mapping, Optional, Sequence

__version__: str

Buffer = bytes | bytearray | memoryview

class LeaseConfig:
    """Every lease setting, parsed from vLLM's ``kv_connector_extra_config``."""

    @staticmethod
    def parse(
        extra: str | Mapping[str, object] | None, num_kv_blocks: int, max_num_seqs: int
    ) -> LeaseConfig:
        """Parses a JSON object (str or dict; a whole ``--kv-transfer-config``
        works too). Raises ``ConfigError`` naming the key at fault."""
    @property
    def unknown_keys(self) -> list[str]: ...
    @property
    def lease_duration(self) -> float: ...
    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def lease_extension(self) -> float: ...
    @property
    def verification(self) -> bool: ...
    @property
    def require_verification(self) -> bool: ...
    @property
    def max_peers(self) -> int: ...
    @property
    def lease_slots(self) -> int: ...
    @property
    def lease_capacity(self) -> int: ...
    @property
    def max_hold(self) -> Optional[float]: ...
    @property
    def max_pin(self) -> float: ...
    @property
    def max_fan_out(self) -> int: ...
    @property
    def max_request_id_len(self) -> int: ...
    @property
    def max_tracked_requests(self) -> int: ...
    def push_config(self) -> PushConfig:
        """Push mode's guard settings from the same keys (``kv_lease_duration``,
        ``kv_lease_push_write_bound``, ``kv_lease_push_capacity``)."""

class SlotTicket:
    """A released lease's slot; give it back with ``blocks_freed`` once."""

    @property
    def slot(self) -> int: ...

ReleaseReason = Literal["read_done", "expired", "cancelled", "not_held"]

class PrefillScheduler:
    """P's scheduler-side lease role (one per engine)."""

    def __init__(self, config: LeaseConfig, ranks: int, now: float) -> None: ...
    def assign(self, request_id: str, now: float) -> Optional[tuple[int, int]]:
        """(remote_lease_slot, remote_lease_nonce) or None (no slot).
        Raises ``GrantError``."""
    def start(self, request_id: str, now: float) -> float:
        """The expiry. Raises ``StartError``."""
    def grant(self, request_id: str, now: float) -> Optional[tuple[int, int]]: ...
    def cancel(self, request_id: str) -> bool: ...
    def poll(self, now: float) -> int:
        """The backstop: probes (and, past a limit, Cancels) queued for
        leases a rank left unanswered. Call once per step, before
        ``encode_directives``."""
    def encode_directives(self, now: float) -> bytes:
        """This step's directives for every rank (b"" when none)."""
    def apply_reports(self, rank: int, msg: Buffer) -> tuple[int, int, int]:
        """(counted, released, ignored). Raises ``IpcError``."""
    def drain_released(self) -> list[tuple[str, int, ReleaseReason, Optional[SlotTicket]]]:
        """(request_id, nonce, reason, ticket) of every released lease."""
    def blocks_freed(self, ticket: SlotTicket) -> None: ...
    def rank_lost(self, rank: int) -> None: ...
    def rank_restarted(self, rank: int) -> None: ...
    def status(self, request_id: str) -> Optional[Literal["assigned", "held", "released"]]: ...
    @property
    def held(self) -> int: ...
    @property
    def pending_directives(self) -> int: ...
    def counters(self) -> dict[str, int]: ...

ShareOutcome = Literal[
    "share_released", "counted", "unknown", "stale_nonce", "duplicate_sender"
]

class PrefillRank:
    """One P worker's share of the leases, with its lease-slot array."""

    def __init__(self, config: LeaseConfig, rank: int, now: float) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def slots_address(self) -> int: ...
    @property
    def slots_nbytes(self) -> int: ...
    @property
    def slot_count(self) -> int: ...
    def slot_word(self, slot: int) -> Optional[int]: ...
    def apply_directives(self, msg: Buffer, now: float) -> tuple[int, int, int]:
        """(applied, ignored, refused). Raises ``IpcError``."""
    def on_notification(
        self, sender: str, msg: Buffer, now: float
    ) -> tuple[int, int, Optional[ShareOutcome]]:
        """(renewed, ignored, read_done). Raises ``WireError``."""
    def poll(self, now: float) -> None: ...
    def encode_reports(self) -> bytes:
        """This step's reports for the scheduler (b"" when none)."""
    @property
    def held(self) -> int: ...
    def expiry(self, request_id: str) -> Optional[float]: ...
    def counters(self) -> dict[str, int]: ...

class HeartbeatTracker:
    """D's scheduler-side tracking and verify-outcome aggregation."""

    def __init__(self, config: LeaseConfig, workers: int) -> None: ...
    def on_new_request(
        self, request_id: str, params: Mapping[str, object], now: float
    ) -> str:
        """"started", "not_remote_prefill" or "missing:<field>". Raises
        ``TrackError``."""
    def on_request_finished(self, request_id: str) -> bool: ...
    def on_transfer_complete(self, request_id: str) -> bool: ...
    def encode_plan(self, now: float) -> bytes: ...
    def apply_outcomes(self, msg: Buffer) -> list[tuple[str, str]]:
        """Decided requests as (request_id, verdict). Raises ``IpcError``."""
    @property
    def tracked(self) -> int: ...
    def counters(self) -> dict[str, int]: ...

class SlotChecker:
    """D's post-READ lease check over reads that Python performs."""

    def __init__(
        self, config: LeaseConfig, capacity: int, max_peers: int, name: str = "kvlease-d"
    ) -> None: ...
    def add_peer(self, agent_name: str, slot_count: int) -> int: ...
    def remove_peer(self, peer: int) -> None: ...
    def landing_regions(self) -> list[tuple[int, int]]:
        """(address, nbytes) of the buffers slot READs land in."""
    def submit(
        self, token: int, slot: Optional[int], nonce_value: Optional[int], peers: Sequence[int]
    ) -> None:
        """Raises ``VerifyError`` when refused: fail the load."""
    def step(self, now: float) -> list[tuple[int, str]]:
        """(token, verdict) of every decided check."""
    def take_reads(self) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """(xfer, peer, [(local_address, remote_offset, nbytes)])."""
    def complete(self, xfer: int, ok: bool, error: Optional[str] = None) -> bool: ...
    @property
    def waiting(self) -> int: ...
    def counters(self) -> dict[str, int]: ...

PushEnd = Literal["written", "refused", "ended_by_p", "lapsed", "revoked"]
Refusal = Literal["request_gone", "no_clock", "past_deadline", "exhausted", "already_ended", "duplicate"]

class PushConfig:
    """Push mode's guard settings; the same on D and P."""

    def __init__(
        self,
        duration: float,
        *,
        capacity: Optional[int] = None,
        extension: Optional[float] = None,
        heartbeat_interval: Optional[float] = None,
        write_bound: Optional[float] = None,
        post_margin: Optional[float] = None,
        drift_ppm: Optional[int] = None,
        max_message_len: Optional[int] = None,
    ) -> None:
        """Defaults from ``duration``: extension 2/3, interval 1/6, write bound
        10 s, post margin 1 s, 100 ppm, 1,024 registrations, 64 KiB messages.
        Raises ``ConfigError``."""
    @property
    def capacity(self) -> int: ...
    @property
    def duration(self) -> float: ...
    @property
    def extension(self) -> float: ...
    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def write_bound(self) -> float: ...
    @property
    def hold_bound(self) -> float: ...
    @property
    def post_margin(self) -> float: ...
    @property
    def drift_ppm(self) -> int: ...
    @property
    def max_message_len(self) -> int: ...

class ClockEstimate:
    """P's estimate of one D's clock, from round trips."""

    def __init__(self, drift_ppm: int = 100) -> None: ...
    def observe(
        self, local_send: float, remote: float, local_recv: float
    ) -> Literal["adopted", "kept", "refused"]: ...
    @property
    def has_sample(self) -> bool: ...
    def to_local(self, remote: float) -> Optional[float]: ...
    @property
    def offset(self) -> Optional[float]: ...
    def bound(self, now: float) -> Optional[float]: ...

class PushPermits:
    """D's write permits: one per registration, ended exactly once."""

    def __init__(self, config: PushConfig, seed: Optional[int] = None) -> None: ...
    def register(self, peer: int, now: float) -> tuple[int, int, bytes]:
        """(slot, nonce, field): send ``field`` with the registration. Raises
        ``PushError`` (``Exhausted``): fail the load, do not register."""
    def revoke(self, slot: int, nonce: int) -> None:
        """Keep the blocks until the permit is reported ended."""
    def on_message(
        self, peer: int, msg: Buffer, now: float
    ) -> list[tuple[int, int, int, PushEnd]]:
        """Permits ended, as (slot, nonce, peer, end). Raises ``WireError``."""
    def poll(
        self, now: float
    ) -> tuple[list[tuple[int, bytes]], list[tuple[int, int, int, PushEnd]]]:
        """((peer, message) to send to P, permits ended at their fence)."""
    def deadline(self, slot: int, nonce: int) -> Optional[float]: ...
    def fence(self, deadline: float) -> Optional[float]: ...
    @property
    def live(self) -> int: ...
    def peers_in_use(self) -> set[int]: ...
    def counters(self) -> dict[str, int]: ...

class WriteHandle:
    """P's name for one accepted registration (hashable)."""

class PushWrites:
    """P's registrations and the gate in front of each WRITE."""

    def __init__(self, config: PushConfig, hash_key: int) -> None: ...
    def register(
        self, peer: int, field: Buffer, request_live: bool, clock: ClockEstimate, now: float
    ) -> tuple[Optional[WriteHandle], Optional[Refusal]]:
        """(handle, None) when accepted, (None, reason) when refused, or
        (None, "duplicate") for a copy of a live registration held already.
        Raises ``WireError`` on a malformed field."""
    def begin_write(
        self, handle: WriteHandle, clock: ClockEstimate, now: float
    ) -> Optional[Literal["closed", "already_posted", "unknown_handle"]]:
        """None: post the WRITE now. Otherwise do not post."""
    def write_done(self, handle: WriteHandle, ok: bool, now: float) -> bool: ...
    def cancel(self, handle: WriteHandle) -> bool: ...
    def on_message(self, peer: int, msg: Buffer) -> None:
        """Renewals and revocations from D. Raises ``WireError``."""
    def poll(self, clocks: Mapping[int, ClockEstimate], now: float) -> list[tuple[int, bytes]]:
        """(peer, message) to send to D."""
    @property
    def held(self) -> int: ...
    def peers_in_use(self) -> set[int]: ...
    def counters(self) -> dict[str, int]: ...

def encode_outcomes(rank: int, seq: int, outcomes: Sequence[tuple[str, str]]) -> bytes: ...
def decode_outcomes(msg: Buffer) -> tuple[int, list[tuple[str, str]]]: ...
def read_done_form(peer_has_lease_slots: bool) -> Literal["plain", "with_nonce"]: ...
def encode_read_done(
    request_id: str, consumers: int, nonce_value: Optional[int], peer_has_lease_slots: bool
) -> bytes: ...
def encode_heartbeats(ids: Sequence[str], max_len: int = 65536) -> list[bytes]: ...
def encode_compact_heartbeats(
    entries: Iterable[tuple[int, int]], max_len: int = 65536, packed: bool = False
) -> list[bytes]:
    """``HBC:`` messages (``HBP:`` with ``packed``) renewing every ``(slot,
    nonce)``, none over ``max_len`` bytes; only for peers whose advert
    accepts that form. Raises ``WireError`` for a nonce of 0 or a
    ``max_len`` under one record and the prefix (28 bytes, packed 20)."""
def decode_notification(
    msg: Buffer,
) -> (
    tuple[Literal["heartbeat"], list[str]]
    | tuple[Literal["compact", "packed"], list[tuple[int, int]]]
    | tuple[Literal["read_done"], str, int, Optional[int]]
): ...
def lease_advert(
    address: int,
    nbytes: int,
    count: int,
    compact_heartbeats: bool = False,
    packed_heartbeats: bool = False,
) -> bytes: ...
def decode_lease_advert(advert: Buffer) -> Optional[tuple[int, int, int]]: ...
def advert_accepts_compact_heartbeats(advert: Buffer) -> bool:
    """Whether the advert's worker renews on ``HBC:``. Raises ``WireError``."""
def advert_accepts_packed_heartbeats(advert: Buffer) -> bool:
    """Whether the advert's worker renews on ``HBP:``. Raises ``WireError``."""
