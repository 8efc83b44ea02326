"""Hybrid geometries with an EAGLE or a multi-module MTP drafter at vLLM's real ``Scheduler`` (a real
``SpeculativeConfig``: the one-layer EAGLE draft the tiny-model builder makes, drafting 3 tokens, or
``method="mtp"`` -- vLLM's name; ``deepseek_mtp``, ``qwen3_next_mtp`` ... are deprecated aliases of it --
over a tiny DeepSeek-V3 config with 3 MTP modules, which vLLM turns into a ``deepseek_mtp`` draft,
drafting 3 tokens: multi-module MTP), with simulated worker ranks over one shared store.

Multi-module MTP drafts ``num_speculative_tokens`` tokens ahead at a chunked-prefill boundary, so vLLM
(0.32, 0.33) refuses prefix caching unless its scheduler block covers that lookahead (``ValueError``
"Multi-module MTP with prefix caching requires scheduler_block_size (=64) >= num_speculative_tokens", raised
by the KV-cache coordinator when ``scheduler_block_size < vllm_config.num_prefill_lookahead_tokens``), it
never ends a prefill chunk within the lookahead of the prompt end, and it hashes only the tokens whose KV is
final (all but the last lookahead - 1 computed tokens).

vLLM's CPU build cannot run a hybrid model with speculative decoding and prefix caching (its Mamba precopy
fails), so this is where hybrids meet the EAGLE block drop. Per geometry and drafter (full attention + Mamba
align at TP 2; MLA + Mamba under DCP = TP = 4 and 8, the Kimi-K3-like sharding):

- a cold engine serves X and stores it; the same prompt again there is vLLM's own local hit, which with
  EAGLE and MTP stops short of the prompt's last cached block (resent until it stops growing: with MTP on
  full attention + Mamba the first resend hits 192, its own run caches the state at 256, later ones hit 256);
- a fresh engine (no device cache, same store) serves X: the external hit equals that local hit, and every
  restored KV slot and Mamba state on every rank equals what a recompute writes; over a store only X's cold
  run wrote, a fresh engine's hit equals the first resend's (192 there), exact as well;
- once a prefix P of X has been served on its own (its state stored at its EAGLE checkpoint), a fresh
  engine serves Y, which shares P and then diverges: the hit stops at least one block before the divergence
  (an attention group is verified one margin past the boundary, and Y's blocks there are not X's) and every
  restored slot is exact.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from hybridkv.connector.vllm_compat import vllm_release
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_eagle_draft, build_tiny_model
from hybridkv_dev.devkit.cluster import Cluster, hybrid_config
from support.scheduler import PROMPT, mtp_draft_config, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

#: Where Y diverges from X (a multiple of every geometry's blocks and spans).
DIVERGE_AT = 192
#: Multi-module MTP: draft modules (``num_nextn_predict_layers``) = speculative tokens = prefill lookahead.
MTP_TOKENS = 3
#: The MTP draft: a tiny DeepSeek-V3 config with ``MTP_TOKENS`` MTP modules, which vLLM turns into a
#: ``deepseek_mtp`` draft (``DeepSeekMTPModel``); 8 attention heads, as the target's, so TP 8 splits it too.
#: One draft architecture for every geometry: the Scheduler reads only its module count, and vLLM inspects
#: each new draft architecture once in a subprocess (~8 s on a fresh vLLM cache).
MTP_DRAFT = ("deepseek_v3", "deepseek_mtp")
GEOMETRIES = [("full_mamba", 1, 2), ("mla_mamba", 4, 4), ("mla_mamba", 8, 8)]


def _speculative_config(vc: Any, method: str, tmp: Path, num_tokens: int | None = None) -> Any:
    from vllm.config import SpeculativeConfig

    if method == "eagle":
        # hybrid_config's model: the tiny Llama with one KV head (its draft shares the sizes).
        model = build_tiny_model("llama", DEFAULT_MODELS_DIR, num_key_value_heads=1, num_attention_heads=8)
        draft, num_tokens = build_eagle_draft(model, DEFAULT_MODELS_DIR), num_tokens or 3
    else:
        draft = mtp_draft_config(MTP_DRAFT[0], tmp, n_predict=MTP_TOKENS, num_attention_heads=8)
        num_tokens = num_tokens or MTP_TOKENS
    return SpeculativeConfig(
        method=method,
        model=str(draft),
        num_speculative_tokens=num_tokens,
        target_model_config=vc.model_config,
        target_parallel_config=vc.parallel_config,
    )


def _spec_configs(
    kind: str, dcp: int, tp: int, method: str, tmp: Path, store: str | None = None, regime: str = "legacy"
) -> tuple[Any, Any]:
    """The geometry's configs with the drafter, in ``regime``: ``legacy`` (vLLM's EAGLE drop, no lookahead
    hashes: 0.32, 0.33, and 0.34 with ``disable_lookahead_block_hashes``) or ``lookahead`` (vLLM 0.34's
    lookahead block hashes, which this connector keeps on: L = the drafter's prefill lookahead, no drop)."""
    vc, kvc = hybrid_config(kind, dcp=dcp, tp=tp, store=store)
    spec = _speculative_config(vc, method, tmp)
    assert spec.use_eagle_block_drop()
    object.__setattr__(vc, "speculative_config", spec)
    if method == "mtp":
        assert spec.method == "mtp" and spec.use_multi_module_mtp(), spec
        assert spec.draft_model_config.hf_config.model_type == MTP_DRAFT[1]
        assert vc.num_prefill_lookahead_tokens == MTP_TOKENS
    if vllm_release() >= (0, 34):
        # The drafter was set after the config resolved: resolve L again, as vLLM does at its end.
        if regime == "legacy":
            object.__setattr__(spec, "disable_lookahead_block_hashes", True)
        vc.num_hash_lookahead_tokens = vc._resolve_num_hash_lookahead_tokens()
    want = vc.num_prefill_lookahead_tokens if regime == "lookahead" else 0
    assert getattr(vc, "num_hash_lookahead_tokens", 0) == want, (regime, vc.num_prefill_lookahead_tokens)
    return vc, kvc


#: the regimes a drafter runs in: vLLM 0.34's lookahead hashes only there
REGIMES = [
    "legacy",
    pytest.param(
        "lookahead",
        marks=pytest.mark.skipif(vllm_release() < (0, 34), reason="lookahead block hashes: vLLM 0.34"),
    ),
]


def _first_start(cl: Cluster, rid: str) -> tuple[int, list[tuple[str, int]]]:
    """Step once after adding ``rid``: (its computed tokens when first scheduled, the step's load jobs)."""
    out = cl.step()
    loads = [(job.req_id, job.boundary) for job in out.kv_connector_metadata.loads]
    starts = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
    return starts.get(rid, -1), loads


def _external_hit(vc: Any, kvc: Any, rid: str, prompt: list[int]) -> int:
    """A fresh engine (no device cache) serves ``prompt``: the connector's one load for it, checked slot by
    slot and state by state on every rank; its boundary."""
    fresh = Cluster(vc, kvc)
    try:
        fresh.add(rid, prompt)
        _, loads = _first_start(fresh, rid)
        assert len(loads) == 1 and loads[0][0] == rid, f"{rid}: loads {loads}"
        fresh.run()
        assert fresh.loads_checked == {rid: loads[0][1]}  # every slot / state on every rank, exact
        fresh.assert_empty()
    finally:
        fresh.shutdown()
    return loads[0][1]


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("method", ["eagle", "mtp"])
@pytest.mark.parametrize(("kind", "dcp", "tp"), GEOMETRIES)
def test_drafter_hits_equal_vllms_local_hit_and_restore_every_slot(
    kind: str, dcp: int, tp: int, method: str, regime: str, tmp_path: Path
) -> None:
    vc, kvc = _spec_configs(kind, dcp, tp, method, tmp_path, regime=regime)
    lookahead = int(getattr(vc, "num_hash_lookahead_tokens", 0))
    x = tokens(1)
    y = x[:DIVERGE_AT] + tokens(2, PROMPT - DIVERGE_AT)
    cold = Cluster(vc, kvc)
    try:
        geometry = cold.geo.geometry
        assert cold.geo.identity.drafter.startswith(f"{method}:")
        # Legacy: vLLM drops, so does the lookup. Lookahead: no drop, and L is in the keys' fingerprint.
        assert (geometry.eagle, geometry.hash_lookahead) == (not lookahead, lookahead)
        cold.add("x", x)
        cold.run()
        # Resend until vLLM's local hit stops growing: then the device cache and the store have seen the
        # same requests (a resend from the same hit computes and saves what the one before it did).
        # EAGLE's first resend already hits its fixed point; multi-module MTP's may not: vLLM caches a
        # state only once it is lookahead - 1 tokens behind the computed end, so X's state at its second
        # chunk end (lookahead - 1 short of that chunk's end) is not cached, a resend's is.
        local_hits: list[int] = []
        while len(local_hits) < 2 or local_hits[-1] != local_hits[-2]:
            assert len(local_hits) < 4, f"{kind}: vLLM's local hit never settles: {local_hits}"
            rid = f"x-local{len(local_hits)}"
            cold.add(rid, x)
            hit, loads = _first_start(cold, rid)
            assert loads == [], "the local hit covers what the store could serve: no load"
            cold.run()
            local_hits.append(hit)
        cold.assert_empty()
    finally:
        cold.shutdown()
    local_hit = local_hits[-1]
    block = cold.geo.geometry.hit_alignment
    if lookahead:
        # No drop: the hit is the Mamba checkpoint vLLM places at floor((N - max(1, L)) / H) * H.
        assert local_hit == (PROMPT - max(1, lookahead)) // block * block, f"{kind}: local hit {local_hit}"
    else:
        assert 0 < local_hit < PROMPT - block, f"{kind}: vLLM's local hit {local_hit}"

    external = _external_hit(vc, kvc, "x2", x)
    assert external == local_hit, f"{kind}: external hit {external} != vLLM's local hit {local_hit}"

    # After X alone, too: a store that only X's cold run wrote (the device cache gave local_hits[0] then).
    vc_once, _ = _spec_configs(
        kind, dcp, tp, method, tmp_path, store=f"memory://once-{uuid.uuid4().hex[:8]}", regime=regime
    )
    once = Cluster(vc_once, kvc)
    try:
        once.add("x", x)
        once.run()
        once.assert_empty()
    finally:
        once.shutdown()
    external_once = _external_hit(vc_once, kvc, "x3", x)
    assert external_once == local_hits[0], f"{kind}: hit after X alone {external_once} != {local_hits[0]}"

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
    print(
        f"{kind} dcp {dcp} {method} {regime}: local hits {local_hits}, external hit of X {local_hit} "
        f"(after X alone {external_once}), of Y {hits[0]}"
    )


@pytest.mark.parametrize(("kind", "dcp", "tp"), GEOMETRIES[:2])
def test_mtp_lookahead_past_the_scheduler_block_is_refused(
    kind: str, dcp: int, tp: int, tmp_path: Path
) -> None:
    """vLLM's own rule: multi-module MTP with prefix caching needs ``scheduler_block_size >=
    num_speculative_tokens``. 66 tokens (22 passes of the 3 modules) over a 64-token scheduler block: the
    Scheduler refuses to start."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc, kvc = hybrid_config(kind, dcp=dcp, tp=tp)
    spec = _speculative_config(vc, "mtp", tmp_path, 66)
    object.__setattr__(vc, "speculative_config", spec)
    # The rule is vLLM's, the connector's no part: no connector (the Scheduler makes its connector before
    # the refusal, and nothing would stop it). vLLM 0.33 without a KV connector hashes the drafter's
    # lookahead into every block instead of dropping; with one (this connector's case) it keeps the legacy
    # hashes and the drop, which ``disable_lookahead_block_hashes`` selects.
    object.__setattr__(vc, "kv_transfer_config", None)
    if hasattr(spec, "disable_lookahead_block_hashes"):
        object.__setattr__(spec, "disable_lookahead_block_hashes", True)
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kvc, vc)
    assert (sched_bs, vc.num_prefill_lookahead_tokens) == (64, 66)
    with pytest.raises(
        ValueError, match=r"requires scheduler_block_size \(=64\) >= num_speculative_tokens \(=66\)"
    ):
        Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=sched_bs, hash_block_size=hash_bs)
