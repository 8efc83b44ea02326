"""Four engine processes on one file store, evicting one another's entries all along: every load is the
exact bytes its writer wrote or a clean miss, and the store stays within its capacity."""

from __future__ import annotations

from pathlib import Path

from hybridkv_dev.bench.scale_shared import run_shared_axis

_ENGINES = 4
_ROUNDS = 12
_BATCH = 4
#: Recyclable (>= 256 KiB): evicted files become spares that other processes' puts overwrite, the race the
#: readers' locks must win.
_VALUE_BYTES = 256 << 10


def test_four_processes_evicting_each_other_load_exact_bytes_or_miss(tmp_path: Path) -> None:
    report = run_shared_axis(
        tmp_path, [_ENGINES], repeats=1, rounds=_ROUNDS, batch=_BATCH, value_bytes=_VALUE_BYTES
    )
    [row] = report["rows"]
    [run] = row["runs"]
    engines = run["engines"]
    assert len(engines) == _ENGINES and all(engine["rounds"] == _ROUNDS for engine in engines)
    # Every load is a verified hit or a clean miss: no wrong bytes, nothing corrupt, no other failure.
    assert row["loads"] == _ENGINES * _ROUNDS * _BATCH
    assert row["wrong_bytes"] == 0 and row["corrupt"] == 0 and row["other_failures"] == 0, row
    assert row["hits"] + row["misses"] == row["loads"]
    assert row["hits"] > 0, "no engine ever loaded another's entry: the scenario did not share the store"
    # The capacity forced evictions, and the store ended within it (objects and spares, read from the files).
    assert row["evicted"] > 0, "no eviction: the capacity did not press"
    assert run["real_bytes"] <= run["capacity_bytes"], run
    assert all(engine["saved_bytes"] > run["capacity_bytes"] / _ENGINES for engine in engines)
