"""The file store's eviction log: the digests of the keys every process's eviction removed.

Why a log: several processes share one directory, and an engine publishes ``BlockRemoved`` for the blocks it
published whenever *any* process evicts them (``hybridkv.connector.scheduler.store_events``). An eviction pass knows
what it removed; the others learn it only if it is recorded. The names under objects/ are the key digests,
so the pass records the digest of each file it took (no header read), in one append.

Layout under DIR/evictions/::

    lock          flock'ed by an appender: appends and the start of a new segment are serialized
    <gen>.log     segments of 16-byte records, one key digest each (``hybridkv.store.frame.key_digest``);
                  ``gen`` counts up from 0, zero-padded

Contract:

- :meth:`EvictionLog.append` records a pass's digests after its files are gone, in one ``O_APPEND`` write
  into the newest segment, under the lock. When that segment would pass ``SEGMENT_BYTES`` it starts the
  next one and deletes all but the newest ``KEEP_SEGMENTS``: the log stays within about
  ``KEEP_SEGMENTS * SEGMENT_BYTES`` however long the store lives. A failed append (a full or read-only
  file system) is logged (``store.file.eviction_log_failed``) and never fails the eviction.
- An :class:`EvictionLogReader` keeps its place (segment, offset) and takes whole records only. Appends
  go to the newest segment only, so a segment that was not the newest when the reader listed the
  directory is final: the reader reads it to its end and moves to the next one. A reader whose segment
  was deleted (it fell more than ``KEEP_SEGMENTS - 1`` full segments behind) or that cannot read the log
  reports that evictions were lost (``Evictions.complete`` false) and goes on from the oldest segment.
- A reader starts at the end of the log as it is when the reader is made: it reports the evictions after.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Sequence
from pathlib import Path

import structlog
from hybridkv.store.base import Evictions, StoreLogEvent

log = structlog.get_logger(__name__)

#: Bytes of one record: a key digest.
RECORD_BYTES = 16
#: A segment is closed once it holds this many bytes (65,536 evictions).
SEGMENT_BYTES = 1 << 20
#: Segments kept: a reader may fall this many segments minus one behind before it loses evictions.
KEEP_SEGMENTS = 4
_SUFFIX = ".log"


def digest_of_name(name: str) -> bytes | None:
    """The key digest a file under objects/ is named by (``<hex digest>.kv``); None for any other name."""
    try:
        digest = bytes.fromhex(name.partition(".")[0])
    except ValueError:
        return None
    return digest if len(digest) == RECORD_BYTES else None


class EvictionLog:
    """The eviction log of one store directory (see the module docstring). Thread- and process-safe."""

    def __init__(self, directory: Path) -> None:
        """``directory``: the store's directory (the log lives in its ``evictions/``, made on first use)."""
        self.directory = directory / "evictions"

    def segment_path(self, gen: int) -> Path:
        return self.directory / f"{gen:012d}{_SUFFIX}"

    def generations(self) -> list[int]:
        """The segments there are, oldest first (none when the log was never written)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(name[: -len(_SUFFIX)]) for name in names if name.endswith(_SUFFIX))

    def append(self, digests: Sequence[bytes]) -> None:
        """Record the evicted keys' ``digests`` (their files are gone already)."""
        if not digests:
            return
        assert all(len(digest) == RECORD_BYTES for digest in digests), "a record is one 16-byte key digest"
        data = b"".join(digests)
        try:
            self.directory.mkdir(mode=0o700, exist_ok=True)
            # A descriptor per call: flock excludes other open files, threads of this process included.
            lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
                self._append_locked(data)
            finally:
                os.close(lock_fd)  # and the lock with it
        except OSError as error:
            log.warning(
                StoreLogEvent.FILE_EVICTION_LOG_FAILED,
                directory=str(self.directory),
                num_evicted=len(digests),
                error=str(error),
            )

    def _append_locked(self, data: bytes) -> None:
        gens = self.generations()
        gen = gens[-1] if gens else 0
        if gens and self.segment_path(gen).stat().st_size + len(data) > SEGMENT_BYTES:
            gen += 1
            for old in gens:
                if old <= gen - KEEP_SEGMENTS:
                    with contextlib.suppress(FileNotFoundError):
                        self.segment_path(old).unlink()
        fd = os.open(self.segment_path(gen), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def reader(self) -> EvictionLogReader:
        """A reader placed at the end of the log as it is now."""
        return EvictionLogReader(self)


class EvictionLogReader:
    """One handle's place in an :class:`EvictionLog`. Not thread-safe: one caller at a time."""

    def __init__(self, log: EvictionLog) -> None:
        self._log = log
        gens = log.generations()
        self._gen = gens[-1] if gens else 0
        self._offset = 0
        if gens:
            with contextlib.suppress(FileNotFoundError):
                self._offset = self._whole(log.segment_path(self._gen).stat().st_size)

    @staticmethod
    def _whole(num_bytes: int) -> int:
        return num_bytes - num_bytes % RECORD_BYTES

    def take(self) -> Evictions:
        """The evictions recorded since the previous call (or since this reader was made)."""
        try:
            return self._take()
        except OSError:
            return Evictions(complete=False)  # unreadable now: the caller must assume anything may be gone

    def _take(self) -> Evictions:
        gens = self._log.generations()
        if not gens:
            # Never written -- or deleted under us (the directory was cleared) after we read some of it.
            complete = (self._gen, self._offset) == (0, 0)
            self._gen, self._offset = 0, 0
            return Evictions(complete=complete)
        complete = True
        if self._gen not in gens:  # deleted while we lagged (or the log started over): records were lost
            complete = False
            self._gen, self._offset = gens[0], 0
        data = bytearray()
        index = gens.index(self._gen)
        while True:
            try:
                with open(self._log.segment_path(self._gen), "rb") as segment:
                    segment.seek(self._offset)
                    chunk = segment.read()
            except FileNotFoundError:  # deleted since the listing: we lagged
                complete, chunk = False, b""
            chunk = chunk[: self._whole(len(chunk))]  # an append still being written: the rest next time
            data += chunk
            self._offset += len(chunk)
            if index + 1 == len(gens):
                break
            # A newer segment existed when we listed, so ours was final: we have read all of it.
            if gens[index + 1] != self._gen + 1:
                complete = False
            index += 1
            self._gen, self._offset = gens[index], 0
        digests = tuple(bytes(data[i : i + RECORD_BYTES]) for i in range(0, len(data), RECORD_BYTES))
        return Evictions(digests, complete=complete)
