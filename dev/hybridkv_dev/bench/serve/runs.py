"""Repeated runs of the serve bench: the per-turn breakdown and the summary over runs (medians, [min,
max])."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from hybridkv_dev.bench.serve.bench import HYBRID_CONFIGS, TARGETS, run_ratios
from hybridkv_dev.bench.serve.workload import CONFIGS, EXACT_CONFIGS

# --- repeated runs --------------------------------------------------------------------------------------------


#: Per configuration, the numbers ``summarize_runs`` takes the median and [min, max] of.
RUN_METRICS = (
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_resent_mean_s",
    "requests_per_s",
    "output_tokens_per_s",
    "local_hit_tokens",
    "external_hit_tokens",
    "agreement_same_prompt",
    "engine_queue_mean_s",
    "engine_prefill_mean_s",
)


def _spread(values: Sequence[float | None]) -> dict[str, float] | None:
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present), "n": len(present)}


#: Per turn, where a request's time goes: the client's TTFT (mean over the turn's requests), vLLM's queue and
#: prefill time per request, and hybridkv's load job seconds per request (0 for the other configurations).
TURN_METRICS = ("ttft_mean_s", "engine_queue_s", "engine_prefill_s", "load_job_s")


def turn_breakdown(report: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per configuration and turn of one run: ``TURN_METRICS`` (the client's TTFTs only where every request
    of the run had one: the report lists them in turn order)."""
    sessions = report["workload"]["num_sessions"]
    out: dict[str, list[dict[str, Any]]] = {}
    for config, turns in report.get("per_turn", {}).items():
        ttfts = report.get("ttfts", {}).get(config, [])
        rows = []
        for turn in turns:
            index = int(turn["turn"])
            count = turn.get("prefill_s_count") or 0
            mine = (
                ttfts[index * sessions : (index + 1) * sessions]
                if len(ttfts) == sessions * len(turns)
                else []
            )
            rows.append(
                {
                    "turn": index + 1,
                    "ttft_mean_s": statistics.fmean(mine) if mine else None,
                    "engine_queue_s": turn["queue_s_sum"] / count if count else None,
                    "engine_prefill_s": turn["prefill_s_sum"] / count if count else None,
                    "load_job_s": turn.get("hybridkv_load_job_seconds", 0.0) / count if count else None,
                }
            )
        out[config] = rows
    return out


def summarize_runs(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians and [min, max] over repeated runs of the bench (each a ``run_serve_bench`` report): per
    configuration the ``RUN_METRICS``, its errors and its serial pass's worst agreement; per hybridkv
    configuration its ratios to each base (``run_ratios``, taken per run, then the median); and the
    ``TARGETS`` judged at those medians, with the failed requests and serial exactness of every run."""
    from hybridkv.bench.report import target_row

    configs = sorted({row["config"] for r in reports for row in r["rows"]}, key=CONFIGS.index)
    rows: list[dict[str, Any]] = []
    for config in configs:
        mine = [row for r in reports for row in r["rows"] if row["config"] == config]
        row: dict[str, Any] = {"config": config, "runs": len(mine)}
        row["failed_runs"] = sum(1 for x in mine if x.get("error"))
        row["errors"] = sum(x.get("errors") or 0 for x in mine)
        serial = [x["serial_agreement"] for x in mine if x.get("serial_agreement") is not None]
        row["serial_agreement_min"] = min(serial) if serial else None
        for metric_name in RUN_METRICS:
            row[metric_name] = _spread([x.get(metric_name) for x in mine])
        rows.append(row)
    ratios: dict[str, dict[str, dict[str, float] | None]] = {}
    for hybrid_config in HYBRID_CONFIGS:
        per_run = [run_ratios({row["config"]: row for row in r["rows"]}, hybrid_config) for r in reports]
        names = sorted({name for one in per_run for name in one})
        if names:
            ratios[hybrid_config] = {name: _spread([one.get(name) for one in per_run]) for name in names}
    targets: list[dict[str, Any]] = []
    for hybrid_config, spreads in ratios.items():
        for name, (op, bound) in TARGETS.items():
            spread = spreads.get(name)
            if spread is None:
                continue  # the base configuration did not run
            targets.append(
                target_row(
                    f"{hybrid_config} {name}, median of {len(reports)} runs",
                    spread["median"],
                    op,
                    bound,
                )
            )
    failed = sum(row["errors"] + row["failed_runs"] for row in rows)
    targets.append(target_row("failed requests and configurations, every run", float(failed), "==", 0))
    exact = [row["serial_agreement_min"] for row in rows if row["config"] in EXACT_CONFIGS]
    if exact and all(value is not None for value in exact):
        targets.append(
            target_row("serial pass agreement of hybridkv-file/-mooncake, worst run", min(exact), "==", 1)
        )
    breakdowns = [turn_breakdown(r) for r in reports if "workload" in r]
    per_turn: dict[str, list[dict[str, Any]]] = {}
    for config in configs:
        runs_turns = [b[config] for b in breakdowns if config in b]
        num_turns = min((len(turns) for turns in runs_turns), default=0)
        per_turn[config] = [
            {
                "turn": index + 1,
                **{name: _spread([turns[index][name] for turns in runs_turns]) for name in TURN_METRICS},
            }
            for index in range(num_turns)
        ]
    return {
        "runs": len(reports),
        "run_orders": [r.get("run_order") for r in reports],
        "per_turn": per_turn,
        "load_average": [r.get("load_average") for r in reports],
        "local_cache_tokens": _spread([r.get("local_cache_tokens") for r in reports]),
        "working_set_tokens": _spread([r.get("working_set_tokens") for r in reports]),
        "rows": rows,
        "ratios": ratios,
        "targets": targets,
    }
