"""``hybridkv bench scheduler`` through the CLI entry point, small settings (the real vLLM ``Scheduler``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm]


def test_bench_scheduler_rows_ratios_and_the_connector_split(tmp_path: Path) -> None:
    from hybridkv.cli import main

    out = tmp_path / "scheduler.json"
    argv = ["bench", "scheduler", "--requests", "6", "--max-tokens", "16384", "--rounds", "2", "--no-peer"]
    assert main([*argv, "--forward-ms", "0.5", "--idle-steps", "16", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    base, ours = report["rows"]
    assert base["store"] == "(no connector)" and "busy_connector_p99_ms" not in base
    assert report["peer"] is None and report["idle_steps"] == 16
    # The idle steps after the stream give the no-connector run its idle steps.
    assert base["num_idle_steps"] >= 16 and base["idle_schedule_p99_ms"] > 0
    assert ours["idle_p99_ratio"] > 0 and ours["connector_p99_ms"] > 0 and ours["vllm_p99_ms"] > 0
    assert ours["store"].startswith("faulty+memory://") and ours["num_rounds"] == 2
    # The asynchronous probing lookup finds exactly what the synchronous full scan finds.
    assert ours["hit_tokens"] == ours["full_scan_hit_tokens"] > 0
    assert ours["lookup_errors"] == 0 and 1 <= ours["round_trips_max"] <= 4
    # A busy step splits into the connector's own calls and vLLM's work around them.
    for name in ("busy_schedule_p99_ms", "busy_connector_p99_ms", "busy_vllm_p99_ms"):
        assert ours[name] > 0, name
    assert ours["busy_connector_p99_ms"] <= ours["busy_schedule_p99_ms"]
    for round_row in report["rounds"][ours["store"]]:
        assert round_row["busy_connector_p99_ms"] <= round_row["busy_schedule_p99_ms"]
    # Ratios are taken within a round, then the median (of two rounds: their mean).
    ratios = [
        r["busy_schedule_p99_ms"] / b["busy_schedule_p99_ms"]
        for r, b in zip(report["rounds"][ours["store"]], report["rounds"]["(no connector)"], strict=True)
    ]
    assert ours["busy_p99_ratio"] == pytest.approx(sum(ratios) / 2)
    # The targets table: each of the connector row's numbers against its limit.
    targets = {t["target"]: t for t in report["targets"]}
    store = ours["store"]
    busy = targets[f"{store}: busy schedule() p99 / no connector"]
    assert busy["value"] == ours["busy_p99_ratio"] and busy["met"] == (ours["busy_p99_ratio"] <= 1.2)
    assert targets[f"{store}: hit tokens / full scan's"] == {
        "target": f"{store}: hit tokens / full scan's",
        "value": 1.0,
        "limit": "== 1",
        "met": True,
    }
    trips = targets[f"{store}: store round trips per lookup (max)"]
    assert trips["value"] == ours["round_trips_max"] and trips["met"] is True
    idle = targets[f"{store}: idle-step schedule() p99 / no connector"]
    assert idle["value"] == ours["idle_p99_ratio"] and idle["limit"] == "<= 1.5"
    assert not any("MooncakeStoreConnector" in t["target"] for t in report["targets"])
