"""Host staging of the block data path: the pinned slab pool, the per-direction lanes, staged batches.

torch + numpy only (no vLLM, no structlog): the GPU benchmark imports this on a bare torch host.

One object per device, :class:`StagingContext`, owns everything a staged transfer holds while it runs:

- its :class:`PinnedPool` of equal-size host slabs (page-locked on CUDA), which bounds the host memory of
  every transfer in flight: a batch that gets no slab within its timeout is dropped or deferred by the
  caller, never allocated beyond the budget;
- per direction ("save": device -> host, "load": host -> device) a *lane*: a kernel stream that packs or
  unpacks device blocks, a copy stream for the PCIe copies, and two device staging buffers used in turn.

The lane contract (what :class:`~hybridkv.connector.datapath.movers.BlockMover` relies on):

- :meth:`StagingContext.lane` serializes one direction's transfers: it holds that direction's lock while the
  caller enqueues, makes the kernel stream current, and queues it behind the caller's *fence* (the event of
  the step that wrote or will read the blocks), so no device work of the transfer runs before the fence.
- Work is only *enqueued* inside ``lane``; :meth:`StagingContext.sync_lane` (after the ``with``, outside the
  lock, so the next transfer of that direction can enqueue meanwhile) blocks the host until the lane's
  streams ran everything queued so far. A transfer is complete -- its slab bytes final, its blocks written
  -- only once ``sync_lane`` returned.
- A lane's two staging buffers are free when ``lane`` yields: every earlier transfer of the direction was
  synchronized before its slab or blocks were handed on.

Host caches have no slabs, but a store call that may answer late must not be handed their pages
(:mod:`hybridkv.connector.worker.ownership`): its batch gets a private buffer instead, from the worker's
:class:`HostBufferPool` of pre-faulted buffers that on-time calls give back for reuse and late calls take out
of the pool for good.

A :class:`StagedBlocks` is one batch's host bytes as store parts; it owns its slab or pooled host buffer
(when it has one) until :meth:`StagedBlocks.release` gives it back, and writes destination bytes into the
blocks through the callback of the mover that made it (:meth:`StagedBlocks.commit`).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeAlias

import numpy as np
import torch

#: What a gather or scatter waits for before touching device memory: a CUDA event, or None (no wait).
Fence: TypeAlias = "torch.cuda.Event | None"

#: Every per-layer segment of a slab (and of a device staging buffer) starts on this boundary.
ALIGN = 256

#: Default device staging bytes of each direction: two buffers, each one chunk (half of it).
DEFAULT_STAGE_BYTES = 32 << 20

#: The transfer directions, each with its own lane.
DIRECTIONS = ("save", "load")


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ---------------------------------------------------------------------------------------------- pool
class PinnedPool:
    """A bounded pool of equal-size host staging slabs (page-locked when ``pin``).

    At most ``budget_bytes // slab_bytes`` slabs (at least one) ever exist; they are allocated on first
    demand and reused until :meth:`close` (no per-step pinned allocation). :meth:`acquire` never allocates
    beyond the budget: when every slab is out it waits at most ``timeout`` seconds and then returns None,
    so a caller can drop or defer its work instead of stalling. Thread-safe.
    """

    def __init__(self, slab_bytes: int, budget_bytes: int, *, pin: bool | None = None) -> None:
        if slab_bytes <= 0:
            raise ValueError(f"slab_bytes must be > 0, got {slab_bytes}")
        self.slab_bytes = align(slab_bytes)
        self.max_slabs = max(1, budget_bytes // self.slab_bytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._cv = threading.Condition()
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._closed = False

    @property
    def budget_bytes(self) -> int:
        return self.max_slabs * self.slab_bytes

    @property
    def in_use(self) -> int:
        with self._cv:
            return self._allocated - len(self._free)

    @property
    def allocated(self) -> int:
        with self._cv:
            return self._allocated

    def acquire(self, timeout: float = 0.0) -> torch.Tensor | None:
        """A free slab (uint8, ``slab_bytes`` long), or None if none frees up within ``timeout`` seconds."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cv:
            while True:
                if self._closed:
                    raise RuntimeError("PinnedPool is closed")
                if self._free:
                    return self._free.pop()
                if self._allocated < self.max_slabs:
                    self._allocated += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
        try:
            return torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin)
        except BaseException:
            with self._cv:
                self._allocated -= 1
                self._cv.notify()
            raise

    def release(self, slab: torch.Tensor) -> None:
        """Give a slab back. Its bytes may be overwritten by the next :meth:`acquire` at once."""
        with self._cv:
            if self._closed:
                self._allocated -= 1
                return
            self._free.append(slab)
            self._cv.notify()

    def close(self) -> None:
        """Drop the free slabs (slabs still out are dropped on release). Idempotent."""
        with self._cv:
            self._closed = True
            self._allocated -= len(self._free)
            self._free.clear()
            self._cv.notify_all()


# ------------------------------------------------------------------------------------ host buffers
#: Host buffer capacities are rounded up to one of 2**_SIZE_STEP_BITS sizes per power of two (at most
#: 12.5 % more than asked) and whole 4 KiB pages, so batches of slightly different sizes share buffers.
_SIZE_STEP_BITS = 3
_PAGE_BYTES = 4096


def host_buffer_capacity(nbytes: int) -> int:
    """The capacity a :class:`HostBufferPool` allocates for a request of ``nbytes``."""
    n = max(nbytes, 1)
    step = max(_PAGE_BYTES, 1 << max(0, n.bit_length() - 1 - _SIZE_STEP_BITS))
    return (n + step - 1) // step * step


class HostBuffer:
    """One buffer from a :class:`HostBufferPool`, out to one batch: ``array`` (uint8, at least the bytes
    asked for). Give it back with :meth:`release` once no store call uses it any more, or take it out of
    the pool for good with :meth:`forfeit` while a late call still holds it."""

    __slots__ = ("_pool", "_pooled", "_state", "array")

    def __init__(self, pool: HostBufferPool, array: np.ndarray, *, pooled: bool) -> None:
        self.array = array
        self._pool = pool
        #: counted in the pool's bytes, and reused after release (False: a one-off, or forfeited)
        self._pooled = pooled
        self._state = "out"  # "out" -> "released" | "forfeited" (-> "released")

    @property
    def capacity(self) -> int:
        return int(self.array.nbytes)

    @property
    def pooled(self) -> bool:
        return self._pooled

    def release(self) -> None:
        """No store call uses the buffer any more: back to the pool (a forfeited or one-off buffer is only
        dropped). Its bytes may be overwritten by the next :meth:`HostBufferPool.acquire` at once.
        Idempotent."""
        self._pool._release(self)

    def forfeit(self) -> None:
        """A late store call still holds the buffer: it leaves the pool for good (the pool stops counting it
        and may allocate a replacement); :meth:`release` later only drops it. Idempotent."""
        self._pool._forfeit(self)


class HostBufferPool:
    """Pre-faulted host buffers that the host path's private batches reuse (a store call that may answer
    late is never handed KV pages). Thread-safe.

    :meth:`acquire` hands out the smallest idle buffer that holds the request, else allocates one of
    :func:`host_buffer_capacity` and touches every page of it once (so no store call pays its page
    faults), evicting idle buffers (smallest first) to stay within ``budget_bytes`` of pooled buffers,
    idle or out. When the buffers out already take the budget, the request gets a one-off buffer (not
    pre-faulted, dropped on release): a caller never waits and memory stays bounded by what is in use plus
    the budget. A buffer a late call holds is :meth:`HostBuffer.forfeit`-ed: it is never handed out again
    (how many may be held so is bounded by the caller: ``ownership.Quarantine``).
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._idle: list[HostBuffer] = []  # by capacity, ascending
        self._pooled_bytes = 0  # capacity of the pooled buffers, idle or out
        self._num_bytes_out = 0  # capacity of the buffers out (pooled, one-off, forfeited), not released
        #: pooled buffers allocated (each pre-faulted once), one-off buffers, acquires served by an idle
        #: buffer, buffers forfeited to late calls, idle buffers dropped to make room
        self.num_allocated = 0
        self.num_one_off = 0
        self.num_reused = 0
        self.num_forfeited = 0
        self.num_evicted = 0

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return self._pooled_bytes

    @property
    def num_idle(self) -> int:
        with self._lock:
            return len(self._idle)

    @property
    def num_bytes_out(self) -> int:
        """Capacity of the buffers handed out and not yet released: pooled, one-off, and forfeited ones a
        late call still holds."""
        with self._lock:
            return self._num_bytes_out

    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of at least ``nbytes`` that no store call uses (never waits)."""
        capacity = host_buffer_capacity(nbytes)
        with self._lock:
            for i, idle in enumerate(self._idle):
                if idle.capacity >= nbytes:
                    del self._idle[i]
                    idle._state = "out"
                    self.num_reused += 1
                    self._num_bytes_out += idle.capacity
                    return idle
            while self._idle and self._pooled_bytes + capacity > self.budget_bytes:
                self._pooled_bytes -= self._idle.pop(0).capacity
                self.num_evicted += 1
            pooled = self._pooled_bytes + capacity <= self.budget_bytes
            if pooled:
                self._pooled_bytes += capacity
                self.num_allocated += 1
            else:
                self.num_one_off += 1
        try:
            if not pooled:
                buffer = HostBuffer(self, np.empty(nbytes, dtype=np.uint8), pooled=False)
            else:
                array = np.empty(capacity, dtype=np.uint8)
                array.fill(0)  # touch every page now, once, rather than under each store call
                buffer = HostBuffer(self, array, pooled=True)
        except BaseException:
            if pooled:
                with self._lock:
                    self._pooled_bytes -= capacity
            raise
        with self._lock:
            self._num_bytes_out += buffer.capacity
        return buffer

    def _release(self, buffer: HostBuffer) -> None:
        with self._lock:
            if buffer._state == "released":
                return
            keep = buffer._state == "out" and buffer._pooled
            buffer._state = "released"
            self._num_bytes_out -= buffer.capacity
            if keep:
                sizes = [b.capacity for b in self._idle]
                self._idle.insert(bisect.bisect_right(sizes, buffer.capacity), buffer)

    def _forfeit(self, buffer: HostBuffer) -> None:
        with self._lock:
            if buffer._state != "out":
                assert buffer._state == "forfeited", "a buffer forfeited after its release"
                return
            buffer._state = "forfeited"
            self.num_forfeited += 1
            if buffer._pooled:
                buffer._pooled = False
                self._pooled_bytes -= buffer.capacity

    def drop_idle(self) -> int:
        """Free every idle buffer (sleep mode, shutdown); buffers out stay theirs. Returns the bytes freed."""
        with self._lock:
            freed = sum(buffer.capacity for buffer in self._idle)
            self._pooled_bytes -= freed
            self.num_evicted += len(self._idle)
            self._idle.clear()
        return freed


# ------------------------------------------------------------------------------------------ lanes
def record_event(stream: Any) -> Fence:
    """An event recorded on ``stream`` now (None when there is no stream: the CPU path)."""
    if stream is None:
        return None
    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ev.record(stream)
    return ev


def queue_behind(stream: Any, event: Fence) -> None:
    """Queue ``stream``'s next work behind ``event`` (no-op without a stream or an event)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


@dataclass(frozen=True)
class Lane:
    """One direction's resources for one transfer, held under that direction's lock.

    ``kernel``: the stream that packs (``index_select``) or unpacks (``index_copy_``) device blocks; it has
    waited on the transfer's fence and is the current stream inside :meth:`StagingContext.lane`.
    ``copy``: the stream of the host<->device copies. ``buffers``: two device staging buffers of
    ``chunk_bytes``; chunk i uses ``buffers[i % 2]``, so packing chunk i+1 overlaps the copy of chunk i.
    Streams are None on the CPU (everything runs in program order there).
    """

    buffers: tuple[torch.Tensor, torch.Tensor]
    kernel: Any
    copy: Any

    def copying(self) -> contextlib.AbstractContextManager[object]:
        """Make the copy stream current (CUDA; no-op on CPU)."""
        return torch.cuda.stream(self.copy) if self.copy is not None else contextlib.nullcontext()


class StagingContext:
    """What the staged path shares per device: the pinned pool, side streams, device staging buffers.

    One per worker (device); every group's :class:`BlockMover` uses it. Saves (device->host) and loads
    (host->device) each have their own pair of streams (a kernel stream for packing / unpacking, a copy
    stream for the PCIe copies) and their own two staging buffers, so a long save never delays a load.
    ``stage_bytes`` is one direction's device staging memory, split into two buffers of ``chunk_bytes``
    (the chunk size). Within a transfer the buffers alternate and are handed between the two streams by
    events; transfers of one direction are serialized by a per-direction lock and each ends with the host
    waiting for both streams, so a transfer starts with both buffers free.
    """

    def __init__(
        self,
        device: torch.device | str,
        pool: PinnedPool,
        *,
        stage_bytes: int = DEFAULT_STAGE_BYTES,
        kernel_directions: frozenset[str] = frozenset(),
        pack_by_kernel: bool = True,
    ):
        unknown = set(kernel_directions) - set(DIRECTIONS)
        assert not unknown, f"kernel_directions: unknown direction(s) {sorted(unknown)}"
        self.device = torch.device(device)
        self.pool = pool
        #: Directions ("save": device -> host, "load": host -> device) whose batches one copy kernel moves
        #: straight between the pages and the pinned slab (``hybridkv.connector.datapath.copy_kernels``), for the
        #: movers whose pages it supports; the other directions pack into device staging and copy by DMA.
        self.kernel_directions = frozenset(kernel_directions)
        #: Whether the DMA path packs its staging chunks with the copy kernel where it can move the pages
        #: (else one ``index_select`` / ``index_copy_`` per layer tensor per chunk).
        self.pack_by_kernel = pack_by_kernel
        self.is_cuda = self.device.type == "cuda"
        self._chunk_bytes = align(max(1, stage_bytes // 2))
        self._streams: dict[str, tuple[Any, Any]] = {}  # direction -> (kernel stream, copy stream)
        self._stages: dict[str, torch.Tensor] = {}  # direction -> 2 * chunk_bytes of device memory
        self._locks = {d: threading.Lock() for d in DIRECTIONS}
        empty = torch.empty(0, dtype=torch.uint8)
        self._no_buffers = (empty, empty)  # a lane's buffers when it needs no device staging
        if self.is_cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            for d in DIRECTIONS:
                self._streams[d] = (
                    torch.cuda.Stream(device=self.device),  # type: ignore[no-untyped-call]
                    torch.cuda.Stream(device=self.device),  # type: ignore[no-untyped-call]
                )

    def require_stage(self, nbytes: int) -> None:
        """Make each staging buffer at least ``nbytes`` (before first use; movers call it when built)."""
        need = align(nbytes)
        if need > self._chunk_bytes:
            assert not self._stages, "staging size must be settled before the first transfer"
            self._chunk_bytes = need

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one device staging buffer: the most one host<->device copy of a transfer moves."""
        return self._chunk_bytes

    @property
    def stage_bytes(self) -> int:
        """Device staging bytes of one direction (two buffers of ``chunk_bytes``)."""
        return 2 * self._chunk_bytes

    def fence(self) -> Fence:
        """Record an event on the current stream of this device (CUDA; None on CPU).

        Give it to :meth:`BlockMover.gather` / :meth:`BlockMover.scatter_targets`: their device work is
        queued behind everything the calling thread's current stream had queued when ``fence()`` ran.
        """
        if not self.is_cuda:
            return None
        return record_event(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def lane(self, direction: str, after: Fence, *, staged: bool = True) -> Iterator[Lane]:
        """Serialized enqueue on ``direction``: its kernel stream (behind ``after``) current, its buffers
        (``staged``; else no device staging is allocated and the buffers are empty). Only enqueue inside;
        :meth:`sync_lane` afterwards waits for the work (see the module docstring)."""
        assert direction in self._locks, f"StagingContext.lane: unknown direction {direction!r}"
        with self._locks[direction]:
            stage = self._stages.get(direction)
            if stage is None and staged:
                stage = torch.empty(2 * self._chunk_bytes, dtype=torch.uint8, device=self.device)
                self._stages[direction] = stage
            if stage is None:
                buffers = self._no_buffers
            else:
                buffers = (stage[: self._chunk_bytes], stage[self._chunk_bytes :])
            if not self.is_cuda:
                yield Lane(buffers, None, None)
                return
            kernel, copy = self._streams[direction]
            with torch.cuda.device(self.device), torch.cuda.stream(kernel):
                queue_behind(kernel, after)
                yield Lane(buffers, kernel, copy)

    def sync_lane(self, direction: str, *, copy_stream: bool = True) -> None:
        """Block until everything queued so far on ``direction``'s kernel stream, and its copy stream
        (``copy_stream``; a kernel-only transfer queued nothing there), is done (CUDA; no-op on CPU)."""
        if self.is_cuda:
            kernel, copy = self._streams[direction]
            for stream in (kernel, copy) if copy_stream else (kernel,):
                ev = record_event(stream)
                assert ev is not None
                ev.synchronize()

    def close(self) -> None:
        """Drop the device staging buffers and close the pool (slabs still out are dropped on release)."""
        self._stages.clear()
        self.pool.close()


# ------------------------------------------------------------------------------------------- batches
#: How a batch from :meth:`BlockMover.scatter_targets` writes its kept blocks: ``(batch, keep flags)``.
WriteBack: TypeAlias = "Callable[[StagedBlocks, list[bool]], None]"


class StagedBlocks:
    """Host bytes of a batch of blocks, as store parts; release (or use as a context manager) when done.

    ``parts[i]`` is block ``block_ids[i]``'s value: one writable uint8 numpy array per layer tensor, in
    part order. From :meth:`BlockMover.gather` the bytes are final when it returns (hand them to
    ``Store.put``). From :meth:`BlockMover.scatter_targets` they are destinations (``Store.get_into``);
    :meth:`commit` then writes them into the blocks. Either way the arrays may alias a pooled slab or host
    buffer: do not touch them after :meth:`release` / :meth:`commit`. Staged parts are views the mover keeps
    per slab and hands out again with that slab's next batch: read and write their bytes, never their shape
    or flags.

    Built by a :class:`~hybridkv.connector.datapath.movers.BlockMover` only: ``pool`` is where ``slab`` goes back
    (a private host ``buffer`` knows its own pool), ``write_back`` how :meth:`commit` writes the kept blocks
    into the mover's caches.
    """

    def __init__(
        self,
        block_ids: Sequence[int],
        parts: list[list[np.ndarray]],
        *,
        block_nbytes: int,
        write_back: WriteBack,
        pool: PinnedPool | None = None,
        slab: torch.Tensor | None = None,
        buffer: HostBuffer | None = None,
        host_copies: list[list[tuple[int, np.ndarray]]] | None = None,
        after: Fence = None,
    ) -> None:
        assert slab is None or pool is not None, "StagedBlocks: a slab needs the pool it goes back to"
        assert slab is None or buffer is None, "StagedBlocks: a slab or a host buffer, not both"
        self.block_ids = list(block_ids)
        self.parts = parts
        self._block_nbytes = block_nbytes
        self._write_back = write_back
        self._pool = pool
        self._slab = slab
        self._buffer = buffer
        self._host_copies = host_copies
        self._after = after
        self._released = False

    @property
    def slab(self) -> torch.Tensor | None:
        """The pooled host slab the parts live in (staged path), or None (direct path, or released)."""
        return self._slab

    @property
    def buffer(self) -> HostBuffer | None:
        """The pooled private host buffer the parts live in (host path, a store call that may answer late),
        or None (staged or direct path, or released)."""
        return self._buffer

    @property
    def after(self) -> Fence:
        """The fence :meth:`commit`'s device writes wait for (staged path; None on the direct path)."""
        return self._after

    @property
    def host_copies(self) -> list[list[tuple[int, np.ndarray]]] | None:
        """Direct path, destinations: per block, (tensor index, array) pairs :meth:`commit` copies into
        that block's page (strided pages, or every page of a private batch); None on the staged path."""
        return self._host_copies

    @property
    def block_nbytes(self) -> int:
        return self._block_nbytes

    @property
    def nbytes(self) -> int:
        return len(self.block_ids) * self._block_nbytes

    def write(self, ok: Sequence[bool]) -> None:
        """Write the destination bytes of the blocks flagged in ``ok`` into their blocks now, keeping the
        batch (to write the rest, or release it, later). Threads may write one batch at once when their
        ``ok`` flags are disjoint. Host path; :meth:`commit` is the one-call form."""
        if self._released:
            raise RuntimeError("write after release")
        keep = [bool(x) for x in ok]
        if len(keep) != len(self.block_ids):
            raise ValueError(f"ok has {len(keep)} flags for {len(self.block_ids)} blocks")
        if any(keep):
            self._write_back(self, keep)

    def commit(self, ok: Sequence[bool] | None = None) -> None:
        """Write the destination bytes into the device (or host) blocks, then release.

        ``ok[i]`` False skips block i (its bytes are unspecified, e.g. a store miss); default: all. On
        return the blocks hold the bytes (CUDA: the copies have completed, so the blocks may be reported
        loaded). Only for batches from :meth:`BlockMover.scatter_targets`.
        """
        if self._released:
            raise RuntimeError("commit after release")
        try:
            keep = [True] * len(self.block_ids) if ok is None else [bool(x) for x in ok]
            if len(keep) != len(self.block_ids):
                raise ValueError(f"ok has {len(keep)} flags for {len(self.block_ids)} blocks")
            if any(keep):
                self._write_back(self, keep)
        finally:
            self.release()

    def quarantine(self) -> None:
        """A late store call took this batch (``ownership.LateOwnership.take``): a private host buffer leaves
        its pool for good now, so it is never handed out again (:meth:`release` then only drops it). A slab
        stays out of its pool until :meth:`release`, which the quarantine calls once the call returned."""
        if self._buffer is not None:
            self._buffer.forfeit()

    def release(self) -> None:
        """Return the slab or host buffer (if any) to its pool without writing anything. Idempotent."""
        if self._released:
            return
        self._released = True
        if self._slab is not None:
            slab, self._slab = self._slab, None
            assert self._pool is not None
            self._pool.release(slab)
        if self._buffer is not None:
            buffer, self._buffer = self._buffer, None
            buffer.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
