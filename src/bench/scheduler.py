"""vLLM's real ``Scheduler`` with and without the connector at production geometry (``hybridkv bench
scheduler``), as pure functions returning dicts.

The geometry is Kimi-K3-like (``k3_configs``): MLA with block 64 sharded by DCP 8 (a 512-token span),
a replicated Mamba / linear-attention state in align mode with block 64, hash unit 64, TP 8. A stream of
requests (prompts up to 128K tokens; a mix of hits on prefixes a previous request saved and misses) is
added a few per step; every ``schedule()`` call is timed. Scheduled requests are finished right away (the
bench measures the scheduler's decision, not prefill), so the pool never fills.

Rounds interleave the configurations (medians over rounds, with the spread; ratios within a round). Like
vLLM's ``EngineCore``, each run freezes the start-up heap before it serves. Per store URL (e.g.
``faulty+memory://...?delay_ms=5``: a store with that much latency per call), and once without the
connector, it reports: ``schedule()`` p50/p99, lookups per second, store round trips and
keys per lookup (p50/max; the probing search), hit tokens found, and the hit tokens the synchronous full
scan (every candidate key in one call, the old lookup) finds over the same store contents.
"""

from __future__ import annotations

import os
import platform
import random
import re
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.report import target_row
from hybridkv.devkit.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model

__all__ = ["K3_BLOCK", "K3_DCP", "SCHEDULER_COLUMNS", "k3_configs", "k3_request", "run_scheduler_bench"]

#: the table columns of ``hybridkv bench scheduler``
SCHEDULER_COLUMNS = [
    "store",
    "num_steps",
    "schedule_p50_ms",
    "schedule_p99_ms",
    "schedule_p99_ms_spread",
    "p99_ratio",
    "p99_ratio_spread",
    "busy_schedule_p99_ms",
    "busy_p99_ratio",
    "busy_p99_ratio_spread",
    "busy_connector_p99_ms",
    "busy_vllm_p99_ms",
    "lookups_per_s",
    "round_trips_p50",
    "round_trips_max",
    "keys_p50",
    "keys_max",
    "hit_tokens",
    "full_scan_hit_tokens",
    "lookup_errors",
]

K3_BLOCK = 64
K3_DCP = 8
_MAX_MODEL_LEN = 131072 + 1024
_CHUNK = 8192  # saved Mamba states: one per prefill chunk end
_PUT_BATCH = 512  # keys per put while filling the store (a remote store's deadline bounds one call)


def k3_configs(store_url: str | None, models_dir: Path, *, num_blocks: int = 8192) -> tuple[Any, Any]:
    """(VllmConfig, scheduler KVCacheConfig): MLA block 64 x DCP 8 + Mamba align block 64, TP 8.

    ``store_url`` None: no connector. Everything else is vLLM's default (``lookup_budget_ms`` too).
    """
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
        MLAAttentionSpec,
    )

    model = build_tiny_model(
        "llama",
        models_dir,
        num_key_value_heads=1,
        num_attention_heads=8,
        max_position_embeddings=_MAX_MODEL_LEN,
    )
    transfer = None
    if store_url is not None:
        transfer = KVTransferConfig(
            kv_connector="HybridStoreConnector",
            kv_connector_module_path="hybridkv.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"store": store_url, "namespace": "k3"},
        )
    vc = VllmConfig(
        model_config=ModelConfig(
            model=str(model),
            dtype="bfloat16",
            skip_tokenizer_init=True,
            seed=0,
            max_model_len=_MAX_MODEL_LEN,
        ),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=K3_DCP, decode_context_parallel_size=K3_DCP),
        cache_config=CacheConfig(block_size=K3_BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_model_len=_MAX_MODEL_LEN,
            max_num_batched_tokens=_CHUNK,
            max_num_seqs=64,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=transfer,
    )
    vc.cache_config.mamba_cache_mode = "align"
    vc.cache_config.num_gpu_blocks = num_blocks
    mla = MLAAttentionSpec(
        block_size=K3_BLOCK, num_kv_heads=1, head_size=8, dtype=torch.bfloat16, cache_dtype_str="auto"
    )
    mamba = MambaSpec(
        block_size=K3_BLOCK, shapes=((4,), (8,)), dtypes=(torch.int16, torch.int32), mamba_cache_mode="align"
    )
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * 4096, layers=["attn.0", "ssm.0"], layer_stride=0, block_stride=4096
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["attn.0"], mla), KVCacheGroupSpec(["ssm.0"], mamba)],
    )
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(cfg, vc)
    cfg.hash_block_size = hash_bs
    cfg.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(cfg, vc, sched_bs, hash_bs)
    return vc, cfg


def k3_scheduler(store_url: str | None, models_dir: Path) -> Any:
    """vLLM's real ``Scheduler`` over ``k3_configs`` (no workers)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc, cfg = k3_configs(store_url, models_dir)
    return Scheduler(
        vc,
        cfg,
        StructuredOutputManager(vc),
        block_size=cfg.hash_block_size,
        hash_block_size=cfg.hash_block_size,
    )


def k3_request(request_id: str, family: int, num_tokens: int) -> Any:
    """A request whose prompt is the first ``num_tokens`` tokens of ``family`` (families share nothing)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    rng = random.Random(family)
    tokens = [rng.randrange(3, 30000) for _ in range(num_tokens)]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    return Request(request_id, tokens, sp, None, block_hasher=get_request_block_hasher(K3_BLOCK, sha256))


def store_prefix(scheme: Any, store: Any, block_hashes: Sequence[bytes], num_tokens: int) -> int:
    """Write what a previous request of ``num_tokens`` tokens saved: every MLA block, a Mamba state at
    every chunk end and at its end, on every rank. Returns the number of keys written."""
    geometry = scheme.geometry
    unit = geometry.hash_unit
    span = geometry.spans[0]
    ranks = [r.tp_rank for r in geometry.topology.ranks]
    entries = [(0, b) for b in range(span, num_tokens + 1, span)]
    states = sorted({*range(_CHUNK, num_tokens + 1, _CHUNK), num_tokens - num_tokens % unit})
    entries += [(1, b) for b in states if b > 0]
    keys = [scheme.key(g, r, scheme.boundary_hash(block_hashes, b)) for g, b in entries for r in ranks]
    for start in range(0, len(keys), _PUT_BATCH):
        batch = keys[start : start + _PUT_BATCH]
        statuses = store.put(batch, [b"k3"] * len(batch))
        assert all(s.is_ok for s in statuses), f"bench put failed: {set(statuses)}"
    return len(keys)


def full_scan_hit(scheme: Any, store: Any, request: Any) -> int:
    """The synchronous full scan's answer (every candidate key in one ``exists``): the old lookup."""
    from hybridkv.lifecycle.lookup import plan_lookup

    candidates = plan_lookup(scheme, request.block_hashes, request.num_tokens, 0)
    exists = [s.is_ok for s in store.exists(list(candidates.keys))] if candidates.keys else []
    return candidates.resolve(exists).num_external_tokens


def _stream(num_requests: int, max_tokens: int, seed: int) -> list[tuple[int, int, bool]]:
    """(family, prompt tokens, hit?) per request: half hit a stored prefix, half miss; long prompts."""
    rng = random.Random(seed)
    sizes = [max_tokens, max_tokens // 4] + [
        rng.randrange(max_tokens // 16, max_tokens + 1) for _ in range(num_requests)
    ]
    return [(i, max(K3_BLOCK * 8, sizes[i] - sizes[i] % K3_BLOCK), i % 2 == 0) for i in range(num_requests)]


def _percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _drive(
    store_url: str | None,
    stream: list[tuple[int, int, bool]],
    models_dir: Path,
    per_step: int,
    prefixes: dict[int, float],
    forward_s: float,
) -> dict[str, Any]:
    import gc

    from hybridkv.store import open_store
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.request import RequestStatus

    sched = k3_scheduler(store_url, models_dir)
    side = sched.connector.scheduler_side if sched.connector is not None else None
    requests = [k3_request(f"r{i}-{uuid.uuid4().hex[:4]}", fam, n) for i, (fam, n, _) in enumerate(stream)]
    expected_hits = 0
    if side is not None:
        assert store_url is not None
        inner = open_store(_filler_url(store_url))
        for req, (fam, n, hit) in zip(requests, stream, strict=True):
            if hit:
                store_prefix(side.scheme, inner, req.block_hashes, int(n * prefixes.get(fam, 0.75)))
        expected_hits = sum(full_scan_hit(side.scheme, inner, req) for req in requests)
        inner.close()
    # vLLM's EngineCore freezes its start-up heap (``freeze_gc_heap``) so that collections while serving
    # do not walk it. Without the freeze, one collection here walks every object of the imported vLLM
    # (tens of ms) and the p99 of either configuration measures when the collector happened to run.
    in_connector = _ConnectorClock(sched.connector) if sched.connector is not None else None
    freeze_gc_heap()
    step_s: list[float] = []
    busy_connector_s: list[float] = []  # per busy step: time inside the connector's scheduler calls
    busy_step_s: list[float] = []  # steps that scheduled tokens (the others delay no request)
    answered: set[str] = set()
    hit_tokens = 0
    pending = list(requests)
    started = time.monotonic()
    try:
        while pending or sched.waiting or sched.running:
            for req in pending[:per_step]:
                sched.add_request(req)
            pending = pending[per_step:]
            if in_connector is not None:
                in_connector.elapsed_s = 0.0
            t0 = time.perf_counter()
            out = sched.schedule()
            step_s.append(time.perf_counter() - t0)
            if out.total_num_scheduled_tokens:
                busy_step_s.append(step_s[-1])
                if in_connector is not None:
                    busy_connector_s.append(in_connector.elapsed_s)
            done = set(out.num_scheduled_tokens)
            if out.kv_connector_metadata is not None:
                for load in out.kv_connector_metadata.loads:
                    hit_tokens += load.boundary
                    done.add(load.req_id)
            answered |= done
            if done:
                sched.finish_requests(done, RequestStatus.FINISHED_ABORTED)
            time.sleep(forward_s)  # the forward pass this bench leaves out
            assert time.monotonic() - started < 600, "the scheduler stopped making progress"
        wall_s = time.monotonic() - started
    finally:
        gc.unfreeze()
    row: dict[str, Any] = {
        "store": store_url or "(no connector)",
        "connector": side is not None,
        "num_requests": len(requests),
        "num_steps": len(step_s),
        "schedule_p50_ms": statistics.median(step_s) * 1e3,
        "schedule_p99_ms": _percentile(step_s, 0.99) * 1e3,
        "schedule_max_ms": max(step_s) * 1e3,
        "num_busy_steps": len(busy_step_s),
        "busy_schedule_p50_ms": statistics.median(busy_step_s) * 1e3,
        "busy_schedule_p99_ms": _percentile(busy_step_s, 0.99) * 1e3,
        "wall_s": wall_s,
    }
    if busy_connector_s:
        # The split of a busy step: the connector's own calls, and vLLM's work around them (which grows with
        # the connector too: a hit's blocks are allocated in one step, a request waiting for its lookup is
        # matched against the local prefix cache again every step).
        row["busy_connector_p99_ms"] = _percentile(busy_connector_s, 0.99) * 1e3
        row["busy_vllm_p99_ms"] = (
            _percentile([t - c for t, c in zip(busy_step_s, busy_connector_s, strict=True)], 0.99) * 1e3
        )
    if side is not None:
        costs = list(side.lookups.recent_costs)
        trips = [c[0] for c in costs] or [0]
        keys = [c[1] for c in costs] or [0]
        row.update(
            {
                "lookups_per_s": side.lookups.num_searches / wall_s,
                "round_trips_p50": statistics.median(trips),
                "round_trips_max": max(trips),
                "keys_p50": statistics.median(keys),
                "keys_max": max(keys),
                "store_calls": side.lookups.num_exists_calls,
                "hit_tokens": hit_tokens,
                "full_scan_hit_tokens": expected_hits,
                "lookup_errors": side.stats.totals.get("lookup_errors", 0),
            }
        )
    sched.shutdown()
    return row


class _ConnectorClock:
    """Times the connector's scheduler-side calls of one ``schedule()`` (``elapsed_s``, reset by the caller).

    The wait of a step that scheduled nothing (``LookupService.wait_for_progress``) is left out: it is the
    connector handing the interpreter to its lookup thread, not work on the step's path."""

    _CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta")

    def __init__(self, connector: Any) -> None:
        self.elapsed_s = 0.0
        for name in self._CALLS:
            setattr(connector, name, self._timed(getattr(connector, name), 1.0))
        lookups = connector.scheduler_side.lookups
        lookups.wait_for_progress = self._timed(lookups.wait_for_progress, -1.0)

    def _timed(self, call: Any, sign: float) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.elapsed_s += sign * (time.perf_counter() - t0)

        return timed


def _spread(values: Sequence[float]) -> str:
    return f"{min(values):.3g}..{max(values):.3g}"


def _summarize(
    label: str, rounds: list[dict[str, Any]], base_rounds: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """One table row from the rounds of one configuration: medians over rounds, with the spread.

    Ratios are taken within a round (against the no-connector run of the same round), then the median.
    """
    row: dict[str, Any] = {
        "store": label,
        "num_rounds": len(rounds),
        "num_steps": statistics.median(r["num_steps"] for r in rounds),
    }
    for name in (
        "schedule_p50_ms",
        "schedule_p99_ms",
        "schedule_max_ms",
        "busy_schedule_p50_ms",
        "busy_schedule_p99_ms",
        "busy_connector_p99_ms",
        "busy_vllm_p99_ms",
    ):
        if name not in rounds[0]:
            continue  # the connector split of the no-connector rows
        values = [r[name] for r in rounds]
        row[name] = statistics.median(values)
        row[f"{name}_spread"] = _spread(values)
    if base_rounds is None:
        return row
    for name, ratio in (
        ("schedule_p99_ms", "p99_ratio"),
        ("schedule_p50_ms", "p50_ratio"),
        ("busy_schedule_p99_ms", "busy_p99_ratio"),
    ):
        ratios = [r[name] / b[name] for r, b in zip(rounds, base_rounds, strict=True)]
        row[ratio] = statistics.median(ratios)
        row[f"{ratio}_spread"] = _spread(ratios)
    for name in ("lookups_per_s", "round_trips_p50", "keys_p50"):
        row[name] = statistics.median(r[name] for r in rounds)
    for name in ("round_trips_max", "keys_max", "lookup_errors"):
        row[name] = max(r[name] for r in rounds)
    # Hit tokens must equal the full scan's in every round: the sum shows a miss in any of them.
    row["hit_tokens"] = sum(r["hit_tokens"] for r in rounds)
    row["full_scan_hit_tokens"] = sum(r["full_scan_hit_tokens"] for r in rounds)
    return row


#: The issue's targets for a lookup at production geometry (``scheduler_targets``).
P99_RATIO_TARGET = 1.2
MAX_ROUND_TRIPS_TARGET = 4


def scheduler_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per connector row: ``schedule()`` p99 against the no-connector run (busy steps, and all steps) at most
    ``P99_RATIO_TARGET``; exactly the synchronous full scan's hit tokens; at most ``MAX_ROUND_TRIPS_TARGET``
    store round trips per lookup."""
    out = []
    for row in rows[1:]:
        store = row["store"]
        full = row["full_scan_hit_tokens"]
        out += [
            target_row(
                f"{store}: busy schedule() p99 / no connector", row["busy_p99_ratio"], "<=", P99_RATIO_TARGET
            ),
            target_row(f"{store}: schedule() p99 / no connector", row["p99_ratio"], "<=", P99_RATIO_TARGET),
            target_row(
                f"{store}: hit tokens / full scan's", row["hit_tokens"] / full if full else None, "==", 1.0
            ),
            target_row(
                f"{store}: store round trips per lookup (max)",
                row["round_trips_max"],
                "<=",
                MAX_ROUND_TRIPS_TARGET,
            ),
        ]
    return out


def run_scheduler_bench(
    store_urls: Sequence[str],
    *,
    labels: dict[str, str] | None = None,
    num_requests: int = 24,
    max_tokens: int = 131072,
    per_step: int = 2,
    num_rounds: int = 5,
    forward_ms: float = 1.0,
    models_dir: Path = DEFAULT_MODELS_DIR,
    seed: int = 0,
) -> dict[str, Any]:
    """Per round: one run without the connector and one per store URL, in a rotating order (so a noisy
    moment hits every configuration alike); rows give medians over rounds with their spread, and ratios
    against the no-connector run of the same round. ``forward_ms``: the pause between ``schedule()``
    calls standing in for the forward pass (short = the connector is asked again most often).
    ``labels``: table names for some URLs (e.g. a store behind a delay proxy on a random port)."""
    assert num_rounds >= 1, "num_rounds must be >= 1"
    stream = _stream(num_requests, max_tokens, seed)
    prefixes = {fam: random.Random(seed + fam).choice([0.5, 0.75, 1.0]) for fam, _, _ in stream}
    configs: list[str | None] = [None, *store_urls]
    by_config: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(configs))}
    for round_index in range(num_rounds):
        order = [(round_index + k) % len(configs) for k in range(len(configs))]
        for i in order:
            url = configs[i]
            if url is not None and round_index > 0:
                url = _fresh_url(url)  # every round starts from an empty store of the same kind
            by_config[i].append(_drive(url, stream, models_dir, per_step, prefixes, forward_ms / 1e3))
    base = by_config[0]
    rows = [_summarize("(no connector)", base, None)]
    names = labels or {}
    rows += [_summarize(names.get(url, url), by_config[i + 1], base) for i, url in enumerate(store_urls)]
    return {
        "targets": scheduler_targets(rows),
        "benchmark": "scheduler",
        "geometry": f"MLA block {K3_BLOCK} x DCP {K3_DCP} + Mamba align block {K3_BLOCK}, hash unit {K3_BLOCK}",
        "num_requests": num_requests,
        "max_prompt_tokens": max_tokens,
        "requests_per_step": per_step,
        "num_rounds": num_rounds,
        "forward_ms": forward_ms,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "rows": rows,
        "rounds": {
            ("(no connector)" if c is None else names.get(c, c)): by_config[i] for i, c in enumerate(configs)
        },
    }


def _filler_url(url: str) -> str:
    """The store behind ``url`` without injected faults, and with a long deadline: what fills the store
    before a run (what a previous request saved) is not what the run measures."""
    if url.startswith("faulty+"):
        url = url.split("+", 1)[1].split("?", 1)[0]
    if url.startswith("mooncake://"):
        url = re.sub(r"([?&])timeout_ms=\d+", r"\1timeout_ms=60000", url)
    return url


def _fresh_url(url: str) -> str:
    """The same store URL with a new ``memory://`` name (other stores are shared: their keys of earlier
    rounds only add hits the full scan also sees)."""
    marker = "memory://"
    if marker not in url:
        return url
    head, rest = url.split(marker, 1)
    name, sep, tail = rest.partition("?")
    return f"{head}{marker}{name}-{uuid.uuid4().hex[:4]}{sep}{tail}"
