"""Fast checks of what ``/metrics`` is built from: the stats object and ``build_prom`` (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.vllm]


def test_breaker_gauge_survives_vllms_empty_check_and_follows_the_latest_state() -> None:
    from hybridkv.connector.stats import HybridStoreStats

    closed = HybridStoreStats(data={"breaker_open": 0})
    assert not closed.is_empty(), "a state report of 0 must still reach the metrics (vLLM drops empty stats)"
    assert HybridStoreStats(data={"lookups": 0}).is_empty()
    agg = HybridStoreStats(data={"lookups": 2, "breaker_open": 1}).aggregate(closed)
    assert agg.data == {"lookups": 2, "breaker_open": 0}


def test_prom_exports_counters_per_group_hits_and_the_breaker_gauge() -> None:
    from hybridkv.connector import HybridStoreConnector
    from hybridkv.connector.connector import hit_source
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()  # what vLLM's stat logger does before building its metrics
    prom = HybridStoreConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["model_name", "engine"],
        {0: ["unit-m", "0"]},
    )
    labels = {"model_name": "unit-m", "engine": "0"}
    try:
        assert REGISTRY.get_sample_value("vllm:hybridkv_breaker_open", labels) == 0
        prom.observe({"hit_tokens": 256, "loaded_blocks.g0": 256, "loaded_blocks.g1": 256, "breaker_open": 1})
        assert REGISTRY.get_sample_value("vllm:hybridkv_hit_tokens_total", labels) == 256
        assert (
            REGISTRY.get_sample_value("vllm:hybridkv_group_loaded_blocks_total", {**labels, "group": "1"})
            == 256
        )
        assert REGISTRY.get_sample_value("vllm:hybridkv_breaker_open", labels) == 1
        prom.observe({"breaker_open": 0, "put_wave_drops": 2})
        assert REGISTRY.get_sample_value("vllm:hybridkv_breaker_open", labels) == 0
        assert REGISTRY.get_sample_value("vllm:hybridkv_put_wave_drops_total", labels) == 2
    finally:
        unregister_vllm_metrics()
    assert hit_source("file:///x") is CacheHitSource.DISK
    assert hit_source("faulty+file:///x?get_fail=1") is CacheHitSource.DISK
    assert hit_source("memory://") is CacheHitSource.HOST
    assert hit_source("mooncake://127.0.0.1:50051") is CacheHitSource.EXTERNAL_UNSPECIFIED
