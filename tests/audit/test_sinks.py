"""The JSON-lines sink on the standard library's QueueHandler / QueueListener: the lines structlog renders, a
failed write that neither kills the writer nor goes uncounted, drops reported at close, nothing left running."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path

import pytest
from hybridkv.audit.replay import audit_file, replay_records
from hybridkv.audit.sinks import DROPPED_EVENT, JsonLinesAuditSink

_FIELDS = {
    "request_id": "r\u00e91",
    "wave": None,
    "src": "NEW",
    "dst": "LOOKUP",
    "trigger": "start_lookup",
    "boundary": 0,
    "num_computed_tokens": 0,
    "groups": [{"group": 0, "hit_tokens": 16, "blocks": 1}],
    "detail": {"retry_cap": None},
    "monotonic": 1.25,
}


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hybridkv-audit-writer"]


def test_lines_are_structlog_json_with_the_event_last(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    with JsonLinesAuditSink(log) as sink:
        sink.emit("lookup_started", **_FIELDS)
    expected = json.dumps({**_FIELDS, "event": "lookup_started"}, separators=(",", ":"))
    assert log.read_text(encoding="utf-8") == expected + "\n"
    assert sink.stats() == {
        "num_written": 1,
        "num_dropped": 0,
        "num_queued": 0,
        "num_rotations": 0,
        "num_reopens": 0,
    }


def test_a_failed_write_is_counted_and_the_writer_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "logs"
    log = folder / "audit.jsonl"
    with JsonLinesAuditSink(log) as sink:
        sink.emit("lookup_started", **_FIELDS)
        assert sink.flush(timeout_s=10)
        shutil.rmtree(folder)  # the disk vanished: reopening fails until the folder is back
        with caplog.at_level(logging.WARNING, logger="hybridkv.audit.sinks"):
            for _ in range(3):
                sink.emit("lookup_started", **_FIELDS)
            assert sink.flush(timeout_s=10)
        assert sink.num_dropped == 3
        assert len([r for r in caplog.records if "write failed" in r.getMessage()]) == 1  # one per outage
        assert len(_writer_threads()) >= 1
        folder.mkdir()
        sink.emit("lookup_started", **_FIELDS)
        assert sink.flush(timeout_s=10)
    lines = log.read_text(encoding="utf-8").splitlines()
    marker = json.loads(lines[0])
    assert marker["event"] == DROPPED_EVENT and marker["num_dropped"] == 3
    assert set(marker) == {"event", "num_dropped", "monotonic"}
    assert json.loads(lines[1])["event"] == "lookup_started" and len(lines) == 2
    assert sink.stats()["num_written"] == 2 and sink.stats()["num_reopens"] >= 1
    assert replay_records(lines).num_dropped == 3


def test_drops_are_reported_at_close_and_after_close_counted(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    sink = JsonLinesAuditSink(log, max_queued=1)
    gate = threading.Event()
    handler = sink._file_handler  # hold the writer on its first record so the queue fills
    original_emit = handler.emit

    def held_emit(record: logging.LogRecord) -> None:
        gate.wait(10)
        original_emit(record)

    handler.emit = held_emit  # type: ignore[method-assign]
    for index in range(50):
        sink.emit("lookup_started", **{**_FIELDS, "request_id": f"r{index}"})
    num_dropped = sink.num_dropped
    assert num_dropped >= 48  # one record at the writer, at most one queued
    gate.set()
    sink.close()
    sink.emit("lookup_started", **_FIELDS)  # after close: counted, never written
    assert sink.num_dropped == num_dropped + 1
    assert sink.flush(timeout_s=1)
    records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    markers = [r for r in records if r["event"] == DROPPED_EVENT]
    assert sum(m["num_dropped"] for m in markers) == num_dropped
    assert len(records) - len(markers) + num_dropped == 50
    assert audit_file(log).num_dropped == num_dropped


def test_close_stops_the_writer_and_is_idempotent(tmp_path: Path) -> None:
    before = len(_writer_threads())
    sink = JsonLinesAuditSink(tmp_path / "audit.jsonl")
    assert len(_writer_threads()) == before + 1
    sink.close()
    sink.close()
    assert len(_writer_threads()) == before


@pytest.mark.parametrize(
    "kwargs", [{"max_bytes": 0}, {"max_bytes": -1}, {"backup_count": 0}, {"max_queued": 0}]
)
def test_bad_parameters_are_refused(tmp_path: Path, kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="JsonLinesAuditSink"):
        JsonLinesAuditSink(tmp_path / "audit.jsonl", **kwargs)  # type: ignore[arg-type]
