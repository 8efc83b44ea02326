"""``hybridkv bench agentic-policies``: the eviction-order models against the memory store's replay, and
the command end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridkv.cli import main
from hybridkv_dev.bench.agentic import CONFIGURATIONS as STORE_CONFIGURATIONS
from hybridkv_dev.bench.agentic import (
    DEFAULT_ATTENTION_VALUE_BYTES,
    DEFAULT_STATE_VALUE_BYTES,
    AgenticWorkload,
    generate_trace,
    opened_store,
    replay_trace,
)
from hybridkv_dev.bench.agentic_policies import (
    POLICIES,
    ClairvoyantModel,
    LruModel,
    S3FifoModel,
    model_hit_fraction,
    run_policy_model,
)

SMALL = AgenticWorkload(num_sessions=8, median_turns=12, one_off_share=0.15, one_off_median_tokens=512)


@pytest.mark.parametrize("fraction", [0.05, 0.2, 10.0])
def test_the_lru_model_serves_what_the_memory_store_serves(fraction: float, tmp_path: Path) -> None:
    """The model's ``lru`` is the memory store's order: on one trace and capacity, the same share of prompt
    tokens (within the frame headers' part of capacity: the model counts payload bytes only); unbounded, all
    models serve the ceiling."""
    trace = generate_trace(SMALL, 3)
    working_set = trace.working_set_bytes(DEFAULT_ATTENTION_VALUE_BYTES, DEFAULT_STATE_VALUE_BYTES)
    capacity = int(fraction * working_set)
    lru = next(c for c in STORE_CONFIGURATIONS if c.name == "lru")
    with opened_store(lru, capacity, capacity // 5, tmp_path) as store:
        replayed = replay_trace(
            trace,
            store,
            configuration="lru",
            capacity_bytes=capacity,
            reference_quota_bytes=capacity // 5,
            attention_value_bytes=DEFAULT_ATTENTION_VALUE_BYTES,
            state_value_bytes=DEFAULT_STATE_VALUE_BYTES,
            sample_every=64,
        ).hit_fraction
    # The store fits a little less than the model at one capacity (each value's frame header counts).
    modelled = model_hit_fraction(trace, "lru", capacity)
    smaller = model_hit_fraction(trace, "lru", capacity * 0.98)
    assert min(modelled, smaller) - 0.01 <= replayed <= max(modelled, smaller) + 0.01, (
        replayed,
        modelled,
        smaller,
    )
    if fraction > 1:
        ideal = sum(trace.ideal_hit_tokens()) / sum(r.num_prompt_tokens for r in trace.requests)
        for policy in POLICIES:
            assert model_hit_fraction(trace, policy, capacity) == pytest.approx(ideal), policy


def test_s3fifo_keeps_entries_reused_over_one_offs() -> None:
    """The small queue lets entries that were never reused go first: under a stream of one-offs, a prefix
    reused once survives in S3-FIFO and not in LRU of the same size."""
    for cache, survives in ((S3FifoModel(100.0), True), (LruModel(100.0), False)):
        cache.insert(("t", "a", b"kept"), 10)
        cache.access(("t", "a", b"kept"))
        for i in range(30):
            cache.insert(("t", "a", bytes([i])), 10)
        assert cache.holds(("t", "a", b"kept")) is survives, type(cache).__name__


def test_the_clairvoyant_model_evicts_the_furthest_use_from_the_tail() -> None:
    """MIN, prefix-aware: an entry never used again goes first, then the one used furthest ahead; among
    entries the same request uses next, the deepest (a prefix is cut from its tail, never holed)."""
    head, middle, tail, state, dead = (("t", kind, bytes([i])) for i, kind in enumerate("aaasa"))
    other, x, y = ("t", "a", b"other"), ("u", "a", b"x"), ("u", "a", b"y")
    uses = {head: [5], middle: [5], tail: [5], state: [3], x: [5], y: [5]}
    depth = {head: 0.0, middle: 1.0, tail: 2.0, state: 2.5, dead: 0.0, other: 0.0, x: 0.0, y: 1.0}
    cache = ClairvoyantModel(40.0, uses, depth)
    cache.start_request(0)
    for entry in (dead, head, middle, tail, state):
        cache.insert(entry, 10)
    assert not cache.holds(dead) and all(cache.holds(e) for e in (head, middle, tail, state))
    cache.insert(other, 10)  # no use either: it goes itself (a bypass)
    assert cache.used == 40 and all(cache.holds(e) for e in (head, middle, tail, state))
    cache.start_request(4)  # the state's use has passed: it is never used again
    cache.insert(x, 10)
    assert not cache.holds(state) and cache.holds(x)
    cache.insert(y, 10)  # all used next at request 5: the deepest goes, the tail of t's prefix
    assert not cache.holds(tail) and all(cache.holds(e) for e in (head, middle, x, y))
    with pytest.raises(AssertionError, match="went back"):
        cache.start_request(2)


@pytest.mark.parametrize("fraction", [0.02, 0.05, 0.2])
def test_the_clairvoyant_model_serves_at_least_every_online_order(fraction: float) -> None:
    """The oracle is the reference the online orders are held to: on these traces it serves at least what
    each of them serves, and at most the unbounded store's ceiling."""
    for seed in (1, 2):
        trace = generate_trace(SMALL, seed)
        capacity = fraction * trace.working_set_bytes(
            DEFAULT_ATTENTION_VALUE_BYTES, DEFAULT_STATE_VALUE_BYTES
        )
        clairvoyant = model_hit_fraction(trace, "clairvoyant", capacity)
        ideal = sum(trace.ideal_hit_tokens()) / sum(r.num_prompt_tokens for r in trace.requests)
        assert clairvoyant <= ideal + 1e-9, (seed, clairvoyant, ideal)
        for policy in ("lru", "lru-tail-first", "s3fifo"):
            online = model_hit_fraction(trace, policy, capacity)
            assert clairvoyant >= online, (seed, policy, online, clairvoyant)


def test_the_command_prints_every_policy_and_the_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    assert (
        main(
            ["bench", "agentic-policies", "--rounds", "1", "--capacity-fractions", "0.05", "--out", str(out)]
        )
        == 0
    )
    text = capsys.readouterr().out
    for policy in [*POLICIES, "unbounded"]:
        assert policy in text
    report = json.loads(out.read_text())
    assert [row["policy"] for row in report["rows"]] == [*POLICIES, "unbounded"]
    (target,) = report["targets"]
    assert target["limit"] == ">= 15" and isinstance(target["met"], bool)
    assert main(["bench", "agentic-policies", "--capacity-fractions", "x"]) == 2


def test_run_policy_model_takes_points_per_seed() -> None:
    report = run_policy_model(SMALL, num_rounds=2, capacity_fractions=(0.05,))
    rows = {row["policy"]: row for row in report["rows"]}
    lru = rows["lru"]["rounds"]
    for policy in ("s3fifo", "unbounded"):
        points = [100 * (a - b) for a, b in zip(rows[policy]["rounds"], lru, strict=True)]
        assert rows[policy]["points_vs_lru"] == pytest.approx(sum(points) / 2)  # the median of two
    assert rows["unbounded"]["hit_fraction"] >= max(r["hit_fraction"] for r in rows.values())
