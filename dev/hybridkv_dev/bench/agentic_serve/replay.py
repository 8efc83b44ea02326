"""One configuration on its own server: the trace replayed over HTTP on its clock, the counters and TTFTs it
gave."""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv_dev.bench.agentic_serve.trace import (
    CONFIGURATIONS,
    FIRST_TOKEN_ID,
    HYBRIDKV_CONFIGURATIONS,
    MOONCAKE_CONFIGURATION,
    NAMESPACE,
    NUM_WINDOWS,
    START_TIMEOUT_S,
    ReplayRequest,
    ServeSetup,
    ServeTrace,
    request_body,
)
from hybridkv_dev.bench.serve import counters, local_cache_tokens
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from hybridkv_dev.devkit.openai_server import (
    OpenAIServer,
    StreamResult,
    http_json,
    hybridkv_transfer_config,
    metric,
    metrics_samples,
    stream_request,
)


@dataclass
class ReplayOutcome:
    """What one replay through one server measured."""

    results: list[StreamResult]
    #: counter deltas over the whole replay (``hybridkv_dev.bench.serve.counters`` names, plus ``mooncake_put_bytes``)
    totals: dict[str, float]
    #: per window of requests: (prompt tokens, external hit tokens, local hit tokens)
    windows: list[tuple[int, float, float]]
    seconds: float


def _samples_counters(base_url: str) -> dict[str, float]:
    samples = metrics_samples(base_url)
    out = counters(samples)
    out["mooncake_put_bytes"] = sum(
        metric(samples, "vllm:mooncake_store_operation_bytes_total", operation="save_put", status=status)
        for status in ("ok", "partial_failure")
    )
    return out


def _settled(base_url: str, num_succeeded: float, timeout_s: float = 10.0) -> dict[str, float]:
    """Counters once ``num_succeeded`` requests are counted (stats reach the API server with the engine's
    outputs), and the connector's store writes have stopped moving (saves finish after their request)."""
    deadline = time.monotonic() + timeout_s
    now = _samples_counters(base_url)
    while now["requests_succeeded"] < num_succeeded and time.monotonic() < deadline:
        time.sleep(0.1)
        now = _samples_counters(base_url)
    while True:
        time.sleep(0.3)
        later = _samples_counters(base_url)
        written = ("hybridkv_save_bytes", "mooncake_put_bytes")
        if all(later.get(k) == now.get(k) for k in written) or time.monotonic() > deadline:
            return later
        now = later


def replay_trace(
    base_url: str,
    trace: ServeTrace,
    configuration: str,
    setup: ServeSetup,
    *,
    num_windows: int = NUM_WINDOWS,
    progress: Callable[[int], None] | None = None,
) -> ReplayOutcome:
    """Send ``trace``'s requests to the server at ``base_url`` in trace order (each once those it follows
    are answered, ``setup.concurrency`` at a time), reading the counters at the end of each window of
    requests; never raises on a failed request."""
    requests = trace.requests
    size = max(1, math.ceil(len(requests) / max(1, num_windows)))
    results: list[StreamResult | None] = [None] * len(requests)
    done = [threading.Event() for _ in requests]
    start_counters = _samples_counters(base_url)
    before = start_counters
    num_ok = 0
    windows: list[tuple[int, float, float]] = []

    def send(request: ReplayRequest) -> None:
        for index in request.after:
            done[index].wait()
        try:
            results[request.index] = stream_request(
                base_url, "/v1/completions", request_body(request, configuration, setup)
            )
        finally:
            done[request.index].set()
        if progress is not None:
            progress(1)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=setup.concurrency, thread_name_prefix="agentic-client") as pool:
        for first in range(0, len(requests), size):
            window = requests[first : first + size]
            for future in [pool.submit(send, r) for r in window]:
                future.result()
            num_ok += sum(1 for r in window if (result := results[r.index]) is not None and result.ok)
            after = _settled(base_url, start_counters["requests_succeeded"] + num_ok)
            windows.append(
                (
                    sum(len(r.prompt) for r in window),
                    after["external_hit_tokens"] - before["external_hit_tokens"],
                    after["local_hit_tokens"] - before["local_hit_tokens"],
                )
            )
            before = after
    seconds = time.perf_counter() - start
    totals = {k: before[k] - start_counters.get(k, 0.0) for k in before}
    final = [r if r is not None else StreamResult(ok=False, error="not sent") for r in results]
    return ReplayOutcome(final, totals, windows, seconds)


def _warm_up(base_url: str, setup: ServeSetup) -> None:
    """Two prompts shorter than a block (nothing to cache, locally or in a store): the first requests after
    start are several times slower. Returns once ``/metrics`` counts them."""
    length = max(1, min(setup.block_tokens - 1, 24))
    for index in range(2):
        body = {
            "model": "tiny",
            "prompt": [FIRST_TOKEN_ID + (index * 7 + k) % 100 for k in range(length)],
            "max_tokens": setup.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_salt": "salt:warm-up",
        }
        stream_request(base_url, "/v1/completions", body)
    _settled(base_url, 2)  # their counts are in before the replay's first reading


def _start_server(
    configuration: str,
    model: Path,
    rundir: Path,
    setup: ServeSetup,
    capacity_bytes: int,
    *,
    master: MooncakeMaster | None,
    store_dir: Path,
) -> OpenAIServer:
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(setup.reserved_cpus)}
    kv: dict[str, Any] | None = None
    if configuration in HYBRIDKV_CONFIGURATIONS:
        kv = hybridkv_transfer_config(f"file://{store_dir}?capacity={capacity_bytes}", namespace=NAMESPACE)
    elif configuration == MOONCAKE_CONFIGURATION:
        assert master is not None, "mooncake-store needs its master"
        mooncake_config = rundir / "mooncake-store.json"
        mooncake_config.write_text(
            json.dumps(
                {
                    "mode": "embedded",
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master.address,
                    "global_segment_size": capacity_bytes,
                    "local_buffer_size": setup.mooncake_local_buffer_mib << 20,
                    "protocol": "tcp",
                    "device_name": "",
                }
            )
        )
        env.update(MOONCAKE_CONFIG_PATH=str(mooncake_config), MC_TCP_BIND_ADDRESS="127.0.0.1")
        kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    elif configuration != "none":
        raise ValueError(f"unknown configuration {configuration!r}; expected one of {CONFIGURATIONS}")
    return OpenAIServer(
        model,
        rundir / "server.log",
        kv_transfer_config=kv,
        max_model_len=setup.max_model_len,
        max_num_seqs=setup.concurrency,
        max_num_batched_tokens=setup.max_model_len,
        kv_cache_memory_bytes=int(setup.kv_cache_mib * (1 << 20)),
        extra_args=("--block-size", str(setup.block_tokens)),
        extra_env=env,
        start_timeout_s=START_TIMEOUT_S,
    )


def _master_metrics(master: MooncakeMaster) -> dict[str, float]:
    """The master's own gauges and counters whose names speak of bytes or capacity (``{}`` if unreadable)."""
    try:
        text = str(http_json(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=5.0))
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if re.search(r"byte|capacity|size", key) and "_bucket" not in key:
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def _percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank ``q`` quantile (``None`` when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run_configuration(
    configuration: str,
    model: Path,
    trace: ServeTrace,
    setup: ServeSetup,
    capacity_bytes: int,
    rundir: Path,
    *,
    store_dir: Path | None = None,
    round_index: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """One configuration on one trace: a fresh server (and store under ``store_dir``, default
    ``rundir/store``, removed afterwards; and master), the warm-up, the replay, the counters; the run's dict
    (``error`` set, with the server log's tail, when the server failed)."""
    rundir.mkdir(parents=True, exist_ok=True)
    store_dir = store_dir if store_dir is not None else rundir / "store"
    master: MooncakeMaster | None = None
    run: dict[str, Any] = {"configuration": configuration, "round": round_index, "seed": trace.seed}
    server: OpenAIServer | None = None
    try:
        if configuration == MOONCAKE_CONFIGURATION:
            master = MooncakeMaster(rundir / "mooncake-master.log", lease_ttl="200ms")
            master.start()
        started = time.perf_counter()
        server = _start_server(
            configuration, model, rundir, setup, capacity_bytes, master=master, store_dir=store_dir
        )
        server.wait_healthy()
        run["server_start_s"] = time.perf_counter() - started
        _warm_up(server.base_url, setup)
        outcome = replay_trace(server.base_url, trace, configuration, setup, progress=progress)
        if master is not None:
            run["mooncake_master"] = _master_metrics(master)
    except Exception as error:  # noqa: BLE001 -- one run's failure must not end the others
        log = rundir / "server.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
        run["error"] = ("".join(traceback.format_exception(error)[-3:]) + "\n" + tail)[-4000:]
        return run
    finally:
        if server is not None:
            run["exit_status"] = server.stop()
            run["local_cache_tokens"] = local_cache_tokens(server.log_text())
        if master is not None:
            master.stop()
        shutil.rmtree(store_dir, ignore_errors=True)
    ok = [r for r in outcome.results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    prompt_tokens = sum(len(r.prompt) for r in trace.requests)
    totals = outcome.totals
    if configuration in HYBRIDKV_CONFIGURATIONS:
        written: float | None = totals.get("hybridkv_save_bytes", 0.0)
        written_source = "vllm:hybridkv_save_bytes_total"
    elif configuration == MOONCAKE_CONFIGURATION:
        written = totals.get("mooncake_put_bytes", 0.0)
        written_source = 'vllm:mooncake_store_operation_bytes_total{operation="save_put"}'
    else:
        written, written_source = None, "no store"
    run.update(
        {
            "requests": len(outcome.results),
            "errors": len(outcome.results) - len(ok),
            "error_samples": sorted({str(r.error) for r in outcome.results if not r.ok})[:3],
            "prompt_tokens": prompt_tokens,
            "vllm_prompt_tokens": totals.get("prompt_tokens"),
            "external_hit_tokens": totals.get("external_hit_tokens", 0.0),
            "local_hit_tokens": totals.get("local_hit_tokens", 0.0),
            "store_share": totals.get("external_hit_tokens", 0.0) / max(1, prompt_tokens),
            "local_share": totals.get("local_hit_tokens", 0.0) / max(1, prompt_tokens),
            "ttft_p50_s": _percentile(ttfts, 0.5),
            "ttft_p99_s": _percentile(ttfts, 0.99),
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            "store_bytes_written": written,
            "store_bytes_written_source": written_source,
            "capacity_bytes": capacity_bytes,
            "replay_s": outcome.seconds,
            "window_store_shares": [ext / max(1, p) for p, ext, _ in outcome.windows],
            "window_local_shares": [loc / max(1, p) for p, _, loc in outcome.windows],
            "window_sizes": [p for p, _, _ in outcome.windows],
            "hybridkv": {k: v for k, v in totals.items() if k.startswith("hybridkv_")},
        }
    )
    return run
