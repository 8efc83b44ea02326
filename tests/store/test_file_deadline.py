"""``file://`` on a file system that may hang: which file system a directory is on, and the deadline.

A hung file system is simulated by making the backend's raw read or write (``_read_all`` / ``_write_all``)
block on an event, under a short deadline given by the URL (``timeout_ms=200``); the real network file
system case differs only in how the deadline is chosen, which the mount detection tests cover.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hybridkv.store import Status, StoreError, open_store
from hybridkv.store.base import collect_late_calls
from hybridkv.store.file import DEFAULT_HANG_TIMEOUT_MS, FileBackend
from hybridkv.store.file import backend as file_module
from hybridkv.store.file import writer as file_writer
from hybridkv.store.file.layout import FileLayout
from hybridkv.store.file.mounts import (
    UNKNOWN_FSTYPE,
    Mount,
    directory_fstype,
    may_hang,
    mount_of,
    parse_mountinfo,
)
from hybridkv.store.file.spares import SpareShelf
from hybridkv.store.file.tenants import FileTenants
from hybridkv.store.framed import FramedStore
from hybridkv.store.quotas import tenant_counters_of, write_quotas

#: A bound on waits that must end (a hang guard, never a timing claim).
GUARD_S = 30.0

MOUNTINFO_LINES = (
    "22 27 0:21 / /proc rw,relatime - proc proc rw",
    "27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard",
    "25 27 0:23 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw,size=24684092k",
    "60 27 0:50 / /home rw,relatime shared:30 - nfs4 files:/export/home rw,vers=4.2,hard",
    "61 60 0:51 / /home/alice/remote rw,nosuid,nodev shared:31 master:7 - fuse.sshfs alice@h:/ rw",
    "62 60 0:52 / /home/alice/.cache rw,relatime shared:32 - tmpfs tmpfs rw",
    "63 27 0:53 / /var/lib/docker/overlay2/abc/merged rw - overlay overlay rw,lowerdir=/l,upperdir=/u",
    r"64 27 8:17 / /mnt/my\040disk rw,relatime shared:33 - xfs /dev/sdb1 rw",
    "65 27 0:54 / /srv rw,relatime shared:34 - autofs systemd-1 rw,fd=50",
    "66 65 0:55 / /srv rw,relatime shared:35 - nfs files:/srv rw,vers=3",
    "this line is not a mount",
)
MOUNTINFO = "\n".join(MOUNTINFO_LINES)


def test_mountinfo_lines_parse_into_mount_point_and_type() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert len(mounts) == 10, mounts  # the malformed line is skipped
    assert mounts[1] == Mount("/", "ext4", "/dev/vda")
    assert mounts[3] == Mount("/home", "nfs4", "files:/export/home")
    assert mounts[4].fstype == "fuse.sshfs"  # two optional fields before the separator
    assert mounts[7].mount_point == "/mnt/my disk"  # octal escape decoded


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/home/alice/work/hybridkv", "nfs4"),
        ("/home", "nfs4"),
        ("/home/alice/.cache/hybridkv", "tmpfs"),  # a local mount nested under the NFS one
        ("/home/alice/remote/kv", "fuse.sshfs"),
        ("/homely/kv", "ext4"),  # /home is not a parent of /homely
        ("/dev/shm/hybridkv", "tmpfs"),
        ("/var/lib/docker/overlay2/abc/merged/root/.cache", "overlay"),
        ("/mnt/my disk/store", "xfs"),
        ("/srv/kv", "nfs"),  # mounted on top of the automount point: the last listed wins
        ("/opt/kv", "ext4"),
    ],
)
def test_the_mount_holding_a_path_is_the_deepest_one(path: str, fstype: str) -> None:
    mount = mount_of(path, parse_mountinfo(MOUNTINFO))
    assert mount is not None and mount.fstype == fstype, mount


@pytest.mark.parametrize(
    ("fstype", "hangs"),
    [
        ("nfs4", True),
        ("nfs", True),
        ("cifs", True),
        ("smb3", True),
        ("9p", True),
        ("ceph", True),
        ("lustre", True),
        ("fuse.sshfs", True),
        ("fuseblk", True),
        ("autofs", True),
        ("somethingnew", True),
        (UNKNOWN_FSTYPE, True),
        ("tmpfs", False),
        ("ext4", False),
        ("xfs", False),
        ("btrfs", False),
        ("overlay", False),
    ],
)
def test_network_fuse_and_unknown_file_systems_may_hang(fstype: str, hangs: bool) -> None:
    assert may_hang(fstype) is hangs


def test_directory_fstype_reads_mountinfo_and_is_unknown_without_it(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    directory.mkdir()
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"27 1 254:0 / / rw - ext4 /dev/vda rw\n70 27 0:60 / {tmp_path} rw - nfs4 s:/x rw\n")
    assert directory_fstype(str(directory), str(mountinfo)) == "nfs4"
    assert directory_fstype(str(directory), str(tmp_path / "absent")) == UNKNOWN_FSTYPE


def _key_and_value(store: FramedStore) -> tuple[str, np.ndarray]:
    value = np.arange(64 << 10, dtype=np.uint8)
    assert store.put(["k"], [value]) == [Status.OK]
    return "k", value


def test_a_directory_on_a_network_file_system_gets_a_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detected NFS: every call runs under the default deadline, so the store says it may answer late (the
    worker then hands it private buffers, never KV pages); the store still works."""
    monkeypatch.setattr(file_module, "directory_fstype", lambda _directory: "nfs4")
    store = open_store(f"file://{tmp_path}/store?capacity=64MiB")
    try:
        backend = store.backend
        assert isinstance(backend, FileBackend)
        assert backend.fstype == "nfs4" and backend.timeout_ms == DEFAULT_HANG_TIMEOUT_MS
        assert store.answers_late("get") and store.answers_late("put")
        key, value = _key_and_value(store)
        got = np.zeros_like(value)
        assert store.get_into([key], [got]) == [Status.OK] and np.array_equal(got, value)
        assert store.exists([key, "absent"]) == [Status.OK, Status.NOT_FOUND]
        extra = store.stats().extra
        assert extra["fstype"] == "nfs4" and extra["timeout_ms"] == DEFAULT_HANG_TIMEOUT_MS
    finally:
        store.close()


def test_a_directory_on_a_local_file_system_has_no_deadline(tmp_path: Path) -> None:
    backend = FileBackend(f"file://{tmp_path}/s", tmp_path / "s", capacity_bytes=1 << 20, fstype="ext4")
    try:
        assert backend.timeout_ms is None
        assert not backend.answers_late("get") and not backend.answers_late("put")
    finally:
        backend.close()
    explicit = open_store(f"file://{tmp_path}/t?timeout_ms=5000")  # a deadline asked for: also locally
    try:
        assert explicit.answers_late("get") and explicit.backend.timeout_ms == 5000  # type: ignore[attr-defined]
    finally:
        explicit.close()


@pytest.mark.parametrize("timeout_ms", ["0", "-1"])
def test_file_timeout_ms_must_be_positive(tmp_path: Path, timeout_ms: str) -> None:
    with pytest.raises(StoreError) as error:
        open_store(f"file://{tmp_path}/s?timeout_ms={timeout_ms}")
    message = str(error.value)
    assert f"timeout_ms='{timeout_ms}'" in message and "must be > 0" in message, message


class _Hang:
    """Makes ``target.name`` (a step of the file backend's calls) block until ``release`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, target: object, name: str) -> None:
        self.release = threading.Event()
        real: Callable[..., Any] = getattr(target, name)

        def hanging(*args: Any) -> Any:
            assert self.release.wait(GUARD_S), "never released"
            return real(*args)

        monkeypatch.setattr(target, name, hanging)
        self._monkeypatch = monkeypatch
        self._target = target
        self._name = name
        self._real = real

    def stop_hanging(self) -> None:
        """Later calls run normally (the one already hung still waits for ``release``)."""
        self._monkeypatch.setattr(self._target, self._name, self._real)


@pytest.fixture
def deadline_store(tmp_path: Path) -> Iterator[FramedStore]:
    store = open_store(f"file://{tmp_path}/store?capacity=64MiB&timeout_ms=200")
    yield store
    store.close()


def test_a_hung_read_answers_timeout_and_keeps_its_destination_until_it_returns(
    deadline_store: FramedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, value = _key_and_value(deadline_store)
    hang = _Hang(monkeypatch, file_module, "read_all")
    got = np.zeros_like(value)
    with collect_late_calls() as late:
        assert deadline_store.get_into([key], [got]) == [Status.TIMEOUT]
    assert len(late) == 1 and not late[0].done(), "the hung read was not registered as a late call"
    assert not got.any(), "the destination was written before the read returned"
    hang.stop_hanging()
    again = np.zeros_like(value)
    assert deadline_store.get_into([key], [again]) == [Status.OK], "a later read did not run"
    assert np.array_equal(again, value)
    hang.release.set()
    assert late[0].result(timeout=GUARD_S) == [Status.OK]
    assert np.array_equal(got, value), "the late read did not write its destination after all"
    assert deadline_store.stats().extra["num_abandoned_calls"] == 1


def test_a_hung_put_answers_timeout_and_lands_when_it_returns(
    deadline_store: FramedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    hang = _Hang(monkeypatch, file_writer, "write_all")
    value = np.full(64 << 10, 7, dtype=np.uint8)
    with collect_late_calls() as late:
        assert deadline_store.put(["late"], [value]) == [Status.TIMEOUT]
    assert len(late) == 1 and not late[0].done()
    assert deadline_store.exists(["late"]) == [Status.NOT_FOUND]  # atomic publish: nothing visible yet
    hang.release.set()
    assert late[0].result(timeout=GUARD_S) == [Status.OK]
    got = np.zeros_like(value)
    assert deadline_store.get_into(["late"], [got]) == [Status.OK] and np.array_equal(got, value)


def test_close_under_a_hung_put_leaves_its_descriptors_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close`` returns while a put hangs, and does not close the descriptors the put will still use: hung
    before it reserves its bytes in the usage estimate, released, the put completes instead of failing on
    a closed descriptor (or writing a file that reused its number)."""
    store = open_store(f"file://{tmp_path}/store?timeout_ms=200")
    hang = _Hang(monkeypatch, SpareShelf, "claim")
    with collect_late_calls() as late:
        assert store.put(["late"], [np.ones(4096, dtype=np.uint8)]) == [Status.TIMEOUT]
    store.close()
    hang.release.set()
    assert late[0].result(timeout=GUARD_S) == [Status.OK]


# -- the calls that hand the store no buffers: listing, removal by prefix, statistics, tenant counters ----

#: How long a modelled hang lasts before a timer ends it (the calls under test must answer before).
HANG_S = 10.0


def _hang_for_a_while(monkeypatch: pytest.MonkeyPatch, target: object, name: str) -> _Hang:
    """A hang of ``target.name`` that ends by itself after ``HANG_S`` (so that code without a deadline
    returns, late, and its test fails on an assertion instead of waiting ``GUARD_S``)."""
    hang = _Hang(monkeypatch, target, name)
    timer = threading.Timer(HANG_S, hang.release.set)
    timer.daemon = True
    timer.start()
    return hang


def _assert_answered_during_the_hang(hang: _Hang, what: str) -> None:
    assert not hang.release.is_set(), f"{what} waited for the hung file system instead of its deadline"


@pytest.fixture
def quota_store(tmp_path: Path) -> Iterator[FramedStore]:
    """A store under a 200 ms deadline whose tenant ``t`` (quota 1 MiB) holds two 64 KiB entries."""
    store = open_store(f"file://{tmp_path}/store?capacity=64MiB&timeout_ms=200")
    write_quotas(tmp_path / "store", {"t": 1 << 20})
    values = [np.full(64 << 10, index, dtype=np.uint8) for index in range(2)]
    assert store.put(["hkv1/t/0", "hkv1/t/1"], values) == [Status.OK] * 2
    yield store
    store.close()


def test_tenant_counters_under_a_hang_answer_the_last_values_within_the_deadline(
    quota_store: FramedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker reads the tenant counters on vLLM's thread: on a hung file system the read answers the
    values last read within the deadline, and answers at once while that read is still hung."""
    before = tenant_counters_of(quota_store)
    assert before["t"].usage_bytes >= 2 * (64 << 10)
    hang = _hang_for_a_while(monkeypatch, FileTenants, "current")
    during = tenant_counters_of(quota_store)
    again = tenant_counters_of(quota_store)
    _assert_answered_during_the_hang(hang, "tenant_counters")
    assert during == before and again == before
    hang.stop_hanging()
    hang.release.set()
    assert quota_store.put(["hkv1/t/2"], [np.ones(64 << 10, dtype=np.uint8)]) == [Status.OK]
    # The hung read returns on the runner, then reads run again and see the new entry.
    deadline = time.monotonic() + GUARD_S
    while tenant_counters_of(quota_store)["t"].usage_bytes == before["t"].usage_bytes:
        assert time.monotonic() < deadline, "the tenant counters were never read again after the hang"
        time.sleep(0.01)


def test_stats_under_a_hang_fail_within_the_deadline(
    quota_store: FramedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    hang = _hang_for_a_while(monkeypatch, FileTenants, "current")
    with pytest.raises(StoreError, match="stats did not finish within timeout_ms=200"):
        quota_store.stats()
    _assert_answered_during_the_hang(hang, "stats")
    hang.stop_hanging()
    hang.release.set()
    assert quota_store.stats().num_keys == 2


def test_listing_under_a_hang_fails_within_the_deadline(
    quota_store: FramedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    hang = _hang_for_a_while(monkeypatch, FileLayout, "key_of")
    with pytest.raises(StoreError, match="iter_keys did not finish within timeout_ms=200"):
        list(quota_store.iter_keys(""))
    _assert_answered_during_the_hang(hang, "iter_keys")
    hang.stop_hanging()
    hang.release.set()
    assert sorted(quota_store.iter_keys("")) == ["hkv1/t/0", "hkv1/t/1"]


def test_a_reset_removal_under_a_hang_fails_within_the_deadline_and_a_later_one_succeeds(
    quota_store: FramedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reset removes its namespace with ``remove_prefix``: on a hung file system it must fail (the reset
    fails, and the next one can succeed) instead of never returning (the external tier off until restart)."""
    hang = _hang_for_a_while(monkeypatch, FileLayout, "key_of")
    with pytest.raises(StoreError, match="remove_prefix did not finish within timeout_ms=200"):
        quota_store.remove_prefix("hkv1/t/")
    _assert_answered_during_the_hang(hang, "remove_prefix")
    hang.stop_hanging()
    hang.release.set()
    assert quota_store.remove_prefix("hkv1/t/") in (0, 1, 2)  # the late step may have removed some
    assert list(quota_store.iter_keys("")) == []
    assert quota_store.exists(["hkv1/t/0", "hkv1/t/1"]) == [Status.NOT_FOUND] * 2
