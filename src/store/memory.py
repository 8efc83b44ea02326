"""``memory://NAME``: a process-local backend (tests, the in-process engine).

All stores opened with the same NAME in one process share one table; ``close()`` closes the handle only.
An optional ``capacity`` bounds the framed bytes held, evicting least-recently-used entries (a read or an
``exists`` counts as a use). ``quotas=NS:SIZE[,NS:SIZE...]`` bounds the bytes of each named tenant
(namespace), evicting that tenant's own least-recently-used entries (``hybridkv.store.quotas``). Retained
entries (``retain``, ``hybridkv.store.retention``) go last, within their budget. Every eviction is reported
to every handle of the table (``take_evictions``, ``hybridkv.store.base.EvictionReporter``) through a
bounded record of the last ``EVICTION_RECORD_LEN`` evicted key digests: a handle that falls further behind
gets an incomplete report.

Frames of 256 KiB or more live in buffers rounded up to whole pages; when such a frame is removed or evicted
its buffer is kept as a spare (at most ``_SPARE_BYTES`` per table, within ``capacity``) for a later put of
the same rounded size: otherwise buffers that big often get fresh pages from malloc (a new ``mmap``, or
heap memory trimmed and faulted back), and faulting + zeroing new pages costs about as much as the copy
itself (dev VM, 64 MiB batches: 16 MiB values put at 0.38x memcpy without reuse, 0.74x with it). A buffer is reused only when no reader is copying out of it (readers pin the frame while they
copy outside the lock).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from hybridkv.key_grammar import namespace_of
from hybridkv.store.base import Evictions, Status, StoreError, StoreStats
from hybridkv.store.frame import key_digest
from hybridkv.store.framed import FrameParts, SealHook, VerifyHook
from hybridkv.store.quotas import OTHER_TENANTS, TenantCounters
from hybridkv.store.retention import RETAIN_FRACTION, protected_keys

#: ``exists``' answer for a key, indexed by whether it is present
_STATUS_OF_PRESENT = (Status.NOT_FOUND, Status.OK)

#: Frames at least this big are recycled on remove/evict (malloc reuses smaller ones well enough).
SPARE_MIN_FRAME = 256 << 10
#: Upper bound on the spare bytes one table keeps.
_SPARE_BYTES = 128 << 20
#: Evicted key digests a table remembers for ``take_evictions`` (16 bytes each, plus the deque's overhead).
EVICTION_RECORD_LEN = 1 << 16
_PAGE = 4096


def _buffer_size(size: int) -> int:
    """Bytes of the buffer holding a frame of ``size`` bytes (spares are matched on this)."""
    return size if size < SPARE_MIN_FRAME else -(-size // _PAGE) * _PAGE


def _buffer_of(data: np.ndarray) -> np.ndarray:
    """The whole buffer behind a stored frame (a frame is a prefix view of its buffer when rounded up)."""
    return data if data.base is None else data.base


def _join(frame: FrameParts, size: int, data: np.ndarray | None = None) -> np.ndarray:
    """One contiguous copy of the frame (into ``data`` when given: a spare buffer of exactly ``size`` bytes).
    numpy, not ``bytes``: for multi-MiB values numpy's allocator (huge-page advice) faults fresh pages in
    faster than ``bytes(...)`` (see docs/performance.md, "Figures behind design choices")."""
    if data is None:
        data = np.empty(_buffer_size(size), dtype=np.uint8)
    if data.nbytes != size:
        data = data[:size]
    view = memoryview(data)  # type: ignore[arg-type]  # numpy arrays are buffers
    offset = 0
    for part in frame:
        view[offset : offset + part.nbytes] = part
        offset += part.nbytes
    return data


class _Tenant:
    """A namespace under a quota: its counters and its keys in LRU order (oldest first)."""

    def __init__(self, quota_bytes: int) -> None:
        self.counters = TenantCounters(quota_bytes)
        self.key_order: OrderedDict[str, None] = OrderedDict()


class _MemoryTable:
    """One named table: frames by key, in LRU order (oldest first)."""

    def __init__(self, capacity_bytes: int | None, quotas: dict[str, int]) -> None:
        self.lock = threading.Lock()
        self.key_to_frame: OrderedDict[str, np.ndarray] = OrderedDict()
        self.num_bytes = 0
        self.capacity_bytes = capacity_bytes
        self.num_evicted = 0
        self.quotas = dict(quotas)
        #: The namespaces under a quota (empty: no per-key tenant bookkeeping at all).
        self.namespace_to_tenant = {namespace: _Tenant(quota) for namespace, quota in quotas.items()}
        #: Retained entries: key -> the time (``time.time()``) until which it goes last.
        self.key_to_until: dict[str, float] = {}
        #: id(frame) -> readers copying out of it right now (they copy outside the lock).
        self.pins: dict[int, int] = {}
        #: frame size -> spare buffers of exactly that size, for puts to reuse (see the module docstring).
        self.spare: dict[int, list[np.ndarray]] = {}
        self.spare_bytes = 0
        #: The digests of the last ``EVICTION_RECORD_LEN`` evicted keys, and how many were ever recorded.
        self.evicted_digests: collections.deque[bytes] = collections.deque(maxlen=EVICTION_RECORD_LEN)
        self.num_evictions_recorded = 0

    # All methods below are called with ``lock`` held.

    def tenant_of(self, key: str) -> _Tenant | None:
        if not self.namespace_to_tenant:
            return None
        namespace = namespace_of(key)
        return None if namespace is None else self.namespace_to_tenant.get(namespace)

    def touch(self, key: str) -> None:
        """Mark ``key`` (present) used now: in the table's LRU order and in its tenant's."""
        self.key_to_frame.move_to_end(key)
        tenant = self.tenant_of(key)
        if tenant is not None:
            tenant.key_order.move_to_end(key)

    def insert(self, key: str, data: np.ndarray) -> None:
        self.key_to_frame[key] = data
        self.num_bytes += data.nbytes
        tenant = self.tenant_of(key)
        if tenant is not None:
            tenant.key_order[key] = None
            tenant.counters.usage_bytes += data.nbytes

    def victim(self, key_order: Iterable[str], budget_bytes: float) -> str:
        """The entry to evict next among ``key_order`` (oldest first): the oldest one not retained within
        ``budget_bytes``, else the retained one that expires first (``hybridkv.store.retention``)."""
        if self.key_to_until:
            now = time.time()
            for key in [key for key, until in self.key_to_until.items() if until <= now]:
                del self.key_to_until[key]  # expired: an ordinary entry again
        if not self.key_to_until:
            return next(iter(key_order))
        candidates = list(key_order)
        retained = {key: self.key_to_until[key] for key in candidates if key in self.key_to_until}
        protected = protected_keys(
            retained, {key: self.key_to_frame[key].nbytes for key in retained}, budget_bytes
        )
        for key in candidates:
            if key not in protected:
                return key
        return min(protected, key=retained.__getitem__)

    def drop(self, key: str) -> np.ndarray | None:
        """Take ``key`` out of the table (and its tenant) and retire its buffer; its frame, or ``None``."""
        data = self.key_to_frame.pop(key, None)
        if data is None:
            return None
        self.key_to_until.pop(key, None)
        self.num_bytes -= data.nbytes
        tenant = self.tenant_of(key)
        if tenant is not None:
            del tenant.key_order[key]
            tenant.counters.usage_bytes -= data.nbytes
        self.retire(data)
        return data

    def make_tenant_room(self, tenant: _Tenant, size: int) -> None:
        """Evict ``tenant``'s oldest entries until ``size`` more bytes fit in its quota (``size`` <= quota)."""
        counters = tenant.counters
        while counters.usage_bytes + size > counters.quota_bytes:
            assert tenant.key_order, f"tenant usage {counters.usage_bytes} with no entries, or {size} > quota"
            victim = self.victim(tenant.key_order, counters.quota_bytes * RETAIN_FRACTION)
            self.drop(victim)
            self.record_eviction(victim)
            counters.num_quota_evicted += 1

    def record_eviction(self, key: str) -> None:
        """``key`` was evicted (it is gone already): every handle's next ``take_evictions`` reports it."""
        self.evicted_digests.append(key_digest(key))
        self.num_evictions_recorded += 1

    def retire(self, data: np.ndarray) -> None:
        """Frame ``data`` left the table: keep its buffer as a spare if big, unpinned, and there is room."""
        if data.nbytes < SPARE_MIN_FRAME or id(data) in self.pins:
            return
        data = _buffer_of(data)
        size = data.nbytes
        limit = _SPARE_BYTES
        if self.capacity_bytes is not None:
            limit = min(limit, self.capacity_bytes - self.num_bytes)
        if self.spare_bytes + size > limit:
            return
        self.spare.setdefault(size, []).append(data)
        self.spare_bytes += size

    def take_spare(self, size: int) -> np.ndarray | None:
        buffers = self.spare.get(size)
        if not buffers:
            return None
        data = buffers.pop()
        if not buffers:
            del self.spare[size]
        self.spare_bytes -= size
        return data

    def drop_spares(self, num_bytes: int) -> None:
        """Free spare buffers until ``num_bytes`` more fit under capacity next to the table's frames."""
        assert self.capacity_bytes is not None
        while self.spare and self.num_bytes + self.spare_bytes + num_bytes > self.capacity_bytes:
            size = next(iter(self.spare))
            self.take_spare(size)


_name_to_table: dict[str, _MemoryTable] = {}
_registry_lock = threading.Lock()


def _table_for(name: str, capacity_bytes: int | None, quotas: dict[str, int]) -> _MemoryTable:
    with _registry_lock:
        table = _name_to_table.get(name)
        if table is None:
            table = _name_to_table[name] = _MemoryTable(capacity_bytes, quotas)
        elif capacity_bytes is not None and table.capacity_bytes != capacity_bytes:
            raise StoreError(
                f"memory://{name} is already open in this process with capacity {table.capacity_bytes}, "
                f"not {capacity_bytes}"
            )
        elif quotas and table.quotas != quotas:
            raise StoreError(
                f"memory://{name} is already open in this process with quotas {table.quotas}, not {quotas}"
            )
        return table


class MemoryBackend:
    """Frames in a process-wide dict; copies in on put and out on get (one memcpy each)."""

    def __init__(
        self, url: str, name: str, *, capacity_bytes: int | None, quotas: dict[str, int] | None = None
    ) -> None:
        """``quotas``: bytes per namespace (``hybridkv.store.quotas``); every handle of one NAME that names
        quotas must name the same ones (a handle naming none shares the table's)."""
        self.url = url
        self.name = name
        self._table = _table_for(name, capacity_bytes, quotas or {})
        with self._table.lock:
            #: ``num_evictions_recorded`` when this handle last reported (``take_evictions``)
            self._evictions_reported = self._table.num_evictions_recorded

    @property
    def table(self) -> _MemoryTable:
        """The process-wide table of this name that the backend shares (frames, pins, spares); for
        inspection. Touch it only under its ``lock``."""
        return self._table

    def answers_late(self, op: str) -> bool:
        """Never: every call copies under the table's lock and returns."""
        return False

    def exists(self, keys: Sequence[str]) -> list[Status]:
        # C-level maps, not a Python loop: a lookup checks thousands of keys, and a loop here held the GIL
        # (and the table lock) for milliseconds at a 128K-token prompt, stalling the engine's other threads.
        table = self._table
        with table.lock:
            present = list(map(table.key_to_frame.__contains__, keys))
            # touch the entries found (LRU order), as a get would
            touch = table.touch if table.namespace_to_tenant else table.key_to_frame.move_to_end
            collections.deque(map(touch, itertools.compress(keys, present)), maxlen=0)
        return list(map(_STATUS_OF_PRESENT.__getitem__, present))

    def put_frames(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        return self.put_frames_sealed(keys, frames, None)

    def put_frames_sealed(
        self, keys: Sequence[str], frames: Sequence[FrameParts], seal: SealHook | None
    ) -> list[Status]:
        """``put_frames``, sealing each frame (computing its checksum) right before copying it."""
        table = self._table
        results: list[Status] = []
        for index, (key, frame) in enumerate(zip(keys, frames, strict=True)):
            with table.lock:
                if key in table.key_to_frame:  # insert-if-absent
                    table.touch(key)
                    results.append(Status.OK)
                    continue
                size = sum(part.nbytes for part in frame)
                tenant = table.tenant_of(key)
                if tenant is not None and size > tenant.counters.quota_bytes:
                    tenant.counters.num_refused_puts += 1
                    results.append(Status.NO_SPACE)
                    continue
                spare = table.take_spare(_buffer_size(size)) if size >= SPARE_MIN_FRAME else None
            if table.capacity_bytes is not None and size > table.capacity_bytes:
                results.append(Status.NO_SPACE)
                continue
            if seal is not None:
                seal(index)
            data = _join(frame, size, spare)  # the one copy, outside the lock
            with table.lock:
                if key in table.key_to_frame:  # another thread won the race: first writer wins
                    table.retire(data)
                    results.append(Status.OK)
                    continue
                if tenant is not None:  # the tenant's own entries first: its put must not grow the table
                    table.make_tenant_room(tenant, size)
                if table.capacity_bytes is not None:
                    table.drop_spares(size)
                    while table.num_bytes + size > table.capacity_bytes:
                        victim = table.victim(table.key_to_frame, table.capacity_bytes * RETAIN_FRACTION)
                        victim_tenant = table.tenant_of(victim)
                        if victim_tenant is not None:
                            victim_tenant.counters.num_capacity_evicted += 1
                        table.drop(victim)
                        table.record_eviction(victim)
                        table.num_evicted += 1
                table.insert(key, data)
                if table.capacity_bytes is not None:
                    table.drop_spares(0)  # spares retired by the evictions above must fit too
            results.append(Status.OK)
        return results

    def get_frames_into(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        return self.get_frames_verified(keys, frames, None)

    def get_frames_verified(
        self, keys: Sequence[str], frames: Sequence[FrameParts], verify: VerifyHook | None
    ) -> list[Status]:
        """``get_frames_into``, verifying each frame right after copying it (while its bytes are cached)."""
        table = self._table
        pins = table.pins
        results: list[Status] = []
        for index, (key, frame) in enumerate(zip(keys, frames, strict=True)):
            with table.lock:
                data = table.key_to_frame.get(key)
                if data is None:
                    results.append(Status.NOT_FOUND)
                    continue
                table.touch(key)
                if data.nbytes != sum(part.nbytes for part in frame):
                    results.append(Status.CORRUPT)
                    continue
                pins[id(data)] = pins.get(id(data), 0) + 1  # not recycled while we copy outside the lock
            try:
                source = memoryview(data)  # type: ignore[arg-type] # never written while published or pinned
                offset = 0
                for part in frame:
                    part[:] = source[offset : offset + part.nbytes]
                    offset += part.nbytes
                del source
            finally:
                with table.lock:
                    count = pins.pop(id(data)) - 1
                    if count:
                        pins[id(data)] = count
            results.append(Status.OK if verify is None or verify(index) else Status.CORRUPT)
        return results

    def retain(self, keys: Sequence[str], until: float) -> list[Status]:
        """Retain each stored key until ``until`` (``hybridkv.store.retention``): ``OK``, or ``NOT_FOUND`` when
        it is not stored; ``until`` in the past releases it (it then ages as if used now)."""
        table = self._table
        now = time.time()
        results: list[Status] = []
        with table.lock:
            for key in keys:
                if key not in table.key_to_frame:
                    results.append(Status.NOT_FOUND)
                    continue
                if until > now:
                    table.key_to_until[key] = until
                else:
                    table.key_to_until.pop(key, None)
                table.touch(
                    key
                )  # a retained entry ages from now once its retention ends, or from its release
                results.append(Status.OK)
        return results

    def remove(self, keys: Sequence[str]) -> list[Status]:
        table = self._table
        results: list[Status] = []
        with table.lock:
            results.extend(Status.NOT_FOUND if table.drop(key) is None else Status.OK for key in keys)
        return results

    def take_evictions(self) -> Evictions:
        """The keys the table evicted since this handle was opened or last asked
        (``hybridkv.store.base.EvictionReporter``); incomplete when more than ``EVICTION_RECORD_LEN`` were."""
        table = self._table
        with table.lock:
            num_new = table.num_evictions_recorded - self._evictions_reported
            self._evictions_reported = table.num_evictions_recorded
            recorded = len(table.evicted_digests)
            digests = tuple(itertools.islice(table.evicted_digests, max(0, recorded - num_new), recorded))
        return Evictions(digests, complete=num_new <= recorded)

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        with self._table.lock:
            keys = [key for key in self._table.key_to_frame if key.startswith(prefix)]
        return iter(keys)

    def remove_prefix(self, prefix: str) -> int:
        keys = list(self.iter_keys(prefix))
        return sum(status is Status.OK for status in self.remove(keys))

    def stats(self) -> StoreStats:
        table = self._table
        with table.lock:
            return StoreStats(
                url=self.url,
                num_keys=len(table.key_to_frame),
                num_bytes=table.num_bytes,
                capacity_bytes=table.capacity_bytes,
                extra={
                    "name": self.name,
                    "num_evicted": table.num_evicted,
                    "spare_bytes": table.spare_bytes,
                    "num_retained": len(table.key_to_until),
                    **(
                        {
                            "tenants": {
                                namespace: tenant.counters.as_dict()
                                for namespace, tenant in sorted(table.namespace_to_tenant.items())
                            }
                        }
                        if table.namespace_to_tenant
                        else {}
                    ),
                },
            )

    def tenant_counters(self) -> dict[str, TenantCounters]:
        """Copies of the tenants' counters (``hybridkv.store.quotas.tenant_counters_of``): one per namespace
        under a quota, and ``OTHER_TENANTS`` for the rest of the table (its bytes, its capacity evictions);
        empty without quotas. Counts every handle of the table (one table per process)."""
        table = self._table
        with table.lock:
            if not table.namespace_to_tenant:
                return {}
            counters = {
                namespace: dataclasses.replace(tenant.counters)
                for namespace, tenant in sorted(table.namespace_to_tenant.items())
            }
            num_bytes, num_evicted = table.num_bytes, table.num_evicted
        counters[OTHER_TENANTS] = TenantCounters(
            quota_bytes=0,
            usage_bytes=max(0, num_bytes - sum(c.usage_bytes for c in counters.values())),
            num_capacity_evicted=max(0, num_evicted - sum(c.num_capacity_evicted for c in counters.values())),
        )
        return counters

    def close(self) -> None:
        """Nothing to release: the table lives as long as the process (same NAME = same store)."""


def drop_memory_store(name: str) -> bool:
    """Forget the table ``name`` (its data is freed once no handle uses it); ``True`` if it existed."""
    with _registry_lock:
        return _name_to_table.pop(name, None) is not None
