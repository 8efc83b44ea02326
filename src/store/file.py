"""``file:///DIR?capacity=SIZE``: the embedded default backend, safe across processes.

Layout under DIR (created ``0700``)::

    objects/ab/ab12...ef.kv   one frame per key; the name is the hex blake2b-128 of the key (never the raw
                              key), the real key lives inside the frame header so listing still works
    tmp/                      frames being written; published with link(2), which fails if the name exists,
                              so publication is atomic *and* insert-if-absent across processes
    usage                     8-byte little-endian estimate of the bytes under objects/ (shared, flock'ed)
    evict.lock                held (non-blocking) by the one process currently evicting

Readers open a published file and read it whole; a concurrent eviction or removal unlinks the name but not
the open inode, so a reader never sees a partial value.

LRU across processes: a file's mtime is its last use. Reads and ``exists`` touch it (at most once a second
per file, to keep hits cheap). Accounting: every put adds its size to ``usage`` and every remove subtracts
it, under an flock; when a put would exceed ``capacity`` the putter takes ``evict.lock``, scans the
objects, deletes oldest-mtime first down to 90 % of capacity, and rewrites ``usage`` with the real total
(correcting drift from crashed writers). The bound is approximate only by the values in flight at once.
No fsync: this is a cache. A frame torn by a power loss fails its frame check and reads as ``CORRUPT``.

Speed (``hybridkv bench store``, /dev/shm): values move with one ``writev``/``readv`` straight from/to the
caller's buffers, and the frame checksum runs per value right before the write / right after the read
(``JustInTimeBackend``), while the bytes are in cache. A put is bounded by tmpfs allocating a fresh 4 KiB
page per 4 KiB written: a plain ``write`` of 1 MiB into a new /dev/shm file runs at ~0.3x memcpy on the dev
VM (overwriting existing pages ~0.6x; on a tmpfs mounted ``huge=always`` a new file takes ~0.6x).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

import structlog
from hybridkv.store.base import Status, StoreError, StoreStats
from hybridkv.store.frame import FIXED_HEADER_SIZE, key_digest, key_from_header
from hybridkv.store.framed import FrameParts, SealHook, VerifyHook

log = structlog.get_logger(__name__)

_SUFFIX = ".kv"
#: Evict down to this fraction of capacity, so eviction scans run once per 10 % of capacity written.
_LOW_WATERMARK = 0.9
#: Reads refresh a file's mtime only when it is older than this (seconds): LRU resolution vs. syscalls.
_TOUCH_INTERVAL_S = 1.0
#: Temporary files older than this (seconds) belong to a crashed writer and are removed by eviction scans.
_STALE_TMP_S = 600.0
_IOV_MAX = 1024
_temp_counter = itertools.count()


class FileBackend:
    """Frames as files under one directory. Thread- and process-safe."""

    def __init__(self, url: str, directory: Path, *, capacity_bytes: int) -> None:
        self.url = url
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self._objects = directory / "objects"
        self._tmp = directory / "tmp"
        self._objects_str = str(self._objects)
        self._tmp_str = str(self._tmp)
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._objects.mkdir(mode=0o700, exist_ok=True)
            self._tmp.mkdir(mode=0o700, exist_ok=True)
            mode = stat.S_IMODE(directory.stat().st_mode)
            if mode & 0o077:
                log.warning("store.file.dir_not_private", directory=str(directory), mode=oct(mode))
            self._usage_fd = os.open(directory / "usage", os.O_RDWR | os.O_CREAT, 0o600)
            self._evict_fd = os.open(directory / "evict.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise StoreError(f"file store {url!r}: cannot use directory {str(directory)!r}: {error}") from None
        # flock is per open file description, so threads of this process also need a lock of their own.
        self._usage_lock = threading.Lock()
        self._closed = False
        self.num_evicted = 0

    # -- paths -------------------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        # str, not Path: this is on every call's hot path.
        digest = key_digest(key).hex()
        return f"{self._objects_str}/{digest[:2]}/{digest}{_SUFFIX}"

    def _iter_object_paths(self) -> Iterator[Path]:
        try:
            with os.scandir(self._objects) as shards:
                shard_paths = [entry.path for entry in shards if entry.is_dir()]
        except FileNotFoundError:
            return
        for shard in shard_paths:
            try:
                with os.scandir(shard) as entries:
                    names = [entry.path for entry in entries if entry.name.endswith(_SUFFIX)]
            except FileNotFoundError:
                continue
            yield from (Path(name) for name in names)

    # -- usage accounting --------------------------------------------------------------------------------

    def _add_usage(self, delta: int) -> int:
        """Add ``delta`` to the shared usage estimate; returns the new value."""
        with self._usage_lock:
            fcntl.flock(self._usage_fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._usage_fd, 8, 0)
                usage = max(0, (int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else 0) + delta)
                if delta == 0:
                    return usage
                os.pwrite(self._usage_fd, usage.to_bytes(8, "little", signed=True), 0)
                return usage
            finally:
                fcntl.flock(self._usage_fd, fcntl.LOCK_UN)

    def _set_usage(self, usage: int) -> None:
        with self._usage_lock:
            fcntl.flock(self._usage_fd, fcntl.LOCK_EX)
            try:
                os.pwrite(self._usage_fd, usage.to_bytes(8, "little", signed=True), 0)
            finally:
                fcntl.flock(self._usage_fd, fcntl.LOCK_UN)

    def _make_room(self, size: int) -> bool:
        """Evict oldest files until ``size`` more bytes fit under the low watermark (one process at a time).

        Returns ``True`` if this call scanned and rewrote ``usage`` (to the bytes on disk now)."""
        try:
            fcntl.flock(self._evict_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # another process is evicting right now; its pass makes room for us too
        try:
            now = time.time()
            entries: list[tuple[float, int, Path]] = []
            for path in self._iter_object_paths():
                try:
                    info = path.stat()
                except FileNotFoundError:
                    continue
                entries.append((info.st_mtime, info.st_size, path))
            total = sum(size_ for _mtime, size_, _path in entries)
            target = int(self.capacity_bytes * _LOW_WATERMARK) - size
            entries.sort(key=lambda entry: entry[0])
            num_evicted = 0
            for _mtime, file_size, path in entries:
                if total <= target:
                    break
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
                total -= file_size
                num_evicted += 1
            self._set_usage(total)
            self.num_evicted += num_evicted
            self._remove_stale_temp_files(now)
            log.debug("store.file.evicted", url=self.url, num_evicted=num_evicted, num_bytes=total)
            return True
        finally:
            fcntl.flock(self._evict_fd, fcntl.LOCK_UN)

    def _remove_stale_temp_files(self, now: float) -> None:
        with os.scandir(self._tmp) as entries:
            for entry in entries:
                try:
                    if now - entry.stat().st_mtime > _STALE_TMP_S:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    pass

    # -- Backend -----------------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[Status]:
        results: list[Status] = []
        now = time.time()
        for key in keys:
            path = self._path(key)
            try:
                info = os.stat(path)
            except FileNotFoundError:
                results.append(Status.NOT_FOUND)
                continue
            except OSError as error:
                results.append(self._status_of(error, "exists", key))
                continue
            self._touch(path, None, info.st_mtime, now)
            results.append(Status.OK)
        return results

    def put_frames(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        return self.put_frames_sealed(keys, frames, None)

    def put_frames_sealed(
        self, keys: Sequence[str], frames: Sequence[FrameParts], seal: SealHook | None
    ) -> list[Status]:
        """``put_frames``, sealing each frame (computing its checksum) right before writing it."""
        results: list[Status] = []
        paths: list[str | None] = []
        sizes = [sum(part.nbytes for part in frame) for frame in frames]
        num_new_bytes = 0
        for key, size in zip(keys, sizes):
            path = self._path(key)
            if os.path.exists(path):  # insert-if-absent; the link in _publish settles races
                results.append(Status.OK)
                paths.append(None)
            elif size > self.capacity_bytes:
                results.append(Status.NO_SPACE)
                paths.append(None)
            else:
                results.append(Status.OK)
                paths.append(path)
                num_new_bytes += size
        if num_new_bytes == 0:
            return results
        # Reserve the batch's bytes up front (one locked update), make room if that overflows, and give
        # back what was not published.
        if self._add_usage(num_new_bytes) > self.capacity_bytes:
            if self._make_room(num_new_bytes):
                self._add_usage(num_new_bytes)  # the eviction pass rewrote usage without this batch
        num_unpublished_bytes = 0
        for index, (key, frame, new_path) in enumerate(zip(keys, frames, paths)):
            if new_path is None:
                continue
            if seal is not None:
                seal(index)
            results[index], published = self._publish(key, frame, new_path)
            if not published:
                num_unpublished_bytes += sizes[index]
        if num_unpublished_bytes:
            self._add_usage(-num_unpublished_bytes)
        return results

    def _publish(self, key: str, frame: FrameParts, path: str) -> tuple[Status, bool]:
        """Write ``frame`` to a temp file and link it to ``path``: (status, whether this call published)."""
        temp = f"{self._tmp_str}/{os.getpid()}-{threading.get_ident()}-{next(_temp_counter)}.tmp"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, frame)
            finally:
                os.close(fd)
            try:
                _link_creating_shard(temp, path)
            except FileExistsError:
                return Status.OK, False  # another writer published first: first writer wins
            return Status.OK, True
        except OSError as error:
            return self._status_of(error, "put", key), False
        finally:
            try:
                os.unlink(temp)
            except FileNotFoundError:
                pass

    def get_frames_into(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        return self.get_frames_verified(keys, frames, None)

    def get_frames_verified(
        self, keys: Sequence[str], frames: Sequence[FrameParts], verify: VerifyHook | None
    ) -> list[Status]:
        """``get_frames_into``, verifying each frame right after reading it (while its bytes are cached)."""
        results: list[Status] = []
        now = time.time()
        for index, (key, frame) in enumerate(zip(keys, frames)):
            path = self._path(key)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                results.append(Status.NOT_FOUND)
                continue
            except OSError as error:
                results.append(self._status_of(error, "get", key))
                continue
            try:
                info = os.fstat(fd)
                expected = sum(part.nbytes for part in frame)
                if info.st_size != expected:
                    results.append(Status.CORRUPT)
                    log.warning("store.file.size_mismatch", key=key, size=info.st_size, expected=expected)
                    continue
                if _read_all(fd, frame) != expected or (verify is not None and not verify(index)):
                    results.append(Status.CORRUPT)
                    continue
                self._touch(path, fd, info.st_mtime, now)
                results.append(Status.OK)
            except OSError as error:
                results.append(self._status_of(error, "get", key))
            finally:
                os.close(fd)
        return results

    def remove(self, keys: Sequence[str]) -> list[Status]:
        results: list[Status] = []
        for key in keys:
            path = self._path(key)
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                results.append(Status.NOT_FOUND)
                continue
            except OSError as error:
                results.append(self._status_of(error, "remove", key))
                continue
            self._add_usage(-size)
            results.append(Status.OK)
        return results

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        for _path, listed_key in self._iter_keyed_paths():
            if listed_key.startswith(prefix):
                yield listed_key

    @overload
    def _iter_keyed_paths(self) -> Iterator[tuple[Path, str]]: ...

    @overload
    def _iter_keyed_paths(self, include_unreadable: bool) -> Iterator[tuple[Path, str | None]]: ...

    def _iter_keyed_paths(self, include_unreadable: bool = False) -> Iterator[tuple[Path, str | None]]:
        for path in self._iter_object_paths():
            try:
                with open(path, "rb") as file:
                    head = file.read(FIXED_HEADER_SIZE)
                    key_length = int.from_bytes(head[8:12], "little") if len(head) == FIXED_HEADER_SIZE else 0
                    head += file.read(min(key_length, 1 << 16))
            except FileNotFoundError:
                continue
            key = key_from_header(head)
            if key is None:
                log.warning("store.file.unreadable_header", path=str(path))
                if not include_unreadable:
                    continue
            yield path, key

    def remove_prefix(self, prefix: str) -> int:
        """Remove the keys starting with ``prefix``, plus any file whose header is unreadable: its key is
        unknown and every read of it would be ``CORRUPT``, so it is garbage under every prefix (not counted)."""
        num_removed = 0
        for path, key in list(self._iter_keyed_paths(include_unreadable=True)):
            if key is None:
                self._unlink_accounted(path)
            elif key.startswith(prefix) and self._unlink_accounted(path):
                num_removed += 1
        return num_removed

    def _unlink_accounted(self, path: Path) -> bool:
        """Unlink ``path`` and subtract its size from ``usage``; ``False`` if it was already gone."""
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return False
        self._add_usage(-size)
        return True

    def stats(self) -> StoreStats:
        num_keys = 0
        num_bytes = 0
        for path in self._iter_object_paths():
            try:
                num_bytes += path.stat().st_size
            except FileNotFoundError:
                continue
            num_keys += 1
        return StoreStats(
            url=self.url,
            num_keys=num_keys,
            num_bytes=num_bytes,
            capacity_bytes=self.capacity_bytes,
            extra={
                "directory": str(self.directory),
                "usage_estimate_bytes": self._add_usage(0),
                "num_evicted_by_this_process": self.num_evicted,
            },
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.close(self._usage_fd)
        os.close(self._evict_fd)

    # -- helpers -----------------------------------------------------------------------------------------

    def _touch(self, path: str, fd: int | None, mtime: float, now: float) -> None:
        if now - mtime < _TOUCH_INTERVAL_S:
            return
        try:
            os.utime(fd if fd is not None else path)
        except OSError:
            pass  # evicted meanwhile, or read-only mount: LRU order is best effort

    def _status_of(self, error: OSError, op: str, key: str) -> Status:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return Status.NO_SPACE
        log.warning("store.file.io_error", url=self.url, op=op, key=key, error=str(error))
        return Status.TRANSFER_FAILED


def _link_creating_shard(temp: str, path: str) -> None:
    """``link(temp, path)``, creating the shard directory on first use (shards are made lazily so that
    small stores stay small to scan)."""
    try:
        os.link(temp, path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.link(temp, path)


def _advance(pending: list[memoryview], num_bytes: int) -> None:
    """Drop the first ``num_bytes`` bytes (just written or read) from ``pending``, keeping the tail."""
    while num_bytes and pending:
        if num_bytes >= pending[0].nbytes:
            num_bytes -= pending[0].nbytes
            pending.pop(0)
        else:
            pending[0] = pending[0][num_bytes:]
            num_bytes = 0


def _write_all(fd: int, parts: Sequence[memoryview]) -> None:
    pending = [part for part in parts if part.nbytes]
    while pending:
        _advance(pending, os.writev(fd, pending[:_IOV_MAX]))


def _read_all(fd: int, parts: Sequence[memoryview]) -> int:
    """Fill ``parts`` from the start of ``fd``; returns bytes read (short only at end of file)."""
    pending = [part for part in parts if part.nbytes]
    total = 0
    while pending:
        num_read = os.readv(fd, pending[:_IOV_MAX])
        if num_read == 0:
            break
        total += num_read
        _advance(pending, num_read)
    return total
