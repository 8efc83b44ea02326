"""``hybridkv bench scale --axis shared`` and ``--axis concurrent`` at CI size, run as a user would: the
reports' shape and outcomes (never their timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridkv.cli import main
from hybridkv_dev.bench.scale_concurrent import CONCURRENT_COLUMNS
from hybridkv_dev.bench.scale_shared import SHARED_COLUMNS


def _run(argv: list[str], out: Path) -> dict[str, object]:
    assert main([*argv, "--out", str(out), "--no-plot"]) == 0
    report: dict[str, object] = json.loads(out.read_text())
    return report


def test_shared_axis_reports_every_engine_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "scale", "--axis", "shared", "--sizes", "1,2", "--repeats", "1", "--rounds", "4"]
    argv += ["--blocks", "2", "--value-kib", "256", "--dir", str(tmp_path / "stores")]
    report = _run(argv, tmp_path / "shared.json")
    assert (report["bench"], report["axis"], report["store"]) == ("scale", "shared", "file")
    rows = report["rows"]
    assert isinstance(rows, list) and [row["engines"] for row in rows] == [1, 2]
    for row in rows:
        assert set(SHARED_COLUMNS) <= set(row)
        assert row["loads"] == row["engines"] * 4 * 2
        assert row["wrong_bytes"] == row["corrupt"] == row["other_failures"] == 0
        assert row["bytes_over_capacity"] <= 0
        [run] = row["runs"]
        assert len(run["engines"]) == row["engines"]
    targets = {target["target"]: target for target in report["targets"]}  # type: ignore[attr-defined]
    assert "per-engine s/round, 2 engines over 1" in targets
    assert targets["wrong bytes loaded (every run)"]["met"] is True
    assert targets["store bytes over capacity at the end (max)"]["met"] is True
    printed = capsys.readouterr().out
    assert "targets:" in printed and "load average" in printed


def test_concurrent_axis_reports_every_concurrency(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "scale", "--axis", "concurrent", "--sizes", "1,4", "--repeats", "2"]
    argv += ["--blocks", "2", "--value-kib", "256", "--dir", str(tmp_path)]
    report = _run(argv, tmp_path / "concurrent.json")
    assert (report["bench"], report["axis"], report["store"]) == ("scale", "concurrent", "file")
    rows = report["rows"]
    assert isinstance(rows, list) and [row["concurrency"] for row in rows] == [1, 4]
    for row in rows:
        assert set(CONCURRENT_COLUMNS) <= set(row)
        assert row["failed_loads"] == 0 and len(row["samples"]) == 2
        assert all(len(sample["request_ms"]) == row["concurrency"] for sample in row["samples"])
        assert row["request_p50_ms"] <= row["request_p99_ms"]
        assert row["load_gb_s"] > 0 and row["memcpy_gb_s"] > 0
    targets = {target["target"]: target for target in report["targets"]}  # type: ignore[attr-defined]
    assert "per-byte load cost, 4 requests over 1" in targets
    assert targets["failed loads (every run)"]["met"] is True
    assert not [path for path in tmp_path.iterdir() if path.name.startswith("hybridkv-scale-concurrent")]
    assert "targets:" in capsys.readouterr().out
