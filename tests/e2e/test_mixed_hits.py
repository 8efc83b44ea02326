"""Real engines: one request whose prefix comes partly from vLLM's local cache and partly from the store.

X = P + Q is served cold and stored, and so is P; the local cache is dropped; P runs (its prefix comes
back from the store and stays local); X runs: vLLM finds P locally and asks the connector for the tokens past it, which
come from the store (a *mixed* hit: local and external tokens on one request, both counted). Then the
local cache is dropped again and P + R runs (R diverging from Q: the local prefix now runs past P on
another branch); X again mixes P's local blocks with Q's stored ones. Every run's greedy tokens equal the
cold run's, on every family the tests build: full attention, sliding window, gated delta net, short conv.

The engines run with ``divergent_local_hits``: after P + R the recurrent families keep P's full-attention
pages as vLLM's local hit although their state at P's end is gone, and the store completes X past them
(without the switch vLLM would report no local hit and the store would serve X's whole prefix).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridkv.demo.tiny_models import build_tiny_model
from support.engines import MODELS_DIR, connectors, engine, flush_saves, generate, prompt, reset_local_cache

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BLOCK = 128  # every family's groups have block 128 here
#: Families whose local prefix P is still vLLM's local hit after P + R ran: full attention only, and the
#: full-attention + recurrent families through ``divergent_local_hits`` (their state at P's end is not local:
#: only P + R's). Sliding window (gemma3) has no window at P's end locally and the switch stays off for it
#: (no load restores window blocks below a local hit), so its local hit is 0 and the store serves X's whole
#: prefix.
LOCAL_PREFIX_SURVIVES_DIVERGENCE = {"llama", "qwen3_next", "lfm2"}


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_next", "lfm2"])
def test_local_and_external_tokens_on_one_request_give_identical_tokens(family: str, tmp_path: Path) -> None:
    model = build_tiny_model(family, MODELS_DIR)
    p, q, r = prompt(2 * BLOCK + 4, seed=11), prompt(2 * BLOCK + 44, seed=12), prompt(2 * BLOCK + 44, seed=13)
    x = p + q
    config = {"store": f"file://{tmp_path}/store?capacity=256MiB", "divergent_local_hits": True}
    with engine(model, config) as llm:
        sched, _ = connectors(llm)
        stats = sched.scheduler_side.stats

        def run(tokens: list[int]) -> tuple[list[int], int, int]:
            """(greedy tokens, local hit tokens, external hit tokens) of one request."""
            before = stats.totals.get("hit_tokens", 0)
            out, num_cached = generate(llm, tokens)
            num_external = int(stats.totals.get("hit_tokens", 0) - before)
            return out, num_cached - num_external, num_external

        cold, num_local, num_external = run(x)
        assert (num_local, num_external) == (0, 0)
        flush_saves(llm)
        reset_local_cache(llm)

        # A recurrent group restores only at a boundary whose state was stored: X's run stored the state at
        # X's end, so P runs once to store its own (full attention: P already comes back from X's blocks).
        run(p)
        flush_saves(llm)
        reset_local_cache(llm)
        _, num_local, num_external = run(p)  # P comes back from the store and stays local
        assert (num_local, num_external) == (0, 2 * BLOCK), family
        flush_saves(llm)
        mixed, num_local, num_external = run(x)
        assert num_local > 0 and num_external > 0, f"{family}: not a mixed hit ({num_local} + {num_external})"
        assert num_local + num_external == 4 * BLOCK, (family, num_local, num_external)
        assert mixed == cold, (
            f"{family}: tokens differ on a mixed hit ({num_local} local + {num_external} ext)"
        )

        flush_saves(llm)
        reset_local_cache(llm)
        run(p + r)  # the local prefix now diverges from X after P
        flush_saves(llm)
        diverged, num_local, num_external = run(x)
        assert diverged == cold, f"{family}: tokens differ after a divergent local prefix"
        assert num_local + num_external == 4 * BLOCK, (family, num_local, num_external)
        if family in LOCAL_PREFIX_SURVIVES_DIVERGENCE:
            assert num_local > 0 and num_external > 0, f"{family}: not a mixed hit after a divergent prefix"
        else:
            assert num_local == 0, f"{family}: a local hit after a divergent prefix ({num_local})"
        assert sched.scheduler_side.stats.totals.get("truncations", 0) == 0
