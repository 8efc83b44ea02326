"""One run of the scheduler bench: a configuration (no connector, hybridkv on a store URL, the peer) driven
through vLLM's real ``Scheduler``."""

from __future__ import annotations

import random
import re
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv_dev.bench.scheduler.clock import ConnectorClock, Step, ms_of, percentile_99
from hybridkv_dev.bench.scheduler.k3 import (
    K3_BLOCK,
    K3_DCP,
    full_scan_hit,
    k3_request,
    k3_scheduler,
    saved_entries,
    store_prefix,
)
from hybridkv_dev.bench.scheduler_peer import (
    PeerLookupServer,
    close_peer_client,
    peer_hits_and_loads,
    peer_report_saves_done,
)


def request_stream(num_requests: int, max_tokens: int, seed: int) -> list[tuple[int, int, bool]]:
    """(family, prompt tokens, hit?) per request: half hit a stored prefix, half miss; long prompts."""
    rng = random.Random(seed)
    sizes = [max_tokens, max_tokens // 4] + [
        rng.randrange(max_tokens // 16, max_tokens + 1) for _ in range(num_requests)
    ]
    return [(i, max(K3_BLOCK * 8, sizes[i] - sizes[i] % K3_BLOCK), i % 2 == 0) for i in range(num_requests)]


@dataclass(frozen=True)
class PeerSpec:
    """The peer's part of a run: its started worker (lookup server), and the hybridkv store URL on the same
    Mooncake deployment (hybridkv's like-for-like row; it must be one of the bench's store URLs)."""

    server: PeerLookupServer
    store_url: str
    where: str
    """how the table names the deployment, e.g. ``master +2.5 ms each way``"""


@dataclass(frozen=True)
class RunConfig:
    label: str
    kind: str  # "none", "hybridkv" or "peer"
    url: str | None = None
    lookup_async: bool = False
    #: the peer's ``lookup_prefetch_limit`` (vLLM 0.34; 0: off)
    prefetch_limit: int = 0
    #: hybridkv with ``lookup_process: true``
    lookup_process: bool = False


@dataclass(frozen=True)
class RunSettings:
    """What every run of a bench shares: the stream, its stored prefixes, the pacing."""

    stream: list[tuple[int, int, bool]]
    prefixes: dict[int, float]
    models_dir: Path
    per_step: int
    forward_s: float
    idle_steps: int


def drive_config(config: RunConfig, settings: RunSettings, peer: PeerLookupServer | None) -> dict[str, Any]:
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
    clock = ConnectorClock(sched.connector) if sched.connector is not None else None
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
    config: RunConfig, side: Any, requests: Sequence[Any], stored: Sequence[tuple[Any, int]]
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
    sched: Any, requests: Sequence[Any], settings: RunSettings, clock: ConnectorClock | None, kind: str
) -> tuple[list[Step], int, float]:
    """Add ``per_step`` requests a step and time every ``schedule()`` until the stream drained, then
    ``idle_steps`` more; scheduled requests and loads are finished at once. (steps, hit tokens, wall s)"""
    from vllm.v1.request import RequestStatus

    connector = sched.connector
    num_workers = sched.vllm_config.parallel_config.world_size
    steps: list[Step] = []
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
        record = Step(time.perf_counter() - t0, out.total_num_scheduled_tokens > 0)
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


def _run_row(config: RunConfig, steps: Sequence[Step], wall_s: float, num_requests: int) -> dict[str, Any]:
    """The step times of one run: all, busy and idle steps, and the connector's split."""
    busy = [s for s in steps if s.busy]
    idle = [s for s in steps if not s.busy]
    row: dict[str, Any] = {
        "store": config.label,
        "connector": config.kind,
        "store_url": config.url,
        "num_requests": num_requests,
        "num_steps": len(steps),
        "schedule_p50_ms": ms_of(statistics.median, steps, Step.total),
        "schedule_p99_ms": ms_of(percentile_99, steps, Step.total),
        "schedule_max_ms": ms_of(max, steps, Step.total),
        "num_busy_steps": len(busy),
        "busy_schedule_p50_ms": ms_of(statistics.median, busy, Step.total),
        "busy_schedule_p99_ms": ms_of(percentile_99, busy, Step.total),
        "num_idle_steps": len(idle),
        "wall_s": wall_s,
    }
    if idle:
        row["idle_schedule_p50_ms"] = ms_of(statistics.median, idle, Step.total)
        row["idle_schedule_p99_ms"] = ms_of(percentile_99, idle, Step.total)
    if config.kind != "none":
        # The split of a step: the connector's own calls, and vLLM's work around them (which grows with
        # the connector too: a hit's blocks are allocated in one step, a request waiting for its lookup is
        # matched against the local prefix cache again every step). ``busy_connector``: its calls inside
        # the busy steps' schedule(); ``connector``: all its calls of a step (schedule(), and the finish
        # and output hooks after it), every step.
        row["busy_connector_p99_ms"] = ms_of(percentile_99, busy, Step.in_schedule)
        row["busy_vllm_p99_ms"] = ms_of(percentile_99, busy, Step.vllm)
        row["connector_p50_ms"] = ms_of(statistics.median, steps, Step.connector)
        row["connector_p99_ms"] = ms_of(percentile_99, steps, Step.connector)
        row["connector_with_wait_p99_ms"] = ms_of(percentile_99, steps, Step.connector_with_wait)
        row["vllm_p99_ms"] = ms_of(percentile_99, steps, Step.vllm)
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


def _filler_url(url: str) -> str:
    """The store behind ``url`` without injected faults, and with a long deadline: what fills the store
    before a run (what a previous request saved) is not what the run measures."""
    if url.startswith("faulty+"):
        url = url.split("+", 1)[1].split("?", 1)[0]
    if url.startswith("mooncake://"):
        url = re.sub(r"([?&])timeout_ms=\d+", r"\1timeout_ms=60000", url)
    return url


def fresh_url(url: str) -> str:
    """The same store URL with a new ``memory://`` name (other stores are shared: their keys of earlier
    rounds only add hits the full scan also sees)."""
    marker = "memory://"
    if marker not in url:
        return url
    head, rest = url.split(marker, 1)
    name, sep, tail = rest.partition("?")
    return f"{head}{marker}{name}-{uuid.uuid4().hex[:4]}{sep}{tail}"
