"""The serve bench's tables (one run, repeated runs) and its plot."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridkv_dev.bench.serve.runs import RUN_METRICS, TURN_METRICS

TABLE_COLUMNS = (
    "config",
    "requests",
    "errors",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "latency_mean_s",
    "requests_per_s",
    "output_tokens_per_s",
    "local_hit_tokens",
    "external_hit_tokens",
    "probe_reuse_external_hit_tokens",
    "agreement",
    "audit_ok",
)
#: Where the time goes: the engine's per-request phase means next to the client's TTFT.
PHASE_COLUMNS = (
    "config",
    "ttft_mean_s",
    "engine_ttft_mean_s",
    "engine_queue_mean_s",
    "engine_prefill_mean_s",
    "engine_decode_mean_s",
    "preemptions",
)


#: Greedy tokens against the ``none`` run (``none``: its second pass against its first): all requests, the
#: requests whose conversation so far was identical, the reference's top-2 gap at the worst first differing
#: token (about 0: a tie that batching flipped), and the concurrency-1 pass (must be exactly 1).
AGREEMENT_COLUMNS = (
    "config",
    "agreement",
    "agreement_same_prompt",
    "same_prompt_requests",
    "differing_max_reference_gap",
    "serial_requests",
    "serial_agreement",
)


def format_serve_table(report: Mapping[str, Any]) -> str:
    from hybridkv.tables import format_table

    lines = [format_table(report["rows"], TABLE_COLUMNS)]
    lines.append("")
    lines.append(format_table(report["rows"], PHASE_COLUMNS))
    lines.append("")
    lines.append(format_table(report["rows"], AGREEMENT_COLUMNS))
    lines.append("")
    lines.append(format_table(report["targets"], ("config", "ratio", "value", "target", "met")))
    core_ids = {str(ids) for ids in report.get("engine_core_ids", {}).values() if ids is not None}
    if len(core_ids) > 1:
        lines.append(f"\nWARNING: the engines computed on different cores: {report['engine_core_ids']}")
    local = report.get("local_cache_tokens")
    working = report.get("working_set_tokens")
    fraction = report.get("local_fraction_of_working_set")
    lines.append(
        f"\nlocal KV cache {local} tokens, working set ~{working} tokens"
        + (f" (local holds {fraction:.0%})" if fraction else "")
    )
    for row in report["rows"]:
        if row.get("error"):
            causes = [line for line in row["error"].splitlines() if "Error" in line] or row[
                "error"
            ].splitlines()
            lines.append(f"{row['config']}: failed: {causes[-1].strip()[-300:]}")
    return "\n".join(lines)


def _cell(spread: Mapping[str, float] | None, digits: int) -> str | None:
    if spread is None:
        return None
    fmt = f"{{:,.{digits}f}}"
    return f"{fmt.format(spread['median'])} [{fmt.format(spread['min'])}, {fmt.format(spread['max'])}]"


def format_runs_table(summary: Mapping[str, Any]) -> str:
    """The summary of repeated runs (``summarize_runs``) as text: medians [min, max]."""
    from hybridkv.bench.report import format_targets
    from hybridkv.tables import format_table

    digits = {"local_hit_tokens": 0, "external_hit_tokens": 0, "agreement_same_prompt": 3}
    rows = [
        {
            "config": row["config"],
            "runs": row["runs"],
            "errors": row["errors"],
            "serial": row["serial_agreement_min"],
            **{name: _cell(row[name], digits.get(name, 3)) for name in RUN_METRICS},
        }
        for row in summary["rows"]
    ]
    lines = [f"{summary['runs']} runs: medians [min, max]", ""]
    lines.append(format_table(rows, ("config", "runs", "errors", "serial", *RUN_METRICS[:6])))
    lines.append("")
    lines.append(format_table(rows, ("config", *RUN_METRICS[6:])))
    turn_rows = [
        {"config": config, "turn": turn["turn"], **{name: _cell(turn[name], 3) for name in TURN_METRICS}}
        for config, turns in summary["per_turn"].items()
        for turn in turns
    ]
    if turn_rows:
        lines += ["", "per turn, every session's request (medians [min, max] over runs):"]
        lines.append(format_table(turn_rows, ("config", "turn", *TURN_METRICS)))
    ratio_rows = [
        {"config": config, "ratio": name, "median [min, max] over runs": _cell(spread, 3)}
        for config, spreads in summary["ratios"].items()
        for name, spread in spreads.items()
    ]
    lines += ["", format_table(ratio_rows, ("config", "ratio", "median [min, max] over runs"))]
    lines += ["", format_targets(summary["targets"])]
    return "\n".join(lines)


def plot_serve(report: Mapping[str, Any], path: Path) -> Path | None:
    """Two panels: TTFT distribution per configuration (box plot), external and local hit tokens per turn."""
    from hybridkv.bench.report import pyplot_or_none

    plt = pyplot_or_none()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ttfts = {c: [v * 1000 for v in vs] for c, vs in report["ttfts"].items() if vs}
    if ttfts:
        left.boxplot(list(ttfts.values()), tick_labels=list(ttfts.keys()), showmeans=True)
        left.set_ylabel("TTFT (ms)")
        left.set_title("time to first token, all turns")
        left.tick_params(axis="x", rotation=20)
    num_turns = 0
    for index, (config, turns) in enumerate(report["per_turn"].items()):
        if not turns:
            continue
        color = f"C{index}"
        xs = [int(t["turn"]) + 1 for t in turns]
        num_turns = max(num_turns, len(xs))
        external = [t.get("external_hit_tokens", 0) for t in turns]
        local = [t.get("local_hit_tokens", 0) for t in turns]
        # Configurations with identical hits overlap: later ones are drawn thinner on top.
        width = 4.0 - 1.2 * index
        right.plot(xs, external, marker="o", color=color, linewidth=width, label=f"{config} external")
        right.plot(
            xs, local, marker="x", linestyle="--", color=color, linewidth=width, label=f"{config} local"
        )
    right.set_xticks(range(1, num_turns + 1))
    right.set_xlabel("turn")
    right.set_ylabel("hit tokens (all sessions)")
    right.set_title("prefix hit tokens per turn")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
