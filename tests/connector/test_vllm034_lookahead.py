"""vLLM 0.34's lookahead block hashes with this connector, at vLLM 0.34's real config resolution and Scheduler.

With ``num_hash_lookahead_tokens`` (L) on, every block hash also covers the L tokens after its block and
vLLM drops no block of an EAGLE / MTP hit. The connector opts in (``supports_lookahead_block_hashes``):

- vLLM resolves L on with it, alone and in a ``MultiConnector`` with vLLM's ``OffloadingConnector``
  (a ``MultiConnector`` keeps L only if every child opts in; one that does not pulls it back to 0);
- L is in the key fingerprint: an engine with lookahead hashes never reads what a legacy engine (L = 0, the
  EAGLE drop) stored for the same prompt, nor the other way round;
- the prompt blocks whose hashes need tokens the request's last step sampled (the last block of a prompt
  that ends on a block boundary needs its first output token) are saved when the request finishes, as the
  in-tree MooncakeStore's ``register_finished_lookahead_save`` does: a conversation continuing from that
  output hits the whole prompt, every slot exact.

The Scheduler-level drafter tests of ``test_scheduler_speculative.py`` run in both regimes; the differential
test against vLLM's coordinator draws L too. 0.32 and 0.33 have no lookahead hashes (this file skips there).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hybridkv.connector.vllm_compat import vllm_release
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_eagle_draft, build_tiny_model
from hybridkv_dev.devkit.cluster import Cluster, hybrid_config
from support.scheduler import tokens

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_release() < (0, 34), reason="lookahead block hashes: vLLM 0.34"),
]


def _with_eagle(vc: Any, *, lookahead: bool = True) -> Any:
    """``vc`` with the tiny model's one-layer EAGLE drafter (3 tokens), L resolved again as vLLM does at
    the end of its config (``lookahead=False``: the legacy regime, ``disable_lookahead_block_hashes``)."""
    from vllm.config import SpeculativeConfig

    model = build_tiny_model("llama", DEFAULT_MODELS_DIR, num_key_value_heads=1, num_attention_heads=8)
    spec = SpeculativeConfig(
        method="eagle",
        model=str(build_eagle_draft(model, DEFAULT_MODELS_DIR)),
        num_speculative_tokens=3,
        target_model_config=vc.model_config,
        target_parallel_config=vc.parallel_config,
    )
    if not lookahead:
        object.__setattr__(spec, "disable_lookahead_block_hashes", True)
    object.__setattr__(vc, "speculative_config", spec)
    vc.num_hash_lookahead_tokens = vc._resolve_num_hash_lookahead_tokens()
    return vc


def _multi_connector(vc: Any, *children: dict[str, Any]) -> Any:
    """``vc``'s transfer config as a ``MultiConnector`` of this connector (``vc``'s own config) and
    ``children``."""
    from vllm.config import KVTransferConfig

    own = vc.kv_transfer_config
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "connectors": [
                {
                    "kv_connector": own.kv_connector,
                    "kv_connector_module_path": own.kv_connector_module_path,
                    "kv_role": own.kv_role,
                    "kv_load_failure_policy": own.kv_load_failure_policy,
                    "kv_connector_extra_config": dict(own.kv_connector_extra_config),
                },
                *children,
            ]
        },
    )


def test_lookahead_hashes_stay_on_with_this_connector_alone_and_beside_offloading() -> None:
    """vLLM resolves L = the drafter's prefill lookahead (1 for EAGLE) with this connector; the geometry
    has L and no drop; a ``MultiConnector`` of this connector and vLLM's ``OffloadingConnector`` keeps it on,
    and one with a child that does not opt in (vLLM's ``ExampleConnector``) turns it off."""
    from hybridkv.connector.connector import HybridStoreConnector
    from hybridkv.connector.vllm_geometry import resolve_geometry

    vc, kvc = hybrid_config("full_mamba", dcp=1, tp=2)
    assert HybridStoreConnector.supports_lookahead_block_hashes(vc.kv_transfer_config)
    vc = _with_eagle(vc)
    assert vc.num_hash_lookahead_tokens == vc.num_prefill_lookahead_tokens == 1
    geometry = resolve_geometry(vc, kvc, "ns", check_vllm_sizes=True).geometry
    assert (geometry.eagle, geometry.hash_lookahead) == (False, 1)

    offloading = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    object.__setattr__(vc, "kv_transfer_config", _multi_connector(vc, offloading))
    assert vc._resolve_num_hash_lookahead_tokens() == 1
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": "unused"},
    }
    object.__setattr__(vc, "kv_transfer_config", _multi_connector(vc, offloading, example))
    assert vc._resolve_num_hash_lookahead_tokens() == 0


def _serve(vc: Any, kvc: Any, rid: str, prompt: list[int], max_tokens: int = 4) -> int:
    """Serve ``prompt`` on a fresh engine over ``vc``'s store: the boundary of its one external load (0: no
    load), every loaded slot and state checked exact on every rank."""
    cl = Cluster(vc, kvc)
    try:
        cl.add(rid, prompt, max_tokens=max_tokens)
        out = cl.step()
        loads = [job.boundary for job in out.kv_connector_metadata.loads if job.req_id == rid]
        cl.run()
        assert cl.loads_checked == ({rid: loads[0]} if loads else {}), (loads, cl.loads_checked)
        cl.assert_empty()
    finally:
        cl.shutdown()
    return loads[0] if loads else 0


@pytest.mark.usefixtures("lookups_settle")
def test_engines_with_and_without_lookahead_hashes_never_read_each_others_entries() -> None:
    """One store, one prompt: a legacy engine (L = 0) hits what a legacy engine stored, an engine with
    lookahead hashes (L = 1) what one with L = 1 stored, and neither what the other stored: their keys'
    fingerprints differ (their block hashes too)."""
    store = f"memory://la-{uuid.uuid4().hex[:8]}"
    legacy_vc, kvc = hybrid_config("full_mamba", dcp=1, tp=2, store=store)
    legacy_vc = _with_eagle(legacy_vc, lookahead=False)
    lookahead_vc, _ = hybrid_config("full_mamba", dcp=1, tp=2, store=store)
    lookahead_vc = _with_eagle(lookahead_vc)
    assert (legacy_vc.num_hash_lookahead_tokens, lookahead_vc.num_hash_lookahead_tokens) == (0, 1)
    x = tokens(11)

    assert _serve(legacy_vc, kvc, "cold-legacy", x) == 0
    assert _serve(lookahead_vc, kvc, "after-legacy", x) == 0, "an L = 1 engine read L = 0 entries"
    legacy_hit = _serve(legacy_vc, kvc, "legacy-again", x)
    assert legacy_hit > 0
    lookahead_hit = _serve(lookahead_vc, kvc, "lookahead-again", x)  # its own cold run stored X just now
    assert lookahead_hit > legacy_hit, (legacy_hit, lookahead_hit)  # no drop

    store2 = f"memory://la-{uuid.uuid4().hex[:8]}"
    first_vc, _ = hybrid_config("full_mamba", dcp=1, tp=2, store=store2)
    legacy_after_vc, _ = hybrid_config("full_mamba", dcp=1, tp=2, store=store2)
    assert _serve(_with_eagle(first_vc), kvc, "cold-lookahead", x) == 0
    assert _serve(_with_eagle(legacy_after_vc, lookahead=False), kvc, "after-lookahead", x) == 0, (
        "an L = 0 engine read L = 1 entries"
    )


@pytest.mark.usefixtures("lookups_settle")
def test_blocks_the_last_hash_update_made_savable_are_saved_at_finish() -> None:
    """Full attention + sliding window, EAGLE (L = 1), a 288-token prompt (a multiple of every block) and
    one output token: the hash of the prompt's last block covers that output token, so it exists only after
    the request's last step, and the block is saved at finish. A conversation continuing from the output
    (the prompt, the output, 31 more tokens) then hits the whole prompt on a fresh engine, every slot exact;
    without the finish-time save the prompt's last block would be missing and the hit one block shorter."""
    vc, kvc = hybrid_config("full_swa", dcp=1, tp=1)
    vc = _with_eagle(vc)
    assert vc.num_hash_lookahead_tokens == 1
    prompt = tokens(12, 288)
    cold = Cluster(vc, kvc)
    try:
        cold.add("x", prompt, max_tokens=1)
        cold.run()
        assert cold.outputs["x"] == [900]
        cold.assert_empty()
    finally:
        cold.shutdown()
    block = cold.geo.geometry.scheduler_block_size
    assert (block, 288 % block) == (32, 0)

    turn2 = [*prompt, 900, *tokens(13, 31)]
    assert _serve(vc, kvc, "turn2", turn2) == 288
