"""Hybrid geometries with an EAGLE drafter at vLLM's real ``Scheduler`` (a real ``SpeculativeConfig``: the
one-layer EAGLE draft the tiny-model builder makes), with simulated worker ranks over one shared store.

vLLM's CPU build cannot run a hybrid model with speculative decoding and prefix caching (its Mamba precopy
fails), so this is where hybrids meet the EAGLE block drop. Per geometry (full attention + Mamba align at
TP 2; MLA + Mamba under DCP = TP = 4 and 8, the Kimi-K3-like sharding):

- a cold engine serves X and stores it; the same prompt again there is vLLM's own local hit, which with
  EAGLE stops short of the prompt's last cached block;
- a fresh engine (no device cache, same store) serves X: the external hit equals that local hit, and every
  restored KV slot and Mamba state on every rank equals what a recompute writes;
- once a prefix P of X has been served on its own (its state stored at its EAGLE checkpoint), a fresh
  engine serves Y, which shares P and then diverges: the hit stops at least one block before the divergence
  (an attention group is verified one margin past the boundary, and Y's blocks there are not X's) and every
  restored slot is exact.
"""

from __future__ import annotations

from typing import Any

import pytest
from hybridkv.devkit.cluster import Cluster, hybrid_config
from hybridkv.devkit.tiny_models import DEFAULT_MODELS_DIR, build_eagle_draft, build_tiny_model
from support.scheduler import PROMPT, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

#: Where Y diverges from X (a multiple of every geometry's blocks and spans).
DIVERGE_AT = 192


def _eagle_configs(kind: str, dcp: int, tp: int) -> tuple[Any, Any]:
    from vllm.config import SpeculativeConfig

    vc, kvc = hybrid_config(kind, dcp=dcp, tp=tp)
    # hybrid_config's model: the tiny Llama with one KV head (its draft shares the sizes).
    model = build_tiny_model("llama", DEFAULT_MODELS_DIR, num_key_value_heads=1, num_attention_heads=8)
    spec = SpeculativeConfig(
        method="eagle",
        model=str(build_eagle_draft(model, DEFAULT_MODELS_DIR)),
        num_speculative_tokens=3,
        target_model_config=vc.model_config,
        target_parallel_config=vc.parallel_config,
    )
    assert spec.use_eagle_block_drop()
    object.__setattr__(vc, "speculative_config", spec)
    return vc, kvc


def _first_start(cl: Cluster, rid: str) -> tuple[int, list[tuple[str, int]]]:
    """Step once after adding ``rid``: (its computed tokens when first scheduled, the step's load jobs)."""
    out = cl.step()
    loads = [(job.req_id, job.boundary) for job in out.kv_connector_metadata.loads]
    starts = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
    return starts.get(rid, -1), loads


@pytest.mark.parametrize(
    ("kind", "dcp", "tp"), [("full_mamba", 1, 2), ("mla_mamba", 4, 4), ("mla_mamba", 8, 8)]
)
def test_eagle_hits_equal_vllms_local_hit_and_restore_every_slot(kind: str, dcp: int, tp: int) -> None:
    vc, kvc = _eagle_configs(kind, dcp, tp)
    x = tokens(1)
    y = x[:DIVERGE_AT] + tokens(2, PROMPT - DIVERGE_AT)
    cold = Cluster(vc, kvc)
    try:
        assert cold.geo.geometry.eagle and cold.geo.identity.drafter.startswith("eagle:")
        cold.add("x", x)
        cold.run()
        cold.add("x-local", x)
        local_hit, loads = _first_start(cold, "x-local")
        assert loads == [], "the local hit covers what the store could serve: no load"
        cold.run()
        cold.assert_empty()
    finally:
        cold.shutdown()
    block = cold.geo.geometry.hit_alignment
    assert 0 < local_hit < PROMPT - block, f"{kind}: vLLM's local hit {local_hit}"

    fresh = Cluster(vc, kvc)
    try:
        fresh.add("x2", x)
        _, loads = _first_start(fresh, "x2")
        assert loads == [("x2", local_hit)], f"{kind}: external hit {loads} != vLLM's local hit {local_hit}"
        fresh.run()
        assert fresh.loads_checked == {"x2": local_hit}  # every slot / state on every rank, exact
        fresh.assert_empty()
    finally:
        fresh.shutdown()

    # X's states are at its chunk ends and checkpoint, all past the divergence; P = X[:DIVERGE_AT] on its
    # own stores a state at its EAGLE checkpoint, below the divergence.
    pre = Cluster(vc, kvc)
    try:
        pre.add("p", x[:DIVERGE_AT])
        pre.run()
        pre.assert_empty()
    finally:
        pre.shutdown()

    diverged = Cluster(vc, kvc)
    try:
        diverged.add("y", y)
        _, loads = _first_start(diverged, "y")
        diverged.run()
        hits = [boundary for rid, boundary in loads if rid == "y"]
        assert hits and 0 < hits[0] <= DIVERGE_AT - block, f"{kind}: Y's hit {hits} reaches the divergence"
        assert diverged.loads_checked == {"y": hits[0]}
        diverged.assert_empty()
    finally:
        diverged.shutdown()
    print(f"{kind} dcp {dcp}: local hit {local_hit}, external hit of X {local_hit}, of Y {hits[0]}")
