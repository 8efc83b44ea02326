"""The whole bench: every configuration on its own server, the serial reference, the report and its
targets."""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hybridkv.bench.harness import load_average

from hybridkv_dev.bench.record import RequestRecord
from hybridkv_dev.bench.serve.configuration import (
    agreement,
    audit_summary,
    check_after_load,
    divergence,
    divergence_columns,
    summarize,
)
from hybridkv_dev.bench.serve.load import LoadResult, run_load
from hybridkv_dev.bench.serve.servers import ServerShape, engine_core_ids, local_cache_tokens, server_for
from hybridkv_dev.bench.serve.trace import hit_trace, resent_engine_times
from hybridkv_dev.bench.serve.workload import CONFIGS, MOONCAKE_CONFIGS, Workload, system_prompt
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from hybridkv_dev.devkit.net import NETNS_HINT, loopback_only_namespace
from hybridkv_dev.devkit.openai_server import (
    OpenAIServer,
)

# --- the whole bench ------------------------------------------------------------------------------------------


@dataclass
class ConfigRun:
    config: str
    summary: dict[str, Any]
    after: dict[str, Any]
    per_turn: list[dict[str, float]]
    records: list[RequestRecord]
    local_cache_tokens: int | None
    self_records: list[RequestRecord] | None = None
    #: the concurrency-1 pass (``serial_workload``), every prefix then from this configuration's tier
    serial_records: list[RequestRecord] | None = None
    error: str | None = None
    #: ``--trace``: each resent-turn hit's way through the scheduler's steps (``bench/serve/trace.py``)
    trace: dict[str, Any] | None = None


def run_config(
    config: str,
    model: Path,
    workdir: Path,
    workload: Workload,
    shape: ServerShape,
    master: MooncakeMaster | None,
    *,
    self_check: bool = False,
    serial: Workload | None = None,
    progress: Callable[[int], None] | None = None,
) -> ConfigRun:
    """Start the server of ``config``; run the ``serial`` workload (concurrency 1) on it first (without one,
    ``warmup_workload``), then reset the local and the external cache; drive the load (twice with
    ``self_check``: the second pass after ``reset_prefix_cache``); check the aftermath; stop the server."""
    server, audit = server_for(config, model, workdir, shape, workload, master)
    after: dict[str, Any] = {}
    try:
        server.wait_healthy()
        serial_records = None
        if serial is not None:
            serial_load = run_serial(server, serial, progress)
            serial_records = serial_load.records
            after["serial_external_hit_tokens"] = serial_load.totals.get("external_hit_tokens")
        else:
            # The first requests after start are several times slower (measured: first-turn TTFT 0.4-0.9 s
            # against ~0.1 s once warm); the serial pass warms the server otherwise.
            run_load(server.base_url, warmup_workload(workload), probe=False)
        # The load starts with nothing cached, locally or in the store.
        try:
            server.reset_prefix_cache(attempts=30, reset_external=True)
            after["store_reset_before_load"] = True
        except RuntimeError:
            after["store_reset_before_load"] = False  # the connector cannot reset: its store stays warm
            server.reset_prefix_cache(attempts=30)
        load = run_load(server.base_url, workload, progress=progress)
        self_records = None
        if self_check:
            server.reset_prefix_cache(attempts=30)
            self_records = run_load(server.base_url, workload, progress=progress).records
        after.update(check_after_load(server, None))
    finally:
        rc = server.stop()
    if audit is not None:
        after.update(audit_summary(audit))
    log = server.log_text()
    after["exit_status"] = rc
    after["server_errors"] = len(re.findall(r" ERROR ", log.partition("shutdown triggered")[0]))
    after["engine_core_ids"] = engine_core_ids(log)
    trace: dict[str, Any] | None = None
    if shape.step_trace and audit is not None:
        try:
            trace = hit_trace(log, audit, load.records)
        except (OSError, ValueError, KeyError) as error:  # the run's figures stand without their trace
            trace = {"error": f"{type(error).__name__}: {error}"}
    return ConfigRun(
        config=config,
        summary=summarize(load),
        after=after,
        per_turn=load.per_turn,
        records=load.records,
        local_cache_tokens=local_cache_tokens(log),
        self_records=self_records,
        serial_records=serial_records,
        trace=trace,
    )


def run_serial(
    server: OpenAIServer, serial: Workload, progress: Callable[[int], None] | None = None
) -> LoadResult:
    """The serial workload on a fresh server (one request at a time, no eviction probe)."""
    assert serial.concurrency == 1, f"the serial pass runs at concurrency 1, got {serial.concurrency}"
    return run_load(server.base_url, serial, progress=progress, probe=False)


def run_serial_reference(
    model: Path,
    workdir: Path,
    shape: ServerShape,
    serial: Workload,
    progress: Callable[[int], None] | None = None,
) -> list[RequestRecord]:
    """The serial workload on a no-connector server whose local cache holds all of it
    (``shape.reference_kv_cache_bytes``): every resent prefix a local hit. An external hit restores the
    same KV and state a local hit keeps, so a configuration's serial pass must give these tokens exactly. (A
    prefix recomputed after eviction may round differently in bfloat16 and flip a greedy tie: the
    no-connector server with the small cache is not an exact reference.)"""
    big = replace(shape, kv_cache_bytes=shape.reference_kv_cache_bytes)
    server, _ = server_for("none", model, workdir, big, serial, None, log_name="server-serial-reference.log")
    try:
        server.wait_healthy()
        return run_serial(server, serial, progress).records
    finally:
        server.stop()


def warmup_workload(workload: Workload) -> Workload:
    """Two one-turn sessions of other prompts (another seed), one at a time: warms a server up before the
    measured load when no serial pass does."""
    return replace(workload, seed=workload.seed + 1, num_sessions=2, num_turns=1, concurrency=1)


def serial_workload(workload: Workload, num_sessions: int) -> Workload:
    """The concurrency-1 check: the first ``num_sessions`` sessions of ``workload``, one request at a time
    (no batching to change greedy tokens), on each configuration's fresh server with its small local cache:
    resent prefixes evicted locally come from the configuration's tier. Compared with
    ``run_serial_reference``."""
    return replace(workload, concurrency=1, num_sessions=min(num_sessions, workload.num_sessions))


def working_set_tokens(records: Sequence[RequestRecord], workload: Workload, model: Path) -> int:
    """Distinct tokens of the multi-turn load: each session's last prompt and answer, with the shared system
    prompts counted once (their length from the model's tokenizer)."""
    last: dict[int, int] = {}
    for r in records:
        if r.phase == "turn" and r.ok:
            last[r.session] = max(last.get(r.session, 0), r.prompt_tokens + r.completion_tokens)
    if not last:
        return 0
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    system_tokens = len(tokenizer.encode(system_prompt(workload, 0)).ids)
    num_shared = min(workload.num_system_prompts, len(last))
    return sum(last.values()) - system_tokens * (len(last) - num_shared)


def run_serve_bench(
    configs: Sequence[str],
    model: Path,
    workload: Workload,
    shape: ServerShape,
    workdir: Path,
    *,
    self_check: bool = True,
    serial_sessions: int = 4,
    progress: Callable[[int], None] | None = None,
    on_config: Callable[[str], None] | None = None,
    checkpoint: Callable[[dict[str, Any]], object] | None = None,
) -> dict[str, Any]:
    """Run every configuration in the order given (rotate it between repeated runs: a host's load drifts over
    a run, and whichever configuration runs first or last would meet the same part of that drift every time);
    return the report (JSON-ready, rows in ``CONFIGS`` order; agreement is against ``none`` wherever it ran).
    ``serial_sessions`` > 0 adds the concurrency-1 pass (``serial_workload``) to every configuration.
    ``checkpoint`` gets the report so far after each configuration."""
    serial = serial_workload(workload, serial_sessions) if serial_sessions > 0 else None
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown serve configuration(s) {unknown}; expected some of {list(CONFIGS)}")
    ordered = list(dict.fromkeys(configs))
    load_start = load_average()
    master: MooncakeMaster | None = None
    runs: dict[str, ConfigRun] = {}
    try:
        if MOONCAKE_CONFIGS & set(ordered):
            if not loopback_only_namespace():
                raise RuntimeError(f"Mooncake configurations: {NETNS_HINT}")
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
            master = MooncakeMaster(workdir / "mooncake-master.log", lease_ttl="200ms")
            master.start()
        serial_reference: list[RequestRecord] | None = None
        if serial is not None:
            if on_config is not None:
                on_config("serial reference")
            serial_reference = run_serial_reference(model, workdir, shape, serial, progress)
        for config in ordered:
            if on_config is not None:
                on_config(config)
            try:
                runs[config] = run_config(
                    config,
                    model,
                    workdir,
                    workload,
                    shape,
                    master,
                    self_check=self_check and config == "none",
                    serial=serial,
                    progress=progress,
                )
            except Exception as error:  # noqa: BLE001 -- one configuration's failure must not end the others
                # A server that did not start or died under load (its /metrics gone), or anything else that
                # ended this configuration: reported with the traceback and the last lines of the server's
                # log, and the other configurations still run.
                log = workdir / f"server-{config}.log"
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else ""
                trace = "".join(traceback.format_exception(error)[-3:])
                runs[config] = ConfigRun(config, {}, {}, [], [], None, error=f"{trace}\n{tail}"[-4000:])
            if checkpoint is not None:
                checkpoint(build_report(runs, workload, shape, model, serial_reference))
    finally:
        if master is not None:
            master.stop()
    report = build_report(runs, workload, shape, model, serial_reference)
    # What else ran on the host: the 1-minute load average when the bench started and when it ended.
    report["load_average"] = {"start": load_start, "end": load_average()}
    return report


#: The configurations whose ratios the targets judge, and the ones they are judged against.
HYBRID_CONFIGS: tuple[str, ...] = ("hybridkv-file", "hybridkv-mooncake")
BASE_CONFIGS: tuple[str, ...] = ("none", "mooncake-store")
#: The targets, a ratio of a hybridkv configuration's to a base's: mean TTFT and throughput (requests/s).
TARGETS: dict[str, tuple[str, float]] = {
    "ttft_mean_vs_none": ("<=", 0.5),
    "ttft_mean_vs_mooncake-store": ("<=", 0.8),
    "throughput_vs_none": (">=", 1.0),
    "throughput_vs_mooncake-store": (">=", 1.0),
}
#: Ratios ``run_ratios`` takes: the TTFT statistics (to the base's), and throughput.
_RATIO_METRICS = {
    "ttft_mean": "ttft_mean_s",
    "ttft_p50": "ttft_p50_s",
    "ttft_p99": "ttft_p99_s",
    # turns after the first: the requests whose prefix a tier can serve
    "ttft_resent_mean": "ttft_resent_mean_s",
}


def run_ratios(by_config: Mapping[str, Mapping[str, Any]], hybrid_config: str) -> dict[str, float]:
    """One run's ratios of ``hybrid_config``'s row to each base configuration's: ``ttft_{mean,p50,p99}_vs_<base>``
    (lower is better) and ``throughput_vs_<base>`` (requests/s; higher is better). Missing where either row
    lacks the number."""
    hybrid = by_config.get(hybrid_config) or {}
    ratios: dict[str, float] = {}
    for base in BASE_CONFIGS:
        other = by_config.get(base) or {}
        for name, key in (*_RATIO_METRICS.items(), ("throughput", "requests_per_s")):
            if hybrid.get(key) and other.get(key):
                ratios[f"{name}_vs_{base}"] = hybrid[key] / other[key]
    return ratios


def build_report(
    runs: Mapping[str, ConfigRun],
    workload: Workload,
    shape: ServerShape,
    model: Path,
    serial_reference: Sequence[RequestRecord] | None = None,
) -> dict[str, Any]:
    reference = runs.get("none")
    rows: list[dict[str, Any]] = []
    for config, run in sorted(runs.items(), key=lambda item: CONFIGS.index(item[0])):
        row: dict[str, Any] = {"config": config, **run.summary, **run.after}
        row["local_cache_tokens"] = run.local_cache_tokens
        if run.error is not None:
            row["error"] = run.error
        if reference is not None and reference.records and run.records:
            if config == "none" and run.self_records is not None:
                row["agreement"] = agreement(run.self_records, run.records)
                row.update(divergence_columns(divergence(run.self_records, run.records)))
            elif config != "none":
                row["agreement"] = agreement(run.records, reference.records)
                row.update(divergence_columns(divergence(run.records, reference.records)))
        if serial_reference and run.serial_records is not None:
            serial = divergence(run.serial_records, serial_reference)
            row["serial_requests"] = serial.num_compared
            row["serial_agreement"] = serial.agreement
            row["serial_differing"] = [list(d) for d in serial.differing]
        rows.append(row)
    working_set = max((working_set_tokens(r.records, workload, model) for r in runs.values()), default=0)
    local = next((r.local_cache_tokens for r in runs.values() if r.local_cache_tokens), None)
    by_config = {row["config"]: row for row in rows}
    target_rows: list[dict[str, Any]] = []
    for hybrid_config in HYBRID_CONFIGS:
        hybrid = by_config.get(hybrid_config)
        if hybrid is None or not hybrid.get("ttft_mean_s"):
            continue
        ratios = run_ratios(by_config, hybrid_config)
        for name, (op, bound) in TARGETS.items():
            value = ratios.get(name)
            met = None if value is None else (value <= bound if op == "<=" else value >= bound)
            target_rows.append(
                {
                    "config": hybrid_config,
                    "ratio": name,
                    "value": value,
                    "target": f"{op} {bound}",
                    "met": met,
                }
            )
    core_ids = {config: run.after.get("engine_core_ids") for config, run in runs.items() if run.after}
    traces = {
        config: {
            **resent_engine_times(run.per_turn),
            "ttft_resent_mean_s": run.summary.get("ttft_resent_mean_s"),
            **(run.trace or {}),
        }
        for config, run in runs.items()
        if shape.step_trace
    }
    return {
        "model": str(model),
        # the order the configurations ran in
        "run_order": list(runs),
        "workload": asdict(workload),
        "server": asdict(shape),
        "local_cache_tokens": local,
        "working_set_tokens": working_set,
        "local_fraction_of_working_set": (local / working_set) if local and working_set else None,
        "rows": rows,
        "targets": target_rows,
        # The same OpenMP cores for every configuration, or the comparison is not like for like.
        "engine_core_ids": core_ids,
        "per_turn": {config: run.per_turn for config, run in runs.items()},
        **({"trace": traces} if traces else {}),
        "ttfts": {
            config: [r.ttft_s for r in run.records if r.phase == "turn" and r.ttft_s is not None]
            for config, run in runs.items()
        },
    }
