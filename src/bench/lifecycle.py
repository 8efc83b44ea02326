"""Lifecycle overhead benchmark (``hybridkv bench lifecycle``): microseconds per transition and per full
request lifecycle, without an audit sink, with an in-memory sink and with the JSON-lines file sink."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridkv.audit.sinks import JsonLinesAuditSink
from hybridkv.bench.report import pyplot_or_none, save_figure
from hybridkv.lifecycle.geometry import Geometry, Topology
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.kinds import GroupSpec
from hybridkv.lifecycle.load import LoadOutcome
from hybridkv.lifecycle.machine import LifecycleMachine, RequestLifecycle
from hybridkv.lifecycle.sink import AuditSink, MemoryAuditSink

__all__ = ["TABLE_COLUMNS", "TARGET_US_PER_TRANSITION", "plot_report", "run_lifecycle_bench"]

#: Targets from the issue: without a sink / with the JSON sink.
TARGET_US_PER_TRANSITION = {"none": 20.0, "json": 60.0}
_TRIGGERS = ("start_lookup", "lookup_hit", "start_load", "load_verified", "evict")
#: the ``detail`` a trigger's record must carry (``TRIGGERS``): a load names its answer's epoch and fingerprint
_DETAIL: dict[str, dict[str, Any]] = {"start_load": {"epoch": 0, "fingerprint": "0" * 12}}


def _bench_scheme() -> KeyScheme:
    # A Qwen3-Next-like layout: full attention (16-token pages) + Mamba (64-token states), TP=2.
    geometry = Geometry(groups=(GroupSpec.full(16), GroupSpec.mamba(64)), topology=Topology(tp_size=2))
    return KeyScheme(namespace="bench", model="bench-model", geometry=geometry)


def _time(fn: Callable[[], None], iterations: int, repeats: int) -> float:
    """Best-of-``repeats`` seconds for ``iterations`` calls of ``fn`` (the best run is the least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_lifecycle_bench(
    iterations: int = 5000, repeats: int = 3, prompt_tokens: int = 1024
) -> dict[str, Any]:
    """Measure and return a JSON-ready report (rows per sink kind)."""
    scheme = _bench_scheme()
    block_hashes = [
        hashlib.sha256(str(i).encode()).digest() for i in range(prompt_tokens // scheme.geometry.hash_unit)
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as tmp:
        sinks: dict[str, Callable[[], AuditSink | None]] = {
            "none": lambda: None,
            "memory": MemoryAuditSink,
            "json": lambda: JsonLinesAuditSink(os.path.join(tmp, "audit.jsonl")),
        }
        for name, make_sink in sinks.items():
            sink = make_sink()
            machine = LifecycleMachine(scheme, sink=sink)

            def transitions_only(machine: LifecycleMachine = machine) -> None:
                lifecycle = RequestLifecycle(machine, "bench")
                for trigger in _TRIGGERS:
                    machine.fire(lifecycle, trigger, **_DETAIL.get(trigger, {}))

            def full_lifecycle(machine: LifecycleMachine = machine) -> None:
                lifecycle = machine.new_request("bench")
                search = lifecycle.start_search(block_hashes, prompt_tokens + 1, 0)
                assert search is not None
                result = lifecycle.finish_search(search.run(lambda keys: [True] * len(keys)))
                lifecycle.start_load()
                assert result.plan is not None
                lifecycle.finish_load({entry: LoadOutcome.OK for entry, _ in result.plan.entries})
                lifecycle.evict()

            seconds = _time(transitions_only, iterations, repeats)
            us_per_transition = seconds / (iterations * len(_TRIGGERS)) * 1e6
            lifecycle_seconds = _time(full_lifecycle, max(1, iterations // 5), repeats)
            us_per_lifecycle = lifecycle_seconds / max(1, iterations // 5) * 1e6
            if isinstance(sink, MemoryAuditSink):
                sink.records.clear()
            if sink is not None:
                sink.close()
            target = TARGET_US_PER_TRANSITION.get(name)
            rows.append(
                {
                    "sink": name,
                    "us_per_transition": us_per_transition,
                    "target_us_per_transition": target,
                    "meets_target": None if target is None else us_per_transition <= target,
                    "us_per_lifecycle": us_per_lifecycle,
                    "transitions_per_lifecycle": len(_TRIGGERS),
                }
            )
    return {
        "benchmark": "lifecycle",
        "iterations": iterations,
        "repeats": repeats,
        "prompt_tokens": prompt_tokens,
        "geometry": scheme.geometry.describe(),
        "lifecycle": "new_request, start_search and its rounds (all exist), finish_search, start_load, "
        "finish_load (all OK), evict",
        "rows": rows,
    }


#: The columns ``hybridkv bench lifecycle`` prints, in order.
TABLE_COLUMNS = ["sink", "us_per_transition", "target_us_per_transition", "meets_target", "us_per_lifecycle"]


def plot_report(report: dict[str, Any], path: Path) -> Path | None:
    """Bars of µs per transition per sink, with each sink's target as a tick; ``None`` without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = report["rows"]
    positions = list(range(len(rows)))
    figure, axes = plt.subplots(figsize=(5, 3.5))
    axes.bar(positions, [row["us_per_transition"] for row in rows], width=0.6, label="measured")
    for position, row in zip(positions, rows, strict=True):
        if row["target_us_per_transition"] is not None:
            target = row["target_us_per_transition"]
            axes.hlines(target, position - 0.35, position + 0.35, colors="red", linestyles="--")
    axes.set_xticks(positions, [f"sink: {row['sink']}" for row in rows])
    axes.set_ylabel("µs per transition (red: target)")
    return save_figure(figure, path)
