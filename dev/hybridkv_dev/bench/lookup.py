"""Scheduler-side lookup cost vs the bare store call (``hybridkv bench lookup``), as pure functions
returning dicts.

For a KV geometry like ``hybridkv bench ttft``'s models (block 128; ``llama``: one full-attention group,
``lfm2``: full attention + a Mamba-spec state group in align mode) and several prompt lengths, with every
candidate key present in the store (a full hit: the most keys a lookup checks and resolves), it times:

- ``bare``: ``store.exists(keys)`` for the lookup's candidate keys (one batched call),
- ``lifecycle``: the lifecycle alone -- ``new_request`` + ``start_search`` and its rounds (answered from the
  keys known present) + ``finish_search`` (agreed boundary and load plan), no store call,
- ``connector``: the whole lookup of the real connector (what vLLM's ``get_num_new_matched_tokens``
  runs, asked again until answered): tracking, lifecycle, the probing search's batched ``exists`` rounds
  on the lookup thread, the answer.

``SchedulerSide`` is built from real vLLM config objects (``VllmConfig`` over a tiny local model, a
``KVCacheConfig`` with the geometry's groups; block sizes resolved by vLLM's own functions), so no engine
runs. Requests are real ``vllm.v1.request.Request`` objects with vLLM's block hasher. Each connector sample
is a fresh request incarnation (the request is finished, untimed, between samples), so no answer is memoized.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.report import pyplot_or_none, save_figure
from hybridkv.demo import vllm_harness
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from hybridkv.lifecycle.lookup import plan_lookup

__all__ = ["DEFAULT_GEOMETRIES", "DEFAULT_PROMPT_TOKENS", "TABLE_COLUMNS", "plot_report", "run_lookup_bench"]

#: The columns ``hybridkv bench`` prints, in order.
TABLE_COLUMNS = [
    "geometry",
    "store",
    "prompt_tokens",
    "num_keys",
    "bare_p50_us",
    "bare_p99_us",
    "lifecycle_p50_us",
    "lifecycle_p99_us",
    "connector_p50_us",
    "connector_p99_us",
    "connector_over_bare_p50",
    "connector_over_bare_p99",
]

DEFAULT_GEOMETRIES = ("llama", "lfm2")
DEFAULT_PROMPT_TOKENS = (1024, 4096, 16384)
_BLOCK = 128
_KV_HEADS, _HEAD_DIM, _LAYERS = 4, 128, 8  # the ttft bench model's attention


def _configs(geometry: str, store_url: str, models_dir: Path) -> tuple[Any, Any]:
    """(VllmConfig, scheduler KVCacheConfig) for ``geometry`` with the connector on ``store_url``."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )

    if geometry not in DEFAULT_GEOMETRIES:
        raise ValueError(f"unknown lookup geometry {geometry!r}; expected one of {DEFAULT_GEOMETRIES}")
    model = build_tiny_model("llama", models_dir)  # names the model only; the groups come from below
    num_blocks = 1024
    vc = vllm_harness.connector_vllm_config(
        model,
        {"store": store_url, "lookup_budget_ms": 5000, "namespace": "bench"},
        block_size=_BLOCK,
        num_blocks=num_blocks,
        mamba_align=geometry == "lfm2",
    )
    attn_layers = [f"model.layers.{i}.self_attn.attn" for i in range(_LAYERS)]
    full = FullAttentionSpec(
        block_size=_BLOCK, num_kv_heads=_KV_HEADS, head_size=_HEAD_DIM, dtype=torch.bfloat16
    )
    groups = [KVCacheGroupSpec(attn_layers, full)]
    if geometry == "lfm2":
        attn_layers = [f"model.layers.{i}.self_attn.attn" for i in range(1, _LAYERS, 2)]
        conv_layers = [f"model.layers.{i}.conv" for i in range(0, _LAYERS, 2)]
        state = MambaSpec(
            block_size=_BLOCK, shapes=((2, 1024),), dtypes=(torch.bfloat16,), mamba_cache_mode="align"
        )
        groups = [KVCacheGroupSpec(attn_layers, full), KVCacheGroupSpec(conv_layers, state)]
    page = full.page_size_bytes
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * page,
                layers=[g.layer_names[i] for g in groups],
                layer_stride=0,
                block_stride=page,
            )
            for i in range(len(groups[0].layer_names))
        ],
        kv_cache_groups=groups,
    )
    vllm_harness.resolve_cache_block_sizes(cfg, vc)
    return vc, cfg


def _request(rid: str, num_tokens: int, hash_unit: int) -> Any:
    rng = random.Random(num_tokens)
    tokens = [rng.randrange(3, 500) for _ in range(num_tokens)]
    return vllm_harness.block_hashed_request(rid, tokens, hash_unit)


def _percentiles(samples_us: list[float]) -> dict[str, float]:
    ordered = sorted(samples_us)
    return {
        "p50_us": statistics.median(ordered),
        "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


def _sample(fn: Callable[[], Any], iterations: int, after: Callable[[], Any] | None = None) -> list[float]:
    """Microseconds of each of ``iterations`` calls of ``fn`` (``after`` runs untimed between calls)."""
    out = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e6)
        if after is not None:
            after()
    return out


def measure_lookup(
    geometry: str,
    store_url: str,
    prompt_tokens: Sequence[int],
    *,
    iterations: int,
    models_dir: Path,
) -> list[dict[str, Any]]:
    """One row per prompt length: bare exists, lifecycle alone and the connector's lookup on ``store_url``."""
    from hybridkv.connector.config import ConnectorConfig
    from hybridkv.connector.scheduler.side import SchedulerSide
    from hybridkv.lifecycle.table import State

    vc, kv_cfg = _configs(geometry, store_url, models_dir)
    cfg = ConnectorConfig.from_extra_config(
        vc.kv_transfer_config.kv_connector_extra_config, model=str(vc.model_config.model)
    )
    side = SchedulerSide(vc, kv_cfg, cfg)
    rows: list[dict[str, Any]] = []
    written: list[str] = []
    try:
        hash_unit = side.scheme.geometry.hash_unit
        for n in prompt_tokens:
            request = _request(f"bench-{n}-{uuid.uuid4().hex[:6]}", n, hash_unit)
            hashes = list(request.block_hashes)
            keys = list(plan_lookup(side.scheme, hashes, request.num_tokens, 0).keys)  # every candidate
            # Every candidate present: a full hit (the connector resolves and plans the most blocks).
            statuses = side.store.put(keys, [b"hybridkv-bench-lookup"] * len(keys))
            assert all(s.is_ok for s in statuses), f"{store_url}: bench put failed: {set(statuses)}"
            written.extend(keys)
            exists = [s.is_ok for s in side.store.exists(keys)]
            assert all(exists), f"{store_url}: {exists.count(False)} of {len(keys)} candidate keys missing"

            def bare(keys: list[str] = keys) -> None:
                side.store.exists(keys)

            made: list[Any] = []

            def lifecycle(
                hashes: list[bytes] = hashes,
                num: int = request.num_tokens,
                present: frozenset[str] = frozenset(keys),
                made: list[Any] = made,
            ) -> None:
                lc = side.machine.new_request("bench-lc")
                search = lc.start_search(hashes, num, 0)
                assert search is not None
                lc.finish_search(search.run(lambda asked: [key in present for key in asked]))
                made.append(lc)

            def evict(made: list[Any] = made) -> None:
                made.pop().evict("bench")

            answer: list[int] = []

            def connector(request: Any = request, answer: list[int] = answer) -> None:
                # Asked again, as vLLM does each step, until the background search has the answer.
                while (num := side.lookup(request, 0)[0]) is None:
                    side.lookups.wait_idle(60.0)
                answer.append(num)

            def finish(request: Any = request) -> None:
                side.request_finished(request)

            for fn, after in ((bare, None), (lifecycle, evict), (connector, finish)):
                _sample(fn, max(3, iterations // 10), after)  # warm-up
            answer.clear()
            bare_us = _sample(bare, iterations)
            lc_us = _sample(lifecycle, iterations, evict)
            conn_us = _sample(connector, iterations, finish)
            hit = answer[0] if answer else 0
            assert all(a == hit for a in answer) and hit > 0, f"{store_url}: lookup answers {set(answer)}"
            assert not side.tracked_request_ids() and side.stats.totals.get("lookup_errors", 0) == 0
            b, lcp, c = _percentiles(bare_us), _percentiles(lc_us), _percentiles(conn_us)
            rows.append(
                {
                    "geometry": geometry,
                    "store": store_url.split("?", 1)[0],
                    "url": store_url,
                    "prompt_tokens": n,
                    "num_keys": len(keys),
                    "hit_tokens": hit,
                    "bare_p50_us": b["p50_us"],
                    "bare_p99_us": b["p99_us"],
                    "lifecycle_p50_us": lcp["p50_us"],
                    "lifecycle_p99_us": lcp["p99_us"],
                    "connector_p50_us": c["p50_us"],
                    "connector_p99_us": c["p99_us"],
                    "connector_over_bare_p50": c["p50_us"] / b["p50_us"] if b["p50_us"] else None,
                    "connector_over_bare_p99": c["p99_us"] / b["p99_us"] if b["p99_us"] else None,
                    "connector_minus_parts_p50_us": c["p50_us"] - b["p50_us"] - lcp["p50_us"],
                    "state_after": State.PARTIAL_HIT.name,
                }
            )
    finally:
        try:
            side.store.remove(written)
        finally:
            side.shutdown()
    return rows


def run_lookup_bench(
    store_urls: Sequence[str],
    *,
    geometries: Sequence[str] = DEFAULT_GEOMETRIES,
    prompt_tokens: Sequence[int] = DEFAULT_PROMPT_TOKENS,
    iterations: int = 300,
    models_dir: Path = DEFAULT_MODELS_DIR,
) -> dict[str, Any]:
    """Every (geometry, store, prompt length); p50/p99 microseconds and the connector / bare ratio."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if iterations < 2 or not prompt_tokens or min(prompt_tokens) < 1:
        raise ValueError("need iterations >= 2 and positive prompt lengths")
    rows: list[dict[str, Any]] = []
    for geometry in geometries:
        for url in store_urls:
            rows.extend(
                measure_lookup(geometry, url, prompt_tokens, iterations=iterations, models_dir=models_dir)
            )
    return {
        "benchmark": "lookup",
        "unit": "microseconds per call; p50/p99 over iterations",
        "iterations": iterations,
        "block_size": _BLOCK,
        "geometries": {
            "llama": f"1 full-attention group, block {_BLOCK}, {_LAYERS} layers x {_KV_HEADS} KV heads x {_HEAD_DIM}",
            "lfm2": f"full attention (block {_BLOCK}) + Mamba-spec state group (align, block {_BLOCK})",
        },
        "measures": {
            "bare": "store.exists(candidate keys), one batched call",
            "lifecycle": "new_request + start_search and its rounds (answered from the keys known present) + "
            "finish_search (boundary, load plan), no store call",
            "connector": "SchedulerSide.lookup (tracking + lifecycle + exists on the lookup thread within the "
            "budget); a fresh request incarnation per sample",
        },
        "ratio": "connector_over_bare = connector / bare at the same percentile",
        "rows": rows,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }


def plot_report(report: dict[str, Any], path: Path) -> Path | None:
    """p50 of bare exists vs the connector's lookup per prompt length, one line per (geometry, store)."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(7, 4))
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in report["rows"]:
        series.setdefault((row["geometry"], row["store"].split("://")[0]), []).append(row)
    for (geometry, scheme), rows in series.items():
        xs = [row["prompt_tokens"] for row in rows]
        axes.plot(
            xs, [row["connector_p50_us"] for row in rows], marker="o", label=f"{geometry} {scheme} connector"
        )
        axes.plot(
            xs,
            [row["bare_p50_us"] for row in rows],
            linestyle="--",
            marker=".",
            label=f"{geometry} {scheme} bare",
        )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("p50 us")
    axes.legend(fontsize=6)
    return save_figure(figure, path)
