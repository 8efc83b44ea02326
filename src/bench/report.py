"""Output helpers for the benchmarks and their commands: targets tables, JSON reports, PNG plots.

Imports nothing heavy: ``hybridkv.bench.datapath`` (torch + numpy only) uses it. The aligned text tables
themselves are :mod:`hybridkv.tables` (the product's commands print them too).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridkv.tables import format_table

#: Columns of a bench's ``targets`` table (:func:`target_row`).
TARGET_COLUMNS = ["target", "value", "limit", "met"]


def target_row(target: str, value: float | None, op: str, limit: float) -> dict[str, Any]:
    """One row of a bench's ``targets`` table: ``value`` against ``limit`` by ``op`` (``<=``, ``>=`` or ``==``).

    ``met`` is False when the value is missing (not measured, or noise made it meaningless): a target is
    reported met only by a number that meets it.
    """
    assert op in ("<=", ">=", "=="), f"target {target!r}: unknown comparison {op!r}"
    met = value is not None and (
        value <= limit if op == "<=" else value >= limit if op == ">=" else value == limit
    )
    return {"target": target, "value": value, "limit": f"{op} {limit:g}", "met": met}


def spread_text(values: Sequence[float], spec: str = ".3g") -> str:
    """The spread of a bench's repeats as ``min..max`` (each value formatted by ``spec``)."""
    return f"{min(values):{spec}}..{max(values):{spec}}"


def format_targets(targets: Sequence[Mapping[str, Any]]) -> str:
    """A bench's ``targets`` rows (:func:`target_row`) as the text block its command prints."""
    return "targets:\n" + format_table(targets, TARGET_COLUMNS)


def write_json(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` as indented JSON, creating parent folders; returns the path written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    return target


def pyplot_or_none() -> Any:
    """matplotlib's ``pyplot`` on the non-interactive Agg backend, or ``None`` when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(figure: Any, path: Path) -> Path:
    """Lay out ``figure`` (from ``pyplot_or_none().subplots``), write it to ``path`` as PNG and close it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def save_report(
    report: Mapping[str, Any],
    out: str | os.PathLike[str],
    plot: Callable[[Any, Path], Path | None],
    *,
    no_plot: bool,
    prefix: str = "wrote ",
) -> Path:
    """A bench handler's output tail: write ``report`` as JSON to ``out`` and, unless ``no_plot``, call
    ``plot(report, <out>.png)`` (which returns ``None`` without matplotlib); print ``prefix`` + each path
    written. Returns the JSON path."""
    target = write_json(out, report)
    print(f"{prefix}{target}")
    if not no_plot:
        png = plot(report, target.with_suffix(".png"))
        if png is not None:
            print(f"{prefix}{png}")
    return target
