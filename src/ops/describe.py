"""``hybridkv describe``: what an operator needs to know about a deployment's tier, before and during serving.

Given the connector's ``kv_connector_extra_config`` (or only a store URL) and optionally the model,
:func:`describe_deployment` builds one report dict and :func:`render_text` writes it as text:

- the resolved geometry per store group (kind, vLLM block, span, DCP sharding, bytes per entry) with the
  hash unit, hit alignment, key fingerprint and namespace -- resolved by vLLM itself: an in-process engine
  (CPU build works) starts with the connector on a private ``memory://`` store, and
  ``hybridkv.connector.vllm_geometry.resolve_geometry`` reads its ``kv_cache_config``; with it, whether
  that engine loads from the tier (off, with the reason, where vLLM disabled prefix caching or the attention
  backend cannot use external KV: ``hybridkv.connector.capabilities``) and whether the model's weights were
  found (an unresolved identity keys the model by its id and revision only) (:mod:`hybridkv.ops.geometry`);
- the store's health: reachable, latency of an existence check on a random key under a deadline (the
  connector's ``lookup_budget_ms``), the state a lookup breaker would be in after those probes, and the
  backend's own breaker when it has one (Mooncake) (:mod:`hybridkv.ops.store_health`);
- usage and capacity, and entries per namespace / fingerprint / group / rank, parsed from the keys
  (``hkv1/<namespace>/<fingerprint>/g<group>/tp<r>/dcp<r>/<hash>``); with a model, bytes per group.

It only reads: existence checks, key listing, stats. A ``file://`` store whose directory does not exist is
reported absent, not created.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hybridkv.ops.geometry import describe_model_geometry
from hybridkv.ops.store_admin import render_tenants
from hybridkv.ops.store_health import describe_store
from hybridkv.store.params import format_size
from hybridkv.tables import format_table

__all__ = [
    "DescribeInputError",
    "connector_settings",
    "describe_deployment",
    "entries_with_bytes",
    "render_text",
]


class DescribeInputError(ValueError):
    """Bad input to describe: the connector config, the probe count, or a model the engine refuses. The
    message names the culprit (the connector's own validation message for a config key)."""


def connector_settings(
    extra: dict[str, Any], store_override: str | None, model: str | None
) -> tuple[str, str | None, float]:
    """(store URL, namespace or None when neither the config nor a model names one, lookup budget ms).

    ``ValueError`` from the connector's own validation: the same errors, naming the same keys, as at engine
    start."""
    from hybridkv.connector.config import ConnectorConfig

    if store_override is not None:
        extra = {**extra, "store": store_override}
    cfg = ConnectorConfig.from_extra_config(extra, model=model or "unnamed")
    namespace = cfg.namespace if (model is not None or "namespace" in extra) else None
    return cfg.store, namespace, cfg.lookup_budget_ms


def describe_deployment(
    extra: dict[str, Any],
    *,
    store: str | None,
    model: str | None,
    probes: int,
    dtype: str,
    max_model_len: int,
    attention_backend: str | None = None,
) -> dict[str, Any]:
    """The describe report of the deployment ``extra`` (a ``kv_connector_extra_config``) configures, its store
    URL replaced by ``store`` when given; with ``model``, the geometry an in-process engine on it resolves
    (``dtype``, ``max_model_len``, ``attention_backend`` its settings) and the namespace that engine keys by.

    Keys: ``store``, ``namespace``, ``geometry`` (with a model), ``health``, ``usage``, ``entries`` (the key
    counts with ``payload_bytes``, known where the geometry is). Input is checked before anything starts:
    the config, then ``probes >= 1``, then the model; bad input raises :class:`DescribeInputError`. The
    store is then only read; whatever the store phase raises propagates unchanged."""
    try:
        store_url, namespace, budget_ms = connector_settings(extra, store, model)
    except ValueError as error:
        raise DescribeInputError(str(error)) from error
    if probes < 1:
        raise DescribeInputError(f"--probes must be >= 1, got {probes}")
    report: dict[str, Any] = {"store": store_url, "namespace": namespace}
    if model is not None:
        try:
            report["geometry"] = describe_model_geometry(
                model, extra, dtype=dtype, max_model_len=max_model_len, attention_backend=attention_backend
            )
        except ValueError as error:
            raise DescribeInputError(str(error)) from error
        report["namespace"] = report["geometry"]["namespace"]
    report.update(describe_store(store_url, probes=probes, deadline_s=budget_ms / 1000.0))
    report["entries"] = entries_with_bytes(report.pop("key_counts"), report.get("geometry"))
    return report


def entries_with_bytes(
    key_counts: list[dict[str, Any]], geometry: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The key-count rows with ``payload_bytes``: entries x bytes per entry where the geometry is known (the
    row's fingerprint is the model's and its group is one of the geometry's), else None."""
    entry_bytes: dict[int, int] = {}
    fingerprint = None
    if geometry is not None:
        fingerprint = geometry["fingerprint"]
        entry_bytes = {g["group"]: g["entry_bytes"] for g in geometry["groups"]}
    rows = []
    for row in key_counts:
        known = row["fingerprint"] == fingerprint and row["group"] in entry_bytes
        rows.append({**row, "payload_bytes": row["entries"] * entry_bytes[row["group"]] if known else None})
    return rows


# -- text --------------------------------------------------------------------------------------------------


def _size(value: object) -> str:
    """``5519136`` -> ``5.3MiB`` (exact sizes as ``format_size`` writes them)."""
    if not isinstance(value, int):
        return "-"
    exact = format_size(value)
    if not exact.endswith("B") or exact.endswith("iB") or value < 1024:
        return exact
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= factor:
            return f"{value / factor:.1f}{unit}"
    return exact


def render_text(report: dict[str, Any]) -> str:
    """The report of :func:`describe_deployment` as the text ``hybridkv describe`` prints (no trailing
    newline): store and namespace; with a geometry, the model, fingerprint, loads, weights and the per-group
    table; health; usage; entries per namespace, fingerprint and group with per-namespace totals."""
    lines = [
        f"store      {report['store']}",
        f"namespace  {report['namespace'] or '(any: no config or model)'}",
    ]
    geometry = report.get("geometry")
    if geometry is not None:
        lines += _geometry_lines(geometry)
    health = report["health"]
    lines += ["", "health"]
    if health["reachable"]:
        lines.append(
            f"reachable, exists p50 {health['exists_p50_ms']} ms, max {health['exists_max_ms']} ms "
            f"({health['exists_probes']} probes, deadline {health['exists_deadline_ms']} ms), "
            f"lookup breaker {health['breaker_state']}"
            + (f", store breaker {health['store_breaker_state']}" if "store_breaker_state" in health else "")
        )
    else:
        lines.append(f"NOT reachable: {health['error']} (lookup breaker {health['breaker_state'] or '-'})")
    if health.get("writable") is False:
        lines.append(f"NOT writable: {health['error']}")
    usage = report.get("usage")
    if usage is not None:
        capacity = usage.get("capacity_bytes")
        used = usage.get("num_bytes")
        share = f" ({100 * used / capacity:.1f}%)" if isinstance(used, int) and capacity else ""
        effective = usage.get("extra", {}).get("effective_capacity_bytes")
        lines += [
            "",
            "usage",
            f"{usage.get('num_keys')} keys, {_size(used)} of {_size(capacity)}{share}"
            + (
                f", {usage['num_other_keys']} keys not written by hybridkv"
                if usage.get("num_other_keys")
                else ""
            ),
        ]
        if isinstance(effective, int) and isinstance(capacity, int) and effective < capacity:
            # a full disk: the file system, not the configured capacity, bounds the store
            lines.append(
                f"the file system holds {_size(effective)} of it ({_size(usage['extra'].get('free_bytes'))} "
                f"free): eviction keeps the store within that"
            )
    tenants = (usage or {}).get("extra", {}).get("tenants")
    if tenants:
        lines += ["", "quotas per namespace", render_tenants(tenants)]
    entries = report["entries"]
    if entries:
        lines += ["", "entries per namespace, fingerprint and group"]
        rows = [
            {**row, "ranks": ",".join(row["ranks"]), "payload_bytes": _size(row["payload_bytes"])}
            for row in entries
        ]
        lines.append(
            format_table(rows, ["namespace", "fingerprint", "group", "entries", "ranks", "payload_bytes"])
        )
        lines.extend(f"namespace {namespace}: {total} entries" for namespace, total in _totals(entries))
    elif usage is not None:
        lines += ["", "no hybridkv entries"]
    return "\n".join(lines)


_GEOMETRY_COLUMNS = [
    "group",
    "vllm_group",
    "kind",
    "spec",
    "block",
    "span",
    "dcp_sharded",
    "layers",
    "entry_bytes",
]


def _geometry_lines(geometry: dict[str, Any]) -> list[str]:
    """The model part of the text: identity, fingerprint, geometry figures, loads, weights, per-group table."""
    return [
        f"model      {geometry['model']}",
        f"fingerprint {geometry['fingerprint']}  (keys under {geometry['key_prefix']})",
        (
            f"hash unit {geometry['hash_unit']} tokens, hit alignment {geometry['hit_alignment']}, "
            f"scheduler block {geometry['scheduler_block']}, TP {geometry['tp']}, DCP {geometry['dcp']}"
        ),
        _loads_line(geometry),
        _weights_line(geometry),
        "",
        "geometry",
        format_table(geometry["groups"], _GEOMETRY_COLUMNS),
    ]


def _loads_line(geometry: dict[str, Any]) -> str:
    """``loads on``, or ``OFF`` with the reason (saves continue either way)."""
    if geometry.get("loads", True):
        return "loads      on"
    return f"loads      OFF: {geometry.get('loads_off_reason') or 'kv_role does not load'} (saves continue)"


def _weights_line(geometry: dict[str, Any]) -> str:
    """The weights identity, or ``UNRESOLVED`` with what that means for the keys."""
    if geometry.get("weights_resolved", True):
        return f"weights    {geometry.get('weights', '-')}"
    return f"weights    UNRESOLVED: {geometry.get('weights_unresolved')}"


def _totals(rows: Iterable[dict[str, Any]]) -> list[tuple[str, int]]:
    """Entries per namespace, sorted by namespace."""
    totals: dict[str, int] = {}
    for row in rows:
        totals[row["namespace"]] = totals.get(row["namespace"], 0) + row["entries"]
    return sorted(totals.items())
