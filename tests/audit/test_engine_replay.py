"""The engine's machine (namespace gate, reset epochs, weights tag) and the replay's load checks.

A load must use the fingerprint and epoch the engine's records say are in force, with the gate open: the
replay proves it (``stale_load``, ``gate_closed``) on hand-made logs, and the engine's own records replay
clean against ``ENGINE_TRANSITIONS``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hybridkv.audit.replay import ViolationKind, replay_records
from hybridkv.cli import main
from hybridkv.connector.scheduler.namespace_gate import GateState, NamespaceGate
from hybridkv.lifecycle.geometry import Geometry, Topology
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.kinds import GroupSpec
from hybridkv.lifecycle.machine import IllegalTransition, LifecycleMachine
from hybridkv.lifecycle.sink import MemoryAuditSink

_OLD, _NEW = "aaaaaaaaaaaa", "bbbbbbbbbbbb"


def _scheme(tag: str = "") -> KeyScheme:
    geometry = Geometry(groups=(GroupSpec.full(16),), topology=Topology(tp_size=1))
    return KeyScheme(namespace="ns", model="m", geometry=geometry, weights_tag=tag)


def _engine(trigger: str, src: str, dst: str, epoch: int, fingerprint: str, **detail: Any) -> dict[str, Any]:
    return {
        "event": trigger,
        "machine": "engine",
        "request_id": None,
        "wave": None,
        "src": src,
        "dst": dst,
        "trigger": trigger,
        "epoch": epoch,
        "fingerprint": fingerprint,
        "detail": detail or None,
    }


def _request(rid: str, trigger: str, src: str, dst: str, **detail: Any) -> dict[str, Any]:
    return {
        "event": trigger,
        "request_id": rid,
        "wave": None,
        "src": src,
        "dst": dst,
        "trigger": trigger,
        "boundary": 32,
        "detail": detail or None,
    }


def _hit(rid: str) -> list[dict[str, Any]]:
    return [
        _request(rid, "start_lookup", "NEW", "LOOKUP"),
        _request(rid, "lookup_hit", "LOOKUP", "PARTIAL_HIT"),
    ]


def _reset(epoch: int, old: str, new: str) -> list[dict[str, Any]]:
    """A reset in the engine's records: the gate closes, the tag rotates, the removal returns."""
    return [
        _engine("begin_reset", "OPEN", "RESETTING", epoch, old, num_pending=1),
        _engine(
            "rotate_weights",
            "RESETTING",
            "RESETTING",
            epoch,
            new,
            weights_source="private",
            previous_fingerprint=old,
            reason="no weights_version_file",
        ),
        _engine("reopen", "RESETTING", "OPEN", epoch, new),
    ]


def _replay(records: list[dict[str, Any]]) -> Any:
    return replay_records(json.dumps(r) for r in records)


def _kinds(report: Any) -> list[str]:
    return [v.kind.value for v in report.violations if v.kind is not ViolationKind.UNTERMINATED]


_STARTED = _engine("start", "STARTING", "OPEN", 0, _OLD, weights_source="checkpoint")


def test_a_load_after_a_reset_under_the_old_fingerprint_is_stale() -> None:
    """The answer was found before the reset (epoch 0, the old fingerprint); its load starts after it."""
    records = [
        _STARTED,
        *_hit("r1"),
        *_reset(1, _OLD, _NEW),
        _request("r1", "start_load", "PARTIAL_HIT", "LOADING", epoch=0, fingerprint=_OLD),
    ]
    report = _replay(records)
    assert _kinds(report) == ["stale_load"], report.violations
    assert "fingerprint aaaaaaaaaaaa of epoch 0" in report.violations[0].message


def test_the_same_fingerprint_from_an_older_epoch_is_stale_too() -> None:
    """A reset that kept the keys (an unchanged weights name) still removed the namespace: an answer from
    before it names entries that may be gone."""
    records = [
        _STARTED,
        *_hit("r1"),
        *_reset(1, _OLD, _OLD),
        _request("r1", "start_load", "PARTIAL_HIT", "LOADING", epoch=0, fingerprint=_OLD),
    ]
    assert _kinds(_replay(records)) == ["stale_load"]


def test_a_load_while_the_gate_is_closed_is_flagged() -> None:
    records = [
        _STARTED,
        *_hit("r1"),
        _engine("begin_reset", "OPEN", "RESETTING", 1, _OLD, num_pending=1),
        _request("r1", "start_load", "PARTIAL_HIT", "LOADING", epoch=1, fingerprint=_OLD),
    ]
    assert _kinds(_replay(records)) == ["gate_closed"]


def test_a_load_in_the_current_epoch_and_fingerprint_is_clean() -> None:
    records = [
        _STARTED,
        *_reset(1, _OLD, _NEW),
        *_hit("r2"),
        _request("r2", "start_load", "PARTIAL_HIT", "LOADING", epoch=1, fingerprint=_NEW),
        _request("r2", "load_verified", "LOADING", "VERIFIED"),
        _request("r2", "evict", "VERIFIED", "EVICTED"),
    ]
    report = _replay(records)
    assert report.ok, report.violations
    assert (report.num_engine_records, report.num_resets, report.engine_state) == (4, 1, "OPEN")


def test_engine_records_replay_against_the_engine_table() -> None:
    records = [
        _STARTED,
        _engine("reopen", "OPEN", "OPEN", 0, _OLD),  # not a row of the table
        _engine("begin_reset", "OPEN", "RESETTING", 3, _OLD, num_pending=1),  # skips epochs
        _engine("reopen", "RESETTING", "OPEN", 3, _NEW),  # fingerprint changed outside rotate_weights
    ]
    messages = [v.message for v in _replay(records).violations]
    assert len(messages) == 3, messages
    assert "table" in messages[0] and "epoch 3, expected 1" in messages[1]
    assert "outside a reset's rotate_weights" in messages[2]


def test_a_log_without_engine_records_is_checked_as_before() -> None:
    """Logs of older connectors carry no engine records and loads without epoch: nothing to check them by."""
    records = [*_hit("r1"), _request("r1", "start_load", "PARTIAL_HIT", "LOADING")]
    assert _kinds(_replay(records)) == []


def test_the_audit_cli_fails_on_a_stale_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "audit.jsonl"
    records = [
        _STARTED,
        *_hit("r1"),
        *_reset(1, _OLD, _NEW),
        _request("r1", "start_load", "PARTIAL_HIT", "LOADING", epoch=0, fingerprint=_OLD),
        _request("r1", "evict", "LOADING", "EVICTED"),
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["audit", str(log)]) == 1
    out = capsys.readouterr().out
    assert "stale_load" in out and "1 resets" in out


# -- the engine's machine ---------------------------------------------------------------------------


def test_the_gate_records_every_engine_transition_and_replays_clean() -> None:
    sink = MemoryAuditSink()
    machine = LifecycleMachine(_scheme(), sink=sink)
    gate = NamespaceGate(machine, weights_source="checkpoint")
    assert gate.state is GateState.OPEN and not gate.closed
    assert gate.begin_reset() == 1 and machine.epoch == 1 and gate.closed
    gate.rotate_weights(_scheme("private-x"), weights_source="private", reason="why")
    assert machine.scheme.weights_tag == "private-x"
    assert gate.begin_reset() == 2  # an overlapping reset
    gate.end_reset(ok=False)
    assert gate.state is GateState.RESETTING  # the later reset's removal still runs
    gate.end_reset(ok=False)
    assert gate.state is GateState.FAILED and gate.closed
    gate.begin_reset()
    gate.end_reset(ok=True)
    assert gate.state is GateState.OPEN
    events = [r["event"] for r in sink.records]
    assert events == [
        "engine_started",
        "reset_started",
        "weights_rotated",
        "reset_started",
        "removal_returned",
        "gate_failed",
        "reset_started",
        "gate_opened",
    ]
    assert all(r["machine"] == "engine" for r in sink.records)
    assert [r["epoch"] for r in sink.records] == [0, 1, 1, 2, 2, 2, 3, 3]
    report = replay_records(json.dumps(r) for r in sink.records)
    assert report.ok, report.violations
    assert (report.num_resets, report.engine_state) == (3, "OPEN")


def test_the_engine_table_refuses_what_it_does_not_allow() -> None:
    gate = NamespaceGate(LifecycleMachine(_scheme()))
    with pytest.raises(IllegalTransition):
        gate.rotate_weights(_scheme("x"), weights_source="private", reason="not during a reset")
    with pytest.raises(AssertionError):
        gate.end_reset(ok=True)  # no reset in progress
    assert gate.state is GateState.OPEN
