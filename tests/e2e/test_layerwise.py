"""``load_mode: layerwise`` on real vLLM CPU engines: the hit is scheduled at once, its load overlaps the forward.

References come from an engine without any connector. Before every external hit the (idle, uncached) KV
cache is filled with garbage, so a page the load did not write is visibly wrong: a failed load leaves
garbage in the request's pages, and the tokens stay right only because vLLM discards the step's output for
that request and recomputes (the control test shows the tokens go wrong when the failure is not reported).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hybridkv.audit.replay import audit_file
from hybridkv.connector.worker.layerwise import LayerwiseLoads
from hybridkv.demo import vllm_harness
from hybridkv.demo.tiny_models import build_tiny_model
from hybridkv.ops import inprocess
from support.engines import MODELS_DIR, connectors, engine, flush_saves, generate, prompt, reset_local_cache

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

FULL = prompt(300, seed=31)  # two whole 128-token blocks stored, then restored (256 of 300 tokens)
PARTIAL = FULL[:256] + prompt(256, seed=32)  # half of it restored from FULL's blocks, half computed
GARBAGE_BYTE = 0x5A  # bf16 0x5A5A ~ 1.5e16: attention over it changes every token


@pytest.fixture(scope="module")
def llama() -> Path:
    return build_tiny_model("llama", MODELS_DIR)


@pytest.fixture(scope="module")
def reference(llama: Path) -> dict[str, list[int]]:
    """Greedy tokens of both prompts from an engine without a connector."""
    with inprocess.inprocess_engine(llama, None) as llm:
        return {"full": generate(llm, FULL)[0], "partial": generate(llm, PARTIAL)[0]}


def scribble_kv(llm: Any) -> None:
    """Fill the whole KV cache with garbage (the engine is idle and caches nothing: no page is in use)."""
    _, worker = connectors(llm)
    for g in worker.worker_side.geo.groups:
        for tensor in worker.worker_side.group_tensors(g.group_index):
            tensor.view(-1).view(torch.uint8).fill_(GARBAGE_BYTE)


@dataclass
class Hits:
    outputs: dict[str, list[int]]
    num_cached: dict[str, int]
    sched_totals: dict[str, Any]
    worker_totals: dict[str, Any]
    block_nbytes: int
    #: name -> whether FULL's first block was in vLLM's prefix cache right after that hit's request
    locally_cached: dict[str, bool]


def full_first_block_cached(llm: Any) -> bool:
    """Whether vLLM's prefix cache holds FULL's first block (by vLLM's own block hash)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    request = vllm_harness.block_hashed_request("probe", FULL, scheduler.block_size)
    return pool.get_cached_block(request.block_hashes[0], [0]) is not None


def run_hits(llama: Path, store: str, log_path: Path) -> Hits:
    """Store FULL, then restore it (whole hit) and PARTIAL (half hit), each over a scribbled KV cache."""
    extra = {"store": store, "audit_log": str(log_path), "load_mode": "layerwise"}
    outputs: dict[str, list[int]] = {}
    num_cached: dict[str, int] = {}
    locally_cached: dict[str, bool] = {}
    with engine(llama, extra) as llm:
        generate(llm, FULL)
        for name, tokens in (("full", FULL), ("partial", PARTIAL)):
            reset_local_cache(llm)
            scribble_kv(llm)
            outputs[name], num_cached[name] = generate(llm, tokens)
            locally_cached[name] = full_first_block_cached(llm)
        flush_saves(llm)  # every save's result seen by the scheduler before shutdown (audit terminal)
        sched, worker = connectors(llm)
        assert sched.scheduler_side.wait_maintenance(10), "invalidation removes still running after 10 s"
        return Hits(
            outputs,
            num_cached,
            dict(sched.scheduler_side.stats.totals),
            dict(worker.worker_side.stats.totals),
            worker.worker_side.block_nbytes(0),
            locally_cached,
        )


def test_layerwise_hits_match_no_connector(
    llama: Path, reference: dict[str, list[int]], tmp_path: Path
) -> None:
    log_path = tmp_path / "audit.jsonl"
    hits = run_hits(llama, f"file://{tmp_path}/s?capacity=256MiB", log_path)
    assert hits.outputs == reference
    assert hits.num_cached == {"full": 256, "partial": 256}
    w_tot, s_tot = hits.worker_totals, hits.sched_totals
    # Two hits of two blocks each, every byte written by the layer-wise path.
    assert w_tot["layerwise_load_steps"] == 2 and w_tot["load_bytes"] == 4 * hits.block_nbytes
    assert "layerwise_unwaited_steps" not in w_tot, "every attention layer waited for its pages"
    assert s_tot.get("truncations", 0) == 0 and s_tot["load_calls"] == 2
    assert hits.locally_cached == {"full": True, "partial": True}, (
        "verified loads stay in vLLM's prefix cache"
    )
    report = audit_file(log_path)
    assert report.ok and report.num_truncations == 0, report.to_dict()


@pytest.mark.parametrize("fault", ["get_fail=1", "corrupt=1", "get_late=1&late_ms=50", "delay_ms=40"])
def test_layerwise_faults_keep_tokens_exact(
    llama: Path, reference: dict[str, list[int]], fault: str, tmp_path: Path
) -> None:
    log_path = tmp_path / "audit.jsonl"
    store = f"faulty+file://{tmp_path}/s?capacity=256MiB&{fault}&seed=3"
    hits = run_hits(llama, store, log_path)
    s_tot, w_tot = hits.sched_totals, hits.worker_totals
    assert hits.outputs == reference, f"{fault}: tokens differ from the engine without a connector"
    report = audit_file(log_path)
    assert report.ok, report.to_dict()["violations"]
    if fault.startswith("delay"):
        assert s_tot.get("truncations", 0) == 0 and w_tot["load_bytes"] > 0
        return
    # Every load failed: each truncated, and its step's saves were dropped (that step attended to garbage).
    assert s_tot["truncations"] >= 1 and report.num_truncations == s_tot["truncations"]
    if fault.startswith("corrupt"):
        # The removal of the first hit's corrupt entries runs in the background: the second hit may miss (both
        # removed), find one block (the second removed, the first not yet) or both (neither removed yet).
        assert s_tot["truncations"] <= w_tot["load_failed_keys"] <= 2 * s_tot["truncations"]
    else:
        assert w_tot["load_failed_keys"] == 2 * s_tot["truncations"]
    if fault.startswith("get_late"):
        # The first hit's load missed its deadline (TIMEOUT): layer-wise hits pause for a cool-down, so the
        # second hit is withheld and computed (failure-semantics.md, "Layer-wise loads").
        assert s_tot["layerwise_breaker_opens"] == 1 and s_tot["layerwise_hits_withheld"] == 1
    else:
        assert w_tot["layerwise_dropped_saves"] >= 1
    # The loaded blocks left vLLM's prefix cache at allocation, so no other request could find their garbage
    # before the recompute; vLLM cached them again as the recompute rewrote them (the tokens above are exact).
    assert hits.locally_cached["full"] is True
    if fault.startswith("corrupt"):
        assert s_tot["invalidated_entries"] > 0  # definite fault: removed from the store
    else:
        assert s_tot.get("invalidated_entries", 0) == 0 and s_tot["load_transient_faults"] > 0


def test_unreported_failure_would_give_wrong_tokens(
    llama: Path, reference: dict[str, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: the same failed loads with their load errors withheld from vLLM give wrong tokens, so the
    fault test above really depends on vLLM discarding the step (and on the scribble being visible)."""
    real_end_step = LayerwiseLoads.end_step

    def end_step_hiding_errors(self: LayerwiseLoads) -> Any:
        _, results = real_end_step(self)
        return set(), results

    monkeypatch.setattr(LayerwiseLoads, "end_step", end_step_hiding_errors)
    store = f"faulty+file://{tmp_path}/s?capacity=256MiB&get_fail=1&seed=3"
    outputs = run_hits(llama, store, tmp_path / "audit.jsonl").outputs
    assert outputs["full"] != reference["full"] and outputs["partial"] != reference["partial"]


def test_layerwise_refuses_a_hybrid_model(tmp_path: Path) -> None:
    model = build_tiny_model("qwen3_next", MODELS_DIR)
    extra = {"store": f"file://{tmp_path}/s", "load_mode": "layerwise"}
    refusal = r"load_mode.*'layerwise' needs a model with one attention KV cache group"
    with pytest.raises(Exception, match=refusal), engine(model, extra):
        pass
