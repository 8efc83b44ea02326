"""open_store URL handling and the frame check (hard rule 7) on real stored bytes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hybridkv.store import Status, StoreError, open_store, parse_size
from hybridkv.store.file import FileBackend
from hybridkv.store.frame import key_digest


@pytest.mark.parametrize(
    ("url", "culprit"),
    [
        ("nosuch://x", "unknown scheme 'nosuch'"),
        ("no-scheme-at-all", "has no scheme"),
        ("memory://", "needs a name"),
        ("memory://x?capacty=1MiB", "unknown parameter(s) capacty"),
        ("memory://x?capacity=12QB", "capacity='12QB'"),
        ("memory://x?capacity=64m", "capacity='64m' is invalid: unit 'm' is ambiguous: write 64MiB"),
        ("file:///tmp/x?capacity=4g", "capacity='4g' is invalid: unit 'g' is ambiguous"),
        ("mooncake://127.0.0.1:1?segment=1G", "segment='1G' is invalid: unit 'G' is ambiguous: write 1GiB"),
        ("mooncake://127.0.0.1:1?local_buffer=64M", "local_buffer='64M' is invalid: unit 'M' is ambiguous"),
        ("memory://x?capacity=0.5B", "not a whole number of bytes"),
        ("memory://x?checksum=md5", "checksum='md5'"),
        ("memory://x?capacity=1&capacity=2", "repeats parameter 'capacity'"),
        ("file://", "missing directory"),
        ("file://relative/dir", "host 'relative'"),
        ("file:///tmp/x?capacity=0", "capacity must be > 0"),
        ("file:///tmp/x?timeout_ms=0", "timeout_ms='0' is invalid: the deadline of each call must be > 0"),
        ("file:///tmp/x?timeout_ms=soon", "timeout_ms='soon'"),
        ("faulty+memory://x?get_fail=1.5", "get_fail='1.5'"),
        ("faulty+memory://x?corrupt=-0.1", "probability outside [0, 1]"),
        ("faulty+memory://x?delay_ms=soon", "delay_ms='soon'"),
        ("faulty+memory://x?bogus=1", "unknown parameter(s) bogus"),
        ("mooncake://hostonly", "HOST:PORT"),
        ("mooncake://127.0.0.1:1?segment=lots", "segment='lots'"),
        ("mooncake://127.0.0.1:1?protocol=carrier-pigeon", "protocol='carrier-pigeon'"),
    ],
)
def test_bad_urls_raise_one_error_naming_the_culprit(url: str, culprit: str) -> None:
    with pytest.raises(StoreError) as error:
        open_store(url)
    assert culprit in str(error.value), f"error for {url!r} does not name {culprit!r}: {error.value}"


def test_mooncake_rdma_is_refused_at_open_naming_the_parameter_and_the_way_out() -> None:
    """The Mooncake backend registers no buffer with the transfer engine, which RDMA transfers need: an
    ``rdma`` URL must fail when the store opens (engine start), saying why and what to use instead, not open
    and fail its transfers later. Refused before any connection: no master listens on port 1."""
    with pytest.raises(StoreError) as error:
        open_store("mooncake://127.0.0.1:1?protocol=rdma")
    message = str(error.value)
    assert "protocol='rdma'" in message and "not supported" in message, message
    assert "use protocol=tcp" in message, message


@pytest.mark.parametrize("timeout_ms", ["0", "-5"])
def test_mooncake_without_a_deadline_is_refused_at_open(timeout_ms: str) -> None:
    """Without a deadline a call to a hung master would hold the worker's load thread, and the request
    waiting for it, forever. Refused before any connection: no master listens on port 1."""
    with pytest.raises(StoreError) as error:
        open_store(f"mooncake://127.0.0.1:1?timeout_ms={timeout_ms}")
    message = str(error.value)
    assert f"timeout_ms='{timeout_ms}'" in message, message
    assert "every Mooncake call needs a deadline: a hung master would hold a request forever" in message
    assert "use timeout_ms > 0" in message, message


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("4096", 4096),
        ("64KiB", 64 << 10),
        ("64MiB", 64 << 20),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 << 29),
        ("8 kb", 8000),
        ("64MB", 64 * 10**6),
        ("4Gi", 4 << 30),
    ],
)
def test_human_sizes(text: str, num_bytes: int) -> None:
    assert parse_size(text) == num_bytes


def test_same_memory_name_is_the_same_store(memory_url: str) -> None:
    first, second = open_store(memory_url), open_store(memory_url)
    assert first.put(["k"], [b"shared"]) == [Status.OK]
    destination = bytearray(6)
    assert second.get_into(["k"], [destination]) == [Status.OK] and destination == b"shared"
    first.close()
    assert second.exists(["k"]) == [Status.OK], "closing one handle must not drop the named table"


def test_faulty_params_are_removed_before_the_inner_url_is_opened(tmp_path: Path) -> None:
    store = open_store(f"faulty+file://{tmp_path}/s?capacity=1MiB&put_fail=1&seed=3")
    assert store.put(["k"], [b"v"]) == [Status.TRANSFER_FAILED]
    stats = store.stats()
    assert stats.capacity_bytes == 1 << 20 and stats.extra["injected_put_fail"] == 1
    assert stats.extra["inner_url"] == f"file://{tmp_path}/s?capacity=1MiB"


def test_faulty_is_deterministic_for_a_seed(memory_url: str) -> None:
    def run(seed: int) -> list[Status]:
        store = open_store(f"faulty+{memory_url}-{seed}-{os.urandom(4).hex()}?put_fail=0.5&seed={seed}")
        return store.put([f"k{i}" for i in range(64)], [b"v"] * 64)

    assert run(5) == run(5)
    assert run(5) != run(6), "different seeds should inject different failures"
    assert Status.OK in run(5) and Status.TRANSFER_FAILED in run(5)


def _file_of(store_dir: Path, key: str) -> Path:
    digest = key_digest(key).hex()
    return store_dir / "objects" / digest[:2] / f"{digest}.kv"


@pytest.fixture
def file_store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.mark.parametrize("checksum", ["xxh3", "crc32", "none"])
@pytest.mark.parametrize("damage", ["truncate", "extend", "flip_header", "other_key", "flip_payload"])
def test_damaged_frames_read_as_corrupt(file_store_dir: Path, checksum: str, damage: str) -> None:
    store = open_store(f"file://{file_store_dir}?checksum={checksum}")
    payload = bytes(range(256)) * 16
    assert store.put(["victim", "other"], [payload, payload]) == [Status.OK, Status.OK]
    path = _file_of(file_store_dir, "victim")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-1]
    elif damage == "extend":
        data += b"\0"
    elif damage == "flip_header":
        data[12] ^= 0x01  # payload length field
    elif damage == "flip_payload":
        data[-100] ^= 0x10
    else:  # a whole valid frame of another key, of the same size, under this key's name
        data = bytearray(_file_of(file_store_dir, "other").read_bytes())
    path.write_bytes(bytes(data))
    destination = bytearray(len(payload))
    [status] = store.get_into(["victim"], [destination])
    if damage == "flip_payload" and checksum == "none":
        # Documented: without a checksum only the header (key digest, length) is verified.
        assert status is Status.OK and destination != payload
    elif damage == "other_key" and len("victim") != len("other"):
        assert status is Status.CORRUPT  # header size differs -> size mismatch
    else:
        assert status is Status.CORRUPT, f"{damage} with checksum={checksum} read as {status}"
    assert store.get_into(["other"], [bytearray(len(payload))]) == [Status.OK], "the neighbour must be intact"


def test_frame_written_under_another_key_of_equal_length_is_corrupt(file_store_dir: Path) -> None:
    store = open_store(f"file://{file_store_dir}")
    assert store.put(["key-a", "key-b"], [b"A" * 100, b"B" * 100]) == [Status.OK, Status.OK]
    shutil.copyfile(_file_of(file_store_dir, "key-a"), _file_of(file_store_dir, "key-b"))
    destination = bytearray(100)
    assert store.get_into(["key-b"], [destination]) == [Status.CORRUPT]


def test_reader_requiring_a_checksum_rejects_frames_without_one(file_store_dir: Path) -> None:
    writer = open_store(f"file://{file_store_dir}?checksum=none")
    assert writer.put(["k"], [b"payload"]) == [Status.OK]
    reader = open_store(f"file://{file_store_dir}?checksum=crc32")
    assert reader.get_into(["k"], [bytearray(7)]) == [Status.CORRUPT]
    # Frames with a different *real* checksum are verified with that one: mixed defaults interoperate.
    crc_writer = open_store(f"file://{file_store_dir}?checksum=crc32")
    assert crc_writer.put(["k2"], [b"payload"]) == [Status.OK]
    destination = bytearray(7)
    assert open_store(f"file://{file_store_dir}?checksum=xxh3").get_into(["k2"], [destination]) == [Status.OK]
    assert destination == b"payload"


def test_wrong_destination_size_is_corrupt_not_ok(memory_url: str) -> None:
    store = open_store(memory_url)
    store.put(["k"], [b"12345"])
    assert store.get_into(["k"], [bytearray(4)]) == [Status.CORRUPT]
    assert store.get_into(["k"], [bytearray(6)]) == [Status.CORRUPT]


def test_programming_errors_raise(memory_url: str) -> None:
    store = open_store(memory_url)
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.put(["a", "b"], [b"x"])
    store.put(["a"], [b"x"])
    with pytest.raises(ValueError, match="read-only"):
        store.get_into(["a"], [b"\0"])
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.exists(["a"])


def test_file_backend_is_what_file_urls_open(file_store_dir: Path) -> None:
    store = open_store(f"file://{file_store_dir}")
    assert isinstance(store.backend, FileBackend)
