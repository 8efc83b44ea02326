"""``hybridkv bench scale --axis mooncake-entries`` and ``--axis prompt-length`` at CI size, run as a user
would: the reports' shape and internal consistency (never their timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridkv.cli import main
from hybridkv_dev.bench.scale import LOOKUP_KEYS, LOOKUP_ROUND_TRIPS, PUT_KEYS

_REPEATS = 2


def _spread_ok(row: dict[str, object], name: str) -> None:
    low, high = (float(part) for part in str(row[f"{name}_spread"]).split(".."))
    assert low <= high, f"{name}: spread {row[f'{name}_spread']}"


@pytest.mark.mooncake
def test_mooncake_entries_axis_reports_every_size_consistently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridkv_dev.bench.scale_mooncake import MIN_ENTRIES, TABLE_COLUMNS
    from support.mooncake import assert_loopback_only_namespace

    assert_loopback_only_namespace()  # the bench starts its own masters, on 127.0.0.1 only
    sizes = (MIN_ENTRIES + 200, 2_000)
    out = tmp_path / "scale.json"
    logs = tmp_path / "logs"
    argv = ["bench", "scale", "--axis", "mooncake-entries", "--sizes", ",".join(map(str, sizes))]
    argv += ["--repeats", str(_REPEATS), "--dir", str(logs), "--out", str(out), "--no-plot"]
    assert main(argv) == 0

    report = json.loads(out.read_text())
    assert (report["bench"], report["axis"], report["store"]) == ("scale", "mooncake-entries", "mooncake")
    assert len(report["load_average_before"]) == 3 and len(report["load_average_after"]) == 3
    rows = report["rows"]
    assert [row["entries"] for row in rows] == list(sizes)
    for row in rows:
        entries = row["entries"]
        assert set(TABLE_COLUMNS) <= set(row)
        assert row["repeats"] == _REPEATS and len(row["samples"]) == _REPEATS
        # Every repeat started from a master holding its keys (and at most the last put's more), found all
        # it looked up and got.
        assert entries <= row["keys_before_put_min"] <= row["keys_before_put_max"] <= entries + PUT_KEYS
        assert row["lookup_keys"] == min(LOOKUP_KEYS, entries // 2) == row["lookup_found_min"]
        assert row["lookup_round_trips"] == LOOKUP_ROUND_TRIPS
        assert row["lookup_rpcs"] >= LOOKUP_ROUND_TRIPS
        assert row["get_found_min"] == row["get_keys"] > 0
        # The put took the pool over the watermark and Mooncake's own eviction then ran.
        assert row["usage_after_put_min"] > report["high_watermark"]
        assert 0 < row["evict_evicted"] < entries + PUT_KEYS
        for name in ("open_ms", "lookup_us_per_key", "put_ms", "get_us_per_key", "evict_observed_ms"):
            _spread_ok(row, name)
            assert row[name] > 0
        assert row["client_rss_mib"] > 0 and row["master_rss_mib"] > 0 and row["node_rss_mib"] > 0
    targets = {target["target"]: target for target in report["targets"]}
    assert "open s per 10^6 keys (largest)" in targets and "master RSS bytes/key growth" in targets
    assert targets["lookup round trips, largest - smallest"]["met"] is True
    printed = capsys.readouterr().out
    assert "medians over repeats:" in printed and "targets:" in printed and "load average" in printed


@pytest.mark.vllm
def test_prompt_length_axis_reports_every_length_consistently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridkv_dev.bench.scale_prompt import TABLE_COLUMNS

    sizes = (256, 1024)
    out = tmp_path / "scale.json"
    argv = ["bench", "scale", "--axis", "prompt-length", "--sizes", ",".join(map(str, sizes))]
    argv += ["--repeats", str(_REPEATS), "--dir", str(tmp_path), "--out", str(out), "--no-plot"]
    assert main(argv) == 0

    report = json.loads(out.read_text())
    assert (report["bench"], report["axis"], report["store"]) == ("scale", "prompt-length", "file")
    assert len(report["load_average_before"]) == 3 and len(report["load_average_after"]) == 3
    assert report["pages_intact"] is True, "a load wrote other bytes than the ones saved"
    bytes_per_token = report["model"]["bytes_per_token"]
    assert report["saved_bytes"] == sum(sizes) * bytes_per_token
    rows = report["rows"]
    assert [row["tokens"] for row in rows] == list(sizes)
    for row in rows:
        assert set(TABLE_COLUMNS) <= set(row)
        assert row["repeats"] == _REPEATS and len(row["samples"]) == _REPEATS
        # Every load job finished, OK, with the whole hit's bytes.
        assert row["loads_ok"] == _REPEATS
        assert row["loaded_bytes_min"] == row["hit_bytes"] == row["tokens"] * bytes_per_token
        for name in ("load_job_ms", "load_wall_ms", "memcpy_ms", "load_over_memcpy"):
            _spread_ok(row, name)
            assert row[name] > 0
        # The load job's phases were measured: its store call read and verified.
        assert row["store_ms"] > 0 and row["file_read_ms"] > 0 and row["file_verify_ms"] > 0
    targets = {target["target"]: target for target in report["targets"]}
    assert set(targets) == {"load job us/token growth", "load / memcpy growth"}
    assert all(target["value"] is not None for target in targets.values())
    assert not any(tmp_path.glob("hybridkv-bench-*")), "the store's scratch folder is removed"
    printed = capsys.readouterr().out
    assert "medians over repeats:" in printed and "targets:" in printed and "load average" in printed
