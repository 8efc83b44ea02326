"""How a Mooncake store's costs grow with the keys it holds (``hybridkv bench scale --axis mooncake-entries``).

Runs only inside a loopback-only network namespace (``scripts/netns-run``): every Mooncake process listens
on ``0.0.0.0``. For each N of ``sizes`` the bench starts its own deployment, the documented topology
(``hybridkv.store.mooncake_node``): a real ``mooncake_master`` on 127.0.0.1 (``hybridkv_dev.devkit.mooncake``,
the product's argv) and one storage node (``python -m hybridkv.store.mooncake_node``) mounting a segment
sized so that N entries fill it to just under the master's eviction high watermark (0.8; room for half a
put batch more, as the file store's ``entries`` axis sizes its capacity). The engine side is a pure client
(``segment=0``, what an engine of that topology is). Values are small (``value_bytes``: at least 1 KiB, a
power of two large enough that the smallest size's segment reaches Mooncake's 16 MiB minimum); every
store is populated with the store's own ``put`` in batches (timed) and kept running side by side.

Repeats interleave the sizes; each repeat of a size times, on a client opened in that repeat:

- ``open``: ``open_store(url)`` of a fresh pure client (its ``setup`` against the master: what a fresh
  engine pays; its ``close`` is untimed),
- ``lookup``: ``exists`` of ``LOOKUP_KEYS`` present keys in ``LOOKUP_ROUND_TRIPS`` calls (``scale.py``'s K3-like
  128K-token lookup); the backend slices each call into ``batch_is_exist`` RPCs of ``EXISTS_KEYS_PER_CALL``
  keys, counted as ``lookup_rpcs``,
- ``put``: a put of ``PUT_KEYS`` new keys that takes the pool over the high watermark (capacity pressure),
- ``get``: ``get_into`` of ``GET_KEYS`` present keys right after that put (the newest keys, leased by the
  lookup, so Mooncake's eviction cannot take them),
- ``evict``: Mooncake's own eviction, which runs in the master's background thread (every 10 ms once usage
  is above the watermark, a fraction of the unleased objects per pass): the time from the put's end until
  the master's ``master_evicted_key_count`` (its Prometheus metrics on 127.0.0.1) rose, and the keys it
  evicted. Its resolution is that thread's cadence plus the metrics poll (~ms), so it bounds the pass
  from above rather than timing it.

After each eviction the bench puts new keys until the master holds N again (untimed; a pass that evicted fewer keys
than the put added leaves up to ``PUT_KEYS`` more, and the next repeat starts from there, its pool still below the
watermark). Once per size, after the repeats: the master's and the storage node's RSS (``VmRSS`` in
``/proc/<pid>/status``; the master's per key counts its growth above its RSS before the first key), and a child
process that opens a pure client, runs the lookup and the get and prints its RSS (the engine side's). The report
holds the medians over repeats with their spread (min..max), per-unit costs, the load average before and after, and
the targets: per-unit costs at the largest size within 1.5x of the smallest, opening at most 1 s per million keys
(or not growing), the same lookup round trips and RPCs at every size.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hybridkv.bench.report import pyplot_or_none, save_figure, target_row
from hybridkv.store import open_store
from hybridkv.store.base import Store
from hybridkv.store.mooncake import EXISTS_KEYS_PER_CALL

from hybridkv_dev.bench.scale import (
    GET_KEYS,
    LOOKUP_KEYS,
    LOOKUP_ROUND_TRIPS,
    OPEN_S_PER_MILLION,
    PUT_KEYS,
    add_medians,
    growth_targets,
    key_of,
    medians_and_spreads,
)
from hybridkv_dev.bench.scale_mooncake_deploy import (
    HIGH_WATERMARK,
    Deployment,
    frame_bytes_of,
    master_metrics,
    rss_mib_of,
    running_deployment,
    value_bytes_for,
)
from hybridkv_dev.devkit.net import LOOPBACK, NETNS_HINT, loopback_only_namespace

__all__ = [
    "AXIS",
    "DEFAULT_SIZES",
    "MIN_ENTRIES",
    "TABLE_COLUMNS",
    "format_mooncake_table",
    "namespace_problem",
    "plot_mooncake_report",
    "rss_child",
    "run_mooncake_entries_axis",
    "value_bytes_for",
]

AXIS = "mooncake-entries"
DEFAULT_SIZES = (10_000, 100_000, 1_000_000)
#: The fewest keys a size may hold: the timed put must end above the watermark and below a full pool
#: (half a put batch is at most a tenth of the pool).
MIN_ENTRIES = 300
#: Keys per populate put; 2 scatter-gather slices each (header, value), under the TCP queue set below.
_FILL_BATCH = 2048
#: Slices one batch may queue to one peer (Mooncake's default 1,024 rejects a batch of more with -800).
_MAX_QUEUED_TRANSFERS_PER_PEER = "8192"
#: How long to wait for Mooncake's eviction thread to act on a pool above the watermark.
_EVICTION_WAIT_S = 10.0
#: How long the master's key counts must hold still to call an eviction pass over.
_SETTLE_S = 0.1

TABLE_COLUMNS = [
    "entries",
    "repeats",
    "value_bytes",
    "populate_us_per_entry",
    "open_ms",
    "lookup_keys",
    "lookup_round_trips",
    "lookup_rpcs",
    "lookup_us_per_key",
    "put_ms",
    "put_us_per_key",
    "get_us_per_key",
    "get_found_min",
    "evict_observed_ms",
    "evict_evicted",
    "evict_us_per_evicted",
    "client_rss_mib",
    "master_rss_mib",
    "master_rss_bytes_per_key",
    "node_rss_mib",
]

_TIMED = (
    "open_ms",
    "lookup_us_per_key",
    "put_ms",
    "put_us_per_key",
    "get_us_per_key",
    "evict_observed_ms",
    "evict_us_per_evicted",
)

_GROWTH_TARGETS = (
    ("open_ms growth", "open_ms"),
    ("lookup us/key growth", "lookup_us_per_key"),
    ("put under pressure us/key growth", "put_us_per_key"),
    ("get under pressure us/key growth", "get_us_per_key"),
    ("eviction us/evicted growth", "evict_us_per_evicted"),
    ("populate us/entry growth", "populate_us_per_entry"),
    ("engine (client) RSS growth", "client_rss_mib"),
    ("master RSS bytes/key growth", "master_rss_bytes_per_key"),
)


def _put_new(store: Store, deployment: Deployment, count: int) -> None:
    """Put ``count`` new keys in batches, all expected ``OK``."""
    value = bytes(deployment.value_bytes)
    while count > 0:
        batch = min(count, _FILL_BATCH)
        keys = [key_of(i) for i in range(deployment.next_index, deployment.next_index + batch)]
        statuses = store.put(keys, [value] * batch)
        assert all(status.is_ok for status in statuses), (
            f"populating {deployment.master.address}: {set(statuses)}"
        )
        deployment.next_index += batch
        count -= batch


def _populate(deployment: Deployment) -> None:
    assert deployment.master.process is not None
    deployment.master_rss_idle_mib = rss_mib_of(deployment.master.process.pid)
    store = open_store(deployment.url)
    try:
        start = time.perf_counter()
        _put_new(store, deployment, deployment.entries)
        deployment.populate_s = time.perf_counter() - start
    finally:
        store.close()
    metrics = master_metrics(deployment.master)
    deployment.allocated_bytes = metrics["master_allocated_bytes"]
    deployment.capacity_bytes = metrics["master_total_capacity_bytes"]
    held = int(metrics["master_key_count"])
    assert held == deployment.entries, (
        f"{deployment.master.address} holds {held} keys after populating {deployment.entries}: "
        f"evicted while below the watermark?"
    )


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def _await_eviction(deployment: Deployment, evicted_before: float) -> float:
    """The ``perf_counter`` time at which the master's evicted-key counter was seen above
    ``evicted_before``; ``RuntimeError`` if nothing was evicted within ``_EVICTION_WAIT_S``."""
    start = time.perf_counter()
    while time.perf_counter() - start < _EVICTION_WAIT_S:
        if master_metrics(deployment.master)["master_evicted_key_count"] > evicted_before:
            return time.perf_counter()
        time.sleep(0.001)
    raise RuntimeError(
        f"mooncake_master on {deployment.master.address} evicted nothing within {_EVICTION_WAIT_S} s "
        f"of a put above its high watermark ({master_metrics(deployment.master)})"
    )


def _settled(deployment: Deployment) -> dict[str, float]:
    """The master's metrics once its key count and evicted-key count held still for ``_SETTLE_S`` (the
    eviction pass over)."""
    previous = master_metrics(deployment.master)
    deadline = time.perf_counter() + _EVICTION_WAIT_S
    while time.perf_counter() < deadline:
        time.sleep(_SETTLE_S)
        current = master_metrics(deployment.master)
        if all(current[name] == previous[name] for name in ("master_key_count", "master_evicted_key_count")):
            return current
        previous = current
    raise RuntimeError(f"mooncake_master on {deployment.master.address} kept evicting: {previous}")


def _measure(deployment: Deployment) -> dict[str, float]:
    """One repeat of one size (see the module docstring); leaves the master holding ``entries`` again."""
    open_s, store = _timed(lambda: open_store(deployment.url))
    try:
        lookup_keys = min(LOOKUP_KEYS, deployment.entries // 2)
        keys = deployment.newest(lookup_keys)
        calls = [keys[i::LOOKUP_ROUND_TRIPS] for i in range(LOOKUP_ROUND_TRIPS)]
        start = time.perf_counter()
        found = sum(status.is_ok for call in calls for status in store.exists(call))
        lookup_s = time.perf_counter() - start
        rpcs = sum(math.ceil(len(call) / EXISTS_KEYS_PER_CALL) for call in calls)
        get_keys = deployment.newest(min(GET_KEYS, deployment.entries // 2))
        buffers = [bytearray(deployment.value_bytes) for _ in get_keys]
        before = master_metrics(deployment.master)
        value = bytes(deployment.value_bytes)
        new_keys = [key_of(i) for i in range(deployment.next_index, deployment.next_index + PUT_KEYS)]
        put_s, statuses = _timed(lambda: store.put(new_keys, [value] * PUT_KEYS))
        put_ended = time.perf_counter()
        assert all(status.is_ok for status in statuses), f"put under pressure: {set(statuses)}"
        deployment.next_index += PUT_KEYS
        get_s, statuses = _timed(lambda: store.get_into(get_keys, buffers))
        got = sum(status.is_ok for status in statuses)
        # From the put's end: the get above ran while the eviction thread may already have been at work.
        observed_s = _await_eviction(deployment, before["master_evicted_key_count"]) - put_ended
        after = _settled(deployment)
        # The keys that left (the master's evicted-key counter can count more than left the key count).
        evicted = int(before["master_key_count"] + PUT_KEYS - after["master_key_count"])
        usage_after_put = (before["master_allocated_bytes"] + PUT_KEYS * deployment.frame_bytes) / before[
            "master_total_capacity_bytes"
        ]
        # Back to N (a pass that evicted fewer than the put added leaves more: the next repeat starts there).
        _put_new(store, deployment, max(0, deployment.entries - int(after["master_key_count"])))
    finally:
        store.close()
    return {
        "open_ms": open_s * 1e3,
        "lookup_keys": lookup_keys,
        "lookup_found": found,
        "lookup_round_trips": len(calls),
        "lookup_rpcs": rpcs,
        "lookup_us_per_key": lookup_s * 1e6 / lookup_keys,
        "keys_before_put": before["master_key_count"],
        "usage_after_put": usage_after_put,
        "put_ms": put_s * 1e3,
        "put_us_per_key": put_s * 1e6 / PUT_KEYS,
        "get_keys": len(get_keys),
        "get_found": got,
        "get_us_per_key": get_s * 1e6 / len(get_keys),
        "evict_observed_ms": observed_s * 1e3,
        "evict_evicted": evicted,
        "evict_us_per_evicted": observed_s * 1e6 / max(1, evicted),
    }


def rss_child(url: str, lookup_keys: int, newest_index: int, value_bytes: int) -> None:
    """In a child process: open ``url`` (a pure client), look up the ``lookup_keys`` keys below
    ``newest_index`` and get ``GET_KEYS`` of them; print the RSS after that as JSON (MiB)."""
    store = open_store(url)
    keys = [key_of(i) for i in range(newest_index - lookup_keys, newest_index)]
    store.exists(keys)
    get_keys = keys[-GET_KEYS:]
    store.get_into(get_keys, [bytearray(value_bytes) for _ in get_keys])
    print(json.dumps({"client_rss_mib": rss_mib_of("self")}), flush=True)
    store.close()


def _rss_of(deployment: Deployment) -> dict[str, float]:
    lookup_keys = min(LOOKUP_KEYS, deployment.entries // 2)
    code = (
        "from hybridkv_dev.bench.scale_mooncake import rss_child; "
        f"rss_child({deployment.url!r}, {lookup_keys}, {deployment.next_index}, {deployment.value_bytes})"
    )
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    client: dict[str, float] = json.loads(output.strip().splitlines()[-1])
    assert deployment.master.process is not None
    master_rss = rss_mib_of(deployment.master.process.pid)
    return {
        **client,
        "master_rss_mib": master_rss,
        "master_rss_idle_mib": deployment.master_rss_idle_mib,
        # What the keys cost the master: its RSS above the idle master's, per key held.
        "master_rss_bytes_per_key": (master_rss - deployment.master_rss_idle_mib)
        * (1 << 20)
        / deployment.entries,
        "node_rss_mib": rss_mib_of(deployment.node.pid),
    }


def _row(deployment: Deployment, samples: list[dict[str, float]], rss: dict[str, float]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "entries": deployment.entries,
        "repeats": len(samples),
        "value_bytes": deployment.value_bytes,
        "frame_bytes": deployment.frame_bytes,
        "segment_bytes": deployment.segment_bytes,
        "populate_s": deployment.populate_s,
        "populate_us_per_entry": deployment.populate_s * 1e6 / deployment.entries,
    }
    for name in ("lookup_keys", "lookup_round_trips", "lookup_rpcs", "get_keys", "evict_evicted"):
        row[name] = int(statistics.median(sample[name] for sample in samples))
    row["lookup_found_min"] = int(min(sample["lookup_found"] for sample in samples))
    row["get_found_min"] = int(min(sample["get_found"] for sample in samples))
    row["keys_before_put_min"] = int(min(sample["keys_before_put"] for sample in samples))
    row["keys_before_put_max"] = int(max(sample["keys_before_put"] for sample in samples))
    row["usage_after_put_min"] = min(sample["usage_after_put"] for sample in samples)
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
            "open s per 10^6 keys (largest)",
            large["open_ms"] / 1e3 / (large["entries"] / 1e6),
            "<=",
            OPEN_S_PER_MILLION,
        )
    )
    for name, column in (("lookup round trips", "lookup_round_trips"), ("lookup RPCs", "lookup_rpcs")):
        targets.append(target_row(f"{name}, largest - smallest", large[column] - small[column], "==", 0))
    return targets


def namespace_problem() -> str | None:
    """Why this process may not start Mooncake processes (not in a loopback-only network namespace: every
    Mooncake process listens on ``0.0.0.0``), or None."""
    return None if loopback_only_namespace() else NETNS_HINT


def run_mooncake_entries_axis(
    root: Path,
    sizes: Sequence[int],
    *,
    repeats: int,
    eviction_ratio: float | None = None,
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """The ``mooncake-entries`` axis (see the module docstring); logs under ``root``; returns the report.

    ``eviction_ratio``: the masters' ``--eviction_ratio`` (the fraction of the keys one eviction pass
    evicts; None: Mooncake's default, 0.05).

    ``RuntimeError`` outside a loopback-only network namespace (``scripts/netns-run``)."""
    sizes = sorted(set(sizes))
    assert sizes and sizes[0] >= MIN_ENTRIES, f"sizes must be >= {MIN_ENTRIES} keys, got {sizes}"
    assert repeats >= 1, f"repeats must be >= 1, got {repeats}"
    root.mkdir(parents=True, exist_ok=True)
    # Set before the first client: Mooncake reads them once per process (the storage nodes inherit them).
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", _MAX_QUEUED_TRANSFERS_PER_PEER)
    value_bytes = value_bytes_for(sizes[0])
    load_before = os.getloadavg()
    with ExitStack() as stack:
        deployments: list[Deployment] = []
        for entries in sizes:
            deployment = stack.enter_context(running_deployment(root, entries, value_bytes, eviction_ratio))
            _populate(deployment)
            deployments.append(deployment)
            progress(
                f"populated {entries} keys in {deployment.populate_s:.1f} s "
                f"({deployment.allocated_bytes:.0f} of {deployment.capacity_bytes:.0f} B allocated, "
                f"{deployment.segment_bytes} B segment)"
            )
        samples: list[list[dict[str, float]]] = [[] for _ in deployments]
        for repeat in range(repeats):
            for deployment, deployment_samples in zip(deployments, samples, strict=True):
                deployment_samples.append(_measure(deployment))
            progress(f"repeat {repeat + 1}/{repeats} done")
        rows = [
            _row(deployment, deployment_samples, _rss_of(deployment))
            for deployment, deployment_samples in zip(deployments, samples, strict=True)
        ]
    load_after = os.getloadavg()
    return {
        "bench": "scale",
        "axis": AXIS,
        "store": "mooncake",
        "value_bytes": value_bytes,
        "frame_bytes": frame_bytes_of(value_bytes),
        "high_watermark": HIGH_WATERMARK,
        "eviction_ratio": eviction_ratio,
        "repeats": repeats,
        "lookup": {
            "keys": LOOKUP_KEYS,
            "round_trips": LOOKUP_ROUND_TRIPS,
            "keys_per_rpc": EXISTS_KEYS_PER_CALL,
            "scheme": "the documented K3-like 128K-token lookup's key count and round trips; keys issued "
            "by the bench (newest entries), not planned by the lifecycle; each exists call is sliced into "
            "batch_is_exist RPCs of keys_per_rpc keys",
        },
        "get_keys": GET_KEYS,
        "put_keys": PUT_KEYS,
        "topology": "one mooncake_master and one storage node per size on 127.0.0.1 (private network "
        "namespace); the bench is a pure client (segment=0)",
        "cpu_count": os.cpu_count(),
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "rows": rows,
        "targets": _targets(rows),
    }


def format_mooncake_table(report: dict[str, Any]) -> str:
    """The medians per size, then each timed metric's spread over repeats."""
    return "medians over repeats:\n" + medians_and_spreads(report["rows"], TABLE_COLUMNS, "entries", _TIMED)


def plot_mooncake_report(report: dict[str, Any], path: Path) -> Path | None:
    """One panel per per-unit cost against the keys held (log x); ``None`` without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    columns = list(
        dict.fromkeys([column for _name, column in _GROWTH_TARGETS] + ["open_ms", "master_rss_mib"])
    )
    num_columns = (len(columns) + 1) // 2
    figure, axes = plt.subplots(2, num_columns, figsize=(4 * num_columns, 7))
    entries = [row["entries"] for row in report["rows"]]
    for axis, column in zip(axes.flat, columns, strict=False):
        axis.plot(entries, [row[column] for row in report["rows"]], marker="o")
        axis.set_xscale("log")
        axis.set_xlabel("keys")
        axis.set_title(column)
        axis.set_ylim(bottom=0)
    return save_figure(figure, path)
