"""Throughput of the connector's block data path (``hybridkv.connector.datapath.movers``) vs a plain copy.

torch + numpy only, so it runs on a bare GPU host::

    mkdir -p /tmp/pkg && ln -s $PWD/src /tmp/pkg/hybridkv
    PYTHONPATH=/tmp/pkg python -m hybridkv.bench.datapath --device cuda --out DIR

(or ``hybridkv bench datapath``). For each KV geometry and batch size it measures, in the same run:

- ``gather``: :meth:`BlockMover.gather` of a batch of scattered block ids (all layers) into host parts --
  CUDA: device -> pinned slab via ``index_select`` packing into a staging buffer, pipelined with one
  copy per staging chunk, synchronized; CPU: the zero-copy views, then one ``np.copyto`` per part into a
  host buffer (what a store does).
- ``scatter``: :meth:`BlockMover.scatter_targets` + ``commit`` (CUDA: pinned slab -> device blocks).
- the baselines: one contiguous ``copy_`` of the same number of bytes device -> pinned host and back
  (CPU: one ``np.copyto``), and (CUDA) the naive alternative to our packing, one ``copy_`` per
  (block, layer) page straight into the pinned slab.

Every case is set up (and warmed up once) first; then ``--repeats`` rounds each time every measure of every
case once, interleaved (each round starting a case at the next measure), so that a slow moment of the host or
the bus lands on all configurations alike.
GB/s are 1e9 bytes per second, the median of the rounds, with the spread (min-max); a ratio is the median
of the rounds' paired ratios (ours / the contiguous copy timed in the same round). On CUDA each batch size has
its own :class:`StagingContext` with a slab it fills, as a full PUT wave fills the worker's. The report
(JSON, every round's GB/s included) lands in ``--out`` (a directory, or a path ending in ``.json``).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hybridkv.bench.report import format_targets, target_row, write_json
from hybridkv.connector.datapath.movers import (
    DEFAULT_STAGE_BYTES,
    BlockMover,
    PinnedPool,
    StagedBlocks,
    StagingContext,
    block_mover,
    flatten_layers,
)
from hybridkv.connector.datapath.staged_mover import StagedMover
from hybridkv.tables import format_cell
from hybridkv.tables import format_table as _format_table

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


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, device work included (synchronized before and after)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _gbps(nbytes: int, seconds: float) -> float:
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
        gbps = [_gbps(case.nbytes, s) for s in secs]
        row[f"{m}_gbps"] = statistics.median(gbps)
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
                case.seconds[m].append(_timed(fn, dev))
    rows = [summarize(case) for case in cases]
    for row in rows:
        print(_fmt_row(row), file=sys.stderr, flush=True)
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


BESIDE_COLUMNS = ["geometry", "blocks", "beside", "matmul_ms", "matmul_ms_spread", "slowdown", "moved_gbps"]

COLUMNS = [
    "geometry",
    "blocks",
    "mib",
    "gather_gbps",
    "d2h_copy_gbps",
    "gather_ratio",
    "gather_ratio_spread",
    "scatter_gbps",
    "h2d_copy_gbps",
    "gather_dma_ratio",
    "gather_dma_idx_ratio",
    "scatter_ratio",
    "scatter_ratio_spread",
    "scatter_dma_ratio",
    "scatter_dma_idx_ratio",
    "per_page_gather_gbps",
    "kernel",
    "verified",
]


def _fmt_row(row: dict[str, Any]) -> str:
    return "  ".join(f"{c}={format_cell(row.get(c))}" for c in COLUMNS if c in row)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] = COLUMNS) -> str:
    """The rows as a text table of the ``columns`` any row has."""
    table: str = _format_table(rows, [c for c in columns if any(c in r for r in rows)])
    return table


def write_report(report: dict[str, Any], out: str) -> Path:
    """Write the JSON report; ``out`` is a directory (file ``datapath-<device>.json``) or a ``.json`` path."""
    target = Path(out)
    if target.suffix != ".json":
        target = target / f"datapath-{report['env']['device'].split(':')[0]}.json"
    return write_json(target, report)


# The exit codes of ``hybridkv`` (``hybridkv.cli.exit_codes``; the bench does not import the CLI).
_EXIT_OK = 0
_EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (``hybridkv bench datapath`` forwards its arguments to :func:`main`)."""
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda if available; %(default)s)")
    parser.add_argument("--out", default="bench-results", help="report directory or .json path (%(default)s)")
    parser.add_argument("--batches", default="16,64,256", help="blocks per batch (%(default)s)")
    parser.add_argument("--geometries", default="attn,mamba", help="comma-separated, of attn, mamba")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="interleaved timed rounds per measurement; medians and spread reported",
    )
    parser.add_argument("--stage-mib", type=int, default=32, help="device staging buffer MiB (%(default)s)")
    parser.add_argument("--no-per-page", action="store_true", help="skip the naive per-page copy baseline")
    parser.add_argument(
        "--no-beside-compute",
        action="store_true",
        help="CUDA: skip timing a matmul loop with each path's transfers running beside it",
    )


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m hybridkv.bench.datapath") -> int:
    """The benchmark's command line: ``python -m hybridkv.bench.datapath`` on a host with only torch and
    numpy, and ``hybridkv bench datapath`` (which forwards its arguments here, ``prog`` naming it)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2), already printed
        return int(exit_.code or 0)
    try:
        batches = [int(x) for x in str(args.batches).split(",") if x.strip()]
    except ValueError as error:
        print(f"error: bad --batches: {error}", file=sys.stderr)
        return _EXIT_USAGE
    geometries = [x.strip() for x in str(args.geometries).split(",") if x.strip()]
    unknown = [g for g in geometries if g not in GEOMETRIES]
    if unknown or not batches or min(batches) < 1:
        print(f"error: bad --geometries {unknown} or --batches {batches}", file=sys.stderr)
        return _EXIT_USAGE
    try:
        report = run_bench(
            str(args.device),
            geometries=geometries,
            batches=batches,
            repeats=args.repeats,
            stage_bytes=args.stage_mib << 20,
            per_page=not args.no_per_page,
            beside_compute=not args.no_beside_compute,
        )
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return _EXIT_USAGE
    print(format_table(report["rows"]))
    if report["beside_compute"]:
        print(format_table(report["beside_compute"], BESIDE_COLUMNS))
    if report["targets"]:
        print("\n" + format_targets(report["targets"]))
    print(f"report: {write_report(report, args.out)}")
    return _EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
