"""A failed put wave's audit record says why (issue 37, item 2): ``put_failed``'s ``detail.reasons`` lists the
outcomes of the entries that were not stored (``no_space`` for a full store or file system), sorted, once each."""

from __future__ import annotations

import hashlib

from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme, plan_save
from hybridkv.lifecycle.machine import LifecycleMachine
from hybridkv.lifecycle.sink import MemoryAuditSink


def test_put_failed_records_carry_the_reasons() -> None:
    geometry = Geometry(groups=(GroupSpec.full(16),))
    scheme = KeyScheme(namespace="prod-a", model="tiny", geometry=geometry)
    hashes = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(4)]
    sink = MemoryAuditSink()
    machine = LifecycleMachine(scheme, sink=sink)
    wave = machine.new_save_wave("req-a", 1, plan_save(scheme, hashes, {0: [16, 32, 48]}))
    wave.start_put()
    entries = [entry for entry, _ in wave.plan.entries]
    outcomes = {entry: index == 0 for index, entry in enumerate(entries)}
    assert wave.finish_put(outcomes, ["no_space", "timeout", "no_space"]) == ()
    [record] = [r for r in sink.records if r.get("trigger") == "put_failed"]
    assert record["detail"] == {"num_stored_blocks": 1, "num_blocks": 3, "reasons": ["no_space", "timeout"]}
