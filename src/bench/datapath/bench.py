"""The data-path bench's rounds: every measure of every case, interleaved; its rows, targets, and the
transfers beside a matmul loop."""

from __future__ import annotations

import os
import platform
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from hybridkv.bench.datapath.cases import (
    DEFAULT_BATCHES,
    GEOMETRIES,
    KERNEL_DIRECTIONS,
    RATIOS,
    Buffers,
    Case,
    MiB,
    build_layers,
    gb_per_s,
    make_case,
    timed_seconds,
)
from hybridkv.bench.datapath.table import row_text
from hybridkv.bench.report import target_row
from hybridkv.connector.datapath.movers import (
    DEFAULT_STAGE_BYTES,
    BlockMover,
    PinnedPool,
    StagingContext,
    block_mover,
    flatten_layers,
)
from hybridkv.tables import format_cell


def _spread(values: Sequence[float]) -> str:
    return f"{format_cell(min(values))}-{format_cell(max(values))}"


def summarize(case: Case) -> dict[str, Any]:
    """A case's row: per measure the median GB/s and its spread; per ratio the median of the rounds'
    paired ratios (ours / the contiguous copy timed in the same round) and its spread."""
    row: dict[str, Any] = {
        "geometry": case.geometry,
        "blocks": case.batch,
        "mib": case.nbytes / MiB,
        "block_kib": case.block_nbytes / 1024,
        "rounds": min(len(s) for s in case.seconds.values()),
        "verified": case.verified,
        "kernel": case.kernel,
    }
    for m, secs in case.seconds.items():
        gbps = [gb_per_s(case.nbytes, s) for s in secs]
        row[f"{m}gb_per_s"] = statistics.median(gbps)
        row[f"{m}_gbps_spread"] = _spread(gbps)
        row[f"{m}_gbps_all"] = gbps
    for name, (ours, base) in RATIOS.items():
        if ours not in case.seconds:
            continue
        ratios = [b / o for o, b in zip(case.seconds[ours], case.seconds[base], strict=True)]
        row[name] = statistics.median(ratios)
        row[f"{name}_spread"] = _spread(ratios)
    return row


def _flat_bytes(layers: list[Any]) -> int:
    return sum(int(t[0].numel()) * t.element_size() for t in flatten_layers(layers))


def run_bench(
    device: str = "cuda",
    *,
    geometries: Sequence[str] = ("attn", "mamba"),
    batches: Sequence[int] = DEFAULT_BATCHES,
    repeats: int = 5,
    stage_bytes: int = DEFAULT_STAGE_BYTES,
    per_page: bool = True,
    seed: int = 0,
    shared_slab: bool = False,
    beside_compute: bool = True,
) -> dict[str, Any]:
    """Measure every (geometry, batch); returns the JSON report (``rows`` plus environment).

    ``repeats`` rounds; each round times every measure of every case once, in order, so that a slow
    moment of the host or the bus lands on all configurations alike. CUDA: each batch size gets a staging
    context whose slab it fills, as a full PUT wave fills the worker's; ``shared_slab`` instead gives all
    cases one context sized for the largest batch (smaller batches then pay one PCIe copy per layer
    tensor rather than per staging chunk). ``beside_compute`` (CUDA): also time a matmul loop alone and with
    each path's transfers looping beside it (:func:`beside_compute_rows`). ``device="auto"``: CUDA when
    available, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
    if repeats < 1:
        raise RuntimeError(f"--repeats must be >= 1, got {repeats}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = max(2 * max(batches), 64) + 16
    caches = {name: build_layers(GEOMETRIES[name], num_blocks, dev) for name in geometries}
    contexts: list[StagingContext] = []
    # CUDA: each case times the copy kernel (""), DMA from staging chunks the kernel packs ("_dma") and DMA
    # from chunks packed by one index_select / index_copy_ per layer tensor ("_dma_idx"), as (kernel
    # directions, pack by kernel); the CPU has one direct path.
    paths: dict[str, tuple[frozenset[str], bool]] = (
        {"": (KERNEL_DIRECTIONS, True), "_dma": (frozenset(), True), "_dma_idx": (frozenset(), False)}
        if dev.type == "cuda"
        else {"": (frozenset(), False)}
    )

    def context(slab: int, kernel_directions: frozenset[str], pack_by_kernel: bool) -> StagingContext | None:
        if dev.type != "cuda":
            return None
        contexts.append(
            StagingContext(
                dev,
                PinnedPool(slab, slab, pin=True),
                stage_bytes=stage_bytes,
                kernel_directions=kernel_directions,
                pack_by_kernel=pack_by_kernel,
            )
        )
        return contexts[-1]

    def slab_for(layers: list[Any], num_blocks_per_slab: int) -> int:
        return num_blocks_per_slab * _flat_bytes(layers) + 256 * len(flatten_layers(layers))

    # Built before any transfer (staging sizes settle when movers are built).
    movers: dict[tuple[str, int], dict[str, BlockMover]] = {}
    for suffix, (directions, pack) in paths.items():
        if shared_slab:  # one context whose slab holds the largest batch: smaller batches leave it part-full
            shared = context(max(slab_for(c, max(batches)) for c in caches.values()), directions, pack)
        for name in geometries:
            for b in batches:
                # else per (geometry, batch size), a slab the batch fills, like the worker's slab and a PUT wave
                ctx = shared if shared_slab else context(slab_for(caches[name], b), directions, pack)
                movers.setdefault((name, b), {})[suffix] = block_mover(caches[name], staging=ctx)
    max_nbytes = max(batches) * max(m[""].block_nbytes for m in movers.values())
    buffers = Buffers(
        np.empty(max_nbytes, dtype=np.uint8),
        np.ones(max_nbytes, dtype=np.uint8) if dev.type == "cpu" else None,
        torch.empty(max_nbytes, dtype=torch.uint8, pin_memory=True) if dev.type == "cuda" else None,
        torch.empty(max_nbytes, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None,
    )
    cases = [
        make_case(
            GEOMETRIES[name],
            caches[name],
            movers[name, batch],
            num_blocks,
            batch,
            device=dev,
            buffers=buffers,
            per_page=per_page and dev.type == "cuda",
            rng=rng,
        )
        for name in geometries
        for batch in batches
    ]
    for r in range(repeats):
        for case in cases:
            # Each round starts the case at another measure: the first transfer after switching cases ran
            # up to 15 % slower (measured: the same path timed first and third in a round), which must not
            # land on one path in every round.
            order = list(case.timers.items())
            for m, fn in order[r % len(order) :] + order[: r % len(order)]:
                case.seconds[m].append(timed_seconds(fn, dev))
    rows = [summarize(case) for case in cases]
    for row in rows:
        print(row_text(row), file=sys.stderr, flush=True)
    beside: list[dict[str, Any]] = []
    if dev.type == "cuda" and beside_compute:
        attn = [c for c in cases if c.geometry == "attn"] or cases
        beside = beside_compute_rows(min(attn, key=lambda c: abs(c.batch - 64)), dev, repeats)
    for ctx in contexts:
        ctx.close()
    del caches, movers, buffers
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    env = {
        "device": str(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "stage_bytes": stage_bytes,
        "repeats": repeats,
        "shared_slab": shared_slab,
        "statistic": "median of the rounds, spread min-max; ratios paired per round",
    }
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["cuda"] = torch.version.cuda
    report: dict[str, Any] = {
        "bench": "datapath",
        "env": env,
        "geometries": {k: asdict(GEOMETRIES[k]) for k in geometries},
        "rows": rows,
        "targets": datapath_targets(rows) if dev.type == "cuda" else [],
        "beside_compute": beside,
    }
    return report


#: The issue's target for the GPU data path: both directions at least this fraction of one contiguous pinned
#: copy, for batches of ``TARGET_MIN_BLOCKS`` blocks or more.
RATIO_TARGET = 0.85
TARGET_MIN_BLOCKS = 64


def datapath_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per CUDA row of ``TARGET_MIN_BLOCKS``+ blocks, each path's gather and scatter ratio against
    ``RATIO_TARGET`` (the kernel's rows only where it moved the pages)."""
    out = []
    for row in rows:
        if row["blocks"] < TARGET_MIN_BLOCKS:
            continue
        case = f"{row['geometry']}, {row['blocks']} blocks"
        paths = [("dma", "_dma")] + ([("kernel", "")] if not row["kernel"].startswith("no") else [])
        for path, suffix in paths:
            for direction in ("gather", "scatter"):
                name = f"{direction}{suffix}_ratio"
                if name in row:
                    out.append(
                        target_row(f"{case}: {direction} by {path} / copy", row[name], ">=", RATIO_TARGET)
                    )
    return out


#: The GPU work a transfer runs beside in ``beside_compute_rows``: this many bf16 matmuls of this size.
BESIDE_MATMULS, BESIDE_SIZE = 30, 8192


def beside_compute_rows(case: Case, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    """What each path's transfers cost the forward running beside them, for one case.

    A side stream runs ``BESIDE_MATMULS`` bf16 matmuls (as a forward would); meanwhile the host runs one
    transfer measure of ``case`` back to back until they finish. Per measure (and ``alone``: no transfer),
    the matmuls' median time over ``repeats`` interleaved rounds, its ratio to ``alone`` (``slowdown``), and
    the GB/s the transfers moved meanwhile. The copy kernel occupies a few SMs while it copies; packing
    with DMA uses them only to pack.
    """
    a = torch.randn(BESIDE_SIZE, BESIDE_SIZE, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def run(load: Callable[[], object] | None) -> tuple[float, float]:
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            start.record()
            for _ in range(BESIDE_MATMULS):
                a @ a
            end.record()
        moved = 0
        while not end.query():  # type: ignore[no-untyped-call]
            if load is not None:
                load()
                moved += case.nbytes
        torch.cuda.synchronize(device)
        ms = float(start.elapsed_time(end))
        return ms, moved / (ms / 1e3) / 1e9

    loads: dict[str, Callable[[], object] | None] = {"alone": None}
    loads.update(
        {
            m: case.timers[m]
            for m in ("gather", "gather_dma", "gather_dma_idx", "scatter", "scatter_dma", "scatter_dma_idx")
            if m in case.timers
        }
    )
    run(None)  # warm-up (cuBLAS picks its kernel)
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in loads}
    for _ in range(repeats):
        for m, load in loads.items():
            samples[m].append(run(load))
    alone = statistics.median(ms for ms, _ in samples["alone"])
    rows = []
    for m, vals in samples.items():
        ms_all = [ms for ms, _ in vals]
        rows.append(
            {
                "geometry": case.geometry,
                "blocks": case.batch,
                "beside": m,
                "matmul_ms": statistics.median(ms_all),
                "matmul_ms_spread": _spread(ms_all),
                "slowdown": statistics.median(ms_all) / alone,
                "moved_gbps": statistics.median(g for _, g in vals),
            }
        )
    return rows
