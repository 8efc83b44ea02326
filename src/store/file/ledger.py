"""The tenants' shared ledger of a file store under quotas, and the tenant eviction pass.

Contract: :class:`SharedLedger` owns ``tenant_usage.json`` in the store directory (read and written under the
usage estimate's flock, ``FileLayout.usage_locked``): per namespace under a quota an estimate of its bytes,
and the reservations of puts in flight (``TenantLedger``); and the tenant pass (``settle``) that evicts a
tenant's own oldest files when they pass its quota. ``hybridkv.store.file.tenants`` is its one caller on the
put path; ``FileLayout.make_room`` counts a capacity pass's evictions per tenant through ``TenantTally``.
Thread- and process-safe.

Quotas: a put of a tenant under a quota reserves its bytes: adds them to the tenant's estimate and records
them in the ledger as in flight until it has published (``SharedLedger.reserve`` / ``release``).
When the estimate passes the quota, the putter takes ``evict.lock`` (waiting for a capacity pass to finish;
one eviction pass at a time across processes, and across threads by a lock of the process's own),
reads the frame headers of every file to find the tenant's (names are digests: the key, hence the namespace,
is only in the header), and if its files plus every process's reservations pass the quota deletes its
oldest-mtime files until they fit under 90 % of it; it rewrites the estimate as the files plus the
reservations (``SharedLedger.settle``), so a put in flight in another process is never dropped from it
(reservations released while the pass scans are kept for it to count). Estimates hold only for the quota
file they were rebuilt under (its mtime, inode and size): the first put after the quotas change, in any
process, rebuilds every tenant's estimate from the files in one pass, evicting tenants over their quotas --
a quota set on a tenant that already holds data applies at once, never starting from 0.
A batch of a tenant never adds more than its quota: the putter writes only the batch's newest frames that fit
(``hybridkv.store.quotas``). While the directory has quotas, a capacity pass reads the header of each file it
evicts (one open and two small reads each, not the whole directory's) to count it for its tenant and take its
bytes off the tenant's estimate. The estimates may still be high (a crashed writer's reservation, dropped
from the ledger after ``STALE_TMP_S``; a file published while a pass scanned, counted twice) until the
tenant's next pass; high, never low: a tenant evicts its own entries early at worst, and never grows past its
quota. Left out: a put that read the quota file just before a ``quota --set`` and lands after the rebuild is
not counted (one put per process, until the tenant's next pass).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import structlog
from hybridkv.key_grammar import namespace_of
from hybridkv.store.base import StoreLogEvent
from hybridkv.store.file.eviction_log import digest_of_name
from hybridkv.store.file.policy import LOW_WATERMARK, STALE_TMP_S, eviction_order
from hybridkv.store.quotas import OTHER_TENANTS
from hybridkv.store.retention import RETAIN_FRACTION

if TYPE_CHECKING:
    from hybridkv.store.file.layout import FileLayout

log = structlog.get_logger(__name__)

#: The quota file's (mtime_ns, inode, size): which quotas the tenants' estimates were rebuilt under.
QuotasStamp = tuple[int, int, int]
T = TypeVar("T")


@dataclass
class Reservation:
    """A put's new bytes per namespace, counted by every tenant pass until the put has published them."""

    since: float
    namespace_to_bytes: dict[str, int]
    #: published while a tenant pass scanned: kept for that pass to count, dropped when it ends
    published: bool = False


@dataclass
class TenantLedger:
    """``tenant_usage.json``: the tenants' shared estimates and the reservations of puts in flight (see
    Quotas in the module docstring). Decoding is lenient: anything malformed is left out (so estimates are
    rebuilt, reservations forgotten -- an old file of another format is an empty ledger)."""

    #: the quotas the estimates were rebuilt under; ``None``: none yet
    quotas_stamp: QuotasStamp | None = None
    #: namespace -> bytes (high, never low); a namespace under a quota without an entry is not counted yet
    usage: dict[str, int] = field(default_factory=dict)
    #: reservation id (unique across processes) -> the put's reservation
    reservations: dict[str, Reservation] = field(default_factory=dict)
    #: when the tenant pass under way started scanning (wall clock); ``None``: none is
    scan_since: float | None = None

    def reserved_bytes(self) -> dict[str, int]:
        """The bytes of the reservations per namespace."""
        reserved: dict[str, int] = {}
        for held in self.reservations.values():
            for namespace, num_bytes in held.namespace_to_bytes.items():
                reserved[namespace] = reserved.get(namespace, 0) + num_bytes
        return reserved

    def drop_stale(self, horizon: float) -> None:
        """Forget the reservations and the scan marker made before ``horizon`` (a crashed process's)."""
        for reservation in [r for r, held in self.reservations.items() if held.since < horizon]:
            del self.reservations[reservation]
        if self.scan_since is not None and self.scan_since < horizon:
            self.scan_since = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "quotas_stamp": self.quotas_stamp,
                "usage": self.usage,
                "reservations": {
                    reservation: {
                        "since": held.since,
                        "bytes": held.namespace_to_bytes,
                        "published": held.published,
                    }
                    for reservation, held in self.reservations.items()
                },
                "scan_since": self.scan_since,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> TenantLedger:
        try:
            loaded = json.loads(raw) if raw else {}
        except ValueError:
            loaded = {}
        if not isinstance(loaded, dict):
            return cls()
        ledger = cls()
        stamp = loaded.get("quotas_stamp")
        if isinstance(stamp, list) and len(stamp) == 3 and all(type(n) is int for n in stamp):
            ledger.quotas_stamp = (stamp[0], stamp[1], stamp[2])
        usage = loaded.get("usage")
        if isinstance(usage, dict):
            ledger.usage = {ns: n for ns, n in usage.items() if type(n) is int}
        reservations = loaded.get("reservations")
        for reservation, held in (reservations if isinstance(reservations, dict) else {}).items():
            if not isinstance(held, dict) or not isinstance(held.get("bytes"), dict):
                continue
            since = held.get("since")
            ledger.reservations[reservation] = Reservation(
                float(since) if isinstance(since, int | float) else 0.0,
                {ns: n for ns, n in held["bytes"].items() if type(n) is int},
                held.get("published") is True,
            )
        scan_since = loaded.get("scan_since")
        ledger.scan_since = float(scan_since) if isinstance(scan_since, int | float) else None
        return ledger


class TenantTally:
    """What one capacity pass evicted per tenant (``FileLayout.make_room``'s ``namespaces``): nothing without
    namespaces under a quota; with some, the header of each file is read before it goes."""

    def __init__(self, layout: FileLayout, ledger: SharedLedger, namespaces: Collection[str]) -> None:
        self.layout = layout
        self.ledger = ledger
        self.namespaces = namespaces
        self.tenant_to_count: dict[str, int] = {}
        self.tenant_to_bytes: dict[str, int] = {}

    def note(self, path: str, size: int) -> None:
        """``path`` (``size`` bytes) is about to be evicted: count it for its tenant (``OTHER_TENANTS`` when
        not under a quota; not at all when it is gone already)."""
        if not self.namespaces:
            return
        found, key = self.layout.key_of(path)
        if not found:
            return
        namespace = None if key is None else namespace_of(key)
        tenant = namespace if namespace is not None and namespace in self.namespaces else OTHER_TENANTS
        self.tenant_to_count[tenant] = self.tenant_to_count.get(tenant, 0) + 1
        self.tenant_to_bytes[tenant] = self.tenant_to_bytes.get(tenant, 0) + size

    def settle(self) -> None:
        """Count the pass's evictions per tenant and take their bytes off the tenants' estimates."""
        if not self.tenant_to_count:
            return
        self.ledger.add_capacity_evicted(self.tenant_to_count)
        deltas = {ns: -num_bytes for ns, num_bytes in self.tenant_to_bytes.items() if ns != OTHER_TENANTS}
        if deltas:
            self.ledger.add_usage(deltas)


class SharedLedger:
    """``tenant_usage.json`` of one store directory and the tenant passes over it (see the module docstring).

    Opening it opens the ledger's descriptor; :meth:`close` closes it."""

    def __init__(self, layout: FileLayout) -> None:
        self.layout = layout
        self._fd = os.open(layout.directory / "tenant_usage.json", os.O_RDWR | os.O_CREAT, 0o600)
        self._lock = threading.Lock()
        #: Per namespace under a quota (and ``OTHER_TENANTS``): the files this process's capacity passes
        #: evicted while the directory had quotas (``FileLayout.make_room``'s ``namespaces``).
        self.namespace_to_capacity_evicted: dict[str, int] = {}

    def close(self) -> None:
        os.close(self._fd)

    def update(self, update: Callable[[TenantLedger], T]) -> T:
        """``update(ledger)`` on the tenants' shared ledger (``tenant_usage.json``) under the usage lock,
        written back if it changed; returns what ``update`` returns. Reservations and a scan marker older than
        ``STALE_TMP_S`` belong to a crashed process and are dropped. An unreadable file is an empty ledger
        (every tenant's estimate is then rebuilt from the files at the next put)."""
        with self.layout.usage_locked():
            raw = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
            ledger = TenantLedger.decode(raw)
            ledger.drop_stale(time.time() - STALE_TMP_S)
            result = update(ledger)
            encoded = ledger.encode()
            if encoded != raw:
                os.pwrite(self._fd, encoded, 0)
                os.ftruncate(self._fd, len(encoded))
            return result

    def estimates(self) -> dict[str, int]:
        """The tenants' shared estimates: namespace -> bytes (only namespaces rebuilt under the quotas in
        force; see Quotas in the module docstring)."""
        return self.update(lambda ledger: dict(ledger.usage))

    def add_usage(self, namespace_to_delta: Mapping[str, int]) -> dict[str, int]:
        """Add each delta to its namespace's estimate (a namespace without one keeps none: its rebuild will
        count its files); returns the new estimates."""

        def add(ledger: TenantLedger) -> dict[str, int]:
            for namespace, delta in namespace_to_delta.items():
                if namespace in ledger.usage:
                    ledger.usage[namespace] = max(0, ledger.usage[namespace] + delta)
            return dict(ledger.usage)

        return self.update(add)

    def reserve(
        self,
        reservation: str | None,
        namespace_to_bytes: Mapping[str, int],
        quotas_stamp: QuotasStamp,
        namespaces: Collection[str],
    ) -> tuple[dict[str, int], set[str]]:
        """Before a put publishes: add its new bytes per namespace to the estimates and record them as the
        in-flight ``reservation`` (an id unique across processes; ``None`` with no bytes), which every tenant
        pass counts until :meth:`release`. Estimates made under other quotas than
        ``quotas_stamp`` (the quota file's) are dropped first. Returns the estimates and the namespaces of
        ``namespaces`` that have none (to rebuild: :meth:`settle`)."""

        def reserve(ledger: TenantLedger) -> tuple[dict[str, int], set[str]]:
            if ledger.quotas_stamp != quotas_stamp:
                ledger.quotas_stamp, ledger.usage = quotas_stamp, {}
            if reservation is not None and namespace_to_bytes:
                ledger.reservations[reservation] = Reservation(time.time(), dict(namespace_to_bytes))
                for namespace, num_bytes in namespace_to_bytes.items():
                    if namespace in ledger.usage:
                        ledger.usage[namespace] += num_bytes
            return dict(ledger.usage), {
                namespace for namespace in namespaces if namespace not in ledger.usage
            }

        return self.update(reserve)

    def release(self, reservation: str, namespace_to_unpublished: Mapping[str, int]) -> None:
        """A put's ``reservation`` ends: its published bytes are files now, its ``namespace_to_unpublished``
        bytes leave the estimates. While a tenant pass scans, the reservation stays (marked published) for
        that pass to count: the scan may have missed a file published meanwhile (counted twice at worst)."""

        def release(ledger: TenantLedger) -> None:
            for namespace, num_bytes in namespace_to_unpublished.items():
                if namespace in ledger.usage:
                    ledger.usage[namespace] = max(0, ledger.usage[namespace] - num_bytes)
            held = ledger.reservations.get(reservation)
            if held is None:
                return
            if ledger.scan_since is None:
                del ledger.reservations[reservation]
            else:
                held.published = True

        self.update(release)

    def capacity_evicted_of(self, namespace: str) -> int:
        """Files of ``namespace`` (or ``OTHER_TENANTS``) this process's capacity passes evicted."""
        with self._lock:
            return self.namespace_to_capacity_evicted.get(namespace, 0)

    def add_capacity_evicted(self, tenant_to_count: dict[str, int]) -> None:
        with self._lock:
            for tenant, count in tenant_to_count.items():
                self.namespace_to_capacity_evicted[tenant] = (
                    self.namespace_to_capacity_evicted.get(tenant, 0) + count
                )

    def settle(self, namespace_to_quota: Mapping[str, int], quotas_stamp: QuotasStamp) -> dict[str, int]:
        """The tenant pass: for each namespace of ``namespace_to_quota`` (its quota) that has no estimate under
        ``quotas_stamp`` or whose estimate is over its quota, read its bytes from the files; if they and the
        reservations in flight (every process's, this put's included) pass the quota, evict its oldest
        files until they fit under 90 % of it (retained ones last, ``eviction_order``); then set its estimate
        to its files plus the reservations. One scan of every file's header for all of them (see Quotas in
        the module docstring); waits for a capacity pass, and skips the namespaces another process's pass
        settled meanwhile. Returns the files evicted per namespace."""
        # One pass at a time, across processes and across this process's threads (two passes at once would
        # each drop reservations or evictions the other still counts on).
        with self.layout.evict_locked():

            def start(ledger: TenantLedger) -> set[str]:
                if ledger.quotas_stamp != quotas_stamp:
                    ledger.quotas_stamp, ledger.usage = quotas_stamp, {}
                due = {
                    namespace
                    for namespace, quota in namespace_to_quota.items()
                    if namespace not in ledger.usage or ledger.usage[namespace] > quota
                }
                if due:
                    ledger.scan_since = time.time()
                return due

            due = self.update(start)
            if not due:
                return {}
            namespace_to_files: dict[str, int] = {}
            try:
                namespace_to_evicted = self._evict(
                    {namespace: namespace_to_quota[namespace] for namespace in due}, namespace_to_files
                )
            finally:

                def finish(ledger: TenantLedger) -> None:
                    if (
                        ledger.quotas_stamp == quotas_stamp
                    ):  # (else other quotas came meanwhile: rebuild anew)
                        reserved = ledger.reserved_bytes()
                        for namespace, num_bytes in namespace_to_files.items():
                            ledger.usage[namespace] = num_bytes + reserved.get(namespace, 0)
                    ledger.scan_since = None
                    for reservation in [r for r, held in ledger.reservations.items() if held.published]:
                        del ledger.reservations[reservation]

                self.update(finish)
            log.debug(
                StoreLogEvent.FILE_EVICTED,
                url=self.layout.url,
                namespaces=sorted(due),
                evicted=namespace_to_evicted,
            )
            return namespace_to_evicted

    def _evict(
        self, namespace_to_quota: Mapping[str, int], namespace_to_files: dict[str, int]
    ) -> dict[str, int]:
        """``settle``' scan and evictions (under ``evict.lock``): fills ``namespace_to_files`` with
        the bytes each namespace's files hold afterwards (only once every namespace is done) and returns the
        files evicted per namespace."""
        namespace_to_entries: dict[str, list[tuple[float, int, Path]]] = {ns: [] for ns in namespace_to_quota}
        for path, key in self.layout.iter_keyed_paths():
            entries = namespace_to_entries.get(namespace_of(key) or "")
            if entries is None:
                continue
            try:
                info = path.stat()
            except FileNotFoundError:
                continue
            entries.append((info.st_mtime, info.st_size, path))
        reserved = self.update(lambda ledger: ledger.reserved_bytes())
        now = time.time()
        namespace_to_evicted: dict[str, int] = {}
        totals: dict[str, int] = {}
        evicted: list[bytes | None] = []
        for namespace, quota_bytes in namespace_to_quota.items():
            entries = namespace_to_entries[namespace]
            total = sum(file_size for _mtime, file_size, _path in entries)
            num_reserved = reserved.get(namespace, 0)
            num_evicted = 0
            if total + num_reserved > quota_bytes:
                keep = max(int(quota_bytes * LOW_WATERMARK), num_reserved) - num_reserved
                for _mtime, file_size, path in eviction_order(entries, now, quota_bytes * RETAIN_FRACTION):
                    if total <= keep:
                        break
                    if self.layout.retire(str(path), file_size):
                        num_evicted += 1
                        evicted.append(digest_of_name(path.name))
                    total -= file_size
            totals[namespace] = total
            namespace_to_evicted[namespace] = num_evicted
        self.layout.eviction_log.append([digest for digest in evicted if digest is not None])
        namespace_to_files.update(totals)
        return namespace_to_evicted
