"""The connector inside vLLM's real ``Scheduler`` with simulated worker ranks over one shared store.

Matrix: (a) full attention + Mamba align, DCP 1 (TP 2); (b) full attention + sliding window, DCP 1
(TP 2); (c) MLA + Mamba align under DCP = TP = 2, 4, 8. Per geometry a cold engine stores four prompts
(fixture ``stored``); each scenario then runs on a fresh engine (new ``Scheduler``: no device cache, same
store), one test per scenario, each with its own prompt:

- hit: the load covers exactly the boundary the store can serve (vLLM's prompt checkpoint), every group
  advances by it, and on every rank every restored KV slot / Mamba state equals what a recompute writes;
- one rank fails one full-attention block k: TRUNCATED with retry cap k x span, ``failed_recving`` +
  ``finished_recving`` from every rank (never block-level ids), the failed entry (a transfer failure, so
  a transient fault) and its downstream entries kept in the store; vLLM restarts the request from 0 and the one capped retry loads an
  earlier boundary the store still serves (Mamba state / window there), whose every restored slot and
  state equals a recompute (TRUNCATED -> LOOKUP -> PARTIAL_HIT -> LOADING -> VERIFIED);
- abort while loading: the lifecycle is evicted, vLLM holds the blocks until every rank finished, the
  late results are ignored;
- preemption after loading (vLLM's ``_preempt_request``): a new incarnation, the device cache serves it;
- after every scenario the outputs equal the cold run's and nothing is pinned or live: block-pool ref counts
  zero, no jobs / lifecycles in the connector, the audit log replays clean with every lifecycle terminated.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from hybridkv.lifecycle.kinds import GroupKind
from hybridkv_dev.devkit.cluster import Cluster, hybrid_config
from support.scheduler import PROMPT, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

GEOMETRIES = [
    pytest.param(("full_mamba", 1, 2), id="full+mamba-dcp1"),
    pytest.param(("full_swa", 1, 2), id="full+swa-dcp1"),
    pytest.param(("mla_mamba", 2, 2), id="mla+mamba-dcp2"),
    pytest.param(("mla_mamba", 4, 4), id="mla+mamba-dcp4"),
    pytest.param(("mla_mamba", 8, 8), id="mla+mamba-dcp8"),
]


#: Where the retry after a failed full-attention block lands: the largest boundary <= the retry cap at
#: which the cold runs left every group in the store. full + Mamba 64: the prefill is split at 256, so
#: a state was handed off there; sliding window: whole blocks; MLA + Mamba 16 prefills in one chunk
#: (a state at the checkpoint 288 only), so a cold run of the 129-token prefix of "b" adds one at 128.
RETRY_HIT = {
    ("full_mamba", 1): 256,
    ("full_swa", 1): 256,
    ("mla_mamba", 2): 128,
    ("mla_mamba", 4): 128,
    ("mla_mamba", 8): 128,
}


def served_boundary(cl: Cluster, n: int) -> int:
    """What a cold prefill of ``n`` tokens leaves in the store: the last hit-aligned boundary below n
    (vLLM's prompt checkpoint: a hash boundary on fine-grained geometries, else a scheduler block)."""
    a = cl.geo.geometry.hit_alignment
    return (n - 1) // a * a


@dataclass(frozen=True)
class Stored:
    """One geometry after the cold runs: its configs, the prompts in the store and the cold outputs."""

    kind: str
    dcp: int
    vc: Any
    kvc: Any
    prompts: dict[str, list[int]]
    cold_out: dict[str, list[int]]


@pytest.fixture(scope="module", params=GEOMETRIES)
def stored(request: pytest.FixtureRequest) -> Stored:
    """A cold engine stores prompts a, b, c, d (one per scenario) on a fresh store."""
    kind, dcp, tp = request.param
    vc, kvc = hybrid_config(kind, dcp=dcp, tp=tp)
    prompts = {name: tokens(seed) for seed, name in enumerate("abcd", start=1)}
    cold = Cluster(vc, kvc)
    try:
        for rid, toks in prompts.items():
            cold.add(rid, toks)
        cold.run()
        cold.assert_empty()
        assert cold.side.stats.totals.get("hit_tokens", 0) == 0
        cold_out = dict(cold.outputs)
    finally:
        cold.shutdown()
    if kind == "mla_mamba":
        pre = Cluster(vc, kvc)  # a fresh engine: no device cache; its lookup misses (no state <= 128)
        try:
            pre.add("b-prefix", prompts["b"][:129])
            pre.run()
            pre.assert_empty()
            assert pre.side.stats.totals.get("hit_tokens", 0) == 0
        finally:
            pre.shutdown()
    return Stored(kind, dcp, vc, kvc, prompts, cold_out)


@contextmanager
def fresh_engine(stored: Stored, *rids: str) -> Iterator[Cluster]:
    """A fresh engine on the stored geometry; on exit every request runs to the end, the outputs of
    ``rids`` (named ``<prompt>2``) equal the cold run's, and nothing is left pinned or live."""
    cl = Cluster(stored.vc, stored.kvc)
    try:
        yield cl
        cl.run()
        for rid in rids:
            assert cl.outputs[rid] == stored.cold_out[rid[0]], rid
        cl.assert_empty()
    finally:
        cl.shutdown()


def test_hit_loads_the_served_boundary(stored: Stored) -> None:
    with fresh_engine(stored, "a2") as cl:
        side = cl.side
        H = served_boundary(cl, PROMPT)
        before = dict(side.stats.totals)
        cl.add("a2", stored.prompts["a"])
        out = cl.step()
        assert "a2" not in out.num_scheduled_tokens  # async: waiting for remote KV
        assert [(j.req_id, j.boundary) for j in out.kv_connector_metadata.loads] == [("a2", H)]
        (job,) = out.kv_connector_metadata.loads

        def counted(name: str) -> float:
            return side.stats.totals.get(name, 0) - before.get(name, 0)

        assert counted("hit_tokens") == H
        out = cl.step()
        assert cl.loads_checked == {"a2": H}  # every slot / state on every rank, checked
        assert out.num_scheduled_tokens["a2"] == PROMPT - H
        assert side.lifecycle("a2").state == "VERIFIED"
        for g in cl.geo.groups:
            loaded = counted(f"loaded_blocks.g{g.group_index}")
            assert loaded == sum(1 for ref in job.blocks if ref.group_index == g.group_index) > 0, g
            if g.kind is GroupKind.FULL:
                assert loaded == -(-H // g.span), g  # a full-attention group restores every block of the hit


def test_one_failed_block_truncates_and_the_capped_retry_loads_an_earlier_boundary(stored: Stored) -> None:
    # The last rank fails the second-to-last full-attention block k of the plan. The retry cap is
    # k * span (no failed entry is needed below it); vLLM restarts the request from 0 and the one
    # retry finds the best boundary <= the cap the store still serves on every group and rank (a
    # Mamba state / sliding window saved by the cold run) and loads it.
    from hybridkv.store import open_store

    retry_hit = RETRY_HIT[stored.kind, stored.dcp]
    store = open_store(stored.vc.kv_transfer_config.kv_connector_extra_config["store"])
    with fresh_engine(stored, "b2") as cl:
        side = cl.side
        H = served_boundary(cl, PROMPT)
        cl.add("b2", stored.prompts["b"])
        last = cl.tp - 1
        full = next(g for g in cl.geo.groups if g.kind.value == "full")
        k = (H - 1) // full.span - 1
        cap = k * full.span
        assert k >= 1 and cap % cl.geo.geometry.hit_alignment == 0
        failed_key: list[str] = []
        downstream: list[str] = []

        def fail_one_block(out: object) -> None:
            job = next(j for j in out.kv_connector_metadata.loads if j.req_id == "b2")  # type: ignore[attr-defined]
            assert job.boundary == H
            ref = next(r for r in job.blocks if r.group_index == full.group_index and r.index == k)
            failed_key.append(side.scheme.key(ref.group_index, last, ref.block_hash))
            downstream.extend(
                side.scheme.key(r.group_index, rank, r.block_hash)
                for r in job.blocks
                if r.group_index == full.group_index and r.index > k
                for rank in range(cl.tp)
            )
            cl.faults[last].fail_keys = {failed_key[0]}

        cl.step(before_load=fail_one_block)
        cl.faults[last].fail_keys = set()
        lc = side.lifecycle("b2")
        assert side.stats.totals["truncations"] == 1
        assert lc.max_boundary == cap and lc.state == "TRUNCATED"
        assert "b2" not in cl.loads_checked
        req = cl.sched.requests["b2"]
        assert req.num_computed_tokens == 0  # policy "recompute": from scratch
        # A transfer failure says nothing about the entry: the failed entry and the full-attention entries
        # downstream of it stay in the store (this request's retry cannot use them: the cap).
        assert side.wait_maintenance(10)
        assert downstream and all(s.is_ok for s in store.exists(failed_key + downstream))
        assert side.stats.totals["load_transient_faults"] == 1
        out = cl.step()  # the one capped retry: an earlier boundary, loaded and checked slot by slot
        retry = [(j.req_id, j.boundary) for j in out.kv_connector_metadata.loads]
        assert retry == [("b2", retry_hit)], (retry, cap)
        assert 0 < retry_hit <= cap
        assert "b2" not in out.num_scheduled_tokens  # waiting for the retry's load
        assert cl.loads_checked["b2"] == retry_hit  # equal to a recompute, every rank
        assert side.lifecycle("b2").state == "VERIFIED"
        out = cl.step()  # the prefill resumes at the retry's boundary (maybe split at a Mamba checkpoint)
        n = out.num_scheduled_tokens["b2"]
        assert 0 < n <= PROMPT - retry_hit
        assert cl.sched.requests["b2"].num_computed_tokens == retry_hit + n
        trail = [
            (r["src"], r["dst"]) for r in cl.audit.records if r["request_id"] == "b2" and r["wave"] is None
        ]
        i = trail.index(("LOADING", "TRUNCATED"))
        assert trail[i + 1 :] == [
            ("TRUNCATED", "LOOKUP"),
            ("LOOKUP", "PARTIAL_HIT"),
            ("PARTIAL_HIT", "LOADING"),
            ("LOADING", "VERIFIED"),
        ], trail
        truncated = next(r for r in cl.audit.records if r["request_id"] == "b2" and r["dst"] == "TRUNCATED")
        assert truncated["boundary"] == cap and truncated["detail"]["retry_cap"] == cap


def test_abort_while_loading_ignores_the_late_results(stored: Stored) -> None:
    from vllm.v1.request import RequestStatus

    with fresh_engine(stored) as cl:
        side = cl.side
        for f in cl.faults:
            f.gate.clear()
        cl.add("c2", stored.prompts["c"])
        out = cl.step(wait_loads=False)
        assert [j.req_id for j in out.kv_connector_metadata.loads] == ["c2"]
        cl.sched.finish_requests("c2", RequestStatus.FINISHED_ABORTED)
        assert side.lifecycle("c2") is None  # evicted at once
        assert "c2" in cl.sched.requests  # vLLM keeps its blocks until every rank finished the load
        for f in cl.faults:
            f.gate.set()
        for _ in range(3):
            cl.step()
            if "c2" not in cl.sched.requests:
                break
        assert "c2" not in cl.sched.requests and "c2" not in cl.loads_checked


def test_preemption_after_loading_starts_a_new_incarnation(stored: Stored) -> None:
    from vllm.v1.request import RequestStatus

    with fresh_engine(stored, "d2") as cl:
        side = cl.side
        cl.add("d2", stored.prompts["d"])
        cl.step()
        cl.step()
        assert cl.loads_checked["d2"] == served_boundary(cl, PROMPT)
        req = cl.sched.requests["d2"]
        assert req.status == RequestStatus.RUNNING
        cl.sched.running.remove(req)
        cl.sched._preempt_request(req, time.monotonic())
        verified = side.lifecycle("d2")
        out = cl.step()
        # Back with its device-cached prefix: a new incarnation, which the store does not need to serve.
        assert verified.state == "EVICTED" and side.lifecycle("d2") is not verified
        assert out.kv_connector_metadata.loads == []
