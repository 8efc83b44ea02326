"""Engines sharing one Mooncake cluster (``hybridkv bench scale --axis mooncake-shared``), as functions returning
dicts: the ``shared`` axis (:mod:`hybridkv_dev.bench.scale_shared`) on a real ``mooncake_master``.

Runs only inside a loopback-only network namespace (``scripts/netns-run``): every Mooncake process listens on
``0.0.0.0``. For each engine count E of ``engines`` (1 -> 4), a fresh deployment of the documented topology
(``hybridkv_dev.bench.scale_mooncake_deploy``: a ``mooncake_master`` on 127.0.0.1 with the eviction high watermark
at 0.8, and one storage node, ``python -m hybridkv.store.mooncake_node``) whose segment holds, below the watermark, a
quarter of the blocks the engines write (Mooncake's minimum segment is 16 MiB), so that the master's eviction
thread evicts all along while engines load; E engine processes (each its own pure Mooncake client,
``open_store("mooncake://...?segment=0")``, what an engine of that topology is) start together and each runs
``rounds`` rounds of:

- a save: ``put`` of ``batch`` new blocks of its own keys, each value the key's digest repeated (any process can
  verify any value it loads). Mooncake refuses a put into a full pool (``NO_SPACE``: it does not evict and wait),
  so puts count as saved or refused,
- a load: ``get_into`` of ``batch`` keys the next engine saved recently (its own when alone), chosen among that
  engine's last ``window`` keys (half the pool's share per engine: a load leases its key for the master's
  ``--default_kv_lease_ttl``, 2 s here, and Mooncake's eviction skips leased objects, so at most half the pool is
  leased and the rest stays evictable; a pool all leased refuses every put), each compared byte for byte with what its writer
  wrote. A load is a verified hit, a clean miss (``NOT_FOUND``: evicted, or not written yet) or a failure (wrong
  bytes, ``CORRUPT``, any other status); right after the load the verified hits are asked again with one
  ``exists``: a key gone then was evicted across its load ("removed while loading"). The lease the ``get`` took
  keeps eviction off the object, so this stays 0 unless a lease ran out mid-round.

Before the start each engine puts and gets one warm-up block of its own (untimed): a client's first transfer
sets up its connection to the storage node, hundreds of ms on a busy host, which would otherwise put the engines
out of step (an engine far ahead of its peer finds the keys it loads not written yet, or already evicted).

Each engine reports its seconds and CPU seconds (the process's, Mooncake's client threads included), its rounds,
bytes saved and loaded, its puts by outcome and loads by outcome, and its store calls (``put``, ``get_into``,
``exists``: one Mooncake batch call each, a master RPC plus the TCP transfers) with the time spent in them. The
file store's lock waits have no counterpart here (the master serialises allocation and eviction itself and tells
no client how long it waited). After each run, the master's Prometheus metrics give the keys it evicted
(``master_evicted_key_count``) and its pool's usage (``master_allocated_bytes``) against its capacity
(``master_total_capacity_bytes``). Repeats interleave the engine counts. Targets: the per-engine cost (seconds per
round, and CPU seconds per round) at the most engines within 1.5x of one engine's, no wrong bytes and no corrupt
loads, the pool within its capacity at the end.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from hybridkv.bench.report import pyplot_or_none, save_figure, target_row
from hybridkv.store import open_store
from hybridkv.store.base import Status
from hybridkv.store.mooncake_node import DEFAULT_LEASE_TTL

from hybridkv_dev.bench.scale import add_medians, growth_targets, medians_and_spreads
from hybridkv_dev.bench.scale_mooncake_deploy import HIGH_WATERMARK, master_metrics, running_deployment
from hybridkv_dev.bench.scale_shared import (
    judge_load,
    key_of,
    load_keys_of,
    run_engine_processes,
    serve_engine,
    value_of,
    wait_for_go,
)
from hybridkv_dev.devkit.net import LOOPBACK

__all__ = [
    "AXIS",
    "DEFAULT_ENGINES",
    "MOONCAKE_SHARED_COLUMNS",
    "engine_main",
    "format_mooncake_shared_table",
    "plot_mooncake_shared_report",
    "run_mooncake_shared_axis",
]

AXIS = "mooncake-shared"
DEFAULT_ENGINES = (1, 2, 3, 4)
#: The pool holds, below its eviction watermark, this fraction of the blocks all engines of a run write.
_POOL_FRACTION = 0.25

#: The key number of an engine's warm-up block (never a round's).
_WARM_INDEX = 16**24 - 1

#: What each engine counts, summed over a size's engines and runs.
_ENGINE_COUNTS = (
    "puts",
    "puts_refused",
    "put_failures",
    "loads",
    "hits",
    "misses",
    "removed_while_loading",
    "wrong_bytes",
    "corrupt",
    "other_failures",
)
#: The per-run medians over engines whose median and min..max over repeats the row holds.
_TIMED = ("round_ms", "cpu_ms_per_round", "mb_s_per_engine", "call_ms_per_round")

MOONCAKE_SHARED_COLUMNS = [
    "engines",
    "repeats",
    *_TIMED,
    "calls_per_round",
    *_ENGINE_COUNTS,
    "evicted",
    "usage_end_max",
    "bytes_over_capacity",
]

_T = TypeVar("_T")


def engine_main() -> None:
    """This axis's engine process (see :func:`~hybridkv_dev.bench.scale_shared.serve_engine`)."""
    serve_engine(run_engine)


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
    # Warm up: the client's first transfer sets up its connection to the storage node (hundreds of ms on a
    # busy host); paid before the start, it would put the engines out of step with one another.
    warm_key = key_of(engine, _WARM_INDEX)
    assert store.put([warm_key], [value_of(warm_key, value_bytes)]) == [Status.OK], "warm-up put"
    store.get_into([warm_key], [bytearray(value_bytes)])
    wait_for_go(ready_file, go_file)
    peer = (engine + 1) % num_engines
    destinations = [bytearray(value_bytes) for _ in range(batch)]
    counts = dict.fromkeys(_ENGINE_COUNTS, 0)
    calls = [0, 0.0]  # store calls, seconds in them

    def call(method: Callable[..., _T], *args: list[Any]) -> _T:
        start = time.perf_counter()
        result = method(*args)
        calls[0] += 1
        calls[1] += time.perf_counter() - start
        return result

    num_saved_bytes = num_loaded_bytes = 0
    started = time.perf_counter()
    cpu_started = time.process_time()
    for round_index in range(rounds):
        keys = [key_of(engine, round_index * batch + i) for i in range(batch)]
        values = [value_of(key, value_bytes) for key in keys]
        for status in call(store.put, keys, values):
            counts["puts"] += 1
            if status.is_ok:
                num_saved_bytes += value_bytes
            elif status is Status.NO_SPACE:
                counts["puts_refused"] += 1
            else:
                counts["put_failures"] += 1
        load_keys = load_keys_of(peer, round_index, batch, window)
        statuses = call(store.get_into, load_keys, destinations)
        hit_keys = []
        for key, status, destination in zip(load_keys, statuses, destinations, strict=True):
            if judge_load(counts, key, status, destination, value_bytes):
                num_loaded_bytes += value_bytes
                hit_keys.append(key)
        if hit_keys:
            after = call(store.exists, hit_keys)
            counts["removed_while_loading"] += sum(status is Status.NOT_FOUND for status in after)
    elapsed = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    report = {
        "engine": engine,
        "seconds": elapsed,
        "cpu_seconds": cpu_s,
        "rounds": rounds,
        "saved_bytes": num_saved_bytes,
        "loaded_bytes": num_loaded_bytes,
        "store_calls": calls[0],
        "store_call_seconds": calls[1],
        **counts,
    }
    store.close()
    return report


def _run_once(
    root: Path, num_engines: int, repeat: int, *, rounds: int, batch: int, value_bytes: int
) -> dict[str, Any]:
    """One run of ``num_engines`` engines on a fresh deployment; the engines' reports and the pool's end state."""
    directory = root / f"mooncake-shared-{num_engines}-{repeat}"
    directory.mkdir(parents=True, exist_ok=True)
    # Blocks the pool holds below the watermark (the deployment sizes the storage node's segment for them).
    entries = max(4 * batch * num_engines, int(num_engines * rounds * batch * _POOL_FRACTION))
    # Loads pick among the newest half of the peer's share of the pool: a load leases its key, and Mooncake's
    # eviction skips leased objects, so the other half stays evictable (a pool all leased refuses puts).
    window = max(batch, entries // num_engines // 2)
    with running_deployment(directory, entries, value_bytes, None) as deployment:
        params = [
            {
                "url": deployment.url,
                "engine": engine,
                "num_engines": num_engines,
                "rounds": rounds,
                "batch": batch,
                "window": window,
                "value_bytes": value_bytes,
            }
            for engine in range(num_engines)
        ]
        engines = run_engine_processes(directory, params, __name__)
        metrics = master_metrics(deployment.master)
        segment_bytes = deployment.segment_bytes
        # The run's pool is thrown away: a graceful unmount (the node's SIGTERM) would cost seconds.
        deployment.node.kill()
        deployment.node.wait()
    capacity = metrics["master_total_capacity_bytes"]
    allocated = metrics["master_allocated_bytes"]
    return {
        "engines": engines,
        "pool_entries": entries,
        "segment_bytes": segment_bytes,
        "capacity_bytes": capacity,
        "allocated_bytes": allocated,
        "usage_end": allocated / capacity if capacity else None,
        "keys_end": int(metrics["master_key_count"]),
        "evicted": int(metrics.get("master_evicted_key_count", 0)),
    }


def _sample(run: dict[str, Any]) -> dict[str, float]:
    """One run's medians over its engines."""
    engines = run["engines"]
    return {
        "round_ms": statistics.median(e["seconds"] * 1e3 / e["rounds"] for e in engines),
        "cpu_ms_per_round": statistics.median(e["cpu_seconds"] * 1e3 / e["rounds"] for e in engines),
        "mb_s_per_engine": statistics.median(
            (e["saved_bytes"] + e["loaded_bytes"]) / e["seconds"] / 1e6 for e in engines
        ),
        "call_ms_per_round": statistics.median(e["store_call_seconds"] * 1e3 / e["rounds"] for e in engines),
        "calls_per_round": statistics.median(e["store_calls"] / e["rounds"] for e in engines),
    }


def _row(num_engines: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats of the per-engine medians; outcome counts and evictions summed over every run."""
    samples = [_sample(run) for run in runs]
    row: dict[str, Any] = {"engines": num_engines, "repeats": len(runs)}
    add_medians(row, samples, _TIMED)
    row["calls_per_round"] = statistics.median(sample["calls_per_round"] for sample in samples)
    for name in _ENGINE_COUNTS:
        row[name] = sum(e[name] for run in runs for e in run["engines"])
    row["evicted"] = sum(run["evicted"] for run in runs)
    row["usage_end_max"] = max(run["usage_end"] or 0.0 for run in runs)
    row["bytes_over_capacity"] = max(run["allocated_bytes"] - run["capacity_bytes"] for run in runs)
    row["capacity_bytes"] = runs[0]["capacity_bytes"]
    row["pool_entries"] = runs[0]["pool_entries"]
    row["runs"] = runs
    return row


def _targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    small, large = rows[0], rows[-1]
    targets = growth_targets(
        rows,
        (
            (f"per-engine s/round, {large['engines']} engines over {small['engines']}", "round_ms"),
            (
                f"per-engine CPU s/round, {large['engines']} engines over {small['engines']}",
                "cpu_ms_per_round",
            ),
        ),
    )
    targets.append(target_row("wrong bytes loaded (every run)", sum(r["wrong_bytes"] for r in rows), "==", 0))
    targets.append(target_row("corrupt loads (every run)", sum(r["corrupt"] for r in rows), "==", 0))
    targets.append(
        target_row(
            "pool bytes over capacity at the end (max)", max(r["bytes_over_capacity"] for r in rows), "<=", 0
        )
    )
    return targets


def run_mooncake_shared_axis(
    root: Path,
    engines: Sequence[int],
    *,
    repeats: int,
    rounds: int,
    batch: int,
    value_bytes: int,
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """The ``mooncake-shared`` axis (see the module docstring); logs under ``root``; returns the report.

    ``RuntimeError`` outside a loopback-only network namespace (``scripts/netns-run``)."""
    engines = sorted(set(engines))
    assert engines and engines[0] >= 1, f"engine counts must be >= 1, got {engines}"
    assert repeats >= 1 and rounds >= 1 and batch >= 1, "repeats, rounds and batch must be >= 1"
    root.mkdir(parents=True, exist_ok=True)
    # Set before the first client: Mooncake reads it once per process (the node and the engines inherit it).
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    load_before = os.getloadavg()
    runs: dict[int, list[dict[str, Any]]] = {count: [] for count in engines}
    for repeat in range(repeats):
        for count in engines:
            runs[count].append(
                _run_once(root, count, repeat, rounds=rounds, batch=batch, value_bytes=value_bytes)
            )
        progress(f"repeat {repeat + 1}/{repeats} done")
    rows = [_row(count, runs[count]) for count in engines]
    return {
        "bench": "scale",
        "axis": AXIS,
        "store": "mooncake",
        "root": str(root),
        "value_bytes": value_bytes,
        "batch": batch,
        "rounds": rounds,
        "repeats": repeats,
        "pool_fraction": _POOL_FRACTION,
        "high_watermark": HIGH_WATERMARK,
        "lease_ttl": DEFAULT_LEASE_TTL,
        "topology": "per run, one mooncake_master and one storage node on 127.0.0.1 (private network "
        "namespace); each engine a pure client (segment=0) in a process of its own",
        "lock_waits": "none reported: Mooncake's master serialises allocation and eviction and tells no "
        "client how long a call waited; calls_per_round and call_ms_per_round count the store calls "
        "(one Mooncake batch call each) and the time in them",
        "cpu_count": os.cpu_count(),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "rows": rows,
        "targets": _targets(rows),
    }


def format_mooncake_shared_table(report: dict[str, Any]) -> str:
    """The medians per engine count, then each timed metric's min..max over repeats."""
    return "medians over repeats (per engine; outcome counts summed):\n" + medians_and_spreads(
        report["rows"], MOONCAKE_SHARED_COLUMNS, "engines", _TIMED
    )


def plot_mooncake_shared_report(report: dict[str, Any], path: Path) -> Path | None:
    """Per-engine cost against the engines sharing the cluster; ``None`` without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = report["rows"]
    engines = [row["engines"] for row in rows]
    figure, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for axis, column in zip(axes, ("round_ms", "cpu_ms_per_round", "mb_s_per_engine"), strict=True):
        axis.plot(engines, [row[column] for row in rows], marker="o")
        axis.set_xlabel("engines on one Mooncake cluster")
        axis.set_title(column)
        axis.set_ylim(bottom=0)
    return save_figure(figure, path)
