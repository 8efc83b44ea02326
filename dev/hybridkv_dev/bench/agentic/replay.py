"""The replay of a trace through one store, as the connector would access it (``replay_trace``)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from hybridkv.lifecycle.geometry import Geometry
from hybridkv.lifecycle.keys import KEY_VERSION, KeyScheme
from hybridkv.lifecycle.kinds import GroupSpec
from hybridkv.lifecycle.lookup import LookupSearch
from hybridkv.lifecycle.save import plan_save
from hybridkv.store.base import Destination, Status, Store, Value, find_layer
from hybridkv.store.file import FileBackend
from hybridkv.store.frame import FIXED_HEADER_SIZE

from hybridkv_dev.bench.agentic.stores import SESSION_TTL_S
from hybridkv_dev.bench.agentic.trace import BACKGROUND_TENANT, AgenticTrace, RequestKind, TraceRequest

#: The store groups of the bench geometry.
ATTENTION_GROUP = 0
STATE_GROUP = 1
DEFAULT_ATTENTION_VALUE_BYTES = 16 << 10
DEFAULT_STATE_VALUE_BYTES = 32 << 10
#: ``iter_keys`` once every this many requests, by store scheme (see the module docstring).
DEFAULT_SAMPLE_EVERY = {"memory": 8, "file": 64}
#: Windows of the hit fraction over the trace (the plot, the report's ``windows``).
NUM_WINDOWS = 40
#: The longest a replay waits for a file store's background top-up after a save.
EVICTION_WAIT_S = 60.0


def bench_geometry(block_tokens: int) -> Geometry:
    """Full attention with an entry per block and a Mamba state at hand-off boundaries, both
    ``block_tokens`` wide, TP 1."""
    return Geometry(groups=(GroupSpec.full(block_tokens), GroupSpec.mamba(block_tokens)))


@dataclass(frozen=True)
class ReplayResult:
    """What one replay of a trace through one store counted (see the module docstring)."""

    configuration: str
    seed: int
    url: str
    capacity_bytes: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    agentic_prompt_tokens: int
    agentic_hit_tokens: int
    bytes_read: int
    bytes_written: int
    tenant_to_bytes_written: dict[str, int]
    tenant_to_bytes_evicted: dict[str, int]
    #: per tenant, payload bytes evicted by the background's puts that ended or began with it over its quota
    tenant_to_bytes_evicted_over_quota: dict[str, int]
    #: per tenant, payload bytes evicted by the background's other puts (capacity eviction)
    tenant_to_bytes_evicted_within_quota: dict[str, int]
    #: the background's quota (the store's, or the one it would have); framed bytes
    reference_quota_bytes: int
    #: the most framed bytes the background held right after one of its puts
    quota_tenant_peak_bytes: int
    #: background puts that ended or began with it over its quota
    num_over_quota_puts: int
    num_samples: int
    num_load_failures: int
    num_put_failures: int
    num_exists_calls: int
    seconds: float
    #: hit tokens / prompt tokens per window of requests, in trace order
    window_hit_fractions: list[float]
    #: ``stats().extra["tenants"]`` at the end (stores with quotas)
    store_tenants: dict[str, Any]

    @property
    def hit_fraction(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)

    @property
    def agentic_hit_fraction(self) -> float:
        return self.agentic_hit_tokens / max(1, self.agentic_prompt_tokens)

    @property
    def agentic_bytes_evicted_over_quota(self) -> int:
        """The agentic tenants' bytes evicted by the background's puts while it was over its quota."""
        return sum(v for t, v in self.tenant_to_bytes_evicted_over_quota.items() if t != BACKGROUND_TENANT)


def _present_bytes(store: Store, group_to_value_bytes: Sequence[int]) -> dict[str, int]:
    """Per namespace, the payload bytes of the block keys ``store`` holds now (``hkv1/NS/FP/gG/...``)."""
    namespace_to_bytes: dict[str, int] = {}
    for key in store.iter_keys(f"{KEY_VERSION}/"):
        parts = key.split("/", 4)
        size = group_to_value_bytes[int(parts[3][1:])]
        namespace_to_bytes[parts[1]] = namespace_to_bytes.get(parts[1], 0) + size
    return namespace_to_bytes


def _framed_holdings(store: Store, group_to_value_bytes: Sequence[int]) -> dict[str, tuple[str, int, int]]:
    """Every block key ``store`` holds now: key -> (namespace, framed bytes as the store counts them, payload
    bytes)."""
    holdings: dict[str, tuple[str, int, int]] = {}
    for key in store.iter_keys(f"{KEY_VERSION}/"):
        parts = key.split("/", 4)
        payload = group_to_value_bytes[int(parts[3][1:])]
        holdings[key] = (parts[1], FIXED_HEADER_SIZE + len(key.encode()) + payload, payload)
    return holdings


def window_fractions(hits: Sequence[int], prompts: Sequence[int], num_windows: int) -> list[float]:
    """Hit tokens over prompt tokens in ``num_windows`` consecutive windows of requests."""
    size = max(1, -(-len(prompts) // max(1, num_windows)))
    return [
        sum(hits[start : start + size]) / max(1, sum(prompts[start : start + size]))
        for start in range(0, len(prompts), size)
    ]


class _Replay:
    """The state of one replay: the store, the buffers, and what has been counted so far."""

    def __init__(
        self,
        trace: AgenticTrace,
        store: Store,
        *,
        reference_quota_bytes: int,
        attention_value_bytes: int,
        state_value_bytes: int,
    ) -> None:
        self.store = store
        # A file store evicts down to its low watermark on a thread of its own, woken by puts. The replay runs
        # hours of trace in a fraction of a second, so it lets that top-up finish after each save, as the
        # seconds between real requests do: otherwise it would evict a block between a later lookup that found
        # it and the load of it, and a put's evictions would be counted against the next put.
        backend = find_layer(store, FileBackend)
        self.evictor = None if backend is None else backend.layout.evictor
        self.block_tokens = trace.workload.block_tokens
        self.reference_quota_bytes = reference_quota_bytes
        self.group_to_value_bytes = (attention_value_bytes, state_value_bytes)
        geometry = bench_geometry(self.block_tokens)
        self.tenants = trace.tenants
        self.tenant_to_scheme = {
            tenant: KeyScheme(namespace=tenant, model="hybridkv-bench-agentic", geometry=geometry)
            for tenant in self.tenants
        }
        max_blocks = max((len(r.block_hashes) for r in trace.requests), default=0)
        # Destinations: a row per block a load may fetch, and one state (a hit loads one state).
        self.attention_rows = np.zeros((max(1, max_blocks), attention_value_bytes), dtype=np.uint8)
        self.state_row = np.zeros(state_value_bytes, dtype=np.uint8)
        self.group_to_value: tuple[Value, Value] = (
            cast(Value, np.full(attention_value_bytes, 0xA5, dtype=np.uint8)),
            cast(Value, np.full(state_value_bytes, 0x5A, dtype=np.uint8)),
        )
        self.tenant_to_written = dict.fromkeys(self.tenants, 0)
        self.tenant_to_evicted = dict.fromkeys(self.tenants, 0)
        #: the tenants whose puts are watched for evicting others (see the module docstring), with the quota
        self.tenant_to_quota = {BACKGROUND_TENANT: reference_quota_bytes} if reference_quota_bytes > 0 else {}
        self.tenant_to_evicted_over_quota = dict.fromkeys(self.tenants, 0)
        self.tenant_to_evicted_within_quota = dict.fromkeys(self.tenants, 0)
        self.quota_tenant_peak_bytes = 0
        self.num_over_quota_puts = 0
        self.num_samples = 0
        self.num_load_failures = 0
        self.num_put_failures = 0
        self.num_exists_calls = 0
        self.bytes_read = 0

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """The lookup's existence check: one batched ``exists``."""
        self.num_exists_calls += 1
        return [status is Status.OK for status in self.store.exists(keys)]

    def lookup_and_load(self, request: TraceRequest) -> int:
        """The connector's lookup of ``request`` and the load of its hit; the hit tokens (0 if the load
        failed: vLLM then recomputes the request from 0)."""
        scheme = self.tenant_to_scheme[request.tenant]
        result = LookupSearch(scheme, request.block_hashes, request.num_prompt_tokens, 0).run(self.exists)
        if result.plan is None or not result.plan.loads:
            return 0
        entries = result.plan.entries
        destinations: list[Destination] = []
        num_attention = 0
        for entry, _key in entries:
            if entry.group_index == ATTENTION_GROUP:
                destinations.append(cast(Destination, self.attention_rows[num_attention]))
                num_attention += 1
            else:
                destinations.append(cast(Destination, self.state_row))
        statuses = self.store.get_into([key for _, key in entries], destinations)
        if not all(status is Status.OK for status in statuses):
            self.num_load_failures += 1
            return 0
        self.bytes_read += sum(self.group_to_value_bytes[entry.group_index] for entry, _ in entries)
        return result.boundary

    def save(self, request: TraceRequest, hit: int) -> None:
        """The connector's save of ``request``: every whole prompt block past ``hit``, and the Mamba state at
        the last whole block (unless the hit reached it)."""
        block_tokens = self.block_tokens
        num_blocks = len(request.block_hashes)
        plan = plan_save(
            self.tenant_to_scheme[request.tenant],
            request.block_hashes,
            {
                ATTENTION_GROUP: [(i + 1) * block_tokens for i in range(hit // block_tokens, num_blocks)],
                STATE_GROUP: [num_blocks * block_tokens] if num_blocks * block_tokens > hit else [],
            },
        )
        if not plan.entries:
            return
        keys = [key for _, key in plan.entries]
        quota = self.tenant_to_quota.get(request.tenant)
        holdings = None if quota is None else _framed_holdings(self.store, self.group_to_value_bytes)
        before = self.store.exists(keys)  # bookkeeping: which of them the put really writes
        statuses = self.store.put(keys, [self.group_to_value[entry.group_index] for entry, _ in plan.entries])
        if self.evictor is not None:
            assert self.evictor.wait_idle(EVICTION_WAIT_S), f"{self.store.url}: the top-up did not finish"
        if holdings is not None and quota is not None:
            self.account_evictions_by(request.tenant, quota, holdings)
        for (entry, _key), was, status in zip(plan.entries, before, statuses, strict=True):
            if status is not Status.OK:
                self.num_put_failures += 1
            elif was is Status.NOT_FOUND:
                self.tenant_to_written[request.tenant] += self.group_to_value_bytes[entry.group_index]

    def account_evictions_by(
        self, tenant: str, quota: int, holdings: Mapping[str, tuple[str, int, int]]
    ) -> None:
        """Count what the put of ``tenant`` just made evicted of the other tenants: the keys of ``holdings``
        (what the store held before it) that are gone now; over its quota if it held more than ``quota``
        framed bytes before or after the put."""
        after = _framed_holdings(self.store, self.group_to_value_bytes)
        held_before = sum(framed for owner, framed, _ in holdings.values() if owner == tenant)
        held_after = sum(framed for owner, framed, _ in after.values() if owner == tenant)
        self.quota_tenant_peak_bytes = max(self.quota_tenant_peak_bytes, held_after)
        over = max(held_before, held_after) > quota
        self.num_over_quota_puts += over
        counts = self.tenant_to_evicted_over_quota if over else self.tenant_to_evicted_within_quota
        for key, (owner, _framed, payload) in holdings.items():
            if owner != tenant and key not in after:
                counts[owner] = counts.get(owner, 0) + payload

    def retain_prompt(self, request: TraceRequest, *, release: bool) -> None:
        """The session's retention of ``request``'s prompt: every whole block and the state at its end, for
        ``SESSION_TTL_S`` (``release``: the session is over, its entries become ordinary ones)."""
        scheme = self.tenant_to_scheme[request.tenant]
        hashes = request.block_hashes
        if not hashes:
            return
        keys = [scheme.key(ATTENTION_GROUP, 0, block_hash) for block_hash in hashes]
        keys.append(scheme.key(STATE_GROUP, 0, hashes[-1]))
        self.store.retain(keys, 0.0 if release else time.time() + SESSION_TTL_S)

    def sample(self) -> None:
        """Read what each tenant still holds: its evicted bytes are what it wrote less that."""
        present = _present_bytes(self.store, self.group_to_value_bytes)
        for tenant in self.tenants:
            self.tenant_to_evicted[tenant] = self.tenant_to_written[tenant] - present.get(tenant, 0)
        self.num_samples += 1


def replay_trace(
    trace: AgenticTrace,
    store: Store,
    *,
    configuration: str = "",
    capacity_bytes: int = 0,
    reference_quota_bytes: int = 0,
    attention_value_bytes: int = DEFAULT_ATTENTION_VALUE_BYTES,
    state_value_bytes: int = DEFAULT_STATE_VALUE_BYTES,
    sample_every: int = 1,
    sessions: bool = False,
) -> ReplayResult:
    """Replay ``trace`` through ``store`` (empty, used by nothing else meanwhile) as the connector would: per
    request a lookup, a load of the hit and a save of the rest (see the module docstring).

    ``reference_quota_bytes``: the background tenant's quota (for a store without quotas: the quota it is
    compared against), framed bytes, for the bytes its puts evict of the others while it is over it (0: not
    watched); ``capacity_bytes`` is only reported.
    ``sample_every``: requests between two presence samples (``iter_keys``), at least 1. ``sessions``: each
    agentic request retains its prompt after its save, a chain's last request releases it.
    """
    assert sample_every >= 1, sample_every
    replay = _Replay(
        trace,
        store,
        reference_quota_bytes=reference_quota_bytes,
        attention_value_bytes=attention_value_bytes,
        state_value_bytes=state_value_bytes,
    )
    hits: list[int] = []
    prompts: list[int] = []
    start = time.perf_counter()
    chain_to_last = {request.chain: request.index for request in trace.requests}
    for position, request in enumerate(trace.requests, start=1):
        hit = replay.lookup_and_load(request)
        replay.save(request, hit)
        if sessions and request.kind is not RequestKind.ONE_OFF:
            replay.retain_prompt(request, release=chain_to_last[request.chain] == request.index)
        hits.append(hit)
        prompts.append(request.num_prompt_tokens)
        if position % sample_every == 0:
            replay.sample()
    if len(trace.requests) % sample_every:
        replay.sample()
    seconds = time.perf_counter() - start
    agentic = [i for i, r in enumerate(trace.requests) if r.tenant != BACKGROUND_TENANT]
    tenant_stats = store.stats().extra.get("tenants", {})
    return ReplayResult(
        configuration=configuration,
        seed=trace.seed,
        url=store.url,
        capacity_bytes=capacity_bytes,
        num_requests=len(trace.requests),
        prompt_tokens=sum(prompts),
        hit_tokens=sum(hits),
        agentic_prompt_tokens=sum(prompts[i] for i in agentic),
        agentic_hit_tokens=sum(hits[i] for i in agentic),
        bytes_read=replay.bytes_read,
        bytes_written=sum(replay.tenant_to_written.values()),
        tenant_to_bytes_written=replay.tenant_to_written,
        tenant_to_bytes_evicted=replay.tenant_to_evicted,
        tenant_to_bytes_evicted_over_quota=replay.tenant_to_evicted_over_quota,
        tenant_to_bytes_evicted_within_quota=replay.tenant_to_evicted_within_quota,
        reference_quota_bytes=reference_quota_bytes,
        quota_tenant_peak_bytes=replay.quota_tenant_peak_bytes,
        num_over_quota_puts=replay.num_over_quota_puts,
        num_samples=replay.num_samples,
        num_load_failures=replay.num_load_failures,
        num_put_failures=replay.num_put_failures,
        num_exists_calls=replay.num_exists_calls,
        seconds=seconds,
        window_hit_fractions=window_fractions(hits, prompts, NUM_WINDOWS),
        store_tenants=dict(tenant_stats) if isinstance(tenant_stats, dict) else {},
    )
