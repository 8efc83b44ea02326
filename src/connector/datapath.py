"""Whole KV blocks between vLLM's per-layer caches and host buffers the store reads and writes.

torch + numpy only (no vLLM, no structlog): the GPU benchmark imports this on a bare torch host.

A *group block* is one block id's page in every layer tensor of a store group, concatenated in layer order
(a layer given as a list of tensors sharing one storage contributes each tensor's page in list order). A
:class:`BlockMover` hands a batch of blocks to the store as *parts*: one uint8 numpy array per (block,
layer tensor), in that order -- exactly what ``Store.put`` takes as a value and ``Store.get_into`` as a
destination.

Two paths, chosen by where the caches live:

- **Direct** (CPU tensors): the parts *are* the pages (zero-copy numpy views). A page that is not
  contiguous (a strided Mamba state view) is copied once into a private staging array. There is no pool
  and no batch limit.
- **Staged** (CUDA tensors; also usable on CPU tensors, for tests): a batch is laid out in one host *slab*
  from a bounded :class:`PinnedPool`. The layout is fixed per mover, whatever the batch size: for each
  layer tensor a 256-byte aligned segment of ``max_blocks`` pages, batch row i at page i, so the numpy
  views of a slab's pages are built once per slab. Device->host: per staging-sized chunk, ``index_select``
  over the block dim packs pages into a device staging buffer (kernel stream, behind the caller's *fence*),
  then async copies move it into the pinned slab (copy stream; one copy per run of pages contiguous in the
  slab, one per chunk once a batch fills the slab). Each direction has two staging buffers used in turn,
  so packing chunk i+1 overlaps the PCIe copy of chunk i; events hand a buffer from one stream to the
  other and back. Host->device is the mirror image (copy chunk i+1 in while ``index_copy_`` unpacks chunk
  i into the destination blocks, only the unpacking behind the fence). Both end by synchronizing both of
  the direction's streams.

Why ``index_select`` into a staging buffer rather than one copy per (block, layer): per-page copies cost a
launch each (32 layers x 256 blocks = 8192 ``cudaMemcpyAsync``), while the device-side gather runs at HBM
speed (256 blocks x 64 KiB: ``index_select`` 1.1 TB/s, ``index_copy_`` 1.4 TB/s) and leaves a few large
PCIe copies. Measured on H200 machines (torch 2.11/CUDA 13, ``hybridkv bench datapath --repeats 9``, 32 MiB
staging per direction, scattered block ids; ours / one contiguous pinned copy of the same bytes timed next
to it, medians of 9 interleaved rounds, range over 6 sessions; the copy itself ran at 51-55 GB/s):

==================================  ====================  ====================
batch                               gather (D2H) / copy   scatter (H2D) / copy
==================================  ====================  ====================
attn 32 layers x 64 KiB, 16 blocks  0.31-0.48             0.33-0.62
attn, 64 blocks                     0.78-0.88             0.81-0.88
attn, 256 blocks                    0.92-0.96             0.89-0.94
Mamba 4 x 1 MiB (strided conv), 16  0.65-0.75             0.73-0.86
Mamba, 64 blocks                    0.90-0.95             0.89-0.95
Mamba, 256 blocks                   0.96-0.98             0.94-0.97
==================================  ====================  ====================

One copy per page ran at 3-6 GB/s for attention pages. What is left is host time: the host enqueues one
``index_select`` / ``index_copy_`` per layer tensor per chunk (tens of microseconds each), which for 64
attention blocks (4 layers per 16 MiB chunk) is about as long as the bus takes to move the chunk, so the
result follows the host's speed; the bus also waits while the first chunk is packed.

The copy kernel (``StagingContext.kernel_directions``, ``cuda_copy``): for a group whose pages are contiguous,
one Triton launch moves the whole batch straight between the pages and the pinned slab over PCIe (same slab
layout, no device staging, no DMA copy); see ``hybridkv.connector.copy_kernels`` and docs/performance.md.

Fences. On CUDA the forward runs asynchronously: when ``wait_for_save`` returns on the host, the kernels
that write this step's blocks may still be queued. :meth:`StagingContext.fence` records an event on the
current (compute) stream; a gather given that fence reads the blocks only after that event, so it sees
every write enqueued before the fence. Loads take a fence too (recorded in ``start_load_kv``): the
host->device writes land after whatever the compute stream had queued for those blocks (e.g. zeroing).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeAlias

import numpy as np
import torch

#: What a gather or scatter waits for before touching device memory: a CUDA event, or None (no wait).
Fence: TypeAlias = "torch.cuda.Event | None"

_ALIGN = 256  # every per-layer segment of a slab (and of the device staging buffer) starts on this boundary

#: Batch sizes whose chunk plans and staging views a mover keeps (past that it starts over).
_MAX_CACHED_BATCH_SIZES = 64

#: Default device staging bytes of each direction: two buffers, each one chunk (half of it).
DEFAULT_STAGE_BYTES = 32 << 20


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _page_nbytes(t: torch.Tensor) -> int:
    return int(t[0].numel()) * t.element_size()


def flatten_layers(layers: Sequence[torch.Tensor | Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The group's layer tensors in part order (a list-of-tensors layer contributes each, in order)."""
    out: list[torch.Tensor] = []
    for layer in layers:
        if isinstance(layer, torch.Tensor):
            out.append(layer)
        else:
            out.extend(layer)
    return out


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
        self.slab_bytes = _align(slab_bytes)
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


# ------------------------------------------------------------------------------------------ context
def _record(stream: Any) -> Fence:
    """An event recorded on ``stream`` now (None when there is no stream: the CPU path)."""
    if stream is None:
        return None
    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ev.record(stream)
    return ev


def _wait(stream: Any, event: Fence) -> None:
    """Queue ``stream``'s next work behind ``event`` (no-op without a stream or an event)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


@dataclass(frozen=True)
class _Lane:
    """One direction's resources for one transfer, held under that direction's lock.

    ``kernel``: the stream that packs (``index_select``) or unpacks (``index_copy_``) device blocks; it has
    waited on the transfer's fence and is the current stream inside :meth:`StagingContext._lane`.
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
        unknown = set(kernel_directions) - {"save", "load"}
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
        self._chunk_bytes = _align(max(1, stage_bytes // 2))
        self._streams: dict[str, tuple[Any, Any]] = {}  # direction -> (kernel stream, copy stream)
        self._stages: dict[str, torch.Tensor] = {}  # direction -> 2 * chunk_bytes of device memory
        self._locks = {"save": threading.Lock(), "load": threading.Lock()}
        empty = torch.empty(0, dtype=torch.uint8)
        self._no_buffers = (empty, empty)  # a lane's buffers when it needs no device staging
        if self.is_cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            for d in ("save", "load"):
                self._streams[d] = (
                    torch.cuda.Stream(device=self.device),  # type: ignore[no-untyped-call]
                    torch.cuda.Stream(device=self.device),  # type: ignore[no-untyped-call]
                )

    def require_stage(self, nbytes: int) -> None:
        """Make each staging buffer at least ``nbytes`` (before first use; movers call it when built)."""
        need = _align(nbytes)
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
        return _record(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def _lane(self, direction: str, after: Fence, *, staged: bool = True) -> Iterator[_Lane]:
        """Serialized enqueue on ``direction``: its kernel stream (behind ``after``) current, its buffers
        (``staged``; else no device staging is allocated and the buffers are empty)."""
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
                yield _Lane(buffers, None, None)
                return
            kernel, copy = self._streams[direction]
            with torch.cuda.device(self.device), torch.cuda.stream(kernel):
                _wait(kernel, after)
                yield _Lane(buffers, kernel, copy)

    def _finish(self, direction: str, *, copy_stream: bool = True) -> None:
        """Block until everything queued so far on ``direction``'s kernel stream, and its copy stream
        (``copy_stream``), is done (CUDA; no-op on CPU)."""
        if self.is_cuda:
            kernel, copy = self._streams[direction]
            for stream in (kernel, copy) if copy_stream else (kernel,):
                ev = _record(stream)
                assert ev is not None
                ev.synchronize()

    def close(self) -> None:
        self._stages.clear()
        self.pool.close()


# ------------------------------------------------------------------------------------------- staged
@dataclass(frozen=True)
class _Piece:
    tensor: int  # index into the mover's flat tensor list
    r0: int  # batch rows [r0, r1)
    r1: int
    host: int  # byte offset of row r0 in the slab
    stage: int  # byte offset of row r0 in the staging buffer (congruent to ``host`` modulo _ALIGN)


@dataclass(frozen=True)
class _Copy:
    host: int  # slab bytes [host, host + nbytes) <-> staging bytes [stage, stage + nbytes)
    stage: int
    nbytes: int


@dataclass(frozen=True)
class _Chunk:
    """What one staging buffer carries: pieces packed into it, and the copies that move them."""

    pieces: tuple[_Piece, ...]
    copies: tuple[_Copy, ...]  # one per run of pieces that are contiguous in the slab (padding included)


@dataclass(frozen=True)
class _ChunkViews:
    """A chunk's tensors in the staging buffer it uses: per piece (the tensor it packs from or unpacks
    into, the piece, its rows in the buffer), per copy (the copy, its bytes in the buffer)."""

    pieces: tuple[tuple[torch.Tensor, _Piece, torch.Tensor], ...]
    copies: tuple[tuple[_Copy, torch.Tensor], ...]


class StagedBlocks:
    """Host bytes of a batch of blocks, as store parts; release (or use as a context manager) when done.

    ``parts[i]`` is block ``block_ids[i]``'s value: one writable uint8 numpy array per layer tensor, in
    part order. From :meth:`BlockMover.gather` the bytes are final when it returns (hand them to
    ``Store.put``). From :meth:`BlockMover.scatter_targets` they are destinations (``Store.get_into``);
    :meth:`commit` then writes them into the blocks. Either way the arrays may alias a pooled slab: do not
    touch them after :meth:`release` / :meth:`commit`. Staged parts are views the mover keeps per slab and
    hands out again with that slab's next batch: read and write their bytes, never their shape or flags.
    """

    def __init__(
        self,
        mover: BlockMover,
        block_ids: Sequence[int],
        parts: list[list[np.ndarray]],
        *,
        slab: torch.Tensor | None = None,
        staged_pages: list[list[tuple[int, np.ndarray]]] | None = None,
        after: Fence = None,
    ) -> None:
        self.block_ids = list(block_ids)
        self.parts = parts
        self._mover = mover
        self._slab = slab
        # direct path: per block, (tensor index, staging array) to copy back
        self._staged_pages = staged_pages
        self._after = after
        self._released = False

    @property
    def slab(self) -> torch.Tensor | None:
        """The pooled host slab the parts live in (staged path), or None (direct path, or released)."""
        return self._slab

    @property
    def nbytes(self) -> int:
        return len(self.block_ids) * self._mover.block_nbytes

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
                self._mover._commit(self, keep)
        finally:
            self.release()

    def release(self) -> None:
        """Return the slab (if any) to the pool without writing anything. Idempotent."""
        if self._released:
            return
        self._released = True
        if self._slab is not None:
            pool = self._mover.staging.pool if self._mover.staging is not None else None
            slab, self._slab = self._slab, None
            if pool is not None:
                pool.release(slab)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BlockMover:
    """Moves whole blocks of one store group between its layer caches and store parts.

    ``layers``: the group's per-layer caches in layer order; each a tensor or a list of tensors (sharing a
    storage), every one block-major (``t[block_id]`` is that block's page; pages may be strided views).
    All on one device. CPU tensors use the direct path unless ``staging`` is given; CUDA tensors need it.
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor | Sequence[torch.Tensor]],
        *,
        staging: StagingContext | None = None,
    ) -> None:
        self.tensors = flatten_layers(layers)
        if not self.tensors:
            raise ValueError("a group needs at least one layer tensor")
        devices = {t.device for t in self.tensors}
        if len(devices) != 1:
            raise ValueError(
                f"a group's layer tensors must share one device, got {sorted(map(str, devices))}"
            )
        self.device = next(iter(devices))
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported KV cache device {self.device}")
        if self.device.type == "cuda" and staging is None:
            raise ValueError("CUDA KV caches need a StagingContext (pinned host staging)")
        if staging is not None and staging.device.type != self.device.type:
            raise ValueError(f"staging context on {staging.device} for caches on {self.device}")
        self.staging = staging
        self._rows = [self._row_view(t) if staging is None else None for t in self.tensors]
        # staged path: what index_select / index_copy_ work on (same bytes as the tensors, wider words)
        self._packed = [self._pack_view(t) for t in self.tensors] if staging is not None else []
        self.page_nbytes = [_page_nbytes(t) for t in self.tensors]
        self.block_nbytes = sum(self.page_nbytes)
        if staging is not None:
            staging.require_stage(max(self.page_nbytes) + _ALIGN)
            cap = (staging.pool.slab_bytes - _ALIGN * len(self.tensors)) // self.block_nbytes
            if cap < 1:
                raise ValueError(
                    f"a staging slab of {staging.pool.slab_bytes} bytes cannot hold one block of "
                    f"{self.block_nbytes} bytes"
                )
            self.max_blocks = cap
            # Fixed slab layout: tensor k's pages at _segments[k] + row * page bytes, for any batch size,
            # so the numpy views of a slab's pages are built once per slab (see _slab_parts).
            self._segments = self._layout(cap)
        else:
            self.max_blocks = sys.maxsize
            self._segments = []
        #: Directions whose batches the copy kernel moves for this group (see
        #: ``StagingContext.kernel_directions``), and why none when the context asked for some but the
        #: kernel cannot move these pages (strided pages, say) or Triton cannot be imported.
        self.kernel_directions: frozenset[str] = frozenset()
        self.kernel_unsupported: str | None = None
        self._kernel: Any = None  # copy_kernels.KernelCopier
        if staging is not None and staging.kernel_directions:
            try:
                from hybridkv.connector import copy_kernels  # Triton: imported only when asked for

                self._kernel = copy_kernels.KernelCopier(
                    self.tensors, self._segments, self.page_nbytes, self.max_blocks
                )
                self.kernel_directions = staging.kernel_directions
            except Exception as exc:  # noqa: BLE001 -- an optional fast path: any failure leaves DMA
                # ImportError (no Triton), ValueError (pages it cannot move), or a compile error of this
                # Triton/GPU in the warm-up: the engine must start anyway, on the DMA path.
                self.kernel_unsupported = (
                    str(exc) if isinstance(exc, (ImportError, ValueError)) else repr(exc)
                )
        self._plans: dict[int, list[_Chunk]] = {}  # batch size -> its chunks
        self._views: dict[tuple[int, int], list[_ChunkViews]] = {}  # (batch size, staging address) -> ...
        self._slab_rows: dict[int, tuple[weakref.ref[torch.Tensor], list[list[np.ndarray]]]] = {}

    @property
    def is_staged(self) -> bool:
        return self.staging is not None

    def fence(self) -> Fence:
        """See :meth:`StagingContext.fence` (None on the direct path)."""
        return self.staging.fence() if self.staging is not None else None

    # ------------------------------------------------------------------ public
    def gather(
        self, block_ids: Sequence[int], *, after: Fence = None, timeout: float = 0.0, private: bool = False
    ) -> StagedBlocks | None:
        """The bytes of ``block_ids`` as store parts, final on return (ready for ``Store.put``).

        Staged path: reads the device blocks only after ``after`` (the fence of the step that wrote them),
        blocks the calling thread until the copies are done, and returns None -- nothing read -- when no
        slab frees up within ``timeout`` seconds. At most ``max_blocks`` blocks. The caller must keep the
        source blocks unchanged until this returns, and release the result once the store has the bytes.

        Direct path: the parts are the pages themselves, unless ``private``: then they are one private copy
        of the batch, taken now (for a store call that may go on reading after it answered, so that it never
        reads pages vLLM has reused). The staged path's slab is private already.
        """
        self._check(block_ids)
        if self.staging is None:
            if private:
                parts = self._private_parts(len(block_ids))
                for row, b in zip(parts, block_ids, strict=True):
                    for k, part in enumerate(row):
                        part[:] = self._host_page(k, b)[0]
                return StagedBlocks(self, block_ids, parts)
            parts = [[self._host_page(k, b)[0] for k in range(len(self.tensors))] for b in block_ids]
            return StagedBlocks(self, block_ids, parts)
        slab = self.staging.pool.acquire(timeout)
        if slab is None:
            return None
        try:
            parts = self._d2h(block_ids, slab, after)
            return StagedBlocks(self, block_ids, parts, slab=slab)
        except BaseException:
            self.staging.pool.release(slab)
            raise

    def scatter_targets(
        self, block_ids: Sequence[int], *, after: Fence = None, timeout: float = 0.0, private: bool = False
    ) -> StagedBlocks | None:
        """Writable store destinations for ``block_ids``; :meth:`StagedBlocks.commit` moves them in.

        Direct path: contiguous pages are written in place by the store (commit only copies staged
        strided pages); with ``private`` every part is a private buffer instead, and commit copies the kept
        blocks into their pages (for a store call that may go on writing after it answered: its late
        write then lands only in memory nobody else uses). Staged path: parts are slab slices; commit copies them to the device after
        ``after`` and waits for completion. None when no slab frees up within ``timeout`` seconds.
        """
        self._check(block_ids)
        if self.staging is None and private:
            private_parts = self._private_parts(len(block_ids))
            to_copy = [list(enumerate(row)) for row in private_parts]
            return StagedBlocks(self, block_ids, private_parts, staged_pages=to_copy)
        if self.staging is None:
            parts: list[list[np.ndarray]] = []
            staged: list[list[tuple[int, np.ndarray]]] = []
            for b in block_ids:
                row: list[np.ndarray] = []
                pending: list[tuple[int, np.ndarray]] = []
                for k in range(len(self.tensors)):
                    view, direct = self._host_page(k, b)
                    row.append(view)
                    if not direct:
                        pending.append((k, view))
                parts.append(row)
                staged.append(pending)
            return StagedBlocks(self, block_ids, parts, staged_pages=staged)
        slab = self.staging.pool.acquire(timeout)
        if slab is None:
            return None
        return StagedBlocks(self, block_ids, self._slab_parts(slab, len(block_ids)), slab=slab, after=after)

    def snapshot(self, block_id: int) -> list[np.ndarray]:
        """Direct path: a private copy of ``block_id``'s parts (one per layer tensor), taken now.

        For a block the engine may still write while the store reads it (a partial tail that the next
        steps append to): the checksum and the stored bytes must come from one consistent copy.
        """
        assert self.staging is None, "staged batches are already private copies (see gather)"
        self._check([block_id])
        return [np.array(self._host_page(k, block_id)[0], copy=True) for k in range(len(self.tensors))]

    # ------------------------------------------------------------------ direct path
    def _private_parts(self, n: int) -> list[list[np.ndarray]]:
        """Parts of ``n`` blocks in one fresh host buffer (block-major, each block's pages in part order)."""
        buffer = np.empty(n * self.block_nbytes, dtype=np.uint8)
        parts: list[list[np.ndarray]] = []
        pos = 0
        for _ in range(n):
            row: list[np.ndarray] = []
            for pb in self.page_nbytes:
                row.append(buffer[pos : pos + pb])
                pos += pb
            parts.append(row)
        return parts

    def _host_page(self, k: int, block_id: int) -> tuple[np.ndarray, bool]:
        """Block ``block_id``'s page of tensor ``k`` as uint8 numpy: a view if contiguous, else a copy."""
        rows = self._rows[k]
        if rows is not None:
            return rows[block_id], True
        page = self.tensors[k][block_id]
        if page.is_contiguous():
            return page.reshape(-1).view(torch.uint8).numpy(), True
        return page.contiguous().reshape(-1).view(torch.uint8).numpy(), False

    @staticmethod
    def _row_view(t: torch.Tensor) -> np.ndarray | None:
        """``t`` as a (blocks, page bytes) uint8 numpy view when every page is contiguous (else None).

        One view per tensor, built once: slicing a row is ~100x cheaper than a torch index + reshape +
        ``.numpy()`` per page, which dominated the host path for small pages.
        """
        if t.dim() < 2 or not t[0].is_contiguous() or t.stride(-1) != 1:
            return None
        try:
            rows = t.view(torch.uint8).flatten(1).numpy()
        except (RuntimeError, TypeError):
            return None
        if rows.ndim != 2 or not rows[0].flags.c_contiguous:
            return None
        return rows

    # ------------------------------------------------------------------ staged path
    def _check(self, block_ids: Sequence[int]) -> None:
        if len(block_ids) > self.max_blocks:
            raise ValueError(f"{len(block_ids)} blocks > max_blocks {self.max_blocks} per batch")

    def _layout(self, rows: int) -> list[int]:
        """Slab offsets of each tensor's segment of ``rows`` pages (layer-major, each 256-byte aligned)."""
        offsets, pos = [], 0
        for pb in self.page_nbytes:
            offsets.append(pos)
            pos = _align(pos + rows * pb)
        return offsets

    def _slab_parts(self, slab: torch.Tensor, n: int) -> list[list[np.ndarray]]:
        """Per block, per tensor, that page's bytes in the slab (views), for a batch of ``n`` blocks.

        The views of every page a slab can hold are built on the slab's first use and kept for the
        mover's life: a numpy view per part per batch cost 1.4-4 ms for 256 blocks of 32 layers on an H200
        host, against 10 ms of PCIe for the batch, and for a load it lies before the first copy.
        """
        hit = self._slab_rows.get(id(slab))
        if hit is None or hit[0]() is not slab:
            arr = slab.numpy()
            rows = [
                list(arr[off : off + self.max_blocks * pb].reshape(self.max_blocks, pb))
                for off, pb in zip(self._segments, self.page_nbytes, strict=True)
            ]
            self._slab_rows[id(slab)] = hit = (weakref.ref(slab), rows)
        return [list(pages) for pages in zip(*(r[:n] for r in hit[1]), strict=True)] if n else []

    def plan(self, n: int) -> list[_Chunk]:
        """A batch of ``n`` blocks as staging-sized chunks, in slab order (cached per ``n``).

        A piece is as many rows of one tensor as fit; a chunk is as many pieces as fit in one staging
        buffer. Each piece sits in the staging buffer at the slab offset's remainder modulo 256 (so wide
        word views stay aligned), right after the previous piece when that one ends where this starts in
        the slab up to alignment padding (then one copy moves both), else at the next 256-byte boundary.
        """
        plan = self._plans.get(n)
        if plan is not None:
            return plan
        if len(self._plans) >= _MAX_CACHED_BATCH_SIZES:
            self._plans.clear()
        assert self.staging is not None
        cap = self.staging.chunk_bytes
        plan = []
        pieces: list[_Piece] = []
        copies: list[_Copy] = []
        end = 0  # staging bytes used by the open chunk
        for k, (off, pb) in enumerate(zip(self._segments, self.page_nbytes, strict=True)):
            r = 0
            while r < n:
                host = off + r * pb
                gap = host - (copies[-1].host + copies[-1].nbytes) if copies else -1
                joins = 0 <= gap < _ALIGN  # starts where the last run ends in the slab, up to padding
                stage = end + gap if joins else _align(end) + host % _ALIGN
                if pieces and stage + pb > cap:  # not even one more row fits: close the chunk
                    plan.append(_Chunk(tuple(pieces), tuple(copies)))
                    pieces, copies, end = [], [], 0
                    joins, stage = False, host % _ALIGN
                rows = min(n - r, (cap - stage) // pb)
                assert rows >= 1, "staging buffer smaller than one page"
                pieces.append(_Piece(k, r, r + rows, host, stage))
                if joins:
                    last = copies.pop()
                    copies.append(_Copy(last.host, last.stage, host + rows * pb - last.host))
                else:
                    copies.append(_Copy(host, stage, rows * pb))
                end = stage + rows * pb
                r += rows
        if pieces:
            plan.append(_Chunk(tuple(pieces), tuple(copies)))
        self._plans[n] = plan
        return plan

    @staticmethod
    def _pack_view(t: torch.Tensor) -> torch.Tensor:
        """``t`` as (blocks, words) of the widest integer type that divides a page, if pages are contiguous.

        The same bytes in the same order, but the index kernels then move 8-byte words over a 2-D index
        space instead of 2-byte elements over five dims (H200, 256 attention pages of 64 KiB:
        ``index_copy_`` 1.4 TB/s instead of 0.64; ``index_select`` is ~1.1 TB/s either way). A tensor
        with strided pages (a transposed Mamba
        conv state) stays as it is: its pages are packed in their logical order, element by element.
        """
        if t.dim() < 2 or not t[0].is_contiguous():
            return t
        try:
            rows = t.view(t.shape[0], -1)
        except RuntimeError:
            return t
        page_nbytes = _page_nbytes(t)
        for word in (torch.int64, torch.int32, torch.int16, torch.uint8):
            if page_nbytes % word.itemsize == 0:
                try:
                    return rows.view(word)
                except RuntimeError:  # storage offset or block stride not a multiple of the word
                    continue
        return t

    def _chunk_views(self, lane: _Lane, n: int) -> list[_ChunkViews]:
        """Per chunk of :meth:`_plan`, its views into the lane's staging buffer ``i % 2``.

        Cached per (batch size, staging buffer): slicing and re-viewing the buffer per piece per transfer
        was half of the host's enqueue work, and the host's enqueueing is what a batch of many small
        pages waits for. The cached views keep the staging memory alive, so its address stays a valid key.
        """
        key = (n, lane.buffers[0].data_ptr())
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_CACHED_BATCH_SIZES:
                self._views.clear()
            views = []
            for i, chunk in enumerate(self.plan(n)):
                buf = lane.buffers[i % 2]
                views.append(
                    _ChunkViews(
                        tuple((self._packed[p.tensor], p, self._stage_view(buf, p)) for p in chunk.pieces),
                        tuple((c, buf[c.stage : c.stage + c.nbytes]) for c in chunk.copies),
                    )
                )
            self._views[key] = views
        return views

    def _stage_view(self, stage: torch.Tensor, p: _Piece) -> torch.Tensor:
        """Piece ``p``'s rows in ``stage``, shaped like :meth:`_pack_view` of its tensor."""
        t = self._packed[p.tensor]
        raw = stage[p.stage : p.stage + (p.r1 - p.r0) * self.page_nbytes[p.tensor]]
        return raw.view(t.dtype).view(p.r1 - p.r0, *t.shape[1:])

    def _index(self, rows: Sequence[int]) -> torch.Tensor:
        """``rows`` as a long tensor on the device, uploaded on the current stream without a host sync."""
        cpu = torch.tensor(list(rows), dtype=torch.long)
        if self.device.type != "cuda":
            return cpu
        # Pinned + non_blocking: queued on the side stream (after its fence wait), no host wait; the
        # caching host allocator keeps the pinned block alive until that copy has run.
        return cpu.pin_memory().to(self.device, non_blocking=True)

    def _d2h(self, block_ids: Sequence[int], slab: torch.Tensor, after: Fence) -> list[list[np.ndarray]]:
        """Copy the blocks into ``slab`` (after ``after``); returns the slab parts once the bytes are there.

        Per chunk: pack its pages into a staging buffer on the kernel stream, then copy that buffer into
        the slab on the copy stream. The buffers alternate, so packing chunk i+1 runs while chunk i
        crosses PCIe; an event per chunk hands the buffer to the copy stream, and one per buffer hands it
        back once its copy has read it. The slab parts are built while the copies run.
        """
        assert self.staging is not None
        n = len(block_ids)
        if "save" in self.kernel_directions and self._kernel_takes(n):
            with self.staging._lane("save", after, staged=False):
                self._kernel.copy(to_slab=True, rows=range(n), block_ids=block_ids, slab=slab)
                parts = self._slab_parts(slab, n)  # built while the kernel runs
            self.staging._finish("save", copy_stream=False)
            return parts
        with self.staging._lane("save", after) as lane:
            idx = self._index(block_ids)
            copied: list[Fence] = [None, None]  # per buffer: its last copy to the host has read it
            for i, views in enumerate(self._chunk_views(lane, n)):
                _wait(lane.kernel, copied[i % 2])
                for t, p, out in views.pieces:
                    rows = idx if p.r1 - p.r0 == n else idx[p.r0 : p.r1]
                    torch.index_select(t, 0, rows, out=out)
                packed = _record(lane.kernel)
                with lane.copying():
                    _wait(lane.copy, packed)
                    for c, staged in views.copies:
                        slab[c.host : c.host + c.nbytes].copy_(staged, non_blocking=True)
                    copied[i % 2] = _record(lane.copy)
            parts = self._slab_parts(slab, n)
        self.staging._finish("save")
        return parts

    def _kernel_takes(self, n: int) -> bool:
        """Whether a batch of ``n`` blocks is small enough for the copy kernel (see ``kernel_max_batch_bytes``)."""
        assert self.staging is not None
        limit = self.staging.kernel_max_batch_bytes
        return limit is None or n * self.block_nbytes <= limit

    def _commit(self, sb: StagedBlocks, keep: list[bool]) -> None:
        if self.staging is None:
            assert sb._staged_pages is not None
            for b, pending, k_ok in zip(sb.block_ids, sb._staged_pages, keep, strict=True):
                if not k_ok:
                    continue
                for k, view in pending:
                    page = self.tensors[k][b]
                    page.copy_(torch.from_numpy(view).view(page.dtype).view(page.shape))
            return
        assert sb._slab is not None
        n = len(sb.block_ids)
        kept = [i for i in range(n) if keep[i]]
        if "load" in self.kernel_directions and self._kernel_takes(n):  # one launch, slab -> kept blocks
            with self.staging._lane("load", sb._after, staged=False):
                ids = [sb.block_ids[i] for i in kept]
                self._kernel.copy(to_slab=False, rows=kept, block_ids=ids, slab=sb._slab)
            self.staging._finish("load", copy_stream=False)
            return
        # Mirror of _d2h: chunk i's copy into a staging buffer (copy stream; it touches no block, so it
        # need not wait for the fence) overlaps the unpacking of chunk i-1 (kernel stream, behind the fence).
        with self.staging._lane("load", sb._after) as lane:
            idx = self._index(sb.block_ids)
            unpacked: list[Fence] = [None, None]  # per buffer: its last unpacking has read it
            for i, views in enumerate(self._chunk_views(lane, n)):
                with lane.copying():
                    _wait(lane.copy, unpacked[i % 2])
                    for c, staged in views.copies:
                        staged.copy_(sb._slab[c.host : c.host + c.nbytes], non_blocking=True)
                    landed = _record(lane.copy)
                _wait(lane.kernel, landed)
                for t, p, src in views.pieces:
                    dst_idx = idx if p.r1 - p.r0 == n else idx[p.r0 : p.r1]
                    if len(kept) != n:  # skip the blocks the store did not fill
                        local = [r - p.r0 for r in kept if p.r0 <= r < p.r1]
                        if not local:
                            continue
                        if len(local) < p.r1 - p.r0:
                            sel = self._index(local)
                            src, dst_idx = src.index_select(0, sel), dst_idx.index_select(0, sel)
                    t.index_copy_(0, dst_idx, src)
                unpacked[i % 2] = _record(lane.kernel)
        self.staging._finish("load")
