"""Real vLLM (CPU build) + HybridStoreConnector over a real ``mooncake_master`` (loopback, private netns).

The connector's ``mooncake://`` store runs Mooncake in embedded mode: each client (the scheduler half and
the worker half of the in-process engine) mounts its own segment, and the stored bytes live in the
segments of *this engine process*. Reuse therefore works within the process that stored them (a cold
request, ``reset_prefix_cache()``, the resend takes its prefix from Mooncake). When the engine shuts down
its segments are unmounted and the entries go with them, so a later engine process does not find them
(not exercised here; use ``file://`` or a standalone ``mooncake_client`` segment for cross-process reuse).

Run with ``scripts/netns-run .venv/bin/python -m pytest tests/e2e/test_mooncake_engine.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridkv.audit.replay import audit_file
from hybridkv.demo.tiny_models import build_tiny_model
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from support.engines import MODELS_DIR, audit, connectors, engine, generate, prompt, reset_local_cache
from support.mooncake import new_master

pytestmark = [pytest.mark.slow, pytest.mark.mooncake, pytest.mark.vllm]

PROMPT_LEN = 300


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    m = new_master(tmp_path_factory)
    yield m
    m.stop()


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2"])
def test_mooncake_store_then_reload_gives_identical_tokens(
    family: str, master: MooncakeMaster, tmp_path: Path
) -> None:
    model = build_tiny_model(family, MODELS_DIR)
    log_path = tmp_path / "audit.jsonl"
    extra = {
        # A namespace per test: the master outlives each engine.
        "store": master.url(segment="64MiB", local_buffer="16MiB", timeout_ms=5000),
        "namespace": f"e2e-{family}",
        "audit_log": str(log_path),
        # Measured: on a 2-core host at load ~14, the first Mooncake exists of an engine took longer than
        # the default budget (a TimeoutError, then a miss): the test asserts no lookup errors.
        "lookup_budget_ms": 5000,
    }
    tokens = prompt(PROMPT_LEN, seed=31)
    with engine(model, extra) as llm:
        sched, worker = connectors(llm)
        assert sched.scheduler_side.store.url.startswith("mooncake://")
        cold, cached0 = generate(llm, tokens)
        assert cached0 == 0
        reset_local_cache(llm)  # drop the device prefix cache; Mooncake keeps the blocks
        warm, cached1 = generate(llm, tokens)
        s_tot, w_tot = dict(sched.scheduler_side.stats.totals), dict(worker.worker_side.stats.totals)
        num_groups = len(sched.scheduler_side.geo.groups)
    assert warm == cold, f"{family}: tokens differ after a Mooncake hit"
    assert cached1 == 256, f"{family}: expected 256 external tokens, got {cached1}"
    assert num_groups > 1
    loaded = [s_tot.get(f"loaded_blocks.g{g}", 0) for g in range(num_groups)]
    assert all(loaded) and sum(loaded) == w_tot["load_keys"], (loaded, w_tot["load_keys"])
    assert s_tot.get("truncations", 0) == 0 and s_tot.get("lookup_errors", 0) == 0
    assert w_tot["load_bytes"] > 0 and w_tot.get("load_failed_keys", 0) == 0
    assert w_tot["save_keys"] > 0 and w_tot.get("save_failed_keys", 0) == 0
    states = [(r["src"], r["dst"]) for r in audit(log_path) if r["wave"] is None]
    assert ("LOADING", "VERIFIED") in states
    report = audit_file(log_path)
    assert report.ok, report.to_dict()["violations"]
