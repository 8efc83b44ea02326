"""Preemption, aborts and finish-time hand-offs with vLLM's real ``Scheduler`` and simulated ranks.

- vLLM's own preemption path (a pool too small for every running request): requests whose prefix came
  from the store are preempted and resumed (a new incarnation each time), a request whose load is still
  in flight is never preempted (it holds its blocks), and afterwards nothing is pinned or live.
- Prompt tails on a geometry where the Mamba checkpoint lies inside both a Mamba block and a
  full-attention (DCP-widened) block: the Mamba state comes from the exact hand-off vLLM gives (a CoW copy
  on the next step, or ``register_finished_partial_tail`` when the request ends at the checkpoint), and
  the full-attention block is saved under the checkpoint's hash with it, so the hit is the checkpoint.
"""

from __future__ import annotations

import pytest
from hybridkv_dev.devkit.cluster import Cluster, hybrid_config
from support.scheduler import tokens

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]


def _store_cold(vc: object, kvc: object, prompts: dict[str, list[int]], max_tokens: int = 4) -> None:
    cold = Cluster(vc, kvc)
    try:
        for rid, toks in prompts.items():
            cold.add(rid, toks, max_tokens=max_tokens)
        cold.run()
        cold.assert_empty()
    finally:
        cold.shutdown()


def test_real_preemption_of_loaded_requests_and_none_while_loading() -> None:
    vc, big = hybrid_config("full_mamba", dcp=1, tp=2, num_blocks=256)
    prompts = {f"p{i}": tokens(40 + i) for i in range(3)}
    _store_cold(vc, big, prompts)

    _, small = hybrid_config("full_mamba", dcp=1, tp=2, num_blocks=64)
    small.kv_cache_groups = big.kv_cache_groups  # same geometry, a smaller pool
    cl = Cluster(vc, small)
    side = cl.side
    try:
        for rid, toks in prompts.items():
            cl.add(rid + "w", toks, max_tokens=40)
        preempted: set[str] = set()
        gated = False
        for _ in range(400):
            if not cl.sched.requests and not side.has_pending_push_work():
                break
            running = {r.request_id for r in cl.sched.running}
            if not gated and (lc := side.lifecycle("p2w")) is not None and lc.state == "VERIFIED":
                # Hold a load in flight while the others grow: add a fourth request and gate its load.
                for f in cl.faults:
                    f.gate.clear()
                cl.add("p0x", prompts["p0"] + [5] * 20, max_tokens=2)
                gated = True
                out = cl.step(wait_loads=False)
                loading = {j.req_id for j in out.kv_connector_metadata.loads}
                for _ in range(6):  # the loading request is never preempted while its blocks are written
                    out = cl.step(wait_loads=False)
                    preempted |= set(out.preempted_req_ids or ())
                    assert not (loading & set(out.preempted_req_ids or ()))
                for f in cl.faults:
                    f.gate.set()
                continue
            out = cl.step()
            preempted |= set(out.preempted_req_ids or ()) & running
        else:
            raise AssertionError("did not drain")
        assert preempted & {"p0w", "p1w", "p2w"}, "the pool was meant to preempt loaded requests"
        evictions = [
            r
            for r in cl.audit.records
            if r["dst"] == "EVICTED" and (r.get("detail") or {}).get("reason") == "preempted"
        ]
        assert evictions, "a preempted request's verified lifecycle is closed (a new incarnation looks up)"
        assert side.stats.totals["hit_tokens"] > 0
        # Every load (first incarnations and resumed ones) restored exactly what a recompute writes.
        assert set(cl.loads_checked) >= {"p0w", "p1w", "p2w"}
        cl.assert_empty()
        for rid in prompts:
            assert cl.outputs[rid + "w"] == [900 + i for i in range(40)]
    finally:
        cl.shutdown()


@pytest.mark.parametrize("handoff", ["cow", "finish"])
def test_prompt_tail_inside_a_full_attention_block_is_saved(handoff: str) -> None:
    """MLA 16 x DCP 4 (span 64) + Mamba 96: hash unit 32. A 360-token prompt checkpoints at 352, inside
    Mamba block 3 (288..384) and full-attention block 5 (320..384): both tails must be stored."""
    from vllm.v1.request import RequestStatus

    vc, kvc = hybrid_config("mla_mamba96", dcp=4, tp=4)
    toks = tokens(77, 360)
    cold = Cluster(vc, kvc)
    try:
        assert cold.hash_unit == 32 and cold.geo.geometry.hit_alignment == 32
        cold.add("x", toks)
        chunks = [cold.step().num_scheduled_tokens["x"] for _ in range(2)]
        assert chunks == [288, 64]  # vLLM stops the prefill at the Mamba block end, then the checkpoint
        if handoff == "finish":
            # Ends exactly at the checkpoint: the state comes from register_finished_partial_tail.
            cold.sched.finish_requests("x", RequestStatus.FINISHED_ABORTED)
        cold.run()
        cold.assert_empty()
        tails = {
            (r["groups"][0]["group"] if r.get("groups") else None, r["boundary"])
            for r in cold.audit.records
            if r["wave"] is not None and r["dst"] == "STORED"
        }
        assert any(b == 352 for _, b in tails), tails
    finally:
        cold.shutdown()

    warm = Cluster(vc, kvc)
    try:
        warm.add("x2", toks)
        out = warm.step()
        assert [(j.req_id, j.boundary) for j in out.kv_connector_metadata.loads] == [("x2", 352)]
        full_tail = [
            (ref.index, ref.key_boundary)
            for ref in out.kv_connector_metadata.loads[0].blocks
            if ref.group_index == 0 and ref.key_boundary % 64
        ]
        assert full_tail == [(5, 352)]
        warm.step()
        assert warm.loads_checked == {"x2": 352}
        warm.run()
        warm.assert_empty()
    finally:
        warm.shutdown()
