"""Framing next to each value's copy (``JustInTimeBackend``) and the memory store's spare buffers."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hybridkv.store import Status, open_store
from hybridkv.store.file import FileBackend
from hybridkv.store.frame import ChecksumAlgo, encode_header, header_size
from hybridkv.store.framed import FramedStore, FrameParts, VerifyHook
from hybridkv.store.memory import SPARE_MIN_FRAME, MemoryBackend, drop_memory_store


def test_file_and_memory_backends_frame_just_in_time(tmp_path: Path) -> None:
    for url in (f"memory://jit-{uuid.uuid4().hex}", f"file://{tmp_path}/s"):
        store = open_store(url)
        backend = store.backend
        assert callable(getattr(backend, "put_frames_sealed", None)), url
        assert callable(getattr(backend, "get_frames_verified", None)), url
        values = [b"a" * 100, [b"bc", memoryview(b"de")], b""]
        keys = ["k0", "k1", "k2"]
        assert store.put(keys, values) == [Status.OK] * 3
        destinations = [bytearray(100), [bytearray(1), bytearray(3)], bytearray(0)]
        assert store.get_into(keys, destinations) == [Status.OK] * 3
        assert destinations[0] == values[0] and b"".join(destinations[1]) == b"bcde"  # type: ignore[arg-type]


class _SkipsVerify:
    """A just-in-time backend that 'forgets' to verify and flips a payload byte on every read."""

    def __init__(self, inner: MemoryBackend) -> None:
        self.inner = inner
        self.url = inner.url
        self.num_seals = 0

    def put_frames_sealed(
        self, keys: Sequence[str], frames: Sequence[FrameParts], seal: object
    ) -> list[Status]:
        def counting_seal(index: int) -> None:
            self.num_seals += 1
            seal(index)  # type: ignore[operator]

        statuses: list[Status] = self.inner.put_frames_sealed(keys, frames, counting_seal)
        return statuses

    def get_frames_verified(
        self, keys: Sequence[str], frames: Sequence[FrameParts], verify: VerifyHook
    ) -> list[Status]:
        results: list[Status] = self.inner.get_frames_into(keys, frames)
        for frame in frames:
            frame[-1][0] ^= 1
        return results

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_framed_store_checks_frames_the_backend_did_not_verify() -> None:
    name = f"jit-{uuid.uuid4().hex}"
    backend = _SkipsVerify(MemoryBackend(f"memory://{name}", name, capacity_bytes=None))
    store = FramedStore(backend, checksum=ChecksumAlgo.CRC32)
    assert store.put(["k"], [b"payload"]) == [Status.OK]
    assert store.get_into(["k"], [bytearray(7)]) == [Status.CORRUPT]
    # Insert-if-absent: a put of a present key writes nothing, so it computes no checksum either.
    assert backend.num_seals == 1
    assert store.put(["k"], [b"payload"]) == [Status.OK]
    assert backend.num_seals == 1
    drop_memory_store(name)


@pytest.mark.parametrize("recycled", [False, True], ids=["new-file", "recycled-file"])
def test_file_store_seals_after_the_payload_is_written_and_before_publishing(
    tmp_path: Path, recycled: bool
) -> None:
    """The file store writes a frame's payload first and seals it right after (hashing bytes still in
    cache); the header goes in last and the frame is linked only once sealed."""
    backend = FileBackend(f"file://{tmp_path}/s", tmp_path / "s", capacity_bytes=64 << 20, recycle_min_size=1)
    store = FramedStore(backend, checksum=ChecksumAlgo.CRC32)
    value = bytes(range(256)) * 40
    if recycled:  # leave a spare of the same size class behind, with other bytes in it
        assert store.put(["old"], [b"\xee" * len(value)]) == [Status.OK]
        assert store.remove(["old"]) == [Status.OK]
    keys = ["k"]
    frames = [[memoryview(bytearray(header_size("k"))), memoryview(value)]]
    seen_at_seal: list[bytes] = []

    def seal(index: int) -> None:
        [temp] = list((tmp_path / "s" / "tmp").iterdir())
        seen_at_seal.append(temp.read_bytes())
        assert not os.path.exists(backend.layout.path_of("k")), "a frame was published before it was sealed"
        frame = frames[index]
        frame[0][:] = encode_header(keys[index], ChecksumAlgo.CRC32, frame[1:])

    assert backend.put_frames_sealed(keys, frames, seal) == [Status.OK]
    assert backend.num_recycled == int(recycled)
    [file_at_seal] = seen_at_seal
    header_length = header_size("k")
    assert file_at_seal[header_length:] == value, "the payload must be in the file when seal runs"
    assert file_at_seal[:header_length] != bytes(frames[0][0]), "the header must be written after seal"
    destination = bytearray(len(value))
    assert store.get_into(keys, [destination]) == [Status.OK] and destination == value
    assert not list((tmp_path / "s" / "tmp").iterdir()), "temp files must not outlive a put"


def test_file_store_verifies_each_frame_it_reads(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/s")
    keys = [f"k{i}" for i in range(3)]
    values = [bytes([i]) * 5000 for i in range(3)]
    assert store.put(keys, values) == [Status.OK] * 3
    backend = store.backend
    assert isinstance(backend, FileBackend)
    path = Path(backend.layout.path_of("k1"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(data)
    destinations = [bytearray(5000) for _ in keys]
    assert store.get_into(keys, destinations) == [Status.OK, Status.CORRUPT, Status.OK]
    assert destinations[0] == values[0] and destinations[2] == values[2]
    assert store.stats().extra["num_corrupt_reads"] == 1


@pytest.fixture
def memory_name() -> Iterator[str]:
    name = f"spare-{uuid.uuid4().hex}"
    yield name
    drop_memory_store(name)


def test_memory_store_reuses_buffers_of_removed_frames(memory_name: str) -> None:
    store = open_store(f"memory://{memory_name}")
    size = SPARE_MIN_FRAME + 123
    values = [bytes([i]) * size for i in range(3)]
    keys = [f"key-{i}" for i in range(3)]
    assert store.put(keys, values) == [Status.OK] * 3
    assert store.remove(keys) == [Status.OK] * 3
    spare_bytes = store.stats().extra["spare_bytes"]
    assert isinstance(spare_bytes, int) and spare_bytes >= 3 * size
    # Keys of another length (so another frame size) still reuse the page-rounded buffers.
    new_keys = [f"other-key-{i}" for i in range(3)]
    assert store.put(new_keys, values[::-1]) == [Status.OK] * 3
    assert store.stats().extra["spare_bytes"] == 0
    destinations = [bytearray(size) for _ in new_keys]
    assert store.get_into(new_keys, destinations) == [Status.OK] * 3
    assert destinations == values[::-1]
    # Small frames are left to malloc.
    assert store.put(["small"], [b"x" * 1000]) == [Status.OK]
    assert store.remove(["small"]) == [Status.OK]
    assert store.stats().extra["spare_bytes"] == 0


def test_memory_store_does_not_recycle_a_frame_being_read(memory_name: str) -> None:
    store = open_store(f"memory://{memory_name}")
    backend = store.backend
    assert isinstance(backend, MemoryBackend)
    value = b"v" * (SPARE_MIN_FRAME + 1)
    assert store.put(["k"], [value]) == [Status.OK]
    table = backend.table
    data = table.key_to_frame["k"]
    table.pins[id(data)] = 1  # as a reader does while it copies outside the lock
    assert store.remove(["k"]) == [Status.OK]
    assert table.spare_bytes == 0, "a pinned frame's buffer must not be handed to a writer"
    del table.pins[id(data)]


def test_memory_store_spares_stay_within_capacity(memory_name: str) -> None:
    capacity = 4 * SPARE_MIN_FRAME
    store = open_store(f"memory://{memory_name}?capacity={capacity}")
    size = SPARE_MIN_FRAME
    keys = [f"k{i:02d}" for i in range(12)]
    backend = store.backend
    assert isinstance(backend, MemoryBackend)
    table = backend.table
    for key in keys:  # every put past the third evicts; evicted buffers become spares, then get reused
        assert store.put([key], [key.encode() * (size // 3)]) == [Status.OK]
        assert table.num_bytes + table.spare_bytes <= capacity, (table.num_bytes, table.spare_bytes)
    assert store.remove(keys[-3:]) == [Status.OK] * 3
    assert table.num_bytes + table.spare_bytes <= capacity
    stats = store.stats()
    assert stats.num_bytes is not None and stats.num_bytes <= capacity


def test_memory_store_readers_never_see_a_recycled_buffer(memory_name: str) -> None:
    # checksum=none: a torn read would come back OK, so only the pins keep this test green.
    store = open_store(f"memory://{memory_name}?checksum=none")
    size = SPARE_MIN_FRAME
    mine, other = b"A" * size, b"B" * size
    assert store.put(["k"], [mine]) == [Status.OK]
    stop = threading.Event()
    problems: list[str] = []

    def reader() -> None:
        destination = bytearray(size)
        while not stop.is_set():
            [status] = store.get_into(["k"], [destination])
            if status is Status.OK and destination != mine:
                problems.append("read other bytes under k")
                return

    thread = threading.Thread(target=reader)
    thread.start()
    deadline = time.monotonic() + 0.5
    round_index = 0
    while time.monotonic() < deadline and not problems:
        store.remove(["k"])
        store.put([f"x{round_index % 10}"], [other])  # same frame size as k: may take k's old buffer
        store.remove([f"x{round_index % 10}"])
        store.put(["k"], [mine])
        round_index += 1
    stop.set()
    thread.join()
    assert not problems, problems
