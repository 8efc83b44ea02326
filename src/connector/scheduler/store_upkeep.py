"""The scheduler half's store calls that nobody on the scheduler thread waits for, and what they make true.

Invalidation removes (``BlockRemoved`` once the removal returned; no ``BlockStored`` for a block while its
removal is pending), a namespace reset's removal (``AllBlocksCleared`` and the namespace gate reopened
once it returned; the gate stays closed when it failed), the manifest, and the store's evictions
(``BlockRemoved`` for the published blocks it evicted, ``hybridkv.connector.scheduler.store_events``): each
``take_events`` starts a drain of the store's eviction report unless one is queued, so what a step's drain
found is published with a later step. Contract: every call runs on the one maintenance thread
(``connector/scheduler/maintenance.py``); a call the full queue refuses is counted (``maintenance_dropped``) and
logged, never waited for -- a refused drain is retried at the next step; a refused check of unsure blocks
publishes nothing for them (the view may miss a block, never name one that is gone).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.scheduler.maintenance import Maintenance
from hybridkv.connector.scheduler.namespace_gate import NamespaceGate
from hybridkv.connector.scheduler.store_events import StoreBlock, StoredBlock, StoreEvents
from hybridkv.connector.stats import StatsBox
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.store.base import EvictionReporter, Evictions, Store, StoreLogEvent, find_layer
from hybridkv.store.frame import key_digest

if TYPE_CHECKING:
    from vllm.distributed.kv_events import BlockStored, KVCacheEvent

log = structlog.get_logger(__name__)


def block_digests(scheme: KeyScheme, group_index: int, block_hash: bytes) -> tuple[bytes, ...]:
    """The digests of a block's keys under ``scheme``, one per rank (what a store's eviction report names)."""
    return tuple(
        key_digest(scheme.key(group_index, rank.tp_rank, block_hash))
        for rank in scheme.geometry.topology.ranks
    )


def _reporter_of(store: Store) -> EvictionReporter | None:
    """The layer of ``store`` that reports its evictions (the memory and file backends), or None."""
    return find_layer(store, EvictionReporter)  # type: ignore[type-abstract]


def _take_evictions(reporter: EvictionReporter) -> Evictions:
    """``reporter.take_evictions()``; one that raised is a lost report (the view then drops what it holds)."""
    try:
        return reporter.take_evictions()
    except Exception as exc:  # noqa: BLE001 -- a report we cannot read must not stop the maintenance thread
        log.warning(StoreLogEvent.EVICTION_REPORT_FAILED, error=repr(exc))
        return Evictions(complete=False)


def _ignore(_fut: concurrent.futures.Future[Any]) -> None:
    """A maintenance call whose outcome is already applied (or, if it raised, deliberately left out)."""


class StoreUpkeep:
    """Invalidations, namespace removals and manifests of one scheduler half, off its thread (the store is
    the caller's: each call names it)."""

    def __init__(self, events: StoreEvents, gate: NamespaceGate, stats: StatsBox) -> None:
        self._events = events
        self._gate = gate
        self._stats = stats
        self._maintenance = Maintenance()
        #: whether an eviction drain is queued or running (at most one at a time)
        self._draining = False
        self._drain_lock = threading.Lock()
        #: the store last named and its eviction-reporting layer: found once, not on every step (a
        #: runtime-checkable protocol's isinstance walk over the store's layers is not free)
        self._store_and_reporter: tuple[Store, EvictionReporter | None] | None = None

    def _reporter(self, store: Store) -> EvictionReporter | None:
        known = self._store_and_reporter
        if known is None or known[0] is not store:
            known = self._store_and_reporter = (store, _reporter_of(store))
        return known[1]

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

    def stored(self, store: Store, scheme: KeyScheme, stored: list[tuple[int, bytes, BlockStored]]) -> None:
        """Publish the ``BlockStored`` of a wave every rank stored under ``scheme``'s keys. Where ``store``
        reports its evictions the blocks are followed, and unsure ones (``StoreEvents.stored_followed``) are
        published only after a drain and an ``exists`` of their keys here found them."""
        reporter = self._reporter(store)
        if reporter is None:
            self._events.stored(stored)
            return
        unsure = self._events.stored_followed(
            StoredBlock(group_index, block_hash, event, block_digests(scheme, group_index, block_hash))
            for group_index, block_hash, event in stored
        )
        if not unsure:
            return
        keys = [
            scheme.key(item.group_index, rank.tp_rank, item.block_hash)
            for item in unsure
            for rank in scheme.geometry.topology.ranks
        ]
        num_ranks = len(scheme.geometry.topology.ranks)

        def verify() -> None:
            # Drain first: an eviction recorded before the exists is matched now, not after the block is
            # followed (it would then remove a block stored again since).
            self._events.evicted(_take_evictions(reporter))
            statuses = store.exists(keys)
            self._events.verified(
                (item, all(st.is_ok for st in statuses[i * num_ranks : (i + 1) * num_ranks]))
                for i, item in enumerate(unsure)
            )

        self.submit(verify, _ignore)  # an exists that raised: nothing published for them

    def take_events(self, store: Store) -> list[KVCacheEvent]:
        """Every event queued so far (``StoreEvents.take``); first, where ``store`` reports its evictions,
        a drain of its report is queued unless one is queued already (its events go with a later call)."""
        reporter = self._reporter(store)
        if reporter is not None:
            self._drain(reporter)
        return self._events.take()

    def _drain(self, reporter: EvictionReporter) -> None:
        with self._drain_lock:
            if self._draining:
                return
            self._draining = True

        def drain() -> None:
            with self._drain_lock:
                self._draining = False  # from here on, evictions recorded are for the next drain
            self._events.evicted(_take_evictions(reporter))

        if self.submit(drain, _ignore) is None:
            with self._drain_lock:
                self._draining = False

    def wait(self, timeout: float) -> bool:
        """Wait until every call queued so far returned (tests, shutdown)."""
        return self._maintenance.wait(timeout)

    def shutdown(self) -> None:
        self._maintenance.shutdown()
