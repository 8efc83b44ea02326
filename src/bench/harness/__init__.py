"""What every bench shares, so that a bench module states its workload only.

- :mod:`~hybridkv.bench.harness.rounds`  -- rounds and the interleaving of arms (each arm takes each place in
  turn), the host's load average around a measurement
- :mod:`~hybridkv.bench.harness.stats`   -- medians and the ``{median, min, max}`` spread of repeated rounds
- :mod:`hybridkv.bench.report`           -- the targets table (met / missed), JSON, PNG plots (re-exported
  here)

The per-request record of the benches that drive an OpenAI server reads the development kit's server, so it
lives with those benches in the development distribution (``hybridkv_dev.bench.record``).

The command-line side (the flags every bench takes: ``--rounds``, ``--out``, ``--no-plot``, ``--json``) is
:mod:`hybridkv.cli.bench_options`: building the parser loads no tooling.
"""

from __future__ import annotations

from hybridkv.bench.harness.rounds import interleaved, load_average, load_change, rotated
from hybridkv.bench.harness.stats import median_or_none, spread, spread_or_none
from hybridkv.bench.report import (
    TARGET_COLUMNS,
    format_targets,
    pyplot_or_none,
    save_figure,
    save_report,
    spread_text,
    target_row,
    write_json,
)

__all__ = [
    "TARGET_COLUMNS",
    "format_targets",
    "interleaved",
    "load_average",
    "load_change",
    "median_or_none",
    "pyplot_or_none",
    "rotated",
    "save_figure",
    "save_report",
    "spread",
    "spread_or_none",
    "spread_text",
    "target_row",
    "write_json",
]
