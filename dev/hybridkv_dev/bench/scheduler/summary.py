"""The scheduler bench's rows: medians over rounds with their spread, ratios within a round, the hook
breakdown, the targets."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from hybridkv.bench.harness import spread_text
from hybridkv.bench.report import target_row

from hybridkv_dev.bench.scheduler_peer import (
    PEER_CONNECTOR,
)

#: the table columns of ``hybridkv bench scheduler``
SCHEDULER_COLUMNS = [
    "store",
    "num_steps",
    "schedule_p50_ms",
    "schedule_p99_ms",
    "schedule_p99_ms_spread",
    "p99_ratio",
    "p99_ratio_spread",
    "busy_schedule_p99_ms",
    "busy_p99_ratio",
    "busy_p99_ratio_spread",
    "busy_connector_p99_ms",
    "busy_vllm_p99_ms",
    "num_idle_steps",
    "idle_schedule_p99_ms",
    "idle_p99_ratio",
    "idle_p99_ratio_spread",
    "connector_p99_ms",
    "connector_p99_ms_spread",
    "vllm_p99_ms",
    "wall_s",
    "lookups_per_s",
    "round_trips_p50",
    "round_trips_max",
    "keys_p50",
    "keys_max",
    "hit_tokens",
    "full_scan_hit_tokens",
    "lookup_errors",
]

#: the columns of the connector hook breakdown (``hook_rows``): medians over rounds
#: How a row measured with ``lookup_process: true`` is named after its store.
LOOKUP_PROCESS_SUFFIX = " [lookup process]"
HOOK_COLUMNS = ["store", "hook", "calls", "total_ms", "p99_ms", "max_ms", "cpu_p99_ms"]


_TIMES = (
    "schedule_p50_ms",
    "schedule_p99_ms",
    "schedule_max_ms",
    "busy_schedule_p50_ms",
    "busy_schedule_p99_ms",
    "idle_schedule_p50_ms",
    "idle_schedule_p99_ms",
    "busy_connector_p99_ms",
    "busy_vllm_p99_ms",
    "connector_p50_ms",
    "connector_p99_ms",
    "connector_with_wait_p99_ms",
    "vllm_p99_ms",
    "peer_lookup_p50_ms",
    "peer_exists_p50_ms",
)
_RATIOS = (
    ("schedule_p99_ms", "p99_ratio"),
    ("schedule_p50_ms", "p50_ratio"),
    ("busy_schedule_p99_ms", "busy_p99_ratio"),
    ("idle_schedule_p99_ms", "idle_p99_ratio"),
)


def round_ratios(
    rounds: Sequence[dict[str, Any]], others: Sequence[dict[str, Any]], name: str
) -> list[float]:
    """``name`` of each round over the same round's ``name`` in ``others`` (rounds where both have it)."""
    return [
        r[name] / o[name]
        for r, o in zip(rounds, others, strict=True)
        if r.get(name) is not None and o.get(name)
    ]


def summarize_config(
    label: str, rounds: list[dict[str, Any]], base_rounds: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """One table row from the rounds of one configuration: medians over rounds, with the spread.

    Ratios are taken within a round (against the no-connector run of the same round), then the median.
    """
    row: dict[str, Any] = {
        "store": label,
        "connector": rounds[0]["connector"],
        "store_url": rounds[0]["store_url"],
        "num_rounds": len(rounds),
        "num_steps": statistics.median(r["num_steps"] for r in rounds),
        "num_idle_steps": statistics.median(r["num_idle_steps"] for r in rounds),
        "wall_s": statistics.median(r["wall_s"] for r in rounds),
    }
    for name in _TIMES:
        values = [r[name] for r in rounds if name in r]
        if len(values) == len(rounds):  # e.g. the connector split of the no-connector rows: absent
            row[name] = statistics.median(values)
            row[f"{name}_spread"] = spread_text(values)
    if base_rounds is None:
        return row
    for name, ratio in _RATIOS:
        ratios = round_ratios(rounds, base_rounds, name)
        if ratios:
            row[ratio] = statistics.median(ratios)
            row[f"{ratio}_spread"] = spread_text(ratios)
    for name in ("lookups_per_s", "round_trips_p50", "keys_p50"):
        row[name] = statistics.median(r[name] for r in rounds)
    for name in ("round_trips_max", "keys_max", "lookup_errors", "peer_lookup_max_ms", "peer_exists_max_ms"):
        if name in rounds[0]:
            row[name] = max(r[name] for r in rounds)
    # Hit tokens must equal the full scan's in every round: the sum shows a miss in any of them.
    row["hit_tokens"] = sum(r["hit_tokens"] for r in rounds)
    if "full_scan_hit_tokens" in rounds[0]:
        row["full_scan_hit_tokens"] = sum(r["full_scan_hit_tokens"] for r in rounds)
    row["planted_keys"] = statistics.median(r["planted_keys"] for r in rounds)
    row["hooks"] = _summarize_hooks(rounds)
    return row


def _summarize_hooks(rounds: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per hook, the median over rounds of each of its numbers (rounds that called it)."""
    names = sorted({name for r in rounds for name in r["hooks"]})
    out: dict[str, dict[str, float]] = {}
    for name in names:
        runs = [r["hooks"][name] for r in rounds if name in r["hooks"]]
        out[name] = {stat: statistics.median(run[stat] for run in runs) for stat in runs[0]}
    return out


def hook_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The connector rows' hook breakdown as table rows (``HOOK_COLUMNS``), heaviest hooks first."""
    return [
        {"store": row["store"], "hook": name, **hooks[name]}
        for row in rows
        for hooks in [row.get("hooks", {})]
        for name in sorted(hooks, key=lambda n: -hooks[n]["p99_ms"])
    ]


#: The issue's targets for a lookup at production geometry (``scheduler_targets``).
P99_RATIO_TARGET = 1.2
MAX_ROUND_TRIPS_TARGET = 4
IDLE_P99_RATIO_TARGET = 1.5
#: hybridkv's connector time on the scheduler thread (per step, p99) against the peer's, same store.
PEER_SYNC_RATIO_TARGET = 0.25
PEER_ASYNC_RATIO_TARGET = 1.0


def scheduler_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per hybridkv row: ``schedule()`` p99 against the no-connector run (busy steps, and all steps) at most
    ``P99_RATIO_TARGET``, idle steps at most ``IDLE_P99_RATIO_TARGET``; exactly the synchronous full scan's
    hit tokens; at most ``MAX_ROUND_TRIPS_TARGET`` store round trips per lookup. For the hybridkv row on the
    peer's store (``connector_p99_over_peer_*``): the connector's own scheduler-thread time per step (p99)
    at most ``PEER_SYNC_RATIO_TARGET`` of the peer's in its synchronous mode, below its asynchronous mode's."""
    out = []
    for row in rows:
        if row["connector"] != "hybridkv":
            continue
        store = row["store"]
        full = row["full_scan_hit_tokens"]
        out += [
            target_row(
                f"{store}: busy schedule() p99 / no connector", row["busy_p99_ratio"], "<=", P99_RATIO_TARGET
            ),
            target_row(f"{store}: schedule() p99 / no connector", row["p99_ratio"], "<=", P99_RATIO_TARGET),
            target_row(
                f"{store}: idle-step schedule() p99 / no connector",
                row.get("idle_p99_ratio"),
                "<=",
                IDLE_P99_RATIO_TARGET,
            ),
            target_row(
                f"{store}: hit tokens / full scan's", row["hit_tokens"] / full if full else None, "==", 1.0
            ),
            target_row(
                f"{store}: store round trips per lookup (max)",
                row["round_trips_max"],
                "<=",
                MAX_ROUND_TRIPS_TARGET,
            ),
        ]
        for mode, limit in (("sync", PEER_SYNC_RATIO_TARGET), ("async", PEER_ASYNC_RATIO_TARGET)):
            if f"connector_p99_over_peer_{mode}" in row:
                out.append(
                    target_row(
                        f"{store}: connector scheduler-thread p99 / {PEER_CONNECTOR} {mode}'s",
                        row[f"connector_p99_over_peer_{mode}"],
                        "<=",
                        limit,
                    )
                )
    return out
