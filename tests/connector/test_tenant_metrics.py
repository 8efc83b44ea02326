"""Per-tenant metrics (hybridkv.connector.worker.tenant_metrics): a real worker's saves past a tenant's quota show
in its stats and in the exported Prometheus series; the labels stay bounded; ranks' reports aggregate."""

from __future__ import annotations

import functools
import re
import uuid
from typing import Any

import pytest
from hybridkv.connector.metadata import BlockRef, HybridStoreMetadata, SaveJob
from hybridkv.connector.stats import HybridStoreStats, StatsBox, build_prom, is_stat_name, with_gauges
from hybridkv.connector.vllm_geometry import resolve_geometry
from hybridkv.connector.worker.tenant_metrics import TenantMetrics
from hybridkv.store.quotas import OTHER_TENANTS, TenantCounters
from hybridkv_dev.devkit.cluster import kv_cache_config
from support.worker import make_worker

pytestmark = pytest.mark.vllm


def _exposition(data: dict[str, Any], vllm_objs: dict[str, Any]) -> str:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    metric_types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = build_prom(vllm_objs["vc"], metric_types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(data, 0)
    return generate_latest(registry).decode()


def _sample(exposition: str, series: str, **labels: str) -> float:
    """The value of the one sample of ``series`` whose labels include ``labels``."""
    found = []
    for match in re.finditer(rf"^{re.escape(series)}\{{([^}}]*)\}} (\S+)$", exposition, flags=re.MULTILINE):
        sample_labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(sample_labels.get(k) == v for k, v in labels.items()):
            found.append(float(match.group(2)))
    assert len(found) == 1, f"{series}{labels}: {found} in\n{exposition}"
    return found[0]


def test_saves_past_a_quota_show_per_tenant(vllm_objs: dict[str, Any]) -> None:
    """Tenant ``ns`` may hold two attention entries: six saves evict four by its quota. Tenant ``tiny``'s
    quota is smaller than one entry: its saves are refused. Both show in the worker's stats and series."""
    probe, _, _ = make_worker(vllm_objs, f"memory://probe-{uuid.uuid4().hex[:8]}")
    value_bytes = probe.block_nbytes(0)
    probe.shutdown()
    framed = value_bytes + 200  # header and key, generously
    quota = 2 * framed
    url = f"memory://tenants-{uuid.uuid4().hex[:8]}?quotas=ns:{quota},tiny:{value_bytes // 2}"
    ws, _, scheme = make_worker(vllm_objs, url)
    tiny = resolve_geometry(vllm_objs["vc"], kv_cache_config(), "tiny", check_vllm_sizes=True).scheme
    try:
        assert ws.gauges()["tenant_usage_bytes.ns"] == 0
        ws.stats.take()
        for index in range(6):
            block = BlockRef(0, 0, 0, index, bytes([index + 1]) * 32, 32)
            ws.enqueue_saves(
                HybridStoreMetadata(scheme=scheme, saves=[SaveJob(index, f"r{index}", (block,))])
            )
            assert ws.flush(), "the save job never ended"
        refused = BlockRef(0, 0, 0, 9, b"\x09" * 32, 32)
        ws.enqueue_saves(HybridStoreMetadata(scheme=tiny, saves=[SaveJob(9, "t", (refused,))]))
        assert ws.flush()
        ws._tenant_metrics._next_read = float("-inf")  # read now, not a second after the last read
        gauges = ws.gauges()
        taken = ws.stats.take()
        assert taken is not None
        data = {**taken.data, **gauges}
        usage = data["tenant_usage_bytes.ns"]
        assert 0 < usage <= quota and usage >= value_bytes
        assert data["tenant_quota_evicted.ns"] == 4
        assert data.get("tenant_capacity_evicted.ns", 0) == 0
        assert data["tenant_refused_puts.tiny"] == 1
        assert data["tenant_usage_bytes.tiny"] == 0
        assert data["tenant_usage_bytes._other"] == 0
        exposition = _exposition(data, vllm_objs)
        assert _sample(exposition, "vllm:hybridkv_tenant_usage_bytes", tenant="ns") == usage
        evicted = "vllm:hybridkv_tenant_evicted_entries_total"
        assert _sample(exposition, evicted, tenant="ns", reason="quota") == 4
        assert _sample(exposition, "vllm:hybridkv_tenant_refused_puts_total", tenant="tiny") == 1
        # The counters are increments: nothing new, nothing sent.
        ws._tenant_metrics._next_read = float("-inf")
        ws.gauges()
        again = ws.stats.take()
        assert again is None or not any(k.startswith("tenant_") and v for k, v in again.data.items())
    finally:
        ws.shutdown()


class _Counting:
    """A store stand-in with tenant counters (what ``tenant_counters_of`` looks for)."""

    def __init__(self) -> None:
        self.counters: dict[str, TenantCounters] = {}

    def tenant_counters(self) -> dict[str, TenantCounters]:
        return dict(self.counters)


def test_labels_are_bounded_and_a_dropped_tenant_goes_to_zero_once() -> None:
    box = StatsBox()
    now = [0.0]
    metrics = TenantMetrics(box, interval_s=1.0, max_tenants=2, clock=lambda: now[0])
    store = _Counting()
    store.counters = {
        "a": TenantCounters(100, usage_bytes=10, num_quota_evicted=1),
        "b": TenantCounters(100, usage_bytes=20, num_refused_puts=2),
        "c": TenantCounters(100, usage_bytes=30, num_capacity_evicted=3),
        OTHER_TENANTS: TenantCounters(0, usage_bytes=5, num_capacity_evicted=1),
    }
    assert metrics.gauges(store) == {
        "tenant_usage_bytes.a": 10,
        "tenant_usage_bytes.b": 20,
        "tenant_usage_bytes._other": 35,  # c (past the label bound) and the rest
    }
    taken = box.take()
    assert taken is not None
    assert {k: v for k, v in taken.data.items() if v} == {
        "tenant_quota_evicted.a": 1,
        "tenant_refused_puts.b": 2,
        "tenant_capacity_evicted._other": 4,
    }
    assert all(is_stat_name(key) for key in taken.data)
    store.counters["a"] = TenantCounters(100, usage_bytes=12, num_quota_evicted=5)
    assert metrics.gauges(store)["tenant_usage_bytes.a"] == 10, "read again within the interval"
    now[0] = 1.5
    del store.counters["b"]
    store.counters["c"] = TenantCounters(100, usage_bytes=30, num_capacity_evicted=4)
    assert metrics.gauges(store) == {
        "tenant_usage_bytes.a": 12,
        "tenant_usage_bytes.b": 0,  # its quota was dropped: 0, this once
        "tenant_usage_bytes.c": 30,  # the label b left is c's now
        "tenant_usage_bytes._other": 5,
    }
    taken = box.take()
    assert taken is not None
    # c's 3 earlier evictions were counted under _other: only its new one is c's
    assert {k: v for k, v in taken.data.items() if v} == {
        "tenant_quota_evicted.a": 4,
        "tenant_capacity_evicted.c": 1,
    }
    now[0] = 3.0
    assert "tenant_usage_bytes.b" not in metrics.gauges(store)
    assert TenantMetrics(StatsBox()).gauges(object()) == {}, "a store without quotas sends nothing"


def test_ranks_keep_the_largest_usage_and_sum_the_counters() -> None:
    rank0 = with_gauges(HybridStoreStats(data={"tenant_quota_evicted.ns": 2}), {"tenant_usage_bytes.ns": 900})
    rank1 = with_gauges(HybridStoreStats(data={"tenant_quota_evicted.ns": 3}), {"tenant_usage_bytes.ns": 400})
    assert rank0 is not None and rank1 is not None
    assert rank0.aggregate(rank1).data == {"tenant_quota_evicted.ns": 5, "tenant_usage_bytes.ns": 900}
    zeros = with_gauges(None, {"tenant_usage_bytes.ns": 0})
    assert zeros is not None and not zeros.is_empty()
    for bad in ("tenant_usage_bytes.", "tenant_usage_bytes.a/b", "tenant_usage_bytes", "tenant_nope.ns"):
        assert not is_stat_name(bad), bad
