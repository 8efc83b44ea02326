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

Steps are split into busy ones (they scheduled tokens) and idle ones (they scheduled nothing: requests waiting for
their lookups, and ``idle_steps`` calls after the stream drained, which give the no-connector run its idle steps),
and each step into the connector's own calls on the scheduler thread (every scheduler-side hook vLLM calls:
``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``, ``request_finished*``,
``update_connector_output``, ...) and vLLM's part of ``schedule()``.

``peer``: vLLM's in-tree ``MooncakeStoreConnector`` in both lookup modes (``lookup_async`` false and true) and,
on vLLM 0.34, asynchronous with lookup prefetch on (``lookup_prefetch_limit``, ``PEER_PREFETCH_LIMIT``), on
the same geometry (it supports MLA + Mamba align with DCP), the same stream and a real ``mooncake_master``
(:mod:`hybridkv.bench.scheduler_peer`: its worker of rank 0 serves the lookups from a child process, and the
stream's stored prefixes are planted under its own keys), interleaved with the other configurations; hybridkv
on the same Mooncake deployment is its like-for-like row.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import re
import statistics
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.bench.report import target_row
from hybridkv.bench.scheduler_peer import (
    PEER_CONNECTOR,
    PeerLookupServer,
    close_peer_client,
    peer_hits_and_loads,
    peer_lookup_server,
    peer_report_saves_done,
    peer_unavailable_reason,
)
from hybridkv.devkit.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model

__all__ = [
    "HOOK_COLUMNS",
    "K3_BLOCK",
    "K3_DCP",
    "PEER_CONNECTOR",
    "SCHEDULER_COLUMNS",
    "PeerSpec",
    "hook_rows",
    "k3_configs",
    "k3_request",
    "peer_lookup_server",
    "peer_unavailable_reason",
    "run_scheduler_bench",
    "saved_entries",
]

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
    "num_idle_steps",
    "idle_schedule_p99_ms",
    "idle_p99_ratio",
    "idle_p99_ratio_spread",
    "connector_p99_ms",
    "connector_p99_ms_spread",
    "vllm_p99_ms",
    "wall_s",
    "lookups_per_s",
    "round_trips_p50",
    "round_trips_max",
    "keys_p50",
    "keys_max",
    "hit_tokens",
    "full_scan_hit_tokens",
    "lookup_errors",
]

#: the columns of the connector hook breakdown (``hook_rows``): medians over rounds
#: How a row measured with ``lookup_process: true`` is named after its store.
LOOKUP_PROCESS_SUFFIX = " [lookup process]"
HOOK_COLUMNS = ["store", "hook", "calls", "total_ms", "p99_ms", "max_ms", "cpu_p99_ms"]

K3_BLOCK = 64
K3_DCP = 8
_MAX_MODEL_LEN = 131072 + 1024
_CHUNK = 8192  # saved Mamba states: one per prefill chunk end
_PUT_BATCH = 512  # keys per put while filling the store (a remote store's deadline bounds one call)
#: the peer's ``lookup_prefetch_limit`` in its prefetch mode: every request of a default stream at once
PEER_PREFETCH_LIMIT = 64


def peer_modes() -> list[tuple[str, bool, int]]:
    """The peer's modes on the installed vLLM: (name, ``lookup_async``, ``lookup_prefetch_limit``). Lookup
    prefetch came with vLLM 0.34."""
    from hybridkv.connector.vllm_compat import vllm_release

    modes = [("sync", False, 0), ("async", True, 0)]
    if vllm_release() >= (0, 34):
        modes.append(("async+prefetch", True, PEER_PREFETCH_LIMIT))
    return modes


def k3_configs(
    store_url: str | None, models_dir: Path, *, num_blocks: int = 8192, transfer: Any = None
) -> tuple[Any, Any]:
    """(VllmConfig, scheduler KVCacheConfig): MLA block 64 x DCP 8 + Mamba align block 64, TP 8.

    ``store_url``: hybridkv's connector on that store; None: no connector, or ``transfer`` (another
    connector's ``KVTransferConfig``, e.g. the peer's). Everything else is vLLM's default
    (``lookup_budget_ms`` too).
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


def k3_scheduler(
    store_url: str | None, models_dir: Path, *, transfer: Any = None, extra: Mapping[str, Any] | None = None
) -> Any:
    """vLLM's real ``Scheduler`` over ``k3_configs`` (no workers); ``extra``: more of hybridkv's
    ``kv_connector_extra_config``."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc, cfg = k3_configs(store_url, models_dir, transfer=transfer)
    if extra and store_url is not None:
        vc.kv_transfer_config.kv_connector_extra_config.update(extra)
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


def saved_entries(num_tokens: int, unit: int, span: int) -> list[tuple[int, int]]:
    """(KV-cache group, boundary in tokens) of what a previous request of ``num_tokens`` tokens saved: group 0
    (MLA) at every ``span`` end, group 1 (Mamba) at every chunk end and at its last hash unit."""
    entries = [(0, b) for b in range(span, num_tokens + 1, span)]
    states = sorted({*range(_CHUNK, num_tokens + 1, _CHUNK), num_tokens - num_tokens % unit})
    return entries + [(1, b) for b in states if b > 0]


def store_prefix(scheme: Any, store: Any, block_hashes: Sequence[bytes], num_tokens: int) -> int:
    """Write what a previous request of ``num_tokens`` tokens saved (``saved_entries``) on every rank.
    Returns the number of keys written."""
    geometry = scheme.geometry
    ranks = [r.tp_rank for r in geometry.topology.ranks]
    entries = saved_entries(num_tokens, geometry.hash_unit, geometry.spans[0])
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


@dataclass(frozen=True)
class PeerSpec:
    """The peer's part of a run: its started worker (lookup server), and the hybridkv store URL on the same
    Mooncake deployment (hybridkv's like-for-like row; it must be one of the bench's store URLs)."""

    server: PeerLookupServer
    store_url: str
    where: str
    """how the table names the deployment, e.g. ``master +2.5 ms each way``"""


@dataclass(frozen=True)
class _Config:
    label: str
    kind: str  # "none", "hybridkv" or "peer"
    url: str | None = None
    lookup_async: bool = False
    #: the peer's ``lookup_prefetch_limit`` (vLLM 0.34; 0: off)
    prefetch_limit: int = 0
    #: hybridkv with ``lookup_process: true``
    lookup_process: bool = False


@dataclass(frozen=True)
class _Settings:
    """What every run of a bench shares: the stream, its stored prefixes, the pacing."""

    stream: list[tuple[int, int, bool]]
    prefixes: dict[int, float]
    models_dir: Path
    per_step: int
    forward_s: float
    idle_steps: int


def _drive(config: _Config, settings: _Settings, peer: PeerLookupServer | None) -> dict[str, Any]:
    """One run of ``config``: fill the store with the stream's stored prefixes, serve the stream (and the
    idle steps after it), and return the run's row."""
    import gc

    from vllm.utils.gc_utils import freeze_gc_heap

    is_peer = config.kind == "peer"
    transfer = None
    if is_peer:
        assert peer is not None
        transfer = peer.transfer_config(
            lookup_async=config.lookup_async, prefetch_limit=config.prefetch_limit
        )
    sched = k3_scheduler(
        config.url,
        settings.models_dir,
        transfer=transfer,
        extra={"lookup_process": True} if config.lookup_process else None,
    )
    side = sched.connector.scheduler_side if config.kind == "hybridkv" else None
    if side is not None:
        assert side.lookups.wait_ready(60.0), f"{config.label}: the lookup process did not start"
    stream = settings.stream
    requests = [k3_request(f"r{i}-{uuid.uuid4().hex[:4]}", fam, n) for i, (fam, n, _) in enumerate(stream)]
    stored = [
        (req, int(n * settings.prefixes.get(fam, 0.75)))
        for req, (fam, n, hit) in zip(requests, stream, strict=True)
        if hit
    ]
    extra: dict[str, Any] = {}
    if side is not None:
        extra = _fill_hybridkv(config, side, requests, stored)
    elif is_peer:
        assert peer is not None
        span = K3_BLOCK * K3_DCP
        extra["planted_keys"] = peer.plant(
            [(req.block_hashes, saved_entries(num_tokens, K3_BLOCK, span)) for req, num_tokens in stored]
        )
        peer.take_lookups()  # only this run's lookups count
    # vLLM's EngineCore freezes its start-up heap (``freeze_gc_heap``) so that collections while serving
    # do not walk it. Without the freeze, one collection here walks every object of the imported vLLM
    # (tens of ms) and the p99 of either configuration measures when the collector happened to run.
    clock = _ConnectorClock(sched.connector) if sched.connector is not None else None
    freeze_gc_heap()
    try:
        steps, hit_tokens, wall_s = _serve(sched, requests, settings, clock, config.kind)
    finally:
        gc.unfreeze()
    row = _run_row(config, steps, wall_s, len(requests))
    if clock is not None:
        row["hit_tokens"] = hit_tokens
        row["hooks"] = clock.breakdown()
        row.update(extra)
    if side is not None:
        row.update(_hybridkv_lookups(side, wall_s))
    if is_peer:
        assert peer is not None
        close_peer_client(sched.connector)
        row.update(_peer_lookups(peer.take_lookups(), wall_s))
    sched.shutdown()
    return row


def _fill_hybridkv(
    config: _Config, side: Any, requests: Sequence[Any], stored: Sequence[tuple[Any, int]]
) -> dict[str, Any]:
    """Store the stream's stored prefixes under hybridkv's keys; the full scan's hit tokens over them."""
    from hybridkv.store import open_store

    assert config.url is not None
    inner = open_store(_filler_url(config.url))
    try:
        planted = sum(store_prefix(side.scheme, inner, req.block_hashes, n) for req, n in stored)
        expected = sum(full_scan_hit(side.scheme, inner, req) for req in requests)
    finally:
        inner.close()
    return {"planted_keys": planted, "full_scan_hit_tokens": expected}


def _serve(
    sched: Any, requests: Sequence[Any], settings: _Settings, clock: _ConnectorClock | None, kind: str
) -> tuple[list[_Step], int, float]:
    """Add ``per_step`` requests a step and time every ``schedule()`` until the stream drained, then
    ``idle_steps`` more; scheduled requests and loads are finished at once. (steps, hit tokens, wall s)"""
    from vllm.v1.request import RequestStatus

    connector = sched.connector
    num_workers = sched.vllm_config.parallel_config.world_size
    steps: list[_Step] = []
    hit_tokens = 0
    pending = list(requests)

    def step() -> None:
        nonlocal pending, hit_tokens
        if clock is not None:
            clock.reset()
        for req in pending[: settings.per_step]:
            sched.add_request(req)
        pending = pending[settings.per_step :]
        before_own, before_wait = (clock.own_s, clock.wait_s) if clock is not None else (0.0, 0.0)
        t0 = time.perf_counter()
        out = sched.schedule()
        record = _Step(time.perf_counter() - t0, out.total_num_scheduled_tokens > 0)
        if clock is not None:
            record.in_schedule_s = clock.own_s - before_own
            record.in_schedule_wait_s = clock.wait_s - before_wait
        done = set(out.num_scheduled_tokens)
        meta = out.kv_connector_metadata
        if meta is not None and kind == "hybridkv":
            for load in meta.loads:
                hit_tokens += load.boundary
                done.add(load.req_id)
        elif meta is not None and kind == "peer":
            found, loads = peer_hits_and_loads(meta)
            hit_tokens += found
            done |= loads
        if done:
            sched.finish_requests(done, RequestStatus.FINISHED_ABORTED)
        if meta is not None and kind == "peer":
            peer_report_saves_done(connector, meta, num_workers)
        if clock is not None:
            record.connector_s, record.wait_s = clock.own_s, clock.wait_s
        steps.append(record)
        time.sleep(settings.forward_s)  # the forward pass this bench leaves out

    started = time.monotonic()
    while pending or sched.waiting or sched.running:
        step()
        assert time.monotonic() - started < 600, "the scheduler stopped making progress"
    for _ in range(settings.idle_steps):  # the engine idle: nothing queued
        step()
    return steps, hit_tokens, time.monotonic() - started


def _run_row(config: _Config, steps: Sequence[_Step], wall_s: float, num_requests: int) -> dict[str, Any]:
    """The step times of one run: all, busy and idle steps, and the connector's split."""
    busy = [s for s in steps if s.busy]
    idle = [s for s in steps if not s.busy]
    row: dict[str, Any] = {
        "store": config.label,
        "connector": config.kind,
        "store_url": config.url,
        "num_requests": num_requests,
        "num_steps": len(steps),
        "schedule_p50_ms": _ms(statistics.median, steps, _Step.total),
        "schedule_p99_ms": _ms(_p99, steps, _Step.total),
        "schedule_max_ms": _ms(max, steps, _Step.total),
        "num_busy_steps": len(busy),
        "busy_schedule_p50_ms": _ms(statistics.median, busy, _Step.total),
        "busy_schedule_p99_ms": _ms(_p99, busy, _Step.total),
        "num_idle_steps": len(idle),
        "wall_s": wall_s,
    }
    if idle:
        row["idle_schedule_p50_ms"] = _ms(statistics.median, idle, _Step.total)
        row["idle_schedule_p99_ms"] = _ms(_p99, idle, _Step.total)
    if config.kind != "none":
        # The split of a step: the connector's own calls, and vLLM's work around them (which grows with
        # the connector too: a hit's blocks are allocated in one step, a request waiting for its lookup is
        # matched against the local prefix cache again every step). ``busy_connector``: its calls inside
        # the busy steps' schedule(); ``connector``: all its calls of a step (schedule(), and the finish
        # and output hooks after it), every step.
        row["busy_connector_p99_ms"] = _ms(_p99, busy, _Step.in_schedule)
        row["busy_vllm_p99_ms"] = _ms(_p99, busy, _Step.vllm)
        row["connector_p50_ms"] = _ms(statistics.median, steps, _Step.connector)
        row["connector_p99_ms"] = _ms(_p99, steps, _Step.connector)
        row["connector_with_wait_p99_ms"] = _ms(_p99, steps, _Step.connector_with_wait)
        row["vllm_p99_ms"] = _ms(_p99, steps, _Step.vllm)
    return row


def _hybridkv_lookups(side: Any, wall_s: float) -> dict[str, Any]:
    costs = list(side.lookups.recent_costs)
    trips = [c[0] for c in costs] or [0]
    keys = [c[1] for c in costs] or [0]
    return {
        "lookups_per_s": side.lookups.num_searches / wall_s,
        "round_trips_p50": statistics.median(trips),
        "round_trips_max": max(trips),
        "keys_p50": statistics.median(keys),
        "keys_max": max(keys),
        "store_calls": side.lookups.num_exists_calls,
        "lookup_errors": side.stats.totals.get("lookup_errors", 0),
    }


def _peer_lookups(served: list[dict[str, float]], wall_s: float) -> dict[str, Any]:
    """What the peer's worker did for this run's lookups (one ``batch_is_exist`` each)."""
    lookups = served or [{"keys": 0, "exists_calls": 0, "exists_s": 0.0, "lookup_s": 0.0}]
    return {
        "lookups_per_s": len(served) / wall_s,
        "round_trips_p50": statistics.median(s["exists_calls"] for s in lookups),
        "round_trips_max": max(s["exists_calls"] for s in lookups),
        "keys_p50": statistics.median(s["keys"] for s in lookups),
        "keys_max": max(s["keys"] for s in lookups),
        "store_calls": sum(s["exists_calls"] for s in lookups),
        "peer_lookups": len(served),
        "peer_lookup_p50_ms": statistics.median(s["lookup_s"] for s in lookups) * 1e3,
        "peer_lookup_max_ms": max(s["lookup_s"] for s in lookups) * 1e3,
        "peer_exists_p50_ms": statistics.median(s["exists_s"] for s in lookups) * 1e3,
        "peer_exists_max_ms": max(s["exists_s"] for s in lookups) * 1e3,
    }


@dataclass
class _Step:
    """One step: ``schedule()``'s wall time, whether it scheduled tokens, and the connector's share."""

    total_s: float
    busy: bool
    in_schedule_s: float = 0.0  # the connector's own calls inside schedule()
    in_schedule_wait_s: float = 0.0  # its idle-step wait inside schedule() (hybridkv)
    connector_s: float = 0.0  # all its own calls of the step (schedule(), finish, output)
    wait_s: float = 0.0

    def total(self) -> float:
        return self.total_s

    def in_schedule(self) -> float:
        return self.in_schedule_s

    def vllm(self) -> float:
        return self.total_s - self.in_schedule_s - self.in_schedule_wait_s

    def connector(self) -> float:
        return self.connector_s

    def connector_with_wait(self) -> float:
        return self.connector_s + self.wait_s


def _p99(samples: Sequence[float]) -> float:
    return _percentile(samples, 0.99)


def _ms(
    stat: Callable[[list[float]], float], steps: Sequence[_Step], value: Callable[[_Step], float]
) -> float:
    return stat([value(s) for s in steps]) * 1e3


class _ConnectorClock:
    """Times the connector's scheduler-side calls of one step (``own_s``, ``wait_s``; ``reset`` by the caller).

    Every hook vLLM's scheduler calls on the connector object (``HOOKS``, those it has), timed at the outermost
    call only (a hook calling another, e.g. ``request_finished`` -> ``request_finished_all_groups``, counts
    once). hybridkv's wait of a step that scheduled nothing (``LookupService.wait_for_progress``) is counted
    apart (``wait_s``) and left out of ``own_s``: it is the connector handing the interpreter to its lookup
    thread, not work on the step's path. ``calls``: per hook, (wall s, this thread's CPU s) of every call
    (the wait left out of both), for the breakdown: wall well above CPU is the scheduler thread waiting (for
    the GIL, a lock or a reply)."""

    HOOKS = (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",
        "request_finished_all_groups",
        "register_finished_partial_tail",
        "update_connector_output",
        "has_pending_block_frees",
        "has_pending_push_work",
        "get_loaded_kv_cache_group_ids",
        "get_external_cache_hit_sources",
        "on_new_request",
    )

    def __init__(self, connector: Any) -> None:
        self.own_s = 0.0
        self.wait_s = 0.0
        self.calls: dict[str, list[tuple[float, float]]] = {}
        self._depth = 0
        self._waited_in_call_s = 0.0
        for name in self.HOOKS:
            if callable(getattr(connector, name, None)):
                setattr(connector, name, self._timed_hook(name, getattr(connector, name)))
        side = getattr(connector, "scheduler_side", None)
        if side is not None:
            side.lookups.wait_for_progress = self._timed_wait(side.lookups.wait_for_progress)

    def reset(self) -> None:
        self.own_s = self.wait_s = 0.0

    def _timed_hook(self, name: str, call: Any) -> Any:
        samples = self.calls.setdefault(name, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return call(*args, **kwargs)  # inside another hook, which is timed
            self._depth = 1
            self._waited_in_call_s = 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                wall = time.perf_counter() - t0 - self._waited_in_call_s
                cpu = time.thread_time() - c0
                self._depth = 0
                self.own_s += wall
                samples.append((wall, cpu))

        return timed

    def _timed_wait(self, call: Any) -> Any:
        samples = self.calls.setdefault("(idle-step wait_for_progress)", [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                waited = time.perf_counter() - t0
                samples.append((waited, time.thread_time() - c0))
                self.wait_s += waited
                self._waited_in_call_s += waited  # inside a hook: not the hook's own time

        return timed

    def breakdown(self) -> dict[str, dict[str, float]]:
        """Per hook called: calls, total ms, p99 / max ms of a call (wall), p99 ms of its thread CPU."""
        return {
            name: {
                "calls": len(samples),
                "total_ms": sum(w for w, _ in samples) * 1e3,
                "p99_ms": _p99([w for w, _ in samples]) * 1e3,
                "max_ms": max(w for w, _ in samples) * 1e3,
                "cpu_p99_ms": _p99([c for _, c in samples]) * 1e3,
            }
            for name, samples in self.calls.items()
            if samples
        }


def _spread(values: Sequence[float]) -> str:
    return f"{min(values):.3g}..{max(values):.3g}"


_TIMES = (
    "schedule_p50_ms",
    "schedule_p99_ms",
    "schedule_max_ms",
    "busy_schedule_p50_ms",
    "busy_schedule_p99_ms",
    "idle_schedule_p50_ms",
    "idle_schedule_p99_ms",
    "busy_connector_p99_ms",
    "busy_vllm_p99_ms",
    "connector_p50_ms",
    "connector_p99_ms",
    "connector_with_wait_p99_ms",
    "vllm_p99_ms",
    "peer_lookup_p50_ms",
    "peer_exists_p50_ms",
)
_RATIOS = (
    ("schedule_p99_ms", "p99_ratio"),
    ("schedule_p50_ms", "p50_ratio"),
    ("busy_schedule_p99_ms", "busy_p99_ratio"),
    ("idle_schedule_p99_ms", "idle_p99_ratio"),
)


def _round_ratios(
    rounds: Sequence[dict[str, Any]], others: Sequence[dict[str, Any]], name: str
) -> list[float]:
    """``name`` of each round over the same round's ``name`` in ``others`` (rounds where both have it)."""
    return [
        r[name] / o[name]
        for r, o in zip(rounds, others, strict=True)
        if r.get(name) is not None and o.get(name)
    ]


def _summarize(
    label: str, rounds: list[dict[str, Any]], base_rounds: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """One table row from the rounds of one configuration: medians over rounds, with the spread.

    Ratios are taken within a round (against the no-connector run of the same round), then the median.
    """
    row: dict[str, Any] = {
        "store": label,
        "connector": rounds[0]["connector"],
        "store_url": rounds[0]["store_url"],
        "num_rounds": len(rounds),
        "num_steps": statistics.median(r["num_steps"] for r in rounds),
        "num_idle_steps": statistics.median(r["num_idle_steps"] for r in rounds),
        "wall_s": statistics.median(r["wall_s"] for r in rounds),
    }
    for name in _TIMES:
        values = [r[name] for r in rounds if name in r]
        if len(values) == len(rounds):  # e.g. the connector split of the no-connector rows: absent
            row[name] = statistics.median(values)
            row[f"{name}_spread"] = _spread(values)
    if base_rounds is None:
        return row
    for name, ratio in _RATIOS:
        ratios = _round_ratios(rounds, base_rounds, name)
        if ratios:
            row[ratio] = statistics.median(ratios)
            row[f"{ratio}_spread"] = _spread(ratios)
    for name in ("lookups_per_s", "round_trips_p50", "keys_p50"):
        row[name] = statistics.median(r[name] for r in rounds)
    for name in ("round_trips_max", "keys_max", "lookup_errors", "peer_lookup_max_ms", "peer_exists_max_ms"):
        if name in rounds[0]:
            row[name] = max(r[name] for r in rounds)
    # Hit tokens must equal the full scan's in every round: the sum shows a miss in any of them.
    row["hit_tokens"] = sum(r["hit_tokens"] for r in rounds)
    if "full_scan_hit_tokens" in rounds[0]:
        row["full_scan_hit_tokens"] = sum(r["full_scan_hit_tokens"] for r in rounds)
    row["planted_keys"] = statistics.median(r["planted_keys"] for r in rounds)
    row["hooks"] = _summarize_hooks(rounds)
    return row


def _summarize_hooks(rounds: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per hook, the median over rounds of each of its numbers (rounds that called it)."""
    names = sorted({name for r in rounds for name in r["hooks"]})
    out: dict[str, dict[str, float]] = {}
    for name in names:
        runs = [r["hooks"][name] for r in rounds if name in r["hooks"]]
        out[name] = {stat: statistics.median(run[stat] for run in runs) for stat in runs[0]}
    return out


def hook_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The connector rows' hook breakdown as table rows (``HOOK_COLUMNS``), heaviest hooks first."""
    return [
        {"store": row["store"], "hook": name, **hooks[name]}
        for row in rows
        for hooks in [row.get("hooks", {})]
        for name in sorted(hooks, key=lambda n: -hooks[n]["p99_ms"])
    ]


#: The issue's targets for a lookup at production geometry (``scheduler_targets``).
P99_RATIO_TARGET = 1.2
MAX_ROUND_TRIPS_TARGET = 4
IDLE_P99_RATIO_TARGET = 1.5
#: hybridkv's connector time on the scheduler thread (per step, p99) against the peer's, same store.
PEER_SYNC_RATIO_TARGET = 0.25
PEER_ASYNC_RATIO_TARGET = 1.0


def scheduler_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per hybridkv row: ``schedule()`` p99 against the no-connector run (busy steps, and all steps) at most
    ``P99_RATIO_TARGET``, idle steps at most ``IDLE_P99_RATIO_TARGET``; exactly the synchronous full scan's
    hit tokens; at most ``MAX_ROUND_TRIPS_TARGET`` store round trips per lookup. For the hybridkv row on the
    peer's store (``connector_p99_over_peer_*``): the connector's own scheduler-thread time per step (p99)
    at most ``PEER_SYNC_RATIO_TARGET`` of the peer's in its synchronous mode, below its asynchronous mode's."""
    out = []
    for row in rows:
        if row["connector"] != "hybridkv":
            continue
        store = row["store"]
        full = row["full_scan_hit_tokens"]
        out += [
            target_row(
                f"{store}: busy schedule() p99 / no connector", row["busy_p99_ratio"], "<=", P99_RATIO_TARGET
            ),
            target_row(f"{store}: schedule() p99 / no connector", row["p99_ratio"], "<=", P99_RATIO_TARGET),
            target_row(
                f"{store}: idle-step schedule() p99 / no connector",
                row.get("idle_p99_ratio"),
                "<=",
                IDLE_P99_RATIO_TARGET,
            ),
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
        for mode, limit in (("sync", PEER_SYNC_RATIO_TARGET), ("async", PEER_ASYNC_RATIO_TARGET)):
            if f"connector_p99_over_peer_{mode}" in row:
                out.append(
                    target_row(
                        f"{store}: connector scheduler-thread p99 / {PEER_CONNECTOR} {mode}'s",
                        row[f"connector_p99_over_peer_{mode}"],
                        "<=",
                        limit,
                    )
                )
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
    idle_steps: int = 64,
    peer: PeerSpec | None = None,
    lookup_process_urls: Sequence[str] = (),
    models_dir: Path = DEFAULT_MODELS_DIR,
    seed: int = 0,
) -> dict[str, Any]:
    """Per round: one run without the connector, one per store URL and (``peer``) one per lookup mode of
    vLLM's ``MooncakeStoreConnector``, in a rotating order (so a noisy moment hits every configuration alike);
    rows give medians over rounds with their spread, and ratios against the no-connector run of the same
    round (the peer comparison: against the peer's run of the same round). ``forward_ms``: the pause between
    ``schedule()`` calls standing in for the forward pass (short = the connector is asked again most often).
    ``idle_steps``: ``schedule()`` calls after the stream drained (idle steps every configuration has).
    ``labels``: table names for some URLs (e.g. a store behind a delay proxy on a random port).
    ``lookup_process_urls``: store URLs (of ``store_urls``) measured once more with ``lookup_process: true``
    (the row's name ends in ``LOOKUP_PROCESS_SUFFIX``)."""
    assert num_rounds >= 1, "num_rounds must be >= 1"
    assert idle_steps >= 0, "idle_steps must be >= 0"
    names = labels or {}
    stream = _stream(num_requests, max_tokens, seed)
    prefixes = {fam: random.Random(seed + fam).choice([0.5, 0.75, 1.0]) for fam, _, _ in stream}
    configs = [_Config("(no connector)", "none")]
    configs += [_Config(names.get(url, url), "hybridkv", url) for url in store_urls]
    configs += [
        _Config(names.get(url, url) + LOOKUP_PROCESS_SUFFIX, "hybridkv", url, lookup_process=True)
        for url in lookup_process_urls
    ]
    if peer is not None:
        assert peer.store_url in store_urls, "the peer's like-for-like hybridkv row must be measured"
        configs += [
            _Config(f"{PEER_CONNECTOR} {mode} ({peer.where})", "peer", None, lookup_async, prefetch)
            for mode, lookup_async, prefetch in peer_modes()
        ]
    settings = _Settings(stream, prefixes, models_dir, per_step, forward_ms / 1e3, idle_steps)
    by_config: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(configs))}
    for round_index in range(num_rounds):
        order = [(round_index + k) % len(configs) for k in range(len(configs))]
        for i in order:
            config = configs[i]
            if config.url is not None and round_index > 0:
                # every round starts from an empty store of the same kind
                config = dataclasses.replace(config, url=_fresh_url(config.url))
            by_config[i].append(_drive(config, settings, peer.server if peer is not None else None))
    base = by_config[0]
    rows = [_summarize(c.label, by_config[i], None if i == 0 else base) for i, c in enumerate(configs)]
    if peer is not None:
        for ours in (i for i, c in enumerate(configs) if c.kind == "hybridkv" and c.url == peer.store_url):
            first_peer = len(configs) - len(peer_modes())
            for index, (mode, _, _) in enumerate(peer_modes(), start=first_peer):
                ratios = _round_ratios(by_config[ours], by_config[index], "connector_p99_ms")
                if ratios:
                    rows[ours][f"connector_p99_over_peer_{mode}"] = statistics.median(ratios)
                    rows[ours][f"connector_p99_over_peer_{mode}_spread"] = _spread(ratios)
    return {
        "targets": scheduler_targets(rows),
        "benchmark": "scheduler",
        "geometry": f"MLA block {K3_BLOCK} x DCP {K3_DCP} + Mamba align block {K3_BLOCK}, hash unit {K3_BLOCK}",
        "num_requests": num_requests,
        "max_prompt_tokens": max_tokens,
        "requests_per_step": per_step,
        "num_rounds": num_rounds,
        "forward_ms": forward_ms,
        "idle_steps": idle_steps,
        "peer": None
        if peer is None
        else {
            "connector": PEER_CONNECTOR,
            "modes": {
                mode: {"lookup_async": lookup_async, "lookup_prefetch_limit": prefetch}
                for mode, lookup_async, prefetch in peer_modes()
            },
            "geometry": "the same (it accepts MLA + Mamba align with DCP 8)",
            "master_address": peer.server.master_address,
            "like_for_like_row": names.get(peer.store_url, peer.store_url),
            "key_prefixes": peer.server.info.get("key_prefixes"),
            "worker_log": str(peer.server.log_path),
        },
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "rows": rows,
        "rounds": {c.label: by_config[i] for i, c in enumerate(configs)},
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
