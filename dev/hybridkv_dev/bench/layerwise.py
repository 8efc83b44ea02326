"""TTFT of a partial external hit (half the prompt restored): ``load_mode: layerwise`` against ``async``.

One in-process vLLM engine (CPU build) with ``HybridStoreConnector`` started in layerwise mode; between
requests (the engine idle) :func:`set_load_mode` switches both connector halves between the two modes, so
both are measured on the same engine, weights, store and caches, interleaved round by round (the order
alternates every round). A round, per mode, on a fresh prompt: store its first half (a request of that half
alone, saves settled, vLLM's prefix cache dropped), then time one request of the whole prompt
(``max_tokens=1``): half of it restored from the store, half computed. Each round also times the same
kind of request with its first half in vLLM's own prefix cache (a local hit, the floor an external hit
is compared with: "overhead" below is TTFT minus the local hit's) and one cold request (no hit) for scale.

Run: ``python -m hybridkv_dev.bench.layerwise [--family llama] [--size bench] [--prompt-tokens 2048] [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridkv.demo import vllm_harness
from hybridkv.ops import inprocess

#: the modes compared, in the order of even rounds (odd rounds reverse it)
MODES: tuple[str, str] = ("layerwise", "async")


def set_load_mode(llm: Any, mode: str) -> None:
    """Switch an idle in-process engine's connector (started with ``load_mode: layerwise``) to ``mode``.

    Only between requests: a mode is a property of a whole request's load. Benchmarks only; a deployment
    sets ``load_mode`` in its config.
    """
    sched, worker = inprocess.connector_halves(llm)
    assert worker.worker_side_if_any() is not None and worker.worker_side.has_layerwise_loads, (
        "set_load_mode needs an engine started with load_mode 'layerwise'"
    )
    for connector in (sched, worker):
        connector.config = dataclasses.replace(connector.config, load_mode=mode)
    sched.scheduler_side.cfg = dataclasses.replace(sched.scheduler_side.cfg, load_mode=mode)
    worker.worker_side.switch_load_mode(mode)


def _prompt(num_tokens: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(num_tokens)]


def _timed(llm: Any, tokens: list[int]) -> tuple[float, int]:
    """Seconds of one greedy request (``max_tokens=1``: its TTFT) and its ``num_cached_tokens``."""
    start = time.perf_counter()
    out = vllm_harness.greedy(llm, tokens, max_tokens=1)
    return time.perf_counter() - start, int(out.num_cached_tokens or 0)


def _summary(values: Sequence[float]) -> dict[str, float]:
    ms = sorted(v * 1000.0 for v in values)
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1]}


def measure_layerwise_ttft(
    model_dir: Path,
    *,
    store_url: str,
    prompt_tokens: int = 2048,
    rounds: int = 7,
    kv_cache_bytes: int = 1 << 30,
    dtype: str = "bfloat16",
    seed: int = 7000,
) -> dict[str, Any]:
    """Per mode, the TTFT samples of a partial hit restoring ``prompt_tokens // 2`` tokens, plus cold TTFT
    samples; round 0 warms both modes and is not counted."""
    half = prompt_tokens // 2
    extra = {"store": store_url, "lookup_budget_ms": 5000, "load_mode": "layerwise"}
    transfer = inprocess.connector_transfer_config(extra)
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    samples["local"], samples["cold"] = [], []
    cached: dict[str, list[int]] = {mode: [] for mode in MODES}
    load_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    kwargs = inprocess.engine_kwargs(
        max_model_len=max(2048, prompt_tokens + 64), kv_cache_bytes=kv_cache_bytes, dtype=dtype
    )
    with inprocess.inprocess_engine(model_dir, transfer, **kwargs) as llm:
        _, worker = inprocess.connector_halves(llm)
        totals = worker.worker_side.stats.totals
        for round_index in range(rounds + 1):
            order = MODES if round_index % 2 == 0 else MODES[::-1]
            for mode in order:
                prefix = _prompt(half, rng)
                tokens = prefix + _prompt(prompt_tokens - half, rng)
                set_load_mode(llm, "async")
                vllm_harness.greedy(llm, prefix, max_tokens=1)  # stores the first half
                vllm_harness.drop_local_cache(llm)
                set_load_mode(llm, mode)
                load_before = float(totals.get("load_job_seconds", 0.0))
                seconds, num_cached = _timed(llm, tokens)
                worker.worker_side.flush()
                vllm_harness.drop_local_cache(llm)
                if round_index:
                    samples[mode].append(seconds)
                    cached[mode].append(num_cached)
                    load_s[mode].append(float(totals.get("load_job_seconds", 0.0)) - load_before)
            prefix = _prompt(half, rng)
            vllm_harness.greedy(llm, prefix, max_tokens=1)
            local_s, num_local = _timed(llm, prefix + _prompt(prompt_tokens - half, rng))
            assert num_local == half, f"expected a local hit of {half} tokens, got {num_local}"
            vllm_harness.drop_local_cache(llm)
            cold_s, _ = _timed(llm, _prompt(prompt_tokens, rng))
            vllm_harness.drop_local_cache(llm)
            if round_index:
                samples["local"].append(local_s)
                samples["cold"].append(cold_s)
        set_load_mode(llm, "layerwise")
    ratios = [lw / a for lw, a in zip(samples["layerwise"], samples["async"], strict=True)]
    overhead = {
        mode: [(s - local) * 1000.0 for s, local in zip(samples[mode], samples["local"], strict=True)]
        for mode in MODES
    }
    return {
        "prompt_tokens": prompt_tokens,
        "restored_tokens": half,
        "rounds": rounds,
        "ttft": {name: _summary(values) for name, values in samples.items()},
        "ttft_samples_ms": {name: [round(v * 1000.0, 2) for v in values] for name, values in samples.items()},
        "num_cached_tokens": cached,
        "load_job_ms": {mode: _summary(values) for mode, values in load_s.items()},
        "overhead_above_local_ms": {
            mode: {"median": statistics.median(v), "min": min(v), "max": max(v)}
            for mode, v in overhead.items()
        },
        "layerwise_over_async": {
            "ratio_of_medians": statistics.median(samples["layerwise"]) / statistics.median(samples["async"]),
            "per_round_median": statistics.median(ratios),
            "per_round_min": min(ratios),
            "per_round_max": max(ratios),
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    from hybridkv.bench.store import bench_scratch_dir
    from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model

    parser = argparse.ArgumentParser(
        prog="python -m hybridkv_dev.bench.layerwise", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--family", default="llama")
    parser.add_argument("--size", default="bench", help="tiny model size: tiny, bench or long (%(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    inprocess.prepare_inprocess_environment(quiet=True)
    model_dir = build_tiny_model(args.family, args.models_dir, size=args.size)
    with bench_scratch_dir() as scratch:
        report = measure_layerwise_ttft(
            model_dir,
            store_url=f"file://{scratch}/store?capacity=4GiB",
            prompt_tokens=args.prompt_tokens,
            rounds=args.rounds,
            dtype=args.dtype,
        )
    report["model"] = {"family": args.family, "size": args.size, "dtype": args.dtype}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
