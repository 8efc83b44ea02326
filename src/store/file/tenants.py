"""The tenants of a file store under the directory's quotas (``hybridkv.store.quotas``), as one handle sees
them.

Contract: :class:`FileTenants` reads the directory's quota file (re-read when it changes: one ``stat`` per put
batch), decides which frames of a put its tenants' quotas let it write (``apply_to_put``), reserves their
bytes in the directory's shared ledger and runs a tenant's eviction pass when its estimate passes its quota
(both ``FileLayout``'s, ``hybridkv.store.file.ledger``), takes removed entries off their tenant's estimate,
and keeps this process's counters per tenant (refused puts, quota evictions) for ``stats`` and
``tenant_counters``. It moves no value bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import structlog
from hybridkv.key_grammar import namespace_of
from hybridkv.store.base import Status, StoreError, StoreLogEvent
from hybridkv.store.file.deadline import DeadlineGuard
from hybridkv.store.file.layout import FileLayout
from hybridkv.store.frame import key_digest
from hybridkv.store.quotas import OTHER_TENANTS, QUOTAS_FILE, TenantCounters, read_quotas

log = structlog.get_logger(__name__)


class FileTenants:
    """One handle's quotas, reservations and tenant counters over a store directory. Thread-safe."""

    def __init__(self, url: str, directory: Path, layout: FileLayout, guard: DeadlineGuard) -> None:
        self.url = url
        self.directory = directory
        self.layout = layout
        self._guard = guard
        self._lock = threading.Lock()
        #: The directory's quotas as last read, and the quota file's (mtime_ns, inode, size) they came from.
        self.quotas: dict[str, int] = {}
        self._quotas_stamp: tuple[int, int, int] | None = None
        #: This process's counters per namespace that has (or had) a quota.
        self._namespace_to_counters: dict[str, TenantCounters] = {}
        #: What ``tenant_counters`` last read (quotas, estimates per namespace, usage, spare), and whether a
        #: read is running (at most one: a read hung past the deadline is not joined by more).
        self._last_estimates: tuple[dict[str, int], dict[str, int], int, int] = ({}, {}, 0, 0)
        self._estimates_reading = False
        #: The quota file's stamp under which this handle last found every tenant's estimate rebuilt.
        self._settled_stamp: tuple[int, int, int] | None = None
        #: Reservation ids (``SharedLedger.reserve``): unique across processes and handles.
        self._reservation_prefix = uuid.uuid4().hex
        self._reservation_ids = itertools.count()

    def current(self) -> dict[str, int]:
        """The directory's quotas, re-read when the quota file changed (one ``stat`` per put batch)."""
        try:
            info = os.stat(self.directory / QUOTAS_FILE)
        except FileNotFoundError:
            self.quotas, self._quotas_stamp = {}, None
            return self.quotas
        except OSError:
            return self.quotas  # unreadable right now: the quotas last read stay in force
        stamp = (info.st_mtime_ns, info.st_ino, info.st_size)
        if stamp != self._quotas_stamp:
            try:
                self.quotas = read_quotas(self.directory)
            except (OSError, ValueError) as error:
                log.warning(StoreLogEvent.FILE_QUOTAS_UNREADABLE, url=self.url, error=str(error))
            self._quotas_stamp = stamp
        return self.quotas

    def apply_to_put(
        self, keys: Sequence[str], sizes: Sequence[int], paths: Sequence[str | None], results: list[Status]
    ) -> tuple[dict[str, int], list[int], str | None]:
        """Enforce the directory's quotas on the new frames of a put (``paths[i]`` set), as if the frames were
        put one by one in batch order (what the memory store does):

        - a frame larger than its tenant's quota is refused (``results[i] = NO_SPACE``);
        - of the rest, each tenant keeps the newest frames of the batch that fit in its quota together (the
          batch's tail); the older ones would be evicted by the newer ones at once, so they are not written
          at all: ``OK``, counted as quota evictions. Without this a batch larger than the quota would land
          whole, and its bytes past the quota would push other tenants out through capacity eviction;
        - the kept bytes are reserved: added to the tenant's estimate and recorded as in flight until the put
          releases them (``SharedLedger.reserve``), so that every process's tenant pass counts
          them; a tenant that passes its quota evicts its own oldest files first (``SharedLedger.settle``);
        - the first put after the quotas changed (any put, of any tenant) rebuilds every tenant's estimate
          from the files, evicting those over their quotas: a quota set on a tenant that already holds data
          applies at once, its estimate never starts at 0.

        Returns the new bytes per namespace under a quota (what to give back if not published), the
        indices of the frames not to write (refused or evicted by the batch itself) and the reservation to
        release once published (``None``: none was made)."""
        quotas = self.current()
        if not quotas:
            return {}, [], None
        unwritten: list[int] = []
        namespace_to_indices: dict[str, list[int]] = {}
        for index, (key, size, path) in enumerate(zip(keys, sizes, paths, strict=True)):
            if path is None:
                continue
            namespace = namespace_of(key)
            if namespace is None or namespace not in quotas:
                continue
            if size > quotas[namespace]:
                results[index] = Status.NO_SPACE
                self.counters_of(namespace, quotas[namespace]).num_refused_puts += 1
                unwritten.append(index)
                continue
            namespace_to_indices.setdefault(namespace, []).append(index)
        namespace_to_new_bytes: dict[str, int] = {}
        for namespace, indices in namespace_to_indices.items():
            quota = quotas[namespace]
            num_kept_bytes = 0
            num_kept = 0
            for index in reversed(indices):  # newest first: the batch's tail that fits in the quota
                if num_kept_bytes + sizes[index] > quota:
                    break
                num_kept_bytes += sizes[index]
                num_kept += 1
            evicted_by_batch = indices[: len(indices) - num_kept]
            if evicted_by_batch:
                unwritten.extend(evicted_by_batch)
                # answered OK but never written: reported like any eviction (``take_evictions``)
                self.layout.eviction_log.append([key_digest(keys[index]) for index in evicted_by_batch])
                self.counters_of(namespace, quota).num_quota_evicted += len(evicted_by_batch)
            namespace_to_new_bytes[namespace] = num_kept_bytes
        stamp = self._quotas_stamp
        if stamp is None or (not namespace_to_new_bytes and stamp == self._settled_stamp):
            return namespace_to_new_bytes, unwritten, None  # nothing to reserve, estimates rebuilt already
        reservation = (
            f"{self._reservation_prefix}-{next(self._reservation_ids)}" if namespace_to_new_bytes else None
        )
        usage, unknown = self.layout.ledger.reserve(reservation, namespace_to_new_bytes, stamp, quotas)
        due = unknown | {
            namespace
            for namespace in namespace_to_new_bytes
            if namespace in usage and usage[namespace] > quotas[namespace]
        }
        if due:
            evicted = self.layout.ledger.settle({namespace: quotas[namespace] for namespace in due}, stamp)
            for namespace, num_evicted in evicted.items():
                self.counters_of(namespace, quotas[namespace]).num_quota_evicted += num_evicted
        self._settled_stamp = stamp
        return namespace_to_new_bytes, unwritten, reservation

    def counters_of(self, namespace: str, quota_bytes: int) -> TenantCounters:
        """This process's live counters of ``namespace`` (created on first use), its quota set to ``quota_bytes``."""
        with self._lock:
            counters = self._namespace_to_counters.get(namespace)
            if counters is None:
                counters = self._namespace_to_counters[namespace] = TenantCounters(quota_bytes)
            counters.quota_bytes = quota_bytes
            return counters

    def forget_bytes(self, key: str, size: int) -> None:
        """A removed entry of a tenant under a quota leaves its estimate."""
        namespace = namespace_of(key)
        if namespace is not None and namespace in self.current():
            self.layout.ledger.add_usage({namespace: -size})

    def stats(self, quotas: dict[str, int], namespace_to_bytes: dict[str, int]) -> dict[str, dict[str, int]]:
        """Per namespace under a quota: its quota, the bytes it holds (read from the headers: exact) and this
        process's counters."""
        tenants: dict[str, dict[str, int]] = {}
        for namespace, quota in sorted(quotas.items()):
            counters = self._snapshot_of(namespace, quota, namespace_to_bytes[namespace])
            tenants[namespace] = counters.as_dict()
        return tenants

    def _snapshot_of(self, namespace: str, quota_bytes: int, usage_bytes: int) -> TenantCounters:
        """A copy of ``namespace``'s counters with ``usage_bytes`` and this process's capacity evictions."""
        counters = self.counters_of(namespace, quota_bytes)
        num_capacity_evicted = self.layout.ledger.capacity_evicted_of(namespace)
        with self._lock:
            return dataclasses.replace(
                counters, usage_bytes=usage_bytes, num_capacity_evicted=num_capacity_evicted
            )

    def tenant_counters(self) -> dict[str, TenantCounters]:
        """The tenants' counters without reading the files (``hybridkv.store.quotas.tenant_counters_of``):
        per namespace under the directory's quotas its usage *estimate* (the shared one the quota passes
        keep: high, never low) and this process's counters; ``OTHER_TENANTS``: the rest of the store's usage
        estimate (spares excluded) and the capacity evictions of its files. Empty without quotas. A stat and
        two small locked reads.

        The worker reads this on vLLM's thread each stats interval, so the read never waits past the
        deadline: past it, while an earlier read is still hung (one at a time), or when it fails, the
        quotas and estimates last read stand, with this process's counters as they are now."""
        with self._lock:
            start_read = not self._estimates_reading
            self._estimates_reading = True
        if start_read:
            try:
                self._guard.call("tenant_counters", self._read_estimates)
            except (StoreError, OSError) as error:
                log.warning(
                    StoreLogEvent.FILE_IO_ERROR, url=self.url, op="tenant_counters", key="", error=str(error)
                )
        with self._lock:
            quotas, estimates, usage_estimate, spare_estimate = self._last_estimates
        if not quotas:
            return {}
        counters = {
            namespace: self._snapshot_of(namespace, quota, estimates.get(namespace, 0))
            for namespace, quota in sorted(quotas.items())
        }
        counters[OTHER_TENANTS] = TenantCounters(
            quota_bytes=0,
            usage_bytes=max(
                0, usage_estimate - spare_estimate - sum(c.usage_bytes for c in counters.values())
            ),
            num_capacity_evicted=self.layout.ledger.capacity_evicted_of(OTHER_TENANTS),
        )
        return counters

    def _read_estimates(self) -> None:
        """Read the quotas and the shared estimates into ``_last_estimates`` (``tenant_counters``)."""
        try:
            quotas = dict(self.current())
            if quotas:
                estimates = self.layout.ledger.estimates()
                usage_estimate, spare_estimate = self.layout.update_usage(lambda usage, spare: (usage, spare))
            else:
                estimates, usage_estimate, spare_estimate = {}, 0, 0
            with self._lock:
                self._last_estimates = (quotas, estimates, usage_estimate, spare_estimate)
        finally:
            with self._lock:
                self._estimates_reading = False
