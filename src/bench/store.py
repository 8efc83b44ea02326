"""Store throughput and latency measurements, as pure functions returning dicts (``hybridkv bench store``).

Every throughput is reported next to a plain ``memcpy`` (``numpy.copyto``) of the same bytes, value size and
working set, measured in the same run, because on a shared 2-core box absolute GB/s swing by +-40 %.
The memcpy writes into pre-touched buffers; a store must place each new value in new pages (page faults
and kernel zeroing), which dominates ``put`` for large values on this box.
Throughputs are the best of ``repeats`` rounds (the least disturbed one); GB/s uses 1e9 bytes.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
from hybridkv.bench.report import pyplot_or_none, save_figure
from hybridkv.store.base import Status, Store, Value
from hybridkv.store.params import format_size
from hybridkv.store.url import open_store

DEFAULT_VALUE_SIZES = (64 << 10, 1 << 20, 16 << 20)
DEFAULT_BYTES_PER_ROUND = 64 << 20


def num_values_for(value_size: int, bytes_per_round: int) -> int:
    """Values per round: enough to move ``bytes_per_round`` bytes, at least one."""
    return max(1, bytes_per_round // value_size)


def _buffers(value_size: int, num_values: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    sources = [rng.integers(0, 256, value_size, dtype=np.uint8) for _ in range(num_values)]
    destinations = [np.ones(value_size, dtype=np.uint8) for _ in range(num_values)]  # pre-touched pages
    return sources, destinations


def _as_values(arrays: list[np.ndarray]) -> list[Value]:
    """numpy arrays as store values (and destinations). They are buffers; numpy's stubs declare the buffer
    protocol only for Python >= 3.12, hence the cast."""
    return cast("list[Value]", arrays)


def measure_memcpy(value_size: int, num_values: int, *, repeats: int = 3) -> dict[str, float]:
    """GB/s of ``np.copyto`` over ``num_values`` buffers of ``value_size`` bytes (best of ``repeats``)."""
    sources, destinations = _buffers(value_size, num_values, seed=1)
    best = 0.0
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for source, destination in zip(sources, destinations):
            np.copyto(destination, source)
        elapsed = time.perf_counter() - start
        best = max(best, value_size * num_values / max(elapsed, 1e-9) / 1e9)
    return {"memcpy_gbps": best}


def measure_put_get(store: Store, value_size: int, num_values: int, *, repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` GB/s of one batched ``put`` and one batched ``get_into`` of ``num_values`` values.

    Each round uses fresh keys (puts are insert-if-absent, so a repeated key would measure nothing), checks
    every status and the bytes of the first and last value, then removes its keys.
    """
    sources, destinations = _buffers(value_size, num_values, seed=2)
    total = value_size * num_values
    best_put = best_get = 0.0
    for round_index in range(max(1, repeats)):
        keys = [f"hybridkv-bench/{uuid.uuid4().hex}/{round_index}/{i}" for i in range(num_values)]
        start = time.perf_counter()
        put_statuses = store.put(keys, _as_values(sources))
        put_elapsed = time.perf_counter() - start
        assert all(s is Status.OK for s in put_statuses), (
            f"{store.url}: bench put failed: {set(put_statuses)}"
        )
        start = time.perf_counter()
        get_statuses = store.get_into(keys, _as_values(destinations))
        get_elapsed = time.perf_counter() - start
        assert all(s is Status.OK for s in get_statuses), (
            f"{store.url}: bench get failed: {set(get_statuses)}"
        )
        assert np.array_equal(sources[0], destinations[0]) and np.array_equal(
            sources[-1], destinations[-1]
        ), f"{store.url}: bench read back different bytes"
        store.remove(keys)
        best_put = max(best_put, total / max(put_elapsed, 1e-9) / 1e9)
        best_get = max(best_get, total / max(get_elapsed, 1e-9) / 1e9)
    return {"put_gbps": best_put, "get_gbps": best_get}


def measure_exists_latency(store: Store, *, num_calls: int = 1000) -> dict[str, float]:
    """p50 / p99 microseconds of ``exists([key])`` for one stored key (a lookup's unit cost)."""
    key = f"hybridkv-bench/{uuid.uuid4().hex}/exists"
    [status] = store.put([key], [b"x" * 64])
    assert status is Status.OK, f"{store.url}: bench put for exists failed: {status}"
    samples: list[float] = []
    for _ in range(max(2, num_calls)):
        start = time.perf_counter()
        [status] = store.exists([key])
        samples.append((time.perf_counter() - start) * 1e6)
        assert status is Status.OK, f"{store.url}: exists of a stored key returned {status}"
    store.remove([key])
    samples.sort()
    return {
        "exists_p50_us": statistics.median(samples),
        "exists_p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))],
    }


def bench_scratch_dir() -> tempfile.TemporaryDirectory[str]:
    """A scratch directory for the default file store: in ``/dev/shm`` when present (the recommended
    production location), else the system temp dir. The caller removes it (it is a context manager)."""
    shm = "/dev/shm"
    parent = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.TemporaryDirectory(prefix="hybridkv-bench-", dir=parent)


def default_store_urls(bytes_per_round: int, directory: str) -> list[str]:
    """``memory://`` and a ``file://`` store under ``directory``, big enough that its spare files (10 % of
    capacity, see ``hybridkv.store.file``) hold a round of each value size: the steady state of a store at
    capacity, where evicted files' pages are recycled. tmpfs allocates only the bytes written."""
    capacity = 32 * bytes_per_round
    return [f"memory://bench-{uuid.uuid4().hex}", f"file://{directory}/store?capacity={capacity}"]


def run_store_bench(
    urls: Sequence[str],
    *,
    value_sizes: Sequence[int] = DEFAULT_VALUE_SIZES,
    bytes_per_round: int = DEFAULT_BYTES_PER_ROUND,
    repeats: int = 3,
    num_exists_calls: int = 1000,
) -> dict[str, Any]:
    """Benchmark every store URL at every value size; one row per (store, size) with ratios to memcpy."""
    memcpy_by_size = {
        size: measure_memcpy(size, num_values_for(size, bytes_per_round), repeats=repeats)
        for size in value_sizes
    }
    rows: list[dict[str, Any]] = []
    for url in urls:
        store = open_store(url)
        try:
            latency = measure_exists_latency(store, num_calls=num_exists_calls)
            for size in value_sizes:
                num_values = num_values_for(size, bytes_per_round)
                result = measure_put_get(store, size, num_values, repeats=repeats)
                # memcpy again right after, so both sides see the same machine load; keep the better one.
                again = measure_memcpy(size, num_values, repeats=repeats)
                memcpy_gbps = max(memcpy_by_size[size]["memcpy_gbps"], again["memcpy_gbps"])
                rows.append(
                    {
                        "store": store.url.split("?", 1)[0],
                        "url": store.url,
                        "value_size": size,
                        "value_size_text": format_size(size),
                        "num_values": num_values,
                        "put_gbps": result["put_gbps"],
                        "get_gbps": result["get_gbps"],
                        "memcpy_gbps": memcpy_gbps,
                        "put_ratio": result["put_gbps"] / memcpy_gbps,
                        "get_ratio": result["get_gbps"] / memcpy_gbps,
                        **latency,
                    }
                )
        finally:
            store.close()
    return {
        "benchmark": "store",
        "unit": "GB/s = 1e9 bytes/s; ratios are store / memcpy of the same bytes in the same run",
        "bytes_per_round": bytes_per_round,
        "repeats": repeats,
        "rows": rows,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }


#: The columns ``hybridkv bench store`` prints, in order.
TABLE_COLUMNS = [
    "store",
    "value_size_text",
    "num_values",
    "put_gbps",
    "get_gbps",
    "memcpy_gbps",
    "put_ratio",
    "get_ratio",
    "exists_p50_us",
    "exists_p99_us",
]


def plot_report(report: dict[str, Any], path: Path) -> Path | None:
    """A bar chart of put/get ratios to memcpy per store and size; ``None`` without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = report["rows"]
    labels = [f"{row['store']}\n{row['value_size_text']}" for row in rows]
    positions = range(len(rows))
    figure, axes = plt.subplots(figsize=(max(6, len(rows) * 1.2), 4))
    axes.bar(
        [p - 0.2 for p in positions], [row["put_ratio"] for row in rows], width=0.4, label="put / memcpy"
    )
    axes.bar(
        [p + 0.2 for p in positions], [row["get_ratio"] for row in rows], width=0.4, label="get / memcpy"
    )
    axes.axhline(0.5, linestyle="--", linewidth=1, color="grey")
    axes.set_xticks(list(positions), labels, fontsize=7)
    axes.set_ylabel("throughput / memcpy")
    axes.legend()
    return save_figure(figure, path)
