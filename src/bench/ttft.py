"""Time to first token through a real in-process vLLM engine (``hybridkv bench ttft``), as pure functions
returning dicts.

One engine per family with ``HybridStoreConnector`` on a ``file://`` store (under ``/dev/shm`` when present).
Every round uses a fresh random prompt and times ``llm.generate`` of one request with ``max_tokens=1``
(wall clock, so scheduling, the connector's lookup, the load and the forward are all inside):

- ``cold``: the prompt was never seen (full prefill; the connector saves its blocks),
- ``local``: the same prompt again (vLLM's own device prefix cache hits),
- ``external``: the same prompt after ``llm.reset_prefix_cache()``, which drops the device prefix cache and
  keeps the store, so the prefix comes from this connector.

Saves run off the forward path; each timed request starts with the previous one's saves flushed (untimed),
so the measurements do not overlap a background write. A warm-up round (same steps, other prompt) is not
counted. Medians over rounds; the bytes the external hit loaded come from the worker's own ``load_bytes``
counter, and the copy floor divides them by a ``memcpy`` (``numpy.copyto``) of the same value size and count
measured in the same run.

Baseline (``baseline=True``, non-hybrid families only): vLLM's in-tree ``ExampleConnector`` (safetensors
files per request, no HMA, so hybrids cannot run it) in a separate engine on the same scratch filesystem,
prefix caching off (as it requires), the same prompt sent twice: the second send is its external hit.
"""

from __future__ import annotations

import math
import os
import platform
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.report import pyplot_or_none
from hybridkv.bench.store import bench_scratch_dir, measure_memcpy
from hybridkv.testing import vllm_harness
from hybridkv.testing.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model, tiny_config_kwargs

__all__ = [
    "DEFAULT_FAMILIES",
    "TABLE_COLUMNS",
    "default_scratch_dir",
    "plot_report",
    "run_ttft_bench",
]

#: The columns ``hybridkv bench`` prints, in order.
TABLE_COLUMNS = [
    "family",
    "connector",
    "cold_ms",
    "local_hit_ms",
    "external_hit_ms",
    "external_hit_tokens",
    "loaded_mb",
    "load_job_ms",
    "copy_floor_ms",
    "external_over_local",
    "cold_over_external",
    "overhead_over_floor",
]

DEFAULT_FAMILIES = ("llama", "lfm2")
#: Families vLLM's ExampleConnector can serve (it does not support the hybrid KV-cache manager).
_EXAMPLE_FAMILIES = ("llama",)


def default_scratch_dir() -> Any:
    """A temp dir under ``/dev/shm`` when present (a context manager); the stores live there."""
    return bench_scratch_dir()


def _prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(num_tokens)]


def _engine_kwargs(prompt_tokens: int, kv_cache_bytes: int, dtype: str) -> dict[str, Any]:
    return vllm_harness.engine_kwargs(
        max_model_len=max(2048, prompt_tokens + 64), kv_cache_bytes=kv_cache_bytes, dtype=dtype
    )


def _timed_generate(llm: Any, tokens: list[int]) -> tuple[float, int]:
    """Seconds of one ``llm.generate`` (``max_tokens=1``) and the request's ``num_cached_tokens``."""
    start = time.perf_counter()
    out = vllm_harness.greedy(llm, tokens, max_tokens=1)
    elapsed = time.perf_counter() - start
    return elapsed, int(out.num_cached_tokens or 0)


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX); without them bf16 matmuls on
    CPU run far slower than float32 (measured here: a 4000x1024x2816 matmul took 26 s in bf16, 0.17 s in fp32)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str) -> str:
    """``auto`` -> ``bfloat16`` on CPUs with fast bf16, else ``float32``; anything else unchanged."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def _model_facts(family: str, size: str, dtype: str) -> dict[str, Any]:
    _, kw = tiny_config_kwargs(family, size=size)
    layer_types = kw.get("layer_types") or ["full_attention"] * kw["num_hidden_layers"]
    num_full = sum(1 for t in layer_types if t == "full_attention")
    head_dim = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    itemsize = 4 if dtype == "float32" else 2
    return {
        "hidden_size": kw["hidden_size"],
        "num_layers": kw["num_hidden_layers"],
        "layer_types": sorted(set(layer_types)),
        "num_full_attention_layers": num_full,
        "kv_heads": kw["num_key_value_heads"],
        "head_dim": head_dim,
        # K and V of every full-attention layer
        "kv_bytes_per_token_full_attention": num_full * 2 * kw["num_key_value_heads"] * head_dim * itemsize,
    }


def _num_params(model_dir: Path) -> int | None:
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover -- vLLM depends on safetensors
        return None
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 -- safe_open is not a mapping
                total += math.prod(int(n) for n in handle.get_slice(name).get_shape())
    return total


def measure_hybridkv(
    model_dir: Path,
    *,
    store_url: str,
    prompt_tokens: int,
    rounds: int,
    kv_cache_bytes: int,
    dtype: str,
    warmup_tokens: int = 512,
    seed: int = 1000,
) -> dict[str, Any]:
    """Cold / local-hit / external-hit TTFT samples of one engine with ``HybridStoreConnector``."""
    transfer = vllm_harness.connector_transfer_config({"store": store_url, "lookup_budget_ms": 5000})
    samples: dict[str, list[float]] = {"cold": [], "local": [], "external": []}
    cached: dict[str, list[int]] = {"cold": [], "local": [], "external": []}
    loaded_bytes: list[int] = []
    loaded_keys: list[int] = []
    load_job_s: list[float] = []
    start = time.perf_counter()
    with vllm_harness.inprocess_engine(
        model_dir,
        prefix_caching=True,
        transfer=transfer,
        **_engine_kwargs(prompt_tokens, kv_cache_bytes, dtype),
    ) as llm:
        engine_start_s = time.perf_counter() - start
        sched, worker = vllm_harness.connector_halves(llm)
        geo = sched.scheduler_side.geo.describe()
        # Round 0 warms every code path (cold, local hit, reset, external hit) on a short prompt; not counted.
        for round_index in range(rounds + 1):
            n = min(prompt_tokens, warmup_tokens) if round_index == 0 else prompt_tokens
            tokens = _prompt(n, seed + round_index)
            cold_s, cold_cached = _timed_generate(llm, tokens)
            vllm_harness.settle(llm)
            local_s, local_cached = _timed_generate(llm, tokens)
            vllm_harness.drop_local_cache(llm)
            totals = worker.worker_side.stats.totals
            bytes_before, keys_before = totals.get("load_bytes", 0), totals.get("load_keys", 0)
            load_s_before = totals.get("load_job_seconds", 0.0)
            ext_s, ext_cached = _timed_generate(llm, tokens)
            worker.worker_side.flush()
            vllm_harness.settle(llm)
            totals = worker.worker_side.stats.totals
            if round_index == 0:
                continue
            for name, sec, num in (
                ("cold", cold_s, cold_cached),
                ("local", local_s, local_cached),
                ("external", ext_s, ext_cached),
            ):
                samples[name].append(sec)
                cached[name].append(num)
            loaded_bytes.append(int(totals.get("load_bytes", 0) - bytes_before))
            loaded_keys.append(int(totals.get("load_keys", 0) - keys_before))
            load_job_s.append(float(totals.get("load_job_seconds", 0.0) - load_s_before))
        sched_totals = dict(sched.scheduler_side.stats.totals)
    return {
        "engine_start_s": engine_start_s,
        "geometry": geo,
        "samples_s": samples,
        "num_cached_tokens": cached,
        "loaded_bytes": loaded_bytes,
        "loaded_keys": loaded_keys,
        "load_job_s": load_job_s,
        "scheduler_totals": {k: v for k, v in sched_totals.items() if not k.startswith("hit_tokens.")},
    }


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def measure_example_connector(
    model_dir: Path,
    *,
    storage_dir: Path,
    prompt_tokens: int,
    rounds: int,
    kv_cache_bytes: int,
    dtype: str,
    warmup_tokens: int = 512,
    seed: int = 2000,
) -> dict[str, Any]:
    """vLLM's ``ExampleConnector`` in its own engine: cold send, then the same prompt again (its hit)."""
    from vllm.config import KVTransferConfig

    storage_dir.mkdir(parents=True, exist_ok=True)
    transfer = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(storage_dir)},
    )
    samples: dict[str, list[float]] = {"cold": [], "external": []}
    cached: dict[str, list[int]] = {"cold": [], "external": []}
    file_bytes: list[int] = []
    with vllm_harness.inprocess_engine(
        model_dir,
        prefix_caching=False,
        transfer=transfer,
        **_engine_kwargs(prompt_tokens, kv_cache_bytes, dtype),
    ) as llm:
        for round_index in range(rounds + 1):
            n = min(prompt_tokens, warmup_tokens) if round_index == 0 else prompt_tokens
            tokens = _prompt(n, seed + round_index)
            before = _dir_bytes(storage_dir)
            cold_s, cold_cached = _timed_generate(llm, tokens)
            written = _dir_bytes(storage_dir) - before
            ext_s, ext_cached = _timed_generate(llm, tokens)
            if round_index == 0:
                continue
            samples["cold"].append(cold_s)
            samples["external"].append(ext_s)
            cached["cold"].append(cold_cached)
            cached["external"].append(ext_cached)
            file_bytes.append(written)
    return {"samples_s": samples, "num_cached_tokens": cached, "file_bytes": file_bytes}


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None


def _row(
    family: str,
    connector: str,
    *,
    cold: float | None,
    local: float | None,
    ext: float | None,
    ext_tokens: int,
    loaded_bytes: int,
    loaded_keys: int | None,
    memcpy_gbps: float | None,
    load_job: float | None,
) -> dict[str, Any]:
    floor_ms = loaded_bytes / memcpy_gbps / 1e6 if memcpy_gbps and loaded_bytes else None
    extra_ms = (ext - local) * 1e3 if ext is not None and local is not None else None
    return {
        "family": family,
        "connector": connector,
        "cold_ms": _ms(cold),
        "local_hit_ms": _ms(local),
        "external_hit_ms": _ms(ext),
        "external_hit_tokens": ext_tokens,
        "loaded_bytes": loaded_bytes,
        "loaded_mb": loaded_bytes / 1e6,
        "loaded_keys": loaded_keys,
        "load_job_ms": _ms(load_job),
        "memcpy_gbps": memcpy_gbps,
        "copy_floor_ms": floor_ms,
        "external_over_local": _ratio(ext, local),
        "cold_over_external": _ratio(cold, ext),
        "external_minus_local_ms": extra_ms,
        "overhead_over_floor": _ratio(extra_ms, floor_ms),
    }


def run_ttft_bench(
    families: Sequence[str] = DEFAULT_FAMILIES,
    *,
    scratch_dir: str | os.PathLike[str],
    prompt_tokens: int = 4000,
    rounds: int = 3,
    size: str = "bench",
    dtype: str = "auto",
    baseline: bool = True,
    models_dir: Path = DEFAULT_MODELS_DIR,
    kv_cache_bytes: int | None = None,
) -> dict[str, Any]:
    """Measure every family; one row per (family, connector) with medians and same-run ratios."""
    # One process, so the connector's worker half is reachable; vLLM logs to stdout: keep the table readable.
    vllm_harness.prepare_inprocess_environment("ERROR")
    if rounds < 1 or prompt_tokens < 1:
        raise ValueError("need rounds >= 1 and prompt_tokens >= 1")
    resolved_dtype = resolve_dtype(dtype)
    scratch = Path(scratch_dir)
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    not_measured: list[str] = []
    for family in families:
        model_dir = build_tiny_model(family, models_dir, size=size)
        facts = _model_facts(family, size, resolved_dtype)
        per_prompt = prompt_tokens * max(1, facts["kv_bytes_per_token_full_attention"])
        # Room for a few prompts in vLLM's cache (hybrids: the state groups take as much again).
        kv_bytes = kv_cache_bytes or max(64 << 20, 6 * per_prompt)
        capacity = max(256 << 20, 4 * (rounds + 1) * per_prompt)
        ours = measure_hybridkv(
            model_dir,
            store_url=f"file://{scratch}/store-{family}?capacity={capacity}",
            prompt_tokens=prompt_tokens,
            rounds=rounds,
            kv_cache_bytes=kv_bytes,
            dtype=resolved_dtype,
        )
        med_bytes = int(statistics.median(ours["loaded_bytes"]))
        med_keys = int(statistics.median(ours["loaded_keys"]))
        memcpy_gbps = None
        if med_bytes > 0 and med_keys > 0:
            # The same bytes in the same value size as the load, measured now (same machine load).
            memcpy_gbps = measure_memcpy(max(1, med_bytes // med_keys), med_keys, repeats=5)["memcpy_gbps"]
        local = _median(ours["samples_s"]["local"])
        rows.append(
            _row(
                family,
                "HybridStoreConnector",
                cold=_median(ours["samples_s"]["cold"]),
                local=local,
                ext=_median(ours["samples_s"]["external"]),
                ext_tokens=int(statistics.median(ours["num_cached_tokens"]["external"])),
                loaded_bytes=med_bytes,
                loaded_keys=med_keys,
                memcpy_gbps=memcpy_gbps,
                load_job=_median(ours["load_job_s"]),
            )
        )
        details[family] = {
            "model": str(model_dir),
            "model_facts": facts,
            "params": _num_params(model_dir),
            "kv_cache_memory_bytes": kv_bytes,
            **ours,
        }
        if not baseline:
            continue
        if family not in _EXAMPLE_FAMILIES:
            not_measured.append(
                f"{family}: no in-tree baseline (ExampleConnector does not support the hybrid KV-cache manager)"
            )
            continue
        example = measure_example_connector(
            model_dir,
            storage_dir=scratch / f"example-{family}",
            prompt_tokens=prompt_tokens,
            rounds=rounds,
            kv_cache_bytes=kv_bytes,
            dtype=resolved_dtype,
        )
        rows.append(
            _row(
                family,
                "ExampleConnector (vLLM)",
                cold=_median(example["samples_s"]["cold"]),
                local=local,  # it runs with prefix caching off: ratios use the same family's local hit above
                ext=_median(example["samples_s"]["external"]),
                ext_tokens=int(statistics.median(example["num_cached_tokens"]["external"])),
                loaded_bytes=int(statistics.median(example["file_bytes"])),
                loaded_keys=None,
                memcpy_gbps=memcpy_gbps,
                load_job=None,
            )
            | {"local_hit_ms": None}
        )
        details[f"{family}/ExampleConnector"] = example
    not_measured.append(
        "MooncakeStoreConnector baseline: not run (needs a mooncake_master process, and in-process its engine "
        "hangs on shutdown in zmq.Context.term)"
    )
    return {
        "benchmark": "ttft",
        "unit": "ms of wall time of llm.generate(max_tokens=1) for one request; medians over rounds",
        "prompt_tokens": prompt_tokens,
        "rounds": rounds,
        "size": size,
        "dtype": resolved_dtype,
        "dtype_requested": dtype,
        "cpu_fast_bf16": cpu_has_fast_bf16(),
        "protocol": "per round a fresh prompt: cold; the same prompt again (local hit); reset_prefix_cache() "
        "(keeps the store) then the same prompt (external hit). Saves are flushed between requests, untimed. "
        "One warm-up round on a short prompt is not counted.",
        "ratios": "external_over_local = external-hit / local-hit TTFT; cold_over_external = cold / external-hit; "
        "copy_floor_ms = loaded bytes / memcpy GB/s of the same value size, measured in the same run; "
        "overhead_over_floor = (external-hit - local-hit) / copy floor; load_job_ms = time the worker's load "
        "thread spent reading the store and writing the blocks during the request (the load_job_seconds "
        "counter). ExampleConnector runs with prefix caching off "
        "(its loaded_bytes = safetensors bytes it wrote), so its ratios use the HybridStoreConnector local hit.",
        "rows": rows,
        "details": details,
        "not_measured": not_measured,
        "seconds": time.perf_counter() - started,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }


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
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
