"""Real engines with speculative decoding: EAGLE and ngram on the tiny Llama, external hits exact.

EAGLE's draft layer joins the target's KV-cache group, so every stored block holds the draft layer's pages
too. Greedy tokens cannot show whether those came back right (the target verifies every draft: a wrong
draft KV only lowers acceptance), so the test reads the engine's KV cache back and compares every layer's
pages, the draft's included, with what a recompute writes.

Why vLLM drops a hit's last block with EAGLE: the draft layer's KV at position ``i`` is computed from the
token at ``i + 1``. The last stored position of a prefix P cut from X = P + Q was drafted with Q's first
token; a request Y = P + R that diverges right after P needs R's there. vLLM's own local hit stops one block
short so that block is recomputed, and the connector's lookup follows the same rule: Y's external hit is
640 of P's 768 tokens. Without the drop (the mutation: ``_eagle_block_drop`` answering False) Y's hit is
768 and block 5's draft pages differ from the recompute's, with identical greedy tokens.

ngram drafts from the prompt and has no KV of its own: no drop, and the keys are the plain target's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hybridkv.demo.tiny_models import build_eagle_draft, build_tiny_model
from hybridkv.demo.vllm_harness import block_hashed_request
from hybridkv.ops import inprocess
from support.engines import MODELS_DIR, connectors, flush_saves, generate, prompt, reset_local_cache

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BLOCK = 128
#: P: 6 whole blocks; Q and R: the divergent continuations (X = P + Q, Y = P + R: 7 whole blocks each).
P_TOKENS, TAIL_TOKENS = 6 * BLOCK, 200
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def _engine(model: Path, store: Path, speculative_config: dict[str, Any]) -> Any:
    transfer = inprocess.connector_transfer_config({"store": f"file://{store}?capacity=256MiB"})
    return inprocess.inprocess_engine(
        model, transfer, speculative_config=speculative_config, disable_log_stats=False
    )


def _pages(llm: Any, tokens: list[int]) -> list[dict[str, torch.Tensor]]:
    """Per whole block of ``tokens``: every attention layer's page of the block vLLM caches for it (copies)."""
    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    caches = {}
    for name, layer in context.items():
        kv = getattr(layer, "kv_cache", None)
        if kv is not None:
            caches[name] = kv[0] if isinstance(kv, list) else kv
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    out = []
    for block_hash in block_hashed_request("pages", tokens, BLOCK).block_hashes:
        blocks = pool.get_cached_block(block_hash, [0])
        assert blocks is not None, "a whole prompt block is not in vLLM's prefix cache"
        out.append({name: cache[blocks[0].block_id].clone() for name, cache in caches.items()})
    return out


def _spec_counters(llm: Any) -> dict[str, float]:
    metrics = {m.name: m for m in llm.get_metrics()}
    return {name: float(getattr(metrics.get(name), "value", 0) or 0) for name in SPEC_COUNTERS}


def test_eagle_hits_drop_the_last_block_like_vllm_and_restore_the_draft_pages(tmp_path: Path) -> None:
    model = build_tiny_model("llama", MODELS_DIR)
    draft = build_eagle_draft(model, MODELS_DIR)
    spec = {"method": "eagle", "model": str(draft), "num_speculative_tokens": 3}
    p, q, r = prompt(P_TOKENS, seed=11), prompt(TAIL_TOKENS, seed=12), prompt(TAIL_TOKENS, seed=13)
    x, y = p + q, p + r
    with _engine(model, tmp_path / "store", spec) as llm:
        sched, _ = connectors(llm)
        side = sched.scheduler_side
        assert side.geo.scheme.geometry.eagle, "the geometry must follow vLLM's EAGLE block drop"
        assert side.geo.identity.drafter.startswith("eagle:"), "the drafter must enter the key fingerprint"
        draft_prefix = f"model.layers.{_num_target_layers(llm)}."
        draft_layers = [n for n in _pages_layer_names(llm) if n.startswith(draft_prefix)]
        assert len(draft_layers) == 1, f"one draft attention layer expected: {draft_layers}"

        cold, num_cached = generate(llm, x)
        assert num_cached == 0
        flush_saves(llm)
        local, num_local = generate(llm, x)  # vLLM's own local hit of X: 7 whole blocks, the last dropped
        assert local == cold and num_local == 6 * BLOCK, num_local
        reset_local_cache(llm)
        external, num_external = generate(llm, x)
        assert external == cold
        assert num_external == num_local, f"external hit {num_external} != vLLM's local hit {num_local}"

        # Y diverges right after P: the stored block ending at P was drafted with Q's first token.
        flush_saves(llm)
        reset_local_cache(llm)
        before = _spec_counters(llm)
        hit, num_hit = generate(llm, y)
        assert num_hit == P_TOKENS - BLOCK, f"Y's external hit {num_hit}: P's last block must be dropped"
        loaded = _pages(llm, y)
        after_hit = _spec_counters(llm)

        # The reference: Y computed, nothing from the store (a connector reset rotates the keys) or local.
        flush_saves(llm)
        assert llm.reset_prefix_cache(reset_running_requests=False, reset_connector=True)
        reset_local_cache(llm)
        recomputed, num_cached = generate(llm, y)
        assert num_cached == 0
        reference = _pages(llm, y)
        after_recompute = _spec_counters(llm)

    assert hit == recomputed, "greedy tokens differ after an EAGLE hit"
    assert len(loaded) == len(reference) == len(y) // BLOCK
    for index, (got, want) in enumerate(zip(loaded, reference, strict=True)):
        differing = [name for name in want if not torch.equal(got[name], want[name])]
        assert not differing, f"block {index}: pages differ from a recompute in {differing}"
    print(
        "spec decode counters, Y with its hit:",
        {k: after_hit[k] - before[k] for k in SPEC_COUNTERS},
        "Y recomputed:",
        {k: after_recompute[k] - after_hit[k] for k in SPEC_COUNTERS},
    )


def _pages_layer_names(llm: Any) -> list[str]:
    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return sorted(name for name, layer in context.items() if getattr(layer, "kv_cache", None) is not None)


def _num_target_layers(llm: Any) -> int:
    config = llm.llm_engine.vllm_config
    return int(config.model_config.get_num_layers(config.parallel_config))


@pytest.fixture
def forget_numba() -> Iterator[None]:
    """vLLM's ngram proposer imports numba, hence llvmlite, whose ``ffi.lib`` answers any attribute (even
    ``__dict__``); vLLM 0.32's kernel dispatcher then fails every later engine of this process while it scans
    ``sys.modules`` (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``,
    ``triton_utils/dispatcher.py``). Nothing else here uses numba: its modules leave with the test."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("numba", "llvmlite"):
            del sys.modules[name]


@pytest.mark.usefixtures("forget_numba")
def test_ngram_hits_are_whole_and_keyed_like_the_plain_target(tmp_path: Path) -> None:
    model = build_tiny_model("llama", MODELS_DIR)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    x = prompt(P_TOKENS, seed=11) + prompt(TAIL_TOKENS, seed=12)
    with _engine(model, tmp_path / "store", spec) as llm:
        sched, _ = connectors(llm)
        side = sched.scheduler_side
        assert not side.geo.scheme.geometry.eagle
        assert side.geo.identity.drafter == "", "ngram has no model: the keys are the plain target's"
        cold, _ = generate(llm, x)
        flush_saves(llm)
        local, num_local = generate(llm, x)
        reset_local_cache(llm)
        external, num_external = generate(llm, x)
    assert local == cold and external == cold
    assert num_local == num_external == 7 * BLOCK, (num_local, num_external)
