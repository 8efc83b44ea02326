"""The KV-cache events the connector publishes about the store tier (vLLM's ``take_events``).

``BlockStored`` when every rank stored a save wave's block, ``BlockRemoved`` when an invalidation removal
returned. Contract: an event is only published when it is true when published -- a block whose removal is
still pending publishes no ``BlockStored`` (the removal may land after the put). Maintenance callbacks
(other threads) and the scheduler thread share this object; every method takes its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from hybridkv.connector.vllm_geometry import ConnectorGeometry

if TYPE_CHECKING:
    from vllm.distributed.kv_events import BlockStored, KVCacheEvent

#: (store group index, block hash): one block of the store tier
StoreBlock = tuple[int, bytes]


class StoreEvents:
    """The queue of store-tier events, and the removals they wait for."""

    def __init__(self, geo: ConnectorGeometry) -> None:
        self._geo = geo
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []
        #: blocks whose invalidation removal has not returned yet
        self._removals_pending: set[StoreBlock] = set()

    def removal_started(self, blocks: Iterable[StoreBlock]) -> None:
        with self._lock:
            self._removals_pending.update(blocks)

    def removal_ended(self, blocks: Iterable[StoreBlock], *, removed: bool) -> None:
        """The removal returned (``removed``: it ran; then ``BlockRemoved`` for each block) or never ran."""
        from vllm.distributed.kv_events import BlockRemoved

        blocks = list(blocks)
        with self._lock:
            self._removals_pending.difference_update(blocks)
            if removed:
                self._events.extend(
                    BlockRemoved(
                        block_hashes=[block_hash],
                        medium="STORAGE",
                        group_idx=self._geo.groups[group_index].vllm_group_index,
                    )
                    for group_index, block_hash in blocks
                )

    def stored(self, stored: Iterable[tuple[int, bytes, BlockStored]]) -> None:
        """Queue the ``BlockStored`` events of a wave every rank stored, but none for a block whose
        removal is pending."""
        with self._lock:
            self._events.extend(
                event
                for group_index, block_hash, event in stored
                if (group_index, block_hash) not in self._removals_pending
            )

    def all_cleared(self, reopen: Callable[[], None]) -> None:
        """Queue ``AllBlocksCleared`` (a namespace reset's removal returned) and run ``reopen`` (the
        namespace gate's) under the same lock: no ``BlockStored`` of the reopened namespace is queued
        before it."""
        from vllm.distributed.kv_events import AllBlocksCleared

        with self._lock:
            reopen()
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """Every event queued since the previous call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events
