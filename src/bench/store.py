"""Store throughput and latency measurements, as pure functions returning dicts (``hybridkv bench store``).

Every throughput is reported next to a plain ``memcpy`` (``numpy.copyto``) of the same bytes, value size and
working set, measured in the same rounds, because on a shared 2-core box absolute GB/s swing by +-40 %:
each round runs the memcpy, the batched put and the batched get back to back, so one round's ratios see one
machine load. Ratios are the median over ``repeats`` rounds, with their min and max as the spread;
throughputs are medians too. The memcpy writes into pre-touched buffers; a store must place each new value
in page-cache pages (page faults and kernel zeroing for new pages, per-page bookkeeping for recycled ones),
which dominates ``put`` for large values. GB/s uses 1e9 bytes.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import numpy as np
from hybridkv.bench.report import pyplot_or_none, save_figure
from hybridkv.store.base import Status, Store, Value, contiguous_shares, find_layer
from hybridkv.store.file import FileBackend
from hybridkv.store.params import format_size
from hybridkv.store.url import open_store
from typing_extensions import Buffer

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


def _as_values(arrays: list[np.ndarray], num_parts: int = 1) -> list[Value]:
    """numpy arrays as store values (and destinations). They are buffers; numpy's stubs declare the buffer
    protocol only for Python >= 3.12, hence the cast. ``num_parts`` > 1: each value is that many contiguous
    views of its array (a sequence of buffers, as a block's KV pages are: one per layer)."""
    if num_parts > 1:
        return cast("list[Value]", [np.array_split(array, num_parts) for array in arrays])
    return cast("list[Value]", arrays)


def measure_memcpy(value_size: int, num_values: int, *, repeats: int = 3) -> dict[str, float]:
    """GB/s of ``np.copyto`` over ``num_values`` buffers of ``value_size`` bytes (best of ``repeats``)."""
    sources, destinations = _buffers(value_size, num_values, seed=1)
    best = 0.0
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for source, destination in zip(sources, destinations, strict=True):
            np.copyto(destination, source)
        elapsed = time.perf_counter() - start
        best = max(best, value_size * num_values / max(elapsed, 1e-9) / 1e9)
    return {"memcpy_gbps": best}


def measure_put_get(
    store: Store,
    value_size: int,
    num_values: int,
    *,
    repeats: int = 5,
    floor_directory: Path | None = None,
    num_parts: int = 1,
    num_readers: int = 1,
) -> dict[str, float]:
    """Throughput of one batched ``put`` and one batched ``get_into`` of ``num_values`` values, interleaved
    with a memcpy of the same bytes: medians over ``repeats`` rounds, and per-round ratios to the memcpy
    (median, min, max).

    Each round uses fresh keys (puts are insert-if-absent, so a repeated key would measure nothing), checks
    every status and the bytes of the first and last value of each reader's share, then removes its keys. ``num_parts`` > 1: each
    value is put from, and read into, that many parts (see ``_as_values``). ``num_readers`` > 1: the get is
    that many concurrent ``get_into`` calls, each on its own contiguous share of the keys (the calling
    thread reads the first share, threads started before the rounds the others), as a load job's readers
    read one batch; its time runs until the last share returned. The memcpy (one thread) copies the
    sources into buffers of its own, so the get's byte check cannot pass on bytes the memcpy left behind.

    With ``floor_directory`` (a file store's directory), each round also overwrites ``num_values`` files
    there whose pages already exist with one ``pwrite`` each, from open descriptors: no checksum, no path
    syscalls, no locks. ``page_write_ratio`` (that over the memcpy) is the floor a file store's put of
    recycled files can approach on that filesystem.
    """
    sources, destinations = _buffers(value_size, num_values, seed=2)
    copies = [np.ones(value_size, dtype=np.uint8) for _ in range(num_values)]  # pre-touched pages
    floor_fds = [] if floor_directory is None else _open_floor_files(floor_directory, sources)
    total = value_size * num_values
    memcpy_gbps: list[float] = []
    put_gbps: list[float] = []
    get_gbps: list[float] = []
    page_write_gbps: list[float] = []
    shares = contiguous_shares(num_values, num_readers)
    helpers = ThreadPoolExecutor(len(shares) - 1, "hybridkv-bench-read") if len(shares) > 1 else None
    try:
        for round_index in range(max(1, repeats)):
            memcpy_gbps.append(total / _time_memcpy(sources, copies) / 1e9)
            if floor_fds:
                start = time.perf_counter()
                for fd, source in zip(floor_fds, sources, strict=True):
                    os.pwrite(fd, cast(Buffer, source), 0)
                page_write_gbps.append(total / max(time.perf_counter() - start, 1e-9) / 1e9)
            put_seconds, get_seconds = _time_put_get(
                store, sources, destinations, round_index, num_parts=num_parts, shares=shares, helpers=helpers
            )
            put_gbps.append(total / put_seconds / 1e9)
            get_gbps.append(total / get_seconds / 1e9)
    finally:
        if helpers is not None:
            helpers.shutdown()
        for fd in floor_fds:
            os.close(fd)
    put_ratios = [put / memcpy for put, memcpy in zip(put_gbps, memcpy_gbps, strict=True)]
    get_ratios = [get / memcpy for get, memcpy in zip(get_gbps, memcpy_gbps, strict=True)]
    result = {
        "put_gbps": statistics.median(put_gbps),
        "get_gbps": statistics.median(get_gbps),
        "memcpy_gbps": statistics.median(memcpy_gbps),
        "put_ratio": statistics.median(put_ratios),
        "put_ratio_min": min(put_ratios),
        "put_ratio_max": max(put_ratios),
        "get_ratio": statistics.median(get_ratios),
        "get_ratio_min": min(get_ratios),
        "get_ratio_max": max(get_ratios),
    }
    if page_write_gbps:
        result["page_write_ratio"] = statistics.median(
            [page / memcpy for page, memcpy in zip(page_write_gbps, memcpy_gbps, strict=True)]
        )
    return result


def _open_floor_files(directory: Path, sources: list[np.ndarray]) -> list[int]:
    """One file per source under ``directory``, written once (so its pages exist) and already unlinked:
    open descriptors the floor measurement overwrites, gone with the last close."""
    fds: list[int] = []
    try:
        for source in sources:
            path = directory / f"page-write-floor-{uuid.uuid4().hex}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.unlink(path)
            fds.append(fd)
            os.pwrite(fd, cast(Buffer, source), 0)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _time_memcpy(sources: list[np.ndarray], copies: list[np.ndarray]) -> float:
    start = time.perf_counter()
    for source, copy in zip(sources, copies, strict=True):
        np.copyto(copy, source)
    return max(time.perf_counter() - start, 1e-9)


def _time_put_get(
    store: Store,
    sources: list[np.ndarray],
    destinations: list[np.ndarray],
    round_index: int,
    *,
    num_parts: int,
    shares: list[tuple[int, int]],
    helpers: ThreadPoolExecutor | None,
) -> tuple[float, float]:
    """Seconds of one checked batched put and get of fresh keys (removed afterwards); the get reads
    ``shares`` at once, the first on the calling thread and the others on ``helpers`` (see
    ``measure_put_get``)."""
    num_values = len(sources)
    keys = [f"hybridkv-bench/{uuid.uuid4().hex}/{round_index}/{i}" for i in range(num_values)]
    values, targets = _as_values(sources, num_parts), _as_values(destinations, num_parts)
    start = time.perf_counter()
    put_statuses = store.put(keys, values)
    put_elapsed = time.perf_counter() - start
    assert all(s is Status.OK for s in put_statuses), f"{store.url}: bench put failed: {set(put_statuses)}"
    start = time.perf_counter()
    others = [
        helpers.submit(store.get_into, keys[low:high], targets[low:high])
        for low, high in shares[1:]
        if helpers is not None
    ]
    low, high = shares[0]
    get_statuses = store.get_into(keys[low:high], targets[low:high])
    for other in others:
        get_statuses = [*get_statuses, *other.result()]
    get_elapsed = time.perf_counter() - start
    assert all(s is Status.OK for s in get_statuses), f"{store.url}: bench get failed: {set(get_statuses)}"
    checked = sorted({index for low, high in shares for index in (low, high - 1)})  # each share's ends
    assert all(np.array_equal(sources[index], destinations[index]) for index in checked), (
        f"{store.url}: bench read back different bytes"
    )
    store.remove(keys)
    for index in checked:
        destinations[index].fill(1)  # the next round's check must see that round's bytes, not these
    return max(put_elapsed, 1e-9), max(get_elapsed, 1e-9)


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


def filesystem_of(directory: Path) -> str:
    """The filesystem ``directory`` is on, from /proc/self/mountinfo: its type, and for tmpfs its huge-page
    mode (``tmpfs huge=never``), which decides whether a file store's writes touch 4 KiB or 2 MiB pages;
    ``unknown`` where mountinfo cannot be read."""
    path = os.path.realpath(directory)
    best_mount_point = ""
    description = "unknown"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as mountinfo:
            lines = mountinfo.read().splitlines()
    except OSError:
        return description
    for line in lines:
        mount_fields, separator, filesystem_fields = line.partition(" - ")
        mount_point = mount_fields.split(" ")[4].replace("\\040", " ") if separator else ""
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if not inside or len(mount_point) < len(best_mount_point):
            continue
        filesystem_type, _source, super_options = (filesystem_fields.split(" ") + ["", ""])[:3]
        best_mount_point = mount_point
        description = filesystem_type
        if filesystem_type == "tmpfs":
            huge = [option for option in super_options.split(",") if option.startswith("huge=")]
            description += " " + (huge[0] if huge else "huge=never")
    return description


def bench_scratch_dir(parent: str | None = None) -> tempfile.TemporaryDirectory[str]:
    """A scratch directory for the default file store: under ``parent`` if given, else in ``/dev/shm`` when
    present (the recommended production location), else the system temp dir. The caller removes it (it is a
    context manager)."""
    shm = "/dev/shm"
    if parent is None and os.path.isdir(shm) and os.access(shm, os.W_OK):
        parent = shm
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
    repeats: int = 5,
    num_exists_calls: int = 1000,
    num_parts: int = 1,
    num_readers: int = 1,
) -> dict[str, Any]:
    """Benchmark every store URL at every value size; one row per (store, size) with ratios to memcpy
    (medians over ``repeats`` interleaved rounds, and their spread). ``num_parts`` > 1: every value is put
    from and read into that many parts (as a block's KV pages are); ``num_readers`` > 1: every get is
    split over that many concurrent readers (as a load job's batch is)."""
    rows: list[dict[str, Any]] = []
    for url in urls:
        store = open_store(url)
        try:
            latency = measure_exists_latency(store, num_calls=num_exists_calls)
            backend = find_layer(store, FileBackend)
            floor_directory = backend.directory if backend is not None else None
            for size in value_sizes:
                num_values = num_values_for(size, bytes_per_round)
                result = measure_put_get(
                    store,
                    size,
                    num_values,
                    repeats=repeats,
                    floor_directory=floor_directory,
                    num_parts=num_parts,
                    num_readers=num_readers,
                )
                rows.append(
                    {
                        "store": store.url.split("?", 1)[0],
                        "url": store.url,
                        "filesystem": "" if floor_directory is None else filesystem_of(floor_directory),
                        "value_size": size,
                        "value_size_text": format_size(size),
                        "num_values": num_values,
                        "num_parts": num_parts,
                        "num_readers": num_readers,
                        **result,
                        "put_ratio_spread": f"{result['put_ratio_min']:.2f}-{result['put_ratio_max']:.2f}",
                        "get_ratio_spread": f"{result['get_ratio_min']:.2f}-{result['get_ratio_max']:.2f}",
                        **latency,
                    }
                )
        finally:
            store.close()
    return {
        "benchmark": "store",
        "unit": "GB/s = 1e9 bytes/s; ratios are store / memcpy of the same bytes in the same round, medians "
        "over the rounds with min-max spread",
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
    "num_parts",
    "num_readers",
    "put_gbps",
    "get_gbps",
    "memcpy_gbps",
    "put_ratio",
    "put_ratio_spread",
    "page_write_ratio",
    "get_ratio",
    "get_ratio_spread",
    "exists_p50_us",
    "exists_p99_us",
    "filesystem",
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
