"""Hits loading at once from one file store (``hybridkv bench scale --axis concurrent``), as functions
returning dicts.

One ``file://`` store (under ``/dev/shm`` when present, else the temporary folder; ``root`` chooses) holds
as many distinct hits as the most concurrent requests, each hit ``blocks`` blocks of ``value_bytes`` (by
default 64 blocks of 1 MiB: about the 65 MB hit of ``hybridkv bench ttft``), its capacity above them all (no
eviction). For each concurrency C of ``concurrency`` (1 -> 32), repeats interleaved (repeat 1 of every C,
then repeat 2, ...), each repeat times:

- ``memcpy``: one copy of the same bytes (C hits) from host buffers into the same destinations, on one
  thread: the floor a load cannot beat on this machine, measured in the same run,
- the loads: C threads (one per request), released at once, each loading its own hit with one ``get_into``
  of its keys into its own destination buffers: the call an engine's worker makes to load a hit (its
  reader threads call ``store.get_into`` per share of a batch; here one call per request). Each request's
  load time runs from the release to its call's return; the aggregate rate is the C hits' bytes over the
  time from the release to the last return.

Every load must answer ``OK`` with the bytes that were put (the first repeat compares them). The report holds
per C the aggregate load GB/s and its ratio to the memcpy's GB/s (medians over repeats, spread min..max), the
per-request load time p50 and p99 over every request of every repeat, and the targets: the per-byte cost of a
load (the inverse of the aggregate rate) at the most concurrent requests within 1.5x of one request's, and no
failed load.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.report import target_row
from hybridkv.store import open_store
from hybridkv.store.base import Status, Store

from hybridkv_dev.bench.scale import GROWTH_LIMIT, add_medians, medians_and_spreads

__all__ = [
    "CONCURRENT_COLUMNS",
    "DEFAULT_BLOCKS",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_VALUE_BYTES",
    "default_root",
    "format_concurrent_table",
    "plot_concurrent_report",
    "run_concurrent_axis",
]

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)
DEFAULT_BLOCKS = 64
DEFAULT_VALUE_BYTES = 1 << 20
_PUT_BATCH = 16

CONCURRENT_COLUMNS = [
    "concurrency",
    "repeats",
    "hit_mib",
    "load_gb_s",
    "memcpy_gb_s",
    "load_over_memcpy",
    "request_p50_ms",
    "request_p99_ms",
    "failed_loads",
]


#: The rates measured per repeat (medians and min..max in the table).
_TIMED = ("load_gb_s", "memcpy_gb_s", "load_over_memcpy")


def default_root() -> Path:
    """Where the store goes when the caller names no folder: ``/dev/shm`` when present (a page-cache tier, as
    an engine host would mount it), else the temporary folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def key_of(hit: int, block: int) -> str:
    """Block ``block`` of hit ``hit`` (``hybridkv.key_grammar``, namespace ``concurrent``)."""
    return f"hkv1/concurrent/0123456789ab/g0/tp0/dcp0/{hit:08x}{block:024x}"


def _populate(store: Store, num_hits: int, blocks: int, value_bytes: int) -> list[list[bytes]]:
    """Put ``num_hits`` hits of random blocks; returns each hit's values (to verify the loads)."""
    values = [[os.urandom(value_bytes) for _ in range(blocks)] for _ in range(num_hits)]
    for hit, hit_values in enumerate(values):
        for first in range(0, blocks, _PUT_BATCH):
            keys = [key_of(hit, block) for block in range(first, min(blocks, first + _PUT_BATCH))]
            statuses = store.put(keys, hit_values[first : first + len(keys)])
            assert all(status is Status.OK for status in statuses), f"populating hit {hit}: {set(statuses)}"
    return values


def _memcpy_s(sources: list[list[bytes]], destinations: list[list[bytearray]]) -> float:
    """One thread copying every source block into its destination (the same bytes the loads move)."""
    started = time.perf_counter()
    for hit_sources, hit_destinations in zip(sources, destinations, strict=True):
        for source, destination in zip(hit_sources, hit_destinations, strict=True):
            destination[:] = source
    return time.perf_counter() - started


def _load_once(
    store: Store, destinations: list[list[bytearray]], blocks: int
) -> tuple[float, list[float], int]:
    """C request threads released at once, each ``get_into`` its hit: (seconds to the last return, each
    request's seconds, loads not ``OK``)."""
    concurrency = len(destinations)
    barrier = threading.Barrier(concurrency + 1)
    request_s = [0.0] * concurrency
    failed = [0] * concurrency
    released = [0.0]

    def request(hit: int) -> None:
        keys = [key_of(hit, block) for block in range(blocks)]
        barrier.wait()
        statuses = store.get_into(keys, destinations[hit])
        request_s[hit] = time.perf_counter() - released[0]
        failed[hit] = sum(status is not Status.OK for status in statuses)

    threads = [threading.Thread(target=request, args=(hit,)) for hit in range(concurrency)]
    for thread in threads:
        thread.start()
    released[0] = time.perf_counter()
    barrier.wait()
    for thread in threads:
        thread.join()
    return time.perf_counter() - released[0], request_s, sum(failed)


def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def run_concurrent_axis(
    root: Path,
    concurrency: Sequence[int],
    *,
    repeats: int,
    blocks: int = DEFAULT_BLOCKS,
    value_bytes: int = DEFAULT_VALUE_BYTES,
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """The ``concurrent`` axis (see the module docstring) with its store under ``root`` (removed at the end);
    returns the report."""
    concurrency = sorted(set(concurrency))
    assert concurrency and concurrency[0] >= 1, f"concurrency must be >= 1 each, got {concurrency}"
    assert repeats >= 1 and blocks >= 1 and value_bytes >= 1, "repeats, blocks and value bytes must be >= 1"
    directory = root / f"hybridkv-scale-concurrent-{os.getpid()}"
    shutil.rmtree(directory, ignore_errors=True)
    num_hits = concurrency[-1]
    hit_bytes = blocks * value_bytes
    capacity = 2 * num_hits * hit_bytes + (64 << 20)
    load_before = os.getloadavg()
    store = open_store(f"file://{directory}?capacity={capacity}")
    try:
        sources = _populate(store, num_hits, blocks, value_bytes)
        progress(f"populated {num_hits} hits of {hit_bytes / (1 << 20):.1f} MiB")
        destinations = [[bytearray(value_bytes) for _ in range(blocks)] for _ in range(num_hits)]
        samples: dict[int, list[dict[str, Any]]] = {count: [] for count in concurrency}
        for repeat in range(repeats):
            for count in concurrency:
                memcpy_s = _memcpy_s(sources[:count], destinations[:count])
                load_s, request_s, failed = _load_once(store, destinations[:count], blocks)
                if repeat == 0:  # the bytes each request loaded are the bytes put
                    failed += sum(
                        destination != source
                        for hit_sources, hit_destinations in zip(
                            sources[:count], destinations[:count], strict=True
                        )
                        for source, destination in zip(hit_sources, hit_destinations, strict=True)
                    )
                num_bytes = count * hit_bytes
                samples[count].append(
                    {
                        "load_gb_s": num_bytes / load_s / 1e9,
                        "memcpy_gb_s": num_bytes / memcpy_s / 1e9,
                        "load_over_memcpy": memcpy_s / load_s,
                        "request_ms": [seconds * 1e3 for seconds in request_s],
                        "failed_loads": failed,
                    }
                )
            progress(f"repeat {repeat + 1}/{repeats} done")
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
    rows = [_row(count, samples[count], hit_bytes) for count in concurrency]
    return {
        "bench": "scale",
        "axis": "concurrent",
        "store": "file",
        "root": str(root),
        "blocks": blocks,
        "value_bytes": value_bytes,
        "hit_bytes": hit_bytes,
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "rows": rows,
        "targets": _targets(rows),
    }


def _row(count: int, samples: list[dict[str, Any]], hit_bytes: int) -> dict[str, Any]:
    row: dict[str, Any] = {"concurrency": count, "repeats": len(samples), "hit_mib": hit_bytes / (1 << 20)}
    add_medians(row, samples, _TIMED)
    request_ms = [ms for sample in samples for ms in sample["request_ms"]]
    row["request_p50_ms"] = _percentile(request_ms, 0.5)
    row["request_p99_ms"] = _percentile(request_ms, 0.99)
    row["failed_loads"] = sum(sample["failed_loads"] for sample in samples)
    row["samples"] = samples
    return row


def _targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    small, large = rows[0], rows[-1]
    targets = []
    if len(rows) >= 2:
        targets.append(
            target_row(
                f"per-byte load cost, {large['concurrency']} requests over {small['concurrency']}",
                small["load_gb_s"] / large["load_gb_s"] if large["load_gb_s"] else None,
                "<=",
                GROWTH_LIMIT,
            )
        )
    targets.append(target_row("failed loads (every run)", sum(row["failed_loads"] for row in rows), "==", 0))
    return targets


def format_concurrent_table(report: dict[str, Any]) -> str:
    """The medians per concurrency, then the spreads over repeats."""
    return "medians over repeats (request times: p50/p99 over every request):\n" + medians_and_spreads(
        report["rows"], CONCURRENT_COLUMNS, "concurrency", _TIMED
    )


def plot_concurrent_report(report: dict[str, Any], path: Path) -> Path | None:
    """Aggregate load rate beside the memcpy's, and request times, against the concurrent requests; ``None``
    without matplotlib."""
    from hybridkv.bench.report import pyplot_or_none, save_figure

    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = report["rows"]
    counts = [row["concurrency"] for row in rows]
    figure, (rate, times) = plt.subplots(1, 2, figsize=(9, 3.5))
    rate.plot(counts, [row["load_gb_s"] for row in rows], marker="o", label="loads")
    rate.plot(counts, [row["memcpy_gb_s"] for row in rows], marker="o", label="one memcpy")
    rate.set_title("GB/s")
    rate.legend()
    times.plot(counts, [row["request_p50_ms"] for row in rows], marker="o", label="p50")
    times.plot(counts, [row["request_p99_ms"] for row in rows], marker="o", label="p99")
    times.set_title("request load ms")
    times.legend()
    for axis in (rate, times):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("requests loading at once")
        axis.set_ylim(bottom=0)
    return save_figure(figure, path)
