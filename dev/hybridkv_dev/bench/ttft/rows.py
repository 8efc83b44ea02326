"""The ttft bench's rows: medians, ratios and spreads of a connector's rounds, the hit profile, the targets,
the plot."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.report import pyplot_or_none, save_figure, target_row

#: The columns ``hybridkv bench`` prints, in order.
TABLE_COLUMNS = [
    "family",
    "connector",
    "cold_ms",
    "local_hit_ms",
    "external_hit_ms",
    "external_hit_tokens",
    "loaded_mb",
    "overhead_ms",
    "overhead_ms_spread",
    "copy_floor_ms",
    "overhead_over_floor",
    "overhead_over_peer",
    "loadavg_1m",
]


def median_if_any(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio_or_none(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None


def _spread(values: Sequence[float]) -> list[float] | None:
    """[min, max] of the samples (the spread the medians hide)."""
    return [min(values), max(values)] if values else None


def _row(
    family: str,
    connector: str,
    *,
    samples_s: dict[str, list[float]],
    ext_tokens: int,
    loaded_bytes: int,
    loaded_keys: int | None,
    memcpy_gbps: float | None,
    local_s: list[float] | None = None,
    load_job: float | None = None,
) -> dict[str, Any]:
    """One table row. ``local_s`` overrides the local-hit samples (a connector measured without a local hit
    borrows the hybridkv engine's). The overhead is the median over rounds of (external - local), each round
    on its own prompt; its spread is [min, max] over rounds."""
    local_samples = samples_s.get("local") or local_s or []
    ext_samples = samples_s.get("external", [])
    cold, local, ext = (
        median_if_any(samples_s.get("cold", [])),
        median_if_any(local_samples),
        median_if_any(ext_samples),
    )
    overheads_ms = [(e - lo) * 1e3 for e, lo in zip(ext_samples, local_samples, strict=False)]
    floor_ms = loaded_bytes / memcpy_gbps / 1e6 if memcpy_gbps and loaded_bytes else None
    overhead_ms = median_if_any(overheads_ms)
    return {
        "family": family,
        "connector": connector,
        "cold_ms": _ms(cold),
        "local_hit_ms": _ms(local),
        "external_hit_ms": _ms(ext),
        "external_hit_ms_spread": [v * 1e3 for v in _spread(ext_samples) or []] or None,
        "external_hit_tokens": ext_tokens,
        "loaded_bytes": loaded_bytes,
        "loaded_mb": loaded_bytes / 1e6,
        "loaded_keys": loaded_keys,
        "load_job_ms": _ms(load_job),
        "memcpy_gbps": memcpy_gbps,
        "copy_floor_ms": floor_ms,
        "external_over_local": ratio_or_none(ext, local),
        "cold_over_external": ratio_or_none(cold, ext),
        "overhead_ms": overhead_ms,
        "overhead_ms_spread": _spread(overheads_ms),
        "overhead_over_floor": ratio_or_none(overhead_ms, floor_ms),
        "overhead_over_floor_spread": (
            [v / floor_ms for v in _spread(overheads_ms) or []] or None if floor_ms else None
        ),
        "overhead_over_peer": None,  # filled once the MooncakeStoreConnector row exists
    }


#: The rows' peer for ``overhead_over_peer``.
PEER_CONNECTOR = "MooncakeStoreConnector (vLLM)"


def hit_profile(
    overhead_ms: float | None,
    load_profile: Sequence[dict[str, float]],
    store_path: dict[str, Any] | None,
    load_job: float | None,
    phases_ms: Sequence[dict[str, float]] = (),
) -> dict[str, Any]:
    """Where a hybridkv hit's time above the local hit goes (ms, medians over rounds); see
    ``PROFILE_SOURCES``."""
    lookup_ms = median_if_any([p["lookup_ms"] for p in load_profile if not math.isnan(p["lookup_ms"])])
    load_ms = median_if_any([p["load_ms"] for p in load_profile if not math.isnan(p["load_ms"])])

    def phase(name: str) -> float | None:
        return median_if_any([p[name] for p in phases_ms if name in p])

    out: dict[str, Any] = {
        "overhead_ms": overhead_ms,
        "lookup_ms": lookup_ms,
        "load_ms": load_ms,
        "load_job_ms": _ms(load_job),
        "queue_ms": phase("queue_ms"),
        "store_ms": phase("store_ms"),
        "open_ms": phase("file_open_ms"),
        "readv_ms": phase("file_read_ms"),
        "verify_ms": phase("file_verify_ms"),
        "readv_cpu_ms": phase("file_read_cpu_ms"),
        "verify_cpu_ms": phase("file_verify_cpu_ms"),
        "close_ms": phase("file_close_ms"),
        "keys_read": phase("file_keys"),
        "report_ms": phase("report_ms"),
        "engine_steps": phase("engine_steps"),
        "engine_busy_ms": phase("engine_busy_ms"),
    }
    targets, commit = phase("targets_ms"), phase("commit_ms")
    out["targets_commit_ms"] = targets + commit if targets is not None and commit is not None else None
    if store_path is not None:
        out |= {
            "microbench_get_ms": store_path["get_ms"],
            "microbench_get_no_checksum_ms": store_path["get_no_checksum_ms"],
            "checksum_alone_ms": store_path["checksum_ms"],
            "memcpy_ms": store_path["memcpy_ms"],
        }
    steps = [out["queue_ms"], out["load_job_ms"], out["report_ms"]]
    if load_ms is not None and all(v is not None for v in steps):
        out["engine_wait_ms"] = load_ms - sum(v for v in steps if v is not None)
    if overhead_ms is not None and load_ms is not None:
        out["outside_load_ms"] = overhead_ms - load_ms - (lookup_ms or 0.0)
    return out


#: Where each number of the hit profile comes from.
PROFILE_SOURCES = {
    "overhead_ms": "TTFT external - local, median over rounds (llm.generate wall time)",
    "lookup_ms": "audit log: lookup_started -> hit_found (monotonic), scheduler side",
    "load_ms": "audit log: load_started -> load_verified, scheduler side: the hand-off to the worker, its "
    "load job, and the engine steps until the scheduler saw it finished",
    "load_job_ms": "worker's load thread, wall time of its load jobs during the request (load_job_seconds)",
    "queue_ms": "worker: start_load_kv -> the load thread takes the job (the worker's LoadProbe)",
    "store_ms": "worker: wall time inside the store's get_into (read + verify, all reader threads)",
    "open_ms": "file store: open + shared lock + name check, summed over keys and reader threads "
    "(the ReadProbe the bench hangs into its FileBackend; thread time, so with several readers it can "
    "exceed store_ms)",
    "readv_ms": "file store: readv of the frames straight into the KV pages, summed over reader threads",
    "verify_ms": "file store: the frame check (xxh3 over the bytes just read), summed over reader threads",
    "readv_cpu_ms": "file store: the readv's CPU time (time.thread_time), summed over reader threads: below "
    "readv_ms by the time the threads waited for a core, the interpreter lock or the disk",
    "verify_cpu_ms": "file store: the frame check's CPU time, summed over reader threads (as readv_cpu_ms)",
    "close_ms": "file store: mtime touch + close, summed over reader threads",
    "keys_read": "file store: keys read during the hit",
    "targets_commit_ms": "worker: building the destination views + committing them (host pages: no copy)",
    "report_ms": "worker: load job done -> the engine thread takes it in transfer_results",
    "engine_steps": "worker: engine steps (transfer_results calls) while the load was in flight",
    "engine_busy_ms": "worker: the engine thread's time between those calls (its own step work, holding the "
    "GIL the reader threads need after each system call)",
    "engine_wait_ms": "load_ms - queue - load_job - report: the scheduler -> worker hand-off (the step that "
    "issues the load) and the step after the report until the scheduler saw it",
    "outside_load_ms": "overhead - lookup - load: scheduling around the load (the extra steps of an async load)",
    "microbench_get_ms": "microbench, this process: framed get_into of the same bytes into host buffers",
    "microbench_get_no_checksum_ms": "microbench: the same with checksum=none (read alone)",
    "checksum_alone_ms": "microbench: the checksum over the same bytes, no store",
    "memcpy_ms": "microbench: np.copyto of the same bytes (the copy floor)",
}

#: The hit-profile columns ``hybridkv bench ttft`` prints.
PROFILE_COLUMNS = [
    "family",
    "connector",
    "overhead_ms",
    "lookup_ms",
    "load_ms",
    "queue_ms",
    "load_job_ms",
    "store_ms",
    "open_ms",
    "readv_ms",
    "readv_cpu_ms",
    "verify_ms",
    "verify_cpu_ms",
    "targets_commit_ms",
    "report_ms",
    "engine_steps",
    "engine_busy_ms",
    "engine_wait_ms",
    "outside_load_ms",
    "memcpy_ms",
]


#: The issue's targets for an external hit: its overhead above a local hit at most this many copy floors,
#: and at most this fraction of vLLM's ``MooncakeStoreConnector``'s overhead in the same run.
FLOOR_RATIO_TARGET = 2.0
PEER_RATIO_TARGET = 0.5


def ttft_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per hybridkv row: ``overhead_over_floor`` and ``overhead_over_peer`` against their targets (a missing
    ratio -- no peer in the run, or noise larger than the peer's hit -- is not met)."""
    out = []
    for row in rows:
        if not row["connector"].startswith("HybridStoreConnector"):
            continue
        name = f"{row['family']}: {row['connector']}"
        out.append(
            target_row(f"{name}: overhead / copy floor", row["overhead_over_floor"], "<=", FLOOR_RATIO_TARGET)
        )
        out.append(
            target_row(
                f"{name}: overhead / {PEER_CONNECTOR}'s overhead",
                row["overhead_over_peer"],
                "<=",
                PEER_RATIO_TARGET,
            )
        )
    return out


def plot_report(report: dict[str, Any], path: Path) -> Path | None:
    """Bars of cold / local / external TTFT per (family, connector), log scale; ``None`` without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = report["rows"]
    labels = [f"{row['family']}\n{row['connector'].split(' ')[0]}" for row in rows]
    positions = list(range(len(rows)))
    figure, axes = plt.subplots(figsize=(max(6, len(rows) * 1.6), 4))
    for offset, key, label in (
        (-0.27, "cold_ms", "cold"),
        (0.0, "local_hit_ms", "local hit"),
        (0.27, "external_hit_ms", "external hit"),
    ):
        axes.bar([p + offset for p in positions], [row[key] or 0 for row in rows], width=0.27, label=label)
    axes.set_yscale("log")
    axes.set_xticks(positions, labels, fontsize=7)
    axes.set_ylabel(f"TTFT ms ({report['prompt_tokens']} tokens)")
    axes.legend()
    return save_figure(figure, path)
