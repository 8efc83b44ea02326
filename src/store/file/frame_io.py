"""Moving one frame between a file and the caller's buffers (vectored writes and reads, no copy of our own),
and what a failed file-system call answers (``status_of``)."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

import structlog
from hybridkv.store.base import Status, StoreLogEvent

log = structlog.get_logger(__name__)

#: The most buffers one ``pwritev``/``readv`` takes (Linux's ``IOV_MAX``).
_IOV_MAX = 1024


def _advance(pending: list[memoryview], num_bytes: int) -> None:
    """Drop the first ``num_bytes`` bytes (just written or read) from ``pending``, keeping the tail."""
    while num_bytes and pending:
        if num_bytes >= pending[0].nbytes:
            num_bytes -= pending[0].nbytes
            pending.pop(0)
        else:
            pending[0] = pending[0][num_bytes:]
            num_bytes = 0


def write_all(fd: int, parts: Sequence[memoryview], offset: int) -> None:
    """Write ``parts`` back to back into ``fd`` from ``offset`` (the file position is not used)."""
    pending = [part for part in parts if part.nbytes]
    while pending:
        num_written = os.pwritev(fd, pending[:_IOV_MAX], offset)
        offset += num_written
        _advance(pending, num_written)


def read_all(fd: int, parts: Sequence[memoryview], expected: int | None = None) -> int:
    """Fill ``parts`` from the start of ``fd``; returns bytes read (short only at end of file).
    ``expected``: the parts' total size where the caller has it already (else it is added up here)."""
    if expected is None:
        expected = sum(part.nbytes for part in parts)
    pending = list(parts)
    total = 0
    while total < expected:
        num_read = os.readv(fd, pending[:_IOV_MAX])
        if num_read == 0:
            break
        total += num_read
        if total < expected:  # the usual read fills every part at once: nothing to walk then
            _advance(pending, num_read)
    return total


def status_of(error: OSError, op: str, key: str, *, url: str) -> Status:
    """The status a failed file-system call answers: ``NO_SPACE`` for a full file system or quota, else
    ``TRANSFER_FAILED`` (logged with the error)."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return Status.NO_SPACE
    log.warning(StoreLogEvent.FILE_IO_ERROR, url=url, op=op, key=key, error=str(error))
    return Status.TRANSFER_FAILED
