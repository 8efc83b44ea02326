"""Differential: the agreed boundary equals vLLM's own coordinator on the same geometry and entries.

The "existing keys" become cached blocks in a real ``BlockPool`` of a real coordinator
(``get_kv_cache_coordinator``), built from real specs; vLLM's ``find_longest_cache_hit`` must give the
boundary our ``plan_lookup(...).resolve(...)`` gives. Block sizes and the hit alignment are compared too.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hybridkv.lifecycle import Geometry, GroupKind, KeyScheme, plan_lookup
from hybridkv.testing.lifecycle_fuzz import family_hashes, geometries
from hypothesis import event, given, note
from hypothesis import strategies as st

pytestmark = pytest.mark.vllm

torch = pytest.importorskip("torch")
kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
kv_cache_coordinator = pytest.importorskip("vllm.v1.core.kv_cache_coordinator")

_LAYOUT_TO_HEAD_SIZE = {"": 64, "mha": 64, "mla": 128}


def _vllm_spec(group):  # type: ignore[no-untyped-def]
    head_size = _LAYOUT_TO_HEAD_SIZE[group.layout]
    if group.kind is GroupKind.FULL:
        return kv_cache_interface.FullAttentionSpec(
            block_size=group.block_size, num_kv_heads=1, head_size=head_size, dtype=torch.float16
        )
    if group.kind is GroupKind.SLIDING_WINDOW:
        return kv_cache_interface.SlidingWindowSpec(
            block_size=group.block_size,
            num_kv_heads=1,
            head_size=head_size,
            dtype=torch.float16,
            sliding_window=group.sliding_window,
        )
    return kv_cache_interface.MambaSpec(
        block_size=group.block_size, shapes=((2,),), dtypes=(torch.float16,), mamba_cache_mode="align"
    )


def _vllm_coordinator(geometry: Geometry, max_model_len: int):  # type: ignore[no-untyped-def]
    groups = [
        kv_cache_interface.KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=_vllm_spec(group))
        for i, group in enumerate(geometry.groups)
    ]
    kv_cache_config = kv_cache_interface.KVCacheConfig(
        num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=groups
    )
    # resolve_kv_cache_block_sizes reads only these fields of the VllmConfig.
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=geometry.groups[0].block_size,
            prefix_match_unit=geometry.prefix_match_unit,
            enable_prefix_caching=True,
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=geometry.topology.dcp_size),
        kv_transfer_config=object(),
    )
    scheduler_block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    coordinator = kv_cache_coordinator.get_kv_cache_coordinator(
        kv_cache_config,
        max_model_len=max_model_len,
        max_in_flight_tokens=max_model_len,
        use_eagle=False,
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=geometry.topology.dcp_size,
        pcp_world_size=1,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
    )
    return coordinator, scheduler_block_size, hash_block_size


@st.composite
def _cases(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    geometry = draw(geometries())
    num_tokens = draw(st.integers(1, 10 * max(geometry.spans) + 3))
    unit = geometry.hash_unit
    num_units = num_tokens // unit
    # Which (group, boundary) entries exist: mostly a prefix per group (a previous save), with holes,
    # entries present on only some ranks (then they do not count), and stray entries past the prefix.
    present = {}
    for g in range(geometry.num_groups):
        end = draw(st.integers(0, num_units)) * unit
        hole_rate = draw(st.sampled_from([0.0, 0.0, 0.1, 0.3]))
        for boundary in range(unit, num_units * unit + 1, unit):
            roll = draw(st.floats(0, 1))
            if boundary <= end:
                present[(g, boundary)] = (
                    "all" if roll >= hole_rate else draw(st.sampled_from(["some", "none"]))
                )
            else:
                present[(g, boundary)] = "all" if roll < 0.1 else "none"
    return geometry, num_tokens, present


@given(case=_cases())
def test_agreed_boundary_equals_vllm_coordinator(case) -> None:  # type: ignore[no-untyped-def]
    geometry, num_tokens, present = case
    note(f"geometry={geometry.describe()} num_tokens={num_tokens}")
    coordinator, scheduler_block_size, hash_block_size = _vllm_coordinator(
        geometry, max_model_len=num_tokens + 64
    )
    assert (scheduler_block_size, hash_block_size) == (geometry.scheduler_block_size, geometry.hash_unit)
    if not geometry.is_single_group:
        assert coordinator._cache_hit_alignment_tokens == geometry.hit_alignment

    hashes = family_hashes(7, num_tokens // geometry.hash_unit)
    scheme = KeyScheme(namespace="diff", model="m", geometry=geometry)
    ranks = geometry.topology.ranks
    existing: set[str] = set()
    pool = coordinator.block_pool
    free_blocks = pool.get_new_blocks(len(present) + 1)
    for (g, boundary), where in present.items():
        block_hash = hashes[boundary // geometry.hash_unit - 1]
        keys = [scheme.key(g, r.tp_rank, block_hash) for r in ranks]
        if where == "all":
            existing.update(keys)
            block = free_blocks.pop()
            pool.cached_block_hash_to_block.insert(
                kv_cache_utils.make_block_hash_with_group_id(block_hash, g), block
            )
        elif where == "some" and len(keys) > 1:
            existing.update(keys[1:])  # rank 0 lacks it: not restorable, not cached for vLLM either

    _, vllm_hit, _ = coordinator.find_longest_cache_hit(hashes, num_tokens - 1)
    candidates = plan_lookup(scheme, hashes, num_tokens, 0)
    result = candidates.resolve([key in existing for key in candidates.keys])
    note(f"vllm={vllm_hit} ours={result.boundary} groups={result.group_hit_tokens}")
    event(f"hit={'yes' if vllm_hit else 'no'} fine={geometry.fine_grained} groups={geometry.num_groups}")
    assert result.boundary == vllm_hit
