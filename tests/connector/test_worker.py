"""The worker half on real CPU tensors and real stores (``memory://``, ``faulty+memory://``)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.metadata import (
    BlockRef,
    HybridStoreMetadata,
    LoadJob,
    LoadResult,
    SaveJob,
    SaveOutcome,
    SaveResult,
)
from hybridkv.connector.vllm_geometry import resolve_geometry
from hybridkv.connector.worker.side import WorkerSide
from hybridkv.lifecycle import EntryId, LoadOutcome
from hybridkv.store import open_store
from hybridkv_dev.devkit.cluster import kv_cache_config
from support.worker import make_worker, wait_loads

pytestmark = pytest.mark.vllm

H1, H2 = b"\x01" * 32, b"\x02" * 32


def test_save_then_load_moves_exact_block_bytes(vllm_objs: dict[str, Any]) -> None:
    url = f"memory://w-{uuid.uuid4().hex[:8]}"
    ws, caches, scheme = make_worker(vllm_objs, url)
    try:
        save = SaveJob(1, "r", (BlockRef(0, 0, 0, 3, H1, 32), BlockRef(1, 1, 0, 5, H2, 32)))
        ws.enqueue_saves(HybridStoreMetadata(scheme=scheme, saves=[save]))
        ws.flush()
        wm = ws.worker_meta()
        assert wm is not None and wm.saves_done == {1: [0]}
        assert sorted(wm.saves[1]) == [
            SaveResult(EntryId(0, 0, 0, 32), SaveOutcome.OK),
            SaveResult(EntryId(0, 1, 0, 32), SaveOutcome.OK),
        ]
        store = open_store(url)
        assert all(s.is_ok for s in store.exists([scheme.key(0, 0, H1), scheme.key(1, 0, H2)]))
        assert not store.exists([scheme.key(0, 1, H1)])[0].is_ok  # rank 1's entry is rank 1's to write

        assert not torch.equal(caches["attn.0"][7], caches["attn.0"][3])
        load = LoadJob("r", 32, (BlockRef(0, 0, 0, 7, H1, 32), BlockRef(1, 1, 0, 9, H2, 32)))
        ws.start_load(HybridStoreMetadata(scheme=scheme, loads=[load]))
        assert wait_loads(ws) == ({"r"}, set())
        assert torch.equal(caches["attn.0"][7], caches["attn.0"][3])
        assert torch.equal(caches["mamba.0"][9], caches["mamba.0"][5])
        wm = ws.worker_meta()
        assert wm is not None and sorted(wm.loads["r"]) == [
            LoadResult(EntryId(0, 0, 0, 32), LoadOutcome.OK),
            LoadResult(EntryId(0, 1, 0, 32), LoadOutcome.OK),
        ]
        assert ws.stats.totals["load_bytes"] == 16 * 64 * 2 + 256
        assert ws.stats.totals["load_job_seconds"] > 0, "the load thread's time per job is exported"
    finally:
        ws.shutdown()


@pytest.mark.parametrize("fault", ["get_fail=1", "corrupt=1"])
def test_failed_or_corrupt_load_is_reported_per_request(vllm_objs: dict[str, Any], fault: str) -> None:
    url = f"faulty+memory://w-{uuid.uuid4().hex[:8]}?{fault}&seed=1"
    ws, _, scheme = make_worker(vllm_objs, url)
    try:
        if fault == "corrupt=1":  # corrupt needs stored bytes to damage
            ws.enqueue_saves(
                HybridStoreMetadata(scheme=scheme, saves=[SaveJob(1, "r", (BlockRef(0, 0, 0, 3, H1, 32),))])
            )
            ws.flush()
        ws.start_load(
            HybridStoreMetadata(scheme=scheme, loads=[LoadJob("r", 32, (BlockRef(0, 0, 0, 7, H1, 32),))])
        )
        done, failed = wait_loads(ws)
        assert done == {"r"} and failed == {"r"}  # failed is reported AND finished (vLLM's contract)
        wm = ws.worker_meta()
        assert wm is not None and [res.outcome for res in wm.loads["r"]] != [LoadOutcome.OK]
        assert ws.stats.totals["load_failed_keys"] == 1
    finally:
        ws.shutdown()


def test_backpressure_drops_a_wave_instead_of_stalling(vllm_objs: dict[str, Any]) -> None:
    url = f"faulty+memory://w-{uuid.uuid4().hex[:8]}?delay_ms=300"
    ws, _, scheme = make_worker(vllm_objs, url, put_wave_bytes=1)  # budget: 4 bytes in flight
    try:
        jobs = [
            SaveJob(1, "r", (BlockRef(0, 0, 0, 3, H1, 32),)),
            SaveJob(2, "r", (BlockRef(0, 0, 1, 4, H2, 64),)),
        ]
        t0 = time.monotonic()
        ws.enqueue_saves(HybridStoreMetadata(scheme=scheme, saves=jobs))
        assert time.monotonic() - t0 < 0.2, "enqueueing must not wait for the store"
        ws.flush()
        wm = ws.worker_meta()
        assert wm is not None and sorted(wm.saves_done) == [1, 2]  # a dropped job still finishes (unpins)
        assert wm.saves[2] == [SaveResult(EntryId(0, 0, 1, 64), SaveOutcome.DROPPED)]
        assert ws.stats.totals["put_wave_drops"] == 1
    finally:
        ws.shutdown()


def test_list_of_tensors_and_non_contiguous_pages_round_trip(vllm_objs: dict[str, Any]) -> None:
    """A Mamba layer given as (conv, ssm) views, one of them strided: bytes still land exactly."""
    url = f"memory://w-{uuid.uuid4().hex[:8]}"
    vc = vllm_objs["vc"]
    kvc = kv_cache_config()
    ws = WorkerSide(vc, kvc, ConnectorConfig.from_extra_config({"store": url}, model="m"))
    gen = torch.Generator().manual_seed(1)
    conv = torch.randn(64, 2, 16, generator=gen).to(torch.bfloat16)
    ssm_storage = torch.randn(64, 8, 4, generator=gen)
    ssm = ssm_storage.transpose(1, 2)  # per-block pages are not contiguous: staged copies
    assert not ssm[0].is_contiguous()
    ws.register_kv_caches(
        {"attn.0": torch.zeros(64, 1, 16, 64, dtype=torch.bfloat16), "mamba.0": [conv, ssm]}
    )
    scheme = resolve_geometry(vc, kvc, "ns", check_vllm_sizes=True).scheme
    try:
        ws.enqueue_saves(
            HybridStoreMetadata(scheme=scheme, saves=[SaveJob(1, "r", (BlockRef(1, 1, 0, 5, H2, 32),))])
        )
        assert ws.flush()
        ws.start_load(
            HybridStoreMetadata(scheme=scheme, loads=[LoadJob("r", 32, (BlockRef(1, 1, 0, 9, H2, 32),))])
        )
        assert wait_loads(ws) == ({"r"}, set())
        assert torch.equal(conv[9], conv[5]) and torch.equal(ssm[9], ssm[5])
        assert ws.block_nbytes(1) == 2 * 16 * 2 + 8 * 4 * 4
    finally:
        ws.shutdown()


def test_sleep_mode_drains_then_refuses_to_touch_the_kv_cache(vllm_objs: dict[str, Any]) -> None:
    """vLLM 0.33 sleep hooks: queued saves are written before the memory goes; while asleep loads fail
    (the request recomputes) and saves are dropped; after wake-up loads move bytes again."""
    url = f"memory://w-{uuid.uuid4().hex[:8]}"
    ws, caches, scheme = make_worker(vllm_objs, url)
    try:
        save = SaveJob(1, "r", (BlockRef(0, 0, 0, 3, H1, 32),))
        ws.enqueue_saves(HybridStoreMetadata(scheme=scheme, saves=[save]))
        assert ws.suspend(timeout=10)
        wm = ws.worker_meta()
        assert wm is not None and wm.saves[1][0].outcome is SaveOutcome.OK, (
            "a save queued before sleep is written"
        )
        expected = caches["attn.0"][3].clone()
        caches["attn.0"][7].zero_()
        load = LoadJob("asleep", 32, (BlockRef(0, 0, 0, 7, H1, 32),))
        ws.start_load(HybridStoreMetadata(scheme=scheme, loads=[load]))
        done, failed = wait_loads(ws)
        assert done == {"asleep"} and failed == {"asleep"}
        assert not caches["attn.0"][7].any(), "nothing is written into released KV memory"
        ws.enqueue_saves(
            HybridStoreMetadata(scheme=scheme, saves=[SaveJob(2, "r2", (BlockRef(0, 0, 1, 4, H2, 32),))])
        )
        wm = ws.worker_meta()
        assert wm is not None and wm.saves[2][0].outcome is SaveOutcome.DROPPED
        ws.resume()
        ws.start_load(
            HybridStoreMetadata(scheme=scheme, loads=[LoadJob("awake", 32, (BlockRef(0, 0, 0, 7, H1, 32),))])
        )
        done, failed = wait_loads(ws)
        assert done == {"awake"} and failed == set()
        assert torch.equal(caches["attn.0"][7], expected)
    finally:
        ws.shutdown()


def test_split_read_puts_every_share_in_its_blocks_and_profiles_the_job(
    vllm_objs: dict[str, Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch read by the load thread and a helper reader at once (the split threshold lowered to 0):
    every block gets its own key's bytes, a key missing from the helper's share fails only its block,
    and the job's phases are timed (worker and file store)."""
    import threading

    from hybridkv.connector.worker import load_pipeline
    from hybridkv.connector.worker.load_probe import LoadProbe
    from hybridkv.store.file.probe import ReadProbe

    monkeypatch.setattr(load_pipeline, "SPLIT_READ_MIN_BYTES", 0)
    url = f"file://{tmp_path}/store?capacity=64MiB"
    ws, caches, scheme = make_worker(vllm_objs, url)
    try:
        hashes = [bytes([i + 1]) * 32 for i in range(10)]
        src = list(range(1, 11))
        dst = list(range(21, 31))
        save = SaveJob(
            1, "r", tuple(BlockRef(0, 0, i, b, h, 32) for i, (b, h) in enumerate(zip(src, hashes)))
        )
        ws.enqueue_saves(HybridStoreMetadata(scheme=scheme, saves=[save]))
        assert ws.flush()
        # The 8th key (in the helper's share: keys 5..9) is gone before the load.
        store = open_store(url)
        assert store.remove([scheme.key(0, 0, hashes[7])])[0].is_ok
        store.close()
        readers: set[str] = set()
        backend = ws.store.backend  # type: ignore[attr-defined]
        read = backend.get_frames_verified

        def spy(*args: Any) -> Any:  # records which threads read; the real read does the work
            readers.add(threading.current_thread().name)
            return read(*args)

        monkeypatch.setattr(backend, "get_frames_verified", spy)
        untouched = caches["attn.0"][28].clone()
        probe = LoadProbe()
        ws.install_load_probe(probe)
        read_probe = ReadProbe()
        backend.install_read_probe(read_probe)
        load = LoadJob(
            "r", 32, tuple(BlockRef(0, 0, i, b, h, 32) for i, (b, h) in enumerate(zip(dst, hashes)))
        )
        ws.start_load(HybridStoreMetadata(scheme=scheme, loads=[load]))
        assert wait_loads(ws) == ({"r"}, {"r"})
        assert len(readers) == 2 and any(name.startswith("hybridkv-read") for name in readers), readers
        for i, (s, d) in enumerate(zip(src, dst)):
            if i == 7:
                assert torch.equal(caches["attn.0"][d], untouched), "a missing key must leave its page alone"
            else:
                assert torch.equal(caches["attn.0"][d], caches["attn.0"][s]), f"block {d} has other bytes"
        wm = ws.worker_meta()
        assert wm is not None
        outcomes = {res.entry.block_index: res.outcome for res in wm.loads["r"]}
        assert outcomes == {i: (LoadOutcome.MISSING if i == 7 else LoadOutcome.OK) for i in range(10)}
        timings = probe.totals()
        assert timings["jobs"] == 1 and timings["store_s"] > 0 and timings["queue_s"] >= 0, timings
        assert timings["report_s"] > 0, "the report phase ends when transfer_results hands the job over"
        reads = read_probe.totals()
        assert (
            reads["keys"] == 10 and reads["read_s"] > 0 and 0 < reads["read_cpu_s"] <= reads["read_s"] + 1e-4
        ), reads
    finally:
        ws.shutdown()


def test_a_worker_that_cannot_read_its_tp_rank_fails_at_start(
    vllm_objs: dict[str, Any], tmp_path: Any
) -> None:
    """Inside a distributed environment a worker must read its TP rank: vLLM's world group is up but no
    tensor-parallel group (a rank it cannot read) fails ``register_kv_caches`` naming what it could not
    read, instead of loading and saving rank 0's entries; so does a group of another size than the
    config's. With no distributed environment at all (every other test here) it is rank 0."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    assert parallel_state._WORLD is None, "another test left vLLM's distributed environment up"
    with set_current_vllm_config(vllm_objs["vc"]):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{tmp_path}/init",
            local_rank=0,
            backend="gloo",
        )
        try:
            with pytest.raises(RuntimeError, match=r"cannot read this worker's tensor-parallel rank"):
                make_worker(vllm_objs, f"memory://w-{uuid.uuid4().hex[:8]}")
            # The groups up, but not the deployment the config describes (TP 2): a rank of the wrong group.
            parallel_state.initialize_model_parallel(1, 1, backend="gloo")
            with pytest.raises(RuntimeError, match=r"tensor-parallel group has 1 ranks, the config says 2"):
                make_worker(vllm_objs, f"memory://w-{uuid.uuid4().hex[:8]}")
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
