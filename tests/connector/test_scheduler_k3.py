"""Production geometry at the real vLLM ``Scheduler``: Kimi-K3-like, default connector configuration.

MLA with block 64 sharded by DCP 8 (a 512-token span), a replicated Mamba state (align mode, block 64),
hash unit 64, TP 8; prompts of 32K and 128K tokens. The store holds what a previous request of the same
prefix saved (every MLA block and a Mamba state at every 8K chunk end, on every rank). The lookup must find
exactly what the synchronous full scan finds, within the default ``lookup_budget_ms``, in at most 4 store
round trips and a fraction of the full scan's keys, while a miss queued with it is scheduled at once.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from hybridkv.connector.config import DEFAULT_LOOKUP_BUDGET_MS
from hybridkv.lifecycle import plan_lookup
from hybridkv.store import open_store
from hybridkv_dev.bench.scheduler import full_scan_hit, k3_request, k3_scheduler, store_prefix

pytestmark = pytest.mark.vllm

MODELS = Path(os.environ.get("HYBRIDKV_TEST_MODELS", "/tmp/hybridkv-test-models"))


def _until_loaded(sched: Any, request_id: str, deadline_s: float) -> tuple[Any, list[float], set[str]]:
    """Step until ``request_id``'s load is planned; the scheduled request ids of every step."""
    times: list[float] = []
    scheduled: set[str] = set()
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        t0 = time.perf_counter()
        out = sched.schedule()
        times.append(time.perf_counter() - t0)
        scheduled |= set(out.num_scheduled_tokens)
        loads = [ld for ld in out.kv_connector_metadata.loads if ld.req_id == request_id]
        if loads:
            return loads[0], times, scheduled
        time.sleep(0.002)  # the forward pass
    raise AssertionError(f"{request_id}: no load planned in {deadline_s} s ({len(times)} steps)")


@pytest.mark.parametrize("num_tokens", [32 * 1024, 128 * 1024])
def test_k3_long_prompt_hits_what_the_full_scan_finds(num_tokens: int) -> None:
    url = f"memory://k3-{uuid.uuid4().hex[:8]}"
    sched = k3_scheduler(url, MODELS)
    side = sched.connector.scheduler_side
    geometry = side.scheme.geometry
    assert side.cfg.lookup_budget_ms == DEFAULT_LOOKUP_BUDGET_MS
    assert geometry.spans == (512, 64) and geometry.hash_unit == 64 and geometry.topology.dcp_size == 8
    store = open_store(url)
    saved = num_tokens * 3 // 4
    previous = k3_request("previous", 1, num_tokens)
    store_prefix(side.scheme, store, previous.block_hashes, saved)

    req = k3_request("k3", 1, num_tokens)  # the same prefix: family 1
    miss = k3_request("miss", 2, 4096)
    sched.add_request(req)
    sched.add_request(miss)
    load, _, scheduled = _until_loaded(sched, "k3", deadline_s=DEFAULT_LOOKUP_BUDGET_MS / 1000 + 5.0)
    assert "miss" in scheduled, "a miss queued with the long lookup was not scheduled meanwhile"
    assert load.boundary == saved == full_scan_hit(side.scheme, store, req)
    assert side.stats.totals.get("lookup_errors", 0) == 0
    trips, keys = max(side.lookups.recent_costs)
    full_keys = len(plan_lookup(side.scheme, req.block_hashes, req.num_tokens, 0).keys)
    assert trips <= 4, f"{trips} store round trips"
    assert keys * 4 < full_keys, f"{keys} keys checked; the full scan lists {full_keys}"
    sched.shutdown()


def test_k3_128k_hole_in_the_middle_steps_back_to_what_the_full_scan_finds() -> None:
    num_tokens = 128 * 1024
    url = f"memory://k3-{uuid.uuid4().hex[:8]}"
    sched = k3_scheduler(url, MODELS)
    side = sched.connector.scheduler_side
    scheme = side.scheme
    store = open_store(url)
    previous = k3_request("previous", 3, num_tokens)
    store_prefix(scheme, store, previous.block_hashes, num_tokens * 3 // 4)
    # MLA block 100 (tokens 50688..51200) evicted on rank 5 only: the longest restorable boundary is the
    # last Mamba state before it, 48K.
    hole = scheme.key(0, 5, previous.block_hashes[101 * 512 // 64 - 1])
    assert [s.is_ok for s in store.remove([hole])] == [True]

    req = k3_request("k3", 3, num_tokens)
    sched.add_request(req)
    load, _, _ = _until_loaded(sched, "k3", deadline_s=DEFAULT_LOOKUP_BUDGET_MS / 1000 + 5.0)
    assert load.boundary == 48 * 1024 == full_scan_hit(scheme, store, req)
    trips, _ = max(side.lookups.recent_costs)
    assert trips <= 4, f"{trips} store round trips"
    sched.shutdown()
