"""Lookups never block vLLM's scheduler: ``get_num_new_matched_tokens`` answers "ask again" while the
search runs in the background, the request stays waiting while others are scheduled, a hung store costs
a request at most ``lookup_budget_ms`` and the scheduler nothing, and the lookups of one step share store
calls. All at the real vLLM ``Scheduler`` (TP = DCP = 2, full attention + Mamba), default breaker.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from hybridkv.lifecycle import plan_lookup
from hybridkv.store import open_store
from hybridkv_dev.devkit.cluster import HASH
from hybridkv_dev.devkit.cluster import kv_cache_config as _kv_cache_config

pytestmark = pytest.mark.vllm


def _scheduler(vllm_objs: dict[str, Any], store: str, budget_ms: float) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc = vllm_objs["vc"]
    extra = vc.kv_transfer_config.kv_connector_extra_config
    saved = dict(extra)
    extra.update({"store": store, "lookup_budget_ms": budget_ms})
    try:
        return Scheduler(
            vc, _kv_cache_config(), StructuredOutputManager(vc), block_size=32, hash_block_size=HASH
        )
    finally:
        extra.clear()
        extra.update(saved)


def _request(rid: str, n: int, first: int) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=4, temperature=0)
    return Request(
        rid, list(range(first, first + n)), sp, None, block_hasher=get_request_block_hasher(HASH, sha256)
    )


def _timed_schedule(sched: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = sched.schedule()
    return out, time.monotonic() - t0


def test_hung_store_costs_the_scheduler_nothing_and_a_request_one_budget(vllm_objs: dict[str, Any]) -> None:
    # Thresholds are fractions of the budget and of the hang (not absolute speeds), so a busy host does
    # not fail them: the synchronous lookup this replaces waited the whole budget inside schedule().
    budget_s = 1.0
    sched = _scheduler(
        vllm_objs, f"faulty+memory://hung-{uuid.uuid4().hex[:6]}?delay_ms=8000", budget_s * 1000
    )
    side = sched.connector.scheduler_side
    sched.add_request(_request("h1", 100, first=700))
    started = time.monotonic()
    waited_steps = 0
    while True:
        out, took = _timed_schedule(sched)
        # The old synchronous lookup waited the whole budget inside schedule().
        assert took < budget_s / 2, f"schedule() took {took:.3f} s: it waited on the store"
        if "h1" in out.num_scheduled_tokens:
            break
        waited_steps += 1
        assert time.monotonic() - started < 3 * budget_s, "h1 waited for its lookup far past the budget"
        time.sleep(0.01)  # one engine step
    assert waited_steps >= 1, "the first ask must not have an answer from an 8 s store"
    assert out.num_scheduled_tokens["h1"] > 0 and out.kv_connector_metadata.loads == []
    assert side.stats.totals["lookup_errors"] == 1 and side.lifecycle("h1").state == "MISS"
    # The store call is still hung: a new request is a miss at its first ask, without queueing behind it.
    assert side.lookup_breaker_open
    sched.add_request(_request("h2", 100, first=900))
    out, took = _timed_schedule(sched)
    assert took < budget_s / 2 and out.num_scheduled_tokens.get("h2", 0) > 0
    assert side.stats.totals["lookup_errors"] == 1 and side.lifecycle("h2").state == "MISS"


def test_pending_lookup_waits_alone_and_answers_like_the_full_scan(vllm_objs: dict[str, Any]) -> None:
    name = f"slow-{uuid.uuid4().hex[:6]}"
    sched = _scheduler(vllm_objs, f"faulty+memory://{name}?delay_ms=1500", 5000)
    side = sched.connector.scheduler_side
    scheme = side.scheme
    store = open_store(f"memory://{name}")

    other = _request("other", 64, first=3000)
    sched.add_request(other)
    assert side.lookups.wait_idle(10)
    req = _request("hit", 100, first=10)
    hashes = list(req.block_hashes)
    keys = [scheme.key(g, r, hashes[b // HASH - 1]) for g, b in [(0, 32), (0, 64), (1, 64)] for r in (0, 1)]
    assert all(s.is_ok for s in store.put(keys, [b"x"] * len(keys)))
    sched.add_request(req)

    out, took = _timed_schedule(sched)
    assert took < 0.75, f"schedule() took {took:.3f} s: it waited on the 1.5 s store"
    assert out.num_scheduled_tokens.get("other", 0) > 0, "a pending lookup delayed another request"
    assert "hit" not in out.num_scheduled_tokens and side.lifecycle("hit").state in ("NEW", "LOOKUP")
    assert side.lookups.wait_idle(10)
    out = sched.schedule()
    loads = out.kv_connector_metadata.loads
    assert [(ld.req_id, ld.boundary) for ld in loads] == [("hit", 64)]
    full = plan_lookup(scheme, hashes, req.num_tokens, 0)
    existing = set(keys)
    assert full.resolve([k in existing for k in full.keys]).boundary == 64


def test_lookups_queued_together_share_store_calls(vllm_objs: dict[str, Any]) -> None:
    sched = _scheduler(vllm_objs, f"faulty+memory://batch-{uuid.uuid4().hex[:6]}?delay_ms=100", 5000)
    side = sched.connector.scheduler_side
    num_requests = 12
    for i in range(num_requests):
        sched.add_request(_request(f"r{i}", 100, first=5000 + 1000 * i))
    assert side.lookups.wait_idle(10)
    # Alone, each search needs one probe round (nothing stored: no confirm). Batched, the requests queued
    # while the first round was in flight join the second.
    assert side.lookups.num_searches == num_requests
    assert side.lookups.num_exists_calls <= 3, side.lookups.num_exists_calls
    out = sched.schedule()
    assert len(out.num_scheduled_tokens) == num_requests
