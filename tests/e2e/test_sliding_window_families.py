"""Sliding-window families on a real engine: external hits give the local hit's greedy tokens.

Cohere2 (3 sliding-window groups + 1 full, one layer each), Gemma2 (sliding + full, logit soft-capping),
GPT-OSS (sliding + full, attention sinks, MoE) and Olmo3 (3 sliding + 1 full, QK-norm; vLLM 0.32 runs it
through its Transformers modeling backend), each with a 64-token window under 128-token blocks. One
engine serves a prompt of 5 blocks and a tail cold, stores it, serves it again from vLLM's own prefix cache
(the reference: where bf16 near-ties make vLLM's local hit differ from the cold run, the external hit must
equal the local hit), drops the local cache and resends: the 5 blocks come from the store -- every block
of the full-attention group, only the last block of each sliding group (the window below the hit) -- and
the tokens are the local hit's. A fresh engine on the same store directory resends: the same hit, the same
tokens. A third engine reads the directory through a chaos view (failed and corrupt gets, corrupt puts):
the loads meet faults, the requests recompute past the last boundary without one (here: every time from
0), and the tokens do not change.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hybridkv.demo.tiny_models import build_tiny_model
from support.engines import MODELS_DIR, connectors, engine, flush_saves, generate, prompt, reset_local_cache

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BLOCK = 128  # vLLM's block for every group of these families here
WINDOW = 64  # the tiny configs' sliding window
PROMPT_LEN = 5 * BLOCK + 60
HIT = 5 * BLOCK
MAX_TOKENS = 16
#: Per family: the KV-cache groups vLLM makes, as the connector names their kinds.
GROUP_KINDS = {
    "cohere2": ["swa", "swa", "swa", "full"],
    "gemma2": ["swa", "full"],
    "gpt_oss": ["swa", "full"],
    "olmo3": ["swa", "swa", "swa", "full"],
}
#: Blocks a sliding group loads for a hit of ``HIT`` tokens: the window below the hit, in whole blocks.
SWA_BLOCKS = -(-WINDOW // BLOCK)
CHAOS = "get_fail=0.3&corrupt=0.2&seed=7"
CHAOS_RESENDS = 3


def _group_kinds(sched: Any) -> list[str]:
    """The kind of each group in the connector's geometry (``'0:swa/SlidingWindowSpec span=128 ...'``)."""
    groups = sched.scheduler_side.geo.describe()["groups"]
    kinds = []
    for index, text in enumerate(groups):
        number, rest = text.split(":", 1)
        assert int(number) == index, groups
        assert f"span={BLOCK} " in rest, f"expected block {BLOCK}: {groups}"
        kinds.append(rest.split("/", 1)[0])
    return kinds


def _request(llm: Any) -> Callable[[list[int]], tuple[list[int], int, int]]:
    """One greedy request on ``llm``: (output tokens, vLLM's cached tokens, the connector's external hit
    tokens, counted at lookup: a load that fails later still counts them)."""
    sched, _ = connectors(llm)
    stats = sched.scheduler_side.stats

    def run(tokens: list[int]) -> tuple[list[int], int, int]:
        before = stats.totals.get("hit_tokens", 0)
        out, num_cached = generate(llm, tokens, MAX_TOKENS)
        return out, num_cached, int(stats.totals.get("hit_tokens", 0) - before)

    return run


@pytest.mark.parametrize("family", sorted(GROUP_KINDS))
def test_sliding_window_family_external_hits_give_identical_tokens(family: str, tmp_path: Path) -> None:
    started = time.monotonic()
    model = build_tiny_model(family, MODELS_DIR)
    store = f"{tmp_path}/store?capacity=256MiB"
    tokens = prompt(PROMPT_LEN, seed=6)

    with engine(model, {"store": f"file://{store}"}) as llm:
        sched, _ = connectors(llm)
        kinds = _group_kinds(sched)
        assert kinds == GROUP_KINDS[family], (
            f"{family}: groups {sched.scheduler_side.geo.describe()['groups']}"
        )
        run = _request(llm)
        cold, num_cached, num_external = run(tokens)
        assert (num_cached, num_external) == (0, 0), family
        flush_saves(llm)
        local, num_cached, num_external = run(tokens)
        assert (num_cached, num_external) == (HIT, 0), f"{family}: local hit {num_cached} (+{num_external})"
        reset_local_cache(llm)
        hit, num_cached, num_external = run(tokens)
        totals = dict(sched.scheduler_side.stats.totals)
    assert (num_cached, num_external) == (HIT, HIT), f"{family}: hit {num_cached}, external {num_external}"
    assert hit == local, f"{family}: an external hit's tokens differ from the local hit's\n{hit}\n{local}"
    if cold == local:
        assert hit == cold
    else:
        print(f"\n{family}: vLLM's local hit differs from the cold run (bf16 near-tie)\n{cold}\n{local}")
    assert totals.get("truncations", 0) == 0, totals
    # The full-attention group loads every block of the hit, a sliding group only its window's.
    loaded = [totals.get(f"loaded_blocks.g{g}", 0) for g in range(len(kinds))]
    assert loaded == [HIT // BLOCK if kind == "full" else SWA_BLOCKS for kind in kinds], (family, loaded)

    # A fresh engine on the same store directory (the first one is shut down).
    with engine(model, {"store": f"file://{store}"}) as llm:
        fresh, num_cached, num_external = _request(llm)(tokens)
    assert (num_cached, num_external) == (HIT, HIT), (
        f"{family}: fresh engine hit {num_cached}, {num_external}"
    )
    assert fresh == local, f"{family}: a fresh engine's external hit gives other tokens\n{fresh}\n{local}"

    # The same directory through a chaos view: loads fail or are corrupt in part, puts are corrupt in part.
    with engine(model, {"store": f"faulty+file://{store}&{CHAOS}"}) as llm:
        sched, worker = connectors(llm)
        run = _request(llm)
        chaos_hits = []  # (vLLM's cached tokens, the connector's planned external tokens) per resend
        for _ in range(CHAOS_RESENDS):
            out, num_cached, num_external = run(tokens)
            chaos_hits.append((num_cached, num_external))
            assert num_cached <= num_external <= HIT, (family, chaos_hits)
            # A request that recomputes from 0 computes what the cold run did; one with a hit, the local hit.
            expected = cold if num_cached == 0 else local
            assert out == expected, (
                f"{family}: tokens differ under chaos ({num_cached} cached)\n{out}\n{expected}"
            )
            flush_saves(llm)
            reset_local_cache(llm)
        assert sched.scheduler_side.wait_maintenance(10), "invalidation removes still running after 10 s"
        s_tot, w_tot = dict(sched.scheduler_side.stats.totals), dict(worker.worker_side.stats.totals)
    # The chaos view did inject faults into the loads, and every fault ended in a truncation.
    assert w_tot.get("load_failed_keys", 0) > 0, (family, chaos_hits, w_tot)
    assert s_tot.get("truncations", 0) > 0, (family, chaos_hits, s_tot)
    print(
        f"\n{family}: groups {kinds}, block {BLOCK}, hit {HIT} (loaded blocks {loaded}), tokens {local}, "
        f"chaos (cached, external) {chaos_hits}, truncations {s_tot['truncations']}, "
        f"failed keys {w_tot['load_failed_keys']}, {time.monotonic() - started:.1f} s"
    )
