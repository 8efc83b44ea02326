"""The store protocol every backend implements.

Contract (all backends, checked by ``hybridkv.testing.store_fuzz``):

- **Batch-first.** Every data call takes a batch of keys and returns one typed result per key, in order.
  Per-key outcomes are never exceptions and never bare ints; exceptions are reserved for programming
  errors (mismatched batch lengths, a closed store, a non-writable destination).
- **Insert-if-absent.** ``put`` of a key that already exists stores nothing and returns ``OK``: keys are
  content-derived, so the bytes already stored are the bytes being offered.
- **Atomic publish.** A key is visible to ``exists``/``get_into`` (in any process) only once its whole
  value is stored.
- **Framed values.** Every stored value carries a frame (magic, version, key digest, payload length,
  checksum). A read whose frame does not match -- truncated, bit-flipped, written under another key, or a
  payload length different from the destination's -- yields ``CORRUPT`` and the destination's contents are
  unspecified (callers must not use them).
- **Pointer-friendly.** A value is one buffer or a sequence of buffers (parts, concatenated in order); a
  destination is one writable buffer or a sequence of writable buffers (scattered in order). Anything
  supporting the Python buffer protocol works (``bytes``, ``bytearray``, ``memoryview``, numpy arrays,
  CPU torch tensors via ``.numpy()``). Backends copy directly between these buffers and their storage.
- **Buffer ownership.** The caller's buffers belong to a call until it has really returned. A call that
  answers ``TIMEOUT`` while its work goes on (a deadline runner abandoned it: it may still read a value's
  parts or write a destination) registers a completion handle with :func:`register_late_call`; a caller
  that reuses or frees buffers collects those handles with :func:`collect_late_calls` and keeps the
  buffers out of use until every handle is done. ``answers_late(op)`` says whether a store's ``get_into``
  (``op="get"``) or ``put`` (``op="put"``) may do that; a store that says ``False`` returns from every such
  call before it answers.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeAlias, TypeVar, runtime_checkable

from typing_extensions import Buffer

_LayerT = TypeVar("_LayerT")


class StoreLogEvent(enum.StrEnum):
    """Every structlog event the store backends log (warnings, and one debug line); docs name some of them."""

    #: a read whose frame does not match (truncated, bit-flipped, another key's, another length)
    CORRUPT_VALUE = "store.corrupt_value"
    FILE_DIR_NOT_PRIVATE = "store.file.dir_not_private"
    FILE_EVICTED = "store.file.evicted"
    FILE_SIZE_MISMATCH = "store.file.size_mismatch"
    FILE_UNREADABLE_HEADER = "store.file.unreadable_header"
    FILE_IO_ERROR = "store.file.io_error"
    #: the directory's quota file is not a namespace -> bytes object: the quotas last read stay in force
    FILE_QUOTAS_UNREADABLE = "store.file.quotas_unreadable"
    #: a file-store call ran past its deadline (a hung network file system): ``TIMEOUT``, left running
    FILE_DEADLINE = "store.file.deadline"
    #: an integrity key file that others than its owner may read or write (they could forge values)
    INTEGRITY_KEY_FILE_NOT_PRIVATE = "store.integrity.key_file_not_private"
    MOONCAKE_RPC_TIMEOUT_ENV_DIFFERS = "store.mooncake.rpc_timeout_env_differs"
    MOONCAKE_DEADLINE = "store.mooncake.deadline"
    MOONCAKE_MASTER_DOWN = "store.mooncake.master_down"
    MOONCAKE_ERROR = "store.mooncake.error"
    MOONCAKE_CLOSE_TIMEOUT = "store.mooncake.close_timeout"
    #: the file store could not append a pass's evictions to the directory's eviction log
    #: (``hybridkv.store.file.eviction_log``): other processes' ``take_evictions`` miss them
    FILE_EVICTION_LOG_FAILED = "store.file.eviction_log_failed"
    #: the file system holds less than a file store's capacity (a full disk, a quota): eviction holds the
    #: store to what it holds (once per episode, with ``free_bytes``, ``capacity_bytes``,
    #: ``effective_capacity_bytes``)
    FILE_SPACE_LIMITED = "store.file.space_limited"
    #: the file system holds a file store's whole capacity again: the episode of ``FILE_SPACE_LIMITED`` ended
    FILE_SPACE_RECOVERED = "store.file.space_recovered"
    #: a store's eviction report (``EvictionReporter.take_evictions``) raised: taken as a lost report
    EVICTION_REPORT_FAILED = "store.eviction_report_failed"


#: One value: a single buffer or parts concatenated in order.
Value: TypeAlias = Buffer | Sequence[Buffer]
#: One destination: a single writable buffer or parts filled in order.
Destination: TypeAlias = Buffer | Sequence[Buffer]


class Status(enum.Enum):
    """The outcome of one key in one batch call."""

    OK = "ok"
    NOT_FOUND = "not_found"
    NO_SPACE = "no_space"
    TRANSFER_FAILED = "transfer_failed"
    TIMEOUT = "timeout"
    CORRUPT = "corrupt"

    @property
    def is_ok(self) -> bool:
        return self is Status.OK


#: Per thread: the stack of open ``collect_late_calls`` lists (innermost last).
_late_collectors = threading.local()


@contextlib.contextmanager
def collect_late_calls() -> Iterator[list[Future[object]]]:
    """Collect the completion handles of calls made inside the block that answered while still running.

    Usage: ``with collect_late_calls() as late: statuses = store.get_into(keys, destinations)``; if
    ``late`` is not empty, the destinations (for ``put``: the values) may still be read or written until
    every future in it is done. Nests; per thread (a store call reports on the thread that made it).
    """
    stack: list[list[Future[object]]] | None = getattr(_late_collectors, "stack", None)
    if stack is None:
        stack = _late_collectors.stack = []
    late: list[Future[object]] = []
    stack.append(late)
    try:
        yield late
    finally:
        popped = stack.pop()
        assert popped is late, "collect_late_calls blocks closed out of order"


def register_late_call(done: Future[object]) -> None:
    """Called by a store (on the caller's thread) when it answers a call whose work goes on until ``done``.

    Every open ``collect_late_calls`` block of this thread gets the handle. Without one, nobody reuses
    the buffers early (the caller did not ask), so there is nothing to record.
    """
    for late in getattr(_late_collectors, "stack", ()):
        late.append(done)


class StoreError(Exception):
    """A store could not be opened or used as configured (bad URL, bad parameter, missing dependency)."""


@dataclass(frozen=True)
class StoreStats:
    """A point-in-time summary of a store, for ``hybridkv store stats`` and metrics."""

    url: str
    num_keys: int | None = None
    num_bytes: int | None = None
    capacity_bytes: int | None = None
    extra: dict[str, object] = field(default_factory=dict)


#: Wrapper layers ``find_layer`` looks through at most (``FramedStore.backend``, a view's ``inner``, ...).
_MAX_LAYERS = 8


def find_layer(store: object, kind: type[_LayerT]) -> _LayerT | None:
    """The first layer of ``store`` that is a ``kind`` (a class, or a runtime-checkable protocol): ``store``
    itself, then its ``backend`` (a ``FramedStore``'s), then each view's ``inner`` (a ``faulty+`` view's);
    None when no layer is. For tools and metrics that need one backend's own calls."""
    current: object | None = store
    for _ in range(_MAX_LAYERS):
        if current is None:
            return None
        if isinstance(current, kind):
            return current
        current = getattr(current, "backend", None) or getattr(current, "inner", None)
    return None


def contiguous_shares(num_keys: int, num_shares: int) -> list[tuple[int, int]]:
    """``[low, high)`` index ranges that split a batch of ``num_keys`` keys into ``min(num_shares, num_keys)``
    contiguous shares, in order, whose sizes differ by at most one (non-empty, but for the one share of an
    empty batch): how concurrent readers of one batch divide it, each with a store call of its own."""
    num_shares = max(1, min(num_shares, num_keys))
    bounds = [num_keys * share // num_shares for share in range(num_shares + 1)]
    return list(itertools.pairwise(bounds))


def with_extra(stats: StoreStats, extra: dict[str, object], *, url: str | None = None) -> StoreStats:
    """``stats`` with ``extra`` merged over its extras (and its ``url`` replaced when given): how a wrapper
    reports its inner store's stats plus its own."""
    return replace(stats, url=stats.url if url is None else url, extra={**stats.extra, **extra})


@dataclass(frozen=True)
class Evictions:
    """What a store's own eviction removed since the previous report (:class:`EvictionReporter`)."""

    #: the digests (``hybridkv.store.frame.key_digest``) of the evicted keys, oldest first
    digests: tuple[bytes, ...] = ()
    #: ``False``: some evictions since the previous report were lost (the reader fell behind the store's
    #: record of them, or could not read it): any key may be gone
    complete: bool = True


@runtime_checkable
class EvictionReporter(Protocol):
    """A backend that reports what its own eviction removed; found through wrapper layers with
    :func:`find_layer` (the memory and file backends are; Mooncake evicts inside its servers, unseen).

    Contract of ``take_evictions()``: every key the store evicted (capacity and quota eviction, and a put's
    frames its own batch evicted at once) since this handle was opened or last asked, by any handle sharing
    the store (the memory store: every handle of its table in this process; the file store: every process
    sharing the directory, through its eviction log), as key digests -- the file store names its files by
    digest, so an eviction costs it no header read. An eviction is recorded only after the entry is gone.
    ``remove`` and ``remove_prefix`` are not evictions and are not reported. A key may be reported that was
    stored again since (the report says it was evicted, not that it is absent now)."""

    def take_evictions(self) -> Evictions: ...


@runtime_checkable
class Store(Protocol):
    """A key-value byte store with typed per-key results. See the module docstring for the contract."""

    @property
    def url(self) -> str:
        """The URL this store was opened from, with secrets (if any) removed."""
        ...

    def exists(self, keys: Sequence[str]) -> list[Status]:
        """``OK`` if a complete value is stored under the key, ``NOT_FOUND`` if not, or an error status."""
        ...

    def put(self, keys: Sequence[str], values: Sequence[Value]) -> list[Status]:
        """Store each value under its key unless the key already exists (then ``OK``, nothing written)."""
        ...

    def get_into(self, keys: Sequence[str], destinations: Sequence[Destination]) -> list[Status]:
        """Copy each stored payload into its destination; its total size must equal the payload length."""
        ...

    def answers_late(self, op: str) -> bool:
        """Whether a ``get_into`` (``op="get"``) or ``put`` (``op="put"``) may answer ``TIMEOUT`` while it
        goes on using the caller's buffers (see "Buffer ownership"); ``False``: it always returns first."""
        ...

    @property
    def supports_retention(self) -> bool:
        """Whether ``retain`` keeps entries; ``False``: it answers ``TRANSFER_FAILED`` for every key."""
        ...

    def retain(self, keys: Sequence[str], until: float) -> list[Status]:
        """Keep each stored key ahead of ordinary entries until ``until`` (``time.time()`` seconds; in the
        past: release it), within a budget (``hybridkv.store.retention``): ``OK``, ``NOT_FOUND`` if absent,
        ``TRANSFER_FAILED`` where the store cannot retain."""
        ...

    def remove(self, keys: Sequence[str]) -> list[Status]:
        """Delete each key: ``OK`` if removed, ``NOT_FOUND`` if absent, or an error status."""
        ...

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        """Yield the stored keys that start with ``prefix`` (order unspecified)."""
        ...

    def remove_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix``; returns how many were removed."""
        ...

    def stats(self) -> StoreStats:
        """Summarize the store."""
        ...

    def close(self) -> None:
        """Release every handle and thread. Idempotent. Data in persistent backends survives."""
        ...
