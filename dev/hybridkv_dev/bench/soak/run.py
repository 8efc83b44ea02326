"""The whole soak: the baseline without the connector, the serial passes, the load on the chaos store."""

from __future__ import annotations

import http.client
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridkv_dev.bench.record import RequestRecord, request_record
from hybridkv_dev.bench.soak.load import PROCESS_SERIES, LoadOutcome, chat_body, run_soak_load
from hybridkv_dev.bench.soak.plan import SoakPlan
from hybridkv_dev.bench.soak.samples import settle
from hybridkv_dev.bench.soak.table import build_soak_report
from hybridkv_dev.bench.soak.verdict import analyze_series, series_bounds
from hybridkv_dev.devkit.openai_server import (
    OpenAIServer,
    hybridkv_transfer_config,
    metrics_samples,
    stream_request,
)

# --- the whole soak -----------------------------------------------------------------------------------------


def soak_store_url(plan: SoakPlan, store_dir: Path) -> str:
    """The chaos view of the file store in ``store_dir`` (``plan.chaos``, capacity ``plan.store_capacity_bytes``)."""
    from hybridkv.store.params import format_size

    return f"faulty+file://{store_dir}?capacity={format_size(plan.store_capacity_bytes)}&{plan.chaos}"


def start_server(
    plan: SoakPlan, model: Path, workdir: Path, *, connector: bool = True
) -> tuple[OpenAIServer, Path, Path]:
    """The soak's server (not yet healthy) with its store folder and audit log; ``connector=False``: the
    baseline's, without a KV connector (its log ``server-baseline.log``; no store, no audit log)."""
    store_dir = workdir / "store"
    audit = workdir / "audit.jsonl"
    kv = (
        hybridkv_transfer_config(soak_store_url(plan, store_dir), namespace="soak", audit_log=str(audit))
        if connector
        else None
    )
    server = OpenAIServer(
        model,
        workdir / ("server.log" if connector else "server-baseline.log"),
        kv_transfer_config=kv,
        max_model_len=plan.max_model_len,
        max_num_seqs=plan.workload.concurrency,
        max_num_batched_tokens=plan.max_model_len,
        kv_cache_memory_bytes=plan.kv_cache_bytes,
        dtype=plan.dtype,
        extra_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": str(plan.reserved_cpus)},
    )
    return server, store_dir, audit


def run_baseline(
    plan: SoakPlan, model: Path, workdir: Path, *, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """The same load on a server without a KV connector: its process series (``PROCESS_SERIES``) and their
    analysis, what vLLM alone does (its allocators' drift). ``error``: why its load ended early."""
    server, _, _ = start_server(plan, model, workdir, connector=False)
    try:
        server.wait_healthy()
        load = run_soak_load(plan, server, None, progress=progress)
    finally:
        server.stop()
    bounds = [
        b
        for b in series_bounds(plan.store_capacity_bytes, median_object_bytes=None)
        if b.series in PROCESS_SERIES
    ]
    samples = [
        {key: s[key] for key in ("requests", "wall_s", "processes", *PROCESS_SERIES)} for s in load.samples
    ]
    return {
        "samples": samples,
        "series": analyze_series(samples, bounds, plan.warmup_fraction),
        "failed": sum(1 for r in load.requests if not r.ok),
        "error": load.error,
    }


def _reset_all(server: OpenAIServer) -> bool:
    """Local and connector reset (the next pass starts cold); False when vLLM or the connector refused."""
    try:
        server.reset_prefix_cache(attempts=30, reset_external=True)
    except RuntimeError:
        return False
    return True


def _serial_pass(server: OpenAIServer, plan: SoakPlan) -> tuple[list[RequestRecord], bool]:
    """The serial exactness pass (after a local and a connector reset): ``plan.serial_sessions`` sessions of
    ``plan.workload.num_turns`` turns, turn by turn (every session's first, then every second...), one request at a
    time, each within ``plan.request_timeout_s``. Returns its records (for ``divergence``) and whether the
    reset succeeded."""
    reset_ok = _reset_all(server)
    workload = plan.workload
    session_to_answers: dict[int, list[str]] = {s: [] for s in range(plan.serial_sessions)}
    records: list[RequestRecord] = []
    for turn in range(plan.workload.num_turns):
        for session, answers in session_to_answers.items():
            body = {**chat_body(plan, workload, session, answers), "ignore_eos": True}
            result = stream_request(
                server.base_url, "/v1/chat/completions", body, timeout=plan.request_timeout_s
            )
            records.append(request_record("turn", session, turn, result))
            answers.append(result.text if result.ok else "(no answer)")
    return records, reset_ok


def run_soak(
    plan: SoakPlan,
    model: Path,
    workdir: Path,
    *,
    baseline: bool = True,
    progress: Callable[[int], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """With ``baseline``, first the same load on a no-connector server (``run_baseline``: vLLM's own memory
    drift, which the memory bound is relative to). Then start the soak's server, run the serial pass, the
    sampled load and the serial pass again, stop the server, replay the audit log; return the report
    (JSON-ready; ``report["passed"]`` is the verdict)."""
    from hybridkv_dev.bench.serve import audit_summary, counters, divergence, local_cache_tokens

    def phase(name: str) -> None:
        if on_phase is not None:
            on_phase(name)

    workdir.mkdir(parents=True, exist_ok=True)
    baseline_report: dict[str, Any] | None = None
    if baseline:
        phase("baseline (no connector)")
        baseline_report = run_baseline(plan, model, workdir, progress=progress)
    server, store_dir, audit = start_server(plan, model, workdir)
    after: dict[str, Any] = {}
    serial_before: list[Any] = []
    serial_after: list[Any] = []
    load = LoadOutcome()
    try:
        phase("server start")
        server.wait_healthy()
        start_counters = counters(metrics_samples(server.base_url))
        if plan.serial_sessions:
            phase("serial pass, before")
            serial_before, after["serial_reset_before_ok"] = _serial_pass(server, plan)
        after["load_reset_ok"] = _reset_all(server)
        phase("load")
        load = run_soak_load(plan, server, store_dir, progress=progress)
        if load.error is None:
            try:
                if plan.serial_sessions:
                    phase("serial pass, after")
                    serial_after, after["serial_reset_after_ok"] = _serial_pass(server, plan)
                after["final_gauges"] = settle(server.base_url)["gauges"]
                end_counters = counters(metrics_samples(server.base_url))
            except (OSError, http.client.HTTPException) as error:
                load.error = f"after the load: {type(error).__name__}: {error}"[:500]
            else:
                after["counters"] = {
                    key: value - start_counters.get(key, 0.0)
                    for key, value in end_counters.items()
                    if key.startswith(("hybridkv_", "external_")) or key == "preemptions"
                }
    finally:
        phase("server stop")
        rc = server.stop()
    after["exit_status"] = rc
    log = server.log_text()
    serving = log.partition("shutdown triggered")[0]
    after["server_errors"] = serving.count(" ERROR ")
    after["load_error"] = load.error
    if load.error is not None or after["server_errors"]:
        # The first error the server logged, with what follows it: why it died, or what went wrong.
        first = serving.find(" ERROR ")
        after["server_log_excerpt"] = (
            serving[serving.rfind("\n", 0, first) + 1 :][:6000] if first >= 0 else ""
        )
    audit_report = audit_summary(audit)
    serial = divergence(serial_after, serial_before) if serial_before else None
    object_sizes = sorted(s["median_object_bytes"] for s in load.samples if s.get("median_object_bytes"))
    median_object = object_sizes[len(object_sizes) // 2] if object_sizes else None
    baseline_rss = next(
        (row for row in (baseline_report or {}).get("series", ()) if row["series"] == "rss_mib"), None
    )
    bounds = series_bounds(
        plan.store_capacity_bytes, median_object_bytes=median_object, baseline_rss=baseline_rss
    )
    rows = analyze_series(load.samples, bounds, plan.warmup_fraction)
    return build_soak_report(
        plan=plan,
        model=model,
        store_url=soak_store_url(plan, store_dir),
        load=load,
        rows=rows,
        after=after,
        audit=audit_report,
        serial=None
        if serial is None
        else {
            "requests": len(serial_before),
            "compared": serial.num_compared,
            "equal": serial.num_equal,
            "differing": [list(d) for d in serial.differing],
            # A request that failed (in either pass) is not compared: it fails the pass on its own.
            "failures": [
                (which, r.session, r.turn, r.error)
                for which, records in (("before", serial_before), ("after", serial_after))
                for r in records
                if not r.ok
            ],
        },
        local_cache_tokens=local_cache_tokens(log),
        baseline=baseline_report,
    )
