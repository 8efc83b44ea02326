"""Audit records as vLLM's proposed KV-connector lifecycle trace (schema ``vllm-kv-connector-v1``).

vLLM's proposal (vllm-project/vllm PR #52859, ``vllm/distributed/kv_transfer/kv_connector/v1/lifecycle.py``)
logs one JSON object per connector transition, after the log prefix ``KV_CONNECTOR_LIFECYCLE ``, with the
fields (in this order; ``None`` fields omitted)::

    schema, event, wall_ns, monotonic_ns, connector, transfer_mode, component, role,
    request_id_hash, request_group_id_hash, [remote_request_id_hash], [block_count]

Request ids are never written: ``request_id_hash`` is a BLAKE2b-64 (personalisation ``vllm-kv-trace``) of the
request id, ``request_group_id_hash`` the same hash of the id without vLLM's trailing ``-<8 hex>`` suffix.

hybridkv's transitions map onto the proposal's events (the others have no counterpart and are skipped):

=================  =====================  =========  =================================================
audit trigger      trace event            role       block_count
=================  =====================  =========  =================================================
``lookup_hit``     ``blocks_matched``     consumer   blocks found, summed over groups
``lookup_miss``    ``blocks_matched``     consumer   0
``start_load``     ``transfer_started``   consumer   blocks of the load plan, summed over groups
``load_verified``  ``transfer_completed`` consumer  blocks of the load plan
``load_failed``    ``transfer_failed``    consumer   blocks of the load plan
``start_put``      ``transfer_started``   producer   blocks of the save wave
``put_stored``     ``transfer_completed`` producer  blocks of the save wave
``put_failed``     ``transfer_failed``    producer   blocks of the save wave
``drop``           ``transfer_failed``    producer   blocks of the save wave
=================  =====================  =========  =================================================

Loads are reads the consumer pulls (``transfer_mode`` ``pull``), saves are writes the producer pushes
(``push``); every record comes from the scheduler-side state machine (``component`` ``scheduler``).

Clocks: the audit records carry ``monotonic`` seconds. ``monotonic_ns`` is that value in nanoseconds;
``wall_ns`` is derived from one anchor, a pair (monotonic seconds, wall nanoseconds) observed at the same
moment. ``hybridkv audit --export vllm-trace`` anchors each file's last record at the file's modification
time (the sink writes every record as it happens, so that is when the last one was written).

What the trace cannot carry is skipped, never raised (as ``hybridkv audit --export vllm-trace`` skips it):
``records_to_trace`` passes over records without a counterpart (other triggers, markers such as the sink's
drop count), malformed ones (no text ``request_id``, no numeric ``monotonic``) and ones a trace line cannot
hold (a ``monotonic`` that is NaN, infinite or too large for nanoseconds, a request id that is not UTF-8
text: a lone surrogate), and counts them by reason in the caller's ``skipped`` counter (:data:`SKIP_REASONS`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.lifecycle.table import TRIGGERS

__all__ = [
    "CONNECTOR_NAME",
    "LOG_PREFIX",
    "SCHEMA",
    "SKIP_REASONS",
    "TRIGGER_TO_TRACE",
    "TraceRecord",
    "hash_request_id",
    "parse_trace_line",
    "records_to_trace",
    "request_group_id",
]

SCHEMA = "vllm-kv-connector-v1"
LOG_PREFIX = "KV_CONNECTOR_LIFECYCLE "
CONNECTOR_NAME = "HybridStoreConnector"
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)

#: audit trigger -> (trace event, role, transfer mode): the ``trace`` column of the triggers' rows
TRIGGER_TO_TRACE: Mapping[str, tuple[str, str, str]] = {
    trigger.value: row.trace for trigger, row in TRIGGERS.items() if row.trace is not None
}
_EVENTS = frozenset(event for event, _, _ in TRIGGER_TO_TRACE.values())
_FIELDS = (
    "schema",
    "event",
    "wall_ns",
    "monotonic_ns",
    "connector",
    "transfer_mode",
    "component",
    "role",
    "request_id_hash",
    "request_group_id_hash",
    "remote_request_id_hash",
    "block_count",
)
_OPTIONAL_FIELDS = frozenset({"remote_request_id_hash", "block_count"})
#: why ``records_to_trace`` skips a record (the keys of its ``skipped`` counter): no trace event for it, a
#: field missing or of the wrong type, a value no trace line holds (non-finite clock, lone-surrogate id)
SKIP_REASONS: tuple[str, ...] = ("no_counterpart", "malformed", "unrepresentable")


def request_group_id(request_id: str) -> str:
    """The request id without vLLM's random ``-<8 hex>`` suffix (related ids share it)."""
    return _RANDOM_SUFFIX.sub("", request_id)


def hash_request_id(request_id: str) -> str:
    """16 hex digits: BLAKE2b-64 of the id, personalised ``vllm-kv-trace`` (the proposal's hash)."""
    return hashlib.blake2b(
        request_id.encode("utf-8"), digest_size=8, person=b"vllm-kv-trace", usedforsecurity=False
    ).hexdigest()


@dataclass(frozen=True)
class TraceRecord:
    """One ``vllm-kv-connector-v1`` record. ``to_json`` writes the proposal's field order, ``None`` omitted."""

    event: str
    wall_ns: int
    monotonic_ns: int
    transfer_mode: str
    role: str
    request_id_hash: str
    request_group_id_hash: str
    component: str = "scheduler"
    connector: str = CONNECTOR_NAME
    remote_request_id_hash: str | None = None
    block_count: int | None = None
    schema: str = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in _FIELDS}
        return {name: value for name, value in values.items() if value is not None}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def parse_trace_line(line: str) -> TraceRecord:
    """Parse one trace line (with or without ``LOG_PREFIX``); ``ValueError`` naming the bad field."""
    text = line.strip()
    if text.startswith(LOG_PREFIX.strip()):
        text = text[len(LOG_PREFIX.strip()) :].strip()
    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise ValueError(f"trace line is not a JSON object: {line!r}")  # noqa: TRY004 (parse error)
    unknown = set(obj) - set(_FIELDS)
    missing = set(_FIELDS) - _OPTIONAL_FIELDS - set(obj)
    if unknown or missing:
        raise ValueError(f"trace line fields: unknown {sorted(unknown)}, missing {sorted(missing)}")
    if obj["schema"] != SCHEMA:
        raise ValueError(f"trace line schema: expected {SCHEMA!r}, got {obj['schema']!r}")
    if obj["event"] not in _EVENTS:
        raise ValueError(f"trace line event: {obj['event']!r} is not one hybridkv exports")
    for name in ("wall_ns", "monotonic_ns", "block_count"):
        if name in obj and not (isinstance(obj[name], int) and not isinstance(obj[name], bool)):
            raise ValueError(f"trace line {name}: expected an integer, got {obj[name]!r}")
    return TraceRecord(**{name: value for name, value in obj.items()})


def _block_count(trigger: str, record: Mapping[str, Any]) -> int | None:
    if trigger == "lookup_miss":
        return 0
    groups = record.get("groups")
    if not isinstance(groups, list):
        return None
    blocks = [g.get("blocks") for g in groups if isinstance(g, dict)]
    counts = [b for b in blocks if isinstance(b, int) and not isinstance(b, bool)]
    return sum(counts) if counts else None


def _monotonic_ns(monotonic: float) -> int | None:
    """``monotonic`` seconds in whole nanoseconds, or None where no integer holds it (NaN, infinite, or so
    large that the product overflows a float; an int too large for a float raises ``OverflowError``)."""
    try:
        nanoseconds = monotonic * 1e9
    except OverflowError:
        return None
    return round(nanoseconds) if math.isfinite(nanoseconds) else None


def _is_text(value: str) -> bool:
    """Whether ``value`` encodes as UTF-8 (a lone surrogate does not: no hash, no JSON line carries it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def records_to_trace(
    records: Iterable[Mapping[str, Any]],
    *,
    anchor_monotonic_s: float,
    anchor_wall_ns: int,
    skipped: Counter[str] | None = None,
) -> Iterator[TraceRecord]:
    """Map audit records (dicts, in log order) to trace records. ``anchor_*``: one moment on both clocks (see
    the module doc); ``ValueError`` (at the call) if the anchor is not a finite number of seconds and an
    integer of nanoseconds.

    Records the trace cannot carry are skipped, never raised: without a counterpart (markers, other
    triggers), malformed (no text ``request_id``, no numeric ``monotonic``), or unrepresentable (``monotonic``
    NaN, infinite or beyond nanoseconds, a request id that is no UTF-8 text). ``skipped``, if given, counts
    each skipped record under its reason (:data:`SKIP_REASONS`)."""
    if isinstance(anchor_wall_ns, bool) or not isinstance(anchor_wall_ns, int):
        raise ValueError(f"anchor_wall_ns: expected an integer of nanoseconds, got {anchor_wall_ns!r}")  # noqa: TRY004
    anchor_ns = (
        None
        if isinstance(anchor_monotonic_s, bool) or not isinstance(anchor_monotonic_s, (int, float))
        else _monotonic_ns(anchor_monotonic_s)
    )
    if anchor_ns is None:
        raise ValueError(
            f"anchor_monotonic_s: expected a finite number of seconds, got {anchor_monotonic_s!r}"
        )
    return _trace_records(records, anchor_ns=anchor_ns, anchor_wall_ns=anchor_wall_ns, skipped=skipped)


def _trace_records(
    records: Iterable[Mapping[str, Any]], *, anchor_ns: int, anchor_wall_ns: int, skipped: Counter[str] | None
) -> Iterator[TraceRecord]:
    tally: Counter[str] = skipped if skipped is not None else Counter()
    for record in records:
        trigger = record.get("trigger")
        request_id = record.get("request_id")
        monotonic = record.get("monotonic")
        if not isinstance(trigger, str) or trigger not in TRIGGER_TO_TRACE:
            tally["no_counterpart"] += 1
            continue
        if (
            not isinstance(request_id, str)
            or not isinstance(monotonic, (int, float))
            or isinstance(monotonic, bool)
        ):
            tally["malformed"] += 1
            continue
        monotonic_ns = _monotonic_ns(monotonic)
        if monotonic_ns is None or not _is_text(request_id):
            tally["unrepresentable"] += 1
            continue
        event, role, transfer_mode = TRIGGER_TO_TRACE[trigger]
        yield TraceRecord(
            event=event,
            wall_ns=anchor_wall_ns + monotonic_ns - anchor_ns,
            monotonic_ns=monotonic_ns,
            transfer_mode=transfer_mode,
            role=role,
            request_id_hash=hash_request_id(request_id),
            request_group_id_hash=hash_request_id(request_group_id(request_id)),
            block_count=_block_count(trigger, record),
        )
