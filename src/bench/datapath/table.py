"""The data-path bench's rows as text, and its report file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.report import write_json
from hybridkv.tables import format_cell
from hybridkv.tables import format_table as _format_table

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


def row_text(row: dict[str, Any]) -> str:
    return "  ".join(f"{c}={format_cell(row.get(c))}" for c in COLUMNS if c in row)
