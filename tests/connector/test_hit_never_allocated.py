"""A hit vLLM never allocates is refused after ``MAX_UNALLOCATED_ASKS`` asks: the request computes instead of
waiting forever.

vLLM 0.32 keeps a request whose async load failed (``failed_recving``, recompute policy, restarted from 0)
among its in-flight prefills, so the retry's async load must fit beside the request's own phantom
reservation. On a small KV cache it never does, and without the watchdog the request waits for ever (the
soak found it: ``Waiting: 1, Deferred: 1, KV fetch: 1 waiting to start``). vLLM's real ``Scheduler``, the
connector and simulated workers over one store.
"""

from __future__ import annotations

from typing import Any

import pytest
from hybridkv.connector.scheduler import lookup_answers
from hybridkv.lifecycle.kinds import GroupKind
from hybridkv_dev.devkit.cluster import Cluster, hybrid_config
from support.scheduler import tokens

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

PROMPT_TOKENS = 600


def _stored_prompt(store: str) -> tuple[list[int], list[int]]:
    """X, stored by a cold engine with room to spare; and X's cold outputs."""
    vc, kvc = hybrid_config("full_mamba", dcp=1, tp=1, num_blocks=256, store=store)
    x = tokens(5, PROMPT_TOKENS)
    cold = Cluster(vc, kvc)
    try:
        cold.add("x", x)
        cold.run()
        return x, cold.outputs["x"]
    finally:
        cold.shutdown()


def _run_with_a_failed_load(store: str, num_blocks: int, x: list[int], max_steps: int) -> Cluster:
    """A fresh engine of ``num_blocks`` blocks serves X; the first load of X fails on its last
    full-attention block (a transient fault), so vLLM restarts X and the connector's retry hits below it."""
    vc, kvc = hybrid_config("full_mamba", dcp=1, tp=1, num_blocks=num_blocks, store=store)
    cl = Cluster(vc, kvc)
    full = next(g for g in cl.geo.groups if g.kind is GroupKind.FULL)
    failed = False

    def fail_the_first_load(out: Any) -> None:
        nonlocal failed
        job = next((j for j in out.kv_connector_metadata.loads if j.req_id == "x" and j.blocks), None)
        if job is not None and not failed:
            ref = max((r for r in job.blocks if r.group_index == full.group_index), key=lambda r: r.index)
            cl.faults[0].fail_keys = {cl.side.scheme.key(ref.group_index, 0, ref.block_hash)}
            failed = True

    cl.add("x", x)
    while cl.sched.requests and cl.steps < max_steps:
        cl.step(before_load=fail_the_first_load)
        if failed:
            cl.faults[0].fail_keys = set()
    return cl


def test_a_retry_hit_that_never_fits_is_refused_and_the_request_computes() -> None:
    store = "memory://never-allocated"
    x, cold_out = _stored_prompt(store)
    budget = 4 * lookup_answers.MAX_UNALLOCATED_ASKS
    cl = _run_with_a_failed_load(store, 60, x, budget)
    try:
        totals = cl.side.stats.totals
        assert not cl.sched.requests, f"X is still waiting after {cl.steps} steps (a stranded request)"
        assert totals.get("truncations") == 1 and totals.get("hit_declined") == 1, totals
        assert cl.outputs["x"] == cold_out
        refused = [r for r in cl.audit.records if r.get("event") == "hit_refused"]
        assert refused and "did not allocate the hit" in refused[-1]["detail"]["reason"], refused
        cl.assert_empty()
    finally:
        cl.shutdown()


def test_a_retry_hit_that_fits_is_loaded() -> None:
    """With room for the phantom reservation the retry's hit is allocated and loaded: nothing refused."""
    store = "memory://allocated"
    x, cold_out = _stored_prompt(store)
    cl = _run_with_a_failed_load(store, 80, x, 200)
    try:
        totals = cl.side.stats.totals
        assert not cl.sched.requests and totals.get("truncations") == 1 and not totals.get("hit_declined")
        assert cl.outputs["x"] == cold_out
        cl.assert_empty()
    finally:
        cl.shutdown()
