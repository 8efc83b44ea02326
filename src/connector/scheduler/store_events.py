"""The KV-cache events the connector publishes about the store tier (vLLM's ``take_events``).

``BlockStored`` when every rank stored a save wave's block, ``BlockRemoved`` when an invalidation removal
returned or the store evicted a published block, ``AllBlocksCleared`` when a namespace reset's removal
returned; every event names the store tier as its medium (vLLM's ``MEDIUM_STORAGE``).

Contract: an event is only published when it is true when published -- a block whose removal is still
pending publishes no ``BlockStored`` (the removal may land after the put). Maintenance callbacks (other
threads) and the scheduler thread share this object; every method takes its lock.

The view a subscriber builds (stored minus removed) follows the store's evictions where the store reports
them (``hybridkv.store.base.EvictionReporter``: the memory and file stores). Then every published block is
*tracked* with the digests of its keys (one per rank): an eviction of any of them publishes
``BlockRemoved`` for the block once (``evicted``). What the view guarantees, per engine: every block in it
was stored by this engine and is still in the store, up to the evictions not drained yet; the view may
miss a block the store holds (never the other way), in these cases, each published as ``BlockRemoved``:

- more than ``MAX_TRACKED_BLOCKS`` blocks published: the oldest leaves the view (it is no longer followed);
- the store's report lost evictions (``Evictions.complete`` false): every tracked block leaves the view;
- an eviction reported for a key that was stored again before the report was read.

The race a view must not lose: a block evicted after its put but before every rank's report reached the
scheduler. Its eviction may be drained before the block is published, and would then match nothing. So an
eviction that matches no tracked block is remembered for ``RECENT_EVICTIONS_S`` (at most
``MAX_RECENT_EVICTIONS``), and a block to publish with a key among them is *unsure*: it is published only
after a drain and an ``exists`` of its keys on the maintenance thread found it (``verified``). After a lost
report every block is unsure for that long.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridkv.connector.vllm_geometry import ConnectorGeometry
from hybridkv.store.base import Evictions

if TYPE_CHECKING:
    from vllm.distributed.kv_events import BlockStored, KVCacheEvent

#: (store group index, block hash): one block of the store tier
StoreBlock = tuple[int, bytes]

#: The medium every event of this tier names (vLLM's ``MEDIUM_STORAGE``).
MEDIUM = "STORAGE"
#: Published blocks followed for evictions at most, per engine (the oldest leaves the view past it).
MAX_TRACKED_BLOCKS = 1 << 16
#: How long (s) an eviction that matched no tracked block makes a block with that key unsure, and how many
#: such evictions are remembered at most. Longer than a save wave's put-to-report time, by far.
RECENT_EVICTIONS_S = 60.0
MAX_RECENT_EVICTIONS = 1 << 16


@dataclass(frozen=True)
class StoredBlock:
    """A block every rank stored, about to be published: its ``BlockStored`` and its keys' digests."""

    group_index: int
    block_hash: bytes
    event: BlockStored
    #: the digests (``hybridkv.store.frame.key_digest``) of its keys, one per rank
    digests: tuple[bytes, ...]

    @property
    def block(self) -> StoreBlock:
        return (self.group_index, self.block_hash)


class StoreEvents:
    """The queue of store-tier events, the removals they wait for, and the published blocks followed for
    evictions (see the module docstring)."""

    def __init__(self, geo: ConnectorGeometry, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the monotonic clock the unsure window is measured on (tests pass their own)."""
        self._geo = geo
        self._clock = clock
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []
        #: blocks whose invalidation removal has not returned yet
        self._removals_pending: set[StoreBlock] = set()
        #: published blocks followed for evictions, oldest first, with their keys' digests
        self._tracked: OrderedDict[StoreBlock, tuple[bytes, ...]] = OrderedDict()
        self._block_of: dict[bytes, StoreBlock] = {}
        #: evictions that matched no tracked block: digest -> when drained (``clock``), oldest first
        self._recent: OrderedDict[bytes, float] = OrderedDict()
        #: after a lost report, every block to publish is unsure until then (``clock``)
        self._unsure_until = float("-inf")
        #: ``BlockRemoved`` published for evictions; blocks that left the view unevicted (bound, lost report)
        self.num_evicted_published = 0
        self.num_dropped_from_view = 0
        #: reports that lost evictions; blocks published only after ``verified``
        self.num_lost_reports = 0
        self.num_unsure = 0

    def removal_started(self, blocks: Iterable[StoreBlock]) -> None:
        with self._lock:
            self._removals_pending.update(blocks)

    def removal_ended(self, blocks: Iterable[StoreBlock], *, removed: bool) -> None:
        """The removal returned (``removed``: it ran; then ``BlockRemoved`` for each block) or never ran."""
        blocks = list(blocks)
        with self._lock:
            self._removals_pending.difference_update(blocks)
            if removed:
                for block in blocks:
                    self._untrack(block)
                    self._removed(block)

    def stored(self, stored: Iterable[tuple[int, bytes, BlockStored]]) -> None:
        """Queue the ``BlockStored`` events of a wave every rank stored, but none for a block whose
        removal is pending. For a store that reports no evictions: nothing is followed."""
        with self._lock:
            self._events.extend(
                event
                for group_index, block_hash, event in stored
                if (group_index, block_hash) not in self._removals_pending
            )

    def stored_followed(self, stored: Iterable[StoredBlock]) -> list[StoredBlock]:
        """``stored`` for a store that reports its evictions: each block is published and followed, unless
        its removal is pending, or it is unsure (returned: publish it only once ``verified``)."""
        unsure: list[StoredBlock] = []
        with self._lock:
            now = self._clock()
            self._forget_old_evictions(now)
            recent = self._recent
            for item in stored:
                if item.block in self._removals_pending:
                    continue
                if now < self._unsure_until or any(digest in recent for digest in item.digests):
                    unsure.append(item)
                    continue
                self._publish(item)
            self.num_unsure += len(unsure)
        return unsure

    def verified(self, items: Iterable[tuple[StoredBlock, bool]]) -> None:
        """Unsure blocks after a drain and an ``exists`` of their keys (maintenance thread): each one found
        (``True``) is published and followed; the others are not stored, so nothing is published."""
        with self._lock:
            for item, present in items:
                if not present or item.block in self._removals_pending:
                    continue
                for digest in item.digests:  # found after its eviction: that one is over
                    self._recent.pop(digest, None)
                self._publish(item)

    def evicted(self, evictions: Evictions) -> int:
        """The store evicted these keys: ``BlockRemoved`` for each tracked block with a key among them (once),
        and, when the report lost evictions, for every tracked block. Returns the ``BlockRemoved`` queued."""
        with self._lock:
            now = self._clock()
            num_removed = 0
            if not evictions.complete:
                self.num_lost_reports += 1
                self._unsure_until = now + RECENT_EVICTIONS_S
                for block in list(self._tracked):
                    self._untrack(block)
                    self._removed(block)
                    self.num_dropped_from_view += 1
                    num_removed += 1
            for digest in evictions.digests:
                evicted = self._block_of.get(digest)
                if evicted is None:
                    self._recent[digest] = now
                    self._recent.move_to_end(digest)
                    continue
                self._untrack(evicted)
                self._removed(evicted)
                self.num_evicted_published += 1
                num_removed += 1
            self._forget_old_evictions(now)
            return num_removed

    def all_cleared(self, reopen: Callable[[], None]) -> None:
        """Queue ``AllBlocksCleared`` (a namespace reset's removal returned) and run ``reopen`` (the
        namespace gate's) under the same lock: no ``BlockStored`` of the reopened namespace is queued
        before it."""
        from vllm.distributed.kv_events import AllBlocksCleared

        with self._lock:
            reopen()
            self._tracked.clear()
            self._block_of.clear()
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """Every event queued since the previous call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events

    @property
    def num_tracked(self) -> int:
        """Published blocks followed for evictions now."""
        with self._lock:
            return len(self._tracked)

    # All methods below are called with ``_lock`` held.

    def _publish(self, item: StoredBlock) -> None:
        """Queue ``item``'s ``BlockStored`` and follow it (the oldest followed block leaves past the bound)."""
        self._events.append(item.event)
        block = item.block
        if block in self._tracked:
            self._tracked.move_to_end(block)
            return
        self._tracked[block] = item.digests
        for digest in item.digests:
            self._block_of[digest] = block
        while len(self._tracked) > MAX_TRACKED_BLOCKS:
            oldest = next(iter(self._tracked))
            self._untrack(oldest)
            self._removed(oldest)  # no longer followed: it must not stay in the view unfollowed
            self.num_dropped_from_view += 1

    def _untrack(self, block: StoreBlock) -> None:
        for digest in self._tracked.pop(block, ()):
            if self._block_of.get(digest) == block:
                del self._block_of[digest]

    def _removed(self, block: StoreBlock) -> None:
        from vllm.distributed.kv_events import BlockRemoved

        group_index, block_hash = block
        self._events.append(
            BlockRemoved(
                block_hashes=[block_hash],
                medium=MEDIUM,
                group_idx=self._geo.groups[group_index].vllm_group_index,
            )
        )

    def _forget_old_evictions(self, now: float) -> None:
        recent = self._recent
        while recent and (
            len(recent) > MAX_RECENT_EVICTIONS or next(iter(recent.values())) < now - RECENT_EVICTIONS_S
        ):
            recent.popitem(last=False)
