"""What kvlease adds to vLLM's channels survives them, and a stock vLLM peer
reads a kvlease peer's handshake (and the other way round)."""

from __future__ import annotations

import pickle

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    NixlHandshakePayload,
)

import kvlease
from kvlease.vllm.metadata import STEP_ATTR, KvLeaseHandshakePayload, LeaseReports, LeaseStep


def test_stock_decoder_reads_a_kvlease_payload():
    advert = kvlease.lease_advert(0x1000, 4096, 512)
    wire = msgspec.msgpack.Encoder().encode(
        KvLeaseHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"md", kv_lease_advert=advert)
    )
    # What a stock vLLM D does with it (base_worker._nixl_handshake).
    stock = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(wire)
    assert type(stock) is NixlHandshakePayload
    assert (stock.compatibility_hash, stock.agent_metadata_bytes) == ("h", b"md")
    ours = msgspec.msgpack.Decoder(KvLeaseHandshakePayload).decode(wire)
    assert kvlease.decode_lease_advert(ours.kv_lease_advert) == (0x1000, 4096, 512)


def test_kvlease_decoder_reads_a_stock_payload_as_no_slots():
    wire = msgspec.msgpack.Encoder().encode(
        NixlHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"md")
    )
    ours = msgspec.msgpack.Decoder(KvLeaseHandshakePayload).decode(wire)
    assert ours.kv_lease_advert == b""
    assert isinstance(ours, NixlHandshakePayload)  # vLLM's isinstance check passes


def test_the_step_message_travels_with_vllms_metadata():
    meta = NixlConnectorMetadata()
    setattr(meta, STEP_ATTR, LeaseStep(directives=b"\x01\x02", read_fields={"r": (3, -5)}))
    back = pickle.loads(pickle.dumps(meta))
    step = getattr(back, STEP_ATTR)
    assert step.directives == b"\x01\x02" and step.read_fields == {"r": (3, -5)}


def test_reports_fold_across_ranks_in_order():
    a, b, c = LeaseReports([(0, b"x")]), LeaseReports([(1, b"y")]), LeaseReports()
    folded = a.aggregate(b).aggregate(c)
    assert folded.reports == [(0, b"x"), (1, b"y")]
    assert pickle.loads(pickle.dumps(folded)).reports == folded.reports
