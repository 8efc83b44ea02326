"""``file:///DIR?capacity=SIZE``: the embedded default backend, safe across processes.

Contract: :class:`FileBackend` is the ``hybridkv.store.framed`` backend of ``file://`` URLs (insert-if-absent
puts, reads that never see a partial or foreign value, eviction under ``capacity`` and under the
directory's quotas, ``hybridkv.store.quotas``) and the I/O path of its calls: it moves each frame between the caller's buffers and one file. The directory's protocol shared
by every process (layout, names, usage accounting, LRU eviction, recycling of files and its locks) is
``hybridkv.store.file.layout``; the deadline on file systems that may hang, ``hybridkv.store.file.deadline``;
the read profile a benchmark may install (production has none), ``hybridkv.store.file.probe``.

The I/O path: a put writes the frame to a temp file under tmp/ (a claimed spare, or a new file) and
publishes it with link(2), which fails if the name exists (first writer wins); a get opens the published
file (locked shared if it is recyclable), reads it whole into the caller's buffers and checks the frame.

Hung file systems: on a file system ``hybridkv.store.file.mounts`` does not know as local every data call
(``exists``, put, get, ``remove``) waits at most ``timeout_ms`` (default ``DEFAULT_HANG_TIMEOUT_MS``;
``?timeout_ms=N`` sets it, also on a local file system); past it it answers ``TIMEOUT`` and goes on as a
late call (see ``hybridkv.store.file.deadline``). Every other file-system call runs under it too, a shard of
the directory per step: ``iter_keys``, ``remove_prefix`` and ``stats`` raise ``StoreError`` past it, and
``tenant_counters`` (read on vLLM's thread) answers the values last read. On a local file system there is no
deadline thread.

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
saves. The figures: docs/performance.md, "The file store's writes".
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import structlog
from hybridkv.store.base import Evictions, Status, StoreLogEvent, StoreStats, find_layer
from hybridkv.store.file.deadline import DeadlineGuard
from hybridkv.store.file.frame_io import read_all, status_of
from hybridkv.store.file.layout import RECYCLE_MIN_SIZE, FileLayout
from hybridkv.store.file.mounts import directory_fstype, may_hang
from hybridkv.store.file.probe import ReadProbe
from hybridkv.store.file.tenants import FileTenants
from hybridkv.store.file.usage import FileSpace, bytes_of_shard, shard_usage
from hybridkv.store.file.writer import FrameWriter
from hybridkv.store.framed import FrameParts, SealHook, VerifyHook
from hybridkv.store.quotas import TenantCounters

log = structlog.get_logger(__name__)

#: The deadline (ms) of each data call on a file system that may hang, when the URL names none: far beyond
#: any healthy NFS round trip, and a bound of hybridkv's own on how long a request waits for this tier.
DEFAULT_HANG_TIMEOUT_MS = 30_000
#: The bytes ``stats`` takes one put to need where the store holds no entry to take a mean size from.
_EMPTY_STORE_PUT_BYTES = 1 << 20


def _no_clock() -> float:
    """The read path's clock when no probe is installed: reads none."""
    return 0.0


class FileBackend:
    """Frames as files under one directory. Thread- and process-safe."""

    def __init__(
        self,
        url: str,
        directory: Path,
        *,
        capacity_bytes: int,
        recycle_min_size: int = RECYCLE_MIN_SIZE,
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
        #: The directory's names, accounting, eviction and spares (``hybridkv.store.file.layout``).
        self.layout = FileLayout(
            url, directory, capacity_bytes=capacity_bytes, recycle_min_size=recycle_min_size
        )
        #: The type of the file system holding ``directory`` (``hybridkv.store.file.mounts``), detected after the
        #: directory exists so that an automount has mounted it.
        self.fstype = directory_fstype(str(directory)) if fstype is None else fstype
        if timeout_ms is None and may_hang(self.fstype):
            timeout_ms = DEFAULT_HANG_TIMEOUT_MS
        #: The deadline of each data call in ms, or ``None``: calls run on the caller's thread.
        self.timeout_ms = timeout_ms
        self._guard = DeadlineGuard(url=url, fstype=self.fstype, timeout_ms=timeout_ms)
        #: This handle's place in the directory's eviction log (``take_evictions``), one reader at a time.
        self._eviction_reader = self.layout.eviction_log.reader()
        self._eviction_reader_lock = threading.Lock()
        self._closed = False
        #: The bench's read profile (:meth:`install_read_probe`); ``None`` in production: nothing timed.
        self.read_probe: ReadProbe | None = None
        #: The directory's quotas, this handle's reservations and its counters per tenant.
        self.tenants = FileTenants(url, directory, self.layout, self._guard)
        #: What the file system holds for the store: the effective capacity eviction holds it to.
        self.space = FileSpace(url, directory, self.layout, capacity_bytes=capacity_bytes)
        #: The put path: claims spares, reserves, makes room, publishes (``hybridkv.store.file.writer``).
        self.writer = FrameWriter(url, self.layout, self.tenants, self.space, capacity_bytes=capacity_bytes)

    @property
    def num_recycled(self) -> int:
        """Spares this handle's puts overwrote instead of writing new files."""
        return self.writer.num_recycled

    @property
    def cannot_write(self) -> bool:
        """Whether this process's last put that met ``ENOSPC`` still failed after evicting (until a put
        publishes)."""
        return self.writer.cannot_write

    def install_read_probe(self, probe: ReadProbe | None) -> None:
        """Time this process's reads into ``probe`` from the next get call on (``None``: stop timing)."""
        self.read_probe = probe

    # -- Backend -----------------------------------------------------------------------------------------

    def answers_late(self, op: str) -> bool:
        """Where calls run under a deadline (a file system that may hang, or ``timeout_ms`` given): a call
        past it answers ``TIMEOUT`` and goes on. Otherwise never: a local file system's call returns."""
        return self._guard.answers_late

    def exists(self, keys: Sequence[str]) -> list[Status]:
        key_list = list(keys)  # the call may outlive this frame: it must not see the caller change them
        return self._guard.run("exists", len(key_list), lambda: self._exists(key_list))

    def _exists(self, keys: Sequence[str]) -> list[Status]:
        layout = self.layout
        results: list[Status] = []
        now = time.time()
        for key in keys:
            path = layout.path_of(key)
            try:
                info = os.stat(path)
            except FileNotFoundError:
                results.append(Status.NOT_FOUND)
                continue
            except OSError as error:
                results.append(self._status_of(error, "exists", key))
                continue
            layout.touch(path, None, info.st_mtime, now)
            results.append(Status.OK)
        return results

    def retain(self, keys: Sequence[str], until: float) -> list[Status]:
        """Retain each stored key until ``until`` (``hybridkv.store.retention``): its file's mtime is set to
        ``until``, so eviction, which takes oldest mtimes first, reaches it after every ordinary file, the
        one expiring first first, in every process sharing the directory (``FileLayout.retain``). ``until``
        in the past releases it (mtime now). ``OK``, or ``NOT_FOUND`` when it is not stored."""
        key_list = list(keys)
        return self._guard.run("exists", len(key_list), lambda: self._retain(key_list, until))

    def _retain(self, keys: Sequence[str], until: float) -> list[Status]:
        layout = self.layout
        results: list[Status] = []
        for key in keys:
            try:
                layout.retain(layout.path_of(key), until)
            except FileNotFoundError:
                results.append(Status.NOT_FOUND)
                continue
            except OSError as error:
                results.append(self._status_of(error, "retain", key))
                continue
            results.append(Status.OK)
        return results

    def put_frames(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        return self.put_frames_sealed(keys, frames, None)

    def put_frames_sealed(
        self, keys: Sequence[str], frames: Sequence[FrameParts], seal: SealHook | None
    ) -> list[Status]:
        """``put_frames``, sealing each frame (computing its checksum) right before writing it."""
        key_list, frame_list = list(keys), list(frames)
        return self._guard.run("put", len(key_list), lambda: self.writer.put(key_list, frame_list, seal))

    def get_frames_into(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        return self.get_frames_verified(keys, frames, None)

    def get_frames_verified(
        self, keys: Sequence[str], frames: Sequence[FrameParts], verify: VerifyHook | None
    ) -> list[Status]:
        """``get_frames_into``, verifying each frame right after reading it (while its bytes are cached)."""
        key_list, frame_list = list(keys), list(frames)
        return self._guard.run(
            "get", len(key_list), lambda: self._get_frames_verified(key_list, frame_list, verify)
        )

    def _get_frames_verified(
        self, keys: Sequence[str], frames: Sequence[FrameParts], verify: VerifyHook | None
    ) -> list[Status]:
        layout = self.layout
        results: list[Status] = []
        now = time.time()
        probe = self.read_probe
        clock = _no_clock if probe is None else time.perf_counter
        cpu_clock = _no_clock if probe is None else time.thread_time
        open_s = read_s = verify_s = close_s = read_cpu_s = verify_cpu_s = 0.0
        for index, (key, frame) in enumerate(zip(keys, frames, strict=True)):
            started = clock()
            path = layout.path_of(key)
            try:
                opened = layout.open_published(path)
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
            opened_cpu = read_cpu = verified_cpu = cpu_clock()
            try:
                expected = sum(part.nbytes for part in frame)
                if info.st_size != expected:
                    results.append(Status.CORRUPT)
                    log.warning(
                        StoreLogEvent.FILE_SIZE_MISMATCH, key=key, size=info.st_size, expected=expected
                    )
                    continue
                num_read = read_all(fd, frame, expected)
                read_at, read_cpu = clock(), cpu_clock()
                intact = num_read == expected and (verify is None or verify(index))
                verified_at, verified_cpu = clock(), cpu_clock()
                if not intact:
                    results.append(Status.CORRUPT)
                    continue
                layout.touch(path, fd, info.st_mtime, now)
                results.append(Status.OK)
            except OSError as error:
                results.append(self._status_of(error, "get", key))
            finally:
                os.close(fd)
                read_s += read_at - opened_at
                verify_s += verified_at - read_at
                close_s += clock() - verified_at
                read_cpu_s += read_cpu - opened_cpu
                verify_cpu_s += verified_cpu - read_cpu
        if probe is not None:
            probe.add_reads(
                len(keys),
                open_s=open_s,
                read_s=read_s,
                verify_s=verify_s,
                close_s=close_s,
                read_cpu_s=read_cpu_s,
                verify_cpu_s=verify_cpu_s,
            )
        return results

    def remove(self, keys: Sequence[str]) -> list[Status]:
        key_list = list(keys)
        return self._guard.run("remove", len(key_list), lambda: self._remove(key_list))

    def _remove(self, keys: Sequence[str]) -> list[Status]:
        results: list[Status] = []
        for key in keys:
            path = self.layout.path_of(key)
            try:
                size = os.stat(path).st_size
                removed = self.layout.retire(path, size)
            except FileNotFoundError:
                removed = False
            except OSError as error:
                results.append(self._status_of(error, "remove", key))
                continue
            if removed:
                self.tenants.forget_bytes(key, size)
            results.append(Status.OK if removed else Status.NOT_FOUND)
        return results

    def take_evictions(self) -> Evictions:
        """The keys any process sharing the directory evicted since this handle was opened or last asked
        (``hybridkv.store.base.EvictionReporter``), read from the directory's eviction log
        (``hybridkv.store.file.eviction_log``) under the deadline: past it, or unreadable, an incomplete report
        (the read goes on; what it takes is lost, so this report already says so)."""
        taken: list[Evictions] = []

        def take() -> list[Status]:
            with self._eviction_reader_lock:
                taken.append(self._eviction_reader.take())
            return [Status.OK]

        if self._guard.run("take_evictions", 1, take)[0] is not Status.OK:
            return Evictions(complete=False)
        return taken[0]

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        """The stored keys starting with ``prefix``, listed a shard at a time; each step (the shard list, one
        shard's headers) runs under the deadline (``StoreError`` past it: see "Hung file systems")."""
        layout = self.layout
        for shard in self._guard.call("iter_keys", layout.object_shards):
            for _path, listed_key in self._guard.call(
                "iter_keys", functools.partial(layout.keyed_paths_in, shard)
            ):
                if listed_key is not None and listed_key.startswith(prefix):
                    yield listed_key

    def remove_prefix(self, prefix: str) -> int:
        """Remove the keys starting with ``prefix``, plus any file whose header is unreadable: its key is
        unknown and every read of it would be ``CORRUPT``, so it is garbage under every prefix (not counted).

        A shard at a time, each step under the deadline: on a hung file system it raises ``StoreError``
        within ``timeout_ms`` (a reset's removal fails instead of never returning); the step in flight goes on
        in the background, and the shards already done stay removed."""
        num_removed = 0
        for shard in self._guard.call("remove_prefix", self.layout.object_shards):
            num_removed += self._guard.call(
                "remove_prefix", functools.partial(self._remove_prefix_in, shard, prefix)
            )
        return num_removed

    def _remove_prefix_in(self, shard: str, prefix: str) -> int:
        num_removed = 0
        for path, key in self.layout.keyed_paths_in(shard, include_unreadable=True):
            if key is None:
                self._unlink_accounted(path, None)
            elif key.startswith(prefix) and self._unlink_accounted(path, key):
                num_removed += 1
        return num_removed

    def _unlink_accounted(self, path: Path, key: str | None) -> bool:
        """Retire ``path`` (unlink or keep as a spare) with accounting; ``False`` if it was already gone."""
        try:
            size = path.stat().st_size
            removed = self.layout.retire(str(path), size)
        except FileNotFoundError:
            return False
        if removed and key is not None:
            self.tenants.forget_bytes(key, size)
        return removed

    def stats(self) -> StoreStats:
        """The exact bytes and keys (read from the files), the shared estimates and this process's counters.
        ``extra`` also holds the file system's ``free_bytes``, the ``effective_capacity_bytes`` eviction holds
        the store to (``FileSpace.effective_capacity``, re-read now) and ``cannot_write``: this process's last put met
        ``ENOSPC`` even after evicting, or the free bytes and the store's own bytes (what eviction could free)
        each stay below one entry of the store's mean size (1 MiB when it holds none).
        A shard at a time, each step under the deadline (``StoreError`` past it)."""
        layout = self.layout
        guard = self._guard
        quotas = guard.call("stats", self.tenants.current)
        num_keys = 0
        num_bytes = 0
        namespace_to_bytes = dict.fromkeys(quotas, 0)
        for shard in guard.call("stats", layout.object_shards):
            shard_keys, shard_bytes, shard_tenants = guard.call(
                "stats", functools.partial(shard_usage, layout, shard, quotas)
            )
            num_keys += shard_keys
            num_bytes += shard_bytes
            for namespace, namespace_bytes in shard_tenants.items():
                namespace_to_bytes[namespace] += namespace_bytes
        num_spare_bytes = 0
        for shard in guard.call("stats", layout.spare_shards):
            num_spare_bytes += guard.call("stats", functools.partial(bytes_of_shard, shard))
        usage_estimate, spare_estimate = guard.call(
            "stats", lambda: layout.update_usage(lambda usage, spare: (usage, spare))
        )
        tenants = self.tenants.stats(quotas, namespace_to_bytes)
        effective = guard.call("stats", lambda: self.space.effective_capacity(force=True))
        put_bytes = num_bytes // num_keys if num_keys else _EMPTY_STORE_PUT_BYTES
        free = self.space.free_bytes
        # Nothing can be written when neither the free space nor what eviction could free holds one entry
        # (any process's view), or this process's last put met ENOSPC even after evicting.
        cannot_write = self.cannot_write or (
            free is not None and free < put_bytes and num_bytes + num_spare_bytes < put_bytes
        )
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
                "num_evicted_by_this_process": layout.num_evicted,
                "num_recycled_by_this_process": self.num_recycled,
                "fstype": self.fstype,
                "timeout_ms": self.timeout_ms,
                "num_abandoned_calls": self._guard.num_abandoned,
                "effective_capacity_bytes": effective,
                "free_bytes": free,
                "cannot_write": cannot_write,
                **({"tenants": tenants} if tenants else {}),
            },
        )

    def tenant_counters(self) -> dict[str, TenantCounters]:
        """The tenants' counters without reading the files (``FileTenants.tenant_counters``)."""
        return self.tenants.tenant_counters()

    def close(self) -> None:
        """Close the descriptors -- unless a call on the deadline runner has not returned (one past its
        deadline, on a hung file system): it may still lock and write them, and once closed the kernel hands
        their numbers to the next files opened, which it would then write. They are then left open (the
        process's exit closes them)."""
        if self._closed:
            return
        self._closed = True
        if self._guard.shutdown():
            self.layout.close()

    def _status_of(self, error: OSError, op: str, key: str) -> Status:
        return status_of(error, op, key, url=self.url)


def effective_capacity_of(store: object) -> int | None:
    """The effective capacity (``FileSpace.effective_capacity_bytes``: as last derived on the put path, no
    file-system call) of ``store``'s file backend (``store`` a ``Store``, its backend or a wrapper of
    either); None for a store of another kind."""
    backend = find_layer(store, FileBackend)
    return None if backend is None else backend.space.effective_capacity_bytes
