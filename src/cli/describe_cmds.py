"""``hybridkv describe``: what an operator needs to know about a deployment's tier, before and during serving.

Given the connector's ``kv_connector_extra_config`` (or only a store URL) and optionally the model, it prints

- the resolved geometry per store group (kind, vLLM block, span, DCP sharding, bytes per entry) with the
  hash unit, hit alignment, key fingerprint and namespace -- resolved by vLLM itself: an in-process engine
  (CPU build works) starts with the connector on a private ``memory://`` store, and
  ``hybridkv.connector.vllm_geometry.resolve_geometry`` reads its ``kv_cache_config``; with it, whether
  that engine loads from the tier (off, with the reason, where vLLM disabled prefix caching or the attention
  backend cannot use external KV: ``hybridkv.connector.capabilities``) and whether the model's weights were
  found (an unresolved identity keys the model by its id and revision only);
- the store's health: reachable, latency of an existence check on a random key under a deadline (the
  connector's ``lookup_budget_ms``), the state a lookup breaker would be in after those probes, and the
  backend's own breaker when it has one (Mooncake);
- usage and capacity, and entries per namespace / fingerprint / group / rank, parsed from the keys
  (``hkv1/<namespace>/<fingerprint>/g<group>/tp<r>/dcp<r>/<hash>``); with a model, bytes per group.

It only reads: existence checks, key listing, stats. A ``file://`` store whose directory does not exist is
reported absent, not created.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.lifecycle.keys import parse_block_key
from hybridkv.store.params import format_size
from hybridkv.tables import format_table


def register(
    subparsers: argparse._SubParsersAction[Any], bench_subparsers: argparse._SubParsersAction[Any]
) -> None:
    del bench_subparsers
    describe = subparsers.add_parser(
        "describe",
        help="geometry, fingerprint, store health, usage and entries of a deployment (read-only)",
        description="Describe a deployment's external tier from its kv_connector_extra_config (or a store "
        "URL) and, optionally, its model: the geometry vLLM resolves per group, the key fingerprint and "
        "namespace, the store's health (reachable, existence-check latency, breaker), usage and capacity, "
        "and entries per namespace and group. Never writes to the store. Exit 0: healthy, 1: the store is "
        "unreachable or absent, 2: bad input.",
    )
    describe.add_argument(
        "--config",
        metavar="JSON",
        help="the connector's kv_connector_extra_config as JSON, or @FILE to read it from a file",
    )
    describe.add_argument("--store", metavar="URL", help="store URL (overrides the config's `store`)")
    describe.add_argument(
        "--model",
        metavar="PATH",
        help="the served model: start an in-process vLLM engine to resolve the real KV-cache geometry",
    )
    describe.add_argument("--dtype", default="bfloat16", help="engine dtype with --model (%(default)s)")
    describe.add_argument(
        "--attention-backend",
        metavar="NAME",
        help="engine attention backend with --model, as vLLM's --attention-backend (default: vLLM picks)",
    )
    describe.add_argument(
        "--max-model-len", type=int, default=2048, help="engine max_model_len with --model (%(default)s)"
    )
    describe.add_argument("--probes", type=int, default=5, help="existence checks to time (%(default)s)")
    describe.add_argument("--json", action="store_true", help="print one JSON object")
    describe.set_defaults(func=_describe)


def _describe(args: argparse.Namespace) -> int:
    try:
        extra = _read_config(args.config)
        store_url, namespace, budget_ms = _connector_settings(extra, args.store, args.model)
    except ValueError as error:
        print(f"hybridkv describe: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.probes < 1:
        print(f"hybridkv describe: --probes must be >= 1, got {args.probes}", file=sys.stderr)
        return EXIT_USAGE
    report: dict[str, Any] = {"store": store_url, "namespace": namespace}
    if args.model is not None:
        try:
            report["geometry"] = describe_model_geometry(
                args.model,
                extra,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                attention_backend=args.attention_backend,
            )
        except ValueError as error:
            print(f"hybridkv describe: {error}", file=sys.stderr)
            return EXIT_USAGE
        namespace = report["namespace"] = report["geometry"]["namespace"]
    report.update(describe_store(store_url, probes=args.probes, deadline_s=budget_ms / 1000.0))
    report["entries"] = _entries_with_bytes(report.pop("key_counts"), report.get("geometry"))
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(render_text(report))
    return EXIT_OK if report["health"]["reachable"] else EXIT_PROBLEM


def _read_config(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"--config {text}: cannot read: {error.strerror}") from None
    try:
        extra = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--config: not JSON: {error}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--config: expected a JSON object (kv_connector_extra_config), got {extra!r}")  # noqa: TRY004
    # The whole kv_transfer_config pasted: take its extra config.
    nested = extra.get("kv_connector_extra_config")
    return dict(nested) if isinstance(nested, dict) else extra


def _connector_settings(
    extra: dict[str, Any], store_override: str | None, model: str | None
) -> tuple[str, str | None, float]:
    """(store URL, namespace or None when neither the config nor a model names one, lookup budget ms)."""
    from hybridkv.connector.config import ConnectorConfig

    if store_override is not None:
        extra = {**extra, "store": store_override}
    # The connector's own validation: the same errors, naming the same keys, as at engine start.
    cfg = ConnectorConfig.from_extra_config(extra, model=model or "unnamed")
    namespace = cfg.namespace if (model is not None or "namespace" in extra) else None
    return cfg.store, namespace, cfg.lookup_budget_ms


# -- geometry (a real engine) ------------------------------------------------------------------------------


def describe_model_geometry(
    model: str,
    extra: dict[str, Any],
    *,
    dtype: str,
    max_model_len: int,
    attention_backend: str | None = None,
) -> dict[str, Any]:
    """Start an in-process engine on ``model`` with the connector on a private ``memory://`` store (so the
    described store is never touched) and resolve the geometry from vLLM's own ``kv_cache_config``; also
    whether that engine's connector loads (``loads``, ``loads_off_reason``) and whether the model identity
    found the weights (``weights``, ``weights_resolved``, ``weights_unresolved``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from hybridkv.connector import inprocess
    from hybridkv.connector.capabilities import load_disabled_reason
    from hybridkv.connector.identity import UNRESOLVED_DETAIL

    engine_extra = {k: v for k, v in extra.items() if k != "audit_log"}
    engine_extra["store"] = f"memory://hybridkv-describe-{secrets.token_hex(4)}"
    transfer = inprocess.connector_transfer_config(engine_extra)
    kwargs = inprocess.engine_kwargs(
        max_model_len=max_model_len, kv_cache_bytes=64 << 20, dtype=dtype, max_num_seqs=1
    )
    if attention_backend is not None:
        kwargs["attention_backend"] = attention_backend
    # vLLM logs to stdout; `describe --json | jq` must see only the JSON.
    with (
        _stdout_to_stderr(),
        inprocess.inprocess_engine(Path(model), transfer, use_tqdm_on_load=False, **kwargs) as llm,
    ):
        # The serving connector resolved the geometry from vLLM's own kv_cache_config at start.
        scheduler_connector, _ = inprocess.connector_halves(llm)
        side = scheduler_connector.scheduler_side
        geo = side.geo
        # The engine's config after vLLM's fix-ups: what the connector itself judged at start.
        loads_off_reason = load_disabled_reason(llm.llm_engine.vllm_config)
        kv_cache_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        geometry = geo.geometry
        groups = []
        for info, spec in zip(geo.groups, geometry.groups, strict=True):
            vllm_group = kv_cache_config.kv_cache_groups[info.gid]
            groups.append(
                {
                    "group": info.sgid,
                    "vllm_group": info.gid,
                    "kind": info.kind.value,
                    "spec": info.spec_name,
                    "block": spec.block_size,
                    "span": info.span,
                    "dcp_sharded": spec.dcp_sharded,
                    "layers": len(info.layer_names),
                    "entry_bytes": _entry_bytes(info.sgid, vllm_group),
                }
            )
        return {
            "model": model,
            "namespace": geo.scheme.namespace,
            "fingerprint": geo.scheme.fingerprint,
            "key_prefix": geo.scheme.geometry_prefix,
            "hash_unit": geometry.hash_unit,
            "hit_alignment": geometry.hit_alignment,
            "scheduler_block": geometry.scheduler_block_size,
            "tp": geometry.topology.tp_size,
            "dcp": geometry.topology.dcp_size,
            "loads": side.can_load,
            "loads_off_reason": None if side.can_load else loads_off_reason,
            "weights": geo.identity.weights,
            "weights_resolved": geo.identity.resolved,
            "weights_unresolved": None if geo.identity.resolved else UNRESOLVED_DETAIL,
            "groups": groups,
        }


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what the engine prints -- vLLM's logger handlers and anything written to fd 1 -- to stderr."""
    swapped: list[tuple[logging.StreamHandler[Any], Any]] = [
        (handler, handler.setStream(sys.stderr))
        for handler in logging.getLogger("vllm").handlers
        if isinstance(handler, logging.StreamHandler) and handler.stream is not sys.stderr
    ]
    saved_stream = os.environ.get("VLLM_LOGGING_STREAM")
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # a handler vLLM configures meanwhile
    sys.stdout.flush()
    saved_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        for handler, stream in swapped:
            handler.setStream(stream)
        if saved_stream is None:
            os.environ.pop("VLLM_LOGGING_STREAM", None)
        else:
            os.environ["VLLM_LOGGING_STREAM"] = saved_stream


def _entry_bytes(sgid: int, vllm_group: Any) -> int:
    """Payload bytes of one entry on one rank: what the engine's worker connector moves per block of the
    group (its registered KV-cache views); from vLLM's unpadded page sizes if that is not reachable."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker_side = getattr(get_kv_transfer_group(), "worker_side", None)
    if worker_side is not None and hasattr(worker_side, "block_nbytes"):
        return int(worker_side.block_nbytes(sgid))
    spec = vllm_group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    specs = (
        [per_layer[name] for name in vllm_group.layer_names]
        if isinstance(per_layer, dict)
        else [spec] * len(vllm_group.layer_names)
    )
    return sum(int(getattr(s, "real_page_size_bytes", s.page_size_bytes)) for s in specs)


# -- the store (read-only) ---------------------------------------------------------------------------------


def describe_store(url: str, *, probes: int, deadline_s: float) -> dict[str, Any]:
    """``health``, ``usage`` and ``key_counts`` of the store at ``url``; never writes to it."""
    from hybridkv.store import StoreError, open_store
    from hybridkv.store.url import absent_store

    try:
        absent = absent_store(url)
    except StoreError:
        absent = None  # a bad URL: opening it below reports the error
    if absent is not None:
        return {
            "health": {
                "reachable": False,
                "error": f"{absent} (describe does not create one)",
                "breaker_state": None,
            },
            "usage": None,
            "key_counts": [],
        }
    try:
        store = open_store(url)
    except StoreError as error:
        return {
            "health": {"reachable": False, "error": str(error), "breaker_state": None},
            "usage": None,
            "key_counts": [],
        }
    with store:
        health = _probe(store, probes=probes, deadline_s=deadline_s)
        usage: dict[str, Any] | None = None
        counts: dict[tuple[str, str, int], dict[str, Any]] = {}
        num_other_keys = 0
        if health["reachable"]:
            stats = store.stats()
            usage = dataclasses.asdict(stats)
            breaker = stats.extra.get("breaker_state")
            if breaker is not None:
                health["store_breaker_state"] = breaker
            for key in store.iter_keys(""):
                parsed = parse_block_key(key)
                if parsed is None:
                    num_other_keys += 1
                    continue
                where = (parsed.namespace, parsed.fingerprint, parsed.group_index)
                row = counts.setdefault(where, {"entries": 0, "ranks": set()})
                row["entries"] += 1
                row["ranks"].add(f"tp{parsed.tp_rank}/dcp{parsed.dcp_rank}")
            if usage is not None:
                usage["num_other_keys"] = num_other_keys
    key_counts = [
        {
            "namespace": namespace,
            "fingerprint": fingerprint,
            "group": group,
            "entries": row["entries"],
            "ranks": sorted(row["ranks"]),
        }
        for (namespace, fingerprint, group), row in sorted(counts.items())
    ]
    return {"health": health, "usage": usage, "key_counts": key_counts}


def _probe(store: Any, *, probes: int, deadline_s: float) -> dict[str, Any]:
    """Time ``probes`` existence checks of a random absent key, each under ``deadline_s``; feed a lookup
    breaker configured like the connector's (one failure opens it) and report its state."""
    from hybridkv.store.breaker import CircuitBreaker, DeadlineExceeded, DeadlineRunner

    runner = DeadlineRunner(name="hybridkv-describe", max_workers=1)
    breaker = CircuitBreaker(num_failures_to_open=1, reset_s=3600.0)
    latencies_ms: list[float] = []
    errors: list[str] = []
    for _ in range(probes):
        key = f"hkv1/describe-probe/{secrets.token_hex(6)}/g0/tp0/dcp0/{secrets.token_hex(16)}"
        start = time.perf_counter()
        try:
            (status,) = runner.run(partial(store.exists, [key]), deadline_s)
        except DeadlineExceeded:
            errors.append(f"exists did not answer within {deadline_s * 1000:.0f} ms")
            breaker.on_failure()
            break  # a hung store: one deadline is enough to know
        except Exception as error:  # noqa: BLE001 -- a probe reports whatever the backend raises
            errors.append(f"exists raised {type(error).__name__}: {error}")
            breaker.on_failure()
            continue
        latencies_ms.append((time.perf_counter() - start) * 1000)
        if status.value in ("ok", "not_found"):
            breaker.on_success()
        else:
            errors.append(f"exists answered {status.value}")
            breaker.on_failure()
    runner.shutdown()
    return {
        "reachable": bool(latencies_ms) and not errors,
        "error": "; ".join(errors) or None,
        "breaker_state": breaker.state.value,
        "exists_probes": len(latencies_ms),
        "exists_deadline_ms": round(deadline_s * 1000, 3),
        "exists_p50_ms": round(statistics.median(latencies_ms), 3) if latencies_ms else None,
        "exists_max_ms": round(max(latencies_ms), 3) if latencies_ms else None,
    }


def _entries_with_bytes(
    key_counts: list[dict[str, Any]], geometry: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """Bytes per row where the geometry is known (the model's fingerprint): entries x bytes per entry."""
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
    lines = [
        f"store      {report['store']}",
        f"namespace  {report['namespace'] or '(any: no config or model)'}",
    ]
    geometry = report.get("geometry")
    if geometry is not None:
        lines += [
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
            format_table(
                geometry["groups"],
                [
                    "group",
                    "vllm_group",
                    "kind",
                    "spec",
                    "block",
                    "span",
                    "dcp_sharded",
                    "layers",
                    "entry_bytes",
                ],
            ),
        ]
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
    usage = report.get("usage")
    if usage is not None:
        capacity = usage.get("capacity_bytes")
        used = usage.get("num_bytes")
        share = f" ({100 * used / capacity:.1f}%)" if isinstance(used, int) and capacity else ""
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
        for namespace, total in _totals(entries):
            lines.append(f"namespace {namespace}: {total} entries")
    elif usage is not None:
        lines += ["", "no hybridkv entries"]
    return "\n".join(lines)


def _loads_line(geometry: dict[str, Any]) -> str:
    if geometry.get("loads", True):
        return "loads      on"
    return f"loads      OFF: {geometry.get('loads_off_reason') or 'kv_role does not load'} (saves continue)"


def _weights_line(geometry: dict[str, Any]) -> str:
    if geometry.get("weights_resolved", True):
        return f"weights    {geometry.get('weights', '-')}"
    return f"weights    UNRESOLVED: {geometry.get('weights_unresolved')}"


def _totals(rows: Iterable[dict[str, Any]]) -> list[tuple[str, int]]:
    totals: dict[str, int] = {}
    for row in rows:
        totals[row["namespace"]] = totals.get(row["namespace"], 0) + row["entries"]
    return sorted(totals.items())
