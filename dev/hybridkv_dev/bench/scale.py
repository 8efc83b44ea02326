"""How the stores' costs grow with what they hold (``hybridkv bench scale``), as functions returning dicts.

Axis ``entries`` (the only axis so far; file store only): a ``file://`` store of N small entries (1 KiB
values, one file each) for each N of ``sizes``, every store populated with the store's own ``put`` in
batches (timed) and kept on disk side by side, its capacity set just above N entries so that one more
batch overflows it. Repeats interleave the sizes (repeat 1 of every size, then repeat 2, ...); each repeat
of a size times, on a handle opened in that repeat:

- ``open``: ``open_store(url)`` (what a fresh engine pays: the directory, its shared files, the record),
- ``lookup``: ``exists`` of ``LOOKUP_KEYS`` present keys in ``LOOKUP_ROUND_TRIPS`` calls: the most keys and
  round trips a K3-like 128K-token lookup's probing search cost in ``hybridkv bench scheduler``
  (docs/performance.md). The bench issues that many keys itself, it does not run the lifecycle's lookup
  planning, so its round trips are fixed by construction; their count does not depend on the store,
- ``get``: ``get_into`` of ``GET_KEYS`` present keys,
- ``tenant_counters``: the tenants' counters (no quota set: the ledger read only),
- ``stats``: reads every file's header (O(N) by design: an operator command, not an engine's call),
- ``put``: a put of ``PUT_KEYS`` new keys that overflows the capacity, its eviction included: the put's
  pass evicts what it needs from a sample of shards or the process's index of the oldest files
  (``hybridkv.store.file.eviction``), so its time should not grow with N; its per-unit cost is per entry
  it evicted,
- ``evict``: the top-up pass alone (``CapacityEvictor.top_up``, which a put wakes in the background): it
  scans every file and evicts down to the low watermark (a tenth of the store), O(N) by design.

After each eviction the evicted entries are put back (untimed), so every repeat sees N entries. Once per
size a child process opens the store and runs a lookup, a get, the counters and ``stats``: the engine
side's RSS (``VmRSS`` after the lookup, and after ``stats``). The report holds the medians over repeats
with their spread (min..max), per-unit costs, the load average before and after, and the targets: on every
per-unit cost the largest size within 1.5x of the smallest, opening at most 1 s per million entries (or not
growing), and the same lookup round trips at every size.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.bench.report import pyplot_or_none, save_figure, spread_text, target_row
from hybridkv.store import open_store
from hybridkv.store.base import Store, find_layer
from hybridkv.store.file import FileBackend

__all__ = [
    "AXES",
    "DEFAULT_SIZES",
    "TABLE_COLUMNS",
    "format_scale_table",
    "plot_report",
    "rss_child",
    "run_entries_axis",
]

AXES = ("entries",)
DEFAULT_SIZES = (10_000, 100_000, 1_000_000)
VALUE_BYTES = 1024
#: A K3-like 128K-token lookup's store cost at most (``hybridkv bench scheduler``, docs/performance.md).
LOOKUP_KEYS = 5_757
LOOKUP_ROUND_TRIPS = 2
GET_KEYS = 64
PUT_KEYS = 64
_FILL_BATCH = 2_048
#: A per-unit cost at the largest size may be at most this many times the smallest size's.
GROWTH_LIMIT = 1.5
#: Opening a store may cost at most this many seconds per million entries (where it grows at all).
OPEN_S_PER_MILLION = 1.0
#: How long a repeat waits for a put's background top-up to finish (it scans every file).
_TOP_UP_WAIT_S = 600.0

#: The columns of the printed table, in order (medians over repeats).
TABLE_COLUMNS = [
    "entries",
    "repeats",
    "populate_us_per_entry",
    "open_ms",
    "lookup_keys",
    "lookup_round_trips",
    "lookup_us_per_key",
    "get_us_per_key",
    "tenant_counters_us",
    "stats_ms",
    "stats_us_per_entry",
    "put_ms",
    "put_evicted",
    "put_us_per_evicted",
    "evict_ms",
    "evict_scanned",
    "evict_evicted",
    "evict_us_per_file",
    "rss_lookup_mib",
    "rss_stats_mib",
]

#: The timed metrics each repeat records (their medians and spreads go in the row).
_TIMED = (
    "open_ms",
    "lookup_us_per_key",
    "get_us_per_key",
    "tenant_counters_us",
    "stats_ms",
    "stats_us_per_entry",
    "put_ms",
    "put_us_per_evicted",
    "evict_ms",
    "evict_us_per_file",
)

#: (target name, row column) of the growth targets: largest over smallest within ``GROWTH_LIMIT``.
_GROWTH_TARGETS = (
    ("open_ms growth", "open_ms"),
    ("lookup us/key growth", "lookup_us_per_key"),
    ("get us/key growth", "get_us_per_key"),
    ("tenant_counters us growth", "tenant_counters_us"),
    ("stats us/entry growth (O(N) total)", "stats_us_per_entry"),
    ("put over capacity ms growth", "put_ms"),
    ("put over capacity us/evicted growth", "put_us_per_evicted"),
    ("top-up pass us/file scanned growth (background)", "evict_us_per_file"),
    ("populate us/entry growth", "populate_us_per_entry"),
    ("engine RSS growth", "rss_lookup_mib"),
)


def key_of(index: int) -> str:
    """The bench's key number ``index``: a block entry's key (``hybridkv.key_grammar``) of namespace scale."""
    return f"hkv1/scale/0123456789ab/g0/tp0/dcp0/{index:032x}"


@dataclass
class _SizedStore:
    """One size's store: its URL, the entries it holds and the next key number to put."""

    entries: int
    directory: Path
    url: str
    frame_bytes: int
    next_index: int = 0
    populate_s: float = 0.0

    def newest(self, count: int) -> list[str]:
        """The ``count`` keys put last (never evicted: a pass takes the least recently used first)."""
        return [key_of(i) for i in range(self.next_index - count, self.next_index)]


def _frame_bytes(root: Path) -> int:
    """The bytes one bench entry takes in a file store (its frame: header, key, value)."""
    probe = root / "frame-probe"
    store = open_store(f"file://{probe}?capacity=1048576")
    try:
        store.put([key_of(0)], [bytes(VALUE_BYTES)])
        num_bytes = store.stats().num_bytes
        assert num_bytes, "the file store's stats give its bytes"
        return num_bytes
    finally:
        store.close()
        shutil.rmtree(probe, ignore_errors=True)


def _put_new(store: Store, sized: _SizedStore, count: int) -> None:
    """Put ``count`` new entries in batches, all expected ``OK``."""
    value = bytes(VALUE_BYTES)
    while count > 0:
        batch = min(count, _FILL_BATCH)
        keys = [key_of(i) for i in range(sized.next_index, sized.next_index + batch)]
        statuses = store.put(keys, [value] * batch)
        assert all(status.is_ok for status in statuses), f"populating {sized.url}: {set(statuses)}"
        sized.next_index += batch
        count -= batch


def _populate(root: Path, entries: int, frame_bytes: int) -> _SizedStore:
    directory = root / f"entries-{entries}"
    shutil.rmtree(directory, ignore_errors=True)
    # Room for the N entries and half a put batch: the timed put of PUT_KEYS overflows it.
    capacity = entries * frame_bytes + PUT_KEYS * frame_bytes // 2
    sized = _SizedStore(entries, directory, f"file://{directory}?capacity={capacity}", frame_bytes)
    store = open_store(sized.url)
    try:
        start = time.perf_counter()
        _put_new(store, sized, entries)
        sized.populate_s = time.perf_counter() - start
    finally:
        store.close()
    return sized


def _num_files(backend: FileBackend) -> int:
    return sum(len(backend.layout.shard_paths(shard)) for shard in backend.layout.object_shards())


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def _measure(sized: _SizedStore) -> dict[str, float]:
    """One repeat of one size (see the module docstring); leaves the store holding ``entries`` again."""
    open_s, store = _timed(lambda: open_store(sized.url))
    try:
        backend = find_layer(store, FileBackend)
        assert backend is not None, f"{sized.url} has no file backend"
        lookup_keys = min(LOOKUP_KEYS, sized.entries // 2)
        keys = sized.newest(lookup_keys)
        calls = [keys[i::LOOKUP_ROUND_TRIPS] for i in range(LOOKUP_ROUND_TRIPS)]
        start = time.perf_counter()
        found = sum(status.is_ok for call in calls for status in store.exists(call))
        lookup_s = time.perf_counter() - start
        get_keys = sized.newest(min(GET_KEYS, sized.entries // 2))
        buffers = [bytearray(VALUE_BYTES) for _ in get_keys]
        get_s, statuses = _timed(lambda: store.get_into(get_keys, buffers))
        got = sum(status.is_ok for status in statuses)
        counters_s, _counters = _timed(backend.tenant_counters)
        stats_s, stats = _timed(store.stats)
        held = int(stats.num_keys)
        evictor = backend.layout.evictor
        evicted_before = evictor.num_put_evicted
        value = bytes(VALUE_BYTES)
        new_keys = [key_of(i) for i in range(sized.next_index, sized.next_index + PUT_KEYS)]
        put_s, statuses = _timed(lambda: store.put(new_keys, [value] * PUT_KEYS))
        assert all(status.is_ok for status in statuses), f"put under pressure: {set(statuses)}"
        sized.next_index += PUT_KEYS
        put_evicted = evictor.num_put_evicted - evicted_before
        # The put may have woken the background top-up (down to the low watermark): let it finish first.
        assert evictor.wait_idle(_TOP_UP_WAIT_S), f"{sized.url}: the top-up did not finish"
        _put_new(store, sized, max(0, sized.entries - _num_files(backend)))  # back to N
        scanned = _num_files(backend)
        # The top-up pass alone, as the put's wake-up runs it in the background: every file scanned, the
        # store evicted down to the low watermark.
        # As a put of PUT_KEYS new entries asks: room for them under the low watermark.
        evict_s, evict_evicted = _timed(lambda: evictor.top_up(PUT_KEYS * sized.frame_bytes))
        _put_new(store, sized, max(0, sized.entries - _num_files(backend)))
    finally:
        store.close()
    return {
        "open_ms": open_s * 1e3,
        "lookup_keys": lookup_keys,
        "lookup_found": found,
        "lookup_round_trips": len(calls),
        "lookup_us_per_key": lookup_s * 1e6 / lookup_keys,
        "get_keys": len(get_keys),
        "get_found": got,
        "get_us_per_key": get_s * 1e6 / len(get_keys),
        "tenant_counters_us": counters_s * 1e6,
        "stats_keys": held,
        "stats_ms": stats_s * 1e3,
        "stats_us_per_entry": stats_s * 1e6 / held,
        "put_ms": put_s * 1e3,
        "put_evicted": put_evicted,
        "put_us_per_evicted": put_s * 1e6 / max(1, put_evicted),
        "evict_ms": evict_s * 1e3,
        "evict_scanned": scanned,
        "evict_evicted": evict_evicted,
        "evict_us_per_file": evict_s * 1e6 / scanned,
    }


def rss_child(url: str, lookup_keys: int, newest_index: int) -> None:
    """In a child process: open ``url``, look up the ``lookup_keys`` keys below ``newest_index``, get some,
    read the counters, then ``stats``; print the RSS after the lookup and after ``stats`` as JSON (MiB)."""
    store = open_store(url)
    keys = [key_of(i) for i in range(newest_index - lookup_keys, newest_index)]
    store.exists(keys)
    store.get_into(keys[:GET_KEYS], [bytearray(VALUE_BYTES) for _ in keys[:GET_KEYS]])
    backend = find_layer(store, FileBackend)
    assert backend is not None
    backend.tenant_counters()
    after_lookup = _rss_mib()
    store.stats()
    print(json.dumps({"rss_lookup_mib": after_lookup, "rss_stats_mib": _rss_mib()}))
    store.close()


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rss_of(sized: _SizedStore) -> dict[str, float]:
    lookup_keys = min(LOOKUP_KEYS, sized.entries // 2)
    code = (
        "from hybridkv_dev.bench.scale import rss_child; "
        f"rss_child({sized.url!r}, {lookup_keys}, {sized.next_index})"
    )
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    result: dict[str, float] = json.loads(output.strip().splitlines()[-1])
    return result


def add_medians(row: dict[str, Any], samples: Sequence[dict[str, Any]], names: Sequence[str]) -> None:
    """``row[name]``: the median of ``name`` over ``samples``; ``row[name + "_spread"]``: its min..max."""
    for name in names:
        values = [sample[name] for sample in samples]
        row[name] = statistics.median(values)
        row[f"{name}_spread"] = spread_text(values)


def growth_targets(
    rows: Sequence[dict[str, Any]], name_to_column: Sequence[tuple[str, str]]
) -> list[dict[str, Any]]:
    """For each ``(name, column)``: the largest size's value over the smallest's, at most ``GROWTH_LIMIT``
    (none with a single size)."""
    if len(rows) < 2:
        return []
    small, large = rows[0], rows[-1]
    return [
        target_row(name, large[column] / small[column] if small[column] else None, "<=", GROWTH_LIMIT)
        for name, column in name_to_column
    ]


def medians_and_spreads(
    rows: Sequence[dict[str, Any]], columns: Sequence[str], size: str, timed: Sequence[str]
) -> str:
    """The medians per size (``columns``), then each timed metric's min..max over repeats, sized by ``size``."""
    from hybridkv.tables import format_table

    spreads = [{size: row[size], **{name: row[f"{name}_spread"] for name in timed}} for row in rows]
    return (
        format_table(list(rows), list(columns))
        + "\nspread over repeats (min..max):\n"
        + format_table(spreads, [size, *timed])
    )


def _row(sized: _SizedStore, samples: list[dict[str, float]], rss: dict[str, float]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "entries": sized.entries,
        "repeats": len(samples),
        "frame_bytes": sized.frame_bytes,
        "populate_s": sized.populate_s,
        "populate_us_per_entry": sized.populate_s * 1e6 / sized.entries,
    }
    for name in ("lookup_keys", "lookup_round_trips", "get_keys", "evict_scanned"):
        row[name] = int(statistics.median(sample[name] for sample in samples))
    for name in ("put_evicted", "evict_evicted"):
        row[name] = int(statistics.median(sample[name] for sample in samples))
    row["lookup_found_min"] = int(min(sample["lookup_found"] for sample in samples))
    row["get_found_min"] = int(min(sample["get_found"] for sample in samples))
    row["stats_keys_min"] = int(min(sample["stats_keys"] for sample in samples))
    row["stats_keys_max"] = int(max(sample["stats_keys"] for sample in samples))
    add_medians(row, samples, _TIMED)
    row.update(rss)
    row["samples"] = samples
    return row


def _targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Growth targets between the smallest and the largest size (none with a single size)."""
    if len(rows) < 2:
        return []
    small, large = rows[0], rows[-1]
    targets = growth_targets(rows, _GROWTH_TARGETS)
    targets.append(
        target_row(
            "open s per 10^6 entries (largest)",
            large["open_ms"] / 1e3 / (large["entries"] / 1e6),
            "<=",
            OPEN_S_PER_MILLION,
        )
    )
    targets.append(
        target_row(
            "lookup round trips, largest - smallest",
            large["lookup_round_trips"] - small["lookup_round_trips"],
            "==",
            0,
        )
    )
    return targets


def run_entries_axis(
    root: Path,
    sizes: Sequence[int],
    *,
    repeats: int,
    keep: bool = False,
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """The ``entries`` axis (see the module docstring) under ``root``; returns the report.

    ``keep``: leave the stores on disk (default: removed at the end)."""
    sizes = sorted(set(sizes))
    assert sizes and sizes[0] >= 2, f"sizes must be >= 2 entries, got {sizes}"
    assert repeats >= 1, f"repeats must be >= 1, got {repeats}"
    root.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    frame_bytes = _frame_bytes(root)
    stores: list[_SizedStore] = []
    try:
        for entries in sizes:
            sized = _populate(root, entries, frame_bytes)
            stores.append(sized)
            progress(f"populated {entries} entries in {sized.populate_s:.1f} s")
        samples: list[list[dict[str, float]]] = [[] for _ in stores]
        for repeat in range(repeats):
            for sized, sized_samples in zip(stores, samples, strict=True):
                sized_samples.append(_measure(sized))
            progress(f"repeat {repeat + 1}/{repeats} done")
        rows = [
            _row(sized, sized_samples, _rss_of(sized))
            for sized, sized_samples in zip(stores, samples, strict=True)
        ]
    finally:
        if not keep:
            for sized in stores:
                shutil.rmtree(sized.directory, ignore_errors=True)
    load_after = os.getloadavg()
    return {
        "bench": "scale",
        "axis": "entries",
        "store": "file",
        "root": str(root),
        "value_bytes": VALUE_BYTES,
        "frame_bytes": frame_bytes,
        "repeats": repeats,
        "lookup": {
            "keys": LOOKUP_KEYS,
            "round_trips": LOOKUP_ROUND_TRIPS,
            "scheme": "the documented K3-like 128K-token lookup's key count and round trips; keys issued "
            "by the bench (newest entries), not planned by the lifecycle",
        },
        "get_keys": GET_KEYS,
        "put_keys": PUT_KEYS,
        "cpu_count": os.cpu_count(),
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "rows": rows,
        "targets": _targets(rows),
    }


def format_scale_table(report: dict[str, Any]) -> str:
    """The medians per size, then each timed metric's spread over repeats."""
    return "medians over repeats:\n" + medians_and_spreads(report["rows"], TABLE_COLUMNS, "entries", _TIMED)


def plot_report(report: dict[str, Any], path: Path) -> Path | None:
    """One panel per per-unit cost against the entries (log x); ``None`` without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    columns = [column for _name, column in _GROWTH_TARGETS] + ["open_ms", "put_ms"]
    columns = list(dict.fromkeys(columns))
    figure, axes = plt.subplots(2, (len(columns) + 1) // 2, figsize=(4 * ((len(columns) + 1) // 2), 7))
    entries = [row["entries"] for row in report["rows"]]
    for axis, column in zip(axes.flat, columns, strict=False):
        axis.plot(entries, [row[column] for row in report["rows"]], marker="o")
        axis.set_xscale("log")
        axis.set_xlabel("entries")
        axis.set_title(column)
        axis.set_ylim(bottom=0)
    return save_figure(figure, path)
