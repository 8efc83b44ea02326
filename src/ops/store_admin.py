"""``hybridkv store ls|stats|clear|quota URL``: a store's keys and deployments, its stats, clearing it, its
quotas per tenant.

Contracts:

- Every function opens the store at ``url`` as an operator (``open_store(url, operator=True)``) and closes
  it before returning: a URL that names no existing store (a mistyped ``file://`` path) raises
  :class:`hybridkv.store.StoreError` and creates nothing; a ``file://`` URL without ``capacity`` opens with
  the capacity its engines recorded (``hybridkv.store.file.capacity``). A bad URL or a backend failure
  raises ``StoreError`` too (the CLI reports it as bad input).
- :func:`list_store` and :func:`store_stats` only read; :func:`clear_store` removes keys and nothing else,
  and only what it was asked to (every key of the store only with ``everything``);
  :func:`store_quotas` changes only the quotas of a file store's directory.
- The ``render_*`` functions write the report dicts as the text the commands print (no trailing newline).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hybridkv.connector.identity import parse_manifest_key, read_manifest
from hybridkv.key_grammar import KEY_VERSION, NAMESPACE_RE, parse_block_key
from hybridkv.store import Store, StoreError, open_store
from hybridkv.store.file.capacity import CAPACITY_FILE, recorded_capacity
from hybridkv.store.params import format_size, shown_url, split_url
from hybridkv.store.quotas import check_quotas, read_quotas, write_quotas
from hybridkv.store.url import FAULTY_PREFIX, store_kind
from hybridkv.tables import format_table

__all__ = [
    "DEPLOYMENT_COLUMNS",
    "ClearRefused",
    "clear_store",
    "deployments",
    "list_store",
    "namespace_prefix",
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
    with open_store(url, operator=True) as store:
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
    """The backend's ``StoreStats`` as a dict (``extra`` holding the backend's own fields); for a file store,
    ``extra["capacity_source"]`` says where ``capacity_bytes`` comes from: the URL, the engines' record, or
    the default (a URL without ``capacity`` on a store no engine opened yet)."""
    with open_store(url, operator=True) as store:
        stats = dataclasses.asdict(store.stats())
    source = _capacity_source(url)
    if source is not None:
        stats["extra"]["capacity_source"] = source
    return stats


def _capacity_source(url: str) -> str | None:
    """Where an operator's open of the file store ``url`` took its capacity from; None for other stores."""
    inner = url.removeprefix(FAULTY_PREFIX)
    if store_kind(url).scheme != "file":
        return None
    parsed = split_url(inner)
    if "capacity" in parsed.params:
        return "the URL"
    if recorded_capacity(Path(parsed.path)) is not None:
        return f"recorded by the engines that opened the store ({CAPACITY_FILE})"
    return "the default: no engine has recorded its capacity in this directory yet"


def render_stats(stats: dict[str, Any]) -> str:
    """A :func:`store_stats` dict as a field/value table, the backend's ``extra`` fields after the common ones."""
    common = {name: value for name, value in stats.items() if name != "extra"}
    rows = [{"field": name, "value": value} for name, value in {**common, **stats["extra"]}.items()]
    return format_table(rows, ["field", "value"])


class ClearRefused(StoreError):
    """:func:`clear_store` was asked to clear a whole store without ``everything``; nothing was removed.
    The message says what would go and how to confirm."""


def namespace_prefix(namespace: str) -> str:
    """The key prefix of every entry (blocks and manifests) of deployments keyed by ``namespace``;
    ``StoreError`` for a name that is no namespace."""
    if not NAMESPACE_RE.fullmatch(namespace):
        raise StoreError(
            f"bad namespace {namespace!r}: expected 1-64 characters of [A-Za-z0-9._-] starting with a letter "
            "or digit (the connector's namespace)"
        )
    return f"{KEY_VERSION}/{namespace}/"


def clear_store(
    url: str, prefix: str = "", *, dry_run: bool = False, everything: bool = False
) -> dict[str, Any]:
    """Remove every key under ``prefix``: ``url``, ``prefix``, ``dry_run`` and ``num_removed`` (with
    ``dry_run``, the keys that would be removed, counted; nothing is removed).

    An empty ``prefix`` is the whole store: without ``everything`` (the operator's confirmation) it raises
    :class:`ClearRefused` naming how many keys it holds (where the store can list them), and removes
    nothing. A dry run needs no confirmation; it lists the keys, so a store that cannot list them (Mooncake)
    raises ``StoreError``."""
    with open_store(url, operator=True) as store:
        if dry_run:
            num_keys = sum(1 for _ in store.iter_keys(prefix))
            return {"url": url, "prefix": prefix, "dry_run": True, "num_removed": num_keys}
        if not prefix and not everything:
            try:
                held = f"its {sum(1 for _ in store.iter_keys(''))} keys"
            except StoreError:
                held = "every key it holds"  # a store that cannot list its keys (Mooncake)
            raise ClearRefused(
                f"refusing to clear the whole store {shown_url(url)!r}: that removes {held}, every "
                "deployment's and every tenant's, from every engine sharing it. Pass --yes to confirm, "
                "--namespace NS to clear one namespace, or --dry-run to count first"
            )
        num_removed = store.remove_prefix(prefix)
    return {"url": url, "prefix": prefix, "dry_run": False, "num_removed": num_removed}


def render_clear(cleared: dict[str, Any]) -> str:
    """A :func:`clear_store` report as text."""
    where = f" under {cleared['prefix']!r}" if cleared["prefix"] else ""
    if cleared["dry_run"]:
        return f"would remove {cleared['num_removed']} keys{where} (dry run: nothing removed)"
    return f"removed {cleared['num_removed']} keys{where}"


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
            f"store URL {shown_url(url)!r}: a memory store is process-local; its quotas are part of its URL "
            "(memory://NAME?quotas=NS:SIZE,...)"
        )
    if scheme != "file":
        raise StoreError(
            f"store URL {shown_url(url)!r}: {scheme} stores evict in their own service, which knows no "
            "tenants; quotas are enforced by file:// and memory:// stores only"
        )
    with open_store(url, operator=True) as store:
        capacity = store.stats().capacity_bytes
        directory = Path(split_url(url.removeprefix(FAULTY_PREFIX)).path)
        try:
            quotas = read_quotas(directory)
        except ValueError as error:
            raise StoreError(f"store URL {shown_url(url)!r}: {error}") from None
        if quotas_to_set or namespaces_to_clear:
            for namespace in namespaces_to_clear or []:
                if namespace not in quotas:
                    raise StoreError(
                        f"store URL {shown_url(url)!r}: namespace {namespace!r} has no quota to clear"
                    )
                del quotas[namespace]
            quotas.update(quotas_to_set or {})
            try:
                check_quotas(quotas, capacity_bytes=capacity)
            except ValueError as error:
                raise StoreError(f"store URL {shown_url(url)!r}: {error}") from None
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
