"""Stateful fuzzing of the lifecycle: random geometries x random stores x random failure interleavings.

``LifecycleFuzzMachine`` is a Hypothesis ``RuleBasedStateMachine``. Each run draws one geometry (full /
sliding-window / Mamba mixes, DCP 1-8 with TP a multiple of it, interleave, hash units, block sizes;
no sliding window under DCP, as in vLLM), a model store (a set of keys), and then interleaves: saves
(whole or partial, per rank), save waves that fail part-way, lookups with local hits, loads failing
per (rank, group, block) or split loads stopping early, evictions of store entries, preemptions and
finishes. At times a seeded positional fault pattern (``faulty+``'s gaps, tails and random gaps of
exists / get / put calls, a run of failed calls, scoped to some groups or ranks; the real
``FaultyBackend`` over the model store, ``hybridkv.testing.fault_patterns``) stands in front of the store:
lookups, loads and save waves then go through it. The hard rules are checked where they apply and as
invariants:

- a reported hit is restorable by every group on every rank (plan coverage + every key exists), on a
  first lookup and on the retry after a truncation alike; every planned key was answered present by the
  store (a gapped exists answer never yields a hit past the gap), and a probing search answers what the
  full scan answers over the store as the search saw it (its answers, gaps included);
- a slot a load answered ``OK`` holds exactly its own entry's bytes (what recomputing it gives), a slot
  that failed holds nothing;
- every planned key is derived from the request's own hashes (never mixed-prefix state);
- the retry cap of a truncation is exactly the largest aligned boundary (strictly below a plan with a
  faulted entry, never below the local hit) that no faulted entry (definite or transient) of any group
  on any rank is needed to restore (checked against a brute-force oracle), and exactly the blocks with
  a definite fault (``MISSING``, ``CORRUPT``) are invalidated, on every rank; timeouts, transport
  errors and unattempted entries keep their store entries;
- the retry's hit is at most the cap; retries are bounded (one, then ``MISS``);
- invalidated keys never exist in the model store afterwards (until a later save stores them again),
  so no later lookup plans them;
- every lifecycle terminates, the audit log replays clean (including: no hit past a recorded cap);
- ``BlockStored`` events name only entries stored on every rank.

Use it as ``run_state_machine_as_test(LifecycleFuzzMachine)`` or via ``TestLifecycleFuzz`` (pytest). Its rule
groups live in ``hybridkv.testing.lifecycle_rules``; this class puts them together and adds the scenarios that
span them, the invariants and the teardown.
"""

from __future__ import annotations

import json

from hybridkv.audit.replay import replay_records
from hybridkv.lifecycle.table import MAX_LOAD_RETRIES, State
from hybridkv.testing.lifecycle_rules.loads import LoadRules
from hybridkv.testing.lifecycle_rules.lookups import LookupRules
from hybridkv.testing.lifecycle_rules.model import family_hashes, geometries
from hybridkv.testing.lifecycle_rules.store_side import StoreRules
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

__all__ = ["LifecycleFuzzMachine", "TestLifecycleFuzz", "family_hashes", "geometries"]


class LifecycleFuzzMachine(LoadRules, LookupRules, StoreRules):
    """Drives ``LifecycleMachine`` + geometry against a set-of-keys model store."""

    # -- scenarios across the rule groups -------------------------------------------------------------

    @rule(data=st.data(), family=st.integers(0, 1))
    def stored_prompt_fails_then_retries(self, data: st.DataObject, family: int) -> None:
        """The scenario the retry cap exists for: a prompt stored at every boundary (Mamba states at
        every hand-off), reloaded by a new request, some entry fails, vLLM restarts it from 0 and the
        one retry looks up again under the cap (and, if it hits, loads: ``load_finishes`` judges it)."""
        self.previous_request_saved_everything(data, family)
        self.new_request(data, family)
        request_id = f"req-{self.num_requests - 1}"
        req = self.requests[request_id]
        self._lookup(data, req, 0, may_be_unavailable=False)
        if req.lifecycle.current is not State.PARTIAL_HIT:
            return
        req.lifecycle.start_load()
        req.num_loads += 1
        self._load(data, req, "fail")
        # (``state``, not ``current``: a type checker keeps ``current`` narrowed to PARTIAL_HIT from above)
        assert req.lifecycle.state == State.TRUNCATED.name
        self._lookup(data, req, 0, may_be_unavailable=False)  # vLLM's recompute policy: from 0
        if req.lifecycle.current is State.PARTIAL_HIT:
            req.lifecycle.start_load()
            req.num_loads += 1

    @rule(data=st.data(), family=st.integers(0, 1))
    def stored_prompt_loads_through_fault_patterns(self, data: st.DataObject, family: int) -> None:
        """A prompt stored at every boundary, looked up and loaded by a new request through freshly drawn
        positional faults (the lookup may meet a gap, a rank's load batch a failed tail or a failed run);
        after a truncation the one retry goes through them too (and, if it hits, ``load_finishes`` judges
        its load)."""
        self.previous_request_saved_everything(data, family)
        self._arm_fault_patterns(data)
        self.new_request(data, family)
        req = self.requests[f"req-{self.num_requests - 1}"]
        self._lookup(data, req, 0, may_be_unavailable=False)
        if req.lifecycle.current is not State.PARTIAL_HIT:
            return
        req.lifecycle.start_load()
        req.num_loads += 1
        self._load(data, req, "patterns")
        # (``state``, not ``current``: a type checker keeps ``current`` narrowed to PARTIAL_HIT from above)
        if req.lifecycle.state == State.TRUNCATED.name:
            self._lookup(data, req, 0, may_be_unavailable=False)  # vLLM's recompute policy: from 0
            if req.lifecycle.current is State.PARTIAL_HIT:
                req.lifecycle.start_load()
                req.num_loads += 1

    # -- invariants --------------------------------------------------------------------------------------

    @invariant()
    def one_record_per_transition(self) -> None:
        if hasattr(self, "sink"):
            assert len(self.sink.records) == self.machine.num_transitions, (
                f"{self.machine.num_transitions} transitions but {len(self.sink.records)} audit records"
            )

    @invariant()
    def invalidated_keys_stay_gone(self) -> None:
        if hasattr(self, "invalidated"):
            assert not (self.invalidated & self.store), "an invalidated key is reported as existing"

    @invariant()
    def retries_bounded(self) -> None:
        for request_id, req in self.requests.items():
            assert req.lifecycle.num_retries <= MAX_LOAD_RETRIES, (
                f"{request_id}: {req.lifecycle.num_retries} retries"
            )
            assert req.num_truncations <= 1 + MAX_LOAD_RETRIES, (
                f"{request_id}: {req.num_truncations} truncations"
            )

    def teardown(self) -> None:
        if not hasattr(self, "machine"):
            return
        for req in self.requests.values():
            req.lifecycle.evict("shutdown")
        report = replay_records(json.dumps(record) for record in self.sink.records)
        assert report.ok, f"audit replay found violations: {report.violations[:5]}"
        assert report.num_terminated == report.num_lifecycles, "some lifecycle never terminated"


TestLifecycleFuzz = LifecycleFuzzMachine.TestCase
