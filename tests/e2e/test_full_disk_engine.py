"""A real engine on a ``file://`` store whose file system is far smaller than its capacity (issue 37, item 2).

A child process gets a private mount namespace (``unshare --mount``) with a 2 MiB tmpfs and runs a CPU vLLM
engine with the connector on ``capacity=1GiB`` there. It saves distinct prompts until it wrote more than twice
the file system; then the newest prompt is sent again with the device prefix cache dropped. What must hold: the
saves kept succeeding after the file system filled (no failed key, no failed wave), the resend takes its
prefix from the store, and its tokens are identical to the cold run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.tmpfs import run_on_private_tmpfs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

_TMPFS_BYTES = 2 << 20

_CHILD = r"""
import json, subprocess, sys
from pathlib import Path

root, tests_dir, tmpfs_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, tests_dir)
from hybridkv.demo.tiny_models import build_tiny_model
from support.engines import MODELS_DIR, audit, connectors, engine, flush_saves, generate, prompt, reset_local_cache

model = build_tiny_model("llama", MODELS_DIR)
log_path = Path(root).parent / "audit.jsonl"
extra = {"store": f"file://{root}/store?capacity=1GiB", "audit_log": str(log_path)}
out = {}
with engine(model, extra) as llm:
    _sched, worker = connectors(llm)
    totals = worker.worker_side.stats.totals
    num_prompts = 0
    cold = []
    while num_prompts < 400:
        tokens = prompt(300, seed=1000 + num_prompts)
        cold, _ = generate(llm, tokens)
        flush_saves(llm)
        num_prompts += 1
        if totals.get("save_bytes", 0) > 2 * tmpfs_bytes:
            break
    reset_local_cache(llm)
    warm, cached = generate(llm, tokens)
    out.update(
        num_prompts=num_prompts,
        save_bytes=totals.get("save_bytes", 0),
        save_failed_keys=totals.get("save_failed_keys", 0),
        cold=cold,
        warm=warm,
        cached=cached,
        effective=worker.worker_side.gauges().get("store_effective_capacity_bytes"),
    )
out["failed_waves"] = sum(1 for r in audit(log_path) if r["wave"] is not None and r["dst"] == "FAILED")
print(json.dumps(out))
"""


def test_an_engine_keeps_saving_and_hitting_after_its_file_system_filled(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    tests_dir = Path(__file__).resolve().parents[1]
    result = run_on_private_tmpfs(
        _CHILD,
        [str(root), str(tests_dir), str(_TMPFS_BYTES)],
        mount_at=root,
        tmpfs_bytes=_TMPFS_BYTES,
        timeout=900,
    )
    assert result["save_bytes"] > 2 * _TMPFS_BYTES, f"the file system never filled: {result}"
    assert result["save_failed_keys"] == 0, f"saves failed after the file system filled: {result}"
    assert result["failed_waves"] == 0, result
    assert result["cached"] > 0, f"the newest prompt did not hit the store: {result}"
    assert result["warm"] == result["cold"], "tokens differ after an external hit"
    assert result["effective"] is not None and result["effective"] <= _TMPFS_BYTES, result
