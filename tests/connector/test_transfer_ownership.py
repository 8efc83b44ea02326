"""A buffer handed to a store call belongs to that call until it has really returned.

``faulty+memory://...?get_late=1`` / ``put_late=1`` answer ``TIMEOUT`` at once and complete the operation
``late_ms`` later, as an abandoned Mooncake call does; a late get then scribbles its destinations. These
tests watch the real KV tensors of a ``WorkerSide`` around that late completion.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import pytest
import torch
from connector_helpers import kv_cache_config
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.datapath import PinnedPool, StagingContext
from hybridkv.connector.metadata import (
    BlockRef,
    HybridStoreMetadata,
    LoadJob,
    SaveJob,
    SaveOutcome,
    SaveResult,
)
from hybridkv.connector.vllm_geometry import resolve_geometry
from hybridkv.connector.worker import WorkerSide
from hybridkv.lifecycle import EntryId, LoadOutcome
from hybridkv.store import open_store

pytestmark = pytest.mark.vllm

H1 = b"\x01" * 32
LATE_MS = 400


def _worker(
    vllm_objs: dict[str, Any], store: str, *, staging: StagingContext | None = None
) -> tuple[WorkerSide, dict[str, torch.Tensor], Any]:
    vc, kvc = vllm_objs["vc"], kv_cache_config()
    ws = WorkerSide(vc, kvc, ConnectorConfig.from_extra_config({"store": store}, model="m"))
    gen = torch.Generator().manual_seed(0)
    caches = {
        "attn.0": torch.randn(64, 1, 16, 64, generator=gen).to(torch.bfloat16),
        "mamba.0": torch.randint(-128, 127, (64, 1, 1, 256), generator=gen, dtype=torch.int8),
    }
    ws.register_kv_caches(caches, staging=staging)
    return ws, caches, resolve_geometry(vc, kvc, "ns", check_vllm_sizes=True).scheme


def _stored_block(scheme: Any, name: str, caches: dict[str, torch.Tensor]) -> None:
    """Save block 3 of group 0 under H1 into ``memory://name`` (through a plain worker)."""
    store = open_store(f"memory://{name}")
    store.put([scheme.key(0, 0, H1)], [caches["attn.0"][3].view(torch.uint8).reshape(-1).numpy()])


def _wait_report(ws: WorkerSide, timeout: float = 10.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = ws.transfer_results()
        if done:
            return done, failed
    raise AssertionError("the load was never reported")


def test_late_load_never_writes_kv_pages_after_its_report(vllm_objs: dict[str, Any]) -> None:
    name = f"late-{uuid.uuid4().hex[:8]}"
    ws, caches, scheme = _worker(vllm_objs, f"faulty+memory://{name}?get_late=1&late_ms={LATE_MS}")
    try:
        _stored_block(scheme, name, caches)
        ws.start_load(
            HybridStoreMetadata(scheme=scheme, loads=[LoadJob("r", 32, (BlockRef(0, 0, 0, 7, H1, 32),))])
        )
        t0 = time.monotonic()
        assert _wait_report(ws) == ({"r"}, {"r"})
        reported_after_s = time.monotonic() - t0
        page_at_report = caches["attn.0"][7].clone()
        time.sleep(LATE_MS / 1000 + 0.3)  # well past the late write
        # vLLM frees (and reuses) a failed request's blocks at the report: nothing may change them after.
        assert torch.equal(caches["attn.0"][7], page_at_report), "a late get wrote a reported page"
        assert reported_after_s >= LATE_MS / 1000 * 0.9
        assert ws.num_late_store_calls == 1
        wm = ws.worker_meta()
        assert wm is not None and [res.outcome for res in wm.loads["r"]] == [LoadOutcome.TIMEOUT]
    finally:
        ws.shutdown()


def test_late_load_keeps_its_staging_slab_until_the_call_returns(vllm_objs: dict[str, Any]) -> None:
    """The staged (CUDA) path, on CPU tensors: the request is failed at once, its slab is quarantined."""
    name = f"late-{uuid.uuid4().hex[:8]}"
    staging = StagingContext("cpu", PinnedPool(1 << 20, 3 << 20, pin=False))
    ws, caches, scheme = _worker(
        vllm_objs, f"faulty+memory://{name}?get_late=1&late_ms={LATE_MS}", staging=staging
    )
    try:
        _stored_block(scheme, name, caches)
        page_before = caches["attn.0"][7].clone()
        ws.start_load(
            HybridStoreMetadata(scheme=scheme, loads=[LoadJob("r", 32, (BlockRef(0, 0, 0, 7, H1, 32),))])
        )
        assert _wait_report(ws) == ({"r"}, {"r"})
        assert staging.pool.in_use == 1, "a slab a late get still writes went back to the pool"
        assert ws.flush(5.0)
        assert staging.pool.in_use == 0
        assert torch.equal(caches["attn.0"][7], page_before)  # the scribbled slab was never committed
    finally:
        ws.shutdown()


def test_late_put_keeps_the_save_job_and_its_pins_until_it_returned(vllm_objs: dict[str, Any]) -> None:
    name = f"late-{uuid.uuid4().hex[:8]}"
    ws, _, scheme = _worker(vllm_objs, f"faulty+memory://{name}?put_late=1&late_ms={LATE_MS}")
    try:
        save = SaveJob(1, "r", (BlockRef(0, 0, 0, 3, H1, 32),))
        ws.enqueue_saves(HybridStoreMetadata(scheme=scheme, saves=[save]))
        time.sleep(LATE_MS / 1000 / 2)  # the put has answered TIMEOUT but still reads the page
        wm = ws.worker_meta()
        assert wm is None or 1 not in wm.saves_done, "the job was reported (pins released) under a late put"
        assert ws.flush(5.0)
        wm = ws.worker_meta()
        assert (
            wm is not None
            and wm.saves_done == {1: [0]}
            and wm.saves[1] == [SaveResult(EntryId(0, 0, 0, 32), SaveOutcome.TIMEOUT)]
        )
        assert open_store(f"memory://{name}").exists([scheme.key(0, 0, H1)])[0].is_ok  # it did land, late
    finally:
        ws.shutdown()


def _save_of(scheme: Any, job_id: int, block_hash: bytes) -> HybridStoreMetadata:
    """A save job of the page in block 3 of group 0, keyed by ``block_hash``."""
    return HybridStoreMetadata(
        scheme=scheme, saves=[SaveJob(job_id, "s", (BlockRef(0, 0, 0, 3, block_hash, 32),))]
    )


def test_suspend_refuses_while_a_late_call_owns_kv_memory(vllm_objs: dict[str, Any]) -> None:
    name = f"late-{uuid.uuid4().hex[:8]}"
    ws, caches, scheme = _worker(vllm_objs, f"faulty+memory://{name}?get_late=1&late_ms={LATE_MS}")
    try:
        _stored_block(scheme, name, caches)
        ws.start_load(
            HybridStoreMetadata(scheme=scheme, loads=[LoadJob("r", 32, (BlockRef(0, 0, 0, 7, H1, 32),))])
        )
        time.sleep(0.05)  # the get has answered TIMEOUT; its write is still to come
        assert not ws.suspend(timeout=0.05), "sleep allowed while a late get may still write KV memory"
        # Refused: the worker stays awake and keeps serving (a save is admitted and written) ...
        ws.enqueue_saves(_save_of(scheme, 1, b"\x02" * 32))
        assert ws.suspend(timeout=5.0)
        # ... asleep, nothing reads the released KV memory (a save is dropped at once) ...
        ws.enqueue_saves(_save_of(scheme, 2, b"\x03" * 32))
        wm = ws.worker_meta()
        entry = EntryId(0, 0, 0, 32)
        assert wm is not None and wm.saves[1] == [SaveResult(entry, SaveOutcome.OK)], wm
        assert wm.saves[2] == [SaveResult(entry, SaveOutcome.DROPPED)], "a save ran while asleep"
        # ... and serving again after the wake-up.
        ws.resume()
        ws.enqueue_saves(_save_of(scheme, 3, b"\x04" * 32))
        assert ws.flush(5.0)
        wm = ws.worker_meta()
        assert wm is not None and wm.saves[3] == [SaveResult(entry, SaveOutcome.OK)], wm
    finally:
        ws.shutdown()


def test_connector_refuses_sleep_while_transfers_own_kv_memory(
    vllm_objs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridkv.connector import connector as connector_module
    from hybridkv.connector.connector import HybridStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    name = f"late-{uuid.uuid4().hex[:8]}"
    vc = vllm_objs["vc"]
    tc = dataclasses.replace(
        vc.kv_transfer_config,
        kv_connector_extra_config={"store": f"faulty+memory://{name}?get_late=1&late_ms={LATE_MS}"},
    )
    monkeypatch.setattr(vc, "kv_transfer_config", tc)
    monkeypatch.setattr(connector_module, "SUSPEND_TIMEOUT_S", 0.05)
    conn = HybridStoreConnector(vc, KVConnectorRole.WORKER, kv_cache_config())
    try:
        ws = conn.worker_side
        caches = {
            "attn.0": torch.zeros(64, 1, 16, 64, dtype=torch.bfloat16),
            "mamba.0": torch.zeros(64, 1, 1, 256, dtype=torch.int8),
        }
        conn.register_kv_caches(caches)
        scheme = resolve_geometry(vc, kv_cache_config(), "ns", check_vllm_sizes=True).scheme
        _stored_block(scheme, name, caches)
        ws.start_load(
            HybridStoreMetadata(scheme=scheme, loads=[LoadJob("r", 32, (BlockRef(0, 0, 0, 7, H1, 32),))])
        )
        time.sleep(0.05)
        with pytest.raises(RuntimeError, match="refusing to release it for sleep"):
            conn.unregister_kv_caches()
    finally:
        conn.shutdown()


def test_fail_policy_is_refused_at_start_for_hybrid_models(
    vllm_objs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridkv.connector.connector import HybridStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = vllm_objs["vc"]
    monkeypatch.setattr(
        vc, "kv_transfer_config", dataclasses.replace(vc.kv_transfer_config, kv_load_failure_policy="fail")
    )
    kvc = kv_cache_config()  # full attention + Mamba: hybrid
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="kv_load_failure_policy='fail' with a hybrid model"):
            HybridStoreConnector(vc, role, kvc)
    single = dataclasses.replace(kvc, kv_cache_groups=kvc.kv_cache_groups[:1])
    HybridStoreConnector(vc, KVConnectorRole.SCHEDULER, single).shutdown()  # one group: a warning only
