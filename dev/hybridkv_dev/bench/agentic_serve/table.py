"""The agentic-serve bench's rows (medians over rounds, [min, max]), targets, table and plot."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.harness import median_or_none, spread_or_none
from hybridkv.bench.report import pyplot_or_none, save_figure, target_row

from hybridkv_dev.bench.agentic import (
    TARGET_POINTS_OVER_LRU,
)
from hybridkv_dev.bench.agentic_serve.trace import (
    BASELINE,
    MIB,
    MOONCAKE_CONFIGURATION,
    SESSIONS_CONFIGURATION,
)


def configuration_row(
    configuration: str, runs: Sequence[Mapping[str, Any]], base_runs: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """One configuration's table row: medians over its measured rounds, [min, max], the points against the
    baseline per round (rounds where both ran)."""
    measured = [r for r in runs if "error" not in r]
    share = spread_or_none([r["store_share"] for r in measured])
    base_by_round = {r["round"]: r for r in base_runs if "error" not in r}
    points = spread_or_none(
        [
            100.0 * (r["store_share"] - base_by_round[r["round"]]["store_share"])
            for r in measured
            if r["round"] in base_by_round
        ]
    )
    is_baseline = configuration == BASELINE
    written = [r["store_bytes_written"] for r in measured]
    hybridkv = [r["hybridkv"] for r in measured]
    return {
        "configuration": configuration,
        "rounds": len(measured),
        "failed_rounds": len(runs) - len(measured),
        "requests": median_or_none([r["requests"] for r in measured]),
        "errors": sum(r["errors"] for r in measured),
        "prompt_tokens": median_or_none([r["prompt_tokens"] for r in measured]),
        "external_hit_tokens": median_or_none([r["external_hit_tokens"] for r in measured]),
        "store_share": None if share is None else share["median"],
        "store_share_min": None if share is None else share["min"],
        "store_share_max": None if share is None else share["max"],
        "store_share_spread": None if share is None else f"[{share['min']:.3f}, {share['max']:.3f}]",
        "points_vs_baseline": None if is_baseline or points is None else points["median"],
        "points_spread": None
        if is_baseline or points is None
        else f"[{points['min']:+.1f}, {points['max']:+.1f}]",
        "local_share": median_or_none([r["local_share"] for r in measured]),
        "ttft_p50_ms": _scaled(median_or_none([r["ttft_p50_s"] for r in measured]), 1000.0),
        "ttft_p99_ms": _scaled(median_or_none([r["ttft_p99_s"] for r in measured]), 1000.0),
        "ttft_p99_ms_spread": _ms_spread([r["ttft_p99_s"] for r in measured]),
        "written_mib": None
        if not written or written[0] is None
        else _scaled(median_or_none(written), 1 / MIB),
        "written_source": measured[0]["store_bytes_written_source"] if measured else None,
        "session_retained_keys": median_or_none([h.get("hybridkv_session_retained_keys") for h in hybridkv])
        if hybridkv
        else None,
        "session_hints_refused": sum(h.get("hybridkv_session_hints_refused", 0) for h in hybridkv)
        if hybridkv
        else None,
        "store_failures": sum(
            h.get("hybridkv_load_failed_keys", 0) + h.get("hybridkv_save_failed_keys", 0) for h in hybridkv
        )
        if hybridkv
        else None,
    }


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _ms_spread(values: Sequence[float | None]) -> str | None:
    present = [v * 1000 for v in values if v is not None]
    return f"[{min(present):.0f}, {max(present):.0f}]" if present else None


def agentic_serve_targets(
    rows: Sequence[Mapping[str, Any]], runs: Mapping[str, Sequence[Mapping[str, Any]]]
) -> list[dict[str, Any]]:
    """The issue's target (``file-lru+sessions`` >= 15 points over ``file-lru``), its share against
    ``mooncake-store``'s (>= 0 points, per round), and no failed request anywhere."""
    by_name = {row["configuration"]: row for row in rows}
    out: list[dict[str, Any]] = []
    sessions = by_name.get(SESSIONS_CONFIGURATION)
    if sessions is not None and BASELINE in by_name:
        out.append(
            target_row(
                f"{SESSIONS_CONFIGURATION}: prompt tokens served from the store vs {BASELINE}, points",
                sessions["points_vs_baseline"],
                ">=",
                TARGET_POINTS_OVER_LRU,
            )
        )
    if sessions is not None and MOONCAKE_CONFIGURATION in by_name:
        mine = {r["round"]: r["store_share"] for r in runs[SESSIONS_CONFIGURATION] if "error" not in r}
        theirs = [r for r in runs[MOONCAKE_CONFIGURATION] if "error" not in r and r["round"] in mine]
        points = spread_or_none([100.0 * (mine[r["round"]] - r["store_share"]) for r in theirs])
        out.append(
            target_row(
                f"{SESSIONS_CONFIGURATION}: prompt tokens served from the store vs {MOONCAKE_CONFIGURATION}, points",
                None if points is None else points["median"],
                ">=",
                0,
            )
        )
    failed = sum(row["errors"] for row in rows)
    failed_runs = sum(row["failed_rounds"] for row in rows)
    out.append(target_row("failed requests, every configuration and round", failed + 0.0, "==", 0))
    out.append(target_row("failed runs (a server that did not start or died)", failed_runs + 0.0, "==", 0))
    return out


#: Columns of the main table.
TABLE_COLUMNS = [
    "configuration",
    "rounds",
    "requests",
    "errors",
    "store_share",
    "store_share_spread",
    "points_vs_baseline",
    "points_spread",
    "local_share",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "ttft_p99_ms_spread",
    "written_mib",
    "session_retained_keys",
]


def describe_report(report: Mapping[str, Any]) -> str:
    """The trace's shape and the run's setup, the lines the command prints above its table."""
    s = report["shape"]
    setup = report["setup"]
    kinds = s["num_requests_by_kind"]
    working = statistics.median(report["working_set_bytes"]) / MIB
    blocks = statistics.median(shape["working_set_blocks"] for shape in report["shapes"])
    capacity = statistics.median(report["capacity_bytes"]) / MIB
    local = report["local_cache_bytes"] / MIB
    last_seed = report["seed"] + report["num_rounds"] - 1
    trace = (
        f"trace (seed {s['seed']}; tokens scaled 1/{s['token_scale']}, blocks of {s['block_tokens']}): "
        f"{s['num_sessions']} sessions, {s['num_requests']} requests replayed ({kinds['turn']} turns, "
        f"{kinds['subagent']} sub-agent, {kinds['one_off']} one-off) of {s['num_trace_requests']} "
        f"({s['num_too_long']} longer than {setup['max_model_len'] - setup['max_tokens']} tokens left out, "
        f"{s['num_cut']} past --max-requests cut)"
    )
    prompts = (
        f"  prompt median {s['prompt_tokens_median']:g} tokens, max {s['prompt_tokens_max']}; "
        f"{s['span_s'] / 60:.0f} min of trace replayed back to back at concurrency {setup['concurrency']}; "
        f"tenants {', '.join(s['tenants'])} (cache_salt); an unbounded store with no local cache would "
        f"serve {s['ideal_share']:.1%} of the prompt tokens"
    )
    ceiling = report.get("store_ceiling_share")
    if ceiling is not None:
        prompts += (
            f"; less the local cache's share without a connector (none), a store can serve at most "
            f"{ceiling:.1%} (median over rounds)"
        )
    sizes = (
        f"model {Path(report['model']).name}: {report['block_bytes'] >> 10} KiB per block; working set "
        f"{working:.1f} MiB ({blocks:g} blocks; medians over rounds), store capacity {setup['capacity_fraction']:g} "
        f"of it = {capacity:.2f} MiB for every configuration; local KV cache {local:.1f} MiB "
        f"({report['local_cache_tokens']} tokens)"
    )
    rounds = (
        f"{report['num_rounds']} interleaved rounds (seeds {report['seed']}..{last_seed}): medians, spread "
        f"[min, max]; points vs {report['baseline']} per round; store_share = external hit tokens / "
        "prompt tokens"
    )
    return f"{trace}\n{prompts}\n{sizes}\n{rounds}"


def plot_report(report: Mapping[str, Any], path: Path) -> Path | None:
    """The share of prompt tokens served from the store over the first round's trace (windows of requests),
    one line per configuration, the unbounded store's dotted and (with ``none``) the ceiling dashed; ``None``
    without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    windows = report["windows"]
    size = windows["window_requests"]
    figure, axes = plt.subplots(figsize=(7, 4))
    styles = {
        "ideal": ({"linestyle": ":", "color": "grey"}, "unbounded store, no local cache"),
        "ceiling": (
            {"linestyle": "--", "color": "black"},
            "ceiling: unbounded store less the local cache (none)",
        ),
    }
    for name, shares in windows.items():
        if name in ("num_requests", "window_requests"):
            continue
        positions = [(index + 0.5) * size for index in range(len(shares))]
        style, label = styles.get(name, ({"marker": "o", "markersize": 3}, name))
        axes.plot(positions, shares, label=label, **style)
    axes.set_xlabel(f"request (trace order, seed {report['seed']}, windows of {size})")
    axes.set_ylabel("prompt tokens served from the store")
    axes.set_ylim(0, 1)
    capacity = statistics.median(report["capacity_bytes"]) / MIB
    axes.set_title(
        f"agentic trace on real engines, store {capacity:.1f} MiB "
        f"({report['setup']['capacity_fraction']:g} x working set)"
    )
    axes.legend(fontsize="small", loc="best")
    return save_figure(figure, path)
