"""The state machine: table-driven, one shared machine, illegal triggers raise, one record per transition."""

from __future__ import annotations

import pytest
from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme
from hybridkv.lifecycle.machine import IllegalTransition, LifecycleMachine, RequestLifecycle
from hybridkv.lifecycle.sink import MemoryAuditSink
from hybridkv.lifecycle.table import TRANSITIONS, TRIGGERS, State, transition_index
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

_SCHEME = KeyScheme(namespace="t", model="m", geometry=Geometry(groups=(GroupSpec.full(16),)))


def test_table_is_consistent() -> None:
    index = transition_index()
    assert len(index) == sum(len(spec.sources) for spec in TRANSITIONS)
    reachable = {State.NEW, State.QUEUED} | {spec.dest for spec in TRANSITIONS}
    assert reachable == set(State), "every state is reachable from an initial state"


def test_machine_uses_the_required_transitions_settings() -> None:
    machine = LifecycleMachine(_SCHEME)._machine
    assert machine.auto_transitions is False and machine.send_event is True and machine.has_queue is True
    assert not machine.models, "requests are never added to the shared machine"


def test_illegal_trigger_names_request_and_states() -> None:
    lifecycle = LifecycleMachine(_SCHEME).new_request("req-7")
    with pytest.raises(IllegalTransition) as error:
        lifecycle.start_load()
    assert "req-7" in str(error.value) and "NEW" in str(error.value) and "LOADING" in str(error.value)
    assert lifecycle.current is State.NEW


def test_one_record_per_transition_with_required_fields() -> None:
    sink = MemoryAuditSink()
    machine = LifecycleMachine(_SCHEME, sink=sink)
    lifecycle = machine.new_request("r")
    search = lifecycle.start_search([b"\x01" * 8] * 4, 70, 0)
    assert search is not None
    lifecycle.finish_search(search.run(lambda keys: [True] * len(keys)))
    lifecycle.start_load()
    lifecycle.evict("aborted")
    assert [(r["src"], r["dst"]) for r in sink.records] == [
        ("NEW", "LOOKUP"),
        ("LOOKUP", "PARTIAL_HIT"),
        ("PARTIAL_HIT", "LOADING"),
        ("LOADING", "EVICTED"),
    ]
    for record in sink.records:
        assert {"event", "request_id", "src", "dst", "trigger", "boundary", "groups", "monotonic"} <= set(
            record
        )
    assert sink.records[1]["boundary"] == 64


class TableDrivenMachine(RuleBasedStateMachine):
    """Fires random triggers: legal ones move exactly as the table says, illegal ones raise and move nothing."""

    @initialize()
    def setup(self) -> None:
        self.sink = MemoryAuditSink()
        self.machine = LifecycleMachine(_SCHEME, sink=self.sink)
        self.lifecycle = RequestLifecycle(self.machine, "r")
        self.index = transition_index()
        self.num_moves = 0

    @rule(trigger=st.sampled_from(sorted({spec.trigger for spec in TRANSITIONS})))
    def fire(self, trigger: str) -> None:
        src = self.lifecycle.current
        spec = self.index.get((trigger, src))
        if spec is None or spec.conditions:
            if spec is None:
                with pytest.raises(IllegalTransition):
                    self.machine.fire(self.lifecycle, trigger)
                assert self.lifecycle.current is src
            return
        row = TRIGGERS[trigger]
        detail = {} if row.detail_optional else dict.fromkeys(row.detail, 0)
        self.machine.fire(self.lifecycle, trigger, **detail)
        self.num_moves += 1
        assert self.lifecycle.current is spec.dest

    @invariant()
    def records_match_moves(self) -> None:
        if hasattr(self, "sink"):
            assert len(self.sink.records) == self.num_moves


TestTableDriven = TableDrivenMachine.TestCase
