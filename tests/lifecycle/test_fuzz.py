"""The lifecycle fuzzer (hybridkv.testing.lifecycle_fuzz) under the active Hypothesis profile.

The lifecycle is pure logic and cheap to drive, so the CI profile runs it several times deeper than the
store fuzzers (at least 400 examples); ``--hypothesis-profile=long`` goes deeper still.
"""

from __future__ import annotations

from hybridkv.testing.lifecycle_fuzz import LifecycleFuzzMachine
from hypothesis import settings

TestLifecycleFuzz = LifecycleFuzzMachine.TestCase
TestLifecycleFuzz.settings = settings(settings.default, max_examples=max(400, settings.default.max_examples))

#: The machine's rules, initialize rules and invariants, wherever its rule groups
#: (``hybridkv.testing.lifecycle_rules``) define them: a group left out of its bases stops being fuzzed.
RULES = {
    "connector_refuses",
    "load_finishes",
    "lookup",
    "namespace_reset",
    "new_request",
    "previous_request_saved",
    "previous_request_saved_everything",
    "request_leaves",
    "save_wave",
    "scheduler_takes_hit",
    "store_evicts",
    "store_evicts_middle",
    "store_fault_patterns",
    "stored_prompt_fails_then_retries",
    "stored_prompt_loads_through_fault_patterns",
}
INITIALIZERS = {"setup"}
INVARIANTS = {"invalidated_keys_stay_gone", "one_record_per_transition", "retries_bounded"}


def test_hypothesis_collects_every_rule_and_invariant() -> None:
    collected = LifecycleFuzzMachine.setup_state()
    assert sorted(r.function.__name__ for r in collected.rules) == sorted(RULES)
    assert sorted(r.function.__name__ for r in collected.initializers) == sorted(INITIALIZERS)
    assert sorted(i.function.__name__ for i in collected.invariants) == sorted(INVARIANTS)
