"""The connector's face to vLLM: registration, constructor validation, geometry refusals, metadata, stats."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hybridkv.connector.metadata import HybridStoreWorkerMetadata, LoadResult, SaveOutcome, SaveResult
from hybridkv.connector.stats import HybridStoreStats
from hybridkv.lifecycle import EntryId, LoadOutcome
from hybridkv_dev.devkit.cluster import kv_cache_config

pytestmark = pytest.mark.vllm


def test_plugin_registers_once_and_module_path_resolves() -> None:
    import hybridkv.connector
    from hybridkv.connector.plugin import register
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    register()
    register()  # idempotent
    cls = KVConnectorFactory.get_connector_class_by_name("HybridStoreConnector")
    assert cls is hybridkv.connector.HybridStoreConnector
    via_path = KVConnectorFactory.get_connector_class(
        KVTransferConfig(
            kv_connector="HybridStoreConnector",
            kv_connector_module_path="hybridkv.connector",
            kv_role="kv_both",
        )
    )
    assert via_path is cls and supports_hma(cls)


@pytest.mark.parametrize(
    ("key", "value"), [("stoer", "memory://x"), ("put_wave_bytes", -1), ("store", "s3://bucket")]
)
def test_bad_extra_config_fails_connector_init_on_both_roles(
    vllm_objs: dict[str, Any], key: str, value: object
) -> None:
    from hybridkv.connector import HybridStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = vllm_objs["vc"]
    extra = vc.kv_transfer_config.kv_connector_extra_config
    saved = dict(extra)
    extra[key] = value
    try:
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(ValueError, match=key):
                HybridStoreConnector(vc, role, kv_cache_config())
    finally:
        extra.clear()
        extra.update(saved)


def test_sliding_window_under_dcp_is_refused_by_name(vllm_objs: dict[str, Any]) -> None:
    from hybridkv.connector import HybridStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec

    kvc = kv_cache_config()
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=32, dtype=torch.bfloat16, sliding_window=64
    )
    kvc = dataclasses.replace(kvc, kv_cache_groups=[kvc.kv_cache_groups[0], KVCacheGroupSpec(["swa.0"], swa)])
    with pytest.raises(ValueError, match=r"SlidingWindowSpec.*decode context parallelism \(dcp=2\)"):
        HybridStoreConnector(vllm_objs["vc"], KVConnectorRole.SCHEDULER, kvc)


def test_geometry_matches_vllm_and_is_logged_fields(vllm_objs: dict[str, Any]) -> None:
    from hybridkv.connector.vllm_geometry import resolve_geometry

    geo = resolve_geometry(vllm_objs["vc"], kv_cache_config(), "ns", check_vllm_sizes=True)
    d = geo.describe()
    assert d["hash_unit"] == 32 and d["hit_alignment"] == 32 and d["tp"] == 2 and d["dcp"] == 2
    assert [g.kind.value for g in geo.groups] == ["full", "mamba"] and [g.span for g in geo.groups] == [
        32,
        32,
    ]
    # A deployment with another DCP size (or namespace) can never read these keys.
    assert geo.scheme.key(0, 1, b"\x00" * 4).startswith(f"hkv1/ns/{geo.scheme.fingerprint}/g0/tp1/dcp1/")


def test_an_eagle_drafter_makes_lookups_drop_like_vllm_and_keeps_the_keys(vllm_objs: dict[str, Any]) -> None:
    """vLLM drops a hit's last block for an EAGLE / MTP drafter (``use_eagle_block_drop``): the geometry says
    so (its lookups follow vLLM's EAGLE rules, checked by ``tests/lifecycle/test_differential_vllm.py``);
    the key fingerprint does not change (the draft layer's pages, if any, change the layout already)."""
    from hybridkv.connector.vllm_geometry import resolve_geometry

    plain = resolve_geometry(vllm_objs["vc"], kv_cache_config(), "ns", check_vllm_sizes=True)
    vc = copy.copy(vllm_objs["vc"])
    object.__setattr__(vc, "speculative_config", SimpleNamespace(use_eagle_block_drop=lambda: True))
    eagle = resolve_geometry(vc, kv_cache_config(), "ns", check_vllm_sizes=True)
    assert eagle.scheme.geometry.eagle and not plain.scheme.geometry.eagle
    assert eagle.scheme.fingerprint == plain.scheme.fingerprint
    object.__setattr__(vc, "speculative_config", SimpleNamespace(use_eagle_block_drop=lambda: False))
    assert not resolve_geometry(vc, kv_cache_config(), "ns", check_vllm_sizes=True).scheme.geometry.eagle


def test_mismatched_hash_unit_fails_startup(vllm_objs: dict[str, Any]) -> None:
    from hybridkv.connector.vllm_geometry import resolve_geometry

    kvc = kv_cache_config()
    kvc.hash_block_size = 16
    with pytest.raises(ValueError, match="hashes every 16 tokens"):
        resolve_geometry(vllm_objs["vc"], kvc, "ns", check_vllm_sizes=True)


def test_worker_metadata_aggregate_merges_ranks() -> None:
    r0_ok = LoadResult(EntryId(0, 0, 0, 32), LoadOutcome.OK)
    r1_corrupt = LoadResult(EntryId(1, 0, 0, 32), LoadOutcome.CORRUPT)
    s1_ok = LoadResult(EntryId(1, 1, 2, 96), LoadOutcome.OK)
    saved = SaveResult(EntryId(0, 0, 0, 32), SaveOutcome.OK)
    a = HybridStoreWorkerMetadata(loads={"r": [r0_ok]}, saves={1: [saved]}, saves_done={1: [0]})
    b = HybridStoreWorkerMetadata(loads={"r": [r1_corrupt], "s": [s1_ok]}, saves_done={1: [1], 2: [1]})
    m = a.aggregate(b)
    assert m.loads == {"r": [r0_ok, r1_corrupt], "s": [s1_ok]}
    assert m.saves_done == {1: [0, 1], 2: [1]} and m.saves == {1: [saved]}
    assert a.loads == {"r": [r0_ok]}, "aggregate must not mutate its inputs"


def test_stats_roundtrip_through_a_dict() -> None:
    from hybridkv.connector import HybridStoreConnector

    s = HybridStoreStats()
    s.add("loaded_blocks.g0", 256)
    s.add("load_bytes", 1000)
    t = HybridStoreConnector.build_kv_connector_stats(s.to_dict())
    assert t is not None and not t.is_empty()
    t.aggregate(HybridStoreStats(data={"load_bytes": 24, "truncations": 1}))
    assert t.reduce() == {"loaded_blocks.g0": 256, "load_bytes": 1024, "truncations": 1}
    t.reset()
    assert t.is_empty()


def test_prometheus_counters_follow_the_stats(vllm_objs: dict[str, Any]) -> None:
    from hybridkv.connector import HybridStoreConnector
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    prom = HybridStoreConnector.build_prom_metrics(
        vllm_objs["vc"],
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    prom.observe({"lookups": 3, "load_bytes": 4096, "loaded_blocks.g1": 256, "truncations": 0})
    labels = {"model_name": "m", "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:hybridkv_lookups_total", labels) == 3
    assert REGISTRY.get_sample_value("vllm:hybridkv_load_bytes_total", labels) == 4096
    assert (
        REGISTRY.get_sample_value("vllm:hybridkv_group_loaded_blocks_total", {**labels, "group": "1"}) == 256
    )
    assert REGISTRY.get_sample_value("vllm:hybridkv_truncations_total", labels) == 0


def test_messages_survive_pickling_between_processes(vllm_objs: dict[str, Any]) -> None:
    """With TP > 1 the scheduler output (our metadata inside) and worker outputs cross process boundaries."""
    import pickle

    from hybridkv.connector.metadata import BlockRef, HybridStoreMetadata, LoadJob, SaveJob
    from hybridkv.connector.vllm_geometry import resolve_geometry

    scheme = resolve_geometry(vllm_objs["vc"], kv_cache_config(), "ns", check_vllm_sizes=True).scheme
    ref = BlockRef(0, 0, 1, 7, b"\x01" * 32, 64)
    meta = HybridStoreMetadata(
        scheme=scheme, loads=[LoadJob("r", 64, (ref,))], saves=[SaveJob(3, "r", (ref,))]
    )
    back = pickle.loads(pickle.dumps(meta))
    assert back == meta and back.scheme.key(0, 1, ref.block_hash) == scheme.key(0, 1, ref.block_hash)
    wm = HybridStoreWorkerMetadata(
        loads={"r": [LoadResult(ref.entry(1), LoadOutcome.OK)]},
        saves={3: [SaveResult(ref.entry(1), SaveOutcome.DROPPED)]},
        saves_done={3: [1]},
    )
    back_wm = pickle.loads(pickle.dumps(wm))
    assert back_wm == wm and back_wm.saves[3][0].outcome is SaveOutcome.DROPPED
