"""``hybridkv bench scale --axis entries`` at CI size, run as a user would: the report's shape and its internal
consistency (never its timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridkv.cli import main
from hybridkv_dev.bench.scale import LOOKUP_KEYS, LOOKUP_ROUND_TRIPS, TABLE_COLUMNS

_SIZES = (200, 2_000)
_REPEATS = 2


def test_entries_axis_reports_every_size_consistently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scale.json"
    stores = tmp_path / "stores"
    argv = ["bench", "scale", "--axis", "entries", "--sizes", ",".join(map(str, _SIZES))]
    argv += ["--repeats", str(_REPEATS), "--dir", str(stores), "--out", str(out), "--no-plot"]
    assert main(argv) == 0

    report = json.loads(out.read_text())
    assert (report["bench"], report["axis"], report["store"]) == ("scale", "entries", "file")
    assert len(report["load_average_before"]) == 3 and len(report["load_average_after"]) == 3
    assert report["repeats"] == _REPEATS
    rows = report["rows"]
    assert [row["entries"] for row in rows] == list(_SIZES)
    for row in rows:
        entries = row["entries"]
        assert set(TABLE_COLUMNS) <= set(row)
        assert row["repeats"] == _REPEATS and len(row["samples"]) == _REPEATS
        # Every repeat saw the store holding exactly its entries, found every key it looked up and got.
        assert row["stats_keys_min"] == row["stats_keys_max"] == entries
        assert row["lookup_keys"] == min(LOOKUP_KEYS, entries // 2)
        assert row["lookup_found_min"] == row["lookup_keys"]
        assert row["lookup_round_trips"] == LOOKUP_ROUND_TRIPS
        assert row["get_found_min"] == row["get_keys"] > 0
        # The put over capacity and the pass both evicted; the pass scanned the whole store.
        assert row["put_evicted"] > 0 and 0 < row["evict_evicted"] < row["evict_scanned"]
        assert row["evict_scanned"] >= entries
        for sample in row["samples"]:
            assert sample["stats_keys"] == entries
            assert sample["stats_us_per_entry"] * entries == pytest.approx(sample["stats_ms"] * 1e3)
        for name in ("open_ms", "lookup_us_per_key", "stats_ms", "evict_ms", "put_ms"):
            low, high = (float(part) for part in row[f"{name}_spread"].split(".."))
            assert low <= high and row[name] > 0
        assert row["rss_lookup_mib"] > 0 and row["rss_stats_mib"] > 0
    targets = {target["target"]: target for target in report["targets"]}
    assert "open s per 10^6 entries (largest)" in targets
    assert targets["lookup round trips, largest - smallest"]["met"] is True
    assert all(target["value"] is not None for target in targets.values())
    # Without --keep the stores are gone; the printed tables name every size and the targets.
    assert not any(stores.iterdir())
    printed = capsys.readouterr().out
    assert "medians over repeats:" in printed and "targets:" in printed and "load average" in printed
