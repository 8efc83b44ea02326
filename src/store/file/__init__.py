"""``file:///DIR?capacity=SIZE``: the embedded default store, safe across processes.

One class per strategy:

- ``backend.FileBackend``: the ``hybridkv.store.framed`` backend of ``file://`` URLs and the I/O path of its
  calls (each frame between the caller's buffers and one file).
- ``layout.FileLayout``: the directory's protocol every process sharing it follows: names, the shared usage
  estimate, LRU eviction, recycling of files and its locks.
- ``eviction.CapacityEvictor``: one process's capacity passes: the put's, bounded by what it evicts, and the
  background top-up to the low watermark.
- ``ledger``: the tenants' shared ledger under the directory's quotas (estimates, reservations of puts in
  flight, the tenant eviction pass).
- ``tenants.FileTenants``: one handle's quotas, reservations and counters per tenant.
- ``space.FileSpace``: what the file system holds for the store (its effective capacity on a full disk).
- ``deadline.DeadlineGuard``: the deadline of every call on a file system that may hang (``mounts``).
- ``capacity``: the capacity engines run with, recorded in the directory for operator commands.
- ``eviction_log``: what every process's eviction removed, for KV events.
- ``probe.ReadProbe``: the read profile a benchmark may install (production has none).
"""

from __future__ import annotations

from hybridkv.store.file.backend import DEFAULT_HANG_TIMEOUT_MS, FileBackend, effective_capacity_of
from hybridkv.store.file.layout import RECYCLE_MIN_SIZE, FileLayout

__all__ = [
    "DEFAULT_HANG_TIMEOUT_MS",
    "RECYCLE_MIN_SIZE",
    "FileBackend",
    "FileLayout",
    "effective_capacity_of",
]
