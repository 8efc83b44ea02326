"""``hybridkv store ls|stats|clear|quota URL``: a store's keys and deployments, its stats, clearing it, its
quotas per tenant.

Contracts:

- Every function opens the store at ``url`` and closes it before returning; a bad URL or a backend failure
  raises :class:`hybridkv.store.StoreError` (the CLI reports it as bad input).
- :func:`list_store` and :func:`store_stats` only read; :func:`clear_store` removes keys and nothing else;
  :func:`store_quotas` changes only the quotas of a file store's directory.
- The ``render_*`` functions write the report dicts as the text the commands print (no trailing newline).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hybridkv.connector.identity import parse_manifest_key, read_manifest
from hybridkv.lifecycle.keys import parse_block_key
from hybridkv.store import Store, StoreError, open_store
from hybridkv.store.params import format_size, split_url
from hybridkv.store.quotas import check_quotas, read_quotas, write_quotas
from hybridkv.store.url import FAULTY_PREFIX, absent_store, store_kind
from hybridkv.tables import format_table

__all__ = [
    "DEPLOYMENT_COLUMNS",
    "clear_store",
    "deployments",
    "list_store",
    "render_clear",
    "render_listing",
    "render_quotas",
    "render_stats",
    "render_tenants",
    "store_quotas",
    "store_stats",
]

#: The columns of the deployments table ``hybridkv store ls`` prints above the keys.
DEPLOYMENT_COLUMNS = [
    "namespace",
    "fingerprint",
    "num_keys",
    "model",
    "revision",
    "weights",
    "dtype",
    "kv_cache_dtype",
    "quantization",
    "tp",
    "dcp",
]


def list_store(url: str, prefix: str = "") -> dict[str, Any]:
    """``url``, ``prefix``, the sorted ``keys`` under ``prefix`` and the ``deployments`` among them
    (:func:`deployments`)."""
    with open_store(url) as store:
        keys = sorted(store.iter_keys(prefix))
        rows = deployments(store, keys)
    return {"url": url, "prefix": prefix, "deployments": rows, "keys": keys}


def deployments(store: Store, keys: list[str]) -> list[dict[str, Any]]:
    """One row per ``hkv1/<namespace>/<fingerprint>/`` among ``keys``: its number of block entries and its
    manifest's fields (model, weights identity, dtypes, geometry) when the engine that wrote it left one.
    Keys that are neither a block entry nor a manifest (another tool's) belong to no deployment."""
    num_keys: dict[tuple[str, str], int] = {}
    manifests: dict[tuple[str, str], str] = {}
    for key in keys:
        block = parse_block_key(key)
        if block is not None:
            deployment = (block.namespace, block.fingerprint)
            num_keys[deployment] = num_keys.get(deployment, 0) + 1
            continue
        manifest_of = parse_manifest_key(key)
        if manifest_of is not None:
            manifests[manifest_of] = key
    rows = []
    for deployment in sorted(num_keys.keys() | manifests.keys()):
        record = read_manifest(store, manifests[deployment]) if deployment in manifests else None
        row: dict[str, Any] = dict(record or {})
        row.update(namespace=deployment[0], fingerprint=deployment[1], num_keys=num_keys.get(deployment, 0))
        rows.append(row)
    return rows


def render_listing(listing: dict[str, Any]) -> str:
    """A :func:`list_store` report as text: the deployments table (when there are any) and a blank line, then
    one key per line, or ``(no keys under 'PREFIX')``."""
    keys: list[str] = listing["keys"]
    parts = []
    if listing["deployments"]:
        rows = [{name: _cell(row.get(name)) for name in DEPLOYMENT_COLUMNS} for row in listing["deployments"]]
        parts.append(format_table(rows, DEPLOYMENT_COLUMNS) + "\n")
    parts.append("\n".join(keys) if keys else f"(no keys under {listing['prefix']!r})")
    return "\n".join(parts)


def _cell(value: object) -> object:
    """``-`` for an empty cell."""
    return "-" if value is None or value == "" else value


def store_stats(url: str) -> dict[str, Any]:
    """The backend's ``StoreStats`` as a dict (``extra`` holding the backend's own fields)."""
    with open_store(url) as store:
        stats = store.stats()
    return dataclasses.asdict(stats)


def render_stats(stats: dict[str, Any]) -> str:
    """A :func:`store_stats` dict as a field/value table, the backend's ``extra`` fields after the common ones."""
    common = {name: value for name, value in stats.items() if name != "extra"}
    rows = [{"field": name, "value": value} for name, value in {**common, **stats["extra"]}.items()]
    return format_table(rows, ["field", "value"])


def clear_store(url: str, prefix: str = "") -> dict[str, Any]:
    """Remove every key under ``prefix`` (every key for ``""``): ``url``, ``prefix`` and ``num_removed``."""
    with open_store(url) as store:
        num_removed = store.remove_prefix(prefix)
    return {"url": url, "prefix": prefix, "num_removed": num_removed}


def render_clear(cleared: dict[str, Any]) -> str:
    """A :func:`clear_store` report as text."""
    return f"removed {cleared['num_removed']} keys"


#: The columns of ``hybridkv store quota``'s table.
QUOTA_COLUMNS = ["namespace", "quota", "usage", "num_quota_evicted", "num_refused_puts"]


def store_quotas(
    url: str, *, quotas_to_set: dict[str, int] | None = None, namespaces_to_clear: list[str] | None = None
) -> dict[str, Any]:
    """The quotas of the file store at ``url`` after setting ``quotas_to_set`` and dropping
    ``namespaces_to_clear``: ``url`` and ``tenants`` (per namespace: ``quota_bytes``, ``usage_bytes``, and this
    call's counters, which are zero). ``StoreError`` for a store kind that keeps no quotas in its directory,
    an absent store, or a bad quota (not a namespace, not > 0, above the URL's capacity); nothing is written
    then."""
    scheme = store_kind(url).scheme
    if scheme == "memory":
        raise StoreError(
            f"store URL {url!r}: a memory store is process-local; its quotas are part of its URL "
            "(memory://NAME?quotas=NS:SIZE,...)"
        )
    if scheme != "file":
        raise StoreError(
            f"store URL {url!r}: {scheme} stores evict in their own service, which knows no tenants; "
            "quotas are enforced by file:// and memory:// stores only"
        )
    absent = absent_store(url)
    if absent is not None:
        raise StoreError(f"store URL {url!r}: {absent}")
    with open_store(url) as store:
        capacity = store.stats().capacity_bytes
        directory = Path(split_url(url.removeprefix(FAULTY_PREFIX)).path)
        try:
            quotas = read_quotas(directory)
        except ValueError as error:
            raise StoreError(f"store URL {url!r}: {error}") from None
        if quotas_to_set or namespaces_to_clear:
            for namespace in namespaces_to_clear or []:
                if namespace not in quotas:
                    raise StoreError(f"store URL {url!r}: namespace {namespace!r} has no quota to clear")
                del quotas[namespace]
            quotas.update(quotas_to_set or {})
            try:
                check_quotas(quotas, capacity_bytes=capacity)
            except ValueError as error:
                raise StoreError(f"store URL {url!r}: {error}") from None
            write_quotas(directory, quotas)
        tenants = store.stats().extra.get("tenants", {})
    return {"url": url, "tenants": tenants}


def render_quotas(report: dict[str, Any]) -> str:
    """A :func:`store_quotas` report as a table (or a line saying there are none)."""
    if not report["tenants"]:
        return "no quotas"
    return render_tenants(report["tenants"])


def render_tenants(tenants: dict[str, dict[str, int]]) -> str:
    """The ``tenants`` of a store's stats (``hybridkv.store.quotas``) as the quota table."""
    rows = [
        {
            "namespace": namespace,
            "quota": format_size(tenant["quota_bytes"]),
            "usage": format_size(tenant["usage_bytes"]),
            "num_quota_evicted": tenant["num_quota_evicted"],
            "num_refused_puts": tenant["num_refused_puts"],
        }
        for namespace, tenant in tenants.items()
    ]
    return format_table(rows, QUOTA_COLUMNS)
