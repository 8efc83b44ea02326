"""Session hints on a real engine: a session's prefix outlives a flood of one-off prompts in a small file store.

A tiny Llama (one full-attention group, 64 KiB blocks) on a ``file://`` store with room for about a dozen
blocks. The session's prompt S (4 blocks) is sent with ``kv_transfer_params.hybridkv_session``; a control
prompt C of the same size without. Then six one-off prompts of 4 blocks each flood the store, far past its
capacity. With the local cache dropped, S comes back from the store (every block: its entries were retained,
within half the capacity) with the cold run's tokens, while C's entries were evicted (no external hit). A
malformed hint is refused, counted, and its request served as usual. The session's requests carry their
hint in their audit records (``lookup_started``'s detail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hybridkv.demo.tiny_models import build_tiny_model
from hybridkv.ops import inprocess
from support.engines import MODELS_DIR, audit, connectors, flush_saves, prompt, reset_local_cache

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BLOCK = 128
NUM_BLOCKS = 4
#: About twelve framed 64 KiB blocks: the six floods (24 blocks) evict everything unretained.
CAPACITY = "800KiB"


def _run(
    llm: Any, tokens: list[int], kv_transfer_params: dict[str, Any] | None = None
) -> tuple[list[int], int]:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, extra_args=extra)
    out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def test_a_sessions_prefix_outlives_a_flood_and_a_bad_hint_is_refused(tmp_path: Path) -> None:
    model = build_tiny_model("llama", MODELS_DIR)
    audit_path = tmp_path / "audit.jsonl"
    transfer = inprocess.connector_transfer_config(
        {"store": f"file://{tmp_path}/store?capacity={CAPACITY}", "audit_log": str(audit_path)}
    )
    session = {"hybridkv_session": {"id": "chat-1", "ttl_s": 600}}
    s, c = prompt(NUM_BLOCKS * BLOCK + 20, seed=1), prompt(NUM_BLOCKS * BLOCK + 20, seed=2)
    floods = [prompt(NUM_BLOCKS * BLOCK + 20, seed=100 + i) for i in range(6)]
    with inprocess.inprocess_engine(model, transfer) as llm:
        sched, _ = connectors(llm)
        side = sched.scheduler_side
        cold_s, _ = _run(llm, s, session)
        cold_c, _ = _run(llm, c)
        flush_saves(llm)
        assert side.wait_maintenance(10.0)
        assert side.stats.totals.get("session_retained_keys", 0) == NUM_BLOCKS, side.stats.totals
        for tokens in floods:
            _run(llm, tokens)
            flush_saves(llm)
        reset_local_cache(llm)
        hot_s, hit_s = _run(llm, s, session)
        hot_c, hit_c = _run(llm, c)
        bad, _ = _run(llm, floods[0], {"hybridkv_session": {"id": "chat-2", "ttl_s": -1}})
        flush_saves(llm)
        assert side.wait_maintenance(10.0)
        totals = dict(side.stats.totals)
    assert hit_s == NUM_BLOCKS * BLOCK, f"the session's prefix was evicted: external hit {hit_s}"
    assert hot_s == cold_s
    assert hit_c == 0, f"the control prompt survived a flood of {len(floods) * NUM_BLOCKS} blocks: {hit_c}"
    assert hot_c == cold_c
    assert len(bad) == 8
    assert totals.get("session_hints_refused", 0) == 1, totals
    # The hit renewed the session's four entries.
    assert totals.get("session_retained_keys", 0) == 2 * NUM_BLOCKS, totals
    assert totals.get("session_retain_failed", 0) == 0, totals
    # The session's requests say so in their audit records (the first record of each lookup).
    starts = [r for r in audit(audit_path) if r["event"] in ("lookup_started", "lookup_restarted")]
    with_session = [r["detail"] for r in starts if r["detail"] is not None]
    assert with_session and all(
        d == {"session": "chat-1", "session_ttl_s": 600.0, "session_end": False} for d in with_session
    ), with_session
    assert len({r["request_id"] for r in starts if r["detail"] is not None}) == 2  # cold and hot S
