"""Connector counters, carried through vLLM's ``KVConnectorStats`` (rebuildable from a plain dict).

All counter values are counts since the previous collection; ``aggregate`` sums them (scheduler + every
worker). The names are data: ``PROM_COUNTERS`` (counters), ``GAUGES`` (states and what the connector holds
now), the per-store-group counter ``loaded_blocks.g<N>`` (``PER_GROUP_LOADED_BLOCKS``) and the per-tenant
series ``<name>.<tenant>`` (``PER_TENANT_COUNTERS``, ``PER_TENANT_GAUGES``; ``hybridkv.connector.worker.tenant_metrics``
says which tenants). ``add`` refuses any other name, so these tables are the whole vocabulary
(``docs/metrics.md`` lists them).

Gauges come in two kinds. The scheduler's (``breaker_open``, ``tracked_requests``, ``pinned_blocks``,
``audit_queued_records``) are sent whenever their value changed, and the latest report wins. The workers'
(``PER_RANK_GAUGES``: ``save_inflight_bytes``, ``staging_bytes_out``, ``late_calls_pending``) are sent by every
rank with each step's stats, and ``aggregate`` keeps the largest: the busiest rank's value in ``/metrics``, the
peak of the interval in vLLM's periodic log line. Both refresh at engine steps: an idle engine shows the
values of its last step. The per-tenant gauges (``tenant_usage_bytes.<tenant>``) are workers' gauges too.

Prometheus (``build_prom``; ``docs/metrics.md``): each counter as ``vllm:hybridkv_<name>_total``, the per-group
``loaded_blocks.g<N>`` as ``vllm:hybridkv_group_loaded_blocks_total{group="N"}``, each gauge as
``vllm:hybridkv_<name>``, the per-tenant series with a ``tenant`` label (the evictions with a ``reason``
too); all with vLLM's per-engine labels.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridkv.key_grammar import NAMESPACE_RE
from hybridkv.store.base import find_layer
from hybridkv.store.faulty import FaultyBackend
from hybridkv.store.quotas import OTHER_TENANTS
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        PromMetric,
        PromMetricT,
    )


def is_stat_name(name: str) -> bool:
    """Whether ``name`` is a counter or gauge of the tables below (``loaded_blocks.g<N>``: any group ``N``;
    ``<per-tenant name>.<tenant>``: a namespace or ``_other``)."""
    if name in PROM_COUNTERS or name in GAUGES or split_tenant_key(name) is not None:
        return True
    group = name.removeprefix(PER_GROUP_LOADED_BLOCKS)
    return group != name and group.isdigit()


def tenant_key(name: str, tenant: str) -> str:
    """The stats key of the per-tenant series ``name`` (``PER_TENANT_COUNTERS``, ``PER_TENANT_GAUGES``) for
    ``tenant``."""
    assert name in PER_TENANT_COUNTERS or name in PER_TENANT_GAUGES, f"{name!r} is no per-tenant series"
    return f"{name}.{tenant}"


def split_tenant_key(key: str) -> tuple[str, str] | None:
    """``(per-tenant name, tenant)`` of a per-tenant stats key, or ``None`` for any other key."""
    name, dot, tenant = key.partition(".")
    if not dot or (name not in PER_TENANT_COUNTERS and name not in PER_TENANT_GAUGES):
        return None
    return (name, tenant) if tenant == OTHER_TENANTS or NAMESPACE_RE.match(tenant) else None


def is_gauge_name(name: str) -> bool:
    """Whether ``name`` is a gauge: of ``GAUGES``, or a per-tenant gauge key."""
    if name in GAUGES:
        return True
    split = split_tenant_key(name)
    return split is not None and split[0] in PER_TENANT_GAUGES


def is_per_rank_gauge(name: str) -> bool:
    """Whether ``name`` is a gauge every worker rank sends (``aggregate`` keeps the largest)."""
    return name in PER_RANK_GAUGES or (name not in GAUGES and is_gauge_name(name))


@dataclass
class HybridStoreStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def add(self, name: str, n: float = 1) -> None:
        assert is_stat_name(name), f"stat {name!r} is in neither PROM_COUNTERS nor GAUGES"
        self.data[name] = self.data.get(name, 0) + n

    def aggregate(self, other: KVConnectorStats) -> HybridStoreStats:
        for k, v in other.data.items():
            if is_per_rank_gauge(k):
                self.data[k] = max(self.data.get(k, v), v)  # the busiest rank (or the interval's peak)
            elif k in GAUGES:
                self.data[k] = v  # a scheduler state: the latest report wins
            elif isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items()) if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not any(self.data.values()) and not any(is_gauge_name(k) for k in self.data)


class StatsBox:
    """Thread-safe accumulator; ``take()`` hands out the counters since the last take (or None)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cur = HybridStoreStats()
        self.totals: dict[str, int | float] = {}

    def add(self, name: str, n: float = 1) -> None:
        if not n:
            return
        with self._lock:
            self._cur.add(name, n)  # (checks the name)
            self.totals[name] = self.totals.get(name, 0) + n

    def take(self) -> HybridStoreStats | None:
        with self._lock:
            if self._cur.is_empty():
                return None
            out, self._cur = self._cur, HybridStoreStats()
            return out


class InjectedFaults:
    """Adds to ``stats`` (``store_faults_injected``) the faults ``store``'s ``faulty+`` view injected since the
    last :meth:`count` -- nothing for a store that is no such view. Called where the owner sends its gauges."""

    def __init__(self, stats: StatsBox, store: object) -> None:
        self._view = find_layer(store, FaultyBackend)
        self._stats = stats
        self._num_counted = 0

    def count(self) -> None:
        if self._view is not None:
            total = self._view.num_faults_injected()
            self._stats.add("store_faults_injected", total - self._num_counted)
            self._num_counted = total


def build_stats(data: dict[str, Any] | None) -> HybridStoreStats:
    return HybridStoreStats(data=dict(data or {}))


def with_gauges(stats: HybridStoreStats | None, gauges: dict[str, int]) -> HybridStoreStats | None:
    """``stats`` with the gauge values ``gauges`` set (a new stats object when ``stats`` is None); ``stats``
    as it is when ``gauges`` is empty."""
    if not gauges:
        return stats
    assert all(is_gauge_name(name) for name in gauges), (
        f"not gauges: {sorted(name for name in gauges if not is_gauge_name(name))}"
    )
    out = stats if stats is not None else build_stats(None)
    out.data.update(gauges)
    return out


#: The per-store-group counter: ``loaded_blocks.g<N>`` counts the blocks of store group ``N`` that verified
#: loads restored (a full-attention group restores a block per ``block_size`` tokens of the hit, a Mamba group
#: one state, a sliding-window group only the blocks of its window), counted once per request at the verdict.
PER_GROUP_LOADED_BLOCKS = "loaded_blocks.g"

#: gauge name in the stats dict -> (Prometheus metric name, help)
GAUGES: dict[str, tuple[str, str]] = {
    "breaker_open": (
        "vllm:hybridkv_breaker_open",
        "1 while the lookup circuit breaker is open (lookups answer miss), else 0.",
    ),
    "tracked_requests": (
        "vllm:hybridkv_tracked_requests",
        "Requests the connector's scheduler half follows (from arrival until finished or aborted).",
    ),
    "pinned_blocks": (
        "vllm:hybridkv_pinned_blocks",
        "KV blocks pinned as the sources of save jobs not yet finished by every rank.",
    ),
    "audit_queued_records": (
        "vllm:hybridkv_audit_queued_records",
        "Audit records queued and not yet written (0 without an audit log).",
    ),
    "save_inflight_bytes": (
        "vllm:hybridkv_save_inflight_bytes",
        "Bytes of save jobs admitted and not yet written and reported (largest rank).",
    ),
    "staging_bytes_out": (
        "vllm:hybridkv_staging_bytes_out",
        "Host staging bytes out to transfers or held by late store calls (largest rank).",
    ),
    "late_calls_pending": (
        "vllm:hybridkv_late_calls_pending",
        "Store calls that answered TIMEOUT and have not returned yet (largest rank).",
    ),
    "store_effective_capacity_bytes": (
        "vllm:hybridkv_store_effective_capacity_bytes",
        (
            "The bytes a file:// store's eviction holds it to: its capacity, or what the file system holds "
            "for it when that is less (a full disk) (largest rank; file:// only)."
        ),
    ),
}
#: The workers' gauges (of ``GAUGES``): every rank sends them with each step's stats; ``aggregate`` keeps
#: the largest.
PER_RANK_GAUGES = frozenset(
    {"save_inflight_bytes", "staging_bytes_out", "late_calls_pending", "store_effective_capacity_bytes"}
)

#: Per-tenant gauges, stats key ``<name>.<tenant>`` (``tenant_key``): name -> (Prometheus metric name, help).
#: Workers' gauges: every rank sends them (``hybridkv.connector.worker.tenant_metrics``), ``aggregate`` keeps the
#: largest.
PER_TENANT_GAUGES: dict[str, tuple[str, str]] = {
    "tenant_usage_bytes": (
        "vllm:hybridkv_tenant_usage_bytes",
        (
            "Framed bytes the store holds per tenant (namespace under a quota, or _other), as the rank's "
            "store counts them (largest rank)."
        ),
    ),
}
_TENANT_EVICTED_HELP = (
    "Store entries evicted per tenant: reason=quota by the tenant's own quota, reason=capacity because the "
    "store was full."
)
#: Per-tenant counters, stats key ``<name>.<tenant>``: name -> (Prometheus metric name, its labels besides
#: ``tenant`` with their values, help). Both eviction counters are one series told apart by ``reason``.
PER_TENANT_COUNTERS: dict[str, tuple[str, tuple[tuple[str, str], ...], str]] = {
    "tenant_quota_evicted": (
        "vllm:hybridkv_tenant_evicted_entries",
        (("reason", "quota"),),
        _TENANT_EVICTED_HELP,
    ),
    "tenant_capacity_evicted": (
        "vllm:hybridkv_tenant_evicted_entries",
        (("reason", "capacity"),),
        _TENANT_EVICTED_HELP,
    ),
    "tenant_refused_puts": (
        "vllm:hybridkv_tenant_refused_puts",
        (),
        "Entries refused per tenant because they are larger than its whole quota.",
    ),
}

#: counter name in the stats dict -> (Prometheus metric name, help)
PROM_COUNTERS: dict[str, tuple[str, str]] = {
    "hit_tokens": (
        "vllm:hybridkv_hit_tokens",
        "Prompt tokens restored from the store (external hits), counted once per request.",
    ),
    "lookups": ("vllm:hybridkv_lookups", "External-cache lookups (one batched existence check each)."),
    "lookup_hits": (
        "vllm:hybridkv_lookup_hits",
        "Lookups that found an agreed boundary beyond the local hit.",
    ),
    "lookup_errors": (
        "vllm:hybridkv_lookup_errors",
        "Lookups the store failed or ran over budget (circuit opened).",
    ),
    "lookup_inconsistent_facts": (
        "vllm:hybridkv_lookup_inconsistent_facts",
        "Lookups answered from exact facts alone because facts changed under the search (should stay 0).",
    ),
    "truncations": (
        "vllm:hybridkv_truncations",
        "Loads that failed and were truncated (request recomputed).",
    ),
    "invalidated_entries": ("vllm:hybridkv_invalidated_entries", "Store entries removed after failed loads."),
    "load_transient_faults": (
        "vllm:hybridkv_load_transient_faults",
        "Load entries that timed out or hit a transport error (entry kept in the store).",
    ),
    "hit_declined": (
        "vllm:hybridkv_hit_declined",
        "Hits declined after vLLM allocated tokens that do not match the load plan (request recomputed).",
    ),
    "session_retained_keys": (
        "vllm:hybridkv_session_retained_keys",
        "Store entries retained (or renewed) for a session hint after a save or a hit.",
    ),
    "session_hints_refused": (
        "vllm:hybridkv_session_hints_refused",
        "Requests whose session hint was refused (malformed, or a store that cannot retain).",
    ),
    "session_retain_failed": (
        "vllm:hybridkv_session_retain_failed",
        "Entries a session retention call could not retain (store failure, or a full maintenance queue).",
    ),
    "maintenance_dropped": (
        "vllm:hybridkv_maintenance_dropped",
        "Store removals (invalidations, resets) dropped because the maintenance queue was full.",
    ),
    "reset_timeouts": (
        "vllm:hybridkv_reset_timeouts",
        "Namespace resets still running when reset_cache answered (lookups miss until they finish).",
    ),
    "load_calls": ("vllm:hybridkv_load_calls", "Async loads judged (all ranks reported)."),
    "load_keys": ("vllm:hybridkv_load_keys", "Keys read from the store."),
    "load_bytes": ("vllm:hybridkv_load_bytes", "Bytes read from the store into the KV cache."),
    "load_failed_keys": ("vllm:hybridkv_load_failed_keys", "Keys whose read failed or was corrupt."),
    "store_faults_injected": (
        "vllm:hybridkv_store_faults_injected",
        "Faults a faulty+ store view injected (chaos testing; 0 on a real store).",
    ),
    "load_job_seconds": (
        "vllm:hybridkv_load_job_seconds",
        "Seconds worker load threads spent running load jobs (store reads and writes into the KV cache).",
    ),
    "save_calls": ("vllm:hybridkv_save_calls", "PUT waves sent."),
    "save_keys": ("vllm:hybridkv_save_keys", "Keys written to the store."),
    "save_bytes": ("vllm:hybridkv_save_bytes", "Bytes written to the store."),
    "save_failed_keys": ("vllm:hybridkv_save_failed_keys", "Keys whose write failed."),
    "save_skipped_keys": ("vllm:hybridkv_save_skipped_keys", "Keys already stored (not rewritten)."),
    "put_wave_drops": ("vllm:hybridkv_put_wave_drops", "PUT waves dropped by backpressure or a full store."),
    "layerwise_load_steps": ("vllm:hybridkv_layerwise_load_steps", "Engine steps with layer-wise loads."),
    "layerwise_dropped_saves": (
        "vllm:hybridkv_layerwise_dropped_saves",
        "Save jobs dropped because a layer-wise load of their step failed.",
    ),
    "layerwise_abandoned_steps": (
        "vllm:hybridkv_layerwise_abandoned_steps",
        "Steps whose layer-wise loads were not written within the wait budget (recomputed).",
    ),
    "layerwise_unwaited_steps": (
        "vllm:hybridkv_layerwise_unwaited_steps",
        "Steps with a loaded layer that never waited for its pages (recomputed).",
    ),
    "layerwise_wait_seconds": (
        "vllm:hybridkv_layerwise_wait_seconds",
        "Seconds engine steps waited for their layer-wise loads (the whole batch waits).",
    ),
    "layerwise_breaker_opens": (
        "vllm:hybridkv_layerwise_breaker_opens",
        "Times a layer-wise load missed its deadline and layer-wise hits were paused for a cool-down.",
    ),
    "layerwise_hits_withheld": (
        "vllm:hybridkv_layerwise_hits_withheld",
        "Hits answered as misses while layer-wise hits were paused (the request computes its prefix).",
    ),
}


def build_prom(
    vllm_config: VllmConfig,
    metric_types: dict[type[PromMetric], type[PromMetricT]],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> KVConnectorPromMetrics:
    """A ``KVConnectorPromMetrics`` exporting every counter above plus the per-group loaded blocks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    class HybridStorePromMetrics(KVConnectorPromMetrics):
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters: dict[str, dict[int, Any]] = {
                name: {
                    idx: self._counter_cls(name=prom, documentation=doc, labelnames=labelnames).labels(
                        *values
                    )
                    for idx, values in per_engine_labelvalues.items()
                }
                for name, (prom, doc) in PROM_COUNTERS.items()
            }
            gauge_cls: Any = self._gauge_cls
            self._gauges: dict[str, dict[int, Any]] = {
                name: {
                    idx: gauge_cls(
                        name=prom, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent"
                    ).labels(*values)
                    for idx, values in per_engine_labelvalues.items()
                }
                for name, (prom, doc) in GAUGES.items()
            }
            for children in self._gauges.values():
                for child in children.values():
                    child.set(0)
            per_group: Any = self._counter_cls(
                name="vllm:hybridkv_group_loaded_blocks",
                documentation="Blocks restored by verified loads, per store group.",
                labelnames=[*labelnames, "group"],
            )
            self._per_group = per_group
            self._per_group_children: dict[tuple[int, str], Any] = {}
            # Per-tenant series: one metric per Prometheus name (the two eviction counters share one).
            self._per_tenant: dict[str, Any] = {}
            for name, (prom, doc) in PER_TENANT_GAUGES.items():
                self._per_tenant[name] = gauge_cls(
                    name=prom,
                    documentation=doc,
                    labelnames=[*labelnames, "tenant"],
                    multiprocess_mode="mostrecent",
                )
            prom_to_counter: dict[str, Any] = {}
            for name, (prom, extra, doc) in PER_TENANT_COUNTERS.items():
                if prom not in prom_to_counter:
                    prom_to_counter[prom] = self._counter_cls(
                        name=prom,
                        documentation=doc,
                        labelnames=[*labelnames, "tenant", *(label for label, _ in extra)],
                    )
                self._per_tenant[name] = prom_to_counter[prom]
            self._per_tenant_children: dict[tuple[int, str], Any] = {}

        def _tenant_child(self, engine_idx: int, key: str, name: str, tenant: str) -> Any:
            child = self._per_tenant_children.get((engine_idx, key))
            if child is None:
                extra = PER_TENANT_COUNTERS[name][1] if name in PER_TENANT_COUNTERS else ()
                child = self._per_tenant[name].labels(
                    *self.per_engine_labelvalues[engine_idx], tenant, *(value for _, value in extra)
                )
                self._per_tenant_children[(engine_idx, key)] = child
            return child

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for key, value in transfer_stats_data.items():
                if key in self._gauges and isinstance(value, (int, float)):
                    self._gauges[key][engine_idx].set(value)
                    continue
                split = split_tenant_key(key)
                if split is not None and isinstance(value, (int, float)):
                    child = self._tenant_child(engine_idx, key, *split)
                    if split[0] in PER_TENANT_GAUGES:
                        child.set(value)
                    elif value > 0:
                        child.inc(value)
                    continue
                if not isinstance(value, (int, float)) or value <= 0:
                    continue
                if key in self._counters:
                    self._counters[key][engine_idx].inc(value)
                elif key.startswith(PER_GROUP_LOADED_BLOCKS):
                    group = key.removeprefix(PER_GROUP_LOADED_BLOCKS)
                    child = self._per_group_children.get((engine_idx, group))
                    if child is None:
                        child = self._per_group.labels(*self.per_engine_labelvalues[engine_idx], group)
                        self._per_group_children[(engine_idx, group)] = child
                    child.inc(value)

    return HybridStorePromMetrics()
