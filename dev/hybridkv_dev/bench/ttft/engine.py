"""What every connector's measurement shares: the in-process engine, its prompts, the interleaved rounds of a
cold prefill and a hit, the store path's own cost."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.bench.store import bench_scratch_dir, measure_memcpy, measure_put_get
from hybridkv.demo import vllm_harness
from hybridkv.demo.tiny_models import tiny_config_kwargs
from hybridkv.ops import inprocess
from hybridkv.store.frame import compute_checksum, default_checksum
from hybridkv.store.url import open_store

from hybridkv_dev.devkit.mooncake import MooncakeMaster, running_master

DEFAULT_FAMILIES = ("llama", "lfm2")
#: Families vLLM's ExampleConnector can serve (it does not support the hybrid KV-cache manager).
EXAMPLE_FAMILIES = ("llama",)


def default_scratch_dir(parent: str | None = None) -> Any:
    """A temp dir under ``parent`` (default: ``/dev/shm`` when present) as a context manager; the stores live
    there."""
    return bench_scratch_dir(parent)


def _prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(num_tokens)]


def engine_kwargs(prompt_tokens: int, kv_cache_bytes: int, dtype: str) -> dict[str, Any]:
    return inprocess.engine_kwargs(
        max_model_len=max(2048, prompt_tokens + 64), kv_cache_bytes=kv_cache_bytes, dtype=dtype
    )


def _timed_generate(llm: Any, tokens: list[int]) -> tuple[float, int]:
    """Seconds of one ``llm.generate`` (``max_tokens=1``) and the request's ``num_cached_tokens``."""
    start = time.perf_counter()
    out = vllm_harness.greedy(llm, tokens, max_tokens=1)
    elapsed = time.perf_counter() - start
    return elapsed, int(out.num_cached_tokens or 0)


def _nothing() -> None:
    pass


def _nothing_counted(_counted: bool) -> None:
    pass


@dataclass(frozen=True)
class RoundHooks:
    """What one connector's engine does around the timed requests of a round (all untimed). ``counted`` is
    False in the warm-up round."""

    before_cold: Callable[[], None] = _nothing
    after_cold: Callable[[bool], None] = _nothing_counted
    #: Drop vLLM's local prefix cache and keep the external tier; None: no local-hit request (prefix
    #: caching off, so the second send is the external hit).
    drop_local_cache: Callable[[], None] | None = None
    before_external: Callable[[], None] = _nothing
    after_external: Callable[[bool], None] = _nothing_counted


def ttft_rounds(
    llm: Any, hooks: RoundHooks, *, prompt_tokens: int, rounds: int, warmup_tokens: int, seed: int
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """The protocol every connector runs: per round a fresh prompt, cold; again (local hit); again after
    ``hooks.drop_local_cache`` (external hit). Round 0 warms every code path on a prompt of at most
    ``warmup_tokens`` and is not counted. Returns (seconds, num_cached_tokens) per request kind."""
    kinds = ("cold", "external") if hooks.drop_local_cache is None else ("cold", "local", "external")
    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
    cached: dict[str, list[int]] = {kind: [] for kind in kinds}
    for round_index in range(rounds + 1):
        counted = round_index > 0
        n = prompt_tokens if counted else min(prompt_tokens, warmup_tokens)
        tokens = _prompt(n, seed + round_index)
        timed: dict[str, tuple[float, int]] = {}
        hooks.before_cold()
        timed["cold"] = _timed_generate(llm, tokens)
        hooks.after_cold(counted)
        if hooks.drop_local_cache is not None:
            timed["local"] = _timed_generate(llm, tokens)
            hooks.drop_local_cache()
        hooks.before_external()
        timed["external"] = _timed_generate(llm, tokens)
        hooks.after_external(counted)
        if counted:
            for kind, (seconds, num_cached) in timed.items():
                samples[kind].append(seconds)
                cached[kind].append(num_cached)
    return samples, cached


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


def started_mooncake_master(log_dir: Path) -> contextlib.AbstractContextManager[MooncakeMaster]:
    """A ``mooncake_master`` child on 127.0.0.1 for the bench's lifetime (the product's argv and lease).

    ``RuntimeError`` outside a loopback-only namespace (``scripts/netns-run``) or without the binary."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    return running_master(log_dir / "mooncake_master.log")


def _load_profile_from_audit(path: Path) -> list[dict[str, float]]:
    """Per external hit (in request order), from the connector's audit log (scheduler-side transitions,
    ``monotonic`` seconds): ``lookup_ms`` = lookup_started -> hit_found, ``load_ms`` = load_started ->
    load_verified (the scheduler's view of the load: issue, the worker's read + verify + copy into the pages,
    and the engine steps until the scheduler saw it finished)."""
    by_request: dict[str, dict[str, float]] = {}
    order: list[str] = []
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        request_id, event = record.get("request_id"), record.get("event")
        if not isinstance(request_id, str) or not isinstance(record.get("monotonic"), (int, float)):
            continue
        times = by_request.setdefault(request_id, {})
        if event not in times:  # the first of each event (a retry would start a second lookup)
            times[str(event)] = float(record["monotonic"])
        if event == "load_verified":
            order.append(request_id)
    profiles = []
    for request_id in order:
        times = by_request[request_id]
        profiles.append(
            {
                "lookup_ms": (times.get("hit_found", math.nan) - times.get("lookup_started", math.nan)) * 1e3,
                "load_ms": (times["load_verified"] - times.get("load_started", math.nan)) * 1e3,
            }
        )
    return profiles


def _median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1e3


def measure_store_path(
    store_url: str, value_size: int, num_values: int, *, repeats: int = 5
) -> dict[str, Any]:
    """The store's own costs for one hit's bytes, in this process (ms, medians of ``repeats``): the whole
    framed ``get_into`` (checksum or keyed hash on), the same with ``checksum=none`` (read + copy alone), the checksum of
    those bytes alone, and one ``memcpy`` of them. The difference of the first two is the verify cost."""
    # The read alone: no checksum, and no keyed hash (a keyed store refuses checksum=none).
    base, _, query = store_url.partition("?")
    params = [p for p in query.split("&") if p and not p.startswith("integrity_key_")]
    unchecked = f"{base}?{'&'.join([*params, 'checksum=none'])}"
    out: dict[str, Any] = {}
    for name, url in (("get_ms", store_url), ("get_no_checksum_ms", unchecked)):
        store = open_store(url)
        try:
            samples = []
            for _ in range(max(1, repeats)):
                gbps = measure_put_get(store, value_size, num_values, repeats=1)["get_gbps"]
                samples.append(value_size * num_values / gbps / 1e9)
            out[name] = _median_ms(samples)
        finally:
            store.close()
    algo = default_checksum()
    buffers = [memoryview(os.urandom(value_size)) for _ in range(num_values)]
    checksum_s = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for buffer in buffers:
            compute_checksum(algo, [buffer])
        checksum_s.append(time.perf_counter() - start)
    out["checksum_ms"] = _median_ms(checksum_s)
    out["checksum_algo"] = algo.url_name
    memcpy_s = [
        value_size * num_values / measure_memcpy(value_size, num_values, repeats=1)["memcpy_gbps"] / 1e9
        for _ in range(max(1, repeats))
    ]
    out["memcpy_ms"] = _median_ms(memcpy_s)
    return out


def model_facts(family: str, size: str, dtype: str) -> dict[str, Any]:
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


def num_params(model_dir: Path) -> int | None:
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
