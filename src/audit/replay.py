"""The replay: check an audit log against the transition table.

``replay_records`` / ``audit_file`` check a log against ``TRANSITIONS``: illegal or discontinuous
transitions, lifecycles that never reach a terminal state, retry loops, retries that hit past the
truncation's cap; plus truncation and per-group hit / miss / verified counts, and the records the writing
sink dropped (its ``audit_records_dropped`` markers).

Engine records (``machine: "engine"``) replay against ``ENGINE_TRANSITIONS``: the namespace gate, reset
epochs and the fingerprint in force. Every ``load_started`` is then checked against the engine: its answer's
epoch and fingerprint must be the engine's latest (``stale_load``: a load that used a fingerprint from before
the reset that preceded it), and the gate must be open (``gate_closed``). A log without engine records (older
connectors) is checked as before. One engine per log: a later ``engine_started`` starts a new engine (a
restart appending to the same file). ``rotated_set`` / ``audit_files`` read a rotated set
(``path.N ... path.1, path``, dated and ``.gz`` siblings too) back as one history.
"""

from __future__ import annotations

import enum
import errno
import functools
import gzip
import json
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hybridkv.audit.sinks import DROPPED_EVENT
from hybridkv.lifecycle.table import (
    ENGINE_INDEX,
    ENGINE_RECORD,
    LOAD_INITIAL,
    LOAD_TERMINAL,
    MAX_LOAD_RETRIES,
    SAVE_INITIAL,
    SAVE_TERMINAL,
    TRIGGERS,
    EngineState,
    EngineTrigger,
    ReplayCount,
    State,
    Trigger,
    transition_index,
)

__all__ = [
    "AuditReport",
    "Violation",
    "ViolationKind",
    "audit_file",
    "audit_files",
    "read_lines",
    "replay_records",
    "rotated_set",
]


class ViolationKind(enum.StrEnum):
    """Every kind of problem the replay reports (``hybridkv audit``; docs/lifecycle.md lists them)."""

    #: not UTF-8, not a JSON object, or lacks the string / int-or-null fields every record has
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
    #: a load whose answer's epoch or fingerprint is not the engine's latest (from before a reset), or
    #: that names neither while the log has engine records
    STALE_LOAD = "stale_load"
    #: a load started while the engine's namespace gate was closed (a reset running, or failed)
    GATE_CLOSED = "gate_closed"


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
    #: engine records (``machine: "engine"``), resets among them, and the engine's state at the end
    num_engine_records: int = 0
    num_resets: int = 0
    engine_state: str | None = None
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
            "num_engine_records": self.num_engine_records,
            "num_resets": self.num_resets,
            "engine_state": self.engine_state,
            "trigger_counts": dict(sorted(self.trigger_counts.items())),
            "group_counts": {str(g): counts for g, counts in sorted(self.group_counts.items())},
            "violation_counts": self.violation_counts(),
            "violations": [v.to_dict() for v in self.violations],
        }


_STATE_NAMES = frozenset(s.name for s in State)
#: A character no UTF-8 text decodes to: a byte that was not UTF-8, as ``surrogateescape`` reads it.
_NOT_UTF8 = re.compile("[\ud800-\udfff]")
_TRIGGER_NAMES = frozenset(t.value for t in Trigger)


class _Line(NamedTuple):
    """One well-formed transition record of an audit log."""

    record: dict[str, Any]
    request_id: str
    src: str
    dst: str
    trigger: str
    wave: int | None


class _EngineLine(NamedTuple):
    """One well-formed engine record of an audit log."""

    src: str
    dst: str
    trigger: str
    epoch: int
    fingerprint: str


@dataclass
class _Engine:
    """What the engine's records said last: its state, reset epoch and fingerprint."""

    state: str
    epoch: int
    fingerprint: str


_ENGINE_STATE_NAMES = frozenset(s.name for s in EngineState)
_ENGINE_TRIGGER_NAMES = frozenset(t.value for t in EngineTrigger)

#: Reports a violation of the line being replayed: ``flag(kind, message)``.
_Flag = Callable[[ViolationKind, str], None]


def replay_records(lines: Iterable[str]) -> AuditReport:
    """Check every line of an audit log against the transition table. Never raises on bad input."""
    index = transition_index()
    report = AuditReport()
    lifecycles: dict[tuple[str, Any], _Lifecycle] = {}
    engine: _Engine | None = None

    for line_number, raw in enumerate(lines, start=1):
        report.num_lines += 1
        parsed = _parse_line(report, line_number, raw)
        if parsed is None:
            continue
        if isinstance(parsed, _EngineLine):
            engine = _replay_engine(
                engine, parsed, report, functools.partial(_flag, report, line_number, None)
            )
            continue
        record, request_id, src, dst, trigger, wave = parsed
        flag = functools.partial(_flag, report, line_number, request_id)
        report.num_records += 1
        report.trigger_counts[trigger] = report.trigger_counts.get(trigger, 0) + 1
        if src not in _STATE_NAMES or dst not in _STATE_NAMES:
            flag(ViolationKind.ILLEGAL, f"unknown state in {src} -> {dst}")
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
            flag(ViolationKind.AFTER_TERMINAL, f"{trigger} after terminal {lifecycle.state}")
            continue
        if src != lifecycle.state:
            flag(
                ViolationKind.DISCONTINUITY,
                f"{trigger} from {src}, but the lifecycle is in {lifecycle.state}",
            )
        spec = index.get((trigger, State[src]))
        if spec is None or spec.dest.name != dst:
            allowed = spec.dest.name if spec else "nowhere"
            flag(ViolationKind.ILLEGAL, f"{trigger}: {src} -> {dst} (table: {src} -> {allowed})")
        lifecycle.state = dst

        row = TRIGGERS.get(Trigger(trigger)) if trigger in _TRIGGER_NAMES else None
        counts = row.replay if row is not None else frozenset()
        _check_retries(lifecycle, trigger, counts, report, flag)
        _count_groups(lifecycle, trigger, counts, record, report=report, flag=flag)
        if trigger == Trigger.START_LOAD and engine is not None:
            _check_load_against_engine(record, engine, flag)

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
    report.engine_state = None if engine is None else engine.state
    return report


def _replay_engine(engine: _Engine | None, line: _EngineLine, report: AuditReport, flag: _Flag) -> _Engine:
    """Check one engine record against ``ENGINE_TRANSITIONS`` and the engine's previous record; returns
    the engine as this record leaves it. The first record of a log (or an ``engine_started``: a restart)
    starts the engine wherever it says (a rotated log may begin mid-run)."""
    report.num_engine_records += 1
    report.trigger_counts[line.trigger] = report.trigger_counts.get(line.trigger, 0) + 1
    if line.trigger == EngineTrigger.BEGIN_RESET:
        report.num_resets += 1
    spec = (
        ENGINE_INDEX.get((line.trigger, EngineState[line.src]))
        if line.trigger in _ENGINE_TRIGGER_NAMES and line.src in _ENGINE_STATE_NAMES
        else None
    )
    if spec is None or spec.dest.name != line.dst:
        allowed = spec.dest.name if spec else "nowhere"
        flag(ViolationKind.ILLEGAL, f"engine {line.trigger}: {line.src} -> {line.dst} (table: {allowed})")
    if engine is not None and line.trigger != EngineTrigger.START:
        if line.src != engine.state:
            flag(
                ViolationKind.DISCONTINUITY,
                f"engine {line.trigger} from {line.src}, but the engine is in {engine.state}",
            )
        expected_epoch = engine.epoch + (1 if line.trigger == EngineTrigger.BEGIN_RESET else 0)
        if line.epoch != expected_epoch:
            flag(
                ViolationKind.ILLEGAL,
                f"engine {line.trigger} in epoch {line.epoch}, expected {expected_epoch}",
            )
        if line.fingerprint != engine.fingerprint and line.trigger != EngineTrigger.ROTATE_WEIGHTS:
            flag(
                ViolationKind.ILLEGAL,
                f"engine {line.trigger} changed the fingerprint {engine.fingerprint} -> {line.fingerprint} "
                "outside a reset's rotate_weights",
            )
    return _Engine(line.dst, line.epoch, line.fingerprint)


def _check_load_against_engine(record: dict[str, Any], engine: _Engine, flag: _Flag) -> None:
    """A ``load_started`` must use the engine's latest epoch and fingerprint, with the gate open."""
    if engine.state != EngineState.OPEN.name:
        flag(ViolationKind.GATE_CLOSED, f"load started while the engine is {engine.state}")
    detail = record.get("detail")
    epoch = detail.get("epoch") if isinstance(detail, dict) else None
    fingerprint = detail.get("fingerprint") if isinstance(detail, dict) else None
    if not isinstance(epoch, int) or not isinstance(fingerprint, str):
        flag(
            ViolationKind.STALE_LOAD,
            "load_started names no epoch and fingerprint (the log has engine records)",
        )
        return
    if epoch != engine.epoch or fingerprint != engine.fingerprint:
        flag(
            ViolationKind.STALE_LOAD,
            f"load used fingerprint {fingerprint} of epoch {epoch}; the engine is in epoch {engine.epoch} "
            f"with fingerprint {engine.fingerprint} (a reset came between the answer and the load)",
        )


def _flag(
    report: AuditReport, line_number: int, request_id: str | None, kind: ViolationKind, message: str
) -> None:
    report.violations.append(Violation(kind, line_number, request_id, message))


def _group_bump(report: AuditReport, group: Any, what: str) -> None:
    if isinstance(group, int):
        counts = report.group_counts.setdefault(group, {"hit": 0, "miss": 0, "verified": 0, "truncated": 0})
        counts[what] += 1


def _parse_line(report: AuditReport, line_number: int, raw: str) -> _Line | _EngineLine | None:
    """The transition record on line ``line_number`` (a request's or save wave's, or the engine's), or
    None: a blank line, a drop marker (counted), or a malformed line (reported)."""
    if not raw.strip():
        return None
    bad_byte = None if raw.isascii() else _NOT_UTF8.search(raw)
    if bad_byte is not None:
        byte = ord(bad_byte.group()) & 0xFF
        report.violations.append(
            Violation(
                ViolationKind.MALFORMED,
                line_number,
                None,
                f"not UTF-8: byte 0x{byte:02x} at column {bad_byte.start() + 1}",
            )
        )
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as error:  # RecursionError: nested deeper than the parser goes
        report.violations.append(Violation(ViolationKind.MALFORMED, line_number, None, f"not JSON: {error}"))
        return None
    if not isinstance(record, dict):
        report.violations.append(Violation(ViolationKind.MALFORMED, line_number, None, "not a JSON object"))
        return None
    if record.get("event") == DROPPED_EVENT and isinstance(record.get("num_dropped"), int):
        report.num_dropped += record["num_dropped"]
        return None
    if record.get("machine") == ENGINE_RECORD:
        return _parse_engine_line(report, line_number, record)
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
        return None
    assert isinstance(request_id, str) and isinstance(src, str) and isinstance(dst, str)
    assert isinstance(trigger, str)
    return _Line(record, request_id, src, dst, trigger, wave)


def _parse_engine_line(report: AuditReport, line_number: int, record: dict[str, Any]) -> _EngineLine | None:
    """An engine record's fields, or None (reported ``malformed``)."""
    src, dst, trigger, epoch, fingerprint = (
        record.get(k) for k in ("src", "dst", "trigger", "epoch", "fingerprint")
    )
    if (
        not all(isinstance(v, str) for v in (src, dst, trigger, fingerprint))
        or not isinstance(epoch, int)
        or isinstance(epoch, bool)
    ):
        report.violations.append(
            Violation(
                ViolationKind.MALFORMED,
                line_number,
                None,
                "an engine record needs string src, dst, trigger, fingerprint and an int epoch",
            )
        )
        return None
    assert isinstance(src, str) and isinstance(dst, str) and isinstance(trigger, str)
    assert isinstance(fingerprint, str)
    return _EngineLine(src, dst, trigger, epoch, fingerprint)


def _check_retries(
    lifecycle: _Lifecycle, trigger: str, counts: frozenset[ReplayCount], report: AuditReport, flag: _Flag
) -> None:
    """Count a retry (a loop past ``MAX_LOAD_RETRIES``) and flag a load started after the retries ran out."""
    if ReplayCount.RETRY in counts:
        lifecycle.num_retries += 1
        report.num_retries += 1
        if lifecycle.num_retries > MAX_LOAD_RETRIES:
            flag(ViolationKind.LOOP, f"retry #{lifecycle.num_retries} (max {MAX_LOAD_RETRIES})")
    elif ReplayCount.ENDS_LOADS in counts:
        lifecycle.gave_up = True
    elif trigger == Trigger.START_LOAD and lifecycle.gave_up:
        flag(ViolationKind.LOOP, "load started after retries ran out")


def _count_groups(
    lifecycle: _Lifecycle,
    trigger: str,
    counts: frozenset[ReplayCount],
    record: dict[str, Any],
    *,
    report: AuditReport,
    flag: _Flag,
) -> None:
    """Flag a hit over the retry cap; count per-group hits, misses, verifications and truncations (a
    truncation also lowers the lifecycle's retry cap)."""
    raw_groups = record.get("groups")
    groups: list[Any] = raw_groups if isinstance(raw_groups, list) else []
    computed = record.get("num_computed_tokens") if isinstance(record.get("num_computed_tokens"), int) else 0
    boundary = record.get("boundary")
    cap = lifecycle.cap
    if trigger == Trigger.LOOKUP_HIT and cap is not None and isinstance(boundary, int) and boundary > cap:
        flag(ViolationKind.OVER_CAP, f"hit {boundary} after a truncation capped the retry at {cap}")
    if ReplayCount.GROUP_HIT_OR_MISS in counts:
        for detail in groups:
            if isinstance(detail, dict) and isinstance(detail.get("hit_tokens"), int):
                _group_bump(report, detail.get("group"), "hit" if detail["hit_tokens"] > computed else "miss")
    elif ReplayCount.GROUP_VERIFIED in counts:
        for detail in groups:
            if isinstance(detail, dict) and detail.get("blocks"):
                _group_bump(report, detail.get("group"), "verified")
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
            _group_bump(report, group, "truncated")


def audit_file(path: str | os.PathLike[str]) -> AuditReport:
    """Replay the log at ``path``. Raises ``OSError`` if it cannot be read (bad lines never raise; a line
    that is not UTF-8 is ``malformed``)."""
    with open(path, encoding="utf-8", errors="surrogateescape") as file:
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


def read_lines(paths: Sequence[str | os.PathLike[str]], *, errors: str = "replace") -> Iterator[str]:
    """The lines of ``paths`` in order, as one stream (``.gz`` files are decompressed). ``errors``: how bytes
    that are not UTF-8 are read (``open``'s argument; the replay reads them ``surrogateescape``, to report).

    A last line without its newline (a file rotated mid-write) is kept whole: each file's lines are
    yielded separately, never glued to the next file's first line. A ``.gz`` file that is not gzip, or is
    cut short, raises ``OSError`` naming it and the line it broke after."""
    for path in paths:
        opener = gzip.open if str(path).endswith(".gz") else open
        line_number = 0
        try:
            with opener(path, "rt", encoding="utf-8", errors=errors) as file:
                for line in file:
                    line_number += 1
                    yield line if line.endswith("\n") else line + "\n"
        except (EOFError, zlib.error, gzip.BadGzipFile) as error:
            raise OSError(
                errno.EIO, f"not a whole gzip file after line {line_number} ({error})", str(path)
            ) from error


def audit_files(paths: Sequence[str | os.PathLike[str]]) -> AuditReport:
    """Replay ``paths`` (e.g. ``rotated_set(path)``) as one history: a lifecycle that began before a
    rotation and ended after it is one lifecycle. Line numbers count across the files in order.
    Raises ``OSError`` if a file cannot be read."""
    return replay_records(read_lines(paths, errors="surrogateescape"))
