"""The notification codec from Python: vLLM's forms byte for byte, and the
read-done form chosen from what the peer advertised."""

from __future__ import annotations

import pytest

import kvlease
from kvlease import WireError


def test_a_stock_peer_only_ever_gets_id_colon_consumers():
    assert kvlease.read_done_form(False) == "plain"
    msg = kvlease.encode_read_done("cmpl-a:0", 2, 0x5EED, False)
    assert msg == b"cmpl-a:0:2"
    # What vLLM 0.34's P does with it.
    req_id, count = msg.decode().rsplit(":", 1)
    assert (req_id, int(count)) == ("cmpl-a:0", 2)


def test_a_kvlease_peer_gets_the_nonce():
    msg = kvlease.encode_read_done("cmpl-a", 1, 0x5EED, True)
    assert msg == b"cmpl-a:1:nonce=0000000000005eed"
    assert kvlease.decode_notification(msg) == ("read_done", "cmpl-a", 1, 0x5EED)
    neg = kvlease.encode_read_done("cmpl-a", 1, -5, True)
    assert neg.endswith(b"fffffffffffffffb"), "int64 -5 as its 64 bits"
    assert kvlease.decode_notification(neg)[3] == -5


def test_heartbeats_are_vllms_and_split_to_the_limit():
    ids = [f"cmpl-{i:04d}" for i in range(100)]
    msgs = kvlease.encode_heartbeats(ids, max_len=256)
    assert len(msgs) > 1 and all(len(m) <= 256 for m in msgs)
    got = [i for m in msgs for i in kvlease.decode_notification(m)[1]]
    assert got == ids
    with pytest.raises(WireError):
        kvlease.encode_heartbeats(["a,b"])


def test_empty_pieces_are_skipped_as_vllm_does():
    assert kvlease.decode_notification(b"HB:a,,b,") == ("heartbeat", ["a", "b"])
