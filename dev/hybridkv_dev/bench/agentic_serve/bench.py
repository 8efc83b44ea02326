"""The whole bench: round ``r`` replays the trace of ``seed + r`` through every configuration, in rotated
order."""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hybridkv.bench.harness import median_or_none, rotated
from hybridkv.bench.store import bench_scratch_dir
from hybridkv.store.mooncake_node import MIN_SEGMENT_BYTES

from hybridkv_dev.bench.agentic_serve.replay import run_configuration
from hybridkv_dev.bench.agentic_serve.table import agentic_serve_targets, configuration_row
from hybridkv_dev.bench.agentic_serve.trace import (
    BASELINE,
    CONFIGURATIONS,
    MIB,
    MOONCAKE_CONFIGURATION,
    NUM_WINDOWS,
    ServeSetup,
    ServeTrace,
    attention_block_bytes,
    build_serve_trace,
    model_vocab_size,
)
from hybridkv_dev.devkit.net import NETNS_HINT, loopback_only_namespace


def run_agentic_serve_bench(
    model: Path,
    setup: ServeSetup,
    workdir: Path,
    *,
    configurations: Sequence[str] = CONFIGURATIONS,
    num_rounds: int = 3,
    seed: int = 0,
    scratch_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
    on_request: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Round ``r`` builds the trace of ``seed + r`` and runs every configuration on it (order rotated by
    ``r``), each on a fresh server and store of capacity ``setup.capacity_fraction`` of that trace's working
    set (file stores under ``scratch_dir``, default ``/dev/shm`` when present; logs under ``workdir``).
    Returns the report (``rows``, ``targets``, ``shape``, ``windows``, every run under ``runs``).
    ``RuntimeError`` for Mooncake outside a loopback-only network namespace; ``ValueError`` when a round's
    capacity is below Mooncake's smallest global segment (16 MiB) and Mooncake is among the
    configurations."""
    unknown = [c for c in configurations if c not in CONFIGURATIONS]
    assert not unknown and configurations, f"configurations {unknown} not in {CONFIGURATIONS}"
    assert num_rounds >= 1, num_rounds
    if MOONCAKE_CONFIGURATION in configurations:
        if not loopback_only_namespace():
            raise RuntimeError(f"{MOONCAKE_CONFIGURATION}: {NETNS_HINT}")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    ordered = [c for c in CONFIGURATIONS if c in configurations]
    vocab_size = model_vocab_size(model)
    block_bytes = attention_block_bytes(model, setup.block_tokens)
    traces = [build_serve_trace(setup, seed + r, vocab_size) for r in range(num_rounds)]
    capacities = [max(1, int(setup.capacity_fraction * t.working_set_blocks() * block_bytes)) for t in traces]
    if MOONCAKE_CONFIGURATION in ordered and min(capacities) < MIN_SEGMENT_BYTES:
        raise ValueError(
            f"store capacity {min(capacities) / MIB:.1f} MiB ({setup.capacity_fraction:g} of the working set)"
            f" is below Mooncake's smallest global segment ({MIN_SEGMENT_BYTES >> 20} MiB): raise the "
            "capacity fraction or the trace (sessions, requests), or leave mooncake-store out"
        )
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in ordered}
    started = time.perf_counter()
    with bench_scratch_dir(scratch_dir) as scratch:
        for round_index, (trace, capacity) in enumerate(zip(traces, capacities, strict=True)):
            for configuration in rotated(ordered, round_index):
                name = configuration.replace("+", "-")
                run = run_configuration(
                    configuration,
                    model,
                    trace,
                    setup,
                    capacity,
                    workdir / f"round-{round_index}" / name,
                    store_dir=Path(scratch) / f"store-{round_index}-{name}",
                    round_index=round_index,
                    progress=on_request,
                )
                runs[configuration].append(run)
                if progress is not None:
                    progress(_progress_line(run, round_index, num_rounds))
    rows = [configuration_row(c, runs[c], runs.get(BASELINE, [])) for c in ordered]
    first = traces[0]
    first_runs = {c: rs[0] for c, rs in runs.items() if rs and "error" not in rs[0]}
    ideal = first.ideal_hit_tokens()
    size = max(1, math.ceil(len(first.requests) / NUM_WINDOWS))
    prompts = [len(r.prompt) for r in first.requests]
    return {
        "benchmark": "agentic-serve",
        "model": str(model),
        "setup": asdict(setup),
        "workload": asdict(first.workload),
        "seed": seed,
        "num_rounds": num_rounds,
        "configurations": ordered,
        "baseline": BASELINE,
        "block_bytes": block_bytes,
        "working_set_bytes": [t.working_set_blocks() * block_bytes for t in traces],
        "capacity_bytes": capacities,
        "local_cache_bytes": int(setup.kv_cache_mib * (1 << 20)),
        "local_cache_tokens": next(
            (r["local_cache_tokens"] for rs in runs.values() for r in rs if r.get("local_cache_tokens")), None
        ),
        "shape": first.shape(),
        "shapes": [t.shape() for t in traces],
        "store_ceiling_share": _store_ceiling(traces, runs.get("none", [])),
        "rows": rows,
        "targets": agentic_serve_targets(rows, runs),
        "windows": {
            "num_requests": len(first.requests),
            "window_requests": size,
            **_ideal_windows(ideal, prompts, size, first_runs.get("none")),
            **{c: r["window_store_shares"] for c, r in first_runs.items()},
        },
        "runs": runs,
        "seconds": time.perf_counter() - started,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
    }


def _ideal_windows(
    ideal: Sequence[int], prompts: Sequence[int], size: int, floor_run: Mapping[str, Any] | None
) -> dict[str, list[float]]:
    """Per window of ``size`` requests: ``ideal``, the unbounded store's share with no local cache, and
    (with the ``none`` run of the same trace) ``ceiling``, that less the share the local cache alone served:
    the most a store can add there."""
    shares = [
        sum(ideal[i : i + size]) / max(1, sum(prompts[i : i + size])) for i in range(0, len(prompts), size)
    ]
    if floor_run is None:
        return {"ideal": shares}
    local = floor_run["window_local_shares"]
    return {"ideal": shares, "ceiling": [max(0.0, a - b) for a, b in zip(shares, local, strict=True)]}


def _store_ceiling(traces: Sequence[ServeTrace], floor_runs: Sequence[Mapping[str, Any]]) -> float | None:
    """The most a store can add (median over rounds): what an unbounded store with no local cache serves,
    less what the local cache alone served (the ``none`` run of the same trace); ``None`` without it."""
    ceilings = [
        traces[run["round"]].shape()["ideal_share"] - run["local_share"]
        for run in floor_runs
        if "error" not in run
    ]
    return median_or_none(ceilings)


def _progress_line(run: Mapping[str, Any], round_index: int, num_rounds: int) -> str:
    head = f"round {round_index + 1}/{num_rounds} {run['configuration']}"
    if "error" in run:
        causes = [line for line in run["error"].splitlines() if "Error" in line] or run["error"].splitlines()
        return f"{head}: FAILED: {causes[-1].strip()[-200:] if causes else '?'}"
    return (
        f"{head}: store share {run['store_share']:.3f}, local {run['local_share']:.3f}, "
        f"{run['errors']} errors, replay {run['replay_s']:.0f}s (start {run.get('server_start_s', 0):.0f}s)"
    )
