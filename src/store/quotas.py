"""Byte quotas per tenant: a tenant at its quota makes room from its own entries, never from another's.

A tenant is a key namespace: the segment after the key version (``hkv1/<namespace>/...``), which a
deployment sets with the connector's ``namespace`` (``hybridkv.lifecycle.keys.KeyScheme``). A key of
any other form belongs to no tenant and is never under a quota.

Contract (every backend that takes quotas; ``hybridkv.testing.store_fuzz`` checks it):

- A put of a new entry of a tenant with a quota first makes room *inside the tenant*: while the tenant's
  stored bytes plus the entry would exceed its quota, the tenant's least recently used entry is evicted
  (counted as a quota eviction). A batch is taken entry by entry in its order: a batch of more bytes than
  the whole quota leaves the tenant holding the batch's newest entries that fit (the older ones answer
  ``OK`` and count as quota evictions, as if evicted by the newer ones at once). So after every put a
  tenant holds at most its quota, a tenant at its quota does not grow the store, and its puts never push
  another tenant's entries out through the store's capacity eviction while it is over its quota.
- An entry larger than its tenant's whole quota is refused with ``NO_SPACE`` (counted as a refused put),
  and nothing of the tenant is evicted for it.
- Capacity eviction (the store is full) is unchanged: least recently used first across all tenants
  (counted per tenant as capacity evictions). A tenant *within* its quota competes for the capacity like
  any other: when the store is full, its puts evict the store's least recently used entries, whoever wrote
  them. Quotas bound what each tenant holds; they reserve no tenant a share of the capacity, except that a
  tenant's entries are safe from the others' puts while its bytes plus the others' quotas fit in the
  capacity (every other tenant under a quota). Quotas may add up to more than the capacity (overcommit);
  one quota above the capacity is a configuration error.
- Reads, ``exists``, removals and listing are unaffected.

Counters (:class:`TenantCounters`, ``stats().extra["tenants"]``, and the cheap :func:`tenant_counters_of`
that the connector's per-tenant metrics read): per namespace under a quota, plus :data:`OTHER_TENANTS` for
everything else the store holds. They count this process's calls; a file store's usage there is the shared
estimate (``hybridkv.store.file.layout``), ``stats()`` reads the exact bytes from the files.

Where quotas are set: ``memory://NAME?quotas=NS:SIZE[,NS:SIZE...]`` (the table is process-local, so its
URL is the one place); a file store's quotas belong to its directory (every process sharing it enforces
the same ones) and are set with ``hybridkv store quota URL --set NS=SIZE`` (:func:`write_quotas`); they apply
to the data already there from the next put of any process on.
Mooncake evicts in its master, which knows no tenants: quotas are refused there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from hybridkv.key_grammar import NAMESPACE_RE
from hybridkv.store.base import find_layer
from hybridkv.store.params import byte_size, format_size

__all__ = [
    "OTHER_TENANTS",
    "QUOTAS_FILE",
    "TenantCounters",
    "check_quotas",
    "parse_quotas",
    "read_quotas",
    "tenant_counters_of",
    "write_quotas",
]

#: The file store's quota file, in its directory: JSON ``{namespace: bytes}``.
QUOTAS_FILE = "quotas.json"


@dataclass
class TenantCounters:
    """One tenant's quota and what it holds; the counters count this process's calls."""

    quota_bytes: int
    usage_bytes: int = 0
    #: entries of the tenant evicted to keep it within its quota
    num_quota_evicted: int = 0
    #: entries of the tenant evicted because the store was full (capacity eviction, least recently used
    #: first across tenants: anyone's put may cause it)
    num_capacity_evicted: int = 0
    #: entries refused because they are larger than the whole quota
    num_refused_puts: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


#: The counters' name for every entry of no namespace under a quota (not a namespace: those start with a
#: letter or digit, so no tenant can be named so).
OTHER_TENANTS = "_other"


@runtime_checkable
class CountsTenants(Protocol):
    """A backend that keeps :class:`TenantCounters` (the memory and file backends)."""

    def tenant_counters(self) -> dict[str, TenantCounters]: ...


def tenant_counters_of(store: object) -> dict[str, TenantCounters]:
    """The tenants' counters of ``store`` (a ``Store``, its backend, or a wrapper of either), without the
    cost of ``stats()``: a copy per namespace under a quota plus :data:`OTHER_TENANTS` (``quota_bytes``
    0). Empty for a store without quotas or of a kind that keeps none (Mooncake)."""
    # mypy refuses a protocol as ``type[T]``; isinstance works on it (runtime-checkable).
    layer = find_layer(store, CountsTenants)  # type: ignore[type-abstract]
    if layer is None:
        return {}
    counters = layer.tenant_counters()
    return counters if isinstance(counters, dict) else {}


def check_quotas(quotas: Mapping[str, int], *, capacity_bytes: int | None) -> None:
    """Raise ``ValueError`` naming the namespace when a quota is not a valid namespace, not positive, or
    above ``capacity_bytes``."""
    for namespace, quota in quotas.items():
        if not NAMESPACE_RE.match(namespace):
            raise ValueError(
                f"quota namespace {namespace!r} is not a namespace (it must match {NAMESPACE_RE.pattern})"
            )
        if quota <= 0:
            raise ValueError(f"quota of namespace {namespace!r} must be > 0 bytes, got {quota}")
        if capacity_bytes is not None and quota > capacity_bytes:
            raise ValueError(
                f"quota of namespace {namespace!r} ({format_size(quota)}) is above the store's "
                f"capacity ({format_size(capacity_bytes)})"
            )


def parse_quotas(text: str) -> dict[str, int]:
    """``NS:SIZE[,NS:SIZE...]`` (sizes as everywhere: ``64MiB``, ``2GB``) -> ``{namespace: bytes}``;
    ``ValueError`` naming the bad part. An empty text means no quotas."""
    quotas: dict[str, int] = {}
    for part in (piece.strip() for piece in text.split(",")):
        if not part:
            continue
        namespace, sep, size_text = part.partition(":")
        namespace = namespace.strip()
        if not sep or not namespace:
            raise ValueError(f"{part!r} is not NAMESPACE:SIZE")
        if namespace in quotas:
            raise ValueError(f"namespace {namespace!r} has two quotas")
        try:
            quotas[namespace] = byte_size(size_text)
        except ValueError as error:
            raise ValueError(f"quota of namespace {namespace!r}: {error}") from None
    return quotas


def read_quotas(directory: Path) -> dict[str, int]:
    """The quotas stored in a file store's ``directory`` (none when it has no quota file); ``ValueError``
    when the file is not a ``{namespace: bytes}`` object."""
    path = directory / QUOTAS_FILE
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        loaded = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not JSON: {error}") from None
    if not isinstance(loaded, dict) or not all(
        isinstance(namespace, str) and type(quota) is int for namespace, quota in loaded.items()
    ):
        raise ValueError(f"{str(path)!r} must hold an object of namespace -> bytes (integers)")
    return loaded


def write_quotas(directory: Path, quotas: Mapping[str, int]) -> None:
    """Replace the quotas of the file store in ``directory`` atomically (processes sharing it pick them up
    at their next put)."""
    path = directory / QUOTAS_FILE
    temp = directory / f".{QUOTAS_FILE}.{os.getpid()}.tmp"
    temp.write_text(json.dumps(dict(sorted(quotas.items())), indent=1) + "\n")
    os.chmod(temp, 0o600)
    os.replace(temp, path)
