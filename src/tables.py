"""Aligned text tables for command output (``hybridkv store ls``, ``describe``, the benches' reports).

A leaf module: imports nothing of hybridkv, so the product's commands and the tooling both use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["format_cell", "format_table"]


def format_cell(value: Any) -> str:
    """A table cell: floats with 3 significant digits (thousands and up: whole, comma-grouped), ``None`` empty."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """Render ``rows`` as a left-aligned text table with the given column order (cells: ``format_cell``)."""
    text_rows = [[format_cell(row.get(column)) for column in columns] for row in rows]
    widths = [max([len(column)] + [len(r[i]) for r in text_rows]) for i, column in enumerate(columns)]
    lines = ["  ".join(column.ljust(widths[i]) for i, column in enumerate(columns))]
    lines.append("  ".join("-" * width for width in widths))
    lines.extend("  ".join(r[i].ljust(widths[i]) for i in range(len(columns))) for r in text_rows)
    return "\n".join(lines)
