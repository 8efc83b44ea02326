"""The production audit sink: one JSON line per transition, appended to a file by the standard library.

The path of a record::

    emit (the caller's thread: vLLM's scheduler)
      -> logging.handlers.QueueHandler            put_nowait on a bounded queue.Queue; full: dropped, counted
      -> logging.handlers.QueueListener thread    (``hybridkv-audit-writer``)
      -> _AuditFileHandler                        RotatingFileHandler (size rotation, ``max_bytes``) that
                                                  also reopens like WatchedFileHandler (logrotate)
           formatter: structlog's JSONRenderer    the same bytes ``structlog.WriteLogger`` would write

The caller never renders, never touches the disk and never waits: rendering and writing happen on the
listener's thread. Dropped records are reported in the file by one marker line
``{"event": "audit_records_dropped", "num_dropped": N, "monotonic": ...}`` written before the next record
(or at ``flush()`` / ``close()``), which the replay (``hybridkv.audit.replay``) totals as ``num_dropped``.
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import os
import queue
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import structlog
from hybridkv.lifecycle.sink import AuditSink

__all__ = ["DEFAULT_MAX_QUEUED", "DROPPED_EVENT", "JsonLinesAuditSink"]

_log = logging.getLogger(__name__)

#: Records that may wait for the JSON sink's writer thread before new ones are dropped.
DEFAULT_MAX_QUEUED = 65536
#: ``event`` of the marker line the JSON sink writes after dropping records (a full queue).
DROPPED_EVENT = "audit_records_dropped"
_WRITER_THREAD_NAME = "hybridkv-audit-writer"


class _AuditRecord(logging.LogRecord):
    """One queued item: an audit record (``event`` + ``fields``), a dropped-records marker (``line`` given,
    ``num_dropped``) or a flush request (``flushed``: set once everything queued before it is written)."""

    def __init__(
        self,
        event: str,
        fields: dict[str, Any] | None = None,
        *,
        line: str | None = None,
        num_dropped: int = 0,
        flushed: threading.Event | None = None,
    ) -> None:
        super().__init__(__name__, logging.INFO, __file__, 0, event, None, None)
        self.fields = fields
        #: The rendered line without its newline (the formatter fills it in once).
        self.line = line
        self.num_dropped = num_dropped
        self.flushed = flushed


class _Drops:
    """Records dropped (a full queue, a failed write) and how many of them a marker line reported."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0
        self._reported = 0

    def add(self, num: int = 1) -> None:
        with self._lock:
            self.total += num

    def take_unreported(self) -> int:
        with self._lock:
            num = self.total - self._reported
            self._reported = self.total
            return num

    @property
    def num_unreported(self) -> int:
        with self._lock:
            return self.total - self._reported

    def unreport(self, num: int) -> None:
        """A marker line carrying ``num`` could not be written: the next marker reports them again."""
        with self._lock:
            self._reported -= num


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    """``QueueHandler`` that never blocks and never renders in the caller's thread: a full queue drops
    the record and counts it."""

    def __init__(self, records: queue.Queue[logging.LogRecord | None], drops: _Drops) -> None:
        super().__init__(records)
        self._drops = drops

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record  # rendered by the listener's handler, off the caller's thread

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self._drops.add(1)


class _AuditListener(logging.handlers.QueueListener):
    """``QueueListener`` whose thread is named, whose stop waits for room for its sentinel (the queue may
    be full), and which keeps its sink alive until ``close()`` (so the sink's atexit hook, a weak
    reference, finds every open sink)."""

    def __init__(
        self, records: queue.Queue[logging.LogRecord | None], handler: logging.Handler, owner: Any
    ) -> None:
        super().__init__(records, handler)
        self._records = records
        self.owner = owner

    def start(self) -> None:
        super().start()
        assert self._thread is not None
        self._thread.name = _WRITER_THREAD_NAME

    def enqueue_sentinel(self) -> None:
        self._records.put(None)  # QueueListener's sentinel: it drains everything before it, then exits

    def stop(self) -> None:
        super().stop()
        self.owner = None


class _JsonLineFormatter(logging.Formatter):
    """Renders an audit record with the sink's structlog logger (``JSONRenderer``), once per record."""

    def __init__(self, renderer: Any) -> None:
        super().__init__()
        self._renderer = renderer

    def format(self, record: logging.LogRecord) -> str:
        if not isinstance(record, _AuditRecord):
            return super().format(record)
        if record.line is None:
            record.line = str(self._renderer.info(record.msg, **(record.fields or {})))
        return record.line


class _AuditFileHandler(logging.handlers.RotatingFileHandler, logging.handlers.WatchedFileHandler):
    """Appends lines to ``path``: ``RotatingFileHandler``'s size rotation (``max_bytes``: ``path`` ->
    ``path.1`` -> ... -> ``path.<backup_count>``) plus ``WatchedFileHandler``'s reopen when ``path`` no
    longer names the open file (logrotate renamed or removed it), checked before every record.

    Runs on the listener's thread only (and at close, after that thread stopped). A write that fails
    (a full or vanished disk) drops that record (counted), logs one warning per run of failures and makes
    the next record reopen the file."""

    def __init__(self, path: Path, *, max_bytes: int | None, backup_count: int, drops: _Drops) -> None:
        logging.handlers.RotatingFileHandler.__init__(
            self, path, mode="a", maxBytes=max_bytes or 0, backupCount=backup_count, encoding="utf-8"
        )
        self.dev, self.ino = -1, -1
        self._statstream()
        self._drops = drops
        self.num_written = 0
        self.num_rotations = 0
        self.num_reopens = 0
        #: Set by ``reopen()`` (any thread) and by a failed write; the next record reopens ``path``.
        self.reopen_requested = False
        self._record_failed = False
        self._failing = False

    # -- one record --------------------------------------------------------------------------------------

    def emit(self, record: logging.LogRecord) -> None:
        flushed = record.flushed if isinstance(record, _AuditRecord) else None
        try:
            if not self._follow_path(record):
                return
            self._write_dropped_marker()
            if flushed is not None:
                return  # nothing to write: every record before it is written (and flushed) already
            self._record_failed = False
            logging.handlers.RotatingFileHandler.emit(self, record)  # rollover check, write, flush
            if not self._record_failed:
                self.num_written += 1
                self._failing = False
        finally:
            if flushed is not None:
                flushed.set()

    def _follow_path(self, record: logging.LogRecord) -> bool:
        """Reopen ``path`` if asked to or if it no longer names the open file; False if that failed."""
        try:
            if self.reopen_requested:
                self.reopen_requested = False
                self.dev, self.ino = -1, -1  # reopenIfNeeded sees another file: reopens
            stream = self.stream
            if stream is None:  # a reopen failed earlier: open again
                self.stream = self._open()
                self._statstream()
            else:
                self.reopenIfNeeded()
            if self.stream is not stream:
                self.num_reopens += 1
        except Exception:  # noqa: BLE001 (as logging's handlers do: nothing may kill the writer thread)
            self.handleError(record)
            return False
        return True

    def _write_dropped_marker(self) -> None:
        num_dropped = self._drops.take_unreported()
        if num_dropped:
            line = json.dumps(
                {"event": DROPPED_EVENT, "num_dropped": num_dropped, "monotonic": time.monotonic()},
                separators=(",", ":"),
            )
            marker = _AuditRecord(DROPPED_EVENT, line=line, num_dropped=num_dropped)
            logging.handlers.RotatingFileHandler.emit(self, marker)

    def close_after_listener(self) -> None:
        """At close (the listener stopped): report the records dropped since the last one, then close."""
        self.acquire()
        try:
            if self._drops.num_unreported and self._follow_path(_AuditRecord(DROPPED_EVENT)):
                self._write_dropped_marker()
        finally:
            self.release()
        self.close()

    # -- RotatingFileHandler hooks ----------------------------------------------------------------------

    def shouldRollover(self, record: logging.LogRecord) -> int:
        """Rotate when this line would grow a non-empty file past ``max_bytes`` (in bytes)."""
        if self.maxBytes <= 0 or self.stream is None:
            return False
        size = self.stream.tell()
        return (
            size > 0
            and size + len(self.format(record).encode("utf-8")) + len(self.terminator) > self.maxBytes
        )

    def doRollover(self) -> None:
        super().doRollover()
        self._statstream()  # the new file is ours: not a reason to reopen
        self.num_rotations += 1

    def handleError(self, record: logging.LogRecord) -> None:
        self._record_failed = True
        self.reopen_requested = True
        if isinstance(record, _AuditRecord):
            if record.fields is not None:
                self._drops.add(1)
            elif record.num_dropped:
                self._drops.unreport(record.num_dropped)
        if not self._failing:
            self._failing = True
            _log.warning(
                "audit log %s: write failed (%s); records dropped until a write succeeds",
                self.baseFilename,
                sys.exc_info()[1],
            )


class JsonLinesAuditSink(AuditSink):
    """Appends one JSON line per transition to ``path`` (the connector's ``audit_log``).

    The caller's thread (vLLM's scheduler) never touches the disk: ``emit`` hands the record to a
    ``logging.handlers.QueueHandler`` over a bounded queue and returns; a ``QueueListener`` thread renders
    it (structlog's ``JSONRenderer``) and appends it, flushed per record. When the queue is full the
    record is dropped and counted (``num_dropped``); the writer then appends one marker line
    ``{"event": "audit_records_dropped", "num_dropped": N, ...}`` so ``hybridkv audit`` reports the gap
    instead of blaming the lifecycle. ``flush()`` waits until every accepted record is written; ``close()``
    drains, then closes the file (an open sink is closed at interpreter exit).

    Living with log rotation:

    - ``max_bytes``: the sink rotates by size itself (``logging.handlers.RotatingFileHandler``):
      ``path`` -> ``path.1`` -> ... -> ``path.<backup_count>`` (the oldest is deleted).
    - It cooperates with ``logrotate`` (like ``logging.handlers.WatchedFileHandler``): before each record
      the writer checks whether ``path`` still names the open file (renamed or removed: ``create`` mode)
      and reopens it if not; ``reopen()`` forces that (call it from a ``SIGHUP`` handler the application
      owns, the library installs none). ``copytruncate`` works too: the file is opened in append mode.

    ``hybridkv.audit.replay.rotated_set(path)`` / ``audit_files`` read ``path.N ... path.1, path`` back as
    one history.

    Args:
        path: the log file; its folder is created.
        max_bytes: rotate when the file would grow past this (``None``: never rotate by size).
        backup_count: rotated files kept when ``max_bytes`` is set.
        max_queued: records that may wait for the writer before new ones are dropped.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        backup_count: int = 5,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"JsonLinesAuditSink: max_bytes must be positive or None, got {max_bytes}")
        if backup_count < 1:
            raise ValueError(f"JsonLinesAuditSink: backup_count must be >= 1, got {backup_count}")
        if max_queued < 1:
            raise ValueError(f"JsonLinesAuditSink: max_queued must be >= 1, got {max_queued}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.backup_count = backup_count
        renderer = structlog.wrap_logger(
            structlog.ReturnLogger(),
            processors=[structlog.processors.JSONRenderer(separators=(",", ":"))],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        )
        super().__init__(renderer)
        self._drops = _Drops()
        self._queue: queue.Queue[logging.LogRecord | None] = queue.Queue(maxsize=max_queued)
        self._file_handler = _AuditFileHandler(
            self.path, max_bytes=max_bytes, backup_count=backup_count, drops=self._drops
        )
        self._file_handler.setFormatter(_JsonLineFormatter(renderer))
        self._queue_handler = _DroppingQueueHandler(self._queue, self._drops)
        self._listener = _AuditListener(self._queue, self._file_handler, owner=self)
        self._closed = False
        self._close_lock = threading.Lock()
        self._listener.start()
        # Records still queued when the interpreter exits are written (the listener's thread is a daemon).
        atexit.register(_close_if_alive, weakref.ref(self))

    # -- the caller's side (never blocks) ----------------------------------------------------------------

    def emit(self, event: str, **fields: Any) -> None:
        if self._closed:
            self._drops.add(1)
            return
        self._queue_handler.handle(_AuditRecord(event, fields))

    @property
    def num_dropped(self) -> int:
        """Records dropped because the writer fell ``max_queued`` records behind (a slow disk), or whose
        write failed."""
        return self._drops.total

    def stats(self) -> dict[str, int]:
        """Counters: written, dropped, queued, rotations (by size), reopens (logrotate or ``reopen()``)."""
        return {
            "num_written": self._file_handler.num_written,
            "num_dropped": self._drops.total,
            "num_queued": self._queue.qsize(),
            "num_rotations": self._file_handler.num_rotations,
            "num_reopens": self._file_handler.num_reopens,
        }

    def reopen(self) -> None:
        """Ask the writer to reopen ``path`` before its next write (e.g. from a ``SIGHUP`` handler)."""
        self._file_handler.reopen_requested = True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every record accepted so far is on disk; ``False`` if ``timeout_s`` ran out first."""
        if self._closed:
            return True
        done = threading.Event()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # A flush request rides the queue behind every accepted record; this put may wait (flush is for
        # callers that choose to wait).
        try:
            self._queue.put(_AuditRecord("", flushed=done), timeout=timeout_s)
        except queue.Full:
            return False
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return done.wait(remaining)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._listener.stop()  # the listener drains everything before its sentinel, then exits
        self._file_handler.close_after_listener()
        self._queue_handler.close()


def _close_if_alive(ref: weakref.ref[JsonLinesAuditSink]) -> None:
    sink = ref()
    if sink is not None:
        sink.close()
