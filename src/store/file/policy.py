"""What a file store's eviction takes first, and down to where: shared by the capacity pass
(``FileLayout.make_room``) and the tenant pass (``SharedLedger.settle``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

from hybridkv.store.retention import protected_keys

#: A file's path: ``Path`` (the tenant pass) or ``str`` (the capacity passes, which scan a million files).
P = TypeVar("P", str, Path)

#: Evict down to this fraction of capacity (of the quota, in a tenant's pass), so eviction scans run once per
#: 10 % written.
LOW_WATERMARK = 0.9
#: Temporary files unmodified for this long (seconds) belong to a crashed writer and are removed by eviction
#: scans; reservations and scan markers of the tenants' ledger this old belong to a crashed process. A put
#: modifies its temp file when it creates it or claims it (a claimed spare is touched before it enters tmp/)
#: and on every write, so a live put's file is never this old unless the put stalls this long.
STALE_TMP_S = 600.0


def eviction_order(
    entries: list[tuple[float, int, P]], now: float, retain_budget_bytes: float
) -> list[tuple[float, int, P]]:
    """``(mtime, size, path)`` entries in the order eviction takes them (``hybridkv.store.retention``).

    A file whose mtime is in the future is retained until then (``FileLayout.retain``). Retained files
    within ``retain_budget_bytes`` (those expiring last first: ``protected_keys``) go after every other
    file, the one expiring first first; the other retained files are ordinary files last used when they were
    retained (or read since: their atime). The rest is least recently used first."""
    retained = {str(path): mtime for mtime, _size, path in entries if mtime > now}
    if not retained:
        return sorted(entries, key=lambda entry: entry[0])
    sizes = {str(path): size for mtime, size, path in entries if mtime > now}
    protected = protected_keys(retained, sizes, retain_budget_bytes)

    def last_use(path: P) -> float:
        try:
            return min(os.stat(path).st_atime, now)
        except FileNotFoundError:
            return now

    def order(entry: tuple[float, int, P]) -> tuple[int, float]:
        mtime, _size, path = entry
        if str(path) in protected:
            return (1, mtime)
        return (0, last_use(path) if str(path) in retained else mtime)

    return sorted(entries, key=order)
