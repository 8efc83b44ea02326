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

import contextlib
import errno
import functools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import structlog
from hybridkv.key_grammar import namespace_of
from hybridkv.store.base import Evictions, Status, StoreLogEvent, StoreStats, find_layer
from hybridkv.store.file.deadline import DeadlineGuard
from hybridkv.store.file.frame_io import read_all, write_all
from hybridkv.store.file.layout import RECYCLE_MIN_SIZE, FileLayout
from hybridkv.store.file.mounts import directory_fstype, may_hang
from hybridkv.store.file.probe import ReadProbe
from hybridkv.store.file.tenants import FileTenants
from hybridkv.store.file.usage import FileSpace, bytes_of_shard, shard_usage
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
        self._lock = threading.Lock()
        #: This handle's place in the directory's eviction log (``take_evictions``), one reader at a time.
        self._eviction_reader = self.layout.eviction_log.reader()
        self._eviction_reader_lock = threading.Lock()
        self._closed = False
        self.num_recycled = 0
        #: The bench's read profile (:meth:`install_read_probe`); ``None`` in production: nothing timed.
        self.read_probe: ReadProbe | None = None
        #: The directory's quotas, this handle's reservations and its counters per tenant.
        self.tenants = FileTenants(url, directory, self.layout, self._guard)
        #: What the file system holds for the store: the effective capacity eviction holds it to.
        self.space = FileSpace(url, directory, self.layout, capacity_bytes=capacity_bytes)
        #: Whether this process's last put that met ``ENOSPC`` still failed after evicting (cleared by the
        #: next published put): the store cannot write.
        self.cannot_write = False

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
        return self._guard.run(
            "put", len(key_list), lambda: self._put_frames_sealed(key_list, frame_list, seal)
        )

    def _put_frames_sealed(
        self, keys: Sequence[str], frames: Sequence[FrameParts], seal: SealHook | None
    ) -> list[Status]:
        layout = self.layout
        results: list[Status] = []
        paths: list[str | None] = []
        sizes = [sum(part.nbytes for part in frame) for frame in frames]
        num_new_bytes = 0
        for key, size in zip(keys, sizes, strict=True):
            path = layout.path_of(key)
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
        namespace_to_new_bytes, unwritten, reservation = self.tenants.apply_to_put(
            keys, sizes, paths, results
        )
        for index in unwritten:  # refused by its tenant's quota, or evicted by a newer value of the batch
            num_new_bytes -= sizes[index]
            paths[index] = None
        if num_new_bytes == 0:
            if reservation is not None:
                layout.ledger.release(reservation, {})
            return results
        # Claim spares first: their bytes are already counted, so only the rest is new. Reserve the new
        # bytes up front (one locked update), make room if that overflows, and give back what was not
        # published.
        claims = layout.claim_spares(
            [size if path else None for size, path in zip(sizes, paths, strict=True)]
        )
        num_claimed = sum(claim is not None for claim in claims)
        num_spare_bytes = sum(claim[1] for claim in claims if claim is not None)
        num_claimed_frame_bytes = sum(
            size for size, claim in zip(sizes, claims, strict=True) if claim is not None
        )
        num_unclaimed_bytes = num_new_bytes - num_claimed_frame_bytes
        capacity = self.space.effective_capacity(force=False)
        usage = layout.add_usage(num_new_bytes - num_spare_bytes, -num_spare_bytes)
        if (
            num_unclaimed_bytes
            and usage > capacity
            and layout.make_room(num_unclaimed_bytes, self.tenants.quotas)
        ):
            layout.add_usage(num_new_bytes)  # the eviction pass rewrote usage without this batch
        num_unpublished_bytes = 0
        namespace_to_unpublished_bytes: dict[str, int] = {}
        num_unwritten_bytes = num_new_bytes  # counted in usage, not written yet (see _publish_with_room)
        may_make_room = True  # until a retry after evicting met ENOSPC again: the batch's rest is not retried
        for index, (key, frame, new_path) in enumerate(zip(keys, frames, paths, strict=True)):
            if new_path is None:
                continue
            claim = claims[index]
            results[index], published, may_make_room = self._publish_with_room(
                key,
                frame,
                new_path,
                None if claim is None else claim[0],
                seal,
                index,
                num_unwritten_bytes=num_unwritten_bytes if may_make_room else None,
            )
            num_unwritten_bytes -= sizes[index]
            if not published:
                num_unpublished_bytes += sizes[index]
                namespace = namespace_of(key)
                if namespace in namespace_to_new_bytes:
                    namespace_to_unpublished_bytes[namespace] = (
                        namespace_to_unpublished_bytes.get(namespace, 0) + sizes[index]
                    )
        if num_unpublished_bytes:
            layout.add_usage(-num_unpublished_bytes)
        # (A put that raises before this leaves its reservation counted -- high, never low -- until it is
        # stale: hybridkv.store.file.ledger.)
        if reservation is not None:
            layout.ledger.release(reservation, namespace_to_unpublished_bytes)
        if num_claimed:
            with self._lock:
                self.num_recycled += num_claimed
        return results

    def _publish_with_room(
        self,
        key: str,
        frame: FrameParts,
        path: str,
        spare: str | None,
        seal: SealHook | None,
        index: int,
        *,
        num_unwritten_bytes: int | None,
    ) -> tuple[Status, bool, bool]:
        """``_publish``, and where it meets ``ENOSPC``/``EDQUOT`` (a file system full below the capacity) and
        ``num_unwritten_bytes`` is given: re-read the free space (the effective capacity drops to what the
        file system holds), evict to make room as at capacity (least recently used first, retention and
        quotas as usual) and write the frame once more, into a new file. ``num_unwritten_bytes``: the
        batch's bytes counted in ``usage`` but not on disk (this frame's included), added back when the
        eviction pass rewrote ``usage`` to the bytes on disk; ``None``: no retry.

        Returns (status, whether this call published, whether the batch's next frames may still retry):
        not after a retry that met ``ENOSPC`` again, which also marks the store ``cannot_write`` (until a
        put publishes)."""
        status, published = self._publish(key, frame, path, spare, seal, index)
        if status is Status.NO_SPACE and num_unwritten_bytes is not None:
            self.space.effective_capacity(force=True, num_unwritten_bytes=num_unwritten_bytes)
            size = sum(part.nbytes for part in frame)
            if self.layout.make_room(size, self.tenants.quotas):
                self.layout.add_usage(num_unwritten_bytes)
            status, published = self._publish(key, frame, path, None, seal, index)
            if not published and status is Status.NO_SPACE:
                self.cannot_write = True
                return status, published, False
        if published:
            self.cannot_write = False
        return status, published, True

    def _publish(
        self, key: str, frame: FrameParts, path: str, spare: str | None, seal: SealHook | None, index: int
    ) -> tuple[Status, bool]:
        """Write ``frame`` to a temp file (the claimed ``spare`` in tmp/ if given, else a new one) and link it
        to ``path``: (status, whether this call published). The temp file is gone afterwards.

        The payload parts are written first and the header part last, right after ``seal(index)`` (if given)
        has filled it: the checksum then reads payload bytes the write has just pulled into the CPU cache
        instead of fetching them from memory once more (see Speed), and the file holds the whole sealed frame
        before it is linked."""
        layout = self.layout
        header = frame[0]
        size = sum(part.nbytes for part in frame)
        temp = layout.temp_path() if spare is None else spare
        try:
            fd = layout.open_spare(spare, size) if spare is not None else None
            if fd is None:  # no spare, or a reader of its previous life still holds it: a new file
                temp = layout.temp_path()
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
                write_all(fd, frame[1:], header.nbytes)
                if seal is not None:
                    seal(index)
                write_all(fd, [header], 0)
            finally:
                # Unlocks a recycled inode. Safe before the link: its bytes are final now, and a reader of
                # its previous life that locks it from here on finds its old name no longer links to it.
                os.close(fd)
            try:
                layout.link(temp, path)
            except FileExistsError:
                return Status.OK, False  # another writer published first: first writer wins
            else:
                return Status.OK, True
        except OSError as error:
            return self._status_of(error, "put", key), False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)

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
        open_s = read_s = verify_s = close_s = 0.0
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
            try:
                expected = sum(part.nbytes for part in frame)
                if info.st_size != expected:
                    results.append(Status.CORRUPT)
                    log.warning(
                        StoreLogEvent.FILE_SIZE_MISMATCH, key=key, size=info.st_size, expected=expected
                    )
                    continue
                num_read = read_all(fd, frame)
                read_at = clock()
                intact = num_read == expected and (verify is None or verify(index))
                verified_at = clock()
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
        if probe is not None:
            probe.add_reads(len(keys), open_s=open_s, read_s=read_s, verify_s=verify_s, close_s=close_s)
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
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return Status.NO_SPACE
        log.warning(StoreLogEvent.FILE_IO_ERROR, url=self.url, op=op, key=key, error=str(error))
        return Status.TRANSFER_FAILED


def effective_capacity_of(store: object) -> int | None:
    """The effective capacity (``FileSpace.effective_capacity_bytes``: as last derived on the put path, no
    file-system call) of ``store``'s file backend (``store`` a ``Store``, its backend or a wrapper of
    either); None for a store of another kind."""
    backend = find_layer(store, FileBackend)
    return None if backend is None else backend.space.effective_capacity_bytes
