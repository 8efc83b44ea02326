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
  from a bounded :class:`PinnedPool` (layer-major: for each layer tensor, the batch's pages back to back,
  each segment 256-byte aligned). Device->host: ``index_select`` over the block dim packs many layers'
  pages into one contiguous device staging buffer, then one async copy per staging chunk moves it into the
  pinned slab, all on a dedicated save stream that first waits on the caller's *fence*. Host->device is the
  mirror image (one async copy per chunk, then ``index_copy_`` into the destination blocks) on a dedicated
  load stream. Both end by synchronizing an event recorded on that stream.

Why ``index_select`` into a staging buffer rather than one copy per (block, layer): per-page copies cost a
launch each (32 layers x 256 blocks = 8192 ``cudaMemcpyAsync``), while the device-side gather runs at HBM
speed (~TB/s, a few percent of the PCIe time) and leaves a handful of large PCIe copies. Measured on one
H200 (torch 2.11/CUDA 13, ``hybridkv bench datapath``, best of 5, scattered block ids), device->pinned:

=====================================  ===========  ============  ====================  ===============
batch                                  ours GB/s    1 copy GB/s   per-page copies GB/s  ours/1 copy
=====================================  ===========  ============  ====================  ===============
attn 32 layers x 64 KiB, 16 blocks     16-26        52-54         3.9                   0.31-0.47
attn 32 layers x 64 KiB, 256 blocks    36-44        55            5.8                   0.65-0.79
Mamba 4 x 1 MiB (strided conv), 16     38-43        55            29                    0.69-0.79
Mamba 4 x 1 MiB (strided conv), 256    42-51        55            31                    0.75-0.92
=====================================  ===========  ============  ====================  ===============

(ranges over four runs with 4/32/128 MiB staging; host->device is within ~10% of these.) Per-page copies
are 7-10x slower for attention pages. What is left is host-side launch overhead (one ``index_select`` per
layer tensor per chunk), so small batches of many small pages are furthest from the copy line.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeAlias

import numpy as np
import torch

#: What a gather or scatter waits for before touching device memory: a CUDA event, or None (no wait).
Fence: TypeAlias = "torch.cuda.Event | None"

_ALIGN = 256  # every per-layer segment of a slab (and of the device staging buffer) starts on this boundary

#: Default bytes of each direction's device staging buffer (the gather/scatter chunk size).
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
class StagingContext:
    """What the staged path shares per device: the pinned pool, two side streams, two device buffers.

    One per worker (device); every group's :class:`BlockMover` uses it. Saves (device->host) use the save
    stream and save staging buffer, loads the load stream and load buffer, so a long save never delays a
    load. Each direction's staging buffer is reused in stream order (the next chunk's packing is queued
    behind the previous chunk's copy on the same stream), so no two transfers of one direction overlap on
    it; the enqueueing itself is serialized by a per-direction lock.
    """

    def __init__(
        self, device: torch.device | str, pool: PinnedPool, *, stage_bytes: int = DEFAULT_STAGE_BYTES
    ):
        self.device = torch.device(device)
        self.pool = pool
        self.is_cuda = self.device.type == "cuda"
        self._stage_bytes = _align(stage_bytes)
        self._streams: dict[str, Any] = {}
        self._stages: dict[str, torch.Tensor] = {}
        self._locks = {"save": threading.Lock(), "load": threading.Lock()}
        if self.is_cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            for d in ("save", "load"):
                self._streams[d] = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def require_stage(self, nbytes: int) -> None:
        """Make each staging buffer at least ``nbytes`` (before first use; movers call it when built)."""
        need = _align(nbytes)
        if need > self._stage_bytes:
            assert not self._stages, "staging size must be settled before the first transfer"
            self._stage_bytes = need

    @property
    def stage_bytes(self) -> int:
        return self._stage_bytes

    def fence(self) -> Fence:
        """Record an event on the current stream of this device (CUDA; None on CPU).

        Give it to :meth:`BlockMover.gather` / :meth:`BlockMover.scatter_targets`: their device work is
        queued behind everything the calling thread's current stream had queued when ``fence()`` ran.
        """
        if not self.is_cuda:
            return None
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    @contextlib.contextmanager
    def _lane(self, direction: str, after: Fence) -> Iterator[torch.Tensor]:
        """Serialized enqueue on ``direction``'s stream (and device), yielding its staging buffer."""
        with self._locks[direction]:
            stage = self._stages.get(direction)
            if stage is None:
                stage = torch.empty(self._stage_bytes, dtype=torch.uint8, device=self.device)
                self._stages[direction] = stage
            if not self.is_cuda:
                yield stage
                return
            stream = self._streams[direction]
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after)
                yield stage

    def _finish(self, direction: str) -> None:
        """Block until everything queued so far on ``direction``'s stream is done (CUDA; no-op on CPU)."""
        if self.is_cuda:
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self._streams[direction])
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


@dataclass(frozen=True)
class _Chunk:
    base: int  # slab offset that maps to staging offset 0 (256-aligned)
    lo: int  # slab byte range [lo, hi) moved by this chunk's one host<->device copy
    hi: int
    pieces: tuple[_Piece, ...]


class StagedBlocks:
    """Host bytes of a batch of blocks, as store parts; release (or use as a context manager) when done.

    ``parts[i]`` is block ``block_ids[i]``'s value: one writable uint8 numpy array per layer tensor, in
    part order. From :meth:`BlockMover.gather` the bytes are final when it returns (hand them to
    ``Store.put``). From :meth:`BlockMover.scatter_targets` they are destinations (``Store.get_into``);
    :meth:`commit` then writes them into the blocks. Either way the arrays may alias a pooled slab: do not
    touch them after :meth:`release` / :meth:`commit`.
    """

    def __init__(
        self,
        mover: BlockMover,
        block_ids: Sequence[int],
        parts: list[list[np.ndarray]],
        *,
        slab: torch.Tensor | None = None,
        offsets: list[int] | None = None,
        staged_pages: list[list[tuple[int, np.ndarray]]] | None = None,
        after: Fence = None,
    ) -> None:
        self.block_ids = list(block_ids)
        self.parts = parts
        self._mover = mover
        self._slab = slab
        self._offsets = offsets
        # direct path: per block, (tensor index, staging array) to copy back
        self._staged_pages = staged_pages
        self._after = after
        self._released = False

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
        else:
            self.max_blocks = sys.maxsize

    @property
    def is_staged(self) -> bool:
        return self.staging is not None

    def fence(self) -> Fence:
        """See :meth:`StagingContext.fence` (None on the direct path)."""
        return self.staging.fence() if self.staging is not None else None

    # ------------------------------------------------------------------ public
    def gather(
        self, block_ids: Sequence[int], *, after: Fence = None, timeout: float = 0.0
    ) -> StagedBlocks | None:
        """The bytes of ``block_ids`` as store parts, final on return (ready for ``Store.put``).

        Staged path: reads the device blocks only after ``after`` (the fence of the step that wrote them),
        blocks the calling thread until the copies are done, and returns None -- nothing read -- when no
        slab frees up within ``timeout`` seconds. At most ``max_blocks`` blocks. The caller must keep the
        source blocks unchanged until this returns, and release the result once the store has the bytes.
        """
        self._check(block_ids)
        if self.staging is None:
            parts = [[self._host_page(k, b)[0] for k in range(len(self.tensors))] for b in block_ids]
            return StagedBlocks(self, block_ids, parts)
        slab = self.staging.pool.acquire(timeout)
        if slab is None:
            return None
        try:
            offsets = self._offsets(len(block_ids))
            self._d2h(block_ids, slab, offsets, after)
            return StagedBlocks(
                self, block_ids, self._slab_parts(slab, offsets, len(block_ids)), slab=slab, offsets=offsets
            )
        except BaseException:
            self.staging.pool.release(slab)
            raise

    def scatter_targets(
        self, block_ids: Sequence[int], *, after: Fence = None, timeout: float = 0.0
    ) -> StagedBlocks | None:
        """Writable store destinations for ``block_ids``; :meth:`StagedBlocks.commit` moves them in.

        Direct path: contiguous pages are written in place by the store (commit only copies staged
        strided pages). Staged path: parts are slab slices; commit copies them to the device after
        ``after`` and waits for completion. None when no slab frees up within ``timeout`` seconds.
        """
        self._check(block_ids)
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
        offsets = self._offsets(len(block_ids))
        return StagedBlocks(
            self,
            block_ids,
            self._slab_parts(slab, offsets, len(block_ids)),
            slab=slab,
            offsets=offsets,
            after=after,
        )

    def snapshot(self, block_id: int) -> list[np.ndarray]:
        """Direct path: a private copy of ``block_id``'s parts (one per layer tensor), taken now.

        For a block the engine may still write while the store reads it (a partial tail that the next
        steps append to): the checksum and the stored bytes must come from one consistent copy.
        """
        assert self.staging is None, "staged batches are already private copies (see gather)"
        self._check([block_id])
        return [np.array(self._host_page(k, block_id)[0], copy=True) for k in range(len(self.tensors))]

    # ------------------------------------------------------------------ direct path
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

    def _offsets(self, n: int) -> list[int]:
        offsets, pos = [], 0
        for pb in self.page_nbytes:
            offsets.append(pos)
            pos = _align(pos + n * pb)
        return offsets

    def _slab_parts(self, slab: torch.Tensor, offsets: list[int], n: int) -> list[list[np.ndarray]]:
        arr = slab.numpy()
        return [
            [
                arr[off + i * pb : off + (i + 1) * pb]
                for off, pb in zip(offsets, self.page_nbytes, strict=True)
            ]
            for i in range(n)
        ]

    def _chunks(self, offsets: list[int], n: int) -> list[_Chunk]:
        """Pack the batch's per-tensor row ranges into staging-sized chunks, in slab order."""
        assert self.staging is not None
        cap = self.staging.stage_bytes
        chunks: list[_Chunk] = []
        cur: list[_Piece] = []
        base = lo = hi = 0
        for k, (off, pb) in enumerate(zip(offsets, self.page_nbytes, strict=True)):
            r = 0
            while r < n:
                start = off + r * pb
                if cur and start + pb - base > cap:  # not even one more row fits: close the chunk
                    chunks.append(_Chunk(base, lo, hi, tuple(cur)))
                    cur = []
                if not cur:
                    base, lo = start - start % _ALIGN, start
                rows = min(n - r, (cap - (start - base)) // pb)
                assert rows >= 1, "staging buffer smaller than one page"
                cur.append(_Piece(k, r, r + rows, start))
                r += rows
                hi = start + rows * pb
        if cur:
            chunks.append(_Chunk(base, lo, hi, tuple(cur)))
        return chunks

    def _stage_view(self, stage: torch.Tensor, chunk: _Chunk, p: _Piece) -> torch.Tensor:
        t = self.tensors[p.tensor]
        a = p.host - chunk.base
        raw = stage[a : a + (p.r1 - p.r0) * self.page_nbytes[p.tensor]]
        return raw.view(t.dtype).view(p.r1 - p.r0, *t.shape[1:])

    def _index(self, rows: Sequence[int]) -> torch.Tensor:
        """``rows`` as a long tensor on the device, uploaded on the current stream without a host sync."""
        cpu = torch.tensor(list(rows), dtype=torch.long)
        if self.device.type != "cuda":
            return cpu
        # Pinned + non_blocking: queued on the side stream (after its fence wait), no host wait; the
        # caching host allocator keeps the pinned block alive until that copy has run.
        return cpu.pin_memory().to(self.device, non_blocking=True)

    def _d2h(self, block_ids: Sequence[int], slab: torch.Tensor, offsets: list[int], after: Fence) -> None:
        assert self.staging is not None
        n = len(block_ids)
        with self.staging._lane("save", after) as stage:
            idx = self._index(block_ids)
            for chunk in self._chunks(offsets, n):
                for p in chunk.pieces:
                    out = self._stage_view(stage, chunk, p)
                    torch.index_select(self.tensors[p.tensor], 0, idx[p.r0 : p.r1], out=out)
                slab[chunk.lo : chunk.hi].copy_(
                    stage[chunk.lo - chunk.base : chunk.hi - chunk.base], non_blocking=True
                )
        self.staging._finish("save")

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
        assert sb._slab is not None and sb._offsets is not None
        n = len(sb.block_ids)
        kept = [i for i in range(n) if keep[i]]
        with self.staging._lane("load", sb._after) as stage:
            idx = self._index(sb.block_ids)
            for chunk in self._chunks(sb._offsets, n):
                stage[chunk.lo - chunk.base : chunk.hi - chunk.base].copy_(
                    sb._slab[chunk.lo : chunk.hi], non_blocking=True
                )
                for p in chunk.pieces:
                    src = self._stage_view(stage, chunk, p)
                    dst_idx = idx[p.r0 : p.r1]
                    if len(kept) != n:  # skip the blocks the store did not fill
                        local = [i - p.r0 for i in kept if p.r0 <= i < p.r1]
                        if not local:
                            continue
                        if len(local) < p.r1 - p.r0:
                            sel = self._index(local)
                            src, dst_idx = src.index_select(0, sel), dst_idx.index_select(0, sel)
                    self.tensors[p.tensor].index_copy_(0, dst_idx, src)
        self.staging._finish("load")
