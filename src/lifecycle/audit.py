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

import json
import logging
import os
import threading
from collections.abc import Iterable, MutableMapping
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
    State,
    transition_index,
)

__all__ = [
    "AuditReport",
    "AuditSink",
    "JsonLinesAuditSink",
    "MemoryAuditSink",
    "Violation",
    "audit_file",
    "replay_records",
]

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

    def close(self) -> None:
        """Release the sink's resources. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class JsonLinesAuditSink(AuditSink):
    """Appends one JSON line per transition to ``path`` (the connector's ``audit_log``), flushed per line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        logger = structlog.wrap_logger(
            structlog.WriteLogger(self._file),
            processors=[structlog.processors.JSONRenderer(separators=(",", ":"))],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        )
        super().__init__(logger)

    def emit(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._logger.info(event, **fields)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


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


@dataclass(frozen=True)
class Violation:
    """One problem found in a log. ``kind``: malformed | illegal | discontinuity | after_terminal |
    unterminated | loop | over_cap (a lookup after a truncation hit past the recorded retry cap)."""

    kind: str
    line: int | None
    request_id: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "line": self.line, "request_id": self.request_id, "message": self.message}


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
            counts[violation.kind] = counts.get(violation.kind, 0) + 1
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
            "trigger_counts": dict(sorted(self.trigger_counts.items())),
            "group_counts": {str(g): counts for g, counts in sorted(self.group_counts.items())},
            "violation_counts": self.violation_counts(),
            "violations": [v.to_dict() for v in self.violations],
        }


_STATE_NAMES = frozenset(s.name for s in State)


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
            report.violations.append(Violation("malformed", line_number, None, f"not JSON: {error}"))
            continue
        if not isinstance(record, dict):
            report.violations.append(Violation("malformed", line_number, None, "not a JSON object"))
            continue
        request_id, src, dst, trigger = (record.get(k) for k in ("request_id", "src", "dst", "trigger"))
        wave = record.get("wave")
        if not all(isinstance(v, str) for v in (request_id, src, dst, trigger)) or not (
            wave is None or isinstance(wave, int)
        ):
            report.violations.append(
                Violation(
                    "malformed",
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
                Violation("illegal", line_number, request_id, f"unknown state in {src} -> {dst}")
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
                    "after_terminal", line_number, request_id, f"{trigger} after terminal {lifecycle.state}"
                )
            )
            continue
        if src != lifecycle.state:
            report.violations.append(
                Violation(
                    "discontinuity",
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
                    "illegal",
                    line_number,
                    request_id,
                    f"{trigger}: {src} -> {dst} (table: {src} -> {allowed})",
                )
            )
        lifecycle.state = dst

        if trigger == "retry":
            lifecycle.num_retries += 1
            report.num_retries += 1
            if lifecycle.num_retries > MAX_LOAD_RETRIES:
                report.violations.append(
                    Violation(
                        "loop",
                        line_number,
                        request_id,
                        f"retry #{lifecycle.num_retries} (max {MAX_LOAD_RETRIES})",
                    )
                )
        elif trigger == "give_up":
            lifecycle.gave_up = True
        elif trigger == "start_load" and lifecycle.gave_up:
            report.violations.append(
                Violation("loop", line_number, request_id, "load started after retries ran out")
            )

        raw_groups = record.get("groups")
        groups: list[Any] = raw_groups if isinstance(raw_groups, list) else []
        computed = (
            record.get("num_computed_tokens") if isinstance(record.get("num_computed_tokens"), int) else 0
        )
        boundary = record.get("boundary")
        cap = lifecycle.cap
        if trigger == "lookup_hit" and cap is not None and isinstance(boundary, int) and boundary > cap:
            report.violations.append(
                Violation(
                    "over_cap",
                    line_number,
                    request_id,
                    f"hit {boundary} after a truncation capped the retry at {cap}",
                )
            )
        if trigger in ("lookup_hit", "lookup_miss"):
            for detail in groups:
                if isinstance(detail, dict) and isinstance(detail.get("hit_tokens"), int):
                    group_bump(detail.get("group"), "hit" if detail["hit_tokens"] > computed else "miss")
        elif trigger == "load_verified":
            for detail in groups:
                if isinstance(detail, dict) and detail.get("blocks"):
                    group_bump(detail.get("group"), "verified")
        elif trigger == "load_failed":
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
                    "unterminated",
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
