"""``hybridkv store ls|stats|clear URL``: a store's keys and deployments, its stats, clearing it.

Contracts:

- Every function opens the store at ``url`` and closes it before returning; a bad URL or a backend failure
  raises :class:`hybridkv.store.StoreError` (the CLI reports it as bad input).
- :func:`list_store` and :func:`store_stats` only read; :func:`clear_store` removes keys and nothing else.
- The ``render_*`` functions write the report dicts as the text the commands print (no trailing newline).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridkv.connector.identity import parse_manifest_key, read_manifest
from hybridkv.lifecycle.keys import parse_block_key
from hybridkv.store import Store, open_store
from hybridkv.tables import format_table

__all__ = [
    "DEPLOYMENT_COLUMNS",
    "clear_store",
    "deployments",
    "list_store",
    "render_clear",
    "render_listing",
    "render_stats",
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
