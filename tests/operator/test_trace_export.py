"""`hybridkv audit --export vllm-trace`: the audit records as vLLM's proposed connector lifecycle trace
(schema `vllm-kv-connector-v1`, vLLM PR #52859), exact to the byte and free of raw request ids."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hybridkv.audit.sinks import JsonLinesAuditSink
from hybridkv.audit.trace import LOG_PREFIX, parse_trace_line
from hybridkv.cli import main
from hybridkv.lifecycle import EntryId, Geometry, GroupSpec, KeyScheme, LoadOutcome, plan_save
from hybridkv.lifecycle.machine import LifecycleMachine

_SCHEME = KeyScheme(
    namespace="t", model="m", geometry=Geometry(groups=(GroupSpec.full(16), GroupSpec.mamba(32)))
)
_HASHES = [bytes([i]) * 8 for i in range(8)]
# Two ids of one request group (vLLM appends `-<8 hex>`), one miss, one truncated load.
_OK, _SIBLING, _MISS, _BAD = "cmpl-alpha-0123abcd", "cmpl-alpha-89efcdab", "cmpl-miss", "cmpl-bad"


def _write_log(path: Path) -> None:
    with JsonLinesAuditSink(path) as sink:
        machine = LifecycleMachine(_SCHEME, sink=sink)
        for request_id in (_OK, _SIBLING, _BAD):
            lifecycle = machine.new_request(request_id)
            search = lifecycle.start_search(_HASHES, 129, 0)
            assert search is not None
            result = lifecycle.finish_search(search.run(lambda keys: [True] * len(keys)))
            assert result.plan is not None
            lifecycle.start_load()
            outcomes = {entry: LoadOutcome.OK for entry, _ in result.plan.entries}
            if request_id == _BAD:
                outcomes[next(iter(outcomes))] = LoadOutcome.CORRUPT
            lifecycle.finish_load(outcomes)
            lifecycle.evict()
        miss = machine.new_request(_MISS)
        search = miss.start_search(_HASHES, 129, 0)
        assert search is not None
        miss.finish_search(search.run(lambda keys: [False] * len(keys)))
        miss.evict()
        plan = plan_save(_SCHEME, _HASHES, {0: [16, 32], 1: [32]})
        for wave_index, stored in ((0, True), (1, False)):
            wave = machine.new_save_wave(_OK, wave_index, plan)
            wave.start_put()
            wave.finish_put(
                {
                    EntryId(rank.tp_rank, block.group_index, block.block_index, block.key_boundary): stored
                    for block in plan.blocks
                    for rank in _SCHEME.geometry.topology.ranks
                }
            )
        machine.new_save_wave(_OK, 2, plan).drop()


def _vllm_hash(request_id: str) -> str:
    # Written out from the proposal, independently of hybridkv.audit.trace.
    return hashlib.blake2b(request_id.encode(), digest_size=8, person=b"vllm-kv-trace").hexdigest()


_GROUP_ID = {_OK: "cmpl-alpha", _SIBLING: "cmpl-alpha"}
_EXPECTED = {  # trigger -> (event, role, transfer_mode)
    "lookup_hit": ("blocks_matched", "consumer", "pull"),
    "lookup_miss": ("blocks_matched", "consumer", "pull"),
    "start_load": ("transfer_started", "consumer", "pull"),
    "load_verified": ("transfer_completed", "consumer", "pull"),
    "load_failed": ("transfer_failed", "consumer", "pull"),
    "start_put": ("transfer_started", "producer", "push"),
    "put_stored": ("transfer_completed", "producer", "push"),
    "put_failed": ("transfer_failed", "producer", "push"),
    "drop": ("transfer_failed", "producer", "push"),
}


_FIELD_ORDER = (
    "schema", "event", "wall_ns", "monotonic_ns", "connector", "transfer_mode", "component", "role",
    "request_id_hash", "request_group_id_hash", "block_count",
)  # fmt: skip


@pytest.mark.parametrize("log_prefix", [False, True])
def test_export_round_trip_is_exact(tmp_path: Path, log_prefix: bool) -> None:
    log = tmp_path / "audit.jsonl"
    _write_log(log)
    audit_records = [json.loads(line) for line in log.read_text().splitlines()]
    out = tmp_path / "trace.jsonl"
    argv = ["audit", str(log), "--export", "vllm-trace", "--out", str(out)]
    assert main([*argv, "--log-prefix"] if log_prefix else argv) == 0
    text = out.read_text()
    for request_id in (_OK, _SIBLING, _MISS, _BAD, "cmpl-alpha"):
        assert request_id not in text, f"raw request id {request_id!r} leaked into the trace"

    lines = text.splitlines()
    expected = [r for r in audit_records if r["trigger"] in _EXPECTED]
    assert len(lines) == len(expected) == 15
    anchor_wall_ns = os.stat(log).st_mtime_ns
    anchor_monotonic_ns = round(max(r["monotonic"] for r in audit_records) * 1e9)
    for line, record in zip(lines, expected, strict=True):
        assert line.startswith(LOG_PREFIX) == log_prefix
        trace = parse_trace_line(line)
        assert (LOG_PREFIX if log_prefix else "") + trace.to_json() == line, "re-encoding changed the line"
        obj = json.loads(line.removeprefix(LOG_PREFIX))
        event, role, transfer_mode = _EXPECTED[record["trigger"]]
        blocks = 0 if record["trigger"] == "lookup_miss" else sum(g["blocks"] for g in record["groups"])
        monotonic_ns = round(record["monotonic"] * 1e9)
        assert obj == {
            "schema": "vllm-kv-connector-v1",
            "event": event,
            "wall_ns": anchor_wall_ns + monotonic_ns - anchor_monotonic_ns,
            "monotonic_ns": monotonic_ns,
            "connector": "HybridStoreConnector",
            "transfer_mode": transfer_mode,
            "component": "scheduler",
            "role": role,
            "request_id_hash": _vllm_hash(record["request_id"]),
            "request_group_id_hash": _vllm_hash(_GROUP_ID.get(record["request_id"], record["request_id"])),
            "block_count": blocks,
        }
        assert list(obj) == list(_FIELD_ORDER), "field order differs from the proposal's"
    hashes = [json.loads(x.removeprefix(LOG_PREFIX)) for x in lines]
    ok, sibling = _vllm_hash(_OK), _vllm_hash(_SIBLING)
    group_of = {h["request_id_hash"]: h["request_group_id_hash"] for h in hashes}
    assert ok != sibling and group_of[ok] == group_of[sibling] == _vllm_hash("cmpl-alpha")
    assert [h["event"] for h in hashes if h["role"] == "producer"] == [
        "transfer_started", "transfer_completed", "transfer_started", "transfer_failed", "transfer_failed",
    ]  # fmt: skip


def test_parse_rejects_a_foreign_or_broken_line() -> None:
    good = (
        '{"schema":"vllm-kv-connector-v1","event":"transfer_started","wall_ns":1,"monotonic_ns":1,'
        '"connector":"X","transfer_mode":"pull","component":"worker","role":"consumer",'
        '"request_id_hash":"a","request_group_id_hash":"b"}'
    )
    assert parse_trace_line(good).to_json() == good
    with pytest.raises(ValueError, match="schema"):
        parse_trace_line(good.replace("vllm-kv-connector-v1", "vllm-kv-connector-v2"))
    with pytest.raises(ValueError, match="missing \\['role'\\]"):
        parse_trace_line(good.replace(',"role":"consumer"', ""))
    with pytest.raises(ValueError, match="wall_ns"):
        parse_trace_line(good.replace('"wall_ns":1', '"wall_ns":"1"'))


def test_export_reads_the_rotated_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "audit.jsonl"
    _write_log(log)
    lines = log.read_text().splitlines(keepends=True)
    (tmp_path / "audit.jsonl.1").write_text("".join(lines[:10]))
    log.write_text("".join(lines[10:]))
    assert main(["audit", str(log), "--export", "vllm-trace"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 15
