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


def test_compact_heartbeats_are_the_librarys_records_split_to_the_limit():
    entries = [(s, 0x5EED + s) for s in range(100)] + [(2**32 - 1, -5)]
    msgs = kvlease.encode_compact_heartbeats(entries, max_len=4 + 24 * 10)
    assert len(msgs) == 11 and all(len(m) <= 244 for m in msgs)
    assert msgs[0][:28] == b"HBC:" + b"00000000" + b"0000000000005eed"
    assert msgs[-1] == b"HBC:ffffffff" + b"fffffffffffffffb", "int64 -5 as its 64 bits"
    got = [e for m in msgs for e in kvlease.decode_notification(m)[1]]
    assert got == entries
    # One message by default (64 KiB holds 2,730 records), any iterable.
    assert len(kvlease.encode_compact_heartbeats(iter(entries))) == 1
    assert kvlease.encode_compact_heartbeats([]) == []


def test_packed_heartbeats_carry_the_same_records_in_16_bytes_each():
    entries = [(s, 0x5EED + s) for s in range(100)] + [(2**32 - 1, -5), (7, 0xFF)]
    msgs = kvlease.encode_compact_heartbeats(entries, max_len=4 + 16 * 10, packed=True)
    assert len(msgs) == 11 and all(len(m) <= 164 for m in msgs)
    assert msgs[-1][-16:] == b"G@@@@|O@" + b"@" * 8, "slot 7, nonce 0xff (wire-formats.md)"
    assert all(m.startswith(b"HBP:") and m.isascii() for m in msgs)
    kinds = {kvlease.decode_notification(m)[0] for m in msgs}
    assert kinds == {"packed"}
    assert [e for m in msgs for e in kvlease.decode_notification(m)[1]] == entries
    # 64 KiB holds 4,095 packed records; a message under one record is refused.
    assert len(kvlease.encode_compact_heartbeats(entries * 41, packed=True)) == 2  # 4,182
    with pytest.raises(WireError) as e:
        kvlease.encode_compact_heartbeats([(1, 7)], max_len=19, packed=True)
    assert e.value.reason == "MessageTooSmall"


def test_compact_heartbeats_refuse_what_no_lease_has_before_encoding():
    with pytest.raises(WireError) as e:
        kvlease.encode_compact_heartbeats([(1, 7), (2, 0)])
    assert e.value.reason == "ZeroNonce"
    with pytest.raises(WireError) as e:
        kvlease.encode_compact_heartbeats([(1, 7)], max_len=27)
    assert e.value.reason == "MessageTooSmall"
    # Out of range for the fields' types: the conversion refuses them.
    with pytest.raises(OverflowError):
        kvlease.encode_compact_heartbeats([(2**32, 7)])
    with pytest.raises(OverflowError):
        kvlease.encode_compact_heartbeats([(1, 2**63)])
    with pytest.raises(TypeError):
        kvlease.encode_compact_heartbeats([(1, "7")])
    # A huge max_len from outside asks for no huge buffer.
    assert len(kvlease.encode_compact_heartbeats([(1, 7)], max_len=2**62)) == 1


def test_the_advert_says_whether_the_rank_takes_compact_heartbeats():
    plain = kvlease.lease_advert(0x1000, 4096, 512)
    compact = kvlease.lease_advert(0x1000, 4096, 512, compact_heartbeats=True)
    assert kvlease.decode_lease_advert(plain) == kvlease.decode_lease_advert(compact)
    assert kvlease.advert_accepts_compact_heartbeats(plain) is False
    assert kvlease.advert_accepts_compact_heartbeats(compact) is True
    with pytest.raises(WireError):
        kvlease.advert_accepts_compact_heartbeats(compact[:31])


def test_the_advert_says_whether_the_rank_takes_packed_heartbeats():
    both = kvlease.lease_advert(
        0x1000, 4096, 512, compact_heartbeats=True, packed_heartbeats=True)
    hbc = kvlease.lease_advert(0x1000, 4096, 512, compact_heartbeats=True)
    assert kvlease.advert_accepts_packed_heartbeats(both) is True
    assert kvlease.advert_accepts_packed_heartbeats(hbc) is False
    assert kvlease.advert_accepts_compact_heartbeats(both) is True
    # A capability bit this build does not know is ignored, not refused.
    later = both[:5] + bytes([both[5] | 0x80]) + both[6:]
    assert kvlease.decode_lease_advert(later) == kvlease.decode_lease_advert(both)
    assert kvlease.advert_accepts_packed_heartbeats(later) is True
