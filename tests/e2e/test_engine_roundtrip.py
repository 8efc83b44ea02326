"""Real vLLM (CPU build) + HybridStoreConnector + tiny random-weight models: store, reload, same tokens.

Cold run stores the prompt's blocks; the device prefix cache is dropped; the exact resend must take its
prefix from the store (``num_cached_tokens`` > 0, per-group hit counters, loaded bytes) and produce the
same greedy tokens. Under the chaos wrapper every load fails or is corrupt: the request recomputes, the
tokens are still identical, the engine never errors, and the truncation is in the stats and audit log.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from hybridkv.audit.replay import audit_file
from hybridkv.connector.scheduler.lookup_process import RESTART_BACKOFF_S
from hybridkv.demo.tiny_models import build_tiny_model
from support.engines import MODELS_DIR, audit, connectors, engine, generate, prompt, reset_local_cache

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPT_LEN = 300  # two full 128-token blocks + a tail; every family's groups have block 128 here


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_next", "lfm2"])
def test_store_then_reload_gives_identical_tokens(family: str, tmp_path: Path) -> None:
    model = build_tiny_model(family, MODELS_DIR)
    log_path = tmp_path / "audit.jsonl"
    extra = {
        "store": f"file://{tmp_path}/store?capacity=256MiB",
        "audit_log": str(log_path),
    }
    tokens = prompt(PROMPT_LEN)
    with engine(model, extra) as llm:
        cold, cached0 = generate(llm, tokens)
        assert cached0 == 0
        reset_local_cache(llm)
        warm, cached1 = generate(llm, tokens)
        sched, worker = connectors(llm)
        s_tot, w_tot = dict(sched.scheduler_side.stats.totals), dict(worker.worker_side.stats.totals)
        num_groups = len(sched.scheduler_side.geo.groups)  # the connector is shut down with the engine
    assert warm == cold, f"{family}: tokens differ after an external hit"
    assert cached1 == 256, f"{family}: expected 256 external tokens, got {cached1}"
    # Every group restored blocks, and the scheduler's per-group count is what the worker read (TP 1: a key
    # per block).
    loaded = [s_tot.get(f"loaded_blocks.g{g}", 0) for g in range(num_groups)]
    assert all(loaded) and sum(loaded) == w_tot["load_keys"], (loaded, w_tot["load_keys"])
    assert s_tot.get("truncations", 0) == 0
    assert w_tot["load_bytes"] > 0 and w_tot["save_bytes"] >= w_tot["load_bytes"]
    records = audit(log_path)
    states = [(r["src"], r["dst"]) for r in records if r["wave"] is None]
    assert ("LOADING", "VERIFIED") in states and ("LOADING", "TRUNCATED") not in states
    waves = [r["dst"] for r in records if r["wave"] is not None]
    assert "STORED" in waves and "FAILED" not in waves
    report = audit_file(log_path)
    assert report.ok, report.to_dict()["violations"]


def test_fresh_engine_reads_previous_engines_store(tmp_path: Path) -> None:
    model = build_tiny_model("qwen3_next", MODELS_DIR)
    extra = {"store": f"file://{tmp_path}/store?capacity=256MiB"}
    tokens = prompt(PROMPT_LEN, seed=7)
    with engine(model, extra) as llm:
        cold, _ = generate(llm, tokens)
    with engine(model, extra, module_path=False) as llm:  # found through the vllm.general_plugins entry point
        warm, cached = generate(llm, tokens)
    assert cached == 256 and warm == cold


@pytest.mark.parametrize(
    ("family", "fault"), [("qwen3_next", "get_fail=1"), ("lfm2", "corrupt=1"), ("llama", "corrupt=1")]
)
def test_failed_loads_truncate_and_recompute(family: str, fault: str, tmp_path: Path) -> None:
    model = build_tiny_model(family, MODELS_DIR)
    log_path = tmp_path / "audit.jsonl"
    extra = {
        "store": f"faulty+file://{tmp_path}/store?capacity=256MiB&{fault}&seed=3",
        "audit_log": str(log_path),
    }
    tokens = prompt(PROMPT_LEN, seed=11)
    with engine(model, extra) as llm:
        cold, _ = generate(llm, tokens)
        reset_local_cache(llm)
        warm, cached = generate(llm, tokens)
        sched, worker = connectors(llm)
        assert sched.scheduler_side.wait_maintenance(10), "invalidation removes still running after 10 s"
        s_tot, w_tot = dict(sched.scheduler_side.stats.totals), dict(worker.worker_side.stats.totals)
    assert warm == cold, f"{family} with {fault}: tokens differ after a failed load"
    assert cached == 0, "a failed load must not leave external tokens behind"
    assert s_tot["truncations"] == 1
    if fault.startswith("corrupt"):
        # A definite fault: the corrupt entries are removed from the store.
        assert s_tot["invalidated_entries"] > 0
    else:
        # A transport failure proves nothing about the entries: they stay, the fault is counted.
        assert s_tot.get("invalidated_entries", 0) == 0 and s_tot["load_transient_faults"] > 0
    assert w_tot["load_failed_keys"] > 0
    records = audit(log_path)
    trunc = [r for r in records if r["dst"] == "TRUNCATED"]
    # Every entry failed, the first full-attention block too: nothing below the plan is free of a failed
    # entry, so the retry cap is 0.
    assert len(trunc) == 1 and trunc[0]["boundary"] == 0, trunc
    assert trunc[0]["detail"]["retry_cap"] == 0 and trunc[0]["detail"]["planned_boundary"] == 256, trunc
    # The one retry (capped at 0) is a miss, then the prompt recomputes: no second load, no loop.
    after = [
        (r["src"], r["dst"])
        for r in records
        if r["wave"] is None and r["request_id"] == trunc[0]["request_id"]
    ]
    assert after[after.index(("LOADING", "TRUNCATED")) + 1 :][:2] == [
        ("TRUNCATED", "LOOKUP"),
        ("LOOKUP", "MISS"),
    ]
    report = audit_file(log_path)
    assert report.ok and report.num_truncations == 1, report.to_dict()


def test_shared_prefix_hits_whole_blocks_on_a_single_group_model(tmp_path: Path) -> None:
    """Llama: a new prompt sharing 200 tokens with a stored one loads its first whole block (128)."""
    model = build_tiny_model("llama", MODELS_DIR)
    extra = {"store": f"file://{tmp_path}/store?capacity=256MiB"}
    a = prompt(PROMPT_LEN, seed=21)
    b = a[:200] + prompt(60, seed=22)
    with engine(model, extra) as llm:
        generate(llm, a)
        baseline, _ = generate(llm, b)  # B's reference output, computed with A's device-cached prefix
        reset_local_cache(llm)
        llm.llm_engine.engine_core.engine_core.scheduler.connector.reset_cache()  # forget B's blocks...
        generate(llm, a)  # ...and store only A's again
        reset_local_cache(llm)
        out, cached = generate(llm, b)
    assert cached == 128 and out == baseline


def test_lookups_in_their_own_process_hit_and_survive_its_death(tmp_path: Path) -> None:
    """``lookup_process: true`` on a real engine: the reload hits as with the lookup thread (same tokens,
    same audit); the lookup process killed between requests costs lookups, never a request or the engine,
    and a new one serves the next hit."""
    model = build_tiny_model("qwen3_next", MODELS_DIR)
    log_path = tmp_path / "audit.jsonl"
    extra = {
        "store": f"file://{tmp_path}/store?capacity=256MiB",
        "audit_log": str(log_path),
        "lookup_process": True,
    }
    tokens = prompt(PROMPT_LEN, seed=11)
    with engine(model, extra) as llm:
        cold, cached0 = generate(llm, tokens)
        reset_local_cache(llm)
        warm, cached1 = generate(llm, tokens)
        sched, _worker = connectors(llm)
        lookups = sched.scheduler_side.lookups
        pid = lookups.child_pid
        assert pid is not None, "no lookup process runs"
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while lookups.child_pid == pid and time.monotonic() < deadline:  # its receiver sees the end
            time.sleep(0.05)
        reset_local_cache(llm)
        after_kill, _ = generate(llm, tokens)  # a miss or a hit: either way the same tokens
        time.sleep(RESTART_BACKOFF_S)
        hit_again = 0
        for _ in range(10):  # the next lookups start a new process; one of them hits
            reset_local_cache(llm)
            again, hit_again = generate(llm, tokens)
            assert again == cold
            if hit_again:
                break
            time.sleep(RESTART_BACKOFF_S)
        starts = lookups.num_process_starts
    assert cached0 == 0 and cached1 == 256 and warm == cold and after_kill == cold
    assert hit_again == 256, "no hit after the lookup process was started again"
    assert starts == 2, starts
    report = audit_file(log_path)
    assert report.ok, report.to_dict()["violations"]
