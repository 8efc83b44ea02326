"""``hybridkv bench scale --axis shared``, ``--axis mooncake-shared`` and ``--axis concurrent`` at CI size, run as a
user would: the reports' shape and outcomes (never their timings)."""

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


@pytest.mark.mooncake
def test_mooncake_shared_axis_reports_every_engine_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridkv_dev.bench.scale_shared_mooncake import MOONCAKE_SHARED_COLUMNS
    from support.mooncake import assert_loopback_only_namespace

    assert_loopback_only_namespace()  # the bench starts its own master and storage node, on 127.0.0.1 only
    rounds, blocks = 4, 2
    argv = ["bench", "scale", "--axis", "mooncake-shared", "--sizes", "2", "--repeats", "1"]
    argv += [
        "--rounds",
        str(rounds),
        "--blocks",
        str(blocks),
        "--value-kib",
        "1024",
        "--dir",
        str(tmp_path / "logs"),
    ]
    report = _run(argv, tmp_path / "mooncake-shared.json")
    assert (report["bench"], report["axis"], report["store"]) == ("scale", "mooncake-shared", "mooncake")
    assert len(report["load_average_before"]) == 3 and len(report["load_average_after"]) == 3  # type: ignore[arg-type]
    rows = report["rows"]
    assert isinstance(rows, list) and [row["engines"] for row in rows] == [2]
    [row] = rows
    assert set(MOONCAKE_SHARED_COLUMNS) <= set(row)
    expected = row["engines"] * rounds * blocks
    assert row["loads"] == row["puts"] == expected
    outcomes = ("hits", "misses", "wrong_bytes", "corrupt", "other_failures")
    assert sum(row[name] for name in outcomes) == expected
    assert row["wrong_bytes"] == row["corrupt"] == 0
    assert row["puts_refused"] + row["put_failures"] <= expected
    assert 0 < row["usage_end_max"] <= 1 and row["bytes_over_capacity"] <= 0
    [run] = row["runs"]
    assert len(run["engines"]) == 2 and all(e["store_calls"] >= 2 * rounds for e in run["engines"])
    targets = {target["target"]: target for target in report["targets"]}  # type: ignore[attr-defined]
    assert targets["wrong bytes loaded (every run)"]["met"] is True
    assert targets["corrupt loads (every run)"]["met"] is True
    assert targets["pool bytes over capacity at the end (max)"]["met"] is True
    printed = capsys.readouterr().out
    assert "targets:" in printed and "load average" in printed
