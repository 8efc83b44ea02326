"""The file store recycles removed and evicted files' pages: no old reader ever sees a recycled inode's new
bytes, damaged recycled values still read back ``CORRUPT``, and spares stay inside capacity."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hybridkv.store import Status
from hybridkv.store.file import FileBackend
from hybridkv.store.file import policy as file_policy
from hybridkv.store.frame import default_checksum
from hybridkv.store.framed import FramedStore
from hybridkv.testing.store_fuzz import make_store_machine

_SIZE = 300 << 10  # above the default recycling threshold


def _value(tag: int, size: int = _SIZE) -> bytes:
    return bytes([tag]) * size


def _open(directory: Path, capacity: int = 64 << 20, recycle_min_size: int | None = None) -> FramedStore:
    kwargs: dict[str, Any] = {} if recycle_min_size is None else {"recycle_min_size": recycle_min_size}
    backend = FileBackend(f"file://{directory}", directory, capacity_bytes=capacity, **kwargs)
    return FramedStore(backend, checksum=default_checksum())


def _backend(store: FramedStore) -> FileBackend:
    backend = store.backend
    assert isinstance(backend, FileBackend)
    return backend


def test_a_removed_file_is_recycled_for_the_next_put_of_its_size(tmp_path: Path) -> None:
    store = _open(tmp_path)
    assert store.put(["a"], [_value(1)]) == [Status.OK]
    old_inode = os.stat(_backend(store).layout.path_of("a")).st_ino
    assert store.remove(["a"]) == [Status.OK]
    assert store.put(["b"], [_value(2, _SIZE - 7)]) == [Status.OK]  # same page-rounded size class
    assert os.stat(_backend(store).layout.path_of("b")).st_ino == old_inode, "the spare was not recycled"
    destination = bytearray(_SIZE - 7)
    assert store.get_into(["b"], [destination]) == [Status.OK] and destination == _value(2, _SIZE - 7)
    assert store.get_into(["a"], [bytearray(_SIZE)]) == [Status.NOT_FOUND]
    assert not list((tmp_path / "tmp").iterdir()), "temp files must not outlive a put"


def test_a_reader_that_opened_the_old_name_never_sees_the_recycled_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = _open(tmp_path)
    writer = _open(tmp_path)  # another handle: its flocks conflict with the reader's as across processes
    assert writer.put(["a"], [_value(1)]) == [Status.OK]
    path_a = _backend(reader).layout.path_of("a")
    old_inode = os.stat(path_a).st_ino
    real_open = os.open
    recycled: list[bool] = []

    def open_then_recycle(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        if path == path_a and flags == os.O_RDONLY and not recycled:
            # Between the reader's open and its lock, "a" is removed and its inode rewritten as "b".
            assert writer.remove(["a"]) == [Status.OK]
            assert writer.put(["b"], [_value(2)]) == [Status.OK]
            recycled.append(os.stat(_backend(writer).layout.path_of("b")).st_ino == old_inode)
            assert writer.put(["a"], [_value(1)]) == [Status.OK]  # "a" again, in a new file
        return fd

    monkeypatch.setattr(os, "open", open_then_recycle)
    destination = bytearray(_SIZE)
    [status] = reader.get_into(["a"], [destination])
    monkeypatch.undo()
    assert recycled == [True], "the scenario did not recycle a's inode"
    # Not b's bytes (the frame check would call them CORRUPT): the inode the reader opened is gone.
    assert status is Status.NOT_FOUND, f"a reader of the recycled inode got {status}"
    assert reader.get_into(["b"], [destination]) == [Status.OK] and destination == _value(2)


def test_a_file_held_by_a_reader_is_not_recycled(tmp_path: Path) -> None:
    reader = _open(tmp_path)
    writer = _open(tmp_path)
    assert writer.put(["a"], [_value(1)]) == [Status.OK]
    reader_layout = _backend(reader).layout
    opened = reader_layout.open_published(reader_layout.path_of("a"))  # a read in progress
    assert opened is not None
    fd, info = opened
    try:
        assert writer.remove(["a"]) == [Status.OK]
        assert writer.put(["b"], [_value(2)]) == [Status.OK]
        assert os.stat(_backend(writer).layout.path_of("b")).st_ino != info.st_ino, (
            "a locked inode was overwritten"
        )
        assert os.pread(fd, _SIZE, info.st_size - _SIZE) == _value(1), "the reader saw other bytes"
    finally:
        os.close(fd)
    assert not list((tmp_path / "tmp").iterdir()), "the unusable spare must not be left in tmp/"
    destination = bytearray(_SIZE)
    assert writer.get_into(["b"], [destination]) == [Status.OK] and destination == _value(2)


def test_another_processs_sweep_never_deletes_a_claimed_spare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spare keeps its mtime from its previous life, and an old file in tmp/ is what eviction scans delete
    as a crashed writer's. A spare older than that, claimed by a put, must survive another process's scan
    running while the put holds it, and the put must store the right bytes in the recycled inode."""
    writer = _open(tmp_path)
    sweeper = _backend(_open(tmp_path))  # another handle on the directory, as another process would have
    assert writer.put(["a"], [_value(1)]) == [Status.OK]
    old_inode = os.stat(_backend(writer).layout.path_of("a")).st_ino
    assert writer.remove(["a"]) == [Status.OK]
    [spare] = [path for path in (tmp_path / "spare").rglob("*") if path.is_file()]
    long_ago = time.time() - 2 * file_policy.STALE_TMP_S
    os.utime(spare, (long_ago, long_ago))  # it waited in spare/ longer than a crashed writer's temp file
    crashed = tmp_path / "tmp" / "crashed-writer.tmp"
    crashed.write_bytes(b"left behind")
    os.utime(crashed, (long_ago, long_ago))
    backend = _backend(writer)
    real_open_spare = backend.layout.spares.open
    swept_while_claimed: list[bool] = []

    def sweep_then_open(temp: str, size: int) -> int | None:
        # The spare is claimed (in tmp/ under the writer's name) and not yet written: the other process's
        # eviction pass, which also sweeps tmp/, runs now.
        assert os.path.exists(temp), "the scenario did not claim the spare"
        assert sweeper.layout.make_room(0), "the other process's eviction pass did not run"
        swept_while_claimed.append(True)
        return real_open_spare(temp, size)

    monkeypatch.setattr(backend.layout.spares, "open", sweep_then_open)
    assert writer.put(["b"], [_value(2)]) == [Status.OK]
    monkeypatch.undo()
    assert swept_while_claimed == [True], "the sweep did not run while the spare was claimed"
    assert not crashed.exists(), "the sweep must still delete a crashed writer's temp file"
    assert os.stat(backend.layout.path_of("b")).st_ino == old_inode, (
        "the claimed spare was not the file published"
    )
    destination = bytearray(_SIZE)
    assert writer.get_into(["b"], [destination]) == [Status.OK] and destination == _value(2)
    assert not list((tmp_path / "tmp").iterdir()), "temp files must not outlive a put"


def test_a_damaged_recycled_value_reads_back_corrupt_into_layer_parts(tmp_path: Path) -> None:
    store = _open(tmp_path)
    assert store.put(["a"], [_value(1)]) == [Status.OK]
    assert store.remove(["a"]) == [Status.OK]
    layers = [_value(2, _SIZE // 4) for _ in range(4)]
    assert store.put(["b"], [layers]) == [Status.OK]
    assert _backend(store).num_recycled == 1
    path = _backend(store).layout.path_of("b")
    with open(path, "r+b") as file:  # one flipped bit in the last layer, on disk
        file.seek(-10, os.SEEK_END)
        byte = file.read(1)[0]
        file.seek(-10, os.SEEK_END)
        file.write(bytes([byte ^ 0x04]))
    parts = [bytearray(_SIZE // 4) for _ in range(4)]
    assert store.get_into(["b"], [parts]) == [Status.CORRUPT]
    assert store.stats().extra["num_corrupt_reads"] == 1


def _usage(store: FramedStore) -> tuple[int, int, int]:
    stats = store.stats()
    assert stats.num_bytes is not None
    return stats.num_bytes, int(stats.extra["spare_bytes"]), int(stats.extra["usage_estimate_bytes"])  # type: ignore[call-overload]


def test_capacity_accounting_counts_spares(tmp_path: Path) -> None:
    capacity = 4 << 20  # spare budget 10 %: one 300 KiB spare fits, two do not
    store = _open(tmp_path, capacity=capacity)
    backend = _backend(store)
    assert store.put(["a", "b"], [_value(1), _value(2)]) == [Status.OK] * 2
    assert store.remove(["a", "b"]) == [Status.OK] * 2
    num_bytes, spare_bytes, estimate = _usage(store)
    assert num_bytes == 0 and 0 < spare_bytes <= backend.layout.spare_budget_bytes, (num_bytes, spare_bytes)
    assert (
        estimate == num_bytes + spare_bytes
        and _backend(store).layout.update_usage(lambda u, s: (u, s))[1] == spare_bytes
    )
    # Fill far past capacity: eviction keeps objects + spares under capacity and the estimate exact.
    for index in range(40):
        assert store.put([f"k{index}"], [_value(index % 200, _SIZE - index)]) == [Status.OK]
        num_bytes, spare_bytes, estimate = _usage(store)
        assert num_bytes + spare_bytes <= capacity, (
            f"over capacity after k{index}: {num_bytes} + {spare_bytes}"
        )
        assert spare_bytes <= backend.layout.spare_budget_bytes
        assert estimate == num_bytes + spare_bytes, f"estimate {estimate} != {num_bytes} + {spare_bytes}"
    assert backend.layout.num_evicted > 0 and backend.num_recycled > 1
    assert store.remove_prefix("k") > 0
    num_bytes, spare_bytes, estimate = _usage(store)
    assert num_bytes == 0 and estimate == spare_bytes <= backend.layout.spare_budget_bytes


def _recycling_worker(directory: str, worker: int, num_rounds: int, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    store = _open(Path(directory), capacity=1 << 20, recycle_min_size=4096)
    problems: list[str] = []
    for round_index in range(num_rounds):
        keys = [f"shared/{(round_index + i) % 12}" for i in range(3)]
        values = [key.encode().ljust(16, b".") * 1200 for key in keys]  # content-derived, ~19 KiB
        for key, status in zip(keys, store.put(keys, values)):
            if status is not Status.OK:
                problems.append(f"worker {worker}: put {key} -> {status}")
        destinations = [bytearray(len(value)) for value in values]
        for key, value, destination, status in zip(
            keys, values, destinations, store.get_into(keys, destinations)
        ):
            if status is Status.OK and destination != value:
                problems.append(f"worker {worker}: {key} read wrong bytes")
            elif status not in (Status.OK, Status.NOT_FOUND):
                problems.append(f"worker {worker}: get {key} -> {status}")
        store.remove([keys[round_index % 3]])
    queue.put((problems, _backend(store).num_recycled))
    store.close()


def test_two_processes_recycle_without_wrong_or_corrupt_reads(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [
        context.Process(target=_recycling_worker, args=(str(tmp_path / "s"), worker, 200, queue))
        for worker in range(2)
    ]
    for process in processes:
        process.start()
    results = [queue.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert [problems for problems, _ in results] == [[], []], results
    assert sum(num_recycled for _, num_recycled in results) > 0, "the workers never recycled a file"


_SCRATCH = tempfile.TemporaryDirectory(prefix="hybridkv-recycle-fuzz-")


def _recycling_store(capacity: int) -> FramedStore:
    # Every file is recyclable here, so the conformance machine runs through spares on most puts.
    return _open(Path(tempfile.mkdtemp(dir=_SCRATCH.name)) / "s", capacity=capacity, recycle_min_size=1)


TestRecyclingFileStore = make_store_machine(
    lambda: _recycling_store(64 << 20), allows_eviction=False
).TestCase
TestRecyclingFileStoreUnderCapacity = make_store_machine(
    lambda: _recycling_store(48 << 10), allows_eviction=True, check_pins=True
).TestCase
