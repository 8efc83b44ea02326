"""The figures a bench reports over its rounds: medians and the ``{median, min, max}`` spread.

The text form of a spread (``min..max``) is :func:`hybridkv.bench.report.spread_text`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence


def median_or_none(values: Iterable[float | None]) -> float | None:
    """The median of the values present (``None`` ones left out); ``None`` when none is."""
    present = [float(v) for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{median, min, max}`` of a bench's repeats (at least one)."""
    assert values, "spread of no values"
    return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values))}


def spread_or_none(values: Iterable[float | None]) -> dict[str, float] | None:
    """:func:`spread` of the values present (``None`` ones left out); ``None`` when none is."""
    present = [float(v) for v in values if v is not None]
    return spread(present) if present else None
