"""Geometry: sizes as vLLM derives them, keys, the agreed boundary on hand-built cases, truncation."""

from __future__ import annotations

import pytest
from hybridkv.lifecycle import (
    EntryId,
    Geometry,
    GroupSpec,
    KeyScheme,
    LoadOutcome,
    Topology,
    plan_lookup,
    plan_save,
)
from hybridkv.testing.lifecycle_fuzz import family_hashes


def _scheme(*groups: GroupSpec, topology: Topology | None = None, **kwargs: object) -> KeyScheme:
    geometry = Geometry(groups=groups, topology=topology or Topology(), **kwargs)  # type: ignore[arg-type]
    return KeyScheme(namespace="test", model="m", geometry=geometry)


def test_sizes_follow_dcp_and_lcm_gcd() -> None:
    geometry = Geometry(
        groups=(GroupSpec.full(16), GroupSpec.mamba(64)), topology=Topology(tp_size=4, dcp_size=2)
    )
    assert geometry.spans == (32, 64)  # full attention is DCP-sharded, Mamba is replicated
    assert geometry.scheduler_block_size == 64
    assert geometry.hash_unit == 32
    assert geometry.fine_grained and geometry.hit_alignment == 32
    assert [r.dcp_rank for r in geometry.topology.ranks] == [0, 1, 0, 1]


def test_invalid_geometries_are_rejected() -> None:
    with pytest.raises(AssertionError, match="sliding window"):
        Geometry(
            groups=(GroupSpec.full(16), GroupSpec.sliding_window_group(16, 32)),
            topology=Topology(tp_size=2, dcp_size=2),
        )
    with pytest.raises(AssertionError, match="divisible"):
        Geometry(groups=(GroupSpec.full(16), GroupSpec.mamba(24)), prefix_match_unit=16)
    with pytest.raises(AssertionError, match="namespace"):
        KeyScheme(namespace="a/b", model="m", geometry=Geometry(groups=(GroupSpec.full(16),)))


def test_keys_are_readable_and_fingerprinted() -> None:
    scheme = _scheme(GroupSpec.full(16), GroupSpec.mamba(32), topology=Topology(tp_size=2))
    key = scheme.key(1, 1, b"\xab\xcd")
    assert key == f"hkv1/test/{scheme.fingerprint}/g1/tp1/dcp0/abcd"
    assert key.startswith(scheme.prefix) and key.startswith(scheme.geometry_prefix)
    other = _scheme(GroupSpec.full(16), GroupSpec.mamba(32), topology=Topology(tp_size=4))
    assert other.fingerprint != scheme.fingerprint  # TP size is part of the geometry


def _resolve(scheme: KeyScheme, num_tokens: int, present: set[tuple[int, int]], local: int = 0):  # type: ignore[no-untyped-def]
    hashes = family_hashes(0, num_tokens // scheme.geometry.hash_unit)
    candidates = plan_lookup(scheme, hashes, num_tokens, local)
    ranks = scheme.geometry.topology.ranks
    existing = {
        scheme.key(g, r.tp_rank, hashes[b // scheme.geometry.hash_unit - 1])
        for g, b in present
        for r in ranks
    }
    return candidates.resolve([k in existing for k in candidates.keys]), hashes


def test_mamba_state_bounds_the_full_attention_hit() -> None:
    scheme = _scheme(GroupSpec.full(32), GroupSpec.mamba(64))
    full = {(0, b) for b in range(32, 193, 32)}
    result, _ = _resolve(scheme, 200, full | {(1, 96)})
    assert result.boundary == 96
    assert result.plan is not None
    loads = {(load.group_index, load.block_index, load.key_boundary) for load in result.plan.loads}
    # Mamba: only block cdiv(96, 64) - 1 = 1, holding the state at exactly 96.
    assert loads == {(0, 0, 32), (0, 1, 64), (0, 2, 96), (1, 1, 96)}


def test_full_tail_is_loaded_from_the_boundary_it_was_stored_under() -> None:
    scheme = _scheme(GroupSpec.full(64), GroupSpec.mamba(64), prefix_match_unit=16)
    # Full block 0 whole, block 1 only as a prompt tail stored at 112; Mamba state at 96.
    result, hashes = _resolve(scheme, 130, {(0, 64), (0, 112), (1, 96)})
    assert result.boundary == 96
    assert result.plan is not None
    tail = [load for load in result.plan.loads if load.group_index == 0 and load.block_index == 1]
    assert [load.key_boundary for load in tail] == [112]  # never a key derived at 96
    assert tail[0].block_hash == hashes[112 // 16 - 1]


def test_sliding_window_needs_only_its_window() -> None:
    scheme = _scheme(GroupSpec.full(16), GroupSpec.sliding_window_group(16, 33))
    full = {(0, b) for b in range(16, 129, 16)}
    result, _ = _resolve(scheme, 140, full | {(1, 96), (1, 112), (1, 128)})
    assert result.boundary == 128  # window 33 -> cdiv(32, 16) = 2 blocks: 96..128 suffices
    assert result.plan is not None
    assert sorted(l.block_index for l in result.plan.loads if l.group_index == 1) == [6, 7]


def test_hit_leaves_a_token_and_must_exceed_the_local_hit() -> None:
    scheme = _scheme(GroupSpec.full(16))
    everything = {(0, b) for b in range(16, 129, 16)}
    result, _ = _resolve(scheme, 128, everything)
    assert result.boundary == 112  # 128 tokens: at least one recomputed
    result, _ = _resolve(scheme, 128, everything, local=112)
    assert not result.is_hit and result.num_external_tokens == 0
    result, _ = _resolve(scheme, 128, {(0, 80), (0, 96), (0, 112)}, local=64)
    assert result.boundary == 112 and result.num_external_tokens == 48
    assert result.plan is not None and [l.block_index for l in result.plan.loads] == [4, 5, 6]


def test_one_rank_missing_means_no_hit() -> None:
    scheme = _scheme(GroupSpec.full(16), topology=Topology(tp_size=2))
    hashes = family_hashes(0, 4)
    candidates = plan_lookup(scheme, hashes, 64, 0)
    exists = [
        not (k.startswith(scheme.geometry_prefix + "g0/tp1/") and k.endswith(hashes[1].hex()))
        for k in candidates.keys
    ]
    assert candidates.resolve(exists).boundary == 16


def test_truncation_after_a_split_load() -> None:
    scheme = _scheme(GroupSpec.full(16), topology=Topology(tp_size=2))
    result, _ = _resolve(scheme, 100, {(0, b) for b in range(16, 97, 16)})
    assert result.plan is not None and result.boundary == 96
    outcomes = {}
    for entry, _key in result.plan.entries:
        if entry.tp_rank == 1 and entry.block_index == 2:
            outcomes[entry] = LoadOutcome.CORRUPT
        elif entry.tp_rank == 1 and entry.block_index > 2:
            continue  # rank 1 stopped after its failure: not attempted
        else:
            outcomes[entry] = LoadOutcome.OK
    resolution = result.plan.resolve_outcomes(outcomes)
    assert not resolution.verified and resolution.retry_cap == 32
    key_of = dict(result.plan.entries)
    invalid = set(resolution.invalid_keys)
    # The corrupt block goes on both ranks; the blocks past it (loaded on rank 0, never attempted on
    # rank 1) are good entries the retry of THIS request cannot use (cap 32), and stay in the store.
    assert invalid == {key_of[EntryId(r, 0, 2, 16 * (2 + 1))] for r in (0, 1)}


def test_save_events_only_for_blocks_stored_on_every_rank() -> None:
    scheme = _scheme(GroupSpec.full(16), GroupSpec.mamba(32), topology=Topology(tp_size=2))
    hashes = family_hashes(0, 4)
    plan = plan_save(scheme, hashes, {0: [16, 32], 1: [32]})
    outcomes = {entry: not (entry.tp_rank == 1 and entry.group_index == 1) for entry, _ in plan.entries}
    assert [(b.group_index, b.block_index) for b in plan.stored_blocks(outcomes)] == [(0, 0), (0, 1)]
