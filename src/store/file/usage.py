"""What a file store holds and what its file system holds for it.

Contract: ``shard_usage`` and ``bytes_of_shard`` read the exact bytes (and, under quotas, each tenant's) of
one shard of the directory, for ``stats`` (a step each, so that a caller can put a deadline on each).
:class:`FileSpace` derives, on the put path, the capacity eviction holds the store to:
``min(capacity, usage + free bytes - margin)``, from the file system's free space (``os.statvfs``) re-read at
most every ``SPACE_REFRESH_S`` (at once after a put met ``ENOSPC``/``EDQUOT``), and hands it to the layout's
eviction (``FileLayout.set_effective_capacity``). It logs once when the file system starts holding less than
the configured capacity and once when it holds it again. It writes nothing to the directory.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import structlog
from hybridkv.key_grammar import namespace_of
from hybridkv.store.base import StoreLogEvent
from hybridkv.store.file.layout import FileLayout

log = structlog.get_logger(__name__)

#: The free space of the file system is re-read (``os.statvfs``) at most this often (seconds) on the put
#: path, and at once after a put met ``ENOSPC``/``EDQUOT``.
SPACE_REFRESH_S = 2.0
#: What the effective capacity leaves free on the file system: this fraction of its size, at most
#: ``_SPACE_MARGIN_MAX_BYTES`` (room for the store's own small files and other writers' metadata).
_SPACE_MARGIN_FRACTION = 0.02
_SPACE_MARGIN_MAX_BYTES = 64 << 20


class FileSpace:
    """One handle's view of the free space under a store directory. Thread-safe."""

    def __init__(self, url: str, directory: Path, layout: FileLayout, *, capacity_bytes: int) -> None:
        self.url = url
        self.directory = directory
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        #: The capacity eviction holds the store to: ``capacity_bytes``, or what the file system holds for
        #: it (``effective_capacity``).
        self.effective_capacity_bytes = capacity_bytes
        #: The free bytes of the file system when last read (``None``: never read, or unreadable).
        self.free_bytes: int | None = None
        #: When the free space was last read (monotonic seconds; -inf: never).
        self._read_at = float("-inf")
        #: Whether the file system holds less than ``capacity_bytes`` (an episode, logged once).
        self._limited = False
        self._lock = threading.Lock()

    def effective_capacity(self, *, force: bool, num_unwritten_bytes: int = 0) -> int:
        """The capacity eviction holds the store to: ``min(capacity, usage + free bytes - margin)``, where the
        free bytes are the file system's (``os.statvfs``, re-read at most every ``SPACE_REFRESH_S`` unless
        ``force``); an unreadable ``statvfs`` keeps the last value. Runs on the put path, under the deadline
        where there is one. Logs ``FILE_SPACE_LIMITED`` once when the file system starts holding less than
        ``capacity_bytes`` and ``FILE_SPACE_RECOVERED`` once when it holds it again.
        ``num_unwritten_bytes``: bytes counted in ``usage`` that are not on disk (a batch's unwritten frames)."""
        now = time.monotonic()
        if not force and now - self._read_at < SPACE_REFRESH_S:
            return self.effective_capacity_bytes
        self._read_at = now
        try:
            info = os.statvfs(self.directory)
        except OSError:
            return self.effective_capacity_bytes
        free = info.f_bavail * info.f_frsize
        margin = min(int(info.f_blocks * info.f_frsize * _SPACE_MARGIN_FRACTION), _SPACE_MARGIN_MAX_BYTES)
        usage, _spare = self.layout.update_usage(lambda usage, spare: (usage, spare))
        effective = max(0, min(self.capacity_bytes, usage - num_unwritten_bytes + free - margin))
        self.free_bytes = free
        self.effective_capacity_bytes = effective
        self.layout.set_effective_capacity(effective)
        limited = effective < self.capacity_bytes
        with self._lock:  # one log line per episode, also when several threads re-read at once
            changed = limited != self._limited
            self._limited = limited
        if changed:
            event = StoreLogEvent.FILE_SPACE_LIMITED if limited else StoreLogEvent.FILE_SPACE_RECOVERED
            (log.warning if limited else log.info)(
                event,
                url=self.url,
                directory=str(self.directory),
                free_bytes=free,
                capacity_bytes=self.capacity_bytes,
                effective_capacity_bytes=effective,
            )
        return effective


def shard_usage(layout: FileLayout, shard: str, quotas: dict[str, int]) -> tuple[int, int, dict[str, int]]:
    """(files, bytes, bytes per namespace under ``quotas``) of one object shard; the namespaces are read
    from the headers, only when there are quotas."""
    num_keys = 0
    num_bytes = 0
    namespace_to_bytes: dict[str, int] = {}
    for path in layout.shard_paths(shard):
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue
        num_keys += 1
        num_bytes += size
        if not quotas:
            continue
        found, key = layout.key_of(str(path))
        namespace = None if key is None else namespace_of(key)
        if found and namespace in quotas:
            namespace_to_bytes[namespace] = namespace_to_bytes.get(namespace, 0) + size
    return num_keys, num_bytes, namespace_to_bytes


def bytes_of_shard(shard: str) -> int:
    """The bytes of the files of one shard (those removed meanwhile not counted)."""
    num_bytes = 0
    for path in FileLayout.shard_paths(shard):
        with contextlib.suppress(FileNotFoundError):
            num_bytes += path.stat().st_size
    return num_bytes
