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

from hybridkv.bench.datapath.bench import (
    RATIO_TARGET,
    TARGET_MIN_BLOCKS,
    beside_compute_rows,
    datapath_targets,
    run_bench,
    summarize,
)
from hybridkv.bench.datapath.cases import (
    DEFAULT_BATCHES,
    GEOMETRIES,
    KERNEL_DIRECTIONS,
    MEASURES,
    RATIOS,
    Case,
    Geometry,
    build_layers,
    make_case,
)
from hybridkv.bench.datapath.cli import (
    add_arguments,
    main,
)
from hybridkv.bench.datapath.table import (
    BESIDE_COLUMNS,
    COLUMNS,
    format_table,
    write_report,
)

__all__ = [
    "BESIDE_COLUMNS",
    "COLUMNS",
    "DEFAULT_BATCHES",
    "GEOMETRIES",
    "KERNEL_DIRECTIONS",
    "MEASURES",
    "RATIOS",
    "RATIO_TARGET",
    "TARGET_MIN_BLOCKS",
    "Case",
    "Geometry",
    "add_arguments",
    "beside_compute_rows",
    "build_layers",
    "datapath_targets",
    "format_table",
    "main",
    "make_case",
    "run_bench",
    "summarize",
    "write_report",
]
