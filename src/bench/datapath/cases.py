"""The data-path bench's cases: KV geometries, their layers, the movers and buffers of one (geometry, batch)
case, and what each round times."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hybridkv.connector.datapath.movers import (
    BlockMover,
    StagedBlocks,
    flatten_layers,
)
from hybridkv.connector.datapath.staged_mover import StagedMover

DEFAULT_BATCHES = (16, 64, 256)
#: The directions the bench's kernel movers route through the copy kernel.
KERNEL_DIRECTIONS = frozenset({"save", "load"})
MiB = 1 << 20


@dataclass(frozen=True)
class Geometry:
    name: str
    description: str
    layers: int
    kind: str  # "attn" | "mamba"


GEOMETRIES = {
    "attn": Geometry(
        "attn",
        "32 layers x (K+V, 16 tok, 8 heads, 128 dim, bf16) = 64 KiB/layer-block, 2 MiB/block",
        32,
        "attn",
    ),
    "mamba": Geometry(
        "mamba",
        "4 layers x Mamba state page 1 MiB = [conv (3,8192) bf16 transposed view, ssm (32,64,122) fp32], 4 MiB/block",
        4,
        "mamba",
    ),
}


def build_layers(geo: Geometry, num_blocks: int, device: torch.device) -> list[Any]:
    """Per-layer caches shaped like vLLM's (attention: one tensor; Mamba: [conv, ssm] on one raw storage)."""
    out: list[Any] = []
    for _ in range(geo.layers):
        if geo.kind == "attn":
            t = torch.empty(num_blocks, 2, 16, 8, 128, dtype=torch.bfloat16, device=device)
            t.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
            out.append(t)
        else:
            conv_bytes, page = 3 * 8192 * 2, 1 * MiB
            raw = torch.empty(num_blocks, page, dtype=torch.uint8, device=device)
            raw.random_(0, 255)
            conv = raw[:, :conv_bytes].view(torch.bfloat16).view(num_blocks, 3, 8192).transpose(1, 2)
            ssm = raw[:, conv_bytes:].view(torch.float32).view(num_blocks, 32, 64, 122)
            out.append([conv, ssm])  # conv pages are strided (transposed) views
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, device work included (synchronized before and after)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def gb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _copy_out(sb: StagedBlocks, sink: np.ndarray) -> None:
    """What a store's put does with the parts: read them, in order, into its own buffer."""
    pos = 0
    for blk in sb.parts:
        for p in blk:
            np.copyto(sink[pos : pos + p.nbytes], p)
            pos += p.nbytes


def _copy_in(sb: StagedBlocks, src: np.ndarray) -> None:
    """What a store's get_into does with the targets: fill them, in order."""
    pos = 0
    for blk in sb.parts:
        for p in blk:
            np.copyto(p, src[pos : pos + p.nbytes])
            pos += p.nbytes


def _raw(page: torch.Tensor) -> torch.Tensor:
    """A page's bytes (compared as bytes: random bf16/fp32 bit patterns include NaNs)."""
    return page.contiguous().reshape(-1).view(torch.uint8)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


#: What each case times, in the order of one round: ours next to its baseline, so that each round gives a
#: paired ratio. CUDA: ``gather`` / ``scatter`` move a batch with the copy kernel (``cuda_copy: kernel``;
#: the DMA path where the kernel cannot move the pages), ``gather_dma`` / ``scatter_dma`` by DMA copies of
#: device staging chunks that the copy kernel packs and unpacks (``cuda_copy: dma``, and ``auto`` above its
#: kernel limit), ``gather_dma_idx`` / ``scatter_dma_idx`` the same with the chunks packed by one
#: ``index_select`` / ``index_copy_`` per layer tensor (where Triton is missing or the pages are strided);
#: ``per_page_gather``: one copy per (block, layer page) into the pinned buffer.
MEASURES = (
    "gather",
    "d2h_copy",
    "gather_dma",
    "gather_dma_idx",
    "scatter",
    "h2d_copy",
    "scatter_dma",
    "scatter_dma_idx",
    "per_page_gather",
)
RATIOS = {
    "gather_ratio": ("gather", "d2h_copy"),
    "gather_dma_ratio": ("gather_dma", "d2h_copy"),
    "gather_dma_idx_ratio": ("gather_dma_idx", "d2h_copy"),
    "scatter_ratio": ("scatter", "h2d_copy"),
    "scatter_dma_ratio": ("scatter_dma", "h2d_copy"),
    "scatter_dma_idx_ratio": ("scatter_dma_idx", "h2d_copy"),
}


@dataclass
class Case:
    """One (geometry, batch): its closures to time and the seconds measured so far, per measure."""

    geometry: str
    batch: int
    nbytes: int
    block_nbytes: int
    verified: bool
    kernel: str  # the directions the copy kernel took ("save+load"), or why none
    timers: dict[str, Callable[[], object]]
    seconds: dict[str, list[float]]


@dataclass
class Buffers:
    """Baseline buffers shared by every case (each uses a prefix): the largest batch's bytes."""

    sink: np.ndarray  # what the store's side of a copy reads into / writes from (host)
    source: np.ndarray | None  # CPU: the baseline copy's source
    host: torch.Tensor | None  # CUDA: pinned
    dev: torch.Tensor | None  # CUDA: device


def make_case(
    geo: Geometry,
    layers: list[Any],
    movers: dict[str, BlockMover],
    num_blocks: int,
    batch: int,
    *,
    device: torch.device,
    buffers: Buffers,
    per_page: bool,
    rng: random.Random,
) -> Case:
    """Set up one (geometry, batch): scattered ids, a byte-exact round-trip check of every mover, one
    warm-up of each measure. ``movers``: measure-name suffix ("", "_dma", "_dma_idx") -> the mover it times."""
    flat = flatten_layers(layers)
    mover = movers[""]
    nbytes = batch * mover.block_nbytes
    picks = rng.sample(range(num_blocks), 2 * batch)  # scattered ids, like a real block table
    src_ids, dst_ids = picks[:batch], picks[batch:]
    sink = buffers.sink[:nbytes]

    # correctness first: per mover, scatter(gather(src)) into dst reproduces src (dst zeroed before: the
    # random source pages differ from it, so a round trip that moved nothing cannot pass)
    verified = True
    for m in movers.values():
        for t in flat:
            for d in dst_ids:
                t[d].zero_()
        sb = m.gather(src_ids, timeout=10)
        assert sb is not None
        with sb:
            _copy_out(sb, sink)
        sb = m.scatter_targets(dst_ids, timeout=10)
        assert sb is not None
        _copy_in(sb, sink)
        sb.commit()
        sb.release()
        _sync(device)
        verified = verified and all(
            torch.equal(_raw(t[d]), _raw(t[s])) for t in flat for s, d in zip(src_ids, dst_ids, strict=True)
        )

    timers: dict[str, Callable[[], object]] = {}
    for suffix, m in movers.items():

        def gather(m: BlockMover = m) -> None:
            sb = m.gather(src_ids, timeout=10)
            assert sb is not None
            with sb:
                if device.type == "cpu":  # zero-copy views: count the store's copy out of them
                    _copy_out(sb, sink)

        def scatter(m: BlockMover = m) -> None:
            sb = m.scatter_targets(dst_ids, timeout=10)
            assert sb is not None
            if device.type == "cpu":  # the store writes the pages (views) directly: count that copy
                _copy_in(sb, sink)
            sb.commit()
            sb.release()

        timers["gather" + suffix] = gather
        timers["scatter" + suffix] = scatter
    if device.type == "cuda":
        assert buffers.host is not None and buffers.dev is not None
        host, dev = buffers.host[:nbytes], buffers.dev[:nbytes]
        timers["d2h_copy"] = lambda: _copy(host, dev)
        timers["h2d_copy"] = lambda: _copy(dev, host)
        if per_page:
            pbs = mover.page_nbytes

            def per_page_gather() -> None:  # one copy per (block, layer page) straight into pinned memory
                pos = 0
                for b in src_ids:
                    for t, pb in zip(flat, pbs, strict=True):
                        page = t[b]
                        if not page.is_contiguous():
                            page = page.contiguous()
                        host[pos : pos + pb].copy_(page.reshape(-1).view(torch.uint8), non_blocking=True)
                        pos += pb

            timers["per_page_gather"] = per_page_gather
    else:
        assert buffers.source is not None
        source = buffers.source[:nbytes]
        timers["d2h_copy"] = timers["h2d_copy"] = lambda: np.copyto(sink, source)
    timers = {m: timers[m] for m in MEASURES if m in timers}
    for fn in timers.values():  # warm-up (also allocates lazily created staging buffers)
        fn()
    _sync(device)
    kernel = _kernel_report(mover)
    return Case(
        geo.name, batch, nbytes, mover.block_nbytes, verified, kernel, timers, {m: [] for m in timers}
    )


def _kernel_report(mover: BlockMover) -> str:
    """Which directions the copy kernel moves for ``mover`` ("save+load"), or "no" with the reason."""
    if not isinstance(mover, StagedMover):
        return "no"
    return "+".join(sorted(mover.kernel_directions, reverse=True)) or (
        "no: " + mover.kernel_unsupported if mover.kernel_unsupported else "no"
    )
