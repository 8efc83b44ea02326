"""Whole KV blocks between vLLM's per-layer caches and host buffers the store reads and writes.

torch + numpy only (no vLLM, no structlog): the GPU benchmark imports this on a bare torch host.

A *group block* is one block id's page in every layer tensor of a store group, concatenated in layer order
(a layer given as a list of tensors sharing one storage contributes each tensor's page in list order). A
:class:`BlockMover` hands a batch of blocks to the store as *parts*: one uint8 numpy array per (block,
layer tensor), in that order -- exactly what ``Store.put`` takes as a value and ``Store.get_into`` as a
destination.

The staged path's host side -- the pinned pool, the per-direction lanes (streams and device staging
buffers), the batches themselves (:class:`StagedBlocks`) -- lives in :mod:`hybridkv.connector.staging`
(re-exported here); this module lays blocks out in slabs and moves them through those lanes.

Two paths, chosen by where the caches live:

- **Direct** (CPU tensors): the parts *are* the pages (zero-copy numpy views). A page that is not
  contiguous (a strided Mamba state view) is copied once into a private staging array. There is no slab
  and no batch limit. For a store call that may answer late the parts are a private copy instead, in a
  pre-faulted buffer of the caller's :class:`HostBufferPool` (``private``).
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

Why a packed staging buffer rather than one copy per (block, layer): per-page copies cost a launch each
(32 layers x 256 blocks = 8192 ``cudaMemcpyAsync``), while the device-side gather runs at HBM speed and leaves
a few large PCIe copies. Where the copy kernel can move the pages (``StagingContext.pack_by_kernel``, the
default), it packs and unpacks a chunk in one to three launches; else the host enqueues one ``index_select`` /
``index_copy_`` per layer tensor per chunk, which for small batches is about as long as the bus takes to move
the chunk. Measured ratios against one contiguous pinned copy: see docs/performance.md, "The GPU data path".

The copy kernel straight to the slab (``StagingContext.kernel_directions``, ``cuda_copy: kernel``): for a group
whose pages are contiguous, one Triton launch moves the whole batch straight between the pages and the pinned
slab over PCIe (same slab layout, no device staging, no DMA copy); see ``hybridkv.connector.copy_kernels``.

Fences. On CUDA the forward runs asynchronously: when ``wait_for_save`` returns on the host, the kernels
that write this step's blocks may still be queued. :meth:`StagingContext.fence` records an event on the
current (compute) stream; a gather given that fence reads the blocks only after that event, so it sees
every write enqueued before the fence. Loads take a fence too (recorded in ``start_load_kv``): the
host->device writes land after whatever the compute stream had queued for those blocks (e.g. zeroing).
"""

from __future__ import annotations

import bisect
import os
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hybridkv.connector.staging import (
    ALIGN,
    DEFAULT_STAGE_BYTES,
    Fence,
    HostBuffer,
    HostBufferPool,
    Lane,
    PinnedPool,
    StagedBlocks,
    StagingContext,
    align,
    queue_behind,
    record_event,
)

__all__ = [
    "DEFAULT_STAGE_BYTES",
    "BlockMover",
    "Fence",
    "HostBufferPool",
    "PinnedPool",
    "StagedBlocks",
    "StagingContext",
    "flatten_layers",
]

#: Batch sizes whose chunk plans and staging views a mover keeps (past that it starts over).
_MAX_CACHED_BATCH_SIZES = 64


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


# ------------------------------------------------------------------------------------------- staged
@dataclass(frozen=True)
class _Piece:
    tensor: int  # index into the mover's flat tensor list
    r0: int  # batch rows [r0, r1)
    r1: int
    host: int  # byte offset of row r0 in the slab
    stage: int  # byte offset of row r0 in the staging buffer (congruent to ``host`` modulo ALIGN)


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


def _kernel_device(device: torch.device) -> bool:
    """Whether the copy kernel may run on tensors of ``device``: CUDA, or the CPU under Triton's interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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


def _slab_segments(page_nbytes: Sequence[int], rows: int) -> list[int]:
    """Slab offsets of each tensor's segment of ``rows`` pages of ``page_nbytes`` bytes (layer-major, each
    segment aligned to ``ALIGN``)."""
    offsets, pos = [], 0
    for pb in page_nbytes:
        offsets.append(pos)
        pos = align(pos + rows * pb)
    return offsets


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
        self._rows = [_row_view(t) if staging is None else None for t in self.tensors]
        # staged path: what index_select / index_copy_ work on (same bytes as the tensors, wider words)
        self._packed = [_pack_view(t) for t in self.tensors] if staging is not None else []
        self.page_nbytes = [_page_nbytes(t) for t in self.tensors]
        self.block_nbytes = sum(self.page_nbytes)
        if staging is not None:
            staging.require_stage(max(self.page_nbytes) + ALIGN)
            cap = (staging.pool.slab_bytes - ALIGN * len(self.tensors)) // self.block_nbytes
            if cap < 1:
                raise ValueError(
                    f"a staging slab of {staging.pool.slab_bytes} bytes cannot hold one block of "
                    f"{self.block_nbytes} bytes"
                )
            self.max_blocks = cap
            # Fixed slab layout: tensor k's pages at _segments[k] + row * page bytes, for any batch size,
            # so the numpy views of a slab's pages are built once per slab (see _slab_parts).
            self._segments = _slab_segments(self.page_nbytes, cap)
        else:
            self.max_blocks = sys.maxsize
            self._segments = []
        #: Directions whose batches the copy kernel moves for this group (see
        #: ``StagingContext.kernel_directions``), and why none when the context asked for some but the
        #: kernel cannot move these pages (strided pages, say) or Triton cannot be imported.
        self.kernel_directions: frozenset[str] = frozenset()
        self.kernel_unsupported: str | None = None
        self._kernel: Any = None  # copy_kernels.KernelCopier
        #: Whether the DMA path packs (and unpacks) each staging chunk with the copy kernel, one to three
        #: launches per chunk, instead of one ``index_select`` / ``index_copy_`` per layer tensor.
        self.packs_by_kernel = False
        wants_pack = staging is not None and staging.pack_by_kernel and _kernel_device(self.device)
        if staging is not None and (staging.kernel_directions or wants_pack):
            try:
                from hybridkv.connector import copy_kernels  # Triton: imported only when asked for

                self._kernel = copy_kernels.KernelCopier(
                    self.tensors, self._segments, self.page_nbytes, self.max_blocks
                )
                self.kernel_directions = staging.kernel_directions
                self.packs_by_kernel = wants_pack
            except Exception as exc:  # noqa: BLE001 -- an optional fast path: any failure leaves DMA
                # ImportError (no Triton), ValueError (pages it cannot move), or a compile error of this
                # Triton/GPU in the warm-up: the engine must start anyway, on the DMA path.
                self.kernel_unsupported = (
                    str(exc) if isinstance(exc, (ImportError, ValueError)) else repr(exc)
                )
        self._plans: dict[int, list[_Chunk]] = {}  # batch size -> its chunks
        self._launches: dict[int, list[list[Any]]] = {}  # batch size -> per chunk, its StageLaunches
        self._views: dict[tuple[int, int], list[_ChunkViews]] = {}  # (batch size, staging address) -> ...
        self._slab_rows: dict[int, tuple[weakref.ref[torch.Tensor], list[list[np.ndarray]]]] = {}

    @property
    def is_staged(self) -> bool:
        return self.staging is not None

    def fence(self) -> Fence:
        """See :meth:`StagingContext.fence` (None on the direct path)."""
        return self.staging.fence() if self.staging is not None else None

    def _batch(
        self,
        block_ids: Sequence[int],
        parts: list[list[np.ndarray]],
        *,
        slab: torch.Tensor | None = None,
        buffer: HostBuffer | None = None,
        host_copies: list[list[tuple[int, np.ndarray]]] | None = None,
        after: Fence = None,
    ) -> StagedBlocks:
        """A batch of this mover's blocks; its slab goes back to this mover's pool (a host buffer to its own)."""
        return StagedBlocks(
            block_ids,
            parts,
            block_nbytes=self.block_nbytes,
            write_back=self._write_back,
            pool=self.staging.pool if self.staging is not None else None,
            slab=slab,
            buffer=buffer,
            host_copies=host_copies,
            after=after,
        )

    # ------------------------------------------------------------------ public
    def gather(
        self,
        block_ids: Sequence[int],
        *,
        after: Fence = None,
        timeout: float = 0.0,
        private: HostBufferPool | None = None,
    ) -> StagedBlocks | None:
        """The bytes of ``block_ids`` as store parts, final on return (ready for ``Store.put``).

        Staged path: reads the device blocks only after ``after`` (the fence of the step that wrote them),
        blocks the calling thread until the copies are done, and returns None -- nothing read -- when no
        slab frees up within ``timeout`` seconds. At most ``max_blocks`` blocks. The caller must keep the
        source blocks unchanged until this returns, and release the result once the store has the bytes.

        Direct path: the parts are the pages themselves, unless ``private`` (a pool): then they are one
        private copy of the batch, taken now into a buffer of that pool (for a store call that may go on
        reading after it answered, so that it never reads pages vLLM has reused). The staged path's slab is
        private already.
        """
        self._check(block_ids)
        if self.staging is None:
            if private is not None:
                parts, buffer = self._private_parts(len(block_ids), private)
                try:
                    for row, b in zip(parts, block_ids, strict=True):
                        for k, part in enumerate(row):
                            part[:] = self._host_page(k, b)[0]
                except BaseException:
                    buffer.release()
                    raise
                return self._batch(block_ids, parts, buffer=buffer)
            parts = [[self._host_page(k, b)[0] for k in range(len(self.tensors))] for b in block_ids]
            return self._batch(block_ids, parts)
        slab = self.staging.pool.acquire(timeout)
        if slab is None:
            return None
        try:
            parts = self._d2h(block_ids, slab, after)
            return self._batch(block_ids, parts, slab=slab)
        except BaseException:
            self.staging.pool.release(slab)
            raise

    def scatter_targets(
        self,
        block_ids: Sequence[int],
        *,
        after: Fence = None,
        timeout: float = 0.0,
        private: HostBufferPool | None = None,
    ) -> StagedBlocks | None:
        """Writable store destinations for ``block_ids``; :meth:`StagedBlocks.commit` moves them in.

        Direct path: contiguous pages are written in place by the store (commit only copies staged
        strided pages); with ``private`` (a pool) every part lies in a private buffer of that pool instead,
        and commit copies the kept blocks into their pages (for a store call that may go on writing after it
        answered: its late write then lands only in memory nobody else uses). Staged path: parts are slab
        slices; commit copies them to the device after ``after`` and waits for completion. None when no
        slab frees up within ``timeout`` seconds.
        """
        self._check(block_ids)
        if self.staging is None and private is not None:
            private_parts, buffer = self._private_parts(len(block_ids), private)
            to_copy = [list(enumerate(row)) for row in private_parts]
            return self._batch(block_ids, private_parts, buffer=buffer, host_copies=to_copy)
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
            return self._batch(block_ids, parts, host_copies=staged)
        slab = self.staging.pool.acquire(timeout)
        if slab is None:
            return None
        return self._batch(block_ids, self._slab_parts(slab, len(block_ids)), slab=slab, after=after)

    def snapshot(self, block_id: int) -> list[np.ndarray]:
        """Direct path: a private copy of ``block_id``'s parts (one per layer tensor), taken now.

        For a block the engine may still write while the store reads it (a partial tail that the next
        steps append to): the checksum and the stored bytes must come from one consistent copy.
        """
        assert self.staging is None, "staged batches are already private copies (see gather)"
        self._check([block_id])
        return [np.array(self._host_page(k, block_id)[0], copy=True) for k in range(len(self.tensors))]

    # ------------------------------------------------------------------ direct path
    def _private_parts(self, n: int, pool: HostBufferPool) -> tuple[list[list[np.ndarray]], HostBuffer]:
        """Parts of ``n`` blocks in one buffer of ``pool`` (block-major, each block's pages in part order),
        and that buffer (the batch's to give back)."""
        held = pool.acquire(n * self.block_nbytes)
        buffer = held.array
        parts: list[list[np.ndarray]] = []
        pos = 0
        for _ in range(n):
            row: list[np.ndarray] = []
            for pb in self.page_nbytes:
                row.append(buffer[pos : pos + pb])
                pos += pb
            parts.append(row)
        return parts, held

    def _host_page(self, k: int, block_id: int) -> tuple[np.ndarray, bool]:
        """Block ``block_id``'s page of tensor ``k`` as uint8 numpy: a view if contiguous, else a copy."""
        rows = self._rows[k]
        if rows is not None:
            return rows[block_id], True
        page = self.tensors[k][block_id]
        if page.is_contiguous():
            return page.reshape(-1).view(torch.uint8).numpy(), True
        return page.contiguous().reshape(-1).view(torch.uint8).numpy(), False

    # ------------------------------------------------------------------ staged path
    def _check(self, block_ids: Sequence[int]) -> None:
        if len(block_ids) > self.max_blocks:
            raise ValueError(f"{len(block_ids)} blocks > max_blocks {self.max_blocks} per batch")

    def _slab_parts(self, slab: torch.Tensor, n: int) -> list[list[np.ndarray]]:
        """Per block, per tensor, that page's bytes in the slab (views), for a batch of ``n`` blocks.

        The views of every page a slab can hold are built on the slab's first use and kept for the
        mover's life: a numpy view per part per batch costs a sizeable share of the batch's PCIe time, and
        for a load it lies before the first copy (see docs/performance.md, "The GPU data path").
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
                joins = 0 <= gap < ALIGN  # starts where the last run ends in the slab, up to padding
                stage = end + gap if joins else align(end) + host % ALIGN
                if pieces and stage + pb > cap:  # not even one more row fits: close the chunk
                    plan.append(_Chunk(tuple(pieces), tuple(copies)))
                    pieces, copies, end = [], [], 0
                    joins, stage = False, host % ALIGN
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

    def _chunk_views(self, lane: Lane, n: int) -> list[_ChunkViews]:
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

    def _unpack_by_index(self, views: _ChunkViews, idx: torch.Tensor, kept: list[int], n: int) -> None:
        """One chunk's pieces from its staging buffer into the kept rows' blocks: ``index_copy_`` per piece
        (``idx``: the batch's block ids on the device)."""
        for t, p, src in views.pieces:
            dst_idx = idx if p.r1 - p.r0 == n else idx[p.r0 : p.r1]
            rows = src
            if len(kept) != n:  # skip the blocks the store did not fill
                local = [r - p.r0 for r in kept if p.r0 <= r < p.r1]
                if not local:
                    continue
                if len(local) < p.r1 - p.r0:
                    sel = self._index(local)
                    rows, dst_idx = src.index_select(0, sel), dst_idx.index_select(0, sel)
            t.index_copy_(0, dst_idx, rows)

    def _stage_launches(self, n: int) -> list[list[Any]]:
        """Per chunk of :meth:`plan`, the copy kernel's launches that pack or unpack it (cached per ``n``)."""
        launches = self._launches.get(n)
        if launches is None:
            if len(self._launches) >= _MAX_CACHED_BATCH_SIZES:
                self._launches.clear()
            launches = [
                self._kernel.stage_launches([(p.tensor, p.r0, p.r1, p.stage) for p in chunk.pieces])
                for chunk in self.plan(n)
            ]
            self._launches[n] = launches
        return launches

    def _stage_view(self, stage: torch.Tensor, p: _Piece) -> torch.Tensor:
        """Piece ``p``'s rows in ``stage``, shaped like :func:`_pack_view` of its tensor."""
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
        if "save" in self.kernel_directions:
            with self.staging.lane("save", after, staged=False):
                self._kernel.copy(to_slab=True, rows=range(n), block_ids=block_ids, slab=slab)
                parts = self._slab_parts(slab, n)  # built while the kernel runs
            self.staging.sync_lane("save", copy_stream=False)
            return parts
        with self.staging.lane("save", after) as lane:
            if self.packs_by_kernel:
                self._kernel.fill_stage_pairs(True, range(n), block_ids)
                launches = self._stage_launches(n)
            else:
                idx = self._index(block_ids)
            copied: list[Fence] = [None, None]  # per buffer: its last copy to the host has read it
            for i, views in enumerate(self._chunk_views(lane, n)):
                queue_behind(lane.kernel, copied[i % 2])
                if self.packs_by_kernel:
                    for launch in launches[i]:
                        self._kernel.launch_staged(
                            True, launch, lane.buffers[i % 2], launch.r0, launch.r1 - launch.r0
                        )
                else:
                    for t, p, out in views.pieces:
                        rows = idx if p.r1 - p.r0 == n else idx[p.r0 : p.r1]
                        torch.index_select(t, 0, rows, out=out)
                packed = record_event(lane.kernel)
                with lane.copying():
                    queue_behind(lane.copy, packed)
                    for c, staged in views.copies:
                        slab[c.host : c.host + c.nbytes].copy_(staged, non_blocking=True)
                    copied[i % 2] = record_event(lane.copy)
            parts = self._slab_parts(slab, n)
        self.staging.sync_lane("save")
        return parts

    def _write_back(self, sb: StagedBlocks, keep: list[bool]) -> None:
        """:meth:`StagedBlocks.commit` of a batch of this mover: write its kept destination blocks."""
        if self.staging is None:
            assert sb.host_copies is not None, "a direct-path destination batch lists its host copies"
            for b, pending, k_ok in zip(sb.block_ids, sb.host_copies, keep, strict=True):
                if not k_ok:
                    continue
                for k, view in pending:
                    pages = self._rows[k]
                    if pages is not None:  # a contiguous page (a private batch): numpy copies it cheaper
                        np.copyto(pages[b], view)
                        continue
                    page = self.tensors[k][b]
                    page.copy_(torch.from_numpy(view).view(page.dtype).view(page.shape))
            return
        slab = sb.slab
        assert slab is not None, "a staged destination batch is committed before its release"
        n = len(sb.block_ids)
        kept = [i for i in range(n) if keep[i]]
        if "load" in self.kernel_directions:  # one launch, slab -> kept blocks
            with self.staging.lane("load", sb.after, staged=False):
                ids = [sb.block_ids[i] for i in kept]
                self._kernel.copy(to_slab=False, rows=kept, block_ids=ids, slab=slab)
            self.staging.sync_lane("load", copy_stream=False)
            return
        # Mirror of _d2h: chunk i's copy into a staging buffer (copy stream; it touches no block, so it
        # need not wait for the fence) overlaps the unpacking of chunk i-1 (kernel stream, behind the fence).
        with self.staging.lane("load", sb.after) as lane:
            if self.packs_by_kernel:
                self._kernel.fill_stage_pairs(False, kept, [sb.block_ids[i] for i in kept])
                launches = self._stage_launches(n)
            else:
                idx = self._index(sb.block_ids)
            unpacked: list[Fence] = [None, None]  # per buffer: its last unpacking has read it
            for i, views in enumerate(self._chunk_views(lane, n)):
                with lane.copying():
                    queue_behind(lane.copy, unpacked[i % 2])
                    for c, staged in views.copies:
                        staged.copy_(slab[c.host : c.host + c.nbytes], non_blocking=True)
                    landed = record_event(lane.copy)
                queue_behind(lane.kernel, landed)
                if self.packs_by_kernel:  # the kept rows of each launch's range: a slice of the sorted pairs
                    for launch in launches[i]:
                        first = bisect.bisect_left(kept, launch.r0)
                        end = bisect.bisect_left(kept, launch.r1, lo=first)
                        self._kernel.launch_staged(False, launch, lane.buffers[i % 2], first, end - first)
                else:
                    self._unpack_by_index(views, idx, kept, n)
                unpacked[i % 2] = record_event(lane.kernel)
        self.staging.sync_lane("load")
