"""Retention: entries a client expects to reuse soon go last, for a while, within a budget.

``Store.retain(keys, until)`` marks each stored entry *retained* until ``until`` (seconds on the
``time.time()`` clock; a later call moves it, one with ``until`` in the past releases the entry, which then
ages as if used at that moment). A session's client retains its prefix for a TTL and retains it again on
every hit, so a session paused for a tool call or a human keeps its prefix while one-off traffic churns
through the rest of the store.

Contract (the memory and file stores; ``hybridkv.testing.store_fuzz`` and tests/store/test_retention.py check
it):

- Eviction (capacity, and a tenant's quota) takes ordinary entries first, least recently used first, and
  retained ones only when no ordinary entry is left, the one that expires first first.
- Retention is bounded: only retained entries within ``RETAIN_FRACTION`` of the capacity (of the quota, for
  a tenant's own eviction) are protected, those expiring last first; the rest are evicted like ordinary
  entries. So retention can never pin a store full, nor a tenant pin another tenant's share away.
- Retention yields to the quota. A tenant's quota is a hard bound: a put that fits in the quota only by
  evicting the tenant's retained entries takes them (the one expiring first first) and lands; it is never
  refused for a retention (the newest data wins, as for a batch larger than the quota). So a tenant's
  retained entry survives the tenant's puts while its retained bytes fit in ``RETAIN_FRACTION`` of the quota
  and each entry put fits in the quota beside them; a client that must keep a prefix sizes its quota so.
- Retention never changes what a read returns, nor whether a key is stored; it is not persistent beyond
  the entry (a removed or evicted entry is not retained when it is stored again).
- The file store keeps the same contract across processes: a retained file's mtime (its LRU clock) is set
  to the end of its retention (``hybridkv.store.file.layout``, Retention).
- A store that cannot retain answers ``TRANSFER_FAILED`` for every key: Mooncake (eviction is its master's).

What it buys is measured by ``hybridkv bench agentic`` (``lru+sessions``: each session retains its prompt
after every request and releases it at its end): on its synthetic agentic trace, 0.4 to 1.4 points more
prompt tokens served than plain LRU at 2 to 10 % of the working set, because protecting the entries that
were retained last is recency again; a first-come variant (a stable set of sessions) served 4 to 23 points
fewer (docs/performance.md, "Agentic traffic and the store's eviction").
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["RETAIN_FRACTION", "protected_keys"]

#: The share of the capacity (or of a tenant's quota) that retained entries may hold protected.
RETAIN_FRACTION = 0.5


def protected_keys(
    key_to_until: Mapping[str, float], key_to_size: Mapping[str, int], budget_bytes: float
) -> set[str]:
    """The retained keys eviction must take last: those expiring last first, while their sizes fit in
    ``budget_bytes`` (``key_to_until`` holds unexpired entries only)."""
    protected: set[str] = set()
    num_bytes = 0
    for key in sorted(key_to_until, key=key_to_until.__getitem__, reverse=True):
        size = key_to_size[key]
        if num_bytes + size > budget_bytes:
            continue  # a smaller, sooner-expiring entry may still fit
        protected.add(key)
        num_bytes += size
    return protected
