"""Audit logs that live in production: a slow disk never blocks the caller (bounded queue, drops counted and
reported), size rotation, logrotate's rename (create mode), and `hybridkv audit` reading a rotated set as
one history."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import threading
import time
from pathlib import Path

from hybridkv.audit.replay import audit_file, audit_files, rotated_set
from hybridkv.audit.sinks import JsonLinesAuditSink
from hybridkv.cli import main
from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme, LoadOutcome
from hybridkv.lifecycle.machine import LifecycleMachine

_SCHEME = KeyScheme(
    namespace="t", model="m", geometry=Geometry(groups=(GroupSpec.full(16), GroupSpec.mamba(32)))
)
_HASHES = [bytes([i]) * 8 for i in range(8)]


def _drive(sink: JsonLinesAuditSink, num_requests: int, *, between: float = 0.0) -> None:
    """Whole lifecycles, every one terminated; ``between`` seconds between lifecycle steps."""
    machine = LifecycleMachine(_SCHEME, sink=sink)
    for index in range(num_requests):
        lifecycle = machine.new_request(f"req-{index}")
        search = lifecycle.start_search(_HASHES, 129, 0)
        assert search is not None
        result = lifecycle.finish_search(search.run(lambda keys: [True] * len(keys)))
        assert result.plan is not None
        lifecycle.start_load()
        if between:
            assert sink.flush(timeout_s=10)
            time.sleep(between)
        lifecycle.finish_load({entry: LoadOutcome.OK for entry, _ in result.plan.entries})
        lifecycle.evict()


def test_slow_disk_never_blocks_the_caller_and_drops_are_counted(tmp_path: Path) -> None:
    """The log is a FIFO nobody reads: after its 64 KiB buffer fills, every write blocks, like a dead disk."""
    fifo = tmp_path / "audit.jsonl"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the sink open it for writing
    sink = JsonLinesAuditSink(fifo, max_queued=1000)
    emitted = threading.Event()
    slowest_emit_s = [0.0]

    def emit_many() -> None:
        for index in range(20_000):
            start = time.perf_counter()
            sink.emit("lookup_started", request_id=f"r{index}", wave=None, src="NEW", dst="LOOKUP")
            slowest_emit_s[0] = max(slowest_emit_s[0], time.perf_counter() - start)
        emitted.set()

    caller = threading.Thread(target=emit_many, daemon=True)
    caller.start()
    try:
        assert emitted.wait(30), "emit blocked behind a stuck log file"
        assert slowest_emit_s[0] < 0.5, f"one emit took {slowest_emit_s[0]:.3f} s"
        assert sink.num_dropped > 0 and sink.stats()["num_dropped"] == sink.num_dropped
        num_dropped = sink.num_dropped
    finally:
        # Unstick the writer: drain the FIFO while the sink closes, then check what it wrote.
        os.set_blocking(reader, True)
        chunks: list[bytes] = []
        drainer = threading.Thread(target=lambda: _drain(reader, chunks), daemon=True)
        drainer.start()
        sink.close()
        drainer.join(30)
    lines = b"".join(chunks).decode().splitlines()
    markers = [json.loads(line) for line in lines if "audit_records_dropped" in line]
    assert sum(m["num_dropped"] for m in markers) == num_dropped
    assert len(lines) - len(markers) + num_dropped == 20_000
    assert audit_files_report_counts(lines)["num_dropped"] == num_dropped


def _drain(fd: int, chunks: list[bytes]) -> None:
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)


def audit_files_report_counts(lines: list[str]) -> dict[str, int]:
    from hybridkv.audit.replay import replay_records

    report = replay_records(lines)
    return {"num_dropped": report.num_dropped, "num_records": report.num_records}


def test_size_rotation_keeps_one_history(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    with JsonLinesAuditSink(log, max_bytes=4096, backup_count=50) as sink:
        long_lived = LifecycleMachine(_SCHEME, sink=sink).new_request("spans-rotations")
        long_lived.start_search(_HASHES, 129, 0)
        _drive(sink, 30)
        long_lived.evict()
    stats = sink.stats()
    files = rotated_set(log)
    assert stats["num_rotations"] == len(files) - 1 >= 3, (stats, files)
    assert files[-1] == log and files[0] == tmp_path / f"audit.jsonl.{len(files) - 1}"
    assert all(path.stat().st_size <= 4096 for path in files)
    report = audit_files(files)
    assert report.ok, report.violations[:3]
    assert report.num_lifecycles == report.num_terminated == 31
    # Alone, the newest file starts mid-lifecycle: that is what reading the set together fixes.
    assert not audit_file(log).ok
    assert main(["audit", str(log)]) == 0
    assert main(["audit", "--single", str(log)]) == 1


def test_size_rotation_deletes_beyond_backup_count(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    with JsonLinesAuditSink(log, max_bytes=2048, backup_count=2) as sink:
        _drive(sink, 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]


def test_logrotate_create_mode_and_compressed_siblings(tmp_path: Path) -> None:
    """logrotate renames the file away (and compresses older ones); the sink notices and reopens ``path``."""
    log = tmp_path / "audit.jsonl"
    sink = JsonLinesAuditSink(log)
    machine = LifecycleMachine(_SCHEME, sink=sink)
    lifecycle = machine.new_request("spans-rotations")
    lifecycle.start_search(_HASHES, 129, 0)
    _drive(sink, 2)
    assert sink.flush(timeout_s=10)
    os.replace(log, tmp_path / "audit.jsonl.1")  # logrotate, first rotation
    _drive(sink, 2)
    assert sink.flush(timeout_s=10)
    assert log.exists(), "the sink did not reopen the log after it was renamed away"
    with (
        (tmp_path / "audit.jsonl.1").open("rb") as src,
        gzip.open(tmp_path / "audit.jsonl.2.gz", "wb") as dst,
    ):
        shutil.copyfileobj(src, dst)  # second rotation, `compress`
    os.replace(log, tmp_path / "audit.jsonl.1")
    lifecycle.evict()
    sink.close()
    assert sink.stats()["num_reopens"] == 2
    files = rotated_set(log)
    assert [p.name for p in files] == ["audit.jsonl.2.gz", "audit.jsonl.1", "audit.jsonl"]
    report = audit_files(files)
    assert report.ok, report.violations[:3]
    assert report.num_lifecycles == report.num_terminated == 5


def test_reopen_on_request_and_flush(tmp_path: Path) -> None:
    """``reopen()`` (the application's SIGHUP handler) reopens even when the path still names the file."""
    log = tmp_path / "audit.jsonl"
    with JsonLinesAuditSink(log) as sink:
        _drive(sink, 1)
        assert sink.flush(timeout_s=10)
        num_lines = len(log.read_text().splitlines())
        assert num_lines == 5  # flushed: every record is on disk before flush returns
        sink.reopen()
        _drive(sink, 1)
        assert sink.flush(timeout_s=10)
        assert sink.stats()["num_reopens"] == 1
    assert audit_file(log).ok
