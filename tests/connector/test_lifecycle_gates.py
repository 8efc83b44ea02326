"""Facts never outlive the state they belong to, inside vLLM's real ``Scheduler``.

- A hit answered before a namespace reset is never loaded after it (the reset epoch: ``hit_revoked``, and
  the ``answer_current`` guard on ``start_load``).
- A reset moves this engine's keys to a fingerprint no engine on other weights reads; replicas whose
  ``weights_version_file`` names the same weights keep sharing.
- A refusal is a state (``REFUSED``, audited), not a flag: no later lookup of the incarnation hits.
- Layer-wise loads: no other request shares a block a load fills before the load is verified.
- A finished request's lookup stops; a request that reads no cached prefix costs no lookup.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from hybridkv.audit.replay import replay_records
from hybridkv.demo import vllm_harness
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from hybridkv.lifecycle.sink import MemoryAuditSink
from hybridkv.store import open_store
from support.scheduler import both_lookup_modes, fill_store, make_request, make_scheduler

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

RANKS = (0, 1)
#: full attention at 32..128 and a Mamba state at 128 on both ranks: a 130-token prompt hits 128
_ENTRIES = [(0, 32), (0, 64), (0, 96), (0, 128), (1, 128)]


def _audited(vc: Any) -> tuple[Any, Any, MemoryAuditSink]:
    sched = make_scheduler(vc)
    side = sched.connector.scheduler_side
    side.machine.sink = sink = MemoryAuditSink()
    return sched, side, sink


def _assert_legal(sink: MemoryAuditSink) -> None:
    """The records replay against the table without an illegal transition (live requests may remain)."""
    report = replay_records(json.dumps(r) for r in sink.records)
    assert [v for v in report.violations if v.kind.value != "unterminated"] == []


def _events(sink: MemoryAuditSink, request_id: str) -> list[str]:
    return [r["event"] for r in sink.records if r["request_id"] == request_id and r["wave"] is None]


class _SlowRemoval:
    """The test's store, whose ``remove_prefix`` waits until released (a large namespace on a slow disk)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.release = threading.Event()

    def remove_prefix(self, prefix: str) -> int:
        assert self.release.wait(30), "the test never released the removal"
        removed: int = self.inner.remove_prefix(prefix)
        return removed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@both_lookup_modes
def test_a_hit_answered_before_a_reset_is_never_loaded_after_it(objs: dict[str, Any]) -> None:
    sched, side, sink = _audited(objs["vc"])
    store = open_store(objs["store_url"])
    req = make_request("r1", 130, first=5000)
    fill_store(side.scheme, store, list(req.block_hashes), _ENTRIES, RANKS)
    # The first allocation fails (a full local cache): the request stays waiting in PARTIAL_HIT.
    allocate = sched.kv_cache_manager.allocate_slots
    calls = {"n": 0}

    def fails_once(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return None if calls["n"] == 1 else allocate(*args, **kwargs)

    sched.kv_cache_manager.allocate_slots = fails_once  # type: ignore[method-assign]
    sched.add_request(req)
    out = sched.schedule()
    assert out.kv_connector_metadata.loads == [] and side.lifecycle("r1").state == "PARTIAL_HIT"

    # A reset whose removal outlasts reset_cache's wait: in effect at once, the entries still there.
    slow = side.store = _SlowRemoval(side.store)
    side.reset_wait_s = 0.05
    try:
        assert side.reset_cache() is True and side.namespace_closed
        out = sched.schedule()  # before: the memo answered 128 again and the pre-reset entries loaded
        assert out.kv_connector_metadata.loads == [], "a hit answered before the reset was loaded after it"
        assert side.lifecycle("r1").state == "MISS"
    finally:
        slow.release.set()
    assert side.wait_maintenance(10) and not side.namespace_closed
    revoked = [r for r in sink.records if r["event"] == "hit_revoked"]
    assert len(revoked) == 1 and revoked[0]["detail"] == {"reason": "namespace reset", "epoch": 0}
    _assert_legal(sink)


@both_lookup_modes
def test_the_load_guard_refuses_a_hit_from_before_a_reset(objs: dict[str, Any]) -> None:
    """The table's ``answer_current`` guard is the last check: a stale PARTIAL_HIT vLLM allocates is
    refused (audited), never loaded, even if nothing revoked it."""
    sched, side, sink = _audited(objs["vc"])
    store = open_store(objs["store_url"])
    req = make_request("g1", 130, first=5200)
    fill_store(side.scheme, store, list(req.block_hashes), _ENTRIES, RANKS)
    lookup = side.lookup

    def reset_between(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        answer = lookup(request, num_computed_tokens)
        side.machine.begin_epoch()  # a reset between the answer and the allocation
        return answer

    sched.connector.get_num_new_matched_tokens = reset_between  # type: ignore[method-assign]
    sched.add_request(req)
    out = sched.schedule()
    (job,) = out.kv_connector_metadata.loads
    assert (job.boundary, tuple(job.blocks)) == (0, ()), "a stale hit's load was planned"
    assert _events(sink, "g1")[-1] == "hit_refused" and side.lifecycle("g1").state == "REFUSED"
    _assert_legal(sink)


@both_lookup_modes
def test_a_reset_moves_the_keys_away_from_engines_on_other_weights(objs: dict[str, Any]) -> None:
    sched, side, _ = _audited(objs["vc"])
    store = open_store(objs["store_url"])
    checkpoint = side.scheme.fingerprint
    assert side.reset_cache() is True and side.wait_maintenance(10)
    updated = side.scheme
    assert updated.fingerprint != checkpoint, "KV of updated weights is keyed as the checkpoint's"
    # What this engine saves from now on goes out under the rotated keys (the workers key by meta.scheme).
    sched.add_request(make_request("w1", 130, first=5300))
    out = sched.schedule()
    assert out.kv_connector_metadata.scheme.fingerprint == updated.fingerprint
    fill_store(updated, store, list(make_request("w", 130, first=5400).block_hashes), _ENTRIES, RANKS)

    # A restart, a replica or an eval engine on the checkpoint never reads it ...
    sched2, side2, _ = _audited(objs["vc"])
    assert side2.scheme.fingerprint == checkpoint
    sched2.add_request(make_request("w2", 130, first=5400))
    assert sched2.schedule().kv_connector_metadata.loads == []
    assert side2.lifecycle("w2").state == "MISS"
    # ... while the engine itself hits what it saved after its reset.
    sched3_req = make_request("w3", 130, first=5400)
    sched.add_request(sched3_req)
    out = sched.schedule()
    assert [j.boundary for j in out.kv_connector_metadata.loads if j.req_id == "w3"] == [128]


@both_lookup_modes
def test_replicas_whose_weights_files_name_one_version_share_across_resets(
    objs: dict[str, Any], tmp_path: Path
) -> None:
    """Each replica's ``weights_version_file`` names the weights it holds (read at every reset): replicas
    updated to the same weights share, whatever their count of resets (``test_weights_tag.py``)."""
    objs["extra"]["weights_version"] = "rl-step-7"
    path_a, path_b = tmp_path / "a.weights", tmp_path / "b.weights"
    objs["extra"]["weights_version_file"] = str(path_a)
    _sched_a, side_a, _ = _audited(objs["vc"])
    objs["extra"]["weights_version_file"] = str(path_b)
    _sched_b, side_b, _ = _audited(objs["vc"])
    assert side_a.scheme.fingerprint == side_b.scheme.fingerprint
    path_a.write_text("rl-step-8\n")
    assert side_a.reset_cache() and side_a.wait_maintenance(10)
    assert side_a.scheme.fingerprint != side_b.scheme.fingerprint, "an updated replica shares with one not"
    path_b.write_text("rl-step-8\n")
    assert side_b.reset_cache() and side_b.wait_maintenance(10)
    assert side_b.reset_cache() and side_b.wait_maintenance(10)  # a second reset (a pause): same weights
    assert side_a.scheme.fingerprint == side_b.scheme.fingerprint
    assert side_a.scheme.weights_tag == "rl-step-8"


@both_lookup_modes
def test_a_finished_request_stops_its_lookup(objs: dict[str, Any]) -> None:
    from hybridkv.connector.scheduler.lookup_service import LookupTask

    sched = make_scheduler(objs["vc"])
    side = sched.connector.scheduler_side
    gate = threading.Event()
    submitted: list[LookupTask] = []
    submit = side.lookups.submit

    def held(task: LookupTask) -> None:
        submitted.append(task)
        submit(task)

    side.lookups.submit = held  # type: ignore[method-assign]
    side.store = _HeldExists(side.store, gate)
    req = make_request("f1", 130, first=5600)
    sched.add_request(req)  # the prefetch starts and hangs in the store
    assert submitted
    from vllm.v1.request import RequestStatus

    sched.finish_requests("f1", RequestStatus.FINISHED_ABORTED)
    gate.set()
    assert all(task.cancelled for task in submitted), "an aborted request's lookup kept running"


class _HeldExists:
    def __init__(self, inner: Any, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def exists(self, keys: Any) -> Any:
        self.gate.wait(30)
        return self.inner.exists(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@both_lookup_modes
def test_a_request_that_reads_no_cached_prefix_costs_no_lookup(objs: dict[str, Any]) -> None:
    _sched, side, sink = _audited(objs["vc"])
    store = open_store(objs["store_url"])
    req = make_request("p1", 130, first=5800)
    fill_store(side.scheme, store, list(req.block_hashes), _ENTRIES, RANKS)
    req.skip_reading_prefix_cache = True  # prompt logprobs, pooling: vLLM itself skips its cache
    assert side.lookup(req, 0) == (0, False)
    assert side.stats.totals.get("lookups", 0) == 0
    assert _events(sink, "p1") == []


# ---------------------------------------------------------------------------------------- layer-wise
def _single_group_scheduler(store_url: str) -> Any:
    from hybridkv_dev.devkit.cluster import two_group_cache_config
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = build_tiny_model("llama", DEFAULT_MODELS_DIR, num_key_value_heads=1, num_attention_heads=8)
    vc = vllm_harness.connector_vllm_config(
        model,
        {"store": store_url, "lookup_budget_ms": 5000, "namespace": "gates", "load_mode": "layerwise"},
        block_size=16,
        num_blocks=64,
    )
    vc.scheduler_config.async_scheduling = False
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    cfg = two_group_cache_config(64, spec.page_size_bytes, ("attn.0", spec))
    vllm_harness.resolve_cache_block_sizes(cfg, vc)
    return Scheduler(vc, cfg, StructuredOutputManager(vc), block_size=16, hash_block_size=16)


def test_a_layerwise_load_is_shared_by_no_request_before_it_is_verified() -> None:
    url = f"memory://gates-lw-{uuid.uuid4().hex[:8]}"
    sched = _single_group_scheduler(url)
    side = sched.connector.scheduler_side
    store = open_store(url)
    tokens = list(range(6000, 6000 + 100))
    first = vllm_harness.block_hashed_request("l1", tokens, 16, 4)
    hashes = list(first.block_hashes)
    keys = [side.scheme.key(0, 0, hashes[b // 16 - 1]) for b in range(16, 97, 16)]
    assert all(s.is_ok for s in store.put(keys, [b"x"] * len(keys)))
    sched.add_request(first)
    # A second request with the same prompt, scheduled in the same step after the first.
    sched.add_request(vllm_harness.block_hashed_request("l2", tokens, 16, 4))
    out = sched.schedule()
    computed = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
    loads = {j.req_id: j.boundary for j in out.kv_connector_metadata.loads}
    assert loads["l1"] == 96
    # Before: l2 took l1's just-allocated blocks as a local hit of 96 tokens, pages not yet loaded.
    l1_blocks = set(sched.kv_cache_manager.get_blocks("l1").get_block_ids()[0][:6])
    l2_blocks = set(sched.kv_cache_manager.get_blocks("l2").get_block_ids()[0])
    assert not l1_blocks & l2_blocks, "a request shares blocks a layer-wise load has not verified"
    assert computed["l2"] == loads.get("l2", 0), "l2's computed prefix came from somewhere but its own load"


def test_layerwise_forces_piecewise_cuda_graphs() -> None:
    """vLLM asks the connector class while resolving its config; full graphs skip the layer waits."""
    from hybridkv.connector import HybridStoreConnector

    assert HybridStoreConnector.requires_piecewise_for_cudagraph({"load_mode": "layerwise"}) is True
    assert HybridStoreConnector.requires_piecewise_for_cudagraph({"load_mode": "async"}) is False
    assert HybridStoreConnector.requires_piecewise_for_cudagraph({}) is False
