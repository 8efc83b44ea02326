"""Layer-wise hits on a store that misses the deadline: one stalled step, then no more layer-wise hits until a
cool-down has passed (``hybridkv.connector.scheduler.layerwise_breaker.LayerwiseBreaker``).

vLLM's real ``Scheduler`` (one attention group, ``load_mode: layerwise``) and a real worker half, stepped the
way vLLM's executor does: ``schedule`` -> ``start_load_kv`` -> the attention layer's ``wait_for_layer_load`` ->
``wait_for_save`` -> ``get_block_ids_with_load_errors`` and the worker metadata -> ``update_from_output``. The
scheduler answers lookups from ``memory://NAME`` (``exists`` stays fast), the worker reads through
``faulty+memory://NAME`` whose ``delay_ms`` turns the store slow (a large read crawling) and back.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import pytest
import torch
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.metadata import HybridStoreMetadata, HybridStoreWorkerMetadata, LoadResult
from hybridkv.connector.scheduler.layerwise_breaker import (
    LAYERWISE_COOL_DOWN_S,
    LAYERWISE_MAX_COOL_DOWN_S,
    LayerwiseBreaker,
)
from hybridkv.connector.stats import StatsBox
from hybridkv.connector.worker import layerwise
from hybridkv.connector.worker.side import WorkerSide
from hybridkv.demo import vllm_harness
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from hybridkv.lifecycle import LoadOutcome
from hybridkv.lifecycle.keys import EntryId
from hybridkv.store.breaker import BreakerState

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

BLOCK = 16
NUM_BLOCKS = 64
#: six whole blocks stored by the first request; every later prompt hits 96 tokens of them
PREFIX = list(range(7000, 7000 + 6 * BLOCK))
#: slower than the (scaled) layer-wise wait budget below
SLOW_MS = 400.0
WAIT_BUDGET_S = 0.1


class _Clock:
    """The breaker's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Engine:
    """One engine core: vLLM's ``Scheduler`` with the connector's scheduler half, and one worker half."""

    def __init__(self) -> None:
        from hybridkv_dev.devkit.cluster import two_group_cache_config
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager

        name = f"lwb-{uuid.uuid4().hex[:8]}"
        model = build_tiny_model("llama", DEFAULT_MODELS_DIR, num_key_value_heads=1, num_attention_heads=8)
        extra = {
            "store": f"memory://{name}",
            "lookup_budget_ms": 5000,
            "namespace": "lwb",
            "load_mode": "layerwise",
        }
        vc = vllm_harness.connector_vllm_config(model, extra, block_size=BLOCK, num_blocks=NUM_BLOCKS)
        vc.scheduler_config.async_scheduling = False
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
        kvc = two_group_cache_config(NUM_BLOCKS, spec.page_size_bytes, ("attn.0", spec))
        vllm_harness.resolve_cache_block_sizes(kvc, vc)
        self.sched = Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=BLOCK, hash_block_size=BLOCK)
        self.side = self.sched.connector.scheduler_side
        self.clock = _Clock()
        self.side.layerwise_breaker.clock = self.clock
        cfg = ConnectorConfig.from_extra_config(
            {**extra, "store": f"faulty+memory://{name}?delay_ms=0"}, model=str(vc.model_config.model)
        )
        self.ws = WorkerSide(vc, kvc, cfg)
        # (blocks, 1, block tokens, K and V of 8): one 512-byte page per block, like the spec's
        self.kv = torch.zeros(NUM_BLOCKS, 1, BLOCK, 16, dtype=torch.bfloat16)
        self.ws.register_kv_caches({"attn.0": self.kv})
        self.num_requests = 0
        #: per step: the request ids that got a layer-wise load job
        self.loads: list[set[str]] = []

    def slow(self, delay_ms: float) -> None:
        """The worker's reads (and writes) take ``delay_ms`` from now on."""
        self.ws.store.backend.delay_ms = delay_ms  # type: ignore[attr-defined]

    def add(self, suffix: int) -> str:
        self.num_requests += 1
        rid = f"r{self.num_requests}"
        request = vllm_harness.block_hashed_request(rid, PREFIX + [suffix] * 4, BLOCK, 2)
        self.sched.add_request(request)
        return rid

    def step(self) -> HybridStoreMetadata:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, HybridStoreMetadata)
        self.loads.append({job.req_id for job in meta.loads if job.blocks})
        # The forward: rows of every scheduled token's block are "computed" (written) by the model ...
        self.ws.start_load(meta)
        self.ws.wait_for_layer("attn.0")  # ... and its attention layer waits for the step's loads
        self.ws.enqueue_saves(meta)  # wait_for_save
        invalid = self.ws.end_layerwise_step()  # get_block_ids_with_load_errors
        assert self.ws.flush(), "saves never finished"
        wm = self.ws.worker_meta() or HybridStoreWorkerMetadata()
        starts = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = self.sched.requests[rid]
            done = starts[rid] + out.num_scheduled_tokens[rid] >= request.num_tokens
            sampled.append([900 + len(request.output_token_ids)] if done else [])
        fields: dict[str, Any] = {
            "req_ids": req_ids,
            "sampled_token_ids": sampled,
            "kv_connector_output": KVConnectorOutput(invalid_block_ids=invalid, kv_connector_worker_meta=wm),
        }
        if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
            fields["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
        self.sched.update_from_output(out, ModelRunnerOutput(**fields))
        return meta

    def run(self, max_steps: int = 50) -> None:
        """Step until every request finished and every save was reported."""
        for _ in range(max_steps):
            if not self.sched.requests and not self.side.has_pending_push_work():
                return
            self.step()
        raise AssertionError(f"not drained after {max_steps} steps: {list(self.sched.requests)}")

    def drop_local_cache(self) -> None:
        """vLLM's own prefix cache forgets everything (the engine is idle): a hit can only come from the store."""
        assert self.sched.kv_cache_manager.reset_prefix_cache()

    def stat(self, name: str) -> float:
        return self.side.stats.totals.get(name, 0) + self.ws.stats.totals.get(name, 0)

    def shutdown(self) -> None:
        self.ws.shutdown()
        self.sched.shutdown()


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(layerwise, "LAYERWISE_WAIT_S", WAIT_BUDGET_S)
    eng = _Engine()
    try:
        yield eng
    finally:
        eng.shutdown()


def test_a_missed_deadline_stops_layerwise_hits_until_a_cool_down_passed(engine: _Engine) -> None:
    engine.add(1)
    engine.run()  # computed, its six blocks saved
    assert engine.ws.stats.totals.get("save_keys", 0) >= 6
    engine.drop_local_cache()
    engine.slow(SLOW_MS)

    # The first hit's load misses the deadline: its step is abandoned (recomputed), the store held it once.
    hit = engine.add(2)
    engine.step()
    assert engine.loads[-1] == {hit}, "the first hit was not loaded layer-wise"
    assert engine.stat("layerwise_abandoned_steps") == 1
    assert engine.stat("layerwise_breaker_opens") == 1

    # Four more steps, each with a new request whose prefix the store holds: none is offered the hit, so no
    # step waits for the slow store again; each computes its prompt (never a load of wrong pages).
    mark = len(engine.loads)
    later = []
    for suffix in range(3, 7):
        engine.run()
        engine.drop_local_cache()
        later.append(engine.add(suffix))
        engine.step()
    engine.run()
    assert not set().union(*engine.loads[mark:]), f"layer-wise loads after the miss: {engine.loads[mark:]}"
    assert engine.stat("layerwise_abandoned_steps") == 1, "a later step waited for the slow store again"
    assert engine.stat("layerwise_hits_withheld") >= len(later)
    assert engine.stat("layerwise_wait_seconds") > 0  # the one stall is counted
    assert engine.side.stats.totals.get("loaded_blocks.g0", 0) == 0, "a load was verified on the slow store"

    # Within the cool-down, even a recovered store is not offered a hit; after it, hits come back.
    engine.slow(0.0)
    engine.drop_local_cache()
    engine.add(7)
    engine.step()
    engine.run()
    assert not engine.loads[-1] and engine.side.layerwise_breaker.state is BreakerState.OPEN
    engine.clock.now += LAYERWISE_COOL_DOWN_S
    engine.drop_local_cache()
    back = engine.add(8)
    num_loaded = engine.side.stats.totals.get("loaded_blocks.g0", 0)
    engine.step()
    assert back in engine.loads[-1], "no layer-wise hit after the cool-down"
    engine.run()
    assert engine.side.stats.totals.get("loaded_blocks.g0", 0) == num_loaded + 6, "the hit's load failed"
    assert engine.side.layerwise_breaker.state is BreakerState.CLOSED
    assert engine.stat("layerwise_abandoned_steps") == 1


def _results(outcome: LoadOutcome) -> list[LoadResult]:
    return [LoadResult(EntryId(0, 0, 0, 16), outcome)]


def test_the_cool_down_doubles_while_the_store_stays_slow_and_resets_once_a_load_verifies() -> None:
    clock = _Clock()
    stats = StatsBox()
    breaker = LayerwiseBreaker(stats, clock)
    assert breaker.may_offer()
    breaker.on_load_results([_results(LoadOutcome.OK), _results(LoadOutcome.TIMEOUT)])
    assert not breaker.may_offer()
    # Outcomes that say nothing about the store's speed change nothing.
    breaker.on_load_results([_results(LoadOutcome.MISSING), _results(LoadOutcome.TRANSPORT_ERROR)])
    clock.now += LAYERWISE_COOL_DOWN_S
    assert breaker.state is BreakerState.HALF_OPEN and breaker.may_offer()
    breaker.on_load_results([_results(LoadOutcome.TIMEOUT)])  # the half-open step missed it again
    clock.now += LAYERWISE_COOL_DOWN_S
    assert not breaker.may_offer(), "the cool-down did not double"
    clock.now += LAYERWISE_COOL_DOWN_S
    assert breaker.may_offer()
    for _ in range(10):  # never past the longest cool-down
        breaker.on_load_results([_results(LoadOutcome.TIMEOUT)])
        clock.now += LAYERWISE_MAX_COOL_DOWN_S
        assert breaker.may_offer()
    breaker.on_load_results([_results(LoadOutcome.OK)])
    assert breaker.state is BreakerState.CLOSED
    breaker.on_load_results([_results(LoadOutcome.TIMEOUT)])
    clock.now += LAYERWISE_COOL_DOWN_S
    assert breaker.may_offer(), "a verified load did not reset the cool-down"
    assert stats.totals["layerwise_breaker_opens"] == 13
