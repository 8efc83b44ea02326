"""``file:///DIR?capacity=SIZE``: the embedded default backend, safe across processes.

Layout under DIR (created ``0700``)::

    objects/ab/ab12...ef.kv   one frame per key; the name is the hex blake2b-128 of the key (never the raw
                              key), the real key lives inside the frame header so listing still works
    tmp/                      frames being written; published with link(2), which fails if the name exists,
                              so publication is atomic *and* insert-if-absent across processes
    spare/SIZE/*.kv           removed or evicted files kept for reuse, by page-rounded size (see Recycling)
    usage                     two 8-byte little-endian estimates (shared, flock'ed): the bytes under objects/
                              and spare/ together, and the bytes under spare/
    evict.lock                held (non-blocking) by the one process currently evicting

Readers open a published file and read it whole; a concurrent eviction or removal moves or unlinks the name
but not the open inode, so a reader never sees a partial value.

Recycling: a put into a new tmpfs file faults in and zeroes a fresh page per 4 KiB, which costs more than
the copy itself; overwriting a file whose pages are already there runs about twice as fast (see Speed). So
a removed or evicted file of ``_RECYCLE_MIN_SIZE`` or more is renamed into ``spare/SIZE/`` instead of being
unlinked (while the spares stay within ``_SPARE_FRACTION`` of capacity; they count toward capacity), and a
put of a frame of the same page-rounded size claims one by renaming it into ``tmp/`` (atomic across
processes), overwrites it in place and publishes it with link(2) like a new file. The claimer touches the
spare just before that rename: a spare keeps its mtime from its previous life, and an old mtime in ``tmp/``
is how eviction scans recognize a crashed writer's temp file, so without the touch another process's scan
could delete a claimed spare mid-put. A reader that opened the file under its old name must never see the
new bytes, so for recyclable files:

- the writer holds ``flock(LOCK_EX)`` on the inode while it overwrites it, and gives up the spare (writing
  a new file instead) if it cannot get the lock at once;
- the reader takes ``flock(LOCK_SH)`` (non-blocking: if a writer holds the inode, the value is gone:
  ``NOT_FOUND``) and then checks that its key's name still links to the inode it opened. While the reader
  holds the shared lock no writer can claim the inode; if the inode was recycled before the reader locked
  it, the name check fails (a name only ever links to frames of its own key) and the reader answers
  ``NOT_FOUND``.

LRU across processes: a file's mtime is its last use. Reads and ``exists`` touch it (at most once a second
per file, to keep hits cheap). Accounting: every put adds its size to ``usage`` and every remove subtracts
it, under an flock; when a put would exceed ``capacity`` the putter takes ``evict.lock``, scans the
objects, deletes oldest-mtime first down to 90 % of capacity, and rewrites ``usage`` with the real total
(correcting drift from crashed writers). The bound is approximate only by the values in flight at once.
No fsync: this is a cache. A frame torn by a power loss fails its frame check and reads as ``CORRUPT``.

Hung file systems: on a network or FUSE file system (NFS, CIFS, 9p, Ceph, sshfs, ...; anything
``hybridkv.store.mounts`` does not know as local) a read or write blocks as long as the server or daemon
does not answer, with a ``hard`` NFS mount forever -- and ``$XDG_CACHE_HOME``, where the default store lives,
is often on NFS. There every data call (``exists``, put, get, ``remove``) runs on a ``DeadlineRunner`` and
waits at most ``timeout_ms`` (default ``DEFAULT_HANG_TIMEOUT_MS``; ``?timeout_ms=N`` sets it, also on a local
file system). A call past it answers ``TIMEOUT`` for all its keys and goes on in the runner's thread, exactly
like an abandoned Mooncake call: it registers its completion handle
(``hybridkv.store.base.register_late_call``) and ``answers_late`` is ``True``, so the worker never hands such
a call KV pages. On a local file system there is no deadline thread (a call returns; zero copies) and
``answers_late`` is ``False``. Opening the store (creating its directories) is not bounded.

Speed (``hybridkv bench store``, /dev/shm): values move with one ``pwritev``/``readv`` straight from/to the
caller's buffers. A put writes the payload first, seals the frame (computes its checksum) right after, while
the payload is still in cache, and writes the header last; a get verifies each frame right after reading it
(``JustInTimeBackend``). What bounds a put of a large value is the page cache, not the code around it: on a
tmpfs with 4 KiB pages (``huge=never``, the default for /dev/shm) every 4 KiB written costs a page lookup,
lock and dirtying on top of the copy, so merely overwriting a recycled file's pages (the bench's
``page_write_ratio``) stays well below memcpy, and a new file also has each page allocated and zeroed. On a
tmpfs mounted ``huge=within_size`` (or ``always``) a recycled file's pages are 2 MiB and the same put runs
markedly faster: mount the store's directory that way where the filesystem allows it. Pre-faulting spares
would not lift the 4 KiB case: a recycled file's pages already exist, the cost is the write path's per page,
and writing through a fresh ``mmap`` instead spends about as much on setting up page-table entries as it
saves. The figures: docs/performance.md, "The file store's writes". Values below
``_RECYCLE_MIN_SIZE`` are not recycled: their put is bounded by the ~10 path syscalls per file, not by page
faults.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import overload

import structlog
from hybridkv.store.base import Status, StoreError, StoreLogEvent, StoreStats, register_late_call
from hybridkv.store.breaker import DeadlineExceeded, DeadlineRunner
from hybridkv.store.frame import FIXED_HEADER_SIZE, key_digest, key_from_header
from hybridkv.store.framed import FrameParts, SealHook, VerifyHook
from hybridkv.store.mounts import directory_fstype, may_hang

log = structlog.get_logger(__name__)

_SUFFIX = ".kv"
#: Evict down to this fraction of capacity, so eviction scans run once per 10 % of capacity written.
_LOW_WATERMARK = 0.9
#: Reads refresh a file's mtime only when it is older than this (seconds): LRU resolution vs. syscalls.
_TOUCH_INTERVAL_S = 1.0
#: Temporary files unmodified for this long (seconds) belong to a crashed writer and are removed by eviction
#: scans. A put modifies its temp file when it creates it or claims it (a claimed spare is touched before it
#: enters tmp/) and on every write, so a live put's file is never this old unless the put stalls this long.
_STALE_TMP_S = 600.0
_IOV_MAX = 1024
_PAGE = mmap.PAGESIZE
#: Files at least this big (page-rounded) are recycled: below it, path syscalls cost more than page faults.
_RECYCLE_MIN_SIZE = 256 << 10
#: Spare files are kept while they hold at most this fraction of capacity (the eviction hysteresis band).
_SPARE_FRACTION = 1.0 - _LOW_WATERMARK
_temp_counter = itertools.count()
#: The deadline (ms) of each data call on a file system that may hang, when the URL names none: far beyond
#: any healthy NFS round trip, and a bound of hybridkv's own on how long a request waits for this tier.
DEFAULT_HANG_TIMEOUT_MS = 30_000
#: The keys of :attr:`FileBackend.read_timings`.
READ_PHASES = ("keys", "open_s", "read_s", "verify_s", "close_s")


def _size_class(size: int) -> int:
    """The page-rounded size spares are matched on: overwriting a file within its last page needs no new
    page, and truncating it there frees none."""
    return -(-size // _PAGE) * _PAGE


class FileBackend:
    """Frames as files under one directory. Thread- and process-safe."""

    def __init__(
        self,
        url: str,
        directory: Path,
        *,
        capacity_bytes: int,
        recycle_min_size: int = _RECYCLE_MIN_SIZE,
        timeout_ms: int | None = None,
        fstype: str | None = None,
    ) -> None:
        """``timeout_ms``: the deadline of each data call (see "Hung file systems"); ``None``:
        ``DEFAULT_HANG_TIMEOUT_MS`` where ``directory``'s file system may hang, none on a local one.
        ``fstype``: the file system type to assume instead of detecting it (tests).

        ``recycle_min_size`` is for tests (recycling small files); every process sharing ``directory``
        must use the same value, because readers lock exactly the files writers may recycle."""
        assert timeout_ms is None or timeout_ms > 0, f"file timeout_ms must be > 0, got {timeout_ms}"
        self.url = url
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.recycle_min_size = max(1, recycle_min_size)
        self.spare_budget_bytes = int(capacity_bytes * _SPARE_FRACTION)
        self._objects = directory / "objects"
        self._tmp = directory / "tmp"
        self._spare = directory / "spare"
        self._objects_str = str(self._objects)
        self._tmp_str = str(self._tmp)
        self._spare_str = str(self._spare)
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
        except OSError as error:
            raise StoreError(
                f"file store {url!r}: cannot use directory {str(directory)!r}: {error}"
            ) from None
        #: The type of the file system holding ``directory`` (``hybridkv.store.mounts``), detected after the
        #: directory exists so that an automount has mounted it.
        self.fstype = directory_fstype(str(directory)) if fstype is None else fstype
        if timeout_ms is None and may_hang(self.fstype):
            timeout_ms = DEFAULT_HANG_TIMEOUT_MS
        #: The deadline of each data call in ms, or ``None``: calls run on the caller's thread.
        self.timeout_ms = timeout_ms
        self._runner = None if timeout_ms is None else DeadlineRunner(name="hybridkv-file")
        #: Calls handed to the runner that have not returned yet, queued ones included (see ``close``).
        self._num_runner_calls = 0
        self._runner_lock = threading.Lock()
        # flock is per open file description, so threads of this process also need a lock of their own.
        self._usage_lock = threading.Lock()
        self._closed = False
        self.num_evicted = 0
        self.num_recycled = 0
        #: Where this process's reads spend their time (seconds summed over keys; for profiles): ``keys``;
        #: ``open_s`` open + lock + the name check; ``read_s`` the readv into the caller's buffers;
        #: ``verify_s`` the frame check; ``close_s`` the mtime touch and close.
        self.read_timings: dict[str, float] = dict.fromkeys(READ_PHASES, 0.0)

    # -- paths -------------------------------------------------------------------------------------------

    def path_of(self, key: str) -> str:
        """The file that holds ``key``'s frame (whether or not it exists); for inspection and fault tests.
        A str, not a Path: this is on every call's hot path."""
        digest = key_digest(key).hex()
        return f"{self._objects_str}/{digest[:2]}/{digest}{_SUFFIX}"

    def _temp_path(self) -> str:
        return f"{self._tmp_str}/{os.getpid()}-{threading.get_ident()}-{next(_temp_counter)}.tmp"

    def _is_recyclable(self, size: int) -> bool:
        """Whether a file of ``size`` bytes may be recycled (readers lock exactly these)."""
        return _size_class(size) >= self.recycle_min_size

    def _iter_object_paths(self) -> Iterator[Path]:
        yield from self._iter_sharded(self._objects)

    def _iter_spare_paths(self) -> Iterator[Path]:
        yield from self._iter_sharded(self._spare)

    @staticmethod
    def _iter_sharded(root: Path) -> Iterator[Path]:
        try:
            with os.scandir(root) as shards:
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

    def _update_usage(self, update: Callable[[int, int], tuple[int, int]]) -> tuple[int, int]:
        """Apply ``update(usage, spare) -> (usage, spare)`` to the shared estimates under the lock, where
        ``usage`` counts the bytes under objects/ and spare/ and ``spare`` those under spare/; returns the
        new pair."""
        with self._usage_lock:
            fcntl.flock(self._usage_fd, fcntl.LOCK_EX)
            try:
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
            finally:
                fcntl.flock(self._usage_fd, fcntl.LOCK_UN)

    def _add_usage(self, delta: int, spare_delta: int = 0) -> int:
        """Add ``delta`` to the usage estimate (and ``spare_delta`` to the spare estimate); returns the usage."""
        return self._update_usage(lambda usage, spare: (usage + delta, spare + spare_delta))[0]

    def _set_usage(self, usage: int, spare: int) -> None:
        self._update_usage(lambda _usage, _spare: (usage, spare))

    def _retire(self, path: str, size: int) -> bool:
        """Take the published file ``path`` (``size`` bytes) out of the store: keep it as a spare when it is
        recyclable and the spares have room, else unlink it. Accounts for it; ``False`` if it was gone."""
        if self._is_recyclable(size):
            kept = False

            def reserve(usage: int, spare: int) -> tuple[int, int]:
                nonlocal kept
                kept = spare + size <= self.spare_budget_bytes
                return (usage, spare + size) if kept else (usage, spare)

            self._update_usage(reserve)
            if kept:
                try:
                    self._move_to_spare(path, size)
                except FileNotFoundError:
                    self._add_usage(0, -size)
                    return False
                return True
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        self._add_usage(-size)
        return True

    def _move_to_spare(self, path: str, size: int) -> None:
        """Rename ``path`` into its size class under spare/ (no accounting)."""
        shard = f"{self._spare_str}/{_size_class(size)}"
        spare = f"{shard}/{os.getpid()}-{threading.get_ident()}-{next(_temp_counter)}{_SUFFIX}"
        try:
            os.rename(path, spare)
        except FileNotFoundError:
            if not os.path.exists(path):
                raise
            os.makedirs(shard, mode=0o700, exist_ok=True)
            os.rename(path, spare)

    def _claim_spares(self, sizes: Sequence[int | None]) -> list[tuple[str, int] | None]:
        """For each frame size (``None``: no frame), claim a spare of its size class by renaming it into
        tmp/: ``(temp path, spare size)``, or ``None`` if none is left. The caller owns the claimed files."""
        claims: list[tuple[str, int] | None] = [None] * len(sizes)
        class_to_candidates: dict[int, list[str]] = {}
        for index, size in enumerate(sizes):
            if size is None or not self._is_recyclable(size):
                continue
            size_class = _size_class(size)
            candidates = class_to_candidates.get(size_class)
            if candidates is None:
                try:
                    with os.scandir(f"{self._spare_str}/{size_class}") as entries:
                        candidates = [entry.path for entry in entries if entry.name.endswith(_SUFFIX)]
                except FileNotFoundError:
                    candidates = []
                class_to_candidates[size_class] = candidates
            while candidates:
                spare = candidates.pop()
                temp = self._temp_path()
                try:
                    # Touch first, rename second: the file appears in tmp/ already fresh, so no process's
                    # sweep (which deletes temp files unmodified for _STALE_TMP_S) can take it for a crashed
                    # writer's, however long it sat in spare/. Touching after the rename would leave a window
                    # in which a sweep sees the old mtime and unlinks the file mid-put.
                    os.utime(spare)
                    os.rename(spare, temp)  # atomic: of several claimers exactly one succeeds
                    spare_size = os.stat(temp).st_size
                except FileNotFoundError:
                    continue  # another process claimed it first
                claims[index] = (temp, spare_size)
                break
        return claims

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
            spares: list[tuple[float, int, Path]] = []
            for path in self._iter_spare_paths():
                try:
                    info = path.stat()
                except FileNotFoundError:
                    continue
                spares.append((info.st_mtime, info.st_size, path))
            spare_total = sum(size_ for _mtime, size_, _path in spares)
            total = sum(size_ for _mtime, size_, _path in entries) + spare_total
            # Spares count toward capacity: evicting a file into spare/ frees nothing, so the pass goes on to
            # older files until objects + spares fit under the watermark (spares stay within their budget).
            target = int(self.capacity_bytes * _LOW_WATERMARK) - size
            entries.sort(key=lambda entry: entry[0])
            num_evicted = 0
            for _mtime, file_size, path in entries:
                if total <= target:
                    break
                if self._is_recyclable(file_size) and spare_total + file_size <= self.spare_budget_bytes:
                    try:
                        self._move_to_spare(str(path), file_size)
                        spare_total += file_size
                    except FileNotFoundError:
                        total -= file_size
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    total -= file_size
                num_evicted += 1
            spares.sort(key=lambda entry: entry[0])
            for _mtime, file_size, path in spares:  # only when objects alone do not fit: drop spares too
                if total <= target:
                    break
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                total -= file_size
                spare_total -= file_size
            self._set_usage(total, spare_total)
            self.num_evicted += num_evicted
            self._remove_stale_temp_files(now)
            log.debug(StoreLogEvent.FILE_EVICTED, url=self.url, num_evicted=num_evicted, num_bytes=total)
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

    # -- deadline --------------------------------------------------------------------------------------

    def _guarded(self, op: str, num_keys: int, call: Callable[[], list[Status]]) -> list[Status]:
        """``call()``, under the deadline when there is one: past it, ``TIMEOUT`` for every key, and the
        call (still running, still using the caller's buffers) registered as late."""
        runner, timeout_ms = self._runner, self.timeout_ms
        if runner is None or timeout_ms is None:
            return call()

        def counted() -> list[Status]:
            try:
                return call()
            finally:
                with self._runner_lock:
                    self._num_runner_calls -= 1

        with self._runner_lock:
            self._num_runner_calls += 1
        try:
            return runner.run(counted, timeout_ms / 1000.0)
        except DeadlineExceeded as late:
            register_late_call(late.done)  # the call still owns the caller's buffers until it returns
            log.warning(
                StoreLogEvent.FILE_DEADLINE,
                url=self.url,
                op=op,
                num_keys=num_keys,
                timeout_ms=timeout_ms,
                fstype=self.fstype,
            )
            return [Status.TIMEOUT] * num_keys

    # -- Backend -----------------------------------------------------------------------------------------

    def answers_late(self, op: str) -> bool:
        """Where calls run under a deadline (a file system that may hang, or ``timeout_ms`` given): a call
        past it answers ``TIMEOUT`` and goes on. Otherwise never: a local file system's call returns."""
        return self._runner is not None

    def exists(self, keys: Sequence[str]) -> list[Status]:
        key_list = list(keys)  # the call may outlive this frame: it must not see the caller change them
        return self._guarded("exists", len(key_list), lambda: self._exists(key_list))

    def _exists(self, keys: Sequence[str]) -> list[Status]:
        results: list[Status] = []
        now = time.time()
        for key in keys:
            path = self.path_of(key)
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
        key_list, frame_list = list(keys), list(frames)
        return self._guarded(
            "put", len(key_list), lambda: self._put_frames_sealed(key_list, frame_list, seal)
        )

    def _put_frames_sealed(
        self, keys: Sequence[str], frames: Sequence[FrameParts], seal: SealHook | None
    ) -> list[Status]:
        results: list[Status] = []
        paths: list[str | None] = []
        sizes = [sum(part.nbytes for part in frame) for frame in frames]
        num_new_bytes = 0
        for key, size in zip(keys, sizes, strict=True):
            path = self.path_of(key)
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
        # Claim spares first: their bytes are already counted, so only the rest is new. Reserve the new
        # bytes up front (one locked update), make room if that overflows, and give back what was not
        # published.
        claims = self._claim_spares([size if path else None for size, path in zip(sizes, paths, strict=True)])
        num_claimed = sum(claim is not None for claim in claims)
        num_spare_bytes = sum(claim[1] for claim in claims if claim is not None)
        num_claimed_frame_bytes = sum(
            size for size, claim in zip(sizes, claims, strict=True) if claim is not None
        )
        num_unclaimed_bytes = num_new_bytes - num_claimed_frame_bytes
        usage = self._add_usage(num_new_bytes - num_spare_bytes, -num_spare_bytes)
        if num_unclaimed_bytes and usage > self.capacity_bytes and self._make_room(num_unclaimed_bytes):
            self._add_usage(num_new_bytes)  # the eviction pass rewrote usage without this batch
        num_unpublished_bytes = 0
        for index, (key, frame, new_path) in enumerate(zip(keys, frames, paths, strict=True)):
            if new_path is None:
                continue
            claim = claims[index]
            results[index], published = self._publish(
                key, frame, new_path, None if claim is None else claim[0], seal, index
            )
            if not published:
                num_unpublished_bytes += sizes[index]
        if num_unpublished_bytes:
            self._add_usage(-num_unpublished_bytes)
        if num_claimed:
            with self._usage_lock:
                self.num_recycled += num_claimed
        return results

    def _publish(
        self, key: str, frame: FrameParts, path: str, spare: str | None, seal: SealHook | None, index: int
    ) -> tuple[Status, bool]:
        """Write ``frame`` to a temp file (the claimed ``spare`` in tmp/ if given, else a new one) and link it
        to ``path``: (status, whether this call published). The temp file is gone afterwards.

        The payload parts are written first and the header part last, right after ``seal(index)`` (if given)
        has filled it: the checksum then reads payload bytes the write has just pulled into the CPU cache
        instead of fetching them from memory once more (see Speed), and the file holds the whole sealed frame
        before it is linked."""
        header = frame[0]
        size = sum(part.nbytes for part in frame)
        temp = self._temp_path() if spare is None else spare
        try:
            fd = self._open_spare(spare, size) if spare is not None else None
            if fd is None:  # no spare, or a reader of its previous life still holds it: a new file
                temp = self._temp_path()
                if spare is not None:
                    os.unlink(spare)
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    # The final size first: a tmpfs mounted huge=within_size backs a file with large pages
                    # only inside its size (some kernels look only at the size, not at where a write will end).
                    os.ftruncate(fd, size)
                except OSError:
                    os.close(fd)
                    raise
            try:
                _write_all(fd, frame[1:], header.nbytes)
                if seal is not None:
                    seal(index)
                _write_all(fd, [header], 0)
            finally:
                # Unlocks a recycled inode. Safe before the link: its bytes are final now, and a reader of
                # its previous life that locks it from here on finds its old name no longer links to it.
                os.close(fd)
            try:
                _link_creating_shard(temp, path)
            except FileExistsError:
                return Status.OK, False  # another writer published first: first writer wins
            else:
                return Status.OK, True
        except OSError as error:
            return self._status_of(error, "put", key), False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)

    def _open_spare(self, temp: str, size: int) -> int | None:
        """Open the claimed spare ``temp`` for overwriting with a ``size``-byte frame, holding its exclusive
        lock; ``None`` if a reader that opened it under its old name still holds it (see Recycling)."""
        fd = os.open(temp, os.O_WRONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # within the size class: no page allocated or freed but the tail's
        except OSError:
            os.close(fd)
            raise
        return fd

    def _open_published(self, path: str) -> tuple[int, os.stat_result] | None:
        """Open the published file ``path`` for reading: ``(fd, its stat)``, or ``None`` if it is gone.

        A recyclable file is returned locked shared (until the fd is closed) and only if ``path`` still
        links to it, so its bytes are the frame published under ``path`` (see Recycling)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            info = os.fstat(fd)
            if self._is_recyclable(info.st_size):
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    return None  # a writer is recycling this inode: the value it held is gone
                info = os.fstat(fd)
                try:
                    named = os.stat(path)
                except FileNotFoundError:
                    named = None
                if named is None or (named.st_ino, named.st_dev) != (info.st_ino, info.st_dev):
                    os.close(fd)
                    return None  # removed (and maybe recycled) between our open and our lock
        except BaseException:
            os.close(fd)
            raise
        return fd, info

    def get_frames_into(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        return self.get_frames_verified(keys, frames, None)

    def get_frames_verified(
        self, keys: Sequence[str], frames: Sequence[FrameParts], verify: VerifyHook | None
    ) -> list[Status]:
        """``get_frames_into``, verifying each frame right after reading it (while its bytes are cached)."""
        key_list, frame_list = list(keys), list(frames)
        return self._guarded(
            "get", len(key_list), lambda: self._get_frames_verified(key_list, frame_list, verify)
        )

    def _get_frames_verified(
        self, keys: Sequence[str], frames: Sequence[FrameParts], verify: VerifyHook | None
    ) -> list[Status]:
        results: list[Status] = []
        now = time.time()
        clock = time.perf_counter
        open_s = read_s = verify_s = close_s = 0.0
        for index, (key, frame) in enumerate(zip(keys, frames, strict=True)):
            started = clock()
            path = self.path_of(key)
            try:
                opened = self._open_published(path)
            except OSError as error:
                results.append(self._status_of(error, "get", key))
                continue
            finally:
                opened_at = clock()
                open_s += opened_at - started
            if opened is None:
                results.append(Status.NOT_FOUND)
                continue
            fd, info = opened
            read_at = verified_at = opened_at
            try:
                expected = sum(part.nbytes for part in frame)
                if info.st_size != expected:
                    results.append(Status.CORRUPT)
                    log.warning(
                        StoreLogEvent.FILE_SIZE_MISMATCH, key=key, size=info.st_size, expected=expected
                    )
                    continue
                num_read = _read_all(fd, frame)
                read_at = clock()
                intact = num_read == expected and (verify is None or verify(index))
                verified_at = clock()
                if not intact:
                    results.append(Status.CORRUPT)
                    continue
                self._touch(path, fd, info.st_mtime, now)
                results.append(Status.OK)
            except OSError as error:
                results.append(self._status_of(error, "get", key))
            finally:
                os.close(fd)
                read_s += read_at - opened_at
                verify_s += verified_at - read_at
                close_s += clock() - verified_at
        with self._usage_lock:
            timings = self.read_timings
            timings["keys"] += len(keys)
            timings["open_s"] += open_s
            timings["read_s"] += read_s
            timings["verify_s"] += verify_s
            timings["close_s"] += close_s
        return results

    def remove(self, keys: Sequence[str]) -> list[Status]:
        key_list = list(keys)
        return self._guarded("remove", len(key_list), lambda: self._remove(key_list))

    def _remove(self, keys: Sequence[str]) -> list[Status]:
        results: list[Status] = []
        for key in keys:
            path = self.path_of(key)
            try:
                removed = self._retire(path, os.stat(path).st_size)
            except FileNotFoundError:
                removed = False
            except OSError as error:
                results.append(self._status_of(error, "remove", key))
                continue
            results.append(Status.OK if removed else Status.NOT_FOUND)
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
            opened = self._open_published(str(path))  # locked: a recycled inode could be mid-rewrite
            if opened is None:
                continue
            fd = opened[0]
            try:
                head = os.pread(fd, FIXED_HEADER_SIZE, 0)
                key_length = int.from_bytes(head[8:12], "little") if len(head) == FIXED_HEADER_SIZE else 0
                head += os.pread(fd, min(key_length, 1 << 16), FIXED_HEADER_SIZE)
            finally:
                os.close(fd)
            key = key_from_header(head)
            if key is not None and self.path_of(key) != str(path):
                key = None  # a frame of another key under this name: unreadable as this key
            if key is None:
                log.warning(StoreLogEvent.FILE_UNREADABLE_HEADER, path=str(path))
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
        """Retire ``path`` (unlink or keep as a spare) with accounting; ``False`` if it was already gone."""
        try:
            return self._retire(str(path), path.stat().st_size)
        except FileNotFoundError:
            return False

    def stats(self) -> StoreStats:
        num_keys = 0
        num_bytes = 0
        for path in self._iter_object_paths():
            try:
                num_bytes += path.stat().st_size
            except FileNotFoundError:
                continue
            num_keys += 1
        num_spare_bytes = 0
        for path in self._iter_spare_paths():
            try:
                num_spare_bytes += path.stat().st_size
            except FileNotFoundError:
                continue
        usage_estimate, spare_estimate = self._update_usage(lambda usage, spare: (usage, spare))
        return StoreStats(
            url=self.url,
            num_keys=num_keys,
            num_bytes=num_bytes,
            capacity_bytes=self.capacity_bytes,
            extra={
                "directory": str(self.directory),
                "usage_estimate_bytes": usage_estimate,
                "spare_bytes": num_spare_bytes,
                "spare_estimate_bytes": spare_estimate,
                "num_evicted_by_this_process": self.num_evicted,
                "num_recycled_by_this_process": self.num_recycled,
                "fstype": self.fstype,
                "timeout_ms": self.timeout_ms,
                "num_abandoned_calls": 0 if self._runner is None else self._runner.num_abandoned,
            },
        )

    def close(self) -> None:
        """Close the descriptors -- unless a call on the deadline runner has not returned (one past its
        deadline, on a hung file system): it may still lock and write them, and once closed the kernel hands
        their numbers to the next files opened, which it would then write. They are then left open (the
        process's exit closes them)."""
        if self._closed:
            return
        self._closed = True
        if self._runner is not None:
            self._runner.shutdown()
        with self._runner_lock:
            if self._num_runner_calls:
                return
        os.close(self._usage_fd)
        os.close(self._evict_fd)

    # -- helpers -----------------------------------------------------------------------------------------

    def _touch(self, path: str, fd: int | None, mtime: float, now: float) -> None:
        if now - mtime < _TOUCH_INTERVAL_S:
            return
        with contextlib.suppress(OSError):  # evicted meanwhile, or read-only mount: LRU order is best effort
            os.utime(fd if fd is not None else path)

    def _status_of(self, error: OSError, op: str, key: str) -> Status:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return Status.NO_SPACE
        log.warning(StoreLogEvent.FILE_IO_ERROR, url=self.url, op=op, key=key, error=str(error))
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


def _write_all(fd: int, parts: Sequence[memoryview], offset: int) -> None:
    """Write ``parts`` back to back into ``fd`` from ``offset`` (the file position is not used)."""
    pending = [part for part in parts if part.nbytes]
    while pending:
        num_written = os.pwritev(fd, pending[:_IOV_MAX], offset)
        offset += num_written
        _advance(pending, num_written)


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
