"""One kernel launch moves a whole batch between paged CUDA KV caches and a pinned host slab, or packs one
chunk of a batch into a device staging buffer for the DMA path.

torch + Triton only (no vLLM). Imported only when a :class:`~hybridkv.connector.datapath.movers.StagingContext`
routes a direction through the kernel or packs by it (``cuda_copy``), so ``cuda_copy: dma`` never imports it.

Packing (:meth:`KernelCopier.stage_launches`, :meth:`KernelCopier.launch_staged`): the same kernel with the
device staging buffer as its "slab" and per-launch tables (a chunk's tensors, their offsets in the buffer) --
one to three launches per chunk instead of one ``index_select`` per layer tensor, so the host no longer holds
back the chunk's DMA (docs/performance.md, "The kernel packs the DMA path's chunks").

The kernel reads (or writes) the pinned slab straight over PCIe: pinned host memory has one address that the
GPU can use too (unified virtual addressing), so no device staging buffer and no DMA copy sit in between, and
one launch covers every (layer tensor, block) page of the batch, whatever the number of layers. The page
addresses come from a table of the layer tensors' base pointers, so the layer tensors need not share a
storage. A fixed, small number of programs loops over the pages (``NUM_PROGRAMS``): as fast as more of them,
and the forward running beside a transfer keeps most of the GPU (see docs/performance.md, "One copy kernel
instead of packing plus DMA").

Slab layout: the one :class:`~hybridkv.connector.datapath.movers.BlockMover` fixes (tensor k's pages from
``segments[k]``, batch row r at ``segments[k] + r * page_nbytes[k]``), so the store sees the same parts
whichever path filled them.

Tests run the kernel on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before this
module is imported).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: 8-byte words one program moves per loop step.
TILE_WORDS = 4096
#: Warps per program.
NUM_WARPS = 8
#: Programs per launch (each loops over pages); see the module docstring for why this few.
NUM_PROGRAMS = 8

#: Programs per launch packing a device staging buffer: device memory on both sides, a launch of a few
#: tens of microseconds per chunk, so it may take more of the GPU than the PCIe launches (NUM_PROGRAMS).
PACK_NUM_PROGRAMS = 32

_WORD = 8


@dataclass(frozen=True)
class StageLaunch:
    """One launch of a staging chunk: the batch rows ``[r0, r1)`` of some layer tensors, with their device
    tables, one entry per tensor (see :meth:`KernelCopier.stage_launches`)."""

    r0: int
    r1: int
    page_ptrs: torch.Tensor
    page_strides: torch.Tensor
    offsets: torch.Tensor
    page_words: torch.Tensor


# Triton reads the parameters' annotations (tl.constexpr), so the others stay unannotated for mypy.
# Sizes are not specialized on (a batch of 1 or of 16 blocks would each compile a variant, on a load thread),
# nor the pair tables' addresses (a launch over pairs from an odd index starts 8 bytes off a 16-byte boundary).
@triton.jit(do_not_specialize=["rows", "blocks", "num_pairs", "tiles_per_page", "num_tiles"])  # type: ignore[untyped-decorator]
def _copy_pages(  # type: ignore[no-untyped-def]  # noqa: PLR0917 -- a Triton kernel: its launch passes arguments by position
    page_ptrs,  # int64 [num_tensors]: each layer tensor's base address
    page_strides,  # int64 [num_tensors]: words from one block's page to the next
    slab_offsets,  # int64 [num_tensors]: words from the slab's start to the tensor's segment
    page_words,  # int64 [num_tensors]: words in one page
    rows,  # int64 [num_pairs]: slab rows
    blocks,  # int64 [num_pairs]: the block ids they pair with
    slab,  # int64 words of the pinned host slab (or of a device staging buffer)
    num_pairs,
    tiles_per_page,
    num_tiles,
    TO_SLAB: tl.constexpr,
    TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    for t in range(pid, num_tiles, num_programs):
        page = t // tiles_per_page
        start = (t - page * tiles_per_page) * TILE
        k = page // num_pairs
        j = page - k * num_pairs
        words = tl.load(page_words + k)
        if start < words:
            row = tl.load(rows + j)
            block = tl.load(blocks + j)
            base = tl.load(page_ptrs + k).to(tl.pointer_type(tl.int64)) + block * tl.load(page_strides + k)
            at = tl.load(slab_offsets + k) + row * words
            offs = start + tl.arange(0, TILE)
            mask = offs < words
            if TO_SLAB:
                tl.store(slab + at + offs, tl.load(base + offs, mask=mask), mask=mask)
            else:
                tl.store(base + offs, tl.load(slab + at + offs, mask=mask), mask=mask)


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unsupported_reason(tensors: Sequence[torch.Tensor]) -> str | None:
    """Why the kernel cannot move these layer tensors' pages (None: it can).

    Every page must be contiguous and a whole number of 8-byte words, starting on a word; the tensors must be
    on CUDA (or on the CPU under Triton's interpreter).
    """
    for k, t in enumerate(tensors):
        if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreted()):
            return f"tensor {k} is on {t.device}"
        if t.dim() < 2 or not t[0].is_contiguous():
            return f"tensor {k} has strided pages (shape {tuple(t.shape)}, strides {t.stride()})"
        page_nbytes = int(t[0].numel()) * t.element_size()
        if page_nbytes % _WORD or (t.stride(0) * t.element_size()) % _WORD or t.data_ptr() % _WORD:
            return f"tensor {k}'s pages are not whole 8-byte words on 8-byte boundaries"
    return None


class KernelCopier:
    """Moves a batch of one group's pages between its layer tensors and a slab, in one launch.

    ``segments`` / ``page_nbytes``: the slab layout (byte offsets of each tensor's segment, bytes per page).
    The caller serializes calls per direction and waits for each launch (the pair table of a direction is
    reused by its next call), and launches on the stream whose order it needs (Triton uses the current one).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        segments: Sequence[int],
        page_nbytes: Sequence[int],
        max_blocks: int,
    ) -> None:
        reason = unsupported_reason(tensors)
        if reason is not None:
            raise ValueError(f"the copy kernel cannot move these pages: {reason}")
        assert all(s % _WORD == 0 for s in segments), f"slab segments {list(segments)} not on 8-byte words"
        device = tensors[0].device
        self.num_tensors = len(tensors)
        self._page_ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)
        self._page_strides = torch.tensor(
            [t.stride(0) * t.element_size() // _WORD for t in tensors], dtype=torch.int64, device=device
        )
        self._slab_offsets = torch.tensor([s // _WORD for s in segments], dtype=torch.int64, device=device)
        words = [pb // _WORD for pb in page_nbytes]
        self._words = words
        self._max_blocks = max_blocks
        self._page_words = torch.tensor(words, dtype=torch.int64, device=device)
        self._tiles_per_page = triton.cdiv(max(words), TILE_WORDS)
        self._keep_alive = list(tensors)  # the pointer table must not outlive the tensors
        # Per direction: (slab rows, block ids) read by the kernel straight from pinned host memory.
        pin = device.type == "cuda"
        self._pairs = {
            to_slab: torch.empty(2 * max_blocks, dtype=torch.int64, pin_memory=pin)
            for to_slab in (True, False)
        }
        self._pairs_host = {to_slab: pairs.numpy() for to_slab, pairs in self._pairs.items()}  # fast fills
        # The same for packing the device staging buffers (``launch_staged``).
        self._stage_pairs = {
            to_stage: torch.empty(2 * max_blocks, dtype=torch.int64, pin_memory=pin)
            for to_stage in (True, False)
        }
        self._stage_pairs_host = {to_stage: pairs.numpy() for to_stage, pairs in self._stage_pairs.items()}
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile both directions now, with launches that copy nothing: the first launch of a process
        took 0.6 s (Triton's disk cache warm) to 1.4 s (cold) on an H200 host, which on a load thread would
        be the first hit's wait."""
        for to_slab in (True, False):
            self._launch(to_slab, self._pairs[to_slab], num_pairs=0)  # zero tiles: the slab is never touched
        if self._page_ptrs.is_cuda:
            torch.cuda.synchronize(self._page_ptrs.device)

    def copy(
        self, *, to_slab: bool, rows: Sequence[int], block_ids: Sequence[int], slab: torch.Tensor
    ) -> None:
        """Enqueue the copy of ``block_ids``' pages to (``to_slab``) or from slab rows ``rows``."""
        num_pairs = len(rows)
        assert num_pairs == len(block_ids), f"{num_pairs} slab rows for {len(block_ids)} blocks"
        if num_pairs == 0:
            return
        pairs = self._pairs[to_slab]
        assert 2 * num_pairs <= pairs.numel(), f"{num_pairs} blocks > the copier's {pairs.numel() // 2}"
        host = self._pairs_host[to_slab]
        host[:num_pairs] = rows
        host[self._max_blocks : self._max_blocks + num_pairs] = block_ids
        if not interpreted():
            assert slab.is_pinned(), "the copy kernel reads and writes pinned host slabs only"
        self._launch(to_slab, slab, num_pairs)

    def _launch(self, to_slab: bool, slab: torch.Tensor, num_pairs: int) -> None:
        """One launch over ``num_pairs`` pairs of ``to_slab``'s pair table (filled by the caller)."""
        pairs = self._pairs[to_slab]
        num_tiles = self.num_tensors * num_pairs * self._tiles_per_page
        _copy_pages[(max(1, min(NUM_PROGRAMS, num_tiles)),)](
            self._page_ptrs,
            self._page_strides,
            self._slab_offsets,
            self._page_words,
            pairs,
            pairs[self._max_blocks :],
            slab.view(torch.int64),
            num_pairs,
            self._tiles_per_page,
            num_tiles,
            TO_SLAB=to_slab,
            TILE=TILE_WORDS,
            num_warps=NUM_WARPS,
        )

    # -- packing a device staging buffer (the DMA path) ----------------------------------------------------
    def stage_launches(self, pieces: Sequence[tuple[int, int, int, int]]) -> list[StageLaunch]:
        """The launches that pack (or unpack) one staging chunk: ``pieces`` are (tensor, first row, end row,
        byte offset of the first row in the staging buffer); one launch per distinct row range (a chunk
        holds whole tensors but at its two ends, so one to three launches).

        Device tables, built once per batch size by the caller (a synchronous upload)."""
        by_rows: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for k, r0, r1, stage in pieces:
            assert stage % _WORD == 0, f"piece of tensor {k} at staging byte {stage}, not on an 8-byte word"
            by_rows.setdefault((r0, r1), []).append((k, stage))
        device = self._page_ptrs.device
        launches = []
        for (r0, r1), members in by_rows.items():
            ks = [k for k, _ in members]
            # row r of tensor k lands at words offsets[k] + r * page_words[k]: the piece's row r0 at its offset
            offsets = [stage // _WORD - r0 * self._words[k] for k, stage in members]
            launches.append(
                StageLaunch(
                    r0,
                    r1,
                    self._page_ptrs[ks].clone(),
                    self._page_strides[ks].clone(),
                    torch.tensor(offsets, dtype=torch.int64, device=device),
                    self._page_words[ks].clone(),
                )
            )
        return launches

    def fill_stage_pairs(self, to_stage: bool, rows: Sequence[int], block_ids: Sequence[int]) -> None:
        """The (row, block id) pairs the next :meth:`launch_staged` calls of a direction read, rows
        ascending (every batch row for a pack; the kept rows for an unpack)."""
        host = self._stage_pairs_host[to_stage]
        num_pairs = len(rows)
        assert num_pairs == len(block_ids) <= self._max_blocks, f"{num_pairs} pairs for {len(block_ids)} ids"
        host[:num_pairs] = rows
        host[self._max_blocks : self._max_blocks + num_pairs] = block_ids

    def launch_staged(
        self, to_stage: bool, launch: StageLaunch, stage: torch.Tensor, first: int, num_pairs: int
    ) -> None:
        """Enqueue ``launch`` over pairs ``[first, first + num_pairs)`` of the filled table, between the
        pages and the device staging buffer ``stage`` (on the current stream)."""
        if num_pairs <= 0:
            return
        pairs = self._stage_pairs[to_stage]
        num_tiles = launch.page_ptrs.numel() * num_pairs * self._tiles_per_page
        _copy_pages[(max(1, min(PACK_NUM_PROGRAMS, num_tiles)),)](
            launch.page_ptrs,
            launch.page_strides,
            launch.offsets,
            launch.page_words,
            pairs[first:],
            pairs[self._max_blocks + first :],
            stage.view(torch.int64),
            num_pairs,
            self._tiles_per_page,
            num_tiles,
            TO_SLAB=to_stage,
            TILE=TILE_WORDS,
            num_warps=NUM_WARPS,
        )
