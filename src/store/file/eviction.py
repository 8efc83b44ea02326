"""The file store's capacity eviction: what a put pays is bounded by what it evicts, not by the store's entries.

Why: a store of 10^6 entries scanned every file (a ``stat`` each), sorted them and evicted a tenth of the store
inside the one put that overflowed the capacity: 41 s on ext4 (docs/performance.md, "How the file store's
costs grow with its entries"). Now the put's pass evicts only what the put needs, and a thread of the process
tops the store up to the low watermark in the background.

Contract: :class:`CapacityEvictor` runs one directory's capacity passes for one process:

- ``make_room_for_put`` (the put path, under ``evict.lock``, waiting for it): when the shared usage estimate
  is over the effective capacity, it evicts the oldest candidates until the estimate fits under the low
  watermark, or fits under the capacity once it has evicted ``SYNC_MIN_FILES`` (or the bytes the put needs),
  taking its usage off the estimate file by file (``EvictionPass``). Candidates come from the index (below),
  each re-``stat``-ed first and skipped when gone or used since it was indexed; when the index is empty, from
  a sample: whole shards in random order until at least ``SAMPLE_FILES`` files (approximate LRU: the oldest
  of the sample go first; retention's budget is applied to the sample). A sample that covers every shard is
  the whole store: the pass then orders and stops as ``full_pass`` does (exact LRU, down to the low
  watermark), but still only takes off what it removed. When the pass stops above the low watermark, or the
  index runs low, it wakes the top-up.
- The index: the oldest files of the last full scan in eviction order (``eviction_order``: least recently
  used first), those covering ``INDEX_BANDS`` watermark bands of bytes, up to the first retained file
  (retained files go after every ordinary file, also those published after the scan: they are left to a
  put's sample). Files published after the scan are newer than every indexed one, so the index stays the
  store's oldest files as long as a candidate used or retained since (its mtime moved) is skipped.
- The top-up (``top_up``; a daemon thread per process, woken by the put path): scans every file without any
  lock, rebuilds the index, then evicts from it down to the low watermark ``TOP_UP_BATCH`` files per hold of
  ``evict.lock``, so that the put paths of every process interleave with it, and removes crashed writers'
  temp files. O(N), off the put path.
- ``full_pass``: the whole-store pass (``FileLayout.make_room``): every file scanned, oldest evicted down
  to the low watermark, the usage estimate rewritten from the files (correcting drift from crashed writers).

Every pass keeps the rules of the old one: a recyclable file goes to spare/ while the spares have room (and
the pass then goes on to older files: a spare frees nothing), spares are dropped oldest first only when
objects alone do not fit, each evicted file is counted for its tenant (``TenantTally``) and recorded in the
eviction log, and a reader that opened a file keeps reading its inode (eviction moves or unlinks the name).
A put's pass and the top-up never rewrite the estimate: they take off exactly the bytes they removed (a file
another process removed first is its remover's to account for). Rewriting it from the files, as every pass
did before, dropped the bytes of other processes' puts in flight (counted before their files exist): with
four engines on one store it fell below the bytes on disk and the store passed its capacity (the shared-store
test). Drift from a crashed writer (a batch counted and never written: high, never low) is corrected by
``full_pass`` (``FileLayout.make_room``).
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import structlog
from hybridkv.store.base import StoreLogEvent
from hybridkv.store.file.eviction_log import digest_of_name
from hybridkv.store.file.ledger import TenantTally
from hybridkv.store.file.policy import LOW_WATERMARK, eviction_order
from hybridkv.store.retention import RETAIN_FRACTION

if TYPE_CHECKING:
    from hybridkv.store.file.layout import FileLayout

log = structlog.get_logger(__name__)

#: A put's pass without an index samples whole shards until it has at least this many files.
SAMPLE_FILES = 4096
#: A put's pass, once the store fits under the capacity, stops after evicting this many files (or the put's
#: bytes, if more): the rest of the way down to the low watermark is the top-up's.
SYNC_MIN_FILES = 64
#: The top-up evicts this many files per hold of ``evict.lock``.
TOP_UP_BATCH = 256
#: The index keeps the oldest files covering this many watermark bands (``1 - LOW_WATERMARK`` of capacity).
INDEX_BANDS = 2

#: ``(mtime, size, path)`` of one file.
Entry = tuple[float, int, str]


def scan_shard(shard: str, suffix: str) -> list[Entry]:
    """``(mtime, size, path)`` of the files of one shard named ``*suffix``; none if it is gone."""
    entries: list[Entry] = []
    try:
        with os.scandir(shard) as listing:
            for entry in listing:
                if not entry.name.endswith(suffix):
                    continue
                try:
                    info = entry.stat()
                except FileNotFoundError:
                    continue
                entries.append((info.st_mtime, info.st_size, entry.path))
    except FileNotFoundError:
        pass
    return entries


def _batch_done(state: EvictionPass, *, low: int) -> bool:
    """A top-up batch ends under the low watermark or after ``TOP_UP_BATCH`` candidates."""
    return state.total <= low or state.num_evicted + state.num_skipped >= TOP_UP_BATCH


class EvictionPass:
    """One pass's evictions and accounting (see the module docstring).

    ``exact``: ``total`` and ``spare_total`` were read from every file (a whole-store pass): a file found
    gone is taken off ``total``. Otherwise they are the shared estimates. ``rewrite`` (only with ``exact``):
    ``finish`` rewrites the estimates from the files; otherwise it takes off exactly the bytes this pass
    removed, so that the bytes of other processes' puts in flight (counted in the estimate before their files
    exist) stay counted."""

    def __init__(
        self,
        layout: FileLayout,
        namespaces: Collection[str],
        total: int,
        spare_total: int,
        *,
        exact: bool,
        rewrite: bool = False,
    ) -> None:
        assert exact or not rewrite, "only a pass that read every file may rewrite the estimates"
        self.layout = layout
        self.total = total
        self.spare_total = spare_total
        self.exact = exact
        self.rewrite = rewrite
        self.tally = TenantTally(layout, layout.ledger, namespaces)
        self.digests: list[bytes] = []
        self.num_evicted = 0
        self.num_skipped = 0
        self._usage_delta = 0
        self._spare_delta = 0

    def evict(self, size: int, path: str) -> None:
        """Take the published file ``path`` (``size`` bytes) out: into spare/ where it is recyclable and the
        spares have room (the total does not drop: spares count toward capacity), else unlinked."""
        layout = self.layout
        self.tally.note(path, size)
        if layout.is_recyclable(size) and self.spare_total + size <= layout.spare_budget_bytes:
            try:
                layout.spares.move_in(path, size)
            except FileNotFoundError:
                self._gone(size)
                return
            self.spare_total += size
            self._spare_delta += size
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                self._gone(size)
                return
            self.total -= size
            self._usage_delta -= size
        self.num_evicted += 1
        digest = digest_of_name(os.path.basename(path))
        if digest is not None:
            self.digests.append(digest)

    def _gone(self, size: int) -> None:
        """A candidate another process removed first: its bytes are its remover's to account for."""
        self.num_skipped += 1
        if self.exact:
            self.total -= size

    def drop_spares(self, spares: list[Entry], target: int) -> None:
        """Unlink spares, oldest first, until ``total`` is at most ``target`` (objects alone do not fit)."""
        for _mtime, size, path in sorted(spares):
            if self.total <= target:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                if not self.exact:
                    continue
            else:
                self._usage_delta -= size
                self._spare_delta -= size
            self.total -= size
            self.spare_total -= size

    def finish(self) -> None:
        """Account for the pass: the estimates, the eviction log, the tenants' counts, this process's count."""
        layout = self.layout
        if self.rewrite:
            layout.set_usage(self.total, self.spare_total)
        elif self._usage_delta or self._spare_delta:
            layout.add_usage(self._usage_delta, self._spare_delta)
        layout.eviction_log.append(self.digests)
        self.tally.settle()
        layout.count_evicted(self.num_evicted)


class CapacityEvictor:
    """One process's capacity passes over one store directory (see the module docstring). Thread-safe.

    The top-up thread starts on first need; :meth:`close` stops it (before the layout closes its
    descriptors)."""

    def __init__(self, layout: FileLayout, suffix: str) -> None:
        self.layout = layout
        self._suffix = suffix
        #: The index and the top-up thread's state.
        self._lock = threading.Lock()
        self._index: list[Entry] = []
        self._next = 0
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._thread_pid = 0
        #: The namespaces under a quota the put path last named (the top-up counts its evictions for them).
        self._namespaces: Collection[str] = ()
        #: Files this process's put-path passes evicted; top-up passes it ran, and the files they evicted.
        self.num_put_evicted = 0
        self.num_top_ups = 0
        self.num_top_up_evicted = 0

    # -- the put path ----------------------------------------------------------------------------------

    def make_room_for_put(self, size: int, namespaces: Collection[str] = ()) -> int:
        """Evict until the store fits (see the module docstring); ``size``: the bytes the put still needs
        room for (already counted in the estimate, which this pass leaves counted). Returns the files it
        evicted."""
        layout = self.layout
        self._namespaces = namespaces
        wake = False
        with layout.evict_locked():
            usage, spare = layout.read_usage()
            capacity = layout.effective_capacity_bytes
            if usage <= capacity:
                return 0  # another pass made room meanwhile
            low = int(capacity * LOW_WATERMARK)
            min_bytes = max(0, size)

            def done(state: EvictionPass) -> bool:
                return state.total <= low or (
                    state.total <= capacity
                    and state.num_evicted >= SYNC_MIN_FILES
                    and usage - state.total >= min_bytes
                )

            state = EvictionPass(layout, namespaces, usage, spare, exact=False)
            self._evict_from_index(state, done)
            if not done(state):
                shards = layout.object_shards()
                random.shuffle(shards)
                sample: list[Entry] = []
                while shards and len(sample) < SAMPLE_FILES:
                    sample += scan_shard(shards.pop(), self._suffix)
                if not shards:  # the sample is the whole store: ordered and bounded as a full pass
                    state.finish()
                    num_evicted = self._full_pass_of(sample, size, namespaces, rewrite=False)
                    num_evicted += state.num_evicted
                    with self._lock:
                        self.num_put_evicted += num_evicted
                    return num_evicted
                self._evict_in_order(state, sample, done)
                while not done(state) and shards:  # the sample was not enough (spares, retained files)
                    self._evict_in_order(state, scan_shard(shards.pop(), self._suffix), done)
                if not done(state):
                    state.drop_spares(self._scan_spares(), capacity)
                wake = True
            state.finish()
            with self._lock:
                self.num_put_evicted += state.num_evicted
            wake = wake or state.total > low or self._num_indexed() < SAMPLE_FILES
        if wake:
            self.wake_top_up()
        log.debug(
            StoreLogEvent.FILE_EVICTED, url=layout.url, num_evicted=state.num_evicted, num_bytes=state.total
        )
        return state.num_evicted

    def _evict_from_index(self, state: EvictionPass, done: Callable[[EvictionPass], bool]) -> None:
        """Evict index candidates until ``done``: each re-``stat``-ed, skipped when gone or used since."""
        while not done(state):
            with self._lock:
                if self._next >= len(self._index):
                    self._index, self._next = [], 0
                    return
                mtime, _size, path = self._index[self._next]
                self._next += 1
            try:
                info = os.stat(path)
            except FileNotFoundError:
                state.num_skipped += 1
                continue
            if info.st_mtime != mtime:
                state.num_skipped += 1  # used (or retained) since it was indexed: no longer among the oldest
                continue
            state.evict(info.st_size, path)

    def _evict_in_order(
        self, state: EvictionPass, sample: list[Entry], done: Callable[[EvictionPass], bool]
    ) -> None:
        """Evict the ``sample``'s files in eviction order until ``done``."""
        capacity = self.layout.effective_capacity_bytes
        for _mtime, size, path in eviction_order(sample, time.time(), capacity * RETAIN_FRACTION):
            if done(state):
                return
            state.evict(size, path)

    def _num_indexed(self) -> int:
        with self._lock:
            return len(self._index) - self._next

    def _scan_spares(self) -> list[Entry]:
        spares: list[Entry] = []
        for shard in self.layout.spare_shards():
            spares += scan_shard(shard, self._suffix)
        return spares

    # -- the whole-store pass --------------------------------------------------------------------------

    def full_pass(self, size: int, namespaces: Collection[str] = ()) -> None:
        """Scan every file and evict the oldest until ``size`` more bytes fit under the low watermark; rewrite
        the estimate from the files and remove crashed writers' temp files. The caller holds ``evict.lock``."""
        entries: list[Entry] = []
        for shard in self.layout.object_shards():
            entries += scan_shard(shard, self._suffix)
        self._full_pass_of(entries, size, namespaces, rewrite=True)

    def _full_pass_of(
        self, entries: list[Entry], size: int, namespaces: Collection[str], *, rewrite: bool
    ) -> int:
        """``full_pass`` over the scanned ``entries``, rewriting the estimates only with ``rewrite`` (else
        taking off what it removed: see ``EvictionPass``); returns the files it evicted."""
        layout = self.layout
        now = time.time()
        spares = self._scan_spares()
        spare_total = sum(file_size for _mtime, file_size, _path in spares)
        total = sum(file_size for _mtime, file_size, _path in entries) + spare_total
        # Spares count toward capacity: evicting a file into spare/ frees nothing, so the pass goes on to
        # older files until objects + spares fit under the watermark (spares stay within their budget).
        target = int(layout.effective_capacity_bytes * LOW_WATERMARK) - size
        state = EvictionPass(layout, namespaces, total, spare_total, exact=True, rewrite=rewrite)
        ordered = eviction_order(entries, now, layout.effective_capacity_bytes * RETAIN_FRACTION)
        for _mtime, file_size, path in ordered:
            if state.total <= target:
                break
            state.evict(file_size, path)
        state.drop_spares(spares, target)  # only when objects alone do not fit
        state.finish()
        self._set_index(ordered, state.num_evicted + state.num_skipped, now)
        layout.remove_stale_temp_files(now)
        log.debug(
            StoreLogEvent.FILE_EVICTED, url=layout.url, num_evicted=state.num_evicted, num_bytes=state.total
        )
        return state.num_evicted

    def _set_index(self, ordered: list[Entry], start: int, now: float, num_bytes_due: int = 0) -> None:
        """Index ``ordered[start:]``'s head: the files covering ``INDEX_BANDS`` watermark bands beyond the
        ``num_bytes_due`` a top-up is about to evict, up to the first retained one (mtime after ``now``, the
        scan's time): a retained file goes after files published later, which the index does not hold, so
        it is left to a put's sample."""
        budget = num_bytes_due + INDEX_BANDS * (1.0 - LOW_WATERMARK) * self.layout.effective_capacity_bytes
        end = start
        num_bytes = 0
        while end < len(ordered) and num_bytes < budget and ordered[end][0] <= now:
            num_bytes += ordered[end][1]
            end += 1
        with self._lock:
            self._index, self._next = ordered[start:end], 0

    # -- the top-up --------------------------------------------------------------------------------------

    def wake_top_up(self) -> None:
        """Have this process's top-up thread run a pass (started here on first need, and anew in a forked
        child, which has none)."""
        with self._lock:
            if self._closed:
                return
            pid = os.getpid()
            if self._thread_pid != pid:  # a forked child: the parent's thread and events are not ours
                self._wake, self._idle, self._thread = threading.Event(), threading.Event(), None
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name=f"hybridkv-file-top-up-{pid}", daemon=True
                )
                self._thread_pid = pid
                self._thread.start()
            self._idle.clear()
            self._wake.set()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no top-up pass is due or running (benches and tests); ``False`` on timeout."""
        return self._idle.wait(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                self._idle.set()
                return
            try:
                self.top_up()
            except Exception as error:  # noqa: BLE001 - a failed top-up must not end the thread
                log.warning(
                    StoreLogEvent.FILE_IO_ERROR, url=self.layout.url, op="top_up", key="", error=str(error)
                )
            finally:
                if not self._wake.is_set():
                    self._idle.set()

    def top_up(self, size: int = 0) -> int:
        """One top-up pass (see the module docstring): scan every file without a lock, rebuild the index,
        evict until ``size`` more bytes fit under the low watermark, a batch per hold of ``evict.lock``.
        Returns the files it evicted."""
        layout = self.layout
        usage, _spare = layout.read_usage()
        if usage <= int(layout.effective_capacity_bytes * LOW_WATERMARK) - size and (
            self._num_indexed() >= SAMPLE_FILES
        ):
            return 0  # woken again by puts while the last pass ran: it made room and left an index
        entries: list[Entry] = []
        for shard in layout.object_shards():
            if self._closed:
                return 0
            entries += scan_shard(shard, self._suffix)
        now = time.time()
        ordered = eviction_order(entries, now, layout.effective_capacity_bytes * RETAIN_FRACTION)
        del entries
        usage, _spare = layout.read_usage()
        self._set_index(ordered, 0, now, usage - int(layout.effective_capacity_bytes * LOW_WATERMARK) + size)
        del ordered
        num_evicted = 0
        while not self._closed:
            with layout.evict_locked():
                usage, spare = layout.read_usage()
                low = int(layout.effective_capacity_bytes * LOW_WATERMARK) - size
                if usage <= low:
                    break
                state = EvictionPass(layout, self._namespaces, usage, spare, exact=False)
                self._evict_from_index(state, functools.partial(_batch_done, low=low))
                exhausted = state.total > low and self._num_indexed() == 0
                # Objects alone do not fit (or the index is used up): spares, then the next scan's index.
                if exhausted:
                    state.drop_spares(self._scan_spares(), low)
                state.finish()
                num_evicted += state.num_evicted
                if exhausted:
                    break
        layout.remove_stale_temp_files(time.time())
        with self._lock:
            self.num_top_ups += 1
            self.num_top_up_evicted += num_evicted
        return num_evicted

    def close(self) -> None:
        """Stop the top-up thread (it stops between shards and between batches) and wait for it."""
        with self._lock:
            self._closed = True
            thread = self._thread if self._thread_pid == os.getpid() else None
            self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._idle.set()
