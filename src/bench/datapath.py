"""Throughput of the connector's block data path (``hybridkv.connector.datapath``) vs a plain copy.

torch + numpy only, so it runs on a bare GPU host::

    mkdir -p /tmp/pkg && ln -s $PWD/src /tmp/pkg/hybridkv
    PYTHONPATH=/tmp/pkg python -m hybridkv.bench.datapath --device cuda --out DIR

(or ``hybridkv bench datapath``). For each KV geometry and batch size it measures, in the same run:

- ``gather``: :meth:`BlockMover.gather` of a batch of scattered block ids (all layers) into host parts --
  CUDA: device -> pinned slab via ``index_select`` packing + one copy per staging chunk, synchronized;
  CPU: the zero-copy views, then one ``np.copyto`` per part into a host buffer (what a store does).
- ``scatter``: :meth:`BlockMover.scatter_targets` + ``commit`` (CUDA: pinned slab -> device blocks).
- the baselines: one contiguous ``copy_`` of the same number of bytes device -> pinned host and back
  (CPU: one ``np.copyto``), and (CUDA) the naive alternative to our packing, one ``copy_`` per
  (block, layer) page straight into the pinned slab.

GB/s are 1e9 bytes per second of the best of ``--repeats`` timed runs (after one warm-up). The report
(JSON) lands in ``--out`` (a directory, or a path ending in ``.json``).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hybridkv.bench.report import format_cell, write_json
from hybridkv.bench.report import format_table as _format_table
from hybridkv.connector.datapath import (
    DEFAULT_STAGE_BYTES,
    BlockMover,
    PinnedPool,
    StagedBlocks,
    StagingContext,
    flatten_layers,
)

DEFAULT_BATCHES = (16, 64, 256)
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


def _best(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (also allocates lazily created slabs / staging buffers)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


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


def _ctx(device: torch.device, slab: int, stage_bytes: int) -> StagingContext:
    return StagingContext(device, PinnedPool(slab, slab, pin=device.type == "cuda"), stage_bytes=stage_bytes)


def bench_case(
    geo: Geometry,
    layers: list[Any],
    num_blocks: int,
    batch: int,
    device: torch.device,
    *,
    repeats: int,
    stage_bytes: int,
    per_page: bool,
    rng: random.Random,
) -> dict[str, Any]:
    """One (geometry, batch) row: ours and the baselines, plus a byte-exact round-trip check."""
    flat = flatten_layers(layers)
    block_nbytes = sum(int(t[0].numel()) * t.element_size() for t in flat)
    staging = None
    if device.type == "cuda":  # one slab that holds the batch (the worker sizes slabs to a PUT wave)
        staging = _ctx(device, batch * block_nbytes + 256 * len(flat), stage_bytes)
    mover = BlockMover(layers, staging=staging)
    nbytes = batch * block_nbytes
    picks = rng.sample(range(num_blocks), 2 * batch)  # scattered ids, like a real block table
    src_ids, dst_ids = picks[:batch], picks[batch:]
    sink = np.empty(nbytes, dtype=np.uint8)

    # correctness first: scatter(gather(src)) into dst reproduces src
    sb = mover.gather(src_ids, timeout=10)
    assert sb is not None
    with sb:
        _copy_out(sb, sink)
    sb = mover.scatter_targets(dst_ids, timeout=10)
    assert sb is not None
    _copy_in(sb, sink)
    sb.commit()
    _sync(device)
    verified = all(
        torch.equal(_raw(t[d]), _raw(t[s])) for t in flat for s, d in zip(src_ids, dst_ids, strict=True)
    )

    def gather() -> None:
        sb = mover.gather(src_ids, timeout=10)
        assert sb is not None
        with sb:
            if device.type == "cpu":  # zero-copy views: count the store's copy out of them
                _copy_out(sb, sink)

    def scatter() -> None:
        sb = mover.scatter_targets(dst_ids, timeout=10)
        assert sb is not None
        if device.type == "cpu":  # the store writes the pages (views) directly: count that copy
            _copy_in(sb, sink)
        sb.commit()

    out: dict[str, Any] = {
        "geometry": geo.name,
        "blocks": batch,
        "mib": nbytes / MiB,
        "block_kib": block_nbytes / 1024,
        "gather_gbps": _gbps(nbytes, _best(gather, device, repeats)),
        "scatter_gbps": _gbps(nbytes, _best(scatter, device, repeats)),
        "verified": verified,
    }

    # baselines: one contiguous copy of the same bytes
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out["d2h_copy_gbps"] = _gbps(nbytes, _best(lambda: _copy(host, dev), device, repeats))
        out["h2d_copy_gbps"] = _gbps(nbytes, _best(lambda: _copy(dev, host), device, repeats))
        if per_page:
            pbs = mover.page_nbytes

            def naive() -> None:  # one copy per (block, layer page) straight into the pinned buffer
                pos = 0
                for b in src_ids:
                    for t, pb in zip(flat, pbs, strict=True):
                        page = t[b]
                        if not page.is_contiguous():
                            page = page.contiguous()
                        host[pos : pos + pb].copy_(page.reshape(-1).view(torch.uint8), non_blocking=True)
                        pos += pb

            out["per_page_gather_gbps"] = _gbps(nbytes, _best(naive, device, repeats))
        del host, dev
    else:
        a = np.ones(nbytes, dtype=np.uint8)
        b = np.empty_like(a)
        out["d2h_copy_gbps"] = out["h2d_copy_gbps"] = _gbps(
            nbytes, _best(lambda: np.copyto(b, a), device, repeats)
        )
    out["gather_ratio"] = out["gather_gbps"] / out["d2h_copy_gbps"]
    out["scatter_ratio"] = out["scatter_gbps"] / out["h2d_copy_gbps"]
    if staging is not None:
        staging.close()
    return out


def run_bench(
    device: str = "cuda",
    *,
    geometries: Sequence[str] = ("attn", "mamba"),
    batches: Sequence[int] = DEFAULT_BATCHES,
    repeats: int = 5,
    stage_bytes: int = DEFAULT_STAGE_BYTES,
    per_page: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure every (geometry, batch); returns the JSON report (``rows`` plus environment).
    ``device="auto"``: CUDA when available, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = []
    for name in geometries:
        geo = GEOMETRIES[name]
        num_blocks = max(2 * max(batches), 64) + 16
        layers = build_layers(geo, num_blocks, dev)
        for batch in batches:
            row = bench_case(
                geo,
                layers,
                num_blocks,
                batch,
                dev,
                repeats=repeats,
                stage_bytes=stage_bytes,
                per_page=per_page and dev.type == "cuda",
                rng=rng,
            )
            rows.append(row)
            print(_fmt_row(row), file=sys.stderr, flush=True)
        del layers
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
    }
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["cuda"] = torch.version.cuda
    report: dict[str, Any] = {
        "bench": "datapath",
        "env": env,
        "geometries": {k: asdict(GEOMETRIES[k]) for k in geometries},
        "rows": rows,
    }
    return report


COLUMNS = [
    "geometry",
    "blocks",
    "mib",
    "gather_gbps",
    "d2h_copy_gbps",
    "gather_ratio",
    "scatter_gbps",
    "h2d_copy_gbps",
    "scatter_ratio",
    "per_page_gather_gbps",
    "verified",
]


def _fmt_row(row: dict[str, Any]) -> str:
    return "  ".join(f"{c}={format_cell(row.get(c))}" for c in COLUMNS if c in row)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a text table of the ``COLUMNS`` any row has."""
    table: str = _format_table(rows, [c for c in COLUMNS if any(c in r for r in rows)])
    return table


def write_report(report: dict[str, Any], out: str) -> Path:
    """Write the JSON report; ``out`` is a directory (file ``datapath-<device>.json``) or a ``.json`` path."""
    target = Path(out)
    if target.suffix != ".json":
        target = target / f"datapath-{report['env']['device'].split(':')[0]}.json"
    return write_json(target, report)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hybridkv.bench.datapath``: the same flags and output as ``hybridkv bench datapath``."""
    from hybridkv.cli import datapath_cmds

    parser = argparse.ArgumentParser(prog="python -m hybridkv.bench.datapath", description=__doc__)
    datapath_cmds.add_arguments(parser)
    return datapath_cmds.handle_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
