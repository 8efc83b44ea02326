"""Host staging of the block data path: the pinned slab pool, the per-direction lanes, staged batches.

torch + numpy only (no vLLM, no structlog): the GPU benchmark imports this on a bare torch host.

One object per device, :class:`StagingContext`, owns everything a staged transfer holds while it runs:

- its :class:`PinnedPool` of equal-size host slabs (page-locked on CUDA), which bounds the host memory of
  every transfer in flight: a batch that gets no slab within its timeout is dropped or deferred by the
  caller, never allocated beyond the budget;
- per direction ("save": device -> host, "load": host -> device) a *lane*: a kernel stream that packs or
  unpacks device blocks, a copy stream for the PCIe copies, and two device staging buffers used in turn.

The lane contract (what :class:`~hybridkv.connector.datapath.BlockMover` relies on):

- :meth:`StagingContext.lane` serializes one direction's transfers: it holds that direction's lock while the
  caller enqueues, makes the kernel stream current, and queues it behind the caller's *fence* (the event of
  the step that wrote or will read the blocks), so no device work of the transfer runs before the fence.
- Work is only *enqueued* inside ``lane``; :meth:`StagingContext.sync_lane` (after the ``with``, outside the
  lock, so the next transfer of that direction can enqueue meanwhile) blocks the host until the lane's
  streams ran everything queued so far. A transfer is complete -- its slab bytes final, its blocks written
  -- only once ``sync_lane`` returned.
- A lane's two staging buffers are free when ``lane`` yields: every earlier transfer of the direction was
  synchronized before its slab or blocks were handed on.

A :class:`StagedBlocks` is one batch's host bytes as store parts; it owns its slab (when it has one) until
:meth:`StagedBlocks.release` gives it back to the pool, and writes destination bytes into the blocks through
the callback of the mover that made it (:meth:`StagedBlocks.commit`).
"""

from __future__ import annotations

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
        kernel_max_batch_bytes: int | None = None,
    ):
        unknown = set(kernel_directions) - set(DIRECTIONS)
        assert not unknown, f"kernel_directions: unknown direction(s) {sorted(unknown)}"
        self.device = torch.device(device)
        self.pool = pool
        #: Directions ("save": device -> host, "load": host -> device) whose batches one copy kernel moves
        #: straight between the pages and the pinned slab (``hybridkv.connector.copy_kernels``), for the
        #: movers whose pages it supports; the other directions pack into device staging and copy by DMA.
        self.kernel_directions = frozenset(kernel_directions)
        #: Batches larger than this take the DMA path in every direction (None: no limit).
        self.kernel_max_batch_bytes = kernel_max_batch_bytes
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
    :meth:`commit` then writes them into the blocks. Either way the arrays may alias a pooled slab: do not
    touch them after :meth:`release` / :meth:`commit`. Staged parts are views the mover keeps per slab and
    hands out again with that slab's next batch: read and write their bytes, never their shape or flags.

    Built by a :class:`~hybridkv.connector.datapath.BlockMover` only: ``pool`` is where ``slab`` goes back,
    ``write_back`` how :meth:`commit` writes the kept blocks into the mover's caches.
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
        host_copies: list[list[tuple[int, np.ndarray]]] | None = None,
        after: Fence = None,
    ) -> None:
        assert slab is None or pool is not None, "StagedBlocks: a slab needs the pool it goes back to"
        self.block_ids = list(block_ids)
        self.parts = parts
        self._block_nbytes = block_nbytes
        self._write_back = write_back
        self._pool = pool
        self._slab = slab
        self._host_copies = host_copies
        self._after = after
        self._released = False

    @property
    def slab(self) -> torch.Tensor | None:
        """The pooled host slab the parts live in (staged path), or None (direct path, or released)."""
        return self._slab

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
    def nbytes(self) -> int:
        return len(self.block_ids) * self._block_nbytes

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

    def release(self) -> None:
        """Return the slab (if any) to the pool without writing anything. Idempotent."""
        if self._released:
            return
        self._released = True
        if self._slab is not None:
            slab, self._slab = self._slab, None
            assert self._pool is not None
            self._pool.release(slab)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
