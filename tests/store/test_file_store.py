"""The file backend: private directory, hashed names, LRU eviction under capacity, several processes."""

from __future__ import annotations

import multiprocessing
import os
import stat
import time
from pathlib import Path

from hybridkv.store import Status, open_store
from hybridkv.store.file import FileBackend


def test_directory_is_private_and_names_are_hashed(tmp_path: Path) -> None:
    directory = tmp_path / "deep" / "store"
    store = open_store(f"file://{directory}")
    key = "model@tp0/../../etc/passwd"
    assert store.put([key], [b"x" * 10]) == [Status.OK]
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    names = [path.name for path in directory.rglob("*") if path.is_file()]
    assert not any("passwd" in name or "model" in name for name in names), (
        f"raw key used as a file name: {names}"
    )
    assert list(store.iter_keys("model@")) == [key], "the real key must be recoverable from the frame"
    assert not list((directory / "tmp").iterdir()), "temp files must not outlive a put"


def test_capacity_evicts_least_recently_used_first(tmp_path: Path) -> None:
    value = b"v" * 1000
    store = open_store(f"file://{tmp_path}/s?capacity=10KiB")
    backend = store.backend
    assert isinstance(backend, FileBackend)
    keys = [f"k{i}" for i in range(8)]
    for index, key in enumerate(keys):
        assert store.put([key], [value]) == [Status.OK]
        os.utime(backend.path_of(key), (1000.0 + index, 1000.0 + index))
    # Reading k0 makes it the most recently used (its mtime is old, so the read touches it).
    assert store.get_into(["k0"], [bytearray(len(value))]) == [Status.OK]
    for index in range(8, 14):
        assert store.put([f"k{index}"], [value]) == [Status.OK]
    stats = store.stats()
    assert stats.num_bytes is not None and stats.num_bytes <= 10 << 10, f"over capacity: {stats}"
    present = {key for key, status in zip(keys, store.exists(keys)) if status is Status.OK}
    assert "k0" in present, f"the recently read key was evicted; left: {sorted(present)}"
    assert "k1" not in present, f"the least recently used key survived; left: {sorted(present)}"
    assert store.put(["huge"], [b"x" * (11 << 10)]) == [Status.NO_SPACE]


def test_usage_estimate_tracks_disk(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/s?capacity=1MiB")
    store.put([f"k{i}" for i in range(10)], [b"x" * 500] * 10)
    store.put(["k0"], [b"x" * 500])  # insert-if-absent: no double counting
    store.remove(["k1", "k2"])
    stats = store.stats()
    assert stats.extra["usage_estimate_bytes"] == stats.num_bytes, stats


def _writer_reader(url: str, worker: int, num_rounds: int, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Put and read back the same shared keys as the other process; report any wrong outcome."""
    store = open_store(url)
    problems: list[str] = []
    for round_index in range(num_rounds):
        keys = [f"shared/{(round_index + i) % 16}" for i in range(4)]
        values = [key.encode() * 2000 for key in keys]  # content-derived: both writers offer equal bytes
        for key, status in zip(keys, store.put(keys, values)):
            if status is not Status.OK:
                problems.append(f"worker {worker}: put {key} -> {status}")
        destinations = [bytearray(len(value)) for value in values]
        for key, value, destination, status in zip(
            keys, values, destinations, store.get_into(keys, destinations)
        ):
            if status is Status.OK and destination != value:
                problems.append(f"worker {worker}: {key} read wrong bytes")
            elif status not in (Status.OK, Status.NOT_FOUND):  # NOT_FOUND: evicted by the other process
                problems.append(f"worker {worker}: get {key} -> {status}")
        if round_index % 10 == 0:
            store.remove([keys[0]])
    store.close()
    queue.put(problems)


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    # Capacity below the working set, so both processes also evict under each other's reads.
    url = f"file://{tmp_path}/s?capacity=100KiB"
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [
        context.Process(target=_writer_reader, args=(url, worker, 150, queue)) for worker in range(2)
    ]
    start = time.monotonic()
    for process in processes:
        process.start()
    results = [queue.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0, f"worker exited with {process.exitcode}"
    assert results == [[], []], f"wrong outcomes: {results}"
    store = open_store(url)
    stats = store.stats()
    assert stats.num_bytes is not None and stats.num_bytes <= (100 << 10) + 2 * 4 * 20_000, stats
    assert time.monotonic() - start < 120
