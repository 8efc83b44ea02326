"""The engine's records in the connector's audit file, inside vLLM's real ``Scheduler``.

A reset is in the audit as the engine's transitions (``reset_started``, ``weights_rotated``, ``gate_opened``),
each with the reset epoch and the fingerprint in force; every ``load_started`` names the epoch and
fingerprint its answer was found in; ``hybridkv audit`` replays the file and proves no load used a
fingerprint from before the reset that preceded it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hybridkv.audit.replay import audit_file
from hybridkv.store import open_store
from support.scheduler import fill_store, make_request, make_scheduler

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

RANKS = (0, 1)
_ENTRIES = [(0, 32), (0, 64), (0, 96), (0, 128), (1, 128)]


def test_a_reset_in_the_audit_file_and_every_load_checked_against_it(
    objs: dict[str, Any], tmp_path: Path
) -> None:
    log = tmp_path / "audit.jsonl"
    objs["extra"]["audit_log"] = str(log)
    sched = make_scheduler(objs["vc"])
    side = sched.connector.scheduler_side
    store = open_store(objs["store_url"])
    before = side.scheme

    req = make_request("e1", 130, first=7000)
    fill_store(before, store, list(req.block_hashes), _ENTRIES, RANKS)
    sched.add_request(req)
    assert [j.boundary for j in sched.schedule().kv_connector_metadata.loads] == [128]

    assert side.reset_cache() is True and side.wait_maintenance(10)
    after = side.scheme
    assert after.fingerprint != before.fingerprint
    req2 = make_request("e2", 130, first=7000)
    fill_store(after, store, list(req2.block_hashes), _ENTRIES, RANKS)
    sched.add_request(req2)
    assert [j.boundary for j in sched.schedule().kv_connector_metadata.loads if j.req_id == "e2"] == [128]
    assert side.audit is not None and side.audit.flush(10)

    records = [json.loads(line) for line in log.read_text().splitlines()]
    engine = [r for r in records if r.get("machine") == "engine"]
    assert [r["event"] for r in engine] == [
        "engine_started",
        "reset_started",
        "weights_rotated",
        "gate_opened",
    ]
    assert [(r["epoch"], r["fingerprint"]) for r in engine] == [
        (0, before.fingerprint),
        (1, before.fingerprint),
        (1, after.fingerprint),
        (1, after.fingerprint),
    ]
    loads = [r for r in records if r["event"] == "load_started"]
    assert [(r["request_id"], r["detail"]) for r in loads] == [
        ("e1", {"epoch": 0, "fingerprint": before.fingerprint}),
        ("e2", {"epoch": 1, "fingerprint": after.fingerprint}),
    ]
    report = audit_file(log)
    assert [v for v in report.violations if v.kind.value != "unterminated"] == []
    assert (report.num_resets, report.engine_state) == (1, "OPEN")

    # The same file with e2's load rewritten to the answer of before the reset: the replay refuses it.
    stale = [
        {**r, "detail": {"epoch": 0, "fingerprint": before.fingerprint}}
        if r["event"] == "load_started" and r["request_id"] == "e2"
        else r
        for r in records
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in stale))
    assert [v.kind.value for v in audit_file(log).violations if v.kind.value != "unterminated"] == [
        "stale_load"
    ]
