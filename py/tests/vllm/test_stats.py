"""kvlease's counters in vLLM's stats objects and Prometheus metrics:
aggregation across workers and the scheduler, the log line, the counters."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from kvlease.vllm import KvLeaseConnectorStats, KvLeaseNixlConnector
from kvlease.vllm.stats import LEASE_KEYS


def test_aggregate_and_reduce():
    a, b = KvLeaseConnectorStats(), KvLeaseConnectorStats()
    a.record_lease("kv_lease_verified")
    b.record_lease("kv_lease_verified", 2)
    b.record_lease("kv_lease_failed_checks")
    b.record_kv_expired_req()
    total = a.aggregate(b)
    out = total.reduce()
    assert out["KV loads verified"] == 3 and out["KV lease checks failed"] == 1
    assert out["Num KV expired reqs"] == 1
    assert not total.is_empty() and KvLeaseConnectorStats().is_empty()


def test_stats_rebuilt_by_the_connector_class_from_their_dict():
    s = KvLeaseConnectorStats()
    s.record_lease("kv_lease_granted", 4)
    rebuilt = KvLeaseNixlConnector.build_kv_connector_stats(s.to_dict())
    assert rebuilt.reduce()["KV leases granted"] == 4


def test_stock_data_keeps_vllms_log_line():
    stock = NixlKVConnectorStats()
    stock.record_failed_transfer()
    ours = KvLeaseNixlConnector.build_kv_connector_stats(stock.to_dict())
    assert ours.reduce() == stock.reduce()


def test_prometheus_counters():
    reg = CollectorRegistry()
    types = {
        Gauge: functools.partial(Gauge, registry=reg),
        Counter: functools.partial(Counter, registry=reg),
        Histogram: functools.partial(Histogram, registry=reg),
    }
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = KvLeaseNixlConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"]})
    s = KvLeaseConnectorStats()
    s.record_lease("kv_lease_failed_checks")
    s.record_lease("kv_lease_verified", 5)
    s.record_lease("kv_lease_unverified", 3)
    metrics.observe(s.to_dict(), 0)
    assert reg.get_sample_value("vllm:kv_lease_verified_loads_total", {"engine": "0"}) == 5
    assert reg.get_sample_value("vllm:kv_lease_failed_checks_total", {"engine": "0"}) == 1
    assert reg.get_sample_value("vllm:kv_lease_unverified_loads_total", {"engine": "0"}) == 3
    for _, name, _ in LEASE_KEYS.values():
        assert reg.get_sample_value(f"{name}_total", {"engine": "0"}) is not None
