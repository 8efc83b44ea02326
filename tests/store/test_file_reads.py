"""The file store's read path: vectored reads that the kernel cuts short, values in many parts (a hit's KV
pages), and the stat an opened published file comes with."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hybridkv.store import Status, open_store
from hybridkv.store.file import FileBackend
from hybridkv.store.file.frame_io import read_all
from hybridkv.store.frame import default_checksum
from hybridkv.store.framed import FramedStore, value_to_parts

_PART_BYTES = 4096
_NUM_PARTS = 16


def _file_backend(store: FramedStore) -> FileBackend:
    backend = store.backend
    assert isinstance(backend, FileBackend)
    return backend


@pytest.mark.parametrize("pass_expected", [True, False])
def test_read_all_fills_every_part_when_reads_come_back_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pass_expected: bool
) -> None:
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    real_readv = os.readv

    def short_readv(fd: int, buffers: list[memoryview]) -> int:  # at most 777 bytes per call
        budget, cut = 777, []
        for buffer in buffers:
            cut.append(buffer[: min(budget, buffer.nbytes)])
            budget -= cut[-1].nbytes
        return real_readv(fd, cut)

    monkeypatch.setattr(os, "readv", short_readv)
    parts = [memoryview(bytearray(size)) for size in (44, 0, 5000, 0, 4956)]
    fd = os.open(path, os.O_RDONLY)
    try:
        num_read = read_all(fd, parts, len(data) if pass_expected else None)
    finally:
        os.close(fd)
    assert num_read == len(data)
    assert b"".join(bytes(part) for part in parts) == data


def test_read_all_of_a_short_file_returns_the_bytes_there(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    parts = [memoryview(bytearray(60)), memoryview(bytearray(60))]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_all(fd, parts, 120) == 100
    finally:
        os.close(fd)
    assert bytes(parts[0]) == b"x" * 60 and bytes(parts[1][:40]) == b"x" * 40


def test_value_parts_of_sequences_and_single_buffers() -> None:
    pages = [np.zeros((2, 8), dtype=np.float16), bytearray(3), (b"ab")]
    views = value_to_parts(pages)
    assert [view.nbytes for view in views] == [32, 3, 2]
    assert all(view.ndim == 1 and view.format == "B" for view in views)
    assert [view.nbytes for view in value_to_parts(tuple(pages))] == [32, 3, 2]
    assert [view.nbytes for view in value_to_parts(np.zeros(5, dtype=np.int32))] == [20]
    with pytest.raises(TypeError, match="value part of type int does not support the buffer protocol"):
        value_to_parts([bytearray(1), 7])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "damaged",
    [0, _PART_BYTES - 1, _PART_BYTES, 7 * _PART_BYTES + 2047, _NUM_PARTS * _PART_BYTES - 1],
    ids=["first", "last-of-a-part", "first-of-the-next", "mid-part", "last"],
)
def test_a_damaged_byte_anywhere_in_a_value_of_many_parts_reads_corrupt(tmp_path: Path, damaged: int) -> None:
    store = open_store(f"file://{tmp_path}/s")
    rng = np.random.default_rng(1)
    values = [rng.integers(0, 256, _NUM_PARTS * _PART_BYTES, dtype=np.uint8) for _ in range(3)]
    keys = ["a", "b", "c"]
    assert store.put(keys, [np.split(value, _NUM_PARTS) for value in values]) == [Status.OK] * 3
    path = Path(_file_backend(store).layout.path_of("b"))
    data = bytearray(path.read_bytes())
    data[len(data) - len(values[1]) + damaged] ^= 0x04  # offset in the payload
    path.write_bytes(data)
    destinations = [np.zeros_like(value) for value in values]
    statuses = store.get_into(keys, [np.split(destination, _NUM_PARTS) for destination in destinations])
    assert statuses == [Status.OK, Status.CORRUPT, Status.OK]
    assert np.array_equal(destinations[0], values[0]) and np.array_equal(destinations[2], values[2])
    store.close()


@pytest.mark.parametrize("recyclable", [True, False])
def test_an_opened_published_file_comes_with_its_own_stat(tmp_path: Path, recyclable: bool) -> None:
    backend = FileBackend(
        f"file://{tmp_path}/s",
        tmp_path / "s",
        capacity_bytes=1 << 20,
        recycle_min_size=1 if recyclable else 1 << 20,
    )
    store = FramedStore(backend, checksum=default_checksum())
    assert store.put(["k"], [b"v" * 100]) == [Status.OK]
    layout = backend.layout
    path = layout.path_of("k")
    assert layout.is_recyclable(os.stat(path).st_size) is recyclable
    opened = layout.open_published(path)
    assert opened is not None
    fd, info = opened
    try:
        own = os.fstat(fd)
    finally:
        os.close(fd)
    fields = ("st_ino", "st_dev", "st_size", "st_mtime_ns", "st_nlink")
    assert [getattr(info, field) for field in fields] == [getattr(own, field) for field in fields]
    assert layout.open_published(layout.path_of("absent")) is None
    store.close()
