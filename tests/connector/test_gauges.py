"""The connector's gauges (what it holds now): the worker's save bytes in flight, staging bytes out and late
calls pending on a real worker, the pool and quarantine counts they read, and how ranks' reports aggregate."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from typing import Any

import pytest
from hybridkv.connector.datapath.staging import HostBufferPool
from hybridkv.connector.metadata import BlockRef, HybridStoreMetadata, SaveJob
from hybridkv.connector.stats import GAUGES, PER_RANK_GAUGES, HybridStoreStats, with_gauges
from hybridkv.connector.worker.ownership import LateOwnership, Quarantine
from support.worker import make_worker

pytestmark = pytest.mark.vllm

H1, H2 = b"\x01" * 32, b"\x02" * 32


def test_rank_gauges_keep_the_largest_scheduler_gauges_the_latest() -> None:
    assert PER_RANK_GAUGES <= set(GAUGES)
    rank0 = HybridStoreStats(data={"save_inflight_bytes": 4096, "late_calls_pending": 0, "load_keys": 2})
    rank1 = HybridStoreStats(data={"save_inflight_bytes": 1024, "late_calls_pending": 3, "load_keys": 5})
    merged = rank0.aggregate(rank1).aggregate(HybridStoreStats(data={"tracked_requests": 2}))
    merged = merged.aggregate(HybridStoreStats(data={"tracked_requests": 0}))
    assert merged.data == {
        "save_inflight_bytes": 4096,
        "late_calls_pending": 3,
        "load_keys": 7,
        "tracked_requests": 0,
    }
    # A report of only zero gauges still reaches the metrics (vLLM drops empty stats).
    zeros = with_gauges(None, {"pinned_blocks": 0})
    assert zeros is not None and not zeros.is_empty()
    assert with_gauges(None, {}) is None


def test_host_buffer_pool_counts_bytes_out_until_release() -> None:
    pool = HostBufferPool(budget_bytes=64 << 10)
    pooled = pool.acquire(16 << 10)
    one_off = pool.acquire(60 << 10)  # beyond the budget left: a one-off buffer
    assert not one_off.pooled
    assert pool.num_bytes_out == pooled.capacity + one_off.capacity
    pooled.forfeit()  # a late call holds it: still out
    assert pool.num_bytes_out == pooled.capacity + one_off.capacity
    pooled.release()
    one_off.release()
    one_off.release()  # idempotent
    assert pool.num_bytes_out == 0
    again = pool.acquire(8 << 10)
    assert pool.num_bytes_out == again.capacity
    again.release()
    assert pool.num_bytes_out == 0


def test_quarantine_counts_late_calls_until_each_returns() -> None:
    quarantine = Quarantine()
    calls: list[Future[object]] = [Future(), Future()]
    reported: list[bool] = []
    quarantine.hold_until_returned(LateOwnership(calls=list(calls)), lambda: reported.append(True))
    assert quarantine.num_calls_pending == 2
    calls[0].set_result(None)
    assert quarantine.num_calls_pending == 1 and not reported
    calls[1].set_result(None)
    assert quarantine.num_calls_pending == 0 and reported == [True]
    assert quarantine.num_late_calls == 2


def test_worker_gauges_follow_saves_and_late_calls(vllm_objs: dict[str, Any]) -> None:
    # Late puts: every PUT answers TIMEOUT at once and completes 300 ms later on a thread of its own, so its
    # private host buffer and the call stay held meanwhile.
    url = f"faulty+memory://g-{uuid.uuid4().hex[:8]}?put_late=1&late_ms=300"
    ws, _, scheme = make_worker(vllm_objs, url)
    try:
        assert ws.gauges() == {"save_inflight_bytes": 0, "staging_bytes_out": 0, "late_calls_pending": 0}
        save = SaveJob(1, "r", (BlockRef(0, 0, 0, 3, H1, 32), BlockRef(1, 1, 0, 5, H2, 32)))
        ws.enqueue_saves(HybridStoreMetadata(scheme=scheme, saves=[save]))
        assert ws.flush(), "the save job never ended"
        held = ws.gauges()
        assert held["save_inflight_bytes"] == 0, f"a reported save job still counts in flight: {held}"
        assert held["late_calls_pending"] >= 1, f"the late PUT is not counted: {held}"
        assert held["staging_bytes_out"] > 0, f"the late PUT's private buffer is not counted: {held}"
        assert ws.wait_late_calls(10.0), "the late PUT never returned"
        deadline = time.monotonic() + 5.0  # the done callbacks run on the late call's thread, just after
        while ws.gauges() != dict.fromkeys(held, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ws.gauges() == dict.fromkeys(held, 0), f"held after every late call returned: {ws.gauges()}"
    finally:
        ws.shutdown()


def test_a_faulty_views_injections_reach_the_stats_once() -> None:
    """``store_faults_injected``: what a ``faulty+`` view injected since the last count, counted once; a real
    store adds nothing."""
    from hybridkv.connector.stats import InjectedFaults, StatsBox
    from hybridkv.store import Status, open_store

    name = uuid.uuid4().hex
    faulty = open_store(f"faulty+memory://{name}?get_fail=1.0&seed=1")
    plain = open_store(f"memory://{name}-plain")
    try:
        stats = StatsBox()
        counters = [InjectedFaults(stats, faulty), InjectedFaults(stats, plain)]
        assert faulty.put(["a", "b", "c"], [b"1", b"2", b"3"]) == [Status.OK] * 3
        assert plain.put(["a"], [b"1"]) == [Status.OK]
        dest = [bytearray(1) for _ in range(3)]
        assert faulty.get_into(["a", "b", "c"], dest) == [Status.TRANSFER_FAILED] * 3
        assert plain.get_into(["a"], [bytearray(1)]) == [Status.OK]
        injected = faulty.backend.num_faults_injected()  # type: ignore[attr-defined]
        assert injected >= 1
        for c in counters:
            c.count()
        taken = stats.take()
        assert taken is not None and taken.data == {"store_faults_injected": injected}
        for c in counters:
            c.count()
        assert stats.take() is None, "counted twice"
    finally:
        faulty.close()
        plain.close()
