"""The staged path of :class:`~hybridkv.connector.datapath.movers.BlockMover` (CUDA caches; also CPU caches, for tests).

A batch is laid out in one host slab from a bounded :class:`PinnedPool` and moved through the staging context's
lanes: device staging buffers, streams, events (``hybridkv.connector.datapath.staging``); see
``hybridkv.connector.datapath.movers`` for the layout, the chunking and the fences. torch + numpy only.
"""

from __future__ import annotations

import bisect
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hybridkv.connector.datapath.movers import BlockMover, page_nbytes_of
from hybridkv.connector.datapath.staging import (
    ALIGN,
    Fence,
    HostBufferPool,
    Lane,
    PinnedPool,
    StagedBlocks,
    StagingContext,
    align,
    queue_behind,
    record_event,
)

__all__ = ["StagedMover"]

#: Batch sizes whose chunk plans and staging views a mover keeps (past that it starts over).
_MAX_CACHED_BATCH_SIZES = 64


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
    page_nbytes = page_nbytes_of(t)
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


class StagedMover(BlockMover):
    """The staged path: every batch through a slab of the staging context's pinned pool (see the module
    docstring of ``hybridkv.connector.datapath.movers``)."""

    def __init__(
        self, layers: Sequence[torch.Tensor | Sequence[torch.Tensor]], *, staging: StagingContext
    ) -> None:
        super().__init__(layers)
        if staging.device.type != self.device.type:
            raise ValueError(f"staging context on {staging.device} for caches on {self.device}")
        self.staging = staging
        # what index_select / index_copy_ work on (same bytes as the tensors, wider words)
        self._packed = [_pack_view(t) for t in self.tensors]
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
        #: Directions whose batches the copy kernel moves for this group (see
        #: ``StagingContext.kernel_directions``), and why none when the context asked for some but the
        #: kernel cannot move these pages (strided pages, say) or Triton cannot be imported.
        self.kernel_directions: frozenset[str] = frozenset()
        self.kernel_unsupported: str | None = None
        self._kernel: Any = None  # copy_kernels.KernelCopier
        #: Whether the DMA path packs (and unpacks) each staging chunk with the copy kernel, one to three
        #: launches per chunk, instead of one ``index_select`` / ``index_copy_`` per layer tensor.
        self.packs_by_kernel = False
        wants_pack = staging.pack_by_kernel and _kernel_device(self.device)
        if staging.kernel_directions or wants_pack:
            try:
                from hybridkv.connector.datapath import copy_kernels  # Triton: imported only when asked for

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
        return True

    def fence(self) -> Fence:
        """See :meth:`StagingContext.fence`."""
        return self.staging.fence()

    def _slab_pool(self) -> PinnedPool | None:
        return self.staging.pool

    def gather(
        self,
        block_ids: Sequence[int],
        *,
        after: Fence = None,
        timeout: float = 0.0,
        private: HostBufferPool | None = None,
    ) -> StagedBlocks | None:
        """See :meth:`BlockMover.gather`: the device blocks are read after ``after`` into a slab of the pool
        (private already: ``private`` is not needed); None when no slab frees up within ``timeout``."""
        self._check(block_ids)
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
        """See :meth:`BlockMover.scatter_targets`: the parts are slab slices; commit copies them to the device
        after ``after`` and waits for completion. None when no slab frees up within ``timeout``."""
        self._check(block_ids)
        slab = self.staging.pool.acquire(timeout)
        if slab is None:
            return None
        return self._batch(block_ids, self._slab_parts(slab, len(block_ids)), slab=slab, after=after)

    def snapshot(self, block_id: int) -> list[np.ndarray]:
        raise AssertionError("staged batches are already private copies (see gather)")

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
