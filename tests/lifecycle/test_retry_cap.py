"""The retry cap of a failed load, and the one retry it bounds.

vLLM (``kv_load_failure_policy="recompute"``) restarts a failed request from 0 computed tokens, so the
retry reloads from scratch: its cap is the largest boundary no failed entry stands in the way of, and
its ordinary lookup finds the best boundary below that the store still serves on every group and rank
(e.g. a Mamba state saved at an earlier hand-off).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hybridkv.audit.replay import replay_records
from hybridkv.lifecycle import (
    EntryId,
    Geometry,
    GroupSpec,
    KeyScheme,
    LoadOutcome,
    LoadPlan,
    Topology,
    retry_cap,
)
from hybridkv.lifecycle.machine import LifecycleMachine, RequestLifecycle
from hybridkv.lifecycle.sink import MemoryAuditSink
from hybridkv.lifecycle.table import State
from hybridkv.testing.lifecycle_fuzz import family_hashes

FULL, MAMBA = 0, 1
NUM_TOKENS = 400  # 3 hash units of 128: the plan loads 384


def _scheme(*groups: GroupSpec, topology: Topology | None = None) -> KeyScheme:
    return KeyScheme(
        namespace="t", model="m", geometry=Geometry(groups=groups, topology=topology or Topology())
    )


class _World:
    """A lifecycle machine over a set-of-keys store holding, for one prompt, full-attention blocks
    through 384 and Mamba states at 128, 256 and 384 on every rank."""

    def __init__(self, scheme: KeyScheme, boundaries: dict[int, list[int]] | None = None) -> None:
        self.scheme = scheme
        self.sink = MemoryAuditSink()
        self.machine = LifecycleMachine(scheme, sink=self.sink)
        self.hashes = family_hashes(0, NUM_TOKENS // scheme.geometry.hash_unit)
        self.store: set[str] = set()
        for group, ends in (boundaries or {FULL: [128, 256, 384], MAMBA: [128, 256, 384]}).items():
            for end in ends:
                self.store.update(self.keys(group, end))

    def keys(self, group: int, boundary: int) -> list[str]:
        block_hash = self.hashes[boundary // self.scheme.geometry.hash_unit - 1]
        return [self.scheme.key(group, r.tp_rank, block_hash) for r in self.scheme.geometry.topology.ranks]

    def lookup(self, lc: RequestLifecycle) -> int:
        search = lc.start_search(self.hashes, NUM_TOKENS, 0)
        if search is None:
            return 0
        return lc.finish_search(search.run(lambda keys: [k in self.store for k in keys])).boundary

    def load(self, lc: RequestLifecycle, fail: Callable[[EntryId], bool] = lambda _e: False):  # type: ignore[no-untyped-def]
        assert lc.lookup is not None and lc.lookup.plan is not None
        lc.start_load()
        outcomes = {
            e: LoadOutcome.CORRUPT if fail(e) or k not in self.store else LoadOutcome.OK
            for e, k in lc.lookup.plan.entries
        }
        resolution = lc.finish_load(outcomes)
        self.store.difference_update(resolution.invalid_keys)  # the connector's store.remove
        return resolution

    def trail(self, request_id: str) -> list[tuple[str, str]]:
        return [(r["src"], r["dst"]) for r in self.sink.records if r["request_id"] == request_id]


def _full_mamba_dcp1() -> KeyScheme:
    return _scheme(GroupSpec.full(128), GroupSpec.mamba(128), topology=Topology(tp_size=2))


def _full_mamba_dcp2() -> KeyScheme:
    # MLA-like full attention sharded over DCP 2: 64 per rank, span 128; Mamba replicated, 128.
    return _scheme(
        GroupSpec.full(64, layout="mla"), GroupSpec.mamba(128), topology=Topology(tp_size=2, dcp_size=2)
    )


@pytest.mark.parametrize(
    ("scheme_fn", "what", "bad_rank"),
    [
        pytest.param(_full_mamba_dcp1, "full", 1, id="full-block-fails-dcp1"),
        pytest.param(_full_mamba_dcp1, "mamba", 0, id="mamba-state-fails-dcp1"),
        pytest.param(_full_mamba_dcp2, "full", 1, id="full-block-fails-dcp2-rank1"),
        pytest.param(_full_mamba_dcp2, "mamba", 1, id="mamba-state-fails-dcp2-rank1"),
    ],
)
def test_failed_load_retries_at_the_earlier_boundary(
    scheme_fn: Callable[[], KeyScheme], what: str, bad_rank: int
) -> None:
    world = _World(scheme_fn())
    assert world.scheme.geometry.spans == (128, 128)
    lc = world.machine.new_request("r")
    assert world.lookup(lc) == 384
    plan = lc.lookup.plan  # type: ignore[union-attr]
    assert plan is not None
    assert sorted((ld.group_index, ld.block_index, ld.key_boundary) for ld in plan.loads) == [
        (FULL, 0, 128),
        (FULL, 1, 256),
        (FULL, 2, 384),
        (MAMBA, 2, 384),
    ]
    # The full block [256, 384), or the Mamba state at 384, fails on one rank only.
    group = FULL if what == "full" else MAMBA
    failed = EntryId(bad_rank, group, 2, 384)
    resolution = world.load(lc, lambda e: e == failed)
    assert not resolution.verified and resolution.planned_boundary == 384
    assert resolution.retry_cap == 256 and lc.max_boundary == 256 and lc.current is State.TRUNCATED
    assert resolution.failed_entries == (failed,)
    # Only the corrupt block is invalid, on every rank: nothing downstream in its group, nothing unattempted.
    key_of = dict(plan.entries)
    assert set(resolution.invalid_keys) == {key_of[failed._replace(tp_rank=r)] for r in (0, 1)}
    truncated = world.sink.records[-1]
    assert truncated["trigger"] == "load_failed" and truncated["boundary"] == 256
    assert truncated["detail"]["retry_cap"] == 256 and truncated["detail"]["planned_boundary"] == 384

    # vLLM restarts the request from 0; the one retry finds the Mamba state at 256 and loads it.
    assert world.lookup(lc) == 256
    retry_plan = lc.lookup.plan  # type: ignore[union-attr]
    assert retry_plan is not None
    assert sorted((ld.group_index, ld.block_index, ld.key_boundary) for ld in retry_plan.loads) == [
        (FULL, 0, 128),
        (FULL, 1, 256),
        (MAMBA, 1, 256),
    ]
    assert world.load(lc).verified and lc.current is State.VERIFIED
    assert world.trail("r") == [
        ("NEW", "LOOKUP"),
        ("LOOKUP", "PARTIAL_HIT"),
        ("PARTIAL_HIT", "LOADING"),
        ("LOADING", "TRUNCATED"),
        ("TRUNCATED", "LOOKUP"),
        ("LOOKUP", "PARTIAL_HIT"),
        ("PARTIAL_HIT", "LOADING"),
        ("LOADING", "VERIFIED"),
    ]
    lc.evict()
    assert replay_records(json.dumps(r) for r in world.sink.records).ok


def test_no_earlier_state_means_the_retry_misses() -> None:
    # Only the Mamba state at 384 exists: the cap is 256, but nothing at or below it has a state.
    world = _World(_full_mamba_dcp1(), {FULL: [128, 256, 384], MAMBA: [384]})
    lc = world.machine.new_request("r")
    assert world.lookup(lc) == 384
    resolution = world.load(lc, lambda e: e.group_index == FULL and e.block_index == 2)
    assert resolution.retry_cap == 256
    assert world.lookup(lc) == 0 and lc.current is State.MISS


def test_first_block_failing_caps_at_zero() -> None:
    world = _World(_full_mamba_dcp1())
    lc = world.machine.new_request("r")
    assert world.lookup(lc) == 384
    resolution = world.load(lc, lambda e: e.group_index == FULL and e.block_index == 0 and e.tp_rank == 1)
    assert resolution.retry_cap == 0
    key_of = dict(lc.lookup.plan.entries)  # type: ignore[union-attr]
    # The corrupt block on every rank; the blocks after it are good entries this request cannot use.
    assert set(resolution.invalid_keys) == {key_of[EntryId(r, FULL, 0, 128)] for r in (0, 1)}
    assert world.lookup(lc) == 0 and lc.current is State.MISS


def test_the_retry_fails_too_then_miss_without_a_loop() -> None:
    world = _World(_full_mamba_dcp1())
    lc = world.machine.new_request("r")
    assert world.lookup(lc) == 384
    assert world.load(lc, lambda e: e.group_index == MAMBA).retry_cap == 256
    assert world.lookup(lc) == 256
    second = world.load(lc, lambda e: e.group_index == MAMBA)
    assert second.retry_cap == 128 and lc.max_boundary == 128 and lc.current is State.TRUNCATED
    # Retries exhausted: REFUSED without asking the store, and every later lookup too.
    assert lc.start_search(world.hashes, NUM_TOKENS, 0) is None and lc.current is State.REFUSED
    assert lc.start_search(world.hashes, NUM_TOKENS, 0) is None
    assert world.trail("r")[-3:] == [
        ("PARTIAL_HIT", "LOADING"),
        ("LOADING", "TRUNCATED"),
        ("TRUNCATED", "REFUSED"),
    ]


def test_unattempted_entries_only_keep_the_planned_boundary() -> None:
    world = _World(_full_mamba_dcp1())
    lc = world.machine.new_request("r")
    world.lookup(lc)
    plan = lc.lookup.plan  # type: ignore[union-attr]
    assert plan is not None
    lc.start_load()
    outcomes = {e: LoadOutcome.OK for e, _ in plan.entries if e.tp_rank == 0}  # rank 1 never reported
    resolution = lc.finish_load(outcomes)
    assert not resolution.verified and resolution.retry_cap == 384 and resolution.invalid_keys == ()


def _plan(scheme: KeyScheme, boundary: int, loads: list[tuple[int, int, int]]) -> LoadPlan:
    from hybridkv.lifecycle import PlannedBlock

    hashes = family_hashes(0, boundary // scheme.geometry.hash_unit + 4)
    unit = scheme.geometry.hash_unit
    return LoadPlan(
        scheme=scheme,
        boundary=boundary,
        num_computed_tokens=0,
        loads=tuple(PlannedBlock(g, i, end, hashes[end // unit - 1]) for g, i, end in loads),
    )


def test_sliding_window_failure_bars_only_windows_that_need_it() -> None:
    # Full 16 + sliding window 16 (window 33: two blocks). The plan restores 128: SWA blocks 6, 7.
    scheme = _scheme(GroupSpec.full(16), GroupSpec.sliding_window_group(16, 33))
    geometry = scheme.geometry
    assert geometry.hit_alignment == 16
    # SWA block 6 ([96, 112)) is needed by the windows of 112 and 128 only: the cap is 96.
    assert retry_cap(geometry, 128, [EntryId(0, 1, 6, 112)]) == 96
    # SWA block 7: only 128 needs it; strictly below the plan anyway: 112.
    assert retry_cap(geometry, 128, [EntryId(0, 1, 7, 128)]) == 112
    # A full-attention block bars everything past its start.
    assert retry_cap(geometry, 128, [EntryId(0, 0, 3, 64), EntryId(0, 1, 7, 128)]) == 48
    plan = _plan(scheme, 128, [(0, i, 16 * (i + 1)) for i in range(8)] + [(1, 6, 112), (1, 7, 128)])
    outcomes = {e: LoadOutcome.OK for e, _ in plan.entries}
    outcomes[EntryId(0, 1, 6, 112)] = LoadOutcome.CORRUPT
    resolution = plan.resolve_outcomes(outcomes)
    key_of = dict(plan.entries)
    assert resolution.retry_cap == 96
    # Invalid: the corrupt SWA block only; the SWA block after it and full attention stay.
    assert set(resolution.invalid_keys) == {key_of[EntryId(0, 1, 6, 112)]}


def test_mamba_failure_bars_only_its_own_boundary() -> None:
    # Fine-grained (Mamba 64 > hash unit 16): a failed state at 48 leaves 32 open, a failed full
    # block 1 ([32, 64)) bars everything past 32.
    geometry = Geometry(groups=(GroupSpec.full(32), GroupSpec.mamba(64)), prefix_match_unit=16)
    assert geometry.hit_alignment == 16
    assert retry_cap(geometry, 48, [EntryId(0, 1, 0, 48)]) == 32
    assert retry_cap(geometry, 96, [EntryId(0, 1, 1, 96)]) == 80
    assert retry_cap(geometry, 96, [EntryId(0, 0, 1, 64), EntryId(0, 1, 1, 96)]) == 32
    assert retry_cap(geometry, 96, []) == 96


def test_audit_replay_flags_a_retry_past_the_cap() -> None:
    world = _World(_full_mamba_dcp1())
    lc = world.machine.new_request("r")
    world.lookup(lc)
    world.load(lc, lambda e: e.group_index == FULL and e.block_index == 2)
    world.lookup(lc)
    lc.evict()
    records = [dict(r) for r in world.sink.records]
    assert replay_records(json.dumps(r) for r in records).ok
    hit = next(r for r in reversed(records) if r["trigger"] == "lookup_hit")
    assert hit["boundary"] == 256
    hit["boundary"] = 384  # a retry that ignored its cap
    report = replay_records(json.dumps(r) for r in records)
    assert report.violation_counts() == {"over_cap": 1}


@pytest.mark.parametrize(
    ("outcome", "invalidates"),
    [
        (LoadOutcome.MISSING, True),
        (LoadOutcome.CORRUPT, True),
        (LoadOutcome.TIMEOUT, False),
        (LoadOutcome.TRANSPORT_ERROR, False),
        (LoadOutcome.NOT_ATTEMPTED, False),
    ],
)
def test_only_definite_faults_invalidate(outcome: LoadOutcome, invalidates: bool) -> None:
    """Only MISSING / CORRUPT remove entries, every fault (but not an unattempted entry) bars the
    retry's boundaries that need it (which store status means which outcome: ``STATUS_MEANINGS``)."""
    assert outcome.invalidates is invalidates
    world = _World(_full_mamba_dcp1())
    lc = world.machine.new_request("r")
    assert world.lookup(lc) == 384
    plan = lc.lookup.plan  # type: ignore[union-attr]
    assert plan is not None
    lc.start_load()
    hit = EntryId(1, FULL, 1, 256)
    outcomes = {e: LoadOutcome.OK for e, _ in plan.entries}
    outcomes[hit] = outcome
    resolution = lc.finish_load(outcomes)
    key_of = dict(plan.entries)
    expected = {key_of[hit._replace(tp_rank=r)] for r in (0, 1)} if invalidates else set()
    assert set(resolution.invalid_keys) == expected
    assert resolution.num_transient_faults == int(outcome.is_fault and not invalidates)
    assert resolution.retry_cap == (128 if outcome.is_fault else 384)
