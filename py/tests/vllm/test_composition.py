"""kvlease inside vLLM's MultiConnector (issue 28, finding 3): a kvlease P
composed with another connector does not start, and says why; a kvlease D
may be composed; and MultiConnector can rebuild kvlease's stats by name."""

from __future__ import annotations

import pytest
from test_startup import build
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorStats,
)

from kvlease.vllm import KvLeaseConnectorStats


def as_child_of_a_multi_connector(monkeypatch, connector):
    multi = object.__new__(MultiConnector)
    multi._connectors = [connector, object()]
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", multi)
    return multi


@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_a_kvlease_p_inside_a_multi_connector_does_not_start(monkeypatch, role):
    c = build(role)
    as_child_of_a_multi_connector(monkeypatch, c)
    with pytest.raises(RuntimeError, match="inside vLLM's MultiConnector is not supported"):
        c.register_kv_caches({})


def test_a_kvlease_d_inside_a_multi_connector_is_not_refused(monkeypatch):
    c = build("kv_consumer")
    as_child_of_a_multi_connector(monkeypatch, c)
    called = []
    monkeypatch.setattr(type(c.connector_worker), "register_kv_caches",
                        lambda self, caches: called.append(caches))
    c.register_kv_caches({"layer0": None})
    assert called == [{"layer0": None}]


def test_a_p_with_verification_off_is_stock_and_may_be_composed(monkeypatch):
    c = build("kv_both", kv_lease_verification=False)
    as_child_of_a_multi_connector(monkeypatch, c)
    monkeypatch.setattr(type(c.connector_worker), "register_kv_caches", lambda self, caches: None)
    c.register_kv_caches({})


def test_multi_connector_rebuilds_kvlease_stats_by_class_name():
    # What vLLM's metrics do with stats that crossed a process boundary.
    stats = KvLeaseConnectorStats()
    stats.record_lease("kv_lease_verified", 3)
    rebuilt = MultiConnector.build_kv_connector_stats(
        data={"KvLeaseNixlConnector": stats.data}
    )
    assert isinstance(rebuilt, MultiKVConnectorStats)
    child = rebuilt["KvLeaseNixlConnector"]
    assert isinstance(child, KvLeaseConnectorStats)
    assert child.lease_total("kv_lease_verified") == 3
