"""A store's health, usage and hybridkv entries, read without writing (the store part of a describe report).

Contracts:

- Only reads: existence checks of random absent keys, key listing, stats. A ``file://`` store whose
  directory does not exist is reported absent, not created.
- Health: reachable, latency of an existence check under a deadline (the connector's ``lookup_budget_ms``),
  the state a lookup breaker configured like the connector's would be in after those probes, and the
  backend's own breaker when it has one (Mooncake).
- Entries are counted per namespace / fingerprint / group, with the ranks seen, from the keys
  (``hkv1/<namespace>/<fingerprint>/g<group>/tp<r>/dcp<r>/<hash>``); the deployments' manifests (hybridkv's
  own bookkeeping, ``hybridkv.connector.identity``) and other tools' keys are only counted, apart.
"""

from __future__ import annotations

import dataclasses
import secrets
import statistics
import time
from functools import partial
from typing import Any

from hybridkv.key_grammar import parse_block_key

__all__ = ["describe_store"]


def describe_store(url: str, *, probes: int, deadline_s: float) -> dict[str, Any]:
    """``health``, ``usage`` and ``key_counts`` of the store at ``url``; never writes to it.

    ``health``: ``reachable``, ``error`` (None when reachable and writable), ``breaker_state`` (None when the
    store could not be opened) and, once opened, the probe figures (``exists_probes``,
    ``exists_deadline_ms``, ``exists_p50_ms``, ``exists_max_ms``), ``store_breaker_state`` where the backend
    reports one, and ``writable: False`` (with ``error`` saying why) where the backend's stats say it cannot
    write (``cannot_write``: a ``file://`` store on a full file system with nothing left to evict).
    ``usage``: the backend's ``StoreStats`` as a dict plus ``num_manifests`` (hybridkv's deployment
    manifests) and ``num_other_keys`` (keys hybridkv did not write), or None when unreachable.
    ``key_counts``: one row per (namespace, fingerprint, group), sorted, with ``entries`` and ``ranks``.
    A store that is absent or cannot be opened is reported in ``health``; a backend error while listing or
    reading stats of a reachable store propagates."""
    from hybridkv.connector.identity import parse_manifest_key
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
        store = open_store(url, operator=True)
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
        num_manifests = 0
        if health["reachable"]:
            stats = store.stats()
            usage = dataclasses.asdict(stats)
            breaker = stats.extra.get("breaker_state")
            if breaker is not None:
                health["store_breaker_state"] = breaker
            if stats.extra.get("cannot_write"):
                health["writable"] = False
                health["error"] = (
                    f"cannot write: the file system has {stats.extra.get('free_bytes')} bytes free and the "
                    f"store holds {stats.num_bytes} bytes to evict, less than one entry"
                )
            for key in store.iter_keys(""):
                parsed = parse_block_key(key)
                if parsed is None:
                    if parse_manifest_key(key) is not None:
                        num_manifests += 1
                    else:
                        num_other_keys += 1
                    continue
                where = (parsed.namespace, parsed.fingerprint, parsed.group_index)
                row = counts.setdefault(where, {"entries": 0, "ranks": set()})
                row["entries"] += 1
                row["ranks"].add(f"tp{parsed.tp_rank}/dcp{parsed.dcp_rank}")
            if usage is not None:
                usage["num_manifests"] = num_manifests
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
