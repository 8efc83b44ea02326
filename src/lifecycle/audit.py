"""The audit trail: sinks that receive one record per transition, and the replay that checks a log.

Record (one JSON object per line)::

    {"event": "hit_found", "request_id": "r1", "wave": null, "src": "LOOKUP", "dst": "PARTIAL_HIT",
     "trigger": "lookup_hit", "boundary": 160, "num_computed_tokens": 0,
     "groups": [{"group": 0, "hit_tokens": 160, "blocks": 5}, ...], "detail": null, "monotonic": 12.5}

Sinks never touch structlog's global configuration: each wraps its own logger
(``structlog.wrap_logger``) with its own processors. ``replay_records`` / ``audit_file`` check a log
against ``TRANSITIONS``: illegal or discontinuous transitions, lifecycles that never reach a terminal
state, retry loops, retries that hit past the truncation's cap; plus truncation and per-group hit / miss / verified counts.
"""

from __future__ import annotations

import atexit
import enum
import gzip
import json
import logging
import os
import queue
import re
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self

import structlog
from hybridkv.lifecycle.machine import (
    LOAD_INITIAL,
    LOAD_TERMINAL,
    MAX_LOAD_RETRIES,
    SAVE_INITIAL,
    SAVE_TERMINAL,
    TRIGGERS,
    ReplayCount,
    State,
    Trigger,
    transition_index,
)

__all__ = [
    "AuditReport",
    "AuditSink",
    "JsonLinesAuditSink",
    "MemoryAuditSink",
    "Violation",
    "ViolationKind",
    "audit_file",
    "audit_files",
    "read_lines",
    "replay_records",
    "rotated_set",
]

_log = logging.getLogger(__name__)

#: Records that may wait for the JSON sink's writer thread before new ones are dropped.
DEFAULT_MAX_QUEUED = 65536
#: ``event`` of the marker line the JSON sink writes after dropping records (a full queue).
DROPPED_EVENT = "audit_records_dropped"
_FLUSH_MARK = "__hybridkv_flush__"

#: Keys of every record besides ``event``.
RECORD_KEYS = (
    "request_id",
    "wave",
    "src",
    "dst",
    "trigger",
    "boundary",
    "num_computed_tokens",
    "groups",
    "detail",
    "monotonic",
)


class AuditSink:
    """Receives one structlog record per transition through a dedicated logger.

    Args:
        logger: a structlog bound logger built for this sink (e.g. with ``structlog.wrap_logger``),
            or any object with an ``info(event, **fields)`` method.
    """

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def emit(self, event: str, **fields: Any) -> None:
        self._logger.info(event, **fields)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every record emitted so far is delivered; False if ``timeout_s`` ran out first.
        This sink hands records to its logger synchronously: always True."""
        return True

    def close(self) -> None:
        """Release the sink's resources. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class JsonLinesAuditSink(AuditSink):
    """Appends one JSON line per transition to ``path`` (the connector's ``audit_log``).

    The caller's thread (vLLM's scheduler) never touches the disk: ``emit`` puts the record on a bounded
    queue and returns; a writer thread renders and appends it, flushed per batch. When the queue is full
    the record is dropped and counted (``num_dropped``); the writer then appends one marker line
    ``{"event": "audit_records_dropped", "num_dropped": N, ...}`` so ``hybridkv audit`` reports the gap
    instead of blaming the lifecycle. ``flush()`` waits until every accepted record is written; ``close()``
    drains, then closes the file.

    Living with log rotation:

    - ``max_bytes``: the sink rotates by size itself, like ``logging.handlers.RotatingFileHandler``:
      ``path`` -> ``path.1`` -> ... -> ``path.<backup_count>`` (the oldest is deleted).
    - Otherwise it cooperates with ``logrotate``: before each batch the writer checks whether ``path``
      still names the open file (renamed or removed: ``create`` mode) and reopens it if not; ``reopen()``
      forces that (call it from a ``SIGHUP`` handler the application owns, the library installs none).
      ``copytruncate`` works too: the file is opened in append mode.

    ``read_rotated_set(path)`` / ``audit_files`` read ``path.N ... path.1, path`` back as one history.

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
        self._file: IO[str] = self.path.open("a", encoding="utf-8")
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(maxsize=max_queued)
        self._num_dropped = 0
        self._num_dropped_reported = 0
        self._num_written = 0
        self._num_rotations = 0
        self._num_reopens = 0
        self._reopen_requested = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._drop_lock = threading.Lock()
        self._buffer = _LineBuffer()
        logger = structlog.wrap_logger(
            structlog.WriteLogger(self._buffer),  # type: ignore[arg-type]
            processors=[structlog.processors.JSONRenderer(separators=(",", ":"))],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        )
        super().__init__(logger)
        self._writer = threading.Thread(target=self._write_loop, name="hybridkv-audit-writer", daemon=True)
        self._writer.start()
        # Records still queued when the interpreter exits are written (the writer is a daemon thread).
        atexit.register(_close_if_alive, weakref.ref(self))

    # -- the caller's side (never blocks) ----------------------------------------------------------------

    def emit(self, event: str, **fields: Any) -> None:
        if self._closed:
            with self._drop_lock:
                self._num_dropped += 1
            return
        try:
            self._queue.put_nowait((event, fields))
        except queue.Full:
            with self._drop_lock:
                self._num_dropped += 1

    @property
    def num_dropped(self) -> int:
        """Records dropped because the writer fell ``max_queued`` records behind (a slow disk)."""
        return self._num_dropped

    def stats(self) -> dict[str, int]:
        """Counters: written, dropped, queued, rotations (by size), reopens (logrotate or ``reopen()``)."""
        return {
            "num_written": self._num_written,
            "num_dropped": self._num_dropped,
            "num_queued": self._queue.qsize(),
            "num_rotations": self._num_rotations,
            "num_reopens": self._num_reopens,
        }

    def reopen(self) -> None:
        """Ask the writer to reopen ``path`` before its next write (e.g. from a ``SIGHUP`` handler)."""
        self._reopen_requested = True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every record accepted so far is on disk; ``False`` if ``timeout_s`` ran out first."""
        if self._closed:
            return True
        done = threading.Event()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # A sentinel callback rides the queue; waiting for the queue to be empty is not enough (the
        # writer may hold the last batch). This put may wait: flush is for callers that choose to wait.
        try:
            self._queue.put(("", {_FLUSH_MARK: done}), timeout=timeout_s)
        except queue.Full:
            return False
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return done.wait(remaining)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)  # the writer drains everything before the sentinel, then exits
        self._writer.join()
        if not self._file.closed:
            self._file.close()

    # -- the writer thread ----------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while item is not None:  # take what is already queued: one flush (and one stat) per batch
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
            stop = self._write_batch(batch)
            if stop:
                return

    def _write_batch(self, batch: list[tuple[str, dict[str, Any]] | None]) -> bool:
        """Write ``batch``; ``True`` when it held the close sentinel."""
        waiters: list[threading.Event] = []
        stop = False
        try:
            self._maybe_reopen()
            with self._drop_lock:
                num_new_drops = self._num_dropped - self._num_dropped_reported
                self._num_dropped_reported = self._num_dropped
            if num_new_drops:
                self._write_line(
                    json.dumps(
                        {"event": DROPPED_EVENT, "num_dropped": num_new_drops, "monotonic": time.monotonic()},
                        separators=(",", ":"),
                    )
                )
            for item in batch:
                if item is None:
                    stop = True
                    continue
                event, fields = item
                if _FLUSH_MARK in fields:
                    waiters.append(fields[_FLUSH_MARK])
                    continue
                self._logger.info(event, **fields)
                self._write_line(self._buffer.take())
                self._num_written += 1
            self._file.flush()
        except (OSError, ValueError) as error:
            # A full or vanished disk must not kill the writer (the records of this batch are lost and
            # counted); the next batch tries again, reopening the file.
            with self._drop_lock:
                self._num_dropped += sum(
                    1 for item in batch if item is not None and _FLUSH_MARK not in item[1]
                )
            self._reopen_requested = True
            _log.warning("audit log %s: write failed (%s); records dropped", self.path, error)
        for waiter in waiters:
            waiter.set()
        return stop

    def _write_line(self, line: str) -> None:
        if not line.endswith("\n"):
            line += "\n"
        if self.max_bytes is not None:
            size = self._file.tell()
            if size > 0 and size + len(line.encode("utf-8")) > self.max_bytes:
                self._rotate()
        self._file.write(line)

    def _maybe_reopen(self) -> None:
        if not self._reopen_requested and not self._file.closed:
            try:
                on_disk = os.stat(self.path)
                still_ours = os.path.samestat(on_disk, os.fstat(self._file.fileno()))
            except FileNotFoundError:
                still_ours = False
            if still_ours:
                return
        self._reopen_requested = False
        if not self._file.closed:
            self._file.close()
        self._file = self.path.open("a", encoding="utf-8")
        self._num_reopens += 1

    def _rotate(self) -> None:
        self._file.close()
        for index in range(self.backup_count - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = self.path.open("a", encoding="utf-8")
        self._num_rotations += 1


class _LineBuffer:
    """The file-like object the sink's structlog logger writes to; the writer thread takes each line."""

    def __init__(self) -> None:
        self._parts: list[str] = []

    def write(self, text: str) -> None:
        self._parts.append(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text = "".join(self._parts)
        self._parts.clear()
        return text


def _close_if_alive(ref: weakref.ref[JsonLinesAuditSink]) -> None:
    sink = ref()
    if sink is not None:
        sink.close()


class MemoryAuditSink(AuditSink):
    """Keeps the records as dicts (tests, benchmarks); ``records`` is in emission order."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

        def capture(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
            self.records.append(dict(event_dict))
            raise structlog.DropEvent

        super().__init__(
            structlog.wrap_logger(
                structlog.ReturnLogger(),
                processors=[capture],
                wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            )
        )


# -- replay -------------------------------------------------------------------------------------------


class ViolationKind(enum.StrEnum):
    """Every kind of problem the replay reports (``hybridkv audit``; docs/lifecycle.md lists them)."""

    #: not a JSON object, or lacks the string / int-or-null fields every record has
    MALFORMED = "malformed"
    #: an unknown state, or a trigger that does not lead from ``src`` to ``dst`` in the table
    ILLEGAL = "illegal"
    #: ``src`` is not the state the lifecycle's previous record left it in
    DISCONTINUITY = "discontinuity"
    #: a record after the lifecycle's terminal state
    AFTER_TERMINAL = "after_terminal"
    #: the lifecycle ends in a non-terminal state
    UNTERMINATED = "unterminated"
    #: more retries than allowed, or a load after the retries ran out
    LOOP = "loop"
    #: a lookup after a truncation hit past the recorded retry cap
    OVER_CAP = "over_cap"


@dataclass(frozen=True)
class Violation:
    """One problem found in a log."""

    kind: ViolationKind
    line: int | None
    request_id: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "line": self.line,
            "request_id": self.request_id,
            "message": self.message,
        }


@dataclass
class _Lifecycle:
    side: str
    state: str
    first_line: int
    num_retries: int = 0
    gave_up: bool = False
    #: The retry cap of the last truncation of this incarnation (None: not truncated).
    cap: int | None = None

    @property
    def terminal(self) -> bool:
        terminal = LOAD_TERMINAL if self.side == "load" else SAVE_TERMINAL
        return State[self.state] in terminal


@dataclass
class AuditReport:
    num_lines: int = 0
    num_records: int = 0
    num_lifecycles: int = 0
    num_terminated: int = 0
    num_truncations: int = 0
    num_retries: int = 0
    #: Records the writing sink dropped (its queue was full), from its ``audit_records_dropped`` markers.
    num_dropped: int = 0
    trigger_counts: dict[str, int] = field(default_factory=dict)
    #: group index -> {"hit": n, "miss": n, "verified": n, "truncated": n}
    group_counts: dict[int, dict[str, int]] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def violation_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for violation in self.violations:
            counts[violation.kind.value] = counts.get(violation.kind.value, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "num_lines": self.num_lines,
            "num_records": self.num_records,
            "num_lifecycles": self.num_lifecycles,
            "num_terminated": self.num_terminated,
            "num_truncations": self.num_truncations,
            "num_retries": self.num_retries,
            "num_dropped": self.num_dropped,
            "trigger_counts": dict(sorted(self.trigger_counts.items())),
            "group_counts": {str(g): counts for g, counts in sorted(self.group_counts.items())},
            "violation_counts": self.violation_counts(),
            "violations": [v.to_dict() for v in self.violations],
        }


_STATE_NAMES = frozenset(s.name for s in State)
_TRIGGER_NAMES = frozenset(t.value for t in Trigger)


def replay_records(lines: Iterable[str]) -> AuditReport:
    """Check every line of an audit log against the transition table. Never raises on bad input."""
    index = transition_index()
    report = AuditReport()
    lifecycles: dict[tuple[str, Any], _Lifecycle] = {}

    def group_bump(group: Any, what: str) -> None:
        if isinstance(group, int):
            counts = report.group_counts.setdefault(
                group, {"hit": 0, "miss": 0, "verified": 0, "truncated": 0}
            )
            counts[what] += 1

    for line_number, raw in enumerate(lines, start=1):
        report.num_lines += 1
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as error:
            report.violations.append(
                Violation(ViolationKind.MALFORMED, line_number, None, f"not JSON: {error}")
            )
            continue
        if not isinstance(record, dict):
            report.violations.append(
                Violation(ViolationKind.MALFORMED, line_number, None, "not a JSON object")
            )
            continue
        if record.get("event") == DROPPED_EVENT and isinstance(record.get("num_dropped"), int):
            report.num_dropped += record["num_dropped"]
            continue
        request_id, src, dst, trigger = (record.get(k) for k in ("request_id", "src", "dst", "trigger"))
        wave = record.get("wave")
        if not all(isinstance(v, str) for v in (request_id, src, dst, trigger)) or not (
            wave is None or isinstance(wave, int)
        ):
            report.violations.append(
                Violation(
                    ViolationKind.MALFORMED,
                    line_number,
                    request_id if isinstance(request_id, str) else None,
                    "needs string request_id, src, dst, trigger and an int or null wave",
                )
            )
            continue
        assert isinstance(request_id, str) and isinstance(src, str) and isinstance(dst, str)
        assert isinstance(trigger, str)
        report.num_records += 1
        report.trigger_counts[trigger] = report.trigger_counts.get(trigger, 0) + 1
        if src not in _STATE_NAMES or dst not in _STATE_NAMES:
            report.violations.append(
                Violation(ViolationKind.ILLEGAL, line_number, request_id, f"unknown state in {src} -> {dst}")
            )
            continue

        side = "load" if wave is None else "save"
        key = (request_id, wave)
        lifecycle = lifecycles.get(key)
        initial = (LOAD_INITIAL if side == "load" else SAVE_INITIAL).name
        if lifecycle is None or (lifecycle.terminal and side == "load" and src == initial):
            if lifecycle is not None:
                report.num_terminated += 1  # the previous incarnation of a resumed request
            lifecycle = lifecycles[key] = _Lifecycle(side, initial, line_number)
            report.num_lifecycles += 1
        if lifecycle.terminal:
            report.violations.append(
                Violation(
                    ViolationKind.AFTER_TERMINAL,
                    line_number,
                    request_id,
                    f"{trigger} after terminal {lifecycle.state}",
                )
            )
            continue
        if src != lifecycle.state:
            report.violations.append(
                Violation(
                    ViolationKind.DISCONTINUITY,
                    line_number,
                    request_id,
                    f"{trigger} from {src}, but the lifecycle is in {lifecycle.state}",
                )
            )
        spec = index.get((trigger, State[src]))
        if spec is None or spec.dest.name != dst:
            allowed = spec.dest.name if spec else "nowhere"
            report.violations.append(
                Violation(
                    ViolationKind.ILLEGAL,
                    line_number,
                    request_id,
                    f"{trigger}: {src} -> {dst} (table: {src} -> {allowed})",
                )
            )
        lifecycle.state = dst

        row = TRIGGERS.get(Trigger(trigger)) if trigger in _TRIGGER_NAMES else None
        counts = row.replay if row is not None else frozenset()
        if ReplayCount.RETRY in counts:
            lifecycle.num_retries += 1
            report.num_retries += 1
            if lifecycle.num_retries > MAX_LOAD_RETRIES:
                report.violations.append(
                    Violation(
                        ViolationKind.LOOP,
                        line_number,
                        request_id,
                        f"retry #{lifecycle.num_retries} (max {MAX_LOAD_RETRIES})",
                    )
                )
        elif ReplayCount.ENDS_LOADS in counts:
            lifecycle.gave_up = True
        elif trigger == Trigger.START_LOAD and lifecycle.gave_up:
            report.violations.append(
                Violation(ViolationKind.LOOP, line_number, request_id, "load started after retries ran out")
            )

        raw_groups = record.get("groups")
        groups: list[Any] = raw_groups if isinstance(raw_groups, list) else []
        computed = (
            record.get("num_computed_tokens") if isinstance(record.get("num_computed_tokens"), int) else 0
        )
        boundary = record.get("boundary")
        cap = lifecycle.cap
        if trigger == Trigger.LOOKUP_HIT and cap is not None and isinstance(boundary, int) and boundary > cap:
            report.violations.append(
                Violation(
                    ViolationKind.OVER_CAP,
                    line_number,
                    request_id,
                    f"hit {boundary} after a truncation capped the retry at {cap}",
                )
            )
        if ReplayCount.GROUP_HIT_OR_MISS in counts:
            for detail in groups:
                if isinstance(detail, dict) and isinstance(detail.get("hit_tokens"), int):
                    group_bump(detail.get("group"), "hit" if detail["hit_tokens"] > computed else "miss")
        elif ReplayCount.GROUP_VERIFIED in counts:
            for detail in groups:
                if isinstance(detail, dict) and detail.get("blocks"):
                    group_bump(detail.get("group"), "verified")
        elif ReplayCount.TRUNCATION in counts:
            report.num_truncations += 1
            detail = record.get("detail")
            cap = detail.get("retry_cap") if isinstance(detail, dict) else None
            if not isinstance(cap, int):
                cap = record.get("boundary")
            if isinstance(cap, int):
                lifecycle.cap = cap if lifecycle.cap is None else min(cap, lifecycle.cap)
            failed = detail.get("failed_groups") if isinstance(detail, dict) else None
            for group in failed if isinstance(failed, list) else []:
                group_bump(group, "truncated")

    for (request_id, _wave), lifecycle in lifecycles.items():
        if lifecycle.terminal:
            report.num_terminated += 1
        else:
            report.violations.append(
                Violation(
                    ViolationKind.UNTERMINATED,
                    lifecycle.first_line,
                    request_id,
                    f"{lifecycle.side} lifecycle ended in {lifecycle.state}",
                )
            )
    return report


def audit_file(path: str | os.PathLike[str]) -> AuditReport:
    """Replay the log at ``path``. Raises ``OSError`` if it cannot be read (bad lines never raise)."""
    with open(path, encoding="utf-8", errors="replace") as file:
        return replay_records(file)


# -- rotated sets -------------------------------------------------------------------------------------

#: ``audit.jsonl.3`` (the sink's own rotation, logrotate's default) or ``audit.jsonl-20261201``
#: (logrotate's ``dateext``), optionally compressed (``.gz``).
_ROTATED_SUFFIX = re.compile(r"^(?:\.(?P<index>\d+)|-(?P<date>\d{8,14}))(?P<gz>\.gz)?$")


def rotated_set(path: str | os.PathLike[str]) -> list[Path]:
    """``path`` and its rotated siblings, oldest first: ``path.N ... path.1`` (numbered: higher is older),
    ``path-<date>`` (dated: ascending), then ``path`` itself (if it exists). Compressed siblings count."""
    path = Path(path)
    numbered: list[tuple[int, Path]] = []
    dated: list[tuple[str, Path]] = []
    if path.parent.is_dir():
        for sibling in path.parent.iterdir():
            if not sibling.name.startswith(path.name) or sibling == path:
                continue
            match = _ROTATED_SUFFIX.match(sibling.name[len(path.name) :])
            if match is None or not sibling.is_file():
                continue
            if match["index"] is not None:
                numbered.append((int(match["index"]), sibling))
            else:
                dated.append((match["date"], sibling))
    ordered = [p for _, p in sorted(dated)] + [p for _, p in sorted(numbered, reverse=True)]
    if path.is_file():
        ordered.append(path)
    return ordered


def read_lines(paths: Sequence[str | os.PathLike[str]]) -> Iterator[str]:
    """The lines of ``paths`` in order, as one stream (``.gz`` files are decompressed).

    A last line without its newline (a file rotated mid-write) is kept whole: each file's lines are
    yielded separately, never glued to the next file's first line."""
    for path in paths:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as file:
            for line in file:
                yield line if line.endswith("\n") else line + "\n"


def audit_files(paths: Sequence[str | os.PathLike[str]]) -> AuditReport:
    """Replay ``paths`` (e.g. ``rotated_set(path)``) as one history: a lifecycle that began before a
    rotation and ended after it is one lifecycle. Line numbers count across the files in order.
    Raises ``OSError`` if a file cannot be read."""
    return replay_records(read_lines(paths))
