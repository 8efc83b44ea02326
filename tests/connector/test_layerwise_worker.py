"""The worker half in ``load_mode: layerwise`` on real CPU tensors and real stores: what one engine step sees
(``start_load_kv`` -> ``wait_for_layer_load`` per layer -> ``wait_for_save`` -> load errors), including the
paths an engine test cannot force: a store slower than the wait budget, a layer that never waits."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.metadata import BlockRef, HybridStoreMetadata, LoadJob, SaveJob, SaveOutcome
from hybridkv.connector.vllm_geometry import resolve_geometry
from hybridkv.connector.worker import layerwise
from hybridkv.connector.worker.side import WorkerSide
from hybridkv.lifecycle import LoadOutcome
from hybridkv_dev.devkit.cluster import kv_cache_config

pytestmark = pytest.mark.vllm

H1, H2 = b"\x01" * 32, b"\x02" * 32
ATTN = "attn.0"


def _worker(vllm_objs: dict[str, Any], store: str) -> tuple[WorkerSide, dict[str, torch.Tensor], Any]:
    vc = vllm_objs["vc"]
    kvc = kv_cache_config()
    cfg = ConnectorConfig.from_extra_config({"store": store, "load_mode": "layerwise"}, model="m")
    ws = WorkerSide(vc, kvc, cfg)
    gen = torch.Generator().manual_seed(0)
    caches = {
        ATTN: torch.randn(64, 1, 16, 64, generator=gen).to(torch.bfloat16),
        "mamba.0": torch.randint(-128, 127, (64, 1, 1, 256), generator=gen, dtype=torch.int8),
    }
    ws.register_kv_caches(caches)
    scheme = resolve_geometry(vc, kvc, "ns", check_vllm_sizes=True).scheme
    return ws, caches, scheme


def _store_blocks(ws: WorkerSide, scheme: Any) -> None:
    """Save attention blocks 3 (as H1) and 4 (as H2) through the worker's own save path."""
    save = SaveJob(1, "s", (BlockRef(0, 0, 0, 3, H1, 32), BlockRef(0, 0, 1, 4, H2, 64)))
    ws.enqueue_saves(HybridStoreMetadata(scheme=scheme, saves=[save]))
    assert ws.flush()
    ws.worker_meta()


def _load_meta(scheme: Any, **kw: Any) -> HybridStoreMetadata:
    job = LoadJob("r", 64, (BlockRef(0, 0, 0, 7, H1, 32), BlockRef(0, 0, 1, 8, H2, 64)))
    return HybridStoreMetadata(scheme=scheme, loads=[job], **kw)


def test_layer_waits_until_its_pages_are_written(vllm_objs: dict[str, Any]) -> None:
    ws, caches, scheme = _worker(vllm_objs, f"faulty+memory://lw-{uuid.uuid4().hex[:8]}?delay_ms=150")
    try:
        _store_blocks(ws, scheme)
        meta = _load_meta(scheme)
        t0 = time.monotonic()
        ws.start_load(meta)
        assert time.monotonic() - t0 < 0.1, "start_load_kv must not wait for the store"
        assert not torch.equal(caches[ATTN][7], caches[ATTN][3])  # not yet written
        ws.wait_for_layer("some.other.layer")  # no load writes it: returns at once
        assert time.monotonic() - t0 < 0.1
        ws.wait_for_layer(ATTN)
        assert time.monotonic() - t0 >= 0.14, "the layer waited for the store"
        assert torch.equal(caches[ATTN][7], caches[ATTN][3]) and torch.equal(caches[ATTN][8], caches[ATTN][4])
        assert ws._layerwise is not None and ws._layerwise.saves_allowed(meta)
        assert ws.end_layerwise_step() == set()
        assert ws.transfer_results() == (set(), set()), "synchronous loads are never in finished_recving"
        wm = ws.worker_meta()
        assert wm is not None and [r.outcome for r in wm.loads["r"]] == [LoadOutcome.OK] * 2
        assert ws.end_layerwise_step() == set(), "a step's verdict is reported once"
    finally:
        ws.shutdown()


def test_failed_load_reports_every_block_and_drops_the_steps_saves(vllm_objs: dict[str, Any]) -> None:
    ws, _, scheme = _worker(vllm_objs, f"memory://lw-{uuid.uuid4().hex[:8]}")
    try:
        # Only H1 is stored: the job's second block is missing (evicted since the lookup, say).
        ws.enqueue_saves(
            HybridStoreMetadata(scheme=scheme, saves=[SaveJob(1, "s", (BlockRef(0, 0, 0, 3, H1, 32),))])
        )
        assert ws.flush()
        ws.worker_meta()
        save = SaveJob(2, "r", (BlockRef(0, 0, 2, 9, b"\x03" * 32, 96),))
        meta = _load_meta(scheme, saves=[save])
        ws.start_load(meta)
        ws.wait_for_layer(ATTN)
        ws.enqueue_saves(meta)  # wait_for_save
        failed = ws.end_layerwise_step()
        wm = ws.worker_meta()
        assert wm is not None
        outcomes = [r.outcome for r in wm.loads["r"]]
        assert outcomes == [LoadOutcome.OK, LoadOutcome.MISSING], outcomes
        assert failed == {7, 8}, "every block of the failed job, not only the failed one"
        assert [r.outcome for r in wm.saves[2]] == [SaveOutcome.DROPPED] and wm.saves_done == {2: [0]}
    finally:
        ws.shutdown()


def test_a_store_slower_than_the_wait_budget_abandons_the_step(
    vllm_objs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layerwise, "LAYERWISE_WAIT_S", 0.2)
    ws, caches, scheme = _worker(vllm_objs, f"faulty+memory://lw-{uuid.uuid4().hex[:8]}?delay_ms=600")
    try:
        _store_blocks(ws, scheme)
        before = caches[ATTN][7].clone()
        t0 = time.monotonic()
        ws.start_load(_load_meta(scheme))
        ws.wait_for_layer(ATTN)
        assert ws.end_layerwise_step() == {7, 8}
        assert time.monotonic() - t0 < 0.5, "the engine waited past the budget"
        wm = ws.worker_meta()
        assert wm is not None and [r.outcome for r in wm.loads["r"]] == [LoadOutcome.TIMEOUT] * 2
        time.sleep(0.8)  # the store answers now: nothing may be written into the (recomputed) pages
        assert torch.equal(caches[ATTN][7], before)
        assert ws.stats.totals["layerwise_abandoned_steps"] == 1
    finally:
        ws.shutdown()


def test_a_layer_that_never_waited_fails_the_step(vllm_objs: dict[str, Any]) -> None:
    ws, _, scheme = _worker(vllm_objs, f"memory://lw-{uuid.uuid4().hex[:8]}")
    try:
        _store_blocks(ws, scheme)
        ws.start_load(_load_meta(scheme))
        time.sleep(0.2)  # the forward ran, its attention layer never called wait_for_layer_load
        assert ws.end_layerwise_step() == {7, 8}
        wm = ws.worker_meta()
        assert wm is not None and [r.outcome for r in wm.loads["r"]] == [LoadOutcome.TRANSPORT_ERROR] * 2
        assert ws.stats.totals["layerwise_unwaited_steps"] == 1
    finally:
        ws.shutdown()


def test_declined_hit_reports_its_blocks(vllm_objs: dict[str, Any]) -> None:
    ws, _, scheme = _worker(vllm_objs, f"memory://lw-{uuid.uuid4().hex[:8]}")
    try:
        ws.start_load(HybridStoreMetadata(scheme=scheme, loads=[LoadJob("r", 0, (), (5, 6))]))
        assert ws.end_layerwise_step() == {5, 6}
        assert ws.worker_meta() is None  # a declined hit has no entries to judge
    finally:
        ws.shutdown()


def _single_group_config() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["attn.0"], spec)]
    )


@pytest.mark.parametrize(
    ("config", "async_scheduling", "refusal"),
    [
        (kv_cache_config, False, "needs a model with one attention KV cache group, this model has 2"),
        (_single_group_config, True, "needs async scheduling off"),
        (_single_group_config, False, None),
    ],
)
def test_layerwise_is_refused_where_a_failure_could_not_be_discarded(
    config: Any, async_scheduling: bool, refusal: str | None
) -> None:
    from hybridkv.connector.connector import check_layerwise_supported

    if refusal is None:
        check_layerwise_supported(config(), async_scheduling)
        return
    with pytest.raises(ValueError, match=rf"\['load_mode'\]: 'layerwise' {refusal}"):
        check_layerwise_supported(config(), async_scheduling)
