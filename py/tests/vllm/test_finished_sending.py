"""P's scheduler hands vLLM's scheduler only the ``finished_sending`` ids it
waits for (``PrefillLeases.release``): vLLM asserts that each is still a
request and frees its blocks, so an id too many kills the engine (issue 28,
3.1; the end-to-end case is ``test_e2e.py``'s rescheduled request)."""

from __future__ import annotations

import time

import kvlease
from kvlease.vllm.prefill_leases import NONCE_KEY, SLOT_KEY, PrefillLeases

CONFIG = kvlease.LeaseConfig.parse({"kv_lease_duration": 6}, 64, 8)


def held_lease(p: PrefillLeases, rid: str, now: float) -> dict:
    """A request kvlease holds: scheduled, assigned, finished with its blocks kept."""
    p.on_scheduled(rid)
    p.assign_scheduled(now)
    params: dict = {}
    assert p.finished(rid, True, params, now) == "held"
    assert SLOT_KEY in params and NONCE_KEY in params
    return params


def test_only_ids_vllm_waits_for_pass_once_each():
    now = time.monotonic()
    p = PrefillLeases(CONFIG, 1, now)
    held_lease(p, "kv", now)
    # vLLM's own lease (kvlease never assigned one): its workers report it.
    assert p.finished("stock", True, {}, now) == "vllm"
    # Finished without blocks kept: vLLM freed them already, waits for nothing.
    assert p.finished("freed", False, {}, now) == "vllm"
    # A worker that took a late read-done for "kv" (held by kvlease), an id
    # vLLM freed at request_finished, and one nobody knows.
    out = p.release({"stock", "kv", "freed", "ghost"})
    assert out == {"stock"}
    assert p.unexpected_finished == 3
    # A second report of the same id (read-done and expiry in one step, or
    # two rounds) would free the blocks twice: dropped.
    assert not p.release({"stock"})
    assert p.unexpected_finished == 4


def test_kvleases_own_release_is_reported_once_with_vllms():
    now = time.monotonic()
    p = PrefillLeases(CONFIG, 1, now)
    held_lease(p, "kv", now)
    assert p.finished("stock", True, {}, now) == "vllm"
    p.cancel("kv")  # released with no rank report needed: a drain reports it
    p.drain_between_steps()
    assert p.release({"stock"}) == {"stock", "kv"}
    assert p.unexpected_finished == 0
    assert p.release(None) is None
