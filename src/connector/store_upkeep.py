"""The scheduler half's store calls that nobody on the scheduler thread waits for, and what they make true.

Invalidation removes (``BlockRemoved`` once the removal returned; no ``BlockStored`` for a block while its
removal is pending), a namespace reset's removal (``AllBlocksCleared`` and the namespace gate reopened
once it returned; the gate stays closed when it failed) and the manifest. Contract: every call runs on
the one maintenance thread (``connector/maintenance.py``); a call the full queue refuses is counted
(``maintenance_dropped``) and logged, never waited for.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import structlog
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.maintenance import Maintenance
from hybridkv.connector.namespace_gate import NamespaceGate
from hybridkv.connector.stats import StatsBox
from hybridkv.connector.store_events import StoreBlock, StoreEvents
from hybridkv.store.base import Store

log = structlog.get_logger(__name__)


class StoreUpkeep:
    """Invalidations, namespace removals and manifests of one scheduler half, off its thread (the store is
    the caller's: each call names it)."""

    def __init__(self, events: StoreEvents, gate: NamespaceGate, stats: StatsBox) -> None:
        self._events = events
        self._gate = gate
        self._stats = stats
        self._maintenance = Maintenance()

    def submit(
        self, fn: Callable[[], Any], on_done: Callable[[concurrent.futures.Future[Any]], None]
    ) -> concurrent.futures.Future[Any] | None:
        """``Maintenance.submit``, counting a call the full queue refused (``maintenance_dropped``)."""
        fut = self._maintenance.submit(fn, on_done)
        if fut is None:
            self._stats.add("maintenance_dropped")
        return fut

    def invalidate(self, store: Store, keys: list[str], blocks: list[StoreBlock]) -> None:
        """Remove known-bad entries from ``store``; ``BlockRemoved`` for ``blocks`` once the removal returned. While it is
        pending, save waves that finish for them publish nothing (the removal may land after their put)."""
        self._events.removal_started(blocks)

        def removed(fut: concurrent.futures.Future[Any]) -> None:
            exc = fut.exception()
            self._events.removal_ended(blocks, removed=exc is None)
            if exc is not None:
                log.warning(ConnectorLogEvent.INVALIDATION_FAILED, error=repr(exc), num_keys=len(keys))
                return
            self._stats.add("invalidated_entries", sum(1 for st in fut.result() if st.is_ok))

        if self.submit(lambda: store.remove(keys), removed) is None:
            self._events.removal_ended(blocks, removed=False)
            log.warning(ConnectorLogEvent.INVALIDATION_DROPPED, num_keys=len(keys))

    def remove_namespace(
        self, store: Store, prefix: str, publish_manifest: Callable[[], None]
    ) -> concurrent.futures.Future[Any] | None:
        """A reset's removal of every key under ``prefix`` (the gate closed by the caller), then the
        manifest again (it went with the namespace). The gate reopens when the removal returned, with
        ``AllBlocksCleared``; it stays closed when it failed. None: the queue refused it (gate closed)."""

        def remove() -> int:
            removed = store.remove_prefix(prefix)
            publish_manifest()
            return removed

        def cleared(fut: concurrent.futures.Future[Any]) -> None:
            exc = fut.exception()
            if exc is not None:
                self._gate.end_reset(ok=False)
                log.warning(ConnectorLogEvent.RESET_CACHE_FAILED, error=repr(exc))
                return
            self._events.all_cleared(reopen=lambda: self._gate.end_reset(ok=True))
            log.info(ConnectorLogEvent.RESET_CACHE, prefix=prefix, removed=fut.result())

        fut = self.submit(remove, cleared)
        if fut is None:
            self._gate.end_reset(ok=False)
            log.warning(ConnectorLogEvent.RESET_CACHE_DROPPED)
        return fut

    def wait(self, timeout: float) -> bool:
        """Wait until every call queued so far returned (tests, shutdown)."""
        return self._maintenance.wait(timeout)

    def shutdown(self) -> None:
        self._maintenance.shutdown()
