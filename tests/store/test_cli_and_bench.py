"""``hybridkv store ...`` and ``hybridkv bench store`` through the real CLI entry point."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from hybridkv.bench.store import filesystem_of, measure_put_get, run_store_bench
from hybridkv.cli import main
from hybridkv.store import Status, open_store
from hybridkv.store.base import contiguous_shares
from hybridkv_dev.devkit.mooncake import MooncakeMaster


@pytest.fixture(autouse=True)
def _restore_logging_config() -> Iterator[None]:
    """``main()`` configures process logging onto the (captured, soon closed) stderr; undo it afterwards."""
    config = structlog.get_config()
    yield
    structlog.configure(**config)


TINY = [
    "--sizes",
    "4KiB,16KiB",
    "--bytes-per-round",
    "64KiB",
    "--repeats",
    "1",
    "--exists-calls",
    "20",
    "--no-plot",
]


def test_bench_cli_writes_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench" / "store.json"
    assert main(["bench", "store", *TINY, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {row["store"].split(":")[0] for row in rows} == {"memory", "file"}
    assert len(rows) == 4
    for row in rows:
        assert row["put_ratio_min"] <= row["put_ratio"] <= row["put_ratio_max"]
        assert row["get_ratio_min"] <= row["get_ratio"] <= row["get_ratio_max"]
        assert row["put_ratio_spread"] == f"{row['put_ratio_min']:.2f}-{row['put_ratio_max']:.2f}"
        assert row["get_ratio"] > 0 and row["exists_p50_us"] <= row["exists_p99_us"]
        if row["store"].startswith("file:"):  # the page-cache write floor, measured in the store's directory
            assert row["page_write_ratio"] > 0 and row["filesystem"] not in ("", "unknown")
        else:
            assert "page_write_ratio" not in row and row["filesystem"] == ""
    assert "put_ratio" in capsys.readouterr().out


def test_bench_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "store", "--sizes", "big", "--out", str(tmp_path / "x.json")]) == 2
    assert "value size" in capsys.readouterr().err
    assert main(["bench", "store", "--store", "nosuch://x", *TINY, "--out", str(tmp_path / "x.json")]) == 2
    capsys.readouterr()
    assert main(["bench", "store", *TINY, "--parts", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert "--parts 0" in capsys.readouterr().err
    assert main(["bench", "store", *TINY, "--readers", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert "--readers 0" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_bench_cli_values_in_parts(tmp_path: Path) -> None:
    """``--parts 16``: every value is put from and read into 16 parts (a block's KV pages); the bench checks
    the bytes read back, so a part written to or read from the wrong place fails it."""
    out = tmp_path / "store.json"
    assert main(["bench", "store", *TINY, "--parts", "16", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and {row["num_parts"] for row in rows} == {16}
    assert all(row["get_ratio"] > 0 and row["put_ratio"] > 0 for row in rows)


def test_bench_cli_reads_split_over_readers(tmp_path: Path) -> None:
    """``--readers 2``: every get is two concurrent calls on the two halves of the keys; the bench checks
    every status and the first and last value of each half read back."""
    out = tmp_path / "store.json"
    assert main(["bench", "store", *TINY, "--parts", "4", "--readers", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and {(row["num_parts"], row["num_readers"]) for row in rows} == {(4, 2)}
    assert all(row["get_ratio"] > 0 for row in rows)


@pytest.mark.parametrize(
    ("num_values", "num_shares", "expected"),
    [
        (10, 1, [(0, 10)]),
        (10, 2, [(0, 5), (5, 10)]),
        (31, 2, [(0, 15), (15, 31)]),
        (7, 3, [(0, 2), (2, 4), (4, 7)]),
        (2, 4, [(0, 1), (1, 2)]),
    ],
)
def test_contiguous_shares_cover_every_value_once(
    num_values: int, num_shares: int, expected: list[tuple[int, int]]
) -> None:
    """The split the load pipeline's readers and ``bench store --readers`` share."""
    assert contiguous_shares(num_values, num_shares) == expected


def test_store_ls_stats_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/s?capacity=1MiB"
    store = open_store(url)
    assert store.put(["a/1", "a/2", "b/1"], [b"x", b"y", b"z"]) == [Status.OK] * 3
    store.close()
    capsys.readouterr()
    assert main(["store", "ls", url, "--prefix", "a/", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["keys"] == ["a/1", "a/2"]
    assert main(["store", "stats", url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_keys"] == 3 and stats["capacity_bytes"] == 1 << 20
    assert main(["store", "clear", url, "--prefix", "a/"]) == 0
    assert "removed 2 keys" in capsys.readouterr().out
    assert main(["store", "ls", url]) == 0
    assert capsys.readouterr().out.split() == ["b/1"]
    assert main(["store", "stats", "file://"]) == 2
    assert "missing directory" in capsys.readouterr().err


def test_filesystem_of_names_tmpfs_huge_page_mode(tmp_path: Path) -> None:
    assert filesystem_of(tmp_path) != "unknown"
    if os.path.isdir("/dev/shm"):
        description = filesystem_of(Path("/dev/shm"))
        assert description.startswith("tmpfs huge="), description


def test_bench_functions_with_tiny_sizes(memory_url: str) -> None:
    store = open_store(memory_url)
    result = measure_put_get(store, 1024, 8, repeats=1)
    assert result["put_gbps"] > 0 and result["get_gbps"] > 0
    in_parts = measure_put_get(store, 1024, 8, repeats=1, num_parts=7)  # parts of unequal size
    assert in_parts["put_gbps"] > 0 and in_parts["get_gbps"] > 0
    split = measure_put_get(store, 1024, 9, repeats=2, num_readers=3)
    assert split["get_gbps"] > 0
    assert store.stats().num_keys == 0, "the bench must remove its keys"


@pytest.mark.mooncake
@pytest.mark.slow
def test_bench_runs_against_mooncake(mooncake_master: MooncakeMaster) -> None:
    report = run_store_bench(
        [mooncake_master.url()],
        value_sizes=[64 << 10, 1 << 20],
        bytes_per_round=4 << 20,
        repeats=1,
        num_exists_calls=50,
    )
    assert [row["value_size"] for row in report["rows"]] == [64 << 10, 1 << 20]
    assert all(row["put_ratio"] > 0 and row["get_ratio"] > 0 for row in report["rows"])
    assert report["rows"][0]["exists_p50_us"] < 10_000
