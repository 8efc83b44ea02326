"""The file backend: private directory, hashed names, LRU eviction under capacity, several processes."""

from __future__ import annotations

import multiprocessing
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from hybridkv.store import Status, open_store
from hybridkv.store.file import FileBackend
from hybridkv.store.file.probe import READ_PHASES, ReadProbe


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
        os.utime(backend.layout.path_of(key), (1000.0 + index, 1000.0 + index))
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


def test_reads_are_timed_only_into_an_installed_read_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Production installs no read probe: a get then reads no clock and records nothing anywhere. A probe
    (the bench's) gets every later get's keys and phase times, until it is taken out again."""
    store = open_store(f"file://{tmp_path}/s")
    backend = store.backend
    assert isinstance(backend, FileBackend)
    assert store.put(["a", "b"], [b"a" * 4096, b"b" * 4096]) == [Status.OK] * 2
    assert backend.read_probe is None and not hasattr(backend, "read_timings")
    caller = threading.get_ident()  # a local file system: the get runs on this thread
    real_clock = time.perf_counter
    clock_reads: list[int] = []

    def counted_clock() -> float:
        if threading.get_ident() == caller:
            clock_reads.append(1)
        return real_clock()

    monkeypatch.setattr(time, "perf_counter", counted_clock)
    assert store.get_into(["a", "b"], [bytearray(4096), bytearray(4096)]) == [Status.OK] * 2
    assert not clock_reads, "a get without a probe read the clock"
    monkeypatch.undo()

    probe = ReadProbe()
    backend.install_read_probe(probe)
    destinations = [bytearray(4096), bytearray(4096), bytearray(4096)]
    statuses = store.get_into(["a", "b", "absent"], destinations)
    assert statuses == [Status.OK, Status.OK, Status.NOT_FOUND]
    totals = probe.totals()
    assert set(totals) == set(READ_PHASES) and totals["keys"] == 3, totals
    assert totals["open_s"] > 0 and totals["read_s"] > 0 and totals["verify_s"] >= 0, totals
    backend.install_read_probe(None)
    assert store.get_into(["a"], [bytearray(4096)]) == [Status.OK]
    assert probe.totals() == totals, "a probe taken out still got reads"
    store.close()


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
