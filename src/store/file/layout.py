"""The file store's directory: where each frame lives, what the store holds, and what it evicts and recycles.

Contract: :class:`FileLayout` owns the on-disk protocol that every process sharing a directory follows -- the
names, the shared usage estimate, eviction, and the recycling of files with the locks that keep readers of
a recycled inode from ever seeing its new bytes. It moves no value bytes: ``hybridkv.store.file`` (the
``FileBackend``) writes and reads the frames, through the paths and descriptors this module hands out.
Thread- and process-safe.

Layout under DIR (created ``0700``)::

    objects/ab/ab12...ef.kv   one frame per key; the name is the hex blake2b-128 of the key (never the raw
                              key), the real key lives inside the frame header so listing still works
    tmp/                      frames being written; published with link(2), which fails if the name exists,
                              so publication is atomic *and* insert-if-absent across processes
    spare/SIZE/*.kv           removed or evicted files kept for reuse, by page-rounded size (see Recycling)
    usage                     two 8-byte little-endian estimates (shared, flock'ed): the bytes under objects/
                              and spare/ together, and the bytes under spare/
    tenant_usage.json         the tenants' ledger (under usage's flock): per namespace under a quota an estimate
                              of its bytes, the reservations of puts in flight (``TenantLedger``)
    quotas.json               bytes per namespace (``hybridkv.store.quotas``), written by the operator
    evict.lock                held by the one process currently evicting (non-blocking for capacity passes)
    evictions/                what every eviction pass removed, for every process's ``take_evictions``
                              (``hybridkv.store.file.eviction_log``)

Readers open a published file and read it whole; a concurrent eviction or removal moves or unlinks the name
but not the open inode, so a reader never sees a partial value.

Recycling: a put into a new tmpfs file faults in and zeroes a fresh page per 4 KiB, which costs more than
the copy itself; overwriting a file whose pages are already there runs about twice as fast (see Speed in
``hybridkv.store.file``). So a removed or evicted file of ``RECYCLE_MIN_SIZE`` or more is renamed into
``spare/SIZE/`` instead of being unlinked (while the spares stay within ``_SPARE_FRACTION`` of capacity;
they count toward capacity), and a put of a frame of the same page-rounded size claims one by renaming it
into ``tmp/`` (atomic across processes), overwrites it in place and publishes it with link(2) like a new
file. The claimer touches the spare just before that rename: a spare keeps its mtime from its previous
life, and an old mtime in ``tmp/`` is how eviction scans recognize a crashed writer's temp file, so without
the touch another process's scan could delete a claimed spare mid-put. A reader that opened the file under
its old name must never see the new bytes, so for recyclable files:

- the writer holds ``flock(LOCK_EX)`` on the inode while it overwrites it, and gives up the spare (writing
  a new file instead) if it cannot get the lock at once (:meth:`~hybridkv.store.file.spares.SpareShelf.open`);
- the reader takes ``flock(LOCK_SH)`` (non-blocking: if a writer holds the inode, the value is gone:
  ``NOT_FOUND``) and then checks that its key's name still links to the inode it opened
  (:meth:`FileLayout.open_published`). While the reader holds the shared lock no writer can claim the
  inode; if the inode was recycled before the reader locked it, the name check fails (a name only ever
  links to frames of its own key) and the reader answers ``NOT_FOUND``.

LRU across processes: a file's mtime is its last use. Reads and ``exists`` touch it (at most once a second
per file, to keep hits cheap). Accounting: every put adds its size to ``usage`` and every remove subtracts
it, under an flock; when a put would exceed ``capacity`` the putter takes ``evict.lock`` and evicts
oldest-mtime first what it needs, from the process's index of the oldest files or from a sample of shards,
taking exactly what it removed off ``usage``; a thread of the process tops the store up to 90 % of capacity
in the background (``hybridkv.store.file.eviction``: a put's cost is bounded by what it evicts, not by the
entries the store holds). ``make_room``, the whole-store pass, rewrites ``usage`` with the real total
(correcting drift from crashed writers). The bound is approximate only by the values in flight at once.

Retention (``Store.retain``, ``hybridkv.store.retention``): a retained file's mtime is set to the time its
retention ends, in the future. Touches never move it back (a future mtime is "used within the last second"),
and an eviction pass takes every ordinary file first, then the retained ones, expiring first first; only
retained files within ``RETAIN_FRACTION`` of the capacity (of the quota, in a tenant's pass) are protected,
the rest count as used now (``eviction_order``). The mtime is on disk, so every process sharing the directory
honours a retention any of them made; a new file for the key (after an eviction) is not retained.

Quotas: the tenants' estimates, the reservations of puts in flight and the tenant pass are
``hybridkv.store.file.ledger``.
No fsync: this is a cache. A frame torn by a power loss fails its frame check and reads as ``CORRUPT``.
Values below ``RECYCLE_MIN_SIZE`` are not recycled: their put is bounded by the ~10 path syscalls per file,
not by page faults.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import overload

import structlog
from hybridkv.store.base import StoreError, StoreLogEvent
from hybridkv.store.file.eviction import CapacityEvictor
from hybridkv.store.file.eviction_log import EvictionLog
from hybridkv.store.file.ledger import SharedLedger
from hybridkv.store.file.policy import LOW_WATERMARK, STALE_TMP_S
from hybridkv.store.file.spares import SUFFIX, SpareShelf, size_class
from hybridkv.store.frame import FIXED_HEADER_SIZE, key_digest, key_from_header

log = structlog.get_logger(__name__)

_SUFFIX = SUFFIX
#: Reads refresh a file's mtime only when it is older than this (seconds): LRU resolution vs. syscalls.
_TOUCH_INTERVAL_S = 1.0
#: Files at least this big (page-rounded) are recycled: below it, path syscalls cost more than page faults.
RECYCLE_MIN_SIZE = 256 << 10
#: Spare files are kept while they hold at most this fraction of capacity (the eviction hysteresis band).
_SPARE_FRACTION = 1.0 - LOW_WATERMARK
_temp_counter = itertools.count()


class FileLayout:
    """One store directory: names, the shared usage estimate, eviction and spares (see the module docstring).

    Creating it creates the directories and opens the two shared descriptors (``usage``, ``evict.lock``);
    :meth:`close` closes them."""

    def __init__(self, url: str, directory: Path, *, capacity_bytes: int, recycle_min_size: int) -> None:
        """``recycle_min_size``: every process sharing ``directory`` must use the same value, because
        readers lock exactly the files writers may recycle. ``url`` names the store in errors and logs."""
        self.url = url
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        #: What eviction holds the store to: ``capacity_bytes``, or less where the file system holds less
        #: (``set_effective_capacity``: ``FileBackend`` derives it from the free space).
        self.effective_capacity_bytes = capacity_bytes
        self.recycle_min_size = max(1, recycle_min_size)
        self.spare_budget_bytes = int(capacity_bytes * _SPARE_FRACTION)
        self._objects = directory / "objects"
        self._tmp = directory / "tmp"
        self._spare = directory / "spare"
        self._objects_str = str(self._objects)
        self._tmp_str = str(self._tmp)
        self._spare_str = str(self._spare)
        #: the spare files by size class (recycling)
        self.spares = SpareShelf(self._spare_str, self.temp_path, self.is_recyclable)
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._objects.mkdir(mode=0o700, exist_ok=True)
            self._tmp.mkdir(mode=0o700, exist_ok=True)
            self._spare.mkdir(mode=0o700, exist_ok=True)
            mode = stat.S_IMODE(directory.stat().st_mode)
            if mode & 0o077:
                log.warning(StoreLogEvent.FILE_DIR_NOT_PRIVATE, directory=str(directory), mode=oct(mode))
            self._usage_fd = os.open(directory / "usage", os.O_RDWR | os.O_CREAT, 0o600)
            self._evict_fd = os.open(directory / "evict.lock", os.O_RDWR | os.O_CREAT, 0o600)
            #: The tenants' shared ledger (``tenant_usage.json``) and the tenant passes.
            self.ledger = SharedLedger(self)
        except OSError as error:
            raise StoreError(
                f"file store {url!r}: cannot use directory {str(directory)!r}: {error}"
            ) from None
        # flock is per open file description, so threads of this process also need a lock of their own.
        self._usage_lock = threading.Lock()
        self._counters_lock = threading.Lock()
        #: ``evict.lock`` among this process's threads: one eviction pass (capacity or tenant) at a time.
        self._evict_thread_lock = threading.Lock()
        #: Files this process's eviction passes evicted (moved to spare/ or unlinked).
        self.num_evicted = 0
        #: Seconds this process's threads waited for the usage lock and for ``evict.lock`` (the blocking
        #: holds: ``usage_locked``, ``evict_locked``), and how many times each was taken.
        self.usage_lock_wait_s = 0.0
        self.num_usage_locks = 0
        self.evict_lock_wait_s = 0.0
        self.num_evict_locks = 0
        #: What every process's eviction passes removed (``hybridkv.store.file.eviction_log``).
        self.eviction_log = EvictionLog(directory)
        #: This process's capacity passes: the put path's, bounded, and the background top-up.
        self.evictor = CapacityEvictor(self, _SUFFIX)

    def set_effective_capacity(self, num_bytes: int) -> None:
        """Hold eviction (and the spares' budget) to ``num_bytes``, at most ``capacity_bytes``: the bytes the
        file system can hold for this store right now (a full disk below the configured capacity)."""
        effective = max(0, min(num_bytes, self.capacity_bytes))
        self.effective_capacity_bytes = effective
        self.spare_budget_bytes = int(effective * _SPARE_FRACTION)

    def close(self) -> None:
        """Stop the top-up thread, then close the shared descriptors (the caller makes sure no call still
        uses them)."""
        self.evictor.close()
        os.close(self._usage_fd)
        os.close(self._evict_fd)
        self.ledger.close()

    @contextlib.contextmanager
    def usage_locked(self) -> Iterator[None]:
        """Hold the usage estimate's lock: ``usage``'s flock across processes, and a lock of this process's
        own (flock is per open file description, so it does not tell this process's threads apart). The
        tenants' ledger is read and written under it too."""
        started = time.perf_counter()
        with self._usage_lock:
            fcntl.flock(self._usage_fd, fcntl.LOCK_EX)
            self.usage_lock_wait_s += time.perf_counter() - started  # under the lock: no race
            self.num_usage_locks += 1
            try:
                yield
            finally:
                fcntl.flock(self._usage_fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def evict_locked(self) -> Iterator[None]:
        """Hold ``evict.lock`` (waiting for it): one eviction pass at a time, across processes and across this
        process's threads (a capacity pass takes it without waiting: ``make_room``)."""
        started = time.perf_counter()
        with self._evict_thread_lock:
            fcntl.flock(self._evict_fd, fcntl.LOCK_EX)
            self.evict_lock_wait_s += time.perf_counter() - started  # under the lock: no race
            self.num_evict_locks += 1
            try:
                yield
            finally:
                fcntl.flock(self._evict_fd, fcntl.LOCK_UN)

    # -- names -------------------------------------------------------------------------------------------

    def path_of(self, key: str) -> str:
        """The file that holds ``key``'s frame (whether or not it exists); for inspection and fault tests.
        A str, not a Path: this is on every call's hot path."""
        digest = key_digest(key).hex()
        return f"{self._objects_str}/{digest[:2]}/{digest}{_SUFFIX}"

    def temp_path(self) -> str:
        """A fresh name under tmp/, unique across processes and threads."""
        return f"{self._tmp_str}/{os.getpid()}-{threading.get_ident()}-{next(_temp_counter)}.tmp"

    def link(self, temp: str, path: str) -> None:
        """Publish ``temp`` as ``path`` (``link(2)``; ``FileExistsError`` if the name exists), creating the
        shard directory on first use (shards are made lazily so that small stores stay small to scan)."""
        try:
            os.link(temp, path)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            os.link(temp, path)

    def touch(self, path: str, fd: int | None, mtime: float, now: float) -> None:
        """Mark the file used ``now`` (LRU), unless its ``mtime`` is within ``_TOUCH_INTERVAL_S``."""
        if now - mtime < _TOUCH_INTERVAL_S:
            return
        with contextlib.suppress(OSError):  # evicted meanwhile, or read-only mount: LRU order is best effort
            os.utime(fd if fd is not None else path)

    def retain(self, path: str, until: float) -> None:
        """Retention (``hybridkv.store.retention``) on disk: the file's mtime becomes ``until`` (now, when
        ``until`` has passed: a released entry ages as if used now) and its atime now (its last use, for an
        eviction pass that finds it beyond the retention budget). ``touch`` never moves a future mtime
        back, and eviction orders by mtime, protected within ``RETAIN_FRACTION`` (``eviction_order``).
        ``FileNotFoundError`` when the file is not there."""
        now = time.time()
        stamp = max(now, until)
        os.utime(path, (now, stamp))

    def is_recyclable(self, size: int) -> bool:
        """Whether a file of ``size`` bytes may be recycled (readers lock exactly these)."""
        return size_class(size) >= self.recycle_min_size

    def iter_object_paths(self) -> Iterator[Path]:
        """The published files (unordered; ones removed meanwhile may be listed)."""
        yield from self._iter_sharded(self._objects)

    def iter_spare_paths(self) -> Iterator[Path]:
        yield from self._iter_sharded(self._spare)

    @staticmethod
    def _iter_sharded(root: Path) -> Iterator[Path]:
        for shard in FileLayout._shards_of(root):
            yield from FileLayout.shard_paths(shard)

    def object_shards(self) -> list[str]:
        """The shard directories under objects/: a listing in steps (one shard each), so that a caller can
        put a deadline on each step (``hybridkv.store.file.deadline``) however large the store."""
        return self._shards_of(self._objects)

    def spare_shards(self) -> list[str]:
        return self._shards_of(self._spare)

    @staticmethod
    def _shards_of(root: Path) -> list[str]:
        try:
            with os.scandir(root) as shards:
                return [entry.path for entry in shards if entry.is_dir()]
        except FileNotFoundError:
            return []

    @staticmethod
    def shard_paths(shard: str) -> list[Path]:
        """The files of one shard (of ``object_shards`` or ``spare_shards``); none if it is gone."""
        try:
            with os.scandir(shard) as entries:
                return [Path(entry.path) for entry in entries if entry.name.endswith(_SUFFIX)]
        except FileNotFoundError:
            return []

    def keyed_paths_in(self, shard: str, include_unreadable: bool = False) -> list[tuple[Path, str | None]]:
        """``iter_keyed_paths`` of one shard of ``object_shards``."""
        keyed: list[tuple[Path, str | None]] = []
        for path in self.shard_paths(shard):
            found, key = self.key_of(str(path))
            if not found:
                continue
            if key is None:
                log.warning(StoreLogEvent.FILE_UNREADABLE_HEADER, path=str(path))
                if not include_unreadable:
                    continue
            keyed.append((path, key))
        return keyed

    @overload
    def iter_keyed_paths(self) -> Iterator[tuple[Path, str]]: ...

    @overload
    def iter_keyed_paths(self, include_unreadable: bool) -> Iterator[tuple[Path, str | None]]: ...

    def iter_keyed_paths(self, include_unreadable: bool = False) -> Iterator[tuple[Path, str | None]]:
        """Each published file with the key its frame header names. A file whose header is unreadable, or
        holds a frame of another key, is logged and skipped -- or, with ``include_unreadable``, listed with
        ``None``. A shard at a time (``keyed_paths_in``)."""
        for shard in self.object_shards():
            yield from self.keyed_paths_in(shard, include_unreadable)

    def key_of(self, path: str) -> tuple[bool, str | None]:
        """(whether the published file ``path`` is there, the key its frame header names): the key is
        ``None`` when the header is unreadable or names another key (one open and two small reads)."""
        opened = self.open_published(path)  # locked: a recycled inode could be mid-rewrite
        if opened is None:
            return False, None
        fd = opened[0]
        try:
            head = os.pread(fd, FIXED_HEADER_SIZE, 0)
            key_length = int.from_bytes(head[8:12], "little") if len(head) == FIXED_HEADER_SIZE else 0
            head += os.pread(fd, min(key_length, 1 << 16), FIXED_HEADER_SIZE)
        finally:
            os.close(fd)
        key = key_from_header(head)
        if key is not None and self.path_of(key) != path:
            key = None  # a frame of another key under this name: unreadable as this key
        return True, key

    # -- the recycling locks -----------------------------------------------------------------------------

    def open_published(self, path: str) -> tuple[int, os.stat_result] | None:
        """Open the published file ``path`` for reading: ``(fd, its stat)``, or ``None`` if it is gone.

        A recyclable file is returned locked shared (until the fd is closed) and only if ``path`` still
        links to it, so its bytes are the frame published under ``path`` (see Recycling)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            info = os.fstat(fd)
            if self.is_recyclable(info.st_size):
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    return None  # a writer is recycling this inode: the value it held is gone
                try:
                    named = os.stat(path)
                except FileNotFoundError:
                    named = None
                if named is None or (named.st_ino, named.st_dev) != (info.st_ino, info.st_dev):
                    os.close(fd)
                    return None  # removed (and maybe recycled) between our open and our lock
                # The locked inode as it is now (a writer may have rewritten it before our lock, and none
                # can while we hold it): the same answer as an fstat, one syscall fewer.
                info = named
        except BaseException:
            os.close(fd)
            raise
        return fd, info

    # -- usage accounting --------------------------------------------------------------------------------

    def update_usage(self, update: Callable[[int, int], tuple[int, int]]) -> tuple[int, int]:
        """Apply ``update(usage, spare) -> (usage, spare)`` to the shared estimates under the lock, where
        ``usage`` counts the bytes under objects/ and spare/ and ``spare`` those under spare/; returns the
        new pair."""
        with self.usage_locked():
            raw = os.pread(self._usage_fd, 16, 0)
            old = (
                int.from_bytes(raw[0:8], "little", signed=True) if len(raw) >= 8 else 0,
                int.from_bytes(raw[8:16], "little", signed=True) if len(raw) >= 16 else 0,
            )
            usage, spare = update(*old)
            new = (max(0, usage), max(0, spare))
            if new != old:
                os.pwrite(self._usage_fd, b"".join(n.to_bytes(8, "little", signed=True) for n in new), 0)
            return new

    def add_usage(self, delta: int, spare_delta: int = 0) -> int:
        """Add ``delta`` to the usage estimate (and ``spare_delta`` to the spare estimate); returns the usage."""
        return self.update_usage(lambda usage, spare: (usage + delta, spare + spare_delta))[0]

    def set_usage(self, usage: int, spare: int) -> None:
        self.update_usage(lambda _usage, _spare: (usage, spare))

    # -- retiring, spares, eviction ----------------------------------------------------------------------

    def retire(self, path: str, size: int) -> bool:
        """Take the published file ``path`` (``size`` bytes) out of the store: keep it as a spare when it is
        recyclable and the spares have room, else unlink it. Accounts for it; ``False`` if it was gone."""
        if self.is_recyclable(size):
            kept = False

            def reserve(usage: int, spare: int) -> tuple[int, int]:
                nonlocal kept
                kept = spare + size <= self.spare_budget_bytes
                return (usage, spare + size) if kept else (usage, spare)

            self.update_usage(reserve)
            if kept:
                try:
                    self.spares.move_in(path, size)
                except FileNotFoundError:
                    self.add_usage(0, -size)
                    return False
                return True
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        self.add_usage(-size)
        return True

    def make_room(self, size: int, namespaces: Collection[str] = ()) -> bool:
        """The whole-store pass (``CapacityEvictor.full_pass``): evict oldest files until ``size`` more bytes
        fit under the low watermark of the effective capacity (``set_effective_capacity``), rewrite ``usage``
        from the files and remove crashed writers' temp files. Without waiting: one process (and one thread)
        at a time. O(N): for operators, tests and benches; the put path runs ``make_room_for_put``.

        ``namespaces``: the directory's namespaces under a quota. With any, the pass reads the header of each
        file it evicts, counts it for its tenant (``SharedLedger.namespace_to_capacity_evicted``; ``OTHER_TENANTS`` for
        the rest) and takes its bytes off its tenant's estimate.

        Returns ``True`` if this call scanned and rewrote ``usage`` (to the bytes on disk now)."""
        if not self._evict_thread_lock.acquire(blocking=False):
            return False  # another thread of this process is evicting (flock does not tell threads apart)
        try:
            fcntl.flock(self._evict_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._evict_thread_lock.release()
            return False  # another process is evicting right now; its pass makes room for us too
        try:
            self.evictor.full_pass(size, namespaces)
            return True
        finally:
            fcntl.flock(self._evict_fd, fcntl.LOCK_UN)
            self._evict_thread_lock.release()

    def make_room_for_put(self, size: int, namespaces: Collection[str] = ()) -> int:
        """The put path's pass (``CapacityEvictor.make_room_for_put``): evicts what the put needs, bounded by
        what it evicts, not by the store's entries; waits for ``evict.lock``; takes off ``usage`` exactly
        what it removed (the put's own bytes stay counted). Returns the files it evicted."""
        return self.evictor.make_room_for_put(size, namespaces)

    def read_usage(self) -> tuple[int, int]:
        """The shared estimates: (bytes under objects/ and spare/, bytes under spare/)."""
        return self.update_usage(lambda usage, spare: (usage, spare))

    def count_evicted(self, num_evicted: int) -> None:
        with self._counters_lock:
            self.num_evicted += num_evicted

    def remove_stale_temp_files(self, now: float) -> None:
        with os.scandir(self._tmp) as entries:
            for entry in entries:
                try:
                    if now - entry.stat().st_mtime > STALE_TMP_S:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    pass
