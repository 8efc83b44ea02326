"""The verdict per series: the warm-up cut, the slope, the rise, each against its bound."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# --- verdict ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeriesBound:
    """What one series may do after the warm-up cut; ``None``: not bounded that way.

    ``max_slope_per_100``: least-squares slope per 100 requests (needs at least 3 samples after the cut);
    ``max_rise``: their max minus the warm-up samples' max; ``max_value``: every sample after the cut (and
    the last one, taken after the load) at most this. ``why``: the reason for the numbers.
    """

    series: str
    unit: str
    why: str
    max_slope_per_100: float | None = None
    max_rise: float | None = None
    max_value: float | None = None


#: What the connector may add to the server's resident memory per 100 requests after warm-up, over what vLLM
#: alone does under the same load: one leaked store entry per request (~450 KiB on the tiny GDN hybrid, both
#: groups) would add 44 MiB.
RSS_SLOPE_OVER_BASELINE = 16.0
#: Without a baseline: vLLM's own drift (measured, no connector: its CPU worker's RSS grows ~390 MiB over
#: the first 300 requests of this load and 10-15 MiB per 100 requests at 400-600) plus the margin above.
RSS_SLOPE_ALONE = 32.0


def series_bounds(
    store_capacity_bytes: int,
    *,
    median_object_bytes: int | None,
    baseline_rss: Mapping[str, Any] | None = None,
) -> list[SeriesBound]:
    """The bounds of every series (see each ``why``): the long run's. ``median_object_bytes``: the median
    frame the store held (bounds its file count through its capacity). ``baseline_rss``: the ``rss_mib``
    row of the same load on a no-connector server (``analyze_series``): the memory bound is then relative
    to vLLM's own drift."""
    capacity_mib = store_capacity_bytes / (1 << 20)
    max_files = 2 * store_capacity_bytes // median_object_bytes if median_object_bytes else None
    if baseline_rss is not None and baseline_rss.get("slope_per_100") is not None:
        rss = SeriesBound(
            "rss_mib",
            "MiB",
            "resident memory of the server's processes: vLLM's own drift under the same load without the "
            f"connector ({baseline_rss['slope_per_100']:+.1f} MiB per 100 requests, the baseline run) plus "
            f"{RSS_SLOPE_OVER_BASELINE:g} (one leaked store entry per request adds 44)",
            max_slope_per_100=max(0.0, baseline_rss["slope_per_100"]) + RSS_SLOPE_OVER_BASELINE,
            max_rise=max(0.0, baseline_rss["rise"] or 0.0) + 128.0,
        )
    else:
        rss = SeriesBound(
            "rss_mib",
            "MiB",
            "resident memory of the server's processes: vLLM's own drift (measured without the connector: "
            f"10-15 MiB per 100 requests after 400) plus {RSS_SLOPE_OVER_BASELINE:g}",
            max_slope_per_100=RSS_SLOPE_ALONE,
        )
    return [
        rss,
        SeriesBound(
            "num_threads",
            "threads",
            "thread pools are fixed; a late call holds a thread only for late_ms; one leaked thread per "
            "late call (5 % of the store calls) would add several per 100 requests",
            max_slope_per_100=1.0,
            max_rise=8,
        ),
        SeriesBound(
            "num_fds",
            "fds",
            "store files are opened per call and closed; client connections are pooled (one per client "
            "thread); a descriptor leaked per request or per store call adds dozens per 100 requests",
            max_slope_per_100=1.0,
            max_rise=16,
        ),
        SeriesBound("num_processes", "processes", "no process is started after warm-up", max_rise=0),
        SeriesBound(
            "vllm_requests_in_engine",
            "requests",
            "settled, vLLM runs and queues nothing: a request left there is stranded",
            max_value=0,
        ),
        SeriesBound(
            "tracked_requests",
            "requests",
            "settled, the connector follows no request: one left is stranded",
            max_value=0,
        ),
        SeriesBound(
            "pinned_blocks", "blocks", "settled, every save job finished and unpinned its blocks", max_value=0
        ),
        SeriesBound(
            "save_inflight_bytes",
            "bytes",
            "settled, every admitted save job ended and gave its bytes back",
            max_value=0,
        ),
        SeriesBound(
            "staging_bytes_out",
            "bytes",
            "settled, every private host buffer was released (a late call's once it returned)",
            max_value=0,
        ),
        SeriesBound(
            "late_calls_pending",
            "calls",
            "late calls finish late_ms after they answered; settle waits for them",
            max_value=0,
        ),
        SeriesBound(
            "audit_queued_records",
            "records",
            "the audit writer keeps up: a settled engine leaves at most the last step's records queued, far "
            "below the 65,536 at which records are dropped",
            max_value=1024,
        ),
        SeriesBound(
            "store_bytes",
            "bytes",
            f"the file store's contract: objects and spares within capacity ({capacity_mib:g} MiB) once no "
            "put is in flight",
            max_value=store_capacity_bytes,
        ),
        SeriesBound(
            "num_store_files",
            "files",
            "twice as many frames as the capacity holds of the median one (frames differ in size: a "
            "Mamba state, a block of attention KV, the manifest)",
            max_value=max_files,
        ),
        SeriesBound(
            "spare_bytes",
            "bytes",
            "recycled files are kept within 10 % of capacity (the eviction hysteresis band)",
            max_value=store_capacity_bytes // 10,
        ),
        SeriesBound(
            "num_tmp_files", "files", "a temp file outlives its put only if its writer crashed", max_value=0
        ),
    ]


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The slope of the least-squares line through ``(xs, ys)``; None with fewer than 3 points or one x."""
    if len(xs) < 3:
        return None
    mean_x = sum(xs) / len(xs)
    mean_y = sum(ys) / len(ys)
    spread_x = sum((x - mean_x) ** 2 for x in xs)
    if spread_x == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread_x


def analyze_series(
    samples: Sequence[Mapping[str, Any]], bounds: Sequence[SeriesBound], warmup_fraction: float
) -> list[dict[str, Any]]:
    """Per bounded series present in ``samples``: the warm-up cut (the first ``warmup_fraction`` of the
    samples, at least one, and at least one left after it), first and last value, the slope per 100 requests
    after the cut, the spread (max - min) and rise (max after minus max during warm-up), each bound and
    ``met`` (every bound given met; a slope bound with too few samples for a slope is not judged)."""
    rows: list[dict[str, Any]] = []
    num_warmup = min(max(1, int(len(samples) * warmup_fraction)), max(0, len(samples) - 1))
    for bound in bounds:
        points = [
            (float(s["requests"]), float(s[bound.series])) for s in samples if s.get(bound.series) is not None
        ]
        if not points:
            continue
        warm, after = points[:num_warmup], points[num_warmup:]
        values = [y for _, y in after] or [y for _, y in warm]
        slope = least_squares_slope([x for x, _ in after], [y for _, y in after])
        slope_100 = None if slope is None else slope * 100.0
        rise = (max(y for _, y in after) - max(y for _, y in warm)) if warm and after else None
        checks: list[bool] = []
        if bound.max_slope_per_100 is not None and slope_100 is not None:
            checks.append(slope_100 <= bound.max_slope_per_100)
        if bound.max_rise is not None and rise is not None:
            checks.append(rise <= bound.max_rise)
        if bound.max_value is not None:
            checks.append(max(values) <= bound.max_value)
        rows.append(
            {
                "series": bound.series,
                "unit": bound.unit,
                "num_warmup": len(warm),
                "num_after": len(after),
                "first": points[0][1],
                "last": points[-1][1],
                "min_after": min(values),
                "max_after": max(values),
                "spread_after": max(values) - min(values),
                "rise": rise,
                "slope_per_100": slope_100,
                "max_slope_per_100": bound.max_slope_per_100,
                "max_rise": bound.max_rise,
                "max_value": bound.max_value,
                "met": all(checks),
                "why": bound.why,
            }
        )
    return rows
