"""``hybridkv bench serve --trace``: where each hit's time to first token goes, step by step.

The hybridkv servers run with ``step_trace: true``: their scheduler logs one ``hybridkv step`` event per
scheduler step (``hybridkv.connector.scheduler.step_trace``: the requests it asked again, answered a hit,
sent loads for, saw loads finish for, scheduled first, with ``time.monotonic()``). This joins those events
with the audit log (the lifecycle's transitions, same clock) and the client's records (send time on the same
clock, TTFT): per resent-turn request that hit, the milliseconds from its send to each event and the step
boundaries it waited at each stage, and each stage's steps (their lengths and the tokens they computed).

Stages (``STAGES``), each from the previous event:

- ``first_ask``: vLLM first asks the connector (the step the request is first asked in);
- ``answered``: the lookup answered a hit (after ``asked_again`` "ask again" answers, one per step);
- ``load_start``: the step that sends the load job (planned in the same step as the answer);
- ``load_done``: the step output in which every rank reported the load (the audit's ``load_verified``);
- ``scheduled``: vLLM schedules the request (``scheduled`` step);

A step's events happen while vLLM schedules it; the trace gives them the step's time (its event's
``monotonic``, taken once it is scheduled); ``audit_ms`` keeps the audit's own times of the lookup's start,
the answered hit, the planned load and its verdict.
- ``first_token``: the client's first token (its TTFT).
"""

from __future__ import annotations

import ast
import itertools
import json
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridkv.connector.log_events import ConnectorLogEvent

from hybridkv_dev.bench.record import RequestRecord

__all__ = [
    "STAGES",
    "audit_times",
    "format_trace",
    "format_traces",
    "hit_trace",
    "resent_engine_times",
    "step_events",
]

#: the events of a hit, in the order they happen (module docstring)
STAGES: tuple[str, ...] = ("first_ask", "answered", "load_start", "load_done", "scheduled", "first_token")
_AUDIT_TRIGGERS = ("start_lookup", "lookup_hit", "start_load", "load_verified")
_LIST_FIELDS = ("asked_again", "hits", "scheduled", "loads", "loads_done")
_FIELD = re.compile(r"(\w+)=(\[[^\]]*\]|'[^']*'|\S+)")


def step_events(server_log: str) -> list[dict[str, Any]]:
    """The ``hybridkv step`` events of a server's log (structlog's console lines), in step order."""
    events: list[dict[str, Any]] = []
    marker = f"] {ConnectorLogEvent.STEP.value} "
    for line in server_log.splitlines():
        _, found, rest = line.partition(marker)
        if not found:
            continue
        event: dict[str, Any] = {}
        for key, text in _FIELD.findall(rest):
            try:
                event[key] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                event[key] = text
        if isinstance(event.get("step"), int) and isinstance(event.get("monotonic"), float):
            for key in _LIST_FIELDS:
                event.setdefault(key, [])
            events.append(event)
    events.sort(key=lambda e: e["step"])
    return events


def audit_times(audit: Path) -> dict[str, dict[str, float]]:
    """Per request id, the monotonic time of its first audit record of each trigger."""
    times: dict[str, dict[str, float]] = {}
    for line in audit.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        rid, trigger, when = record.get("request_id"), record.get("trigger"), record.get("monotonic")
        if isinstance(rid, str) and isinstance(trigger, str) and isinstance(when, (int, float)):
            times.setdefault(rid, {}).setdefault(trigger, float(when))
    return times


def _first_step(events: Sequence[dict[str, Any]], key: str, rid: str, after: int = -1) -> int | None:
    return next((e["step"] for e in events if e["step"] > after and rid in e[key]), None)


def _ms(value: float | None, origin: float) -> float | None:
    return None if value is None else round((value - origin) * 1000.0, 1)


def _one_hit(
    record: RequestRecord,
    rid: str,
    events: Sequence[dict[str, Any]],
    by_step: Mapping[int, dict[str, Any]],
    audit: Mapping[str, float],
) -> dict[str, Any] | None:
    """One hit's trace, or None when the step events do not show its whole way (not a hit, or a retry)."""
    asked = [e["step"] for e in events if rid in e["asked_again"] or rid in e["hits"]]
    answered = _first_step(events, "hits", rid)
    if not asked or answered is None:
        return None
    loaded = _first_step(events, "loads", rid, answered - 1)
    done = _first_step(events, "loads_done", rid, answered - 1)
    scheduled = _first_step(events, "scheduled", rid, answered - 1)
    if loaded is None or done is None or scheduled is None or record.ttft_s is None:
        return None
    sent = record.start_monotonic
    steps = {
        "first_ask": asked[0],
        "answered": answered,
        "load_start": loaded,
        "load_done": done,
        "scheduled": scheduled,
    }
    at = {
        "first_ask": by_step[asked[0]]["monotonic"],
        "answered": by_step[answered]["monotonic"],
        "load_start": by_step[loaded]["monotonic"],
        "load_done": by_step[done].get("output_monotonic") or audit.get("load_verified"),
        "scheduled": by_step[scheduled]["monotonic"],
        "first_token": sent + record.ttft_s,
    }
    stage_steps: dict[str, list[dict[str, Any]]] = {}
    previous = None
    for stage, step in steps.items():
        lo = asked[0] - 1 if previous is None else previous
        stage_steps[stage] = [
            {"step": s, "tokens": by_step[s]["tokens"], "ms": by_step[s].get("ms")}
            for s in range(lo, step)
            if s in by_step
        ]
        previous = step
    return {
        "request_id": rid,
        "session": record.session,
        "turn": record.turn,
        "sent": sent,
        "lookup_start_ms": _ms(audit.get("start_lookup"), sent),
        "verified_ms": _ms(audit.get("load_verified"), sent),
        # the audit's own times (ms from the send): the lookup's start at arrival, the ask that answered the
        # hit, the load's plan (vLLM's allocation) and its verdict
        "audit_ms": {
            trigger: _ms(when, sent) for trigger, when in audit.items() if trigger in _AUDIT_TRIGGERS
        },
        "ms": {stage: _ms(at[stage], sent) for stage in STAGES},
        "step": steps,
        "asked_again": sum(1 for s in asked if s < answered),
        # step boundaries between one event and the next (first_ask: the step running when it arrived)
        "boundaries": {
            "answered": answered - asked[0],
            "load_done": done - loaded,
            "scheduled": scheduled - done,
        },
        "stage_steps": stage_steps,
        # vLLM's queue time: from its arrival (the connector's lookup starts then) to its first scheduling
        "engine_queue_ms": _ms(at["scheduled"], audit.get("start_lookup", sent)),
        "prefill_ms": _ms(at["first_token"], at["scheduled"]),
    }


def hit_trace(
    server_log: str,
    audit: Path,
    records: Sequence[RequestRecord],
    *,
    first_turn: int = 1,
) -> dict[str, Any]:
    """The trace of every request of turn ``first_turn`` on (0-based) that hit: ``hits`` (one entry each, see
    ``_one_hit``), ``medians`` (ms from the send to each event, and boundaries per stage), ``steps`` (how long
    the run's steps lasted: every step, and those that computed tokens), and ``num_step_events``."""
    events = step_events(server_log)
    for event, following in itertools.pairwise(events):
        event["ms"] = round((following["monotonic"] - event["monotonic"]) * 1000.0, 1)
    by_step = {e["step"]: e for e in events}
    times = audit_times(audit)
    hits: list[dict[str, Any]] = []
    for record in records:
        if record.phase != "turn" or record.turn < first_turn or not record.response_id:
            continue
        rids = [rid for rid in times if rid.startswith(record.response_id)]
        for rid in rids:
            hit = _one_hit(record, rid, events, by_step, times[rid])
            if hit is not None:
                hits.append(hit)
    medians: dict[str, Any] = {}
    if hits:
        for stage in STAGES:
            values = [h["ms"][stage] for h in hits if h["ms"][stage] is not None]
            medians[f"{stage}_ms"] = round(statistics.median(values), 1) if values else None
        for stage in ("answered", "load_done", "scheduled"):
            medians[f"{stage}_boundaries"] = statistics.median(h["boundaries"][stage] for h in hits)
        for key in ("engine_queue_ms", "prefill_ms", "lookup_start_ms", "verified_ms"):
            values = [h[key] for h in hits if h[key] is not None]
            medians[key] = round(statistics.median(values), 1) if values else None
    busy = [e["ms"] for e in events if "ms" in e and e["tokens"] > 0]
    return {
        "num_step_events": len(events),
        "hits": hits,
        "medians": medians,
        "steps": {
            "num": len(events),
            "num_with_tokens": len(busy),
            "median_ms_with_tokens": statistics.median(busy) if busy else None,
            "max_ms": max(busy, default=None),
        },
    }


def format_trace(config: str, trace: Mapping[str, Any]) -> str:
    """The trace as a compact table: one line per hit (ms from the send to each event, boundaries waited at
    the lookup and the load), then the medians."""
    head = "  ".join(f"{stage:>11}" for stage in STAGES)
    lines = [f"{config}: {len(trace['hits'])} hits traced over {trace['num_step_events']} steps"]
    lines.append(f"  s/t  {head}  again  load_bnd  queue  prefill  (ms from the send; boundaries: steps)")
    for hit in trace["hits"]:
        cells = "  ".join(
            f"{hit['ms'][stage] if hit['ms'][stage] is not None else '-':>11}" for stage in STAGES
        )
        lines.append(
            f"  {hit['session']}/{hit['turn'] + 1}  {cells}  {hit['asked_again']:>5}  "
            f"{hit['boundaries']['load_done']:>8}  {hit['engine_queue_ms']:>5}  {hit['prefill_ms']:>7}"
        )
    med = trace["medians"]
    if med:
        cells = "  ".join(f"{med[f'{stage}_ms']:>11}" for stage in STAGES)
        lines.append(
            f"  med  {cells}  {med['answered_boundaries']:>5}  {med['load_done_boundaries']:>8}  "
            f"{med['engine_queue_ms']:>5}  {med['prefill_ms']:>7}"
        )
    steps = trace["steps"]
    lines.append(
        f"  steps with tokens: {steps['num_with_tokens']}, median {steps['median_ms_with_tokens']} ms, "
        f"longest {steps['max_ms']} ms"
    )
    return "\n".join(lines)


def resent_engine_times(per_turn: Sequence[Mapping[str, float]], *, first_turn: int = 1) -> dict[str, Any]:
    """vLLM's own mean queue and prefill time per request (its ``request_queue_time_seconds`` and
    ``request_prefill_time_seconds`` histograms, read around each turn) over turns ``first_turn`` on, in ms:
    every configuration has them, the peer's included."""
    out: dict[str, Any] = {}
    turns = [t for t in per_turn if t.get("turn", 0) >= first_turn]
    for phase in ("queue", "prefill"):
        total = sum(t.get(f"{phase}_s_sum", 0.0) for t in turns)
        count = sum(t.get(f"{phase}_s_count", 0.0) for t in turns)
        out[f"engine_{phase}_ms"] = round(total / count * 1000.0, 1) if count else None
    return out


def format_traces(traces: Mapping[str, Mapping[str, Any]]) -> str:
    """Every configuration's resent turns (vLLM's queue and prefill, the client's TTFT), then each traced
    configuration's hits (``format_trace``)."""
    lines = ["resent turns (2 on): vLLM queue, vLLM prefill, client TTFT (means)"]
    for config, trace in traces.items():
        ttft = trace.get("ttft_resent_mean_s")
        lines.append(
            f"  {config:<18} queue {trace.get('engine_queue_ms')} ms  prefill {trace.get('engine_prefill_ms')} ms"
            f"  TTFT {None if ttft is None else round(ttft * 1000.0, 1)} ms"
        )
    lines.extend(format_trace(config, trace) for config, trace in traces.items() if "hits" in trace)
    return "\n".join(lines)
