"""Engines sharing one file store (``hybridkv bench scale --axis shared``), as functions returning dicts.

For each engine count E of ``engines`` (1 -> 4), a fresh ``file://`` store directory whose capacity holds a
fraction of what the engines write, so that they evict one another's entries all along; E engine processes
(real separate processes, each its own ``open_store(url)``: the store object an engine's worker saves its
blocks through, ``put``, and loads its hits through, ``get_into``) start together and each runs ``rounds``
rounds of:

- a save: ``put`` of ``batch`` new blocks of its own keys, each value the key's digest repeated (so that any
  process can verify any value it loads without asking its writer),
- a load: ``get_into`` of ``batch`` keys another engine saved recently (the next engine's; its own when
  alone), chosen among that engine's last ``window`` keys; each loaded value is compared byte for byte with
  what its writer wrote. A load is a verified hit, a clean miss (``NOT_FOUND``: evicted, or not written yet),
  or a failure (wrong bytes, ``CORRUPT``, any other status); right after a verified hit the key's file is
  ``stat``-ed again: gone or another inode means an eviction (by any process) removed the entry across the
  load ("removed while loading": the loader still got its bytes).

Each engine reports its seconds and its CPU seconds (on a host with fewer cores than engines the wall time
grows with the engines even where the store's own cost per round does not), its rounds, bytes saved and
loaded, the time its threads waited for the store's locks (``FileLayout``: the usage estimate's flock,
``evict.lock``) and its loads by outcome. After each run the store's real bytes (objects and spares, read from
the files) are compared with its capacity. Repeats interleave the engine counts. Targets: the per-engine cost
(seconds per round, and CPU seconds per round) at the most engines within 1.5x of one engine's, no wrong bytes
and no corrupt loads, the store within its capacity at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.report import spread_text, target_row
from hybridkv.store import open_store
from hybridkv.store.base import Status, find_layer
from hybridkv.store.file import FileBackend
from hybridkv.store.frame import key_digest

from hybridkv_dev.bench.scale import GROWTH_LIMIT

__all__ = [
    "DEFAULT_ENGINES",
    "SHARED_COLUMNS",
    "engine_main",
    "format_shared_table",
    "judge_load",
    "key_of",
    "load_keys_of",
    "plot_shared_report",
    "run_engine_processes",
    "run_shared_axis",
    "serve_engine",
    "value_of",
    "wait_for_go",
]

DEFAULT_ENGINES = (1, 2, 3, 4)
#: The store holds this fraction of what all engines of a run write (evictions all along).
_CAPACITY_FRACTION = 0.25
#: How long the engines may take to start (import, open) before the run fails, and to finish.
_START_TIMEOUT_S = 120.0
_RUN_TIMEOUT_S = 900.0

#: What each engine counts, summed over a size's engines and runs.
_ENGINE_COUNTS = (
    "loads",
    "hits",
    "misses",
    "removed_while_loading",
    "wrong_bytes",
    "corrupt",
    "other_failures",
    "evicted",
)

SHARED_COLUMNS = [
    "engines",
    "repeats",
    "round_ms",
    "cpu_ms_per_round",
    "mb_s_per_engine",
    "usage_lock_wait_ms",
    "evict_lock_wait_ms",
    *_ENGINE_COUNTS,
    "bytes_over_capacity",
]


def key_of(engine: int, index: int) -> str:
    """Engine ``engine``'s block key number ``index`` (``hybridkv.key_grammar``, namespace ``shared``)."""
    return f"hkv1/shared/0123456789ab/g0/tp0/dcp0/{engine:08x}{index:024x}"


def value_of(key: str, num_bytes: int) -> bytes:
    """The value every engine writes for ``key``: its 16-byte digest repeated (any reader can verify it)."""
    digest = key_digest(key)
    return (digest * (num_bytes // len(digest) + 1))[:num_bytes]


def load_keys_of(peer: int, round_index: int, batch: int, window: int) -> list[str]:
    """The ``batch`` keys an engine loads in round ``round_index``: spread over ``peer``'s last ``window`` keys,
    counting the peer about as far as the loader (``batch`` keys saved per round)."""
    newest = (round_index + 1) * batch
    first = max(0, newest - window)
    return [key_of(peer, first + (round_index * 7919 + i * 104729) % (newest - first)) for i in range(batch)]


def serve_engine(run: Callable[..., dict[str, Any]]) -> None:
    """An engine process (``python -c``) of either shared axis: ``run`` with the parameters in ``sys.argv[1]``
    (JSON); prints its report (JSON)."""
    params = json.loads(sys.argv[1])
    print(json.dumps(run(**params)), flush=True)


def engine_main() -> None:
    """This axis's engine process (see :func:`serve_engine`)."""
    serve_engine(run_engine)


def wait_for_go(ready_file: str, go_file: str) -> None:
    """Say this engine is ready (its store open) and wait until every engine is: the start of its rounds."""
    Path(ready_file).touch()
    while not os.path.exists(go_file):
        time.sleep(0.005)


def judge_load(
    counts: dict[str, int], key: str, status: Status, loaded: bytes | bytearray, value_bytes: int
) -> bool:
    """Count one loaded key's outcome in ``counts`` (``loads`` and one of ``hits``, ``wrong_bytes``,
    ``misses``, ``corrupt``, ``other_failures``); True for a hit whose bytes are what its writer wrote."""
    counts["loads"] += 1
    if status is Status.OK:
        if loaded != value_of(key, value_bytes):
            counts["wrong_bytes"] += 1
            return False
        counts["hits"] += 1
        return True
    if status is Status.NOT_FOUND:
        counts["misses"] += 1
    elif status is Status.CORRUPT:
        counts["corrupt"] += 1
    else:
        counts["other_failures"] += 1
    return False


def run_engine(
    *,
    url: str,
    engine: int,
    num_engines: int,
    rounds: int,
    batch: int,
    window: int,
    value_bytes: int,
    go_file: str,
    ready_file: str,
) -> dict[str, Any]:
    """One engine's rounds (see the module docstring), started once ``go_file`` exists."""
    store = open_store(url)
    backend = find_layer(store, FileBackend)
    assert backend is not None, f"{url} has no file backend"
    layout = backend.layout
    wait_for_go(ready_file, go_file)
    peer = (engine + 1) % num_engines
    destinations = [bytearray(value_bytes) for _ in range(batch)]
    counts = dict.fromkeys(
        ("loads", "hits", "misses", "removed_while_loading", "wrong_bytes", "corrupt", "other_failures"), 0
    )
    num_saved_bytes = num_loaded_bytes = 0
    started = time.perf_counter()
    cpu_started = time.process_time()
    for round_index in range(rounds):
        keys = [key_of(engine, round_index * batch + i) for i in range(batch)]
        statuses = store.put(keys, [value_of(key, value_bytes) for key in keys])
        num_saved_bytes += value_bytes * sum(status.is_ok for status in statuses)
        load_keys = load_keys_of(peer, round_index, batch, window)
        inodes = [_inode(layout.path_of(key)) for key in load_keys]
        statuses = store.get_into(load_keys, destinations)
        for key, inode, status, destination in zip(load_keys, inodes, statuses, destinations, strict=True):
            if judge_load(counts, key, status, destination, value_bytes):
                num_loaded_bytes += value_bytes
                after = _inode(layout.path_of(key))
                if after is None or (inode is not None and after != inode):
                    counts["removed_while_loading"] += 1
    elapsed = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    report = {
        "engine": engine,
        "seconds": elapsed,
        "cpu_seconds": cpu_s,
        "rounds": rounds,
        "saved_bytes": num_saved_bytes,
        "loaded_bytes": num_loaded_bytes,
        "usage_lock_wait_s": layout.usage_lock_wait_s,
        "num_usage_locks": layout.num_usage_locks,
        "evict_lock_wait_s": layout.evict_lock_wait_s,
        "num_evict_locks": layout.num_evict_locks,
        "evicted": layout.num_evicted,
        **counts,
    }
    store.close()
    return report


def _inode(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_dev


def run_engine_processes(
    directory: Path, params: Sequence[dict[str, Any]], module: str
) -> list[dict[str, Any]]:
    """One process per ``params`` entry, each ``module.engine_main()`` with that entry (plus its ``go_file`` and
    ``ready_file`` under ``directory``) as JSON in ``sys.argv[1]``; each touches its ready file once its store is
    open and starts when ``directory / "go"`` exists, created once all are ready. Returns their reports (each
    one's last line of output, JSON), in order."""
    go_file = directory / "go"
    ready_files = [directory / f"ready-{index}" for index in range(len(params))]
    code = f"from {module} import engine_main; engine_main()"
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                json.dumps({**entry, "go_file": str(go_file), "ready_file": str(ready)}),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for entry, ready in zip(params, ready_files, strict=True)
    ]
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not all(ready.exists() for ready in ready_files):
            assert time.monotonic() < deadline, f"{len(params)} engines did not start"
            assert all(child.poll() is None for child in children), "an engine exited before starting"
            time.sleep(0.01)
        go_file.touch()
        outputs = [child.communicate(timeout=_RUN_TIMEOUT_S)[0] for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    for index, child in enumerate(children):
        assert child.returncode == 0, f"engine {index} of {len(params)} exited {child.returncode}"
    return [json.loads(output.strip().splitlines()[-1]) for output in outputs]


def _run_once(root: Path, num_engines: int, *, rounds: int, batch: int, value_bytes: int) -> dict[str, Any]:
    """One run of ``num_engines`` engines on a fresh store; the engines' reports and the store's end state."""
    directory = root / f"shared-{num_engines}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    written = num_engines * rounds * batch * value_bytes
    capacity = max(4 * batch * value_bytes * num_engines, int(written * _CAPACITY_FRACTION))
    url = f"file://{directory / 'store'}?capacity={capacity}"
    # Loads pick among the peer's last keys that the store may still hold (its share of the capacity).
    window = max(batch, capacity // value_bytes // num_engines)
    params = [
        {
            "url": url,
            "engine": engine,
            "num_engines": num_engines,
            "rounds": rounds,
            "batch": batch,
            "window": window,
            "value_bytes": value_bytes,
        }
        for engine in range(num_engines)
    ]
    engines = run_engine_processes(directory, params, "hybridkv_dev.bench.scale_shared")
    store = open_store(url)
    try:
        stats = store.stats()
    finally:
        store.close()
    assert stats.num_bytes is not None, "the file store's stats give its bytes"
    real_bytes = stats.num_bytes + int(stats.extra["spare_bytes"])  # type: ignore[call-overload]
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "engines": engines,
        "capacity_bytes": capacity,
        "real_bytes": real_bytes,
        "usage_estimate_bytes": int(stats.extra["usage_estimate_bytes"]),  # type: ignore[call-overload]
    }


def _row(num_engines: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats of the per-engine medians; outcome counts summed over every run."""
    round_ms = [statistics.median(e["seconds"] * 1e3 / e["rounds"] for e in run["engines"]) for run in runs]
    cpu_ms = [statistics.median(e["cpu_seconds"] * 1e3 / e["rounds"] for e in run["engines"]) for run in runs]
    mb_s = [
        statistics.median((e["saved_bytes"] + e["loaded_bytes"]) / e["seconds"] / 1e6 for e in run["engines"])
        for run in runs
    ]
    usage_wait = [statistics.median(e["usage_lock_wait_s"] * 1e3 for e in run["engines"]) for run in runs]
    evict_wait = [statistics.median(e["evict_lock_wait_s"] * 1e3 for e in run["engines"]) for run in runs]
    row: dict[str, Any] = {
        "engines": num_engines,
        "repeats": len(runs),
        "round_ms": statistics.median(round_ms),
        "round_ms_spread": spread_text(round_ms),
        "cpu_ms_per_round": statistics.median(cpu_ms),
        "cpu_ms_per_round_spread": spread_text(cpu_ms),
        "mb_s_per_engine": statistics.median(mb_s),
        "mb_s_per_engine_spread": spread_text(mb_s),
        "usage_lock_wait_ms": statistics.median(usage_wait),
        "usage_lock_wait_ms_spread": spread_text(usage_wait),
        "evict_lock_wait_ms": statistics.median(evict_wait),
        "evict_lock_wait_ms_spread": spread_text(evict_wait),
    }
    for name in _ENGINE_COUNTS:
        row[name] = sum(e[name] for run in runs for e in run["engines"])
    row["bytes_over_capacity"] = max(run["real_bytes"] - run["capacity_bytes"] for run in runs)
    row["capacity_bytes"] = runs[0]["capacity_bytes"]
    row["runs"] = runs
    return row


def _targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    small, large = rows[0], rows[-1]
    targets = []
    if len(rows) >= 2:
        targets.append(
            target_row(
                f"per-engine s/round, {large['engines']} engines over {small['engines']}",
                large["round_ms"] / small["round_ms"] if small["round_ms"] else None,
                "<=",
                GROWTH_LIMIT,
            )
        )
        targets.append(
            target_row(
                f"per-engine CPU s/round, {large['engines']} engines over {small['engines']}",
                large["cpu_ms_per_round"] / small["cpu_ms_per_round"] if small["cpu_ms_per_round"] else None,
                "<=",
                GROWTH_LIMIT,
            )
        )
    targets.append(target_row("wrong bytes loaded (every run)", sum(r["wrong_bytes"] for r in rows), "==", 0))
    targets.append(target_row("corrupt loads (every run)", sum(r["corrupt"] for r in rows), "==", 0))
    targets.append(
        target_row(
            "store bytes over capacity at the end (max)", max(r["bytes_over_capacity"] for r in rows), "<=", 0
        )
    )
    return targets


def run_shared_axis(
    root: Path,
    engines: Sequence[int],
    *,
    repeats: int,
    rounds: int,
    batch: int,
    value_bytes: int,
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """The ``shared`` axis (see the module docstring) under ``root``; returns the report."""
    engines = sorted(set(engines))
    assert engines and engines[0] >= 1, f"engine counts must be >= 1, got {engines}"
    assert repeats >= 1 and rounds >= 1 and batch >= 1, "repeats, rounds and batch must be >= 1"
    root.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    runs: dict[int, list[dict[str, Any]]] = {count: [] for count in engines}
    for repeat in range(repeats):
        for count in engines:
            runs[count].append(_run_once(root, count, rounds=rounds, batch=batch, value_bytes=value_bytes))
        progress(f"repeat {repeat + 1}/{repeats} done")
    rows = [_row(count, runs[count]) for count in engines]
    return {
        "bench": "scale",
        "axis": "shared",
        "store": "file",
        "root": str(root),
        "value_bytes": value_bytes,
        "batch": batch,
        "rounds": rounds,
        "repeats": repeats,
        "capacity_fraction": _CAPACITY_FRACTION,
        "cpu_count": os.cpu_count(),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "rows": rows,
        "targets": _targets(rows),
    }


def format_shared_table(report: dict[str, Any]) -> str:
    """The medians per engine count (spreads in the JSON)."""
    from hybridkv.tables import format_table

    rows = report["rows"]
    spreads = [
        {
            "engines": row["engines"],
            **{
                name: row[f"{name}_spread"]
                for name in (
                    "round_ms",
                    "cpu_ms_per_round",
                    "mb_s_per_engine",
                    "usage_lock_wait_ms",
                    "evict_lock_wait_ms",
                )
            },
        }
        for row in rows
    ]
    return (
        "medians over repeats (per engine; outcome counts summed):\n"
        + format_table(rows, SHARED_COLUMNS)
        + "\nspread over repeats (min..max):\n"
        + format_table(
            spreads,
            [
                "engines",
                "round_ms",
                "cpu_ms_per_round",
                "mb_s_per_engine",
                "usage_lock_wait_ms",
                "evict_lock_wait_ms",
            ],
        )
    )


def plot_shared_report(report: dict[str, Any], path: Path) -> Path | None:
    """Per-engine cost and lock waits against the engines sharing the store; ``None`` without matplotlib."""
    from hybridkv.bench.report import pyplot_or_none, save_figure

    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = report["rows"]
    engines = [row["engines"] for row in rows]
    figure, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for axis, column in zip(axes, ("round_ms", "mb_s_per_engine", "evict_lock_wait_ms"), strict=True):
        axis.plot(engines, [row[column] for row in rows], marker="o")
        axis.set_xlabel("engines on one store")
        axis.set_title(column)
        axis.set_ylim(bottom=0)
    return save_figure(figure, path)
