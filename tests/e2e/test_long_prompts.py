"""A long prompt on a real hybrid engine: 32K tokens of Qwen3-Next (GDN + full attention), external hit exact.

vLLM prefills it in chunks of 8192 tokens; the store receives every full-attention block and the GDN state
at each chunk's end. The local cache dropped, the resend's prefix comes from the store: the external hit
covers every whole block up to the last boundary with a stored state, and the greedy tokens equal the cold
run's. The lookup asks for 32K tokens' keys (2 groups) and the load restores them in one job.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridkv.demo.tiny_models import build_tiny_model
from hybridkv.ops import inprocess
from support.engines import MODELS_DIR, connectors, flush_saves, generate, prompt, reset_local_cache

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BLOCK = 128
NUM_TOKENS = 32 * 1024 + 100
CHUNK = 8192


def test_a_32k_prompt_comes_back_from_the_store_with_identical_tokens(tmp_path: Path) -> None:
    model = build_tiny_model("qwen3_next", MODELS_DIR, max_position_embeddings=40960)
    transfer = inprocess.connector_transfer_config({"store": f"file://{tmp_path}/store"})
    tokens = prompt(NUM_TOKENS, seed=21)
    with inprocess.inprocess_engine(
        model,
        transfer,
        max_model_len=NUM_TOKENS + 64,
        max_num_batched_tokens=CHUNK,
        kv_cache_memory_bytes=512 << 20,
    ) as llm:
        sched, _ = connectors(llm)
        stats = sched.scheduler_side.stats
        cold, num_cached = generate(llm, tokens)
        assert num_cached == 0
        flush_saves(llm)
        reset_local_cache(llm)
        before = stats.totals.get("hit_tokens", 0)
        hot, num_cached = generate(llm, tokens)
        num_external = int(stats.totals.get("hit_tokens", 0) - before)
        truncations = stats.totals.get("truncations", 0)
    assert num_external == num_cached, (num_external, num_cached)
    # The GDN state is stored at every chunk end (8192, ..., 32768): the hit reaches the last one.
    assert num_external == 4 * CHUNK, f"external hit {num_external} of a {NUM_TOKENS}-token prompt"
    assert truncations == 0
    assert hot == cold, "tokens differ after a 32K external hit"
