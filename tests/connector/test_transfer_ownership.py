"""A buffer handed to a store call belongs to that call until it has really returned.

``faulty+memory://...?get_late=1`` / ``put_late=1`` answer ``TIMEOUT`` at once and complete the operation
``late_ms`` later, as an abandoned Mooncake call does; a late get then scribbles its destinations. These
tests watch the real KV tensors of a ``WorkerSide`` around that late completion (a ``late_ms`` far beyond
the test: a late call that never returns).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.datapath.movers import PinnedPool, StagingContext
from hybridkv.connector.metadata import (
    BlockRef,
    HybridStoreMetadata,
    LoadJob,
    SaveJob,
    SaveOutcome,
    SaveResult,
)
from hybridkv.connector.vllm_geometry import resolve_geometry
from hybridkv.connector.worker.ownership import MAX_QUARANTINED_BATCHES, may_answer_late
from hybridkv.connector.worker.side import WorkerSide
from hybridkv.lifecycle import EntryId, LoadOutcome
from hybridkv.store import open_store
from hybridkv.store.base import Status, register_late_call
from hybridkv.store.file import backend as file_module
from hybridkv_dev.devkit.cluster import kv_cache_config

pytestmark = pytest.mark.vllm

H1 = b"\x01" * 32
H2 = b"\x02" * 32
LATE_MS = 400
#: A late call that does not return while the test runs.
NEVER_MS = 600_000


def _worker(
    vllm_objs: dict[str, Any],
    store: str,
    *,
    staging: StagingContext | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[WorkerSide, dict[str, torch.Tensor], Any]:
    vc, kvc = vllm_objs["vc"], kv_cache_config()
    ws = WorkerSide(vc, kvc, ConnectorConfig.from_extra_config({"store": store, **(extra or {})}, model="m"))
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


def _stored_file_block(scheme: Any, url: str, caches: dict[str, torch.Tensor]) -> None:
    """Save block 3 of group 0 under H1 into the file store ``url``."""
    store = open_store(url)
    try:
        page = caches["attn.0"][3].view(torch.uint8).reshape(-1).numpy()
        assert store.put([scheme.key(0, 0, H1)], [page]) == [Status.OK]
    finally:
        store.close()


def _wait_report(ws: WorkerSide, timeout: float = 10.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = ws.transfer_results()
        if done:
            return done, failed
    raise AssertionError("the load was never reported")


def _load_of(scheme: Any, req_id: str, block_id: int = 7) -> HybridStoreMetadata:
    return HybridStoreMetadata(
        scheme=scheme, loads=[LoadJob(req_id, 32, (BlockRef(0, 0, 0, block_id, H1, 32),))]
    )


def _shutdown_returns(ws: WorkerSide, timeout: float) -> bool:
    """Whether ``ws.shutdown(timeout)`` returned (a 30 s hang guard, never a timing claim)."""
    closer = threading.Thread(target=ws.shutdown, args=(timeout,), daemon=True)
    closer.start()
    closer.join(30)
    return not closer.is_alive()


def test_late_load_that_never_returns_holds_nothing_on_the_host_path(vllm_objs: dict[str, Any]) -> None:
    """Host KV, a get that answers TIMEOUT and goes on for good: it was given a private buffer, never the
    pages, so the request is failed at once, sleep and flush are not held up, and shutdown returns."""
    name = f"late-{uuid.uuid4().hex[:8]}"
    ws, caches, scheme = _worker(vllm_objs, f"faulty+memory://{name}?get_late=1&late_ms={NEVER_MS}")
    _stored_block(scheme, name, caches)
    page_before = caches["attn.0"][7].clone()
    ws.start_load(_load_of(scheme, "r"))
    assert _wait_report(ws) == ({"r"}, {"r"})
    assert ws.store.backend.num_late_pending == 1  # type: ignore[attr-defined]  # reported under a late call
    assert ws.num_late_store_calls == 1
    wm = ws.worker_meta()
    assert wm is not None and [res.outcome for res in wm.loads["r"]] == [LoadOutcome.TIMEOUT]
    assert torch.equal(caches["attn.0"][7], page_before), "the late get's buffer was committed"
    assert ws.flush(5.0), "flush waited for a late call that owns no KV memory"
    assert ws.suspend(timeout=5.0), "sleep refused for a late call that owns no KV memory"
    ws.resume()
    assert not ws.wait_late_calls(0.05)  # ... but its buffer is still quarantined
    assert _shutdown_returns(ws, 1.0), "shutdown hung on a late call"


def test_hung_file_store_read_fails_the_load_within_its_deadline_and_holds_nothing(
    vllm_objs: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A ``file://`` read that hangs and never answers (a hung network file system; here the raw read
    blocks) under the store's own deadline (``timeout_ms``): the request is reported failed, its pages
    untouched, later loads still run, and shutdown returns while the read still hangs."""
    url = f"file://{tmp_path}/store?timeout_ms=200"
    ws, caches, scheme = _worker(vllm_objs, url)
    _stored_file_block(scheme, url, caches)
    release = threading.Event()
    real_read_all = file_module.read_all

    def hung_read_all(fd: int, parts: Sequence[memoryview], expected: int | None = None) -> int:
        assert release.wait(30), "never released"
        return real_read_all(fd, parts, expected)

    monkeypatch.setattr(file_module, "read_all", hung_read_all)
    try:
        page_before = caches["attn.0"][7].clone()
        ws.start_load(_load_of(scheme, "hung"))
        assert _wait_report(ws) == ({"hung"}, {"hung"}), "the load waited for the hung read"
        wm = ws.worker_meta()
        assert wm is not None and [res.outcome for res in wm.loads["hung"]] == [LoadOutcome.TIMEOUT]
        assert torch.equal(caches["attn.0"][7], page_before), "the hung read was handed the KV pages"
        assert ws.flush(5.0) and ws.suspend(timeout=5.0), "a hung read that owns no KV memory held sleep"
        ws.resume()
        monkeypatch.setattr(file_module, "read_all", real_read_all)  # the file system answers again
        ws.start_load(_load_of(scheme, "next", block_id=8))
        assert _wait_report(ws) == ({"next"}, set()), "a later load did not run"
        assert torch.equal(caches["attn.0"][8], caches["attn.0"][3])
        assert _shutdown_returns(ws, 1.0), "shutdown hung on the hung read"
        assert torch.equal(caches["attn.0"][7], page_before)
    finally:
        release.set()


def test_the_worker_asks_the_store_whether_itmay_answer_late(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Only a store that says it never answers late is handed KV pages; an object that does not say (a
    wrapper forwarding attributes to a store, or anything else) is assumed to."""
    name = f"late-{uuid.uuid4().hex[:8]}"
    assert not may_answer_late(open_store(f"memory://{name}"), "get")
    late_get = open_store(f"faulty+memory://{name}?get_late=1")
    assert may_answer_late(late_get, "get") and not may_answer_late(late_get, "put")
    assert not may_answer_late(open_store(f"faulty+memory://{name}?delay_ms=1"), "put")
    local = open_store(f"file://{tmp_path}/local")
    assert not may_answer_late(local, "get") and not may_answer_late(local, "put")
    monkeypatch.setattr(file_module, "directory_fstype", lambda _directory: "nfs4")
    on_nfs = open_store(f"file://{tmp_path}/nfs")
    assert may_answer_late(on_nfs, "get") and may_answer_late(on_nfs, "put")
    assert may_answer_late(open_store(f"faulty+file://{tmp_path}/nfs2"), "get")  # its inner store may

    class Forwarding:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, attribute: str) -> Any:
            return getattr(self.inner, attribute)

    assert may_answer_late(Forwarding(local), "get")
    assert may_answer_late(object(), "put")
    for store in (local, on_nfs):
        store.close()


def test_host_loads_fail_fast_once_too_many_batches_are_quarantined(vllm_objs: dict[str, Any]) -> None:
    name = f"late-{uuid.uuid4().hex[:8]}"
    ws, caches, scheme = _worker(vllm_objs, f"faulty+memory://{name}?get_late=1&late_ms={NEVER_MS}")
    _stored_block(scheme, name, caches)
    for n in range(MAX_QUARANTINED_BATCHES):
        ws.start_load(_load_of(scheme, f"r{n}"))
        assert _wait_report(ws) == ({f"r{n}"}, {f"r{n}"})
    assert ws.num_late_store_calls == MAX_QUARANTINED_BATCHES
    ws.start_load(_load_of(scheme, "over"))
    assert _wait_report(ws) == ({"over"}, {"over"})
    wm = ws.worker_meta()
    assert wm is not None and [res.outcome for res in wm.loads["over"]] == [LoadOutcome.NOT_ATTEMPTED]
    assert ws.num_late_store_calls == MAX_QUARANTINED_BATCHES, "a quarantined buffer too many was read into"
    assert ws.num_quarantine_refusals == 1
    pool = ws._ctx.host_buffers
    # Each late get kept its buffer (forfeited, out of the pool); each next load got a new one: bounded by
    # the quarantine, not by the pool.
    assert pool.num_forfeited == pool.num_allocated == MAX_QUARANTINED_BATCHES
    assert pool.num_reused == 0 and pool.pooled_bytes == 0
    assert _shutdown_returns(ws, 1.0)


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
        assert ws.wait_late_calls(5.0)
        assert staging.pool.in_use == 0
        assert torch.equal(caches["attn.0"][7], page_before)  # the scribbled slab was never committed
    finally:
        ws.shutdown()


def test_late_put_reads_a_private_copy_so_the_job_is_reported_at_once(vllm_objs: dict[str, Any]) -> None:
    """Host KV: a put that may answer late is given a copy of the pages. The job is reported (its pins
    released) while the put still runs, vLLM may then overwrite the page, and the late put stores the
    bytes the page had at the save."""
    name = f"late-{uuid.uuid4().hex[:8]}"
    late_ms = 5000
    ws, caches, scheme = _worker(vllm_objs, f"faulty+memory://{name}?put_late=1&late_ms={late_ms}")
    try:
        page_at_save = caches["attn.0"][3].clone()
        save = SaveJob(1, "r", (BlockRef(0, 0, 0, 3, H1, 32),))
        ws.enqueue_saves(HybridStoreMetadata(scheme=scheme, saves=[save]))
        assert ws.flush(5.0)
        wm = ws.worker_meta()
        assert (
            wm is not None
            and wm.saves_done == {1: [0]}
            and wm.saves[1] == [SaveResult(EntryId(0, 0, 0, 32), SaveOutcome.TIMEOUT)]
        )
        assert ws.store.backend.num_late_pending == 1  # type: ignore[attr-defined]  # reported under the put
        pool = ws._ctx.host_buffers
        assert pool.num_forfeited == 1 and pool.pooled_bytes == 0
        caches["attn.0"][3].zero_()  # vLLM reuses the unpinned block
        assert ws.wait_late_calls(30.0)
        assert pool.num_idle == 0, "the late put's buffer went back to the pool once it returned"
        got = torch.empty_like(page_at_save)
        store = open_store(f"memory://{name}")
        assert store.get_into([scheme.key(0, 0, H1)], [got.view(torch.uint8).reshape(-1).numpy()]) == [
            Status.OK
        ], "the late put did not land"
        assert torch.equal(got, page_at_save), "the late put read the page after the report"
    finally:
        ws.shutdown()


def test_late_put_that_never_returns_holds_no_job_nor_budget(vllm_objs: dict[str, Any]) -> None:
    name = f"late-{uuid.uuid4().hex[:8]}"
    ws, _, scheme = _worker(vllm_objs, f"faulty+memory://{name}?put_late=1&late_ms={NEVER_MS}")
    for job_id in range(1, 4):  # more than one wave's budget, one after the other
        ws.enqueue_saves(_save_of(scheme, job_id, bytes([job_id]) * 32))
        assert ws.flush(5.0)
        wm = ws.worker_meta()
        assert wm is not None and wm.saves_done == {job_id: [0]}
        assert wm.saves[job_id] == [SaveResult(EntryId(0, 0, 0, 32), SaveOutcome.TIMEOUT)], "dropped"
    assert _shutdown_returns(ws, 1.0)


def _spans(values: Sequence[Sequence[Any]]) -> list[tuple[int, int]]:
    """The (address, length) of every part of every value: the memory a store call was handed."""
    spans = []
    for value in values:
        for part in value:
            array = np.asarray(part)
            spans.append((array.ctypes.data, array.nbytes))
    return spans


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(x < y + m and y < x + n for x, n in a for y, m in b)


class _Recording:
    """A store view that records the memory each ``get_into`` / ``put`` was handed. It does not say whether
    it may answer late (no ``answers_late`` on its class), so the worker hands it private buffers."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[list[tuple[int, int]]] = []

    def get_into(self, keys: Sequence[str], destinations: Sequence[Any]) -> list[Status]:
        self.calls.append(_spans(destinations))
        return list(self.inner.get_into(keys, destinations))

    def put(self, keys: Sequence[str], values: Sequence[Any]) -> list[Status]:
        self.calls.append(_spans(values))
        return list(self.inner.put(keys, values))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _save_and_load_back(
    ws: WorkerSide, caches: dict[str, torch.Tensor], scheme: Any, n: int, gen: torch.Generator
) -> None:
    """Give block 3 fresh bytes, save it under a fresh hash (job ``n``), load that into block 10 + n."""
    caches["attn.0"][3] = torch.randn(caches["attn.0"][3].shape, generator=gen).to(torch.bfloat16)
    block_hash = bytes([0x40 + n]) * 32
    ws.enqueue_saves(_save_of(scheme, n, block_hash))
    assert ws.flush(5.0)
    wm = ws.worker_meta()
    assert wm is not None and wm.saves[n] == [SaveResult(EntryId(0, 0, 0, 32), SaveOutcome.OK)], wm
    req = f"load{n}"
    load = LoadJob(req, 32, (BlockRef(0, 0, 0, 10 + n, block_hash, 32),))
    ws.start_load(HybridStoreMetadata(scheme=scheme, loads=[load]))
    assert _wait_report(ws) == ({req}, set())
    assert torch.equal(caches["attn.0"][10 + n], caches["attn.0"][3]), "a load through a reused buffer"


def test_on_time_private_transfers_reuse_one_pooled_buffer(vllm_objs: dict[str, Any]) -> None:
    """Host KV, a store that may answer late but answers on time: every save and load goes through a
    private buffer, and it is the same pre-faulted buffer each time (allocated once); the pages still get
    each transfer's own bytes."""
    ws, caches, scheme = _worker(vllm_objs, f"memory://pool-{uuid.uuid4().hex[:8]}")
    recording = _Recording(ws.store)
    ws.store = recording
    pool = ws._ctx.host_buffers
    gen = torch.Generator().manual_seed(1)
    try:
        for n in range(1, 5):
            _save_and_load_back(ws, caches, scheme, n, gen)
        assert len(recording.calls) == 8
        pages = [caches["attn.0"][b].view(torch.uint8).reshape(-1).numpy() for b in (3, 11, 12, 13, 14)]
        assert not _overlap([s for call in recording.calls for s in call], _spans([pages])), (
            "a store that may answer late was handed KV pages"
        )
        assert all(call == recording.calls[0] for call in recording.calls), "a transfer used another buffer"
        assert (pool.num_allocated, pool.num_reused, pool.num_one_off) == (1, 7, 0)
        assert pool.num_forfeited == 0 and pool.num_idle == 1
    finally:
        ws.shutdown()


def test_a_buffer_a_late_call_holds_is_never_handed_out_again(vllm_objs: dict[str, Any]) -> None:
    """A late get keeps its private buffer for good (it never returns): the buffer leaves the pool, the pool
    allocates one replacement, and no later save or load is handed any byte of the late call's buffer."""
    name = f"late-{uuid.uuid4().hex[:8]}"
    ws, caches, scheme = _worker(vllm_objs, f"memory://{name}")
    _stored_block(scheme, name, caches)
    on_time = _Recording(ws.store)
    late = _Recording(open_store(f"faulty+memory://{name}?get_late=1&late_ms={NEVER_MS}"))
    pool = ws._ctx.host_buffers
    gen = torch.Generator().manual_seed(2)
    try:
        _save_and_load_back(ws, caches, scheme, 1, gen)  # direct path: the memory store never answers late
        ws.store = late
        ws.start_load(_load_of(scheme, "late"))
        assert _wait_report(ws) == ({"late"}, {"late"})
        assert ws.num_late_store_calls == 1 and pool.num_forfeited == 1 and pool.num_idle == 0
        ws.store = on_time
        for n in range(2, 6):
            _save_and_load_back(ws, caches, scheme, n, gen)
        assert len(late.calls) == 1 and len(on_time.calls) == 8
        assert not any(_overlap(late.calls[0], call) for call in on_time.calls), (
            "a buffer a late call still holds was handed out again"
        )
        assert (pool.num_allocated, pool.num_reused, pool.num_forfeited) == (2, 7, 1)
    finally:
        assert _shutdown_returns(ws, 1.0)


def test_private_loads_go_in_rounds_of_one_put_wave(vllm_objs: dict[str, Any]) -> None:
    """Host KV, private buffers: a load of more than ``put_wave_bytes`` is read in rounds that end at the
    block reaching a wave, as saves are, so each round's buffer fits the pool and every round reuses it."""
    name = f"rounds-{uuid.uuid4().hex[:8]}"
    ws, caches, scheme = _worker(vllm_objs, f"memory://{name}", extra={"put_wave_bytes": 2 * 2048})
    assert ws.block_nbytes(0) == 2048
    hashes = [bytes([0x60 + i]) * 32 for i in range(5)]
    pages = [caches["attn.0"][i].view(torch.uint8).reshape(-1).numpy() for i in range(5)]
    assert open_store(f"memory://{name}").put([scheme.key(0, 0, h) for h in hashes], pages) == [Status.OK] * 5
    recording = _Recording(ws.store)
    ws.store = recording
    try:
        refs = tuple(BlockRef(0, 0, i, 20 + i, h, 32 * (i + 1)) for i, h in enumerate(hashes))
        ws.start_load(HybridStoreMetadata(scheme=scheme, loads=[LoadJob("r", 160, refs)]))
        assert _wait_report(ws) == ({"r"}, set())
        assert torch.equal(caches["attn.0"][20:25], caches["attn.0"][0:5])
        assert [len(call) for call in recording.calls] == [2, 2, 1]
        pool = ws._ctx.host_buffers
        assert (pool.num_allocated, pool.num_reused, pool.num_one_off) == (1, 2, 0)
    finally:
        ws.shutdown()


def _answer_late(
    keys: Sequence[str],
    destinations: Sequence[Any],
    release: threading.Event,
    late_calls: list[Future[object]],
) -> list[Status]:
    """Answer TIMEOUT now and go on: once ``release`` is set, scribble 0xA5 over ``destinations`` and return."""
    done: Future[object] = Future()
    done.set_running_or_notify_cancel()

    def go_on() -> None:
        assert release.wait(30), "never released"
        for destination in destinations:
            for part in destination:
                np.asarray(part)[:] = 0xA5
        done.set_result(None)

    threading.Thread(target=go_on, daemon=True).start()
    register_late_call(done)
    late_calls.append(done)
    return [Status.TIMEOUT] * len(keys)


class _LateHelperShare:
    """A store view for split reads: the share read on the load thread answers on time; the helper
    thread's answers ``TIMEOUT`` and goes on -- once ``release`` is set it scribbles its destinations."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.late_calls: list[Future[object]] = []

    def get_into(self, keys: Sequence[str], destinations: Sequence[Any]) -> list[Status]:
        if not threading.current_thread().name.startswith("hybridkv-read"):
            return list(self.inner.get_into(keys, destinations))
        return _answer_late(keys, destinations, self.release, self.late_calls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_split_read_writes_the_on_time_share_and_never_the_late_one(
    vllm_objs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host KV, private buffers, a batch read in two shares: the load thread's share answers on time and
    its block is written into its page as it returns; the helper's share answers late, so its page is
    never written (not even after the late call scribbled its buffer and returned) and its buffer leaves the
    pool. The job is reported failed at once."""
    from hybridkv.connector.worker import load_pipeline

    monkeypatch.setattr(load_pipeline, "SPLIT_READ_MIN_BYTES", 0)
    name = f"late-{uuid.uuid4().hex[:8]}"
    ws, caches, scheme = _worker(vllm_objs, f"memory://{name}")
    store = open_store(f"memory://{name}")
    pages = [caches["attn.0"][b].view(torch.uint8).reshape(-1).numpy() for b in (3, 4)]
    assert store.put([scheme.key(0, 0, H1), scheme.key(0, 0, H2)], pages) == [Status.OK] * 2
    faults = _LateHelperShare(ws.store)
    ws.store = faults
    pool = ws._ctx.host_buffers
    try:
        late_page_before = caches["attn.0"][8].clone()
        load = LoadJob("r", 32, (BlockRef(0, 0, 0, 7, H1, 32), BlockRef(0, 0, 1, 8, H2, 64)))
        ws.start_load(HybridStoreMetadata(scheme=scheme, loads=[load]))
        assert _wait_report(ws) == ({"r"}, {"r"})
        wm = ws.worker_meta()
        assert wm is not None and [res.outcome for res in wm.loads["r"]] == [
            LoadOutcome.OK,
            LoadOutcome.TIMEOUT,
        ]
        assert torch.equal(caches["attn.0"][7], caches["attn.0"][3]), "the on-time share was not written"
        assert torch.equal(caches["attn.0"][8], late_page_before), "the late share's page was written"
        assert pool.num_forfeited == 1 and pool.num_idle == 0
        faults.release.set()
        futures_wait(faults.late_calls, timeout=30)
        assert ws.wait_late_calls(30.0)
        assert torch.equal(caches["attn.0"][8], late_page_before), "the late call's bytes reached a page"
        assert pool.num_idle == 0, "the late call's buffer went back to the pool once it returned"
    finally:
        faults.release.set()
        ws.shutdown()


class _SplitReadFaults:
    """A store view for split reads: the share read on ``raising`` ("load" or "helper" thread) raises; the
    other answers ``TIMEOUT`` and goes on -- once ``release`` is set it scribbles its destinations."""

    def __init__(self, inner: Any, raising: str) -> None:
        self.inner = inner
        self.raising = raising
        self.release = threading.Event()
        self.late_calls: list[Future[object]] = []

    def get_into(self, keys: Sequence[str], destinations: Sequence[Any]) -> list[Status]:
        on_helper = threading.current_thread().name.startswith("hybridkv-read")
        if on_helper == (self.raising == "helper"):
            raise RuntimeError("injected: this share's store call failed")
        return _answer_late(keys, destinations, self.release, self.late_calls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize(
    ("raising", "staged"), [("helper", False), ("load", False), ("helper", True), ("load", True)]
)
def test_split_read_keeps_a_late_share_when_the_other_raises(
    vllm_objs: dict[str, Any], monkeypatch: pytest.MonkeyPatch, raising: str, staged: bool
) -> None:
    """A batch read in two shares: one raises, the other's call answered TIMEOUT and goes on. The job fails
    at once, but the late call never writes a page of the reported job, and (staged) its slab stays out
    of the pool until it returned."""
    from hybridkv.connector.worker import load_pipeline

    monkeypatch.setattr(load_pipeline, "SPLIT_READ_MIN_BYTES", 0)
    staging = StagingContext("cpu", PinnedPool(1 << 20, 3 << 20, pin=False)) if staged else None
    ws, caches, scheme = _worker(vllm_objs, f"memory://late-{uuid.uuid4().hex[:8]}", staging=staging)
    faults = _SplitReadFaults(ws.store, raising)
    ws.store = faults
    try:
        pages_before = caches["attn.0"][7:9].clone()
        load = LoadJob("r", 32, (BlockRef(0, 0, 0, 7, H1, 32), BlockRef(0, 0, 1, 8, H2, 64)))
        ws.start_load(HybridStoreMetadata(scheme=scheme, loads=[load]))
        assert _wait_report(ws) == ({"r"}, {"r"})
        if staging is not None:
            assert staging.pool.in_use == 1, "the slab went back to the pool under a late call"
        faults.release.set()
        futures_wait(faults.late_calls, timeout=30)
        assert len(faults.late_calls) == 1 and all(call.done() for call in faults.late_calls)
        assert torch.equal(caches["attn.0"][7:9], pages_before), "a late call wrote pages of a reported job"
        assert ws.wait_late_calls(30.0)
        assert staging is None or staging.pool.in_use == 0
        assert ws.num_late_store_calls == 1
    finally:
        faults.release.set()
        ws.shutdown()


def _save_of(scheme: Any, job_id: int, block_hash: bytes) -> HybridStoreMetadata:
    """A save job of the page in block 3 of group 0, keyed by ``block_hash``."""
    return HybridStoreMetadata(
        scheme=scheme, saves=[SaveJob(job_id, "s", (BlockRef(0, 0, 0, 3, block_hash, 32),))]
    )


def test_suspend_refuses_while_a_transfer_owns_kv_memory(vllm_objs: dict[str, Any]) -> None:
    """A save still reading the live pages (``delay_ms``: a slow store that cannot answer late, so it was
    given the pages themselves) keeps the worker awake."""
    name = f"slow-{uuid.uuid4().hex[:8]}"
    ws, _, scheme = _worker(vllm_objs, f"faulty+memory://{name}?delay_ms={LATE_MS}")
    try:
        ws.enqueue_saves(_save_of(scheme, 9, b"\x09" * 32))
        assert not ws.suspend(timeout=0.05), "sleep allowed while a put may still read KV memory"
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

    name = f"slow-{uuid.uuid4().hex[:8]}"
    vc = vllm_objs["vc"]
    tc = dataclasses.replace(
        vc.kv_transfer_config,
        kv_connector_extra_config={"store": f"faulty+memory://{name}?delay_ms={LATE_MS}"},
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
        ws.enqueue_saves(_save_of(scheme, 1, H1))  # the put reads the live page for LATE_MS
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
