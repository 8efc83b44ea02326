"""Keyed integrity (``integrity_key_file`` / ``integrity_key_env``, ``hybridkv.store.integrity``): only frames
sealed with one of the store's secrets are read; everything else -- a value framed correctly without the key,
with another secret, another key's frame copied under this key, a forged tag -- is a counted, logged
``CORRUPT``. Rotation accepts the previous secret and seals with the current one; bad configuration is a
``StoreError`` naming the parameter; no secret shows in the URL, stats, reprs, errors or logs."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridkv.store import Status, StoreError, StoreLogEvent, open_store
from hybridkv.store.file import FileBackend
from hybridkv.store.frame import (
    FIXED_HEADER,
    KEYED_BLAKE3_ALGO_ID,
    KEYED_VERSION,
    MAGIC,
    ChecksumAlgo,
    check_frame,
    header_size,
)
from hybridkv.store.framed import FramedStore
from hybridkv.store.integrity import MIN_SECRET_BYTES, TAG_SIZE, IntegrityKey, Keyring
from hybridkv.store.url import check_store_url
from hybridkv.testing.store_fuzz import make_store_machine
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from hypothesis import HealthCheck, settings
from structlog.testing import capture_logs

SECRET_A = b"a" * 8 + b"-integrity-secret-A-0123456789"
SECRET_B = b"b" * 8 + b"-integrity-secret-B-0123456789"
KEY = "hkv1/ns/000000000000/g0/tp0/dcp0/0000000000000001"
OTHER_KEY = "hkv1/ns/000000000000/g0/tp0/dcp0/0000000000000002"  # as long as KEY: same frame size
VALUE = bytes(range(256)) * 64  # 16 KiB


def write_key_file(path: Path, *secrets: bytes) -> Path:
    """A private key file holding ``secrets``, one per line, the current one first."""
    path.write_bytes(b"".join(secret + b"\n" for secret in secrets))
    path.chmod(0o600)
    return path


#: A store URL by scheme (a fresh name, or a folder under the test's temp dir), ending where one more
#: parameter may follow (``?`` or ``&``).
Location = Callable[[Path], str]
LOCATIONS: dict[str, Location] = {
    "memory": lambda _tmp: f"memory://integrity-{uuid.uuid4().hex}?",
    "file": lambda tmp: f"file://{tmp}/store?capacity=64MiB&",
    "faulty+memory": lambda _tmp: f"faulty+memory://integrity-{uuid.uuid4().hex}?seed=1&",
    "faulty+file": lambda tmp: f"faulty+file://{tmp}/store?seed=1&",
}


def keyed(base: str, key_file: Path) -> str:
    return f"{base}integrity_key_file={key_file}"


def plain(base: str) -> str:
    return base.rstrip("?&")


def read(store: FramedStore, key: str, size: int = len(VALUE)) -> tuple[Status, bytes]:
    destination = bytearray(size)
    [status] = store.get_into([key], [destination])
    return status, bytes(destination)


def num_corrupt_reads(store: FramedStore) -> int:
    count = store.stats().extra["num_corrupt_reads"]
    assert isinstance(count, int), f"num_corrupt_reads is {count!r}"
    return count


def raw_frame(store: FramedStore, key: str, size: int = len(VALUE)) -> bytes:
    """The stored frame of ``key`` as the backend holds it (no check)."""
    header, payload = bytearray(header_size(key)), bytearray(size)
    [status] = store.backend.get_frames_into([key], [[memoryview(header), memoryview(payload)]])
    assert status is Status.OK, f"raw read of {key}: {status}"
    return bytes(header + payload)


def put_raw_frame(store: FramedStore, key: str, frame: bytes) -> None:
    """Store ``frame`` under ``key`` as is, bypassing the framing (what a forger with store access does)."""
    [status] = store.backend.put_frames([key], [[memoryview(frame)]])
    assert status is Status.OK, f"raw put of {key}: {status}"


@pytest.fixture(params=sorted(LOCATIONS))
def base(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return LOCATIONS[request.param](tmp_path)


def test_a_keyed_store_reads_its_own_values_and_refuses_unkeyed_ones(base: str, tmp_path: Path) -> None:
    key_file = write_key_file(tmp_path / "key", SECRET_A)
    with open_store(keyed(base, key_file)) as store, open_store(plain(base)) as unkeyed:
        assert store.put([KEY], [VALUE]) == [Status.OK]
        assert read(store, KEY) == (Status.OK, VALUE)
        # A forger without the key frames a value correctly (plain checksum) under a key the engines use.
        assert unkeyed.put([OTHER_KEY], [b"planted context".ljust(len(VALUE))]) == [Status.OK]
        with capture_logs() as logs:
            status, _unspecified = read(store, OTHER_KEY)
        assert status is Status.CORRUPT, f"{base}: an unkeyed frame was read as {status}"
        assert num_corrupt_reads(store) == 1
        [event] = [entry for entry in logs if entry["event"] == StoreLogEvent.CORRUPT_VALUE]
        assert event["key"] == OTHER_KEY and "not sealed with an integrity key" in event["problem"], event
        # The store without a key cannot verify keyed frames: CORRUPT too, counted there.
        assert read(unkeyed, KEY)[0] is Status.CORRUPT
        assert num_corrupt_reads(unkeyed) == 1


def test_a_value_sealed_in_parts_reads_back_whole_and_in_other_parts(base: str, tmp_path: Path) -> None:
    """The tag covers the payload's bytes, not how they were split (values and destinations are part lists)."""
    key_file = write_key_file(tmp_path / "key", SECRET_A)
    with open_store(keyed(base, key_file)) as store:
        parts = [VALUE[:1000], VALUE[1000:1001], b"", VALUE[1001:]]
        assert store.put([KEY], [parts]) == [Status.OK]
        assert read(store, KEY) == (Status.OK, VALUE)
        halves = [bytearray(len(VALUE) // 2), bytearray(len(VALUE) - len(VALUE) // 2)]
        assert store.get_into([KEY], [halves]) == [Status.OK]
        assert b"".join(halves) == VALUE


def test_another_secret_or_a_forged_tag_is_corrupt(base: str, tmp_path: Path) -> None:
    key_file_a = write_key_file(tmp_path / "key-a", SECRET_A)
    key_file_b = write_key_file(tmp_path / "key-b", SECRET_B)
    with open_store(keyed(base, key_file_a)) as store, open_store(keyed(base, key_file_b)) as other_tenant:
        assert other_tenant.put([KEY], [VALUE]) == [Status.OK]
        with capture_logs() as logs:
            assert read(store, KEY)[0] is Status.CORRUPT, f"{base}: another secret's frame was accepted"
        assert any("does not hold" in str(entry.get("problem")) for entry in logs), logs
        # A forger who read the key id (every frame shows it) but lacks the secret: a well-formed frame
        # under the right key id, with a made-up tag.
        key_bytes = OTHER_KEY.encode()
        key_id = IntegrityKey(SECRET_A).key_id
        fixed = FIXED_HEADER.pack(
            MAGIC,
            KEYED_VERSION,
            KEYED_BLAKE3_ALGO_ID,
            0,
            len(key_bytes),
            len(VALUE),
            key_id,
            b"\x5a" * TAG_SIZE,
        )
        put_raw_frame(store, OTHER_KEY, fixed + key_bytes + VALUE)
        with capture_logs() as logs:
            assert read(store, OTHER_KEY)[0] is Status.CORRUPT, f"{base}: a forged tag was accepted"
        assert any("tag mismatch" in str(entry.get("problem")) for entry in logs), logs
        assert num_corrupt_reads(store) == 2


def test_a_keyed_frame_copied_under_another_key_is_corrupt(base: str, tmp_path: Path) -> None:
    key_file = write_key_file(tmp_path / "key", SECRET_A)
    with open_store(keyed(base, key_file)) as store:
        assert store.put([KEY], [VALUE]) == [Status.OK]
        put_raw_frame(store, OTHER_KEY, raw_frame(store, KEY))
        assert read(store, KEY) == (Status.OK, VALUE)
        assert read(store, OTHER_KEY)[0] is Status.CORRUPT, f"{base}: a replayed frame was accepted"
        assert num_corrupt_reads(store) == 1


def test_a_file_copied_over_another_keys_file_is_corrupt(tmp_path: Path) -> None:
    key_file = write_key_file(tmp_path / "key", SECRET_A)
    with open_store(f"file://{tmp_path}/store?integrity_key_file={key_file}") as store:
        assert store.put([KEY, OTHER_KEY], [VALUE, bytes(len(VALUE))]) == [Status.OK, Status.OK]
        backend = store.backend
        assert isinstance(backend, FileBackend), backend
        # What anyone who can write the directory can do: replace one entry's file by another's.
        shutil.copyfile(backend.layout.path_of(KEY), backend.layout.path_of(OTHER_KEY))
        assert read(store, OTHER_KEY)[0] is Status.CORRUPT
        assert read(store, KEY) == (Status.OK, VALUE)
        assert sorted(store.iter_keys()) == [KEY], (
            "a keyed file store lists its keys (the copy is unreadable)"
        )


def test_a_damaged_keyed_frame_is_corrupt(tmp_path: Path) -> None:
    key_file = write_key_file(tmp_path / "key", SECRET_A)
    url = f"faulty+memory://integrity-{uuid.uuid4().hex}?corrupt=1&seed=3&integrity_key_file={key_file}"
    with open_store(url) as store:
        assert store.put([KEY], [VALUE]) == [Status.OK]
        assert read(store, KEY)[0] is Status.CORRUPT


def test_rotation_accepts_the_previous_secret_and_seals_with_the_current(base: str, tmp_path: Path) -> None:
    old_only = write_key_file(tmp_path / "old", SECRET_A)
    rotating = write_key_file(tmp_path / "rotating", SECRET_B, SECRET_A)
    new_only = write_key_file(tmp_path / "new", SECRET_B)
    old_id, new_id = IntegrityKey(SECRET_A).key_id, IntegrityKey(SECRET_B).key_id
    with open_store(keyed(base, old_only)) as before:
        assert before.put([KEY], [VALUE]) == [Status.OK]
    with open_store(keyed(base, rotating)) as during, open_store(keyed(base, old_only)) as not_restarted:
        assert during.stats().extra["integrity_key_ids"] == [f"{new_id:016x}", f"{old_id:016x}"]
        assert read(during, KEY) == (Status.OK, VALUE), "the previous secret is not accepted"
        assert during.put([OTHER_KEY], [VALUE]) == [Status.OK]
        sealed_with = FIXED_HEADER.unpack_from(raw_frame(during, OTHER_KEY), 0)[6]
        assert sealed_with == new_id, f"a new put was sealed with key id {sealed_with:016x}, not the current"
        assert read(not_restarted, OTHER_KEY)[0] is Status.CORRUPT  # why step 1 of a rotation adds NEW first
    with open_store(keyed(base, new_only)) as after:
        assert read(after, OTHER_KEY) == (Status.OK, VALUE)
        assert read(after, KEY)[0] is Status.CORRUPT, "a dropped secret's frame is still accepted"


def test_the_secret_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"HYBRIDKV_TEST_INTEGRITY_{uuid.uuid4().hex[:8].upper()}"
    monkeypatch.setenv(name, f"{SECRET_B.decode()}\n{SECRET_A.decode()}\n")
    base = f"memory://integrity-{uuid.uuid4().hex}?"
    with open_store(f"{base}integrity_key_env={name}") as store:
        assert store.put([KEY], [VALUE]) == [Status.OK]
        assert read(store, KEY) == (Status.OK, VALUE)
        assert store.stats().extra["integrity_key_ids"] == [
            IntegrityKey(SECRET_B).key_id_text,
            IntegrityKey(SECRET_A).key_id_text,
        ]


def test_no_secret_shows_in_url_stats_reprs_or_logs(tmp_path: Path) -> None:
    key_file = write_key_file(tmp_path / "key", SECRET_A, SECRET_B)
    base = f"memory://integrity-{uuid.uuid4().hex}?"
    with open_store(keyed(base, key_file)) as store, open_store(plain(base)) as unkeyed:
        unkeyed.put([KEY], [VALUE])
        with capture_logs() as logs:
            assert read(store, KEY)[0] is Status.CORRUPT
        shown = [store.url, repr(store), repr(store.keyring), str(store.stats()), repr(logs)]
        for secret in (SECRET_A, SECRET_B):
            for text in shown:
                assert secret.decode() not in text, f"the secret shows in {text!r}"


def test_unreadable_key_file_names_the_parameter(tmp_path: Path) -> None:
    directory = tmp_path / "a-directory"
    directory.mkdir()
    with pytest.raises(StoreError, match=r"parameter integrity_key_file=.*is not a regular file"):
        open_store(f"memory://integrity-x?integrity_key_file={directory}")


#: (name, what the file holds or None for no file, URL parameters after the file's, what the error says)
BAD_CONFIGS = [
    ("missing file", None, "", r"parameter integrity_key_file=.*it does not exist"),
    ("empty file", b"", "", r"parameter integrity_key_file=.*holds no secret"),
    ("blank file", b"\n \n\t\n", "", r"parameter integrity_key_file=.*holds no secret"),
    (
        "short secret",
        SECRET_A + b"\n" + b"x" * (MIN_SECRET_BYTES - 1),
        "",
        r"line 2 holds a secret of 15 bytes",
    ),
    ("repeated secret", SECRET_A + b"\n" + SECRET_A, "", r"line 2 repeats the secret of line 1"),
    ("file and env", SECRET_A, "&integrity_key_env=HOME", r"parameter integrity_key_env=.*not both"),
    ("checksum none", SECRET_A, "&checksum=none", r"parameter checksum='none'.*integrity key"),
]


@pytest.mark.parametrize(
    ("contents", "more", "message"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_key_file_config_is_a_store_error_naming_the_parameter(
    contents: bytes | None, more: str, message: str, tmp_path: Path
) -> None:
    key_file = tmp_path / "key"
    if contents is not None:
        write_key_file(key_file, contents)
    for scheme_url in (f"memory://integrity-{uuid.uuid4().hex}", f"faulty+file://{tmp_path}/store"):
        url = f"{scheme_url}?integrity_key_file={key_file}{more}"
        with pytest.raises(StoreError, match=message) as refused:
            check_store_url(url)
        with pytest.raises(StoreError, match=message):
            open_store(url)
        assert SECRET_A.decode() not in str(refused.value), "the error quotes the secret"
    assert not (tmp_path / "store").exists(), "a refused URL created its store"


def test_bad_key_env_and_paths_are_store_errors_naming_the_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    unset = f"HYBRIDKV_TEST_UNSET_{uuid.uuid4().hex[:8].upper()}"
    monkeypatch.delenv(unset, raising=False)
    short = f"HYBRIDKV_TEST_SHORT_{uuid.uuid4().hex[:8].upper()}"
    monkeypatch.setenv(short, "too-short")
    for query, message in (
        (f"integrity_key_env={unset}", r"parameter integrity_key_env=\.\.\. .*is not set"),
        ("integrity_key_env=", r"parameter integrity_key_env=.*names no environment variable"),
        (f"integrity_key_env={short}", r"parameter integrity_key_env=.*line 1 holds a secret of 9 bytes"),
        ("integrity_key_file=relative/key", r"parameter integrity_key_file=.*must be an absolute path"),
        ("integrity_key_file=", r"parameter integrity_key_file=.*must be an absolute path"),
        ("integrity_key_file=/dev/zero", r"parameter integrity_key_file=.*is not a regular file"),
    ):
        with pytest.raises(StoreError, match=message):
            check_store_url(f"memory://integrity-x?{query}")


def test_a_secret_in_the_url_is_refused_without_repeating_it() -> None:
    for url in (
        f"memory://integrity-x?integrity_key={SECRET_A.decode()}",
        f"faulty+memory://integrity-x?seed=1&integrity_key={SECRET_A.decode()}",
    ):
        for call in (check_store_url, open_store):
            with pytest.raises(StoreError, match="parameter integrity_key is refused") as refused:
                call(url)
            assert SECRET_A.decode() not in str(refused.value), (
                f"{call.__name__}: the error repeats the secret"
            )


def test_key_file_readable_by_others_is_warned_about(tmp_path: Path) -> None:
    key_file = write_key_file(tmp_path / "key", SECRET_A)
    key_file.chmod(0o644)
    with (
        capture_logs() as logs,
        open_store(f"memory://integrity-{uuid.uuid4().hex}?integrity_key_file={key_file}"),
    ):
        pass
    assert [
        entry["mode"] for entry in logs if entry["event"] == StoreLogEvent.INTEGRITY_KEY_FILE_NOT_PRIVATE
    ] == ["644"], logs


def test_an_unkeyed_reader_rejects_a_keyed_frame_cleanly() -> None:
    """What a reader without a key does with a keyed frame of the right size: a reason, no exception (a
    release before version 2 frames answers "unsupported frame version 2" the same way)."""
    header = Keyring([IntegrityKey(SECRET_A)]).encode_header(KEY, [memoryview(VALUE)])
    assert len(header) == header_size(KEY), "a keyed header is not the size of an unkeyed one"
    for required in ChecksumAlgo:
        problem = check_frame(KEY, header, [memoryview(VALUE)], required=required)
        assert problem is not None and "sealed with an integrity key" in problem, problem


def test_a_keyed_store_conforms(tmp_path: Path) -> None:
    """The store conformance machine on keyed memory and file stores (a few short examples: the framing is
    what changes, and the other store tests cover the backends at length)."""
    key_file = write_key_file(tmp_path / "key", SECRET_A)
    for factory in (
        lambda: open_store(f"memory://integrity-fuzz-{uuid.uuid4().hex}?integrity_key_file={key_file}"),
        lambda: open_store(f"file://{tmp_path}/{uuid.uuid4().hex}?integrity_key_file={key_file}"),
    ):
        test_case = make_store_machine(factory, allows_eviction=False).TestCase
        test_case.settings = settings(  # type: ignore[attr-defined]
            max_examples=15, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)
        )
        test_case().runTest()
    assert os.listdir(tmp_path), "the file store factory made no store"


@pytest.mark.mooncake
def test_a_keyed_mooncake_store_refuses_another_clients_values(
    mooncake_master: MooncakeMaster, tmp_path: Path
) -> None:
    """The case the mode is for: another client of the same Mooncake deployment plants a value."""
    key_file = write_key_file(tmp_path / "key", SECRET_A)
    key, planted = f"mc/integrity/{uuid.uuid4().hex}/0", f"mc/integrity/{uuid.uuid4().hex}/1"
    with (
        open_store(mooncake_master.url(timeout_ms=10000, integrity_key_file=key_file)) as store,
        open_store(mooncake_master.url(timeout_ms=10000)) as intruder,
    ):
        assert store.put([key], [VALUE]) == [Status.OK]
        assert intruder.put([planted], [bytes(len(VALUE))]) == [Status.OK]
        assert read(store, key) == (Status.OK, VALUE)
        assert read(store, planted)[0] is Status.CORRUPT
        assert read(intruder, key)[0] is Status.CORRUPT
        assert num_corrupt_reads(store) == 1
