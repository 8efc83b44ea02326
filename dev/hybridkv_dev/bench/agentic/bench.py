"""The store configurations and the bench over rounds (``run_agentic_bench``)."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hybridkv.bench.harness import rotated
from hybridkv.store.base import StoreError

from hybridkv_dev.bench.agentic.replay import (
    DEFAULT_ATTENTION_VALUE_BYTES,
    DEFAULT_SAMPLE_EVERY,
    DEFAULT_STATE_VALUE_BYTES,
    NUM_WINDOWS,
    ReplayResult,
    replay_trace,
    window_fractions,
)
from hybridkv_dev.bench.agentic.stores import CONFIGURATIONS, StoreConfiguration, opened_store
from hybridkv_dev.bench.agentic.table import agentic_targets, config_row
from hybridkv_dev.bench.agentic.trace import AgenticTrace, AgenticWorkload, generate_trace


def run_agentic_bench(
    workload: AgenticWorkload,
    *,
    seed: int = 0,
    num_rounds: int = 5,
    capacity_fraction: float = 0.1,
    background_quota_fraction: float = 0.2,
    configurations: Sequence[StoreConfiguration] = CONFIGURATIONS,
    attention_value_bytes: int = DEFAULT_ATTENTION_VALUE_BYTES,
    state_value_bytes: int = DEFAULT_STATE_VALUE_BYTES,
    sample_every: Mapping[str, int] | None = None,
    scratch_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replay the traces of seeds ``seed .. seed + num_rounds - 1`` through every configuration, round ``r``
    in an order rotated by ``r``, each on a fresh store of ``capacity_fraction`` of that trace's working set.
    Returns the report (``rows``, ``targets``, ``shape``, ``windows``, every run under ``rounds``)."""
    assert num_rounds >= 1 and capacity_fraction > 0 and 0 < background_quota_fraction <= 1, (
        num_rounds,
        capacity_fraction,
        background_quota_fraction,
    )
    assert configurations, "no configuration to run"
    sample_every = {**DEFAULT_SAMPLE_EVERY, **(sample_every or {})}
    from hybridkv.bench.store import bench_scratch_dir

    config_to_runs: dict[str, list[ReplayResult]] = {c.name: [] for c in configurations}
    unavailable: dict[str, str] = {}
    traces: list[AgenticTrace] = []
    working_sets: list[int] = []
    capacities: list[int] = []
    with bench_scratch_dir(scratch_dir) as scratch_text:
        scratch = Path(scratch_text)
        for round_index in range(num_rounds):
            trace = generate_trace(workload, seed + round_index)
            working_set = trace.working_set_bytes(attention_value_bytes, state_value_bytes)
            capacity = max(1, int(capacity_fraction * working_set))
            quota = max(1, int(background_quota_fraction * capacity))
            traces.append(trace)
            working_sets.append(working_set)
            capacities.append(capacity)
            for configuration in rotated(configurations, round_index):
                if configuration.name in unavailable:
                    continue
                try:
                    with opened_store(configuration, capacity, quota, scratch) as store:
                        result = replay_trace(
                            trace,
                            store,
                            configuration=configuration.name,
                            capacity_bytes=capacity,
                            reference_quota_bytes=quota,
                            attention_value_bytes=attention_value_bytes,
                            state_value_bytes=state_value_bytes,
                            sample_every=sample_every[configuration.scheme],
                            sessions=configuration.sessions,
                        )
                except StoreError as error:
                    unavailable[configuration.name] = str(error)
                    config_to_runs[configuration.name].clear()
                    continue
                config_to_runs[configuration.name].append(result)
                if progress is not None:
                    progress(
                        f"round {round_index + 1}/{num_rounds} {configuration.name}: "
                        f"hit {result.hit_fraction:.3f} in {result.seconds:.1f}s"
                    )
    measured = [c for c in configurations if c.name not in unavailable]
    baseline = measured[0].name if measured else None
    first = traces[0]
    ideal_hit_fraction = statistics.median(
        sum(trace.ideal_hit_tokens()) / max(1, sum(r.num_prompt_tokens for r in trace.requests))
        for trace in traces
    )
    rows = [
        config_row(
            c, config_to_runs[c.name], config_to_runs[baseline] if baseline else [], baseline, first.tenants
        )
        for c in measured
    ]
    return {
        "benchmark": "agentic",
        "workload": asdict(workload),
        "seed": seed,
        "num_rounds": num_rounds,
        "capacity_fraction": capacity_fraction,
        "background_quota_fraction": background_quota_fraction,
        "attention_value_bytes": attention_value_bytes,
        "state_value_bytes": state_value_bytes,
        "sample_every": dict(sample_every),
        "geometry": f"full attention block {workload.block_tokens} + Mamba state block {workload.block_tokens}, TP 1",
        "shape": first.shape(),
        "working_set_bytes": working_sets,
        "capacity_bytes": capacities,
        "baseline": baseline,
        "ideal_hit_fraction": ideal_hit_fraction,
        "rows": rows,
        "unavailable": [{"configuration": name, "error": error} for name, error in unavailable.items()],
        "targets": agentic_targets(rows, baseline),
        "windows": {
            "num_requests": len(first.requests),
            "ideal": window_fractions(
                first.ideal_hit_tokens(), [r.num_prompt_tokens for r in first.requests], NUM_WINDOWS
            ),
            **{name: runs[0].window_hit_fractions for name, runs in config_to_runs.items() if runs},
        },
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "rounds": {name: [_run_dict(run) for run in runs] for name, runs in config_to_runs.items() if runs},
    }


def _run_dict(run: ReplayResult) -> dict[str, Any]:
    return {**asdict(run), "hit_fraction": run.hit_fraction, "agentic_hit_fraction": run.agentic_hit_fraction}
