"""The agentic bench's rows, targets, tables and plot."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.harness import spread as _spread
from hybridkv.bench.report import pyplot_or_none, save_figure, target_row

from hybridkv_dev.bench.agentic.replay import ReplayResult
from hybridkv_dev.bench.agentic.stores import StoreConfiguration
from hybridkv_dev.bench.agentic.trace import BACKGROUND_TENANT, TARGET_POINTS_OVER_LRU

_MIB = float(1 << 20)


def config_row(
    configuration: StoreConfiguration,
    runs: Sequence[ReplayResult],
    baseline_runs: Sequence[ReplayResult],
    baseline: str | None,
    tenants: Sequence[str],
) -> dict[str, Any]:
    """The table row of one configuration: medians over its rounds, differences to the baseline per round."""
    hit = _spread([run.hit_fraction for run in runs])
    is_baseline = configuration.name == baseline
    points = _spread(
        [
            100.0 * (run.hit_fraction - base.hit_fraction)
            for run, base in zip(runs, baseline_runs, strict=True)
        ]
    )
    return {
        "configuration": configuration.name,
        "store": configuration.scheme,
        "hit_fraction": hit["median"],
        "hit_spread": f"[{hit['min']:.3f}, {hit['max']:.3f}]",
        "hit_fraction_min": hit["min"],
        "hit_fraction_max": hit["max"],
        "agentic_hit_fraction": statistics.median(run.agentic_hit_fraction for run in runs),
        "points_vs_baseline": None if is_baseline else points["median"],
        "points_spread": None if is_baseline else f"[{points['min']:+.1f}, {points['max']:+.1f}]",
        "points_vs_baseline_min": None if is_baseline else points["min"],
        "points_vs_baseline_max": None if is_baseline else points["max"],
        "baseline": baseline,
        "written_mib": statistics.median(run.bytes_written for run in runs) / _MIB,
        "read_mib": statistics.median(run.bytes_read for run in runs) / _MIB,
        "evicted_mib_by_tenant": {
            tenant: statistics.median(run.tenant_to_bytes_evicted.get(tenant, 0) for run in runs) / _MIB
            for tenant in tenants
        },
        "agentic_evicted_mib": statistics.median(
            sum(v for t, v in run.tenant_to_bytes_evicted.items() if t != BACKGROUND_TENANT) for run in runs
        )
        / _MIB,
        "agentic_evicted_by_over_quota_mib": statistics.median(
            run.agentic_bytes_evicted_over_quota for run in runs
        )
        / _MIB,
        "evicted_by_over_quota_max_mib": max(
            sum(run.tenant_to_bytes_evicted_over_quota.values()) for run in runs
        )
        / _MIB,
        "evicted_by_over_quota_mib_by_tenant": {
            tenant: statistics.median(run.tenant_to_bytes_evicted_over_quota.get(tenant, 0) for run in runs)
            / _MIB
            for tenant in tenants
        },
        "evicted_by_background_within_quota_mib": statistics.median(
            sum(run.tenant_to_bytes_evicted_within_quota.values()) for run in runs
        )
        / _MIB,
        "num_over_quota_puts": sum(run.num_over_quota_puts for run in runs),
        "background_peak_of_quota": max(
            run.quota_tenant_peak_bytes / max(1, run.reference_quota_bytes) for run in runs
        ),
        "load_failures": sum(run.num_load_failures for run in runs),
        "put_failures": sum(run.num_put_failures for run in runs),
        "seconds": statistics.median(run.seconds for run in runs),
        "num_rounds": len(runs),
    }


def agentic_targets(rows: Sequence[Mapping[str, Any]], baseline: str | None) -> list[dict[str, Any]]:
    """The issue's target per configuration (>= 15 points over the baseline), and for the configurations
    that set a quota: 0 bytes of any tenant evicted by the background's puts while it was over its quota
    (what the store did: listings around each of its puts)."""
    served = [
        target_row(
            f"{row['configuration']}: prompt tokens served vs {baseline}, points",
            row["points_vs_baseline"],
            ">=",
            TARGET_POINTS_OVER_LRU,
        )
        for row in rows
        if row["configuration"] != baseline
    ]
    protected = [
        target_row(
            f"{row['configuration']}: MiB of other tenants evicted by background puts over its quota (max)",
            row["evicted_by_over_quota_max_mib"],
            "==",
            0,
        )
        for row in rows
        if row["configuration"].endswith("+quotas")
    ]
    return served + protected


#: Columns of the main table.
TABLE_COLUMNS = [
    "configuration",
    "hit_fraction",
    "hit_spread",
    "agentic_hit_fraction",
    "points_vs_baseline",
    "points_spread",
    "written_mib",
    "agentic_evicted_mib",
    "agentic_evicted_by_over_quota_mib",
    "seconds",
]


def evicted_table_rows(report: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows and columns of the evicted-MiB-by-tenant table (medians over rounds)."""
    tenants = list(report["shape"]["tenants"])
    rows = [{"configuration": row["configuration"], **row["evicted_mib_by_tenant"]} for row in report["rows"]]
    return rows, ["configuration", *tenants]


def evicted_by_background_table_rows(report: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows and columns of the table of what the background's puts evicted of the other tenants (medians
    over rounds): per tenant while it was over its quota, in all while within it; the over-quota puts (all
    rounds) and the most it held after a put, as a fraction of its quota."""
    tenants = [tenant for tenant in report["shape"]["tenants"] if tenant != BACKGROUND_TENANT]
    over = [f"{tenant} over quota" for tenant in tenants]
    rows = [
        {
            "configuration": row["configuration"],
            **{
                label: row["evicted_by_over_quota_mib_by_tenant"][tenant]
                for label, tenant in zip(over, tenants, strict=True)
            },
            "all within quota": row["evicted_by_background_within_quota_mib"],
            "over-quota puts": row["num_over_quota_puts"],
            "background peak / quota": f"{row['background_peak_of_quota']:.2f}",
        }
        for row in report["rows"]
    ]
    return rows, ["configuration", *over, "all within quota", "over-quota puts", "background peak / quota"]


def describe_shape(report: Mapping[str, Any]) -> str:
    """The trace's shape and the run's setup, as the lines the command prints above its tables."""
    s = report["shape"]
    kinds = s["num_requests_by_kind"]
    p10, p90 = s["turns_per_session_p10_p90"]
    working = statistics.median(report["working_set_bytes"]) / _MIB
    capacity = statistics.median(report["capacity_bytes"]) / _MIB
    last_seed = report["seed"] + report["num_rounds"] - 1
    sessions = (
        f"trace (seed {s['seed']}; tokens scaled 1/{s['token_scale']}): {s['num_sessions']} sessions, turns "
        f"median {s['turns_per_session_median']:g} (p10-p90 {p10:g}-{p90:g}), sub-agents in "
        f"{s['subagent_session_share']:.0%} of sessions ({s['num_subagents']}, median "
        f"{s['subagent_turns_median']:g} turns)"
    )
    requests = (
        f"  {s['num_requests']} requests ({kinds['turn']} turns, {kinds['subagent']} sub-agent, "
        f"{kinds['one_off']} one-off = {s['one_off_share']:.0%}); prompt median {s['prompt_tokens_median']:g} "
        f"tokens, mean {s['prompt_tokens_mean']:.0f} (~{s['prompt_tokens_mean_real'] / 1000:.0f}K real); "
        f"{s['num_agent_types']} agent types x {s['system_prompt_tokens']}-token system prompt; tenants "
        f"{', '.join(s['tenants'])}"
    )
    pauses = (
        f"  pauses: {s['num_tool_pauses']} tool (median {s['tool_pause_median_s']:.1f}s), "
        f"{s['num_human_pauses']} human (median {s['human_pause_median_s']:.0f}s); span {s['span_s'] / 60:.0f} "
        f"min; prefix reuse of agentic requests {s['prefix_reuse_agentic']:.1%}; an unbounded store serves "
        f"{s['ideal_hit_fraction']:.1%} of all prompt tokens"
    )
    store = (
        f"store: {report['geometry']}, {report['attention_value_bytes'] >> 10} KiB per block, "
        f"{report['state_value_bytes'] >> 10} KiB per state; working set {working:.1f} MiB, capacity "
        f"{report['capacity_fraction']:g} of it = {capacity:.1f} MiB; background quota "
        f"{report['background_quota_fraction']:g} of capacity"
    )
    rounds = (
        f"{report['num_rounds']} interleaved rounds (seeds {report['seed']}..{last_seed}): medians, spread "
        f"[min, max]; points vs {report['baseline']} taken per round"
    )
    return f"{sessions}\n{requests}\n{pauses}\n{store}\n{rounds}"


def plot_report(report: Mapping[str, Any], path: Path) -> Path | None:
    """The hit-token fraction over the first round's trace (windows of requests), one line per configuration
    and the unbounded store's dashed; ``None`` without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    windows = report["windows"]
    num_requests = windows["num_requests"]
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, fractions in windows.items():
        if name == "num_requests":
            continue
        size = num_requests / max(1, len(fractions))
        positions = [(index + 0.5) * size for index in range(len(fractions))]
        style = {"linestyle": "--", "color": "grey"} if name == "ideal" else {}
        label = "unbounded store" if name == "ideal" else name
        axes.plot(positions, fractions, label=label, **style)
    axes.set_xlabel(f"request (trace order, seed {report['seed']})")
    axes.set_ylabel("prompt tokens served by the store")
    axes.set_ylim(0, 1)
    axes.set_title(f"agentic trace, capacity {report['capacity_fraction']:g} x working set")
    axes.legend(fontsize="small")
    return save_figure(figure, path)
