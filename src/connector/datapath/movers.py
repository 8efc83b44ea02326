"""Whole KV blocks between vLLM's per-layer caches and host buffers the store reads and writes.

torch + numpy only (no vLLM, no structlog): the GPU benchmark imports this on a bare torch host.

A *group block* is one block id's page in every layer tensor of a store group, concatenated in layer order
(a layer given as a list of tensors sharing one storage contributes each tensor's page in list order). A
:class:`BlockMover` hands a batch of blocks to the store as *parts*: one uint8 numpy array per (block,
layer tensor), in that order -- exactly what ``Store.put`` takes as a value and ``Store.get_into`` as a
destination.

The staged path's host side -- the pinned pool, the per-direction lanes (streams and device staging
buffers), the batches themselves (:class:`StagedBlocks`) -- lives in :mod:`hybridkv.connector.datapath.staging`
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
slab over PCIe (same slab layout, no device staging, no DMA copy); see ``hybridkv.connector.datapath.copy_kernels``.

Fences. On CUDA the forward runs asynchronously: when ``wait_for_save`` returns on the host, the kernels
that write this step's blocks may still be queued. :meth:`StagingContext.fence` records an event on the
current (compute) stream; a gather given that fence reads the blocks only after that event, so it sees
every write enqueued before the fence. Loads take a fence too (recorded in ``start_load_kv``): the
host->device writes land after whatever the compute stream had queued for those blocks (e.g. zeroing).
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Sequence

import numpy as np
import torch
from hybridkv.connector.datapath.staging import (
    DEFAULT_STAGE_BYTES,
    Fence,
    HostBuffer,
    HostBufferPool,
    PinnedPool,
    StagedBlocks,
    StagingContext,
)

__all__ = [
    "DEFAULT_STAGE_BYTES",
    "BlockMover",
    "DirectMover",
    "Fence",
    "HostBufferPool",
    "PinnedPool",
    "StagedBlocks",
    "StagingContext",
    "block_mover",
    "flatten_layers",
]


def page_nbytes_of(t: torch.Tensor) -> int:
    """The bytes of one block's page of the block-major cache ``t``."""
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


class BlockMover(abc.ABC):
    """Moves whole blocks of one store group between its layer caches and store parts: the contract both
    paths keep (:class:`DirectMover`, ``hybridkv.connector.datapath.staged_mover.StagedMover``); :func:`block_mover`
    picks one.

    ``layers``: the group's per-layer caches in layer order; each a tensor or a list of tensors (sharing a
    storage), every one block-major (``t[block_id]`` is that block's page; pages may be strided views).
    All on one device.
    """

    def __init__(self, layers: Sequence[torch.Tensor | Sequence[torch.Tensor]]) -> None:
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
        self.page_nbytes = [page_nbytes_of(t) for t in self.tensors]
        self.block_nbytes = sum(self.page_nbytes)
        #: The most blocks one batch may hold.
        self.max_blocks = sys.maxsize

    @property
    def is_staged(self) -> bool:
        """Whether batches go through a staging slab (:class:`StagingContext`)."""
        return False

    def fence(self) -> Fence:
        """See :meth:`StagingContext.fence` (None on the direct path)."""
        return None

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
            pool=self._slab_pool(),
            slab=slab,
            buffer=buffer,
            host_copies=host_copies,
            after=after,
        )

    def _slab_pool(self) -> PinnedPool | None:
        """Where a batch's slab goes back (None: this mover uses none)."""
        return None

    def _check(self, block_ids: Sequence[int]) -> None:
        if len(block_ids) > self.max_blocks:
            raise ValueError(f"{len(block_ids)} blocks > max_blocks {self.max_blocks} per batch")

    # ------------------------------------------------------------------ public
    @abc.abstractmethod
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

    @abc.abstractmethod
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

    @abc.abstractmethod
    def snapshot(self, block_id: int) -> list[np.ndarray]:
        """Direct path: a private copy of ``block_id``'s parts (one per layer tensor), taken now.

        For a block the engine may still write while the store reads it (a partial tail that the next
        steps append to): the checksum and the stored bytes must come from one consistent copy.
        """

    @abc.abstractmethod
    def _write_back(self, sb: StagedBlocks, keep: list[bool]) -> None:
        """:meth:`StagedBlocks.commit` of a batch of this mover: write its kept destination blocks."""


class DirectMover(BlockMover):
    """The direct path (CPU caches): the parts are the pages themselves (zero-copy numpy views), a strided page
    a private copy; with ``private`` the whole batch a private copy in a buffer of the caller's pool. No slab,
    no batch limit."""

    def __init__(self, layers: Sequence[torch.Tensor | Sequence[torch.Tensor]]) -> None:
        super().__init__(layers)
        if self.device.type == "cuda":
            raise ValueError("CUDA KV caches need a StagingContext (pinned host staging)")
        self._rows = [_row_view(t) for t in self.tensors]

    def gather(
        self,
        block_ids: Sequence[int],
        *,
        after: Fence = None,
        timeout: float = 0.0,
        private: HostBufferPool | None = None,
    ) -> StagedBlocks | None:
        """See :meth:`BlockMover.gather`: the parts are the pages themselves, unless ``private``. Never None."""
        self._check(block_ids)
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

    def scatter_targets(
        self,
        block_ids: Sequence[int],
        *,
        after: Fence = None,
        timeout: float = 0.0,
        private: HostBufferPool | None = None,
    ) -> StagedBlocks | None:
        """See :meth:`BlockMover.scatter_targets`: contiguous pages are written in place by the store (commit
        only copies staged strided pages), or every part lies in a private buffer of ``private``. Never None."""
        self._check(block_ids)
        if private is not None:
            private_parts, buffer = self._private_parts(len(block_ids), private)
            to_copy = [list(enumerate(row)) for row in private_parts]
            return self._batch(block_ids, private_parts, buffer=buffer, host_copies=to_copy)
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

    def snapshot(self, block_id: int) -> list[np.ndarray]:
        """A private copy of ``block_id``'s parts (one per layer tensor), taken now.

        For a block the engine may still write while the store reads it (a partial tail that the next
        steps append to): the checksum and the stored bytes must come from one consistent copy.
        """
        self._check([block_id])
        return [np.array(self._host_page(k, block_id)[0], copy=True) for k in range(len(self.tensors))]

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

    def _write_back(self, sb: StagedBlocks, keep: list[bool]) -> None:
        """:meth:`StagedBlocks.commit` of a batch of this mover: write its kept destination blocks' pages."""
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


def block_mover(
    layers: Sequence[torch.Tensor | Sequence[torch.Tensor]], *, staging: StagingContext | None = None
) -> BlockMover:
    """The mover of one store group's caches: staged when ``staging`` is given (CUDA caches need it; CPU
    caches may use it, for tests), else direct."""
    if staging is None:
        return DirectMover(layers)
    # the staged path imports the direct one's base, so it is imported here, when asked for
    from hybridkv.connector.datapath.staged_mover import StagedMover

    return StagedMover(layers, staging=staging)
