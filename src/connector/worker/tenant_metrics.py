"""Per-tenant metrics of a worker's store: what each tenant (namespace) holds, what was evicted of it, what
was refused (``hybridkv.store.quotas``), exported where the store objects live -- each worker rank.

Contract: :class:`TenantMetrics` reads the rank's store's tenant counters (``tenant_counters_of``: the memory
and file stores keep them; a store without quotas, or Mooncake, has none and no series is sent) at most once
per ``interval_s`` (the file store's read is a ``stat`` and two small locked reads, never a scan), and turns
them into stats keys (``hybridkv.connector.stats``):

- gauge ``tenant_usage_bytes.<tenant>``: the framed bytes the tenant holds (the file store's shared
  estimate: high, never low; the memory store's exact count). Every rank sends it with each step's stats and
  ``aggregate`` keeps the largest rank's: ranks sharing one file store read the same figure; a memory store
  is one table per worker process, so the series is the fullest rank's table.
- counters ``tenant_quota_evicted.<tenant>``, ``tenant_capacity_evicted.<tenant>``,
  ``tenant_refused_puts.<tenant>``: what this rank's puts made the store do since the last sample (summed
  over ranks). The store's counters only grow; a counter found lower (another store object) starts over.

Bounded label cardinality: the tenants are the namespaces under a quota -- set by the operator, so bounded by
configuration -- and at most ``max_tenants`` of them (the first by name, kept while their quota stays); the
others, and every namespace without a quota, are summed into ``_other`` (``OTHER_TENANTS``; no namespace can
be named so). Increments are taken per namespace, so a namespace moving between its label and ``_other``
counts nothing twice. A namespace whose quota was dropped is sent once more with usage 0, then no more.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hybridkv.connector.stats import StatsBox, tenant_key
from hybridkv.store.quotas import OTHER_TENANTS, TenantCounters, tenant_counters_of

#: Tenants with a label of their own, at most (the rest are summed into ``_other``).
MAX_TENANT_LABELS = 32
#: Seconds between two reads of the store's tenant counters.
DEFAULT_INTERVAL_S = 1.0

#: stats counter name -> the ``TenantCounters`` field it follows
_COUNTER_FIELDS = {
    "tenant_quota_evicted": "num_quota_evicted",
    "tenant_capacity_evicted": "num_capacity_evicted",
    "tenant_refused_puts": "num_refused_puts",
}


class TenantMetrics:
    """One rank's per-tenant series (see the module docstring). Called from the thread that collects the
    rank's stats (``WorkerSide.gauges``); not thread-safe on its own."""

    def __init__(
        self,
        stats: StatsBox,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_tenants: int = MAX_TENANT_LABELS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stats = stats
        self._interval_s = interval_s
        self._max_tenants = max_tenants
        self._clock = clock
        self._next_read = float("-inf")
        #: (namespace, counter field) -> the store's total at the last read
        self._totals: dict[tuple[str, str], int] = {}
        #: the namespaces with a label of their own
        self._labelled: set[str] = set()
        #: the gauges sent at the last read (sent again at every step until the next read)
        self._gauges: dict[str, int] = {}
        #: the tenants the last read found
        self._live: set[str] = set()

    def gauges(self, store: object) -> dict[str, int]:
        """The per-tenant gauges to send with this step's stats; every ``interval_s`` it reads ``store``'s
        counters first and adds their increments to the rank's stats."""
        now = self._clock()
        if now >= self._next_read:
            self._next_read = now + self._interval_s
            self._read(tenant_counters_of(store))
        return dict(self._gauges)

    def _read(self, counters: dict[str, TenantCounters]) -> None:
        namespaces = sorted(namespace for namespace in counters if namespace != OTHER_TENANTS)
        # Labels are sticky: a namespace keeps its label while it has a quota; new ones get one while fewer
        # than max_tenants are taken.
        labelled = [namespace for namespace in namespaces if namespace in self._labelled]
        for namespace in namespaces:
            if len(labelled) >= self._max_tenants:
                break
            if namespace not in self._labelled:
                labelled.append(namespace)
        self._labelled = set(labelled)
        tenant_to_usage: dict[str, int] = {}
        for namespace, tenant_counters in counters.items():
            tenant = namespace if namespace in self._labelled else OTHER_TENANTS
            tenant_to_usage[tenant] = tenant_to_usage.get(tenant, 0) + tenant_counters.usage_bytes
            for name, field in _COUNTER_FIELDS.items():
                # Increments per namespace (each one's counters only grow), summed into its label.
                total = getattr(tenant_counters, field)
                previous = self._totals.get((namespace, field), 0)
                self._stats.add(tenant_key(name, tenant), total - previous if total >= previous else total)
                self._totals[(namespace, field)] = total
        # A tenant gone since the last read (its quota dropped): its gauge goes to 0 until the next read.
        gauges = {tenant_key("tenant_usage_bytes", tenant): 0 for tenant in self._live - set(tenant_to_usage)}
        for tenant, usage in sorted(tenant_to_usage.items()):
            gauges[tenant_key("tenant_usage_bytes", tenant)] = usage
        self._live = set(tenant_to_usage)
        self._gauges = gauges
