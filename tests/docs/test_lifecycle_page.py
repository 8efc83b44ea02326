"""docs/lifecycle.md: its `ok` audit log is what the lifecycle machine writes for the story the page tells; its
state, transition, violation and ``detail`` tables and any Mermaid block equal the code's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridkv.audit.diagram import render_mermaid
from hybridkv.audit.replay import ViolationKind
from hybridkv.lifecycle.table import DETAIL_FIELDS, TRANSITIONS, State
from support.docs import DOCS, all_blocks, audit_examples, names, table_rows


def audit_scenario() -> list[dict[str, Any]]:
    """The story docs/lifecycle.md tells for its `ok` log, played on the real lifecycle machine.

    Full attention (16 tokens/block, DCP-sharded) + Mamba (64), TP=2, DCP=2, 100-token prompts: req-a misses and
    saves its prompt (save job 1); req-b hits and verifies; req-c hits, full-attention block 1 fails on rank 1,
    the one retry looks up again under the cap, and the request finishes.
    """
    import hashlib

    from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme, LoadOutcome, Topology, plan_save
    from hybridkv.lifecycle.machine import LifecycleMachine
    from hybridkv.lifecycle.sink import MemoryAuditSink

    geometry = Geometry(
        groups=(GroupSpec.full(16), GroupSpec.mamba(64)), topology=Topology(tp_size=2, dcp_size=2)
    )
    scheme = KeyScheme(namespace="prod-a", model="tiny", geometry=geometry)
    hashes = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(8)]
    sink = MemoryAuditSink()
    machine = LifecycleMachine(scheme, sink=sink)
    stored: set[str] = set()

    def lookup(request: Any) -> Any:
        search = request.start_search(hashes, 100, 0)
        return (
            None
            if search is None
            else request.finish_search(search.run(lambda keys: [k in stored for k in keys]))
        )

    a = machine.new_request("req-a")
    lookup(a)
    wave = machine.new_save_wave("req-a", 1, plan_save(scheme, hashes, {0: [32, 64, 96], 1: [96]}))
    wave.start_put()
    wave.finish_put({entry: True for entry, _ in wave.plan.entries})
    stored |= {key for _, key in wave.plan.entries}
    a.evict()
    b = machine.new_request("req-b")
    result = lookup(b)
    b.start_load()
    b.finish_load({entry: LoadOutcome.OK for entry, _ in result.plan.entries})
    b.evict()
    c = machine.new_request("req-c")
    result = lookup(c)
    c.start_load()
    outcomes = {entry: LoadOutcome.OK for entry, _ in result.plan.entries}
    failed = next(e for e, _ in result.plan.entries if (e.tp_rank, e.group_index, e.block_index) == (1, 0, 1))
    outcomes[failed] = LoadOutcome.CORRUPT
    c.finish_load(outcomes)
    lookup(c)
    c.evict()
    records: list[dict[str, Any]] = sink.records
    return records


def test_ok_audit_example_is_what_the_machine_writes() -> None:
    """The `ok` log in docs/lifecycle.md is exactly what the lifecycle writes for the story it tells."""
    log = next(block for name, block, _ in audit_examples() if name == "ok")
    shown = [json.loads(line) for line in log.text.splitlines() if line.strip()]
    written = audit_scenario()
    for record in (*shown, *written):
        record.pop("monotonic")
    assert shown == written, (
        f"{log.where}: regenerate the example from audit_scenario() in {Path(__file__).name}"
    )


def test_violation_kinds_table() -> None:
    """docs/lifecycle.md's violation table lists exactly the kinds `hybridkv audit` can report."""
    kinds = {kind.value for kind in ViolationKind}
    documented = {names(row[0])[0] for row in table_rows(DOCS / "lifecycle.md", "violation")}
    assert documented == kinds, f"violation kinds: missing {kinds - documented}, extra {documented - kinds}"


def test_detail_fields_table() -> None:
    """docs/lifecycle.md's `detail` table lists exactly the fields each trigger's record carries."""
    fields = {trigger: set(declared) for trigger, declared in DETAIL_FIELDS.items()}
    documented = {
        names(row[0])[0]: set(names(row[1])) for row in table_rows(DOCS / "lifecycle.md", "trigger")
    }
    assert documented == fields, f"detail fields: docs {documented}, code {fields}"


def test_lifecycle_states_table() -> None:
    rows = table_rows(DOCS / "lifecycle.md", "state")
    documented = [names(row[0])[0] for row in rows]
    assert sorted(documented) == sorted(s.name for s in State), "docs/lifecycle.md states table != State"


def test_lifecycle_transitions_table() -> None:
    rows = table_rows(DOCS / "lifecycle.md", "event")
    documented = {
        (names(trigger)[0], frozenset(names(sources)), names(dest)[0], names(event)[0], tuple(names(guard)))
        for event, trigger, sources, dest, guard, *_ in rows
    }
    table = {
        (t.trigger, frozenset(s.name for s in t.sources), t.dest.name, t.event, t.conditions)
        for t in TRANSITIONS
    }
    assert documented == table, (
        f"docs/lifecycle.md transitions differ from TRANSITIONS: missing {table - documented}, extra {documented - table}"
    )


def test_mermaid_blocks_match_the_table() -> None:
    mermaid = [block for block in all_blocks() if block.lang == "mermaid"]
    assert mermaid, "no mermaid diagram in the docs"
    for block in mermaid:
        assert block.text == render_mermaid(), (
            f"{block.where}: stale diagram (copy docs/diagrams/lifecycle.mmd)"
        )
