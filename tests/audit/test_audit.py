"""Audit: the JSON-lines sink writes replayable records; the replay flags every kind of violation."""

from __future__ import annotations

import json
from pathlib import Path

from hybridkv.audit.replay import audit_file, replay_records
from hybridkv.audit.sinks import JsonLinesAuditSink
from hybridkv.cli import main
from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme, LoadOutcome
from hybridkv.lifecycle.machine import LifecycleMachine

_SCHEME = KeyScheme(
    namespace="t", model="m", geometry=Geometry(groups=(GroupSpec.full(16), GroupSpec.mamba(32)))
)


def _write_clean_log(path: Path) -> None:
    with JsonLinesAuditSink(path) as sink:
        machine = LifecycleMachine(_SCHEME, sink=sink)
        hashes = [bytes([i]) * 8 for i in range(8)]
        for request_id, fail in (("ok", False), ("bad", True)):
            lifecycle = machine.new_request(request_id)
            search = lifecycle.start_search(hashes, 129, 0)
            assert search is not None
            result = lifecycle.finish_search(search.run(lambda keys: [True] * len(keys)))
            assert result.plan is not None
            lifecycle.start_load()
            outcomes = {e: LoadOutcome.OK for e, _ in result.plan.entries}
            if fail:
                outcomes[next(iter(outcomes))] = LoadOutcome.CORRUPT
            lifecycle.finish_load(outcomes)
            lifecycle.evict()


def test_clean_log_replays_clean(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    _write_clean_log(log)
    report = audit_file(log)
    assert report.ok, report.violations
    assert report.num_lifecycles == report.num_terminated == 2
    assert report.num_truncations == 1
    assert report.group_counts[0]["hit"] == 2 and report.group_counts[0]["verified"] == 1
    assert main(["audit", str(log)]) == 0


def _record(request_id: str, trigger: str, src: str, dst: str, wave: int | None = None) -> str:
    return json.dumps(
        {"event": trigger, "request_id": request_id, "wave": wave, "src": src, "dst": dst, "trigger": trigger}
    )


def test_violations_are_found() -> None:
    lines = [
        "not json",
        _record("a", "start_lookup", "NEW", "LOOKUP"),
        _record("a", "start_load", "LOOKUP", "LOADING"),  # illegal
        _record("b", "start_lookup", "NEW", "LOOKUP"),  # never terminates
        _record("c", "start_lookup", "NEW", "LOOKUP"),
        _record("c", "lookup_hit", "LOOKUP", "PARTIAL_HIT"),
        _record("c", "start_load", "PARTIAL_HIT", "LOADING"),
        _record("c", "load_failed", "LOADING", "TRUNCATED"),
        _record("c", "retry", "TRUNCATED", "LOOKUP"),
        _record("c", "lookup_hit", "LOOKUP", "PARTIAL_HIT"),
        _record("c", "start_load", "PARTIAL_HIT", "LOADING"),
        _record("c", "load_failed", "LOADING", "TRUNCATED"),
        _record("c", "retry", "TRUNCATED", "LOOKUP"),  # second retry: a loop
        _record("c", "evict", "LOOKUP", "EVICTED"),
        _record("a", "evict", "MISS", "EVICTED"),  # discontinuity (a is in LOADING)
        _record("w", "start_put", "QUEUED", "PUTTING", wave=1),
        _record("w", "put_stored", "PUTTING", "STORED", wave=1),
        "[1, 2]",
    ]
    report = replay_records(lines)
    kinds = report.violation_counts()
    assert kinds == {"malformed": 2, "illegal": 1, "discontinuity": 1, "loop": 1, "unterminated": 1}
    assert {v.line for v in report.violations if v.kind == "malformed"} == {1, 18}
    assert report.num_truncations == 2


def test_cli_exit_codes(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_record("x", "start_lookup", "NEW", "LOOKUP") + "\n{oops\n")
    assert main(["audit", str(bad)]) == 2  # a malformed line is bad input, named on stderr
    assert f"{bad} line 2 is malformed" in capsys.readouterr().err
    violating = tmp_path / "violating.jsonl"
    violating.write_text(_record("x", "start_lookup", "NEW", "LOOKUP") + "\n")
    assert main(["audit", str(violating)]) == 1
    assert main(["audit", str(tmp_path / "missing.jsonl")]) == 2


def test_cli_json_output(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["audit", "--json", str(bad)]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["violations"][0]["line"] == 1
