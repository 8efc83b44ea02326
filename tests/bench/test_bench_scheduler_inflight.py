"""``hybridkv bench scheduler``'s may_load_async axis (vLLM 0.34's ``--max-num-inflight-kv-loads``), small
settings: the report's shape and what holds whatever the timing (never a wall-clock number)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from hybridkv.connector.vllm_compat import vllm_release

pytestmark = [pytest.mark.vllm]

ON, OFF = "may_load_async on", "may_load_async off"
HITS = 4
LOAD_STEPS = 3


@pytest.mark.skipif(vllm_release() < (0, 34), reason="may_load_async came with vLLM 0.34")
def test_bench_scheduler_inflight_arms_and_what_they_measure(tmp_path: Path) -> None:
    from hybridkv.cli import main

    out = tmp_path / "scheduler.json"
    argv = ["bench", "scheduler", "--requests", "2", "--max-tokens", "4096", "--rounds", "2", "--no-peer"]
    argv += ["--idle-steps", "4", "--inflight", "--inflight-hits", str(HITS)]
    assert main([*argv, "--inflight-load-steps", str(LOAD_STEPS), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    inflight = report["inflight"]
    assert inflight["settings"]["load_steps"] == LOAD_STEPS and inflight["num_rounds"] == 2
    rows = {row["arm"]: row for row in inflight["rows"]}
    assert sorted(rows) == sorted([ON, OFF])
    for arm, row in rows.items():
        runs = inflight["runs"][arm]
        assert len(runs) == row["num_rounds"] == 2 and row["hits"] == 2 * HITS, arm
        # Every hit request loaded its prefix (checked slot by slot against a recompute) and then ran.
        assert row["hits_loaded"] == row["hits"], arm
        for run in runs:
            for hit in run["hits"]:
                assert hit["loaded_tokens"] > 0 and hit["load_start_steps"] >= 0, (arm, hit)
                # A load takes LOAD_STEPS engine steps; the request runs no earlier than its KV is there.
                assert hit["first_token_steps"] >= hit["load_start_steps"] + LOAD_STEPS, (arm, hit)
        medians = [statistics.median(h["first_token_steps"] for h in run["hits"]) for run in runs]
        assert row["first_token_steps_p50"] == statistics.median(medians), arm
        assert row["first_token_steps_p50_spread"] == f"{min(medians):g}..{max(medians):g}", arm
    # With vLLM's default answer a hit waits in the plain queue, which starts nothing while the running batch
    # is full; with the connector's hook, hits arriving behind the full batch start their loads there.
    assert rows[OFF]["loads_started_batch_full"] == 0
    assert rows[ON]["loads_started_batch_full"] > 0
    saved = [
        statistics.median(h["first_token_steps"] for h in off["hits"])
        - statistics.median(h["first_token_steps"] for h in on["hits"])
        for on, off in zip(inflight["runs"][ON], inflight["runs"][OFF], strict=True)
    ]
    assert inflight["steps_saved_p50"] == statistics.median(saved)
    # The targets table is the scheduler bench's own: the axis adds no target.
    assert not any("may_load_async" in t["target"] for t in report["targets"])


@pytest.mark.skipif(vllm_release() >= (0, 34), reason="vLLM 0.34 has may_load_async")
def test_bench_scheduler_inflight_before_034_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridkv.cli import main

    out = tmp_path / "scheduler.json"
    assert main(["bench", "scheduler", "--inflight", "--no-peer", "--requests", "1", "--out", str(out)]) == 2
    assert "error: --inflight: vLLM" in capsys.readouterr().err
    assert not out.exists()
