"""The scheduler half inside vLLM's real ``Scheduler`` (no workers): TP = DCP = 2, full attention + Mamba.

The store is pre-filled through the connector's own ``KeyScheme`` (``memory://``), and worker results are
handed to ``Scheduler.update_from_output`` as the executor would after aggregating both ranks. A load that
fails on rank 1 truncates with a retry cap; vLLM restarts the request from 0 and the one retry loads the
earlier boundary the store still serves (the Mamba state there); a failed retry is the last one.
"""

from __future__ import annotations

from typing import Any

import pytest
from hybridkv.connector.metadata import LoadResult, SaveOutcome, SaveResult
from hybridkv.lifecycle import LoadOutcome
from hybridkv.store import open_store
from hybridkv_dev.devkit.cluster import HASH
from support.scheduler import fill_store, make_request, make_scheduler, model_output

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]


def test_hit_needs_every_group_on_every_rank_then_loads_verify(vllm_objs: dict[str, Any]) -> None:
    from hybridkv.connector.metadata import HybridStoreWorkerMetadata

    sched = make_scheduler(vllm_objs["vc"])
    conn = sched.connector
    side = conn.scheduler_side
    scheme = side.scheme
    assert scheme.geometry.spans == (32, 32) and scheme.geometry.topology.dcp_size == 2
    store = open_store(vllm_objs["store_url"])

    req = make_request("a", 100)  # 3 hashes: boundaries 32, 64, 96; limit 96
    hashes = list(req.block_hashes)
    # Full attention everywhere, Mamba state at 96 only on rank 0: no boundary has a state on every rank.
    fill_store(scheme, store, hashes, [(0, 32), (0, 64), (0, 96)], (0, 1))
    fill_store(scheme, store, hashes, [(1, 96)], (0,))
    sched.add_request(req)
    out = sched.schedule()
    # A miss: the prefill starts at 0 (split at the Mamba block boundary), nothing loads.
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("a", 0)]
    assert out.kv_connector_metadata.loads == []
    assert side.stats.totals.get("hit_tokens", 0) == 0

    # The same prompt on a fresh engine (no device cache), after the state reached rank 1 too: 96, async.
    fill_store(scheme, store, hashes, [(1, 96)], (1,))
    sched = make_scheduler(vllm_objs["vc"])
    side = sched.connector.scheduler_side
    req_b = make_request("b", 100)
    sched.add_request(req_b)
    out = sched.schedule()
    assert "b" not in out.num_scheduled_tokens  # waiting for remote KV
    loads = out.kv_connector_metadata.loads
    assert [(ld.req_id, ld.boundary) for ld in loads] == [("b", 96)]
    plan = sorted((b.group_index, b.index) for b in loads[0].blocks)
    assert plan == [(0, 0), (0, 1), (0, 2), (1, 2)], plan  # 3 full blocks; Mamba block cdiv(96,32)-1
    assert side.stats.totals["hit_tokens"] == 96

    results = {"b": [LoadResult(b.entry(rank), LoadOutcome.OK) for rank in (0, 1) for b in loads[0].blocks]}
    sched.update_from_output(out, model_output(out, HybridStoreWorkerMetadata(loads=results), {"b"}, set()))
    assert side.lifecycle("b").state == "VERIFIED"
    # Counted per group at the verdict: 3 full-attention blocks, 1 Mamba state.
    assert (side.stats.totals["loaded_blocks.g0"], side.stats.totals["loaded_blocks.g1"]) == (3, 1)
    out = sched.schedule()
    assert out.num_scheduled_tokens.get("b") == 4  # 96 loaded + 4 computed
    # Preempted and back: a new incarnation looks up again (the verified one is closed, not reused).
    verified = side.lifecycle("b")
    assert side.lookup(req_b, 0) == (96, True)
    assert verified.state == "EVICTED" and side.lifecycle("b").state == "PARTIAL_HIT"


def _load_results(job: Any, bad: set[tuple[int, int, int]]) -> Any:
    """Both ranks' per-block results for ``job``; (rank, group_index, index) in ``bad`` fail as corrupt."""
    from hybridkv.connector.metadata import HybridStoreWorkerMetadata

    return HybridStoreWorkerMetadata(
        loads={
            job.req_id: [
                LoadResult(
                    b.entry(rank),
                    LoadOutcome.CORRUPT if (rank, b.group_index, b.index) in bad else LoadOutcome.OK,
                )
                for rank in (0, 1)
                for b in job.blocks
            ]
        }
    )


def _trail(sink: Any, rid: str) -> list[tuple[str, str]]:
    return [(r["src"], r["dst"]) for r in sink.records if r["request_id"] == rid and r["wave"] is None]


def _truncate_on_rank1(
    vllm_objs: dict[str, Any], rid: str, first: int
) -> tuple[Any, Any, Any, list[bytes], Any]:
    """A 130-token prompt whose store holds full attention at 32..128 and Mamba states at 64 and 128 on
    both ranks; the plan loads 128 and rank 1 fails full-attention block 2 (tokens 64..96)."""
    from hybridkv.lifecycle.sink import MemoryAuditSink

    sched = make_scheduler(vllm_objs["vc"])
    side = sched.connector.scheduler_side
    side.machine.sink = sink = MemoryAuditSink()
    scheme = side.scheme
    store = open_store(vllm_objs["store_url"])
    req = make_request(rid, 130, first=first)  # 4 hashes: limit 128
    hashes = list(req.block_hashes)
    keys = fill_store(scheme, store, hashes, [(0, 32), (0, 64), (0, 96), (0, 128), (1, 64), (1, 128)], (0, 1))
    sched.add_request(req)
    out = sched.schedule()
    (job,) = out.kv_connector_metadata.loads
    assert job.boundary == 128
    sched.update_from_output(out, model_output(out, _load_results(job, {(1, 0, 2)}), {rid}, {rid}))
    lc = side.lifecycle(rid)
    # Full-attention block 2 failed (on one DCP rank: bad for both): boundaries past 64 need it. The
    # retry cap is 64; the Mamba state at 64 is still in the store.
    assert lc.state == "TRUNCATED" and lc.max_boundary == 64
    assert side.wait_maintenance(10)  # invalidation removes run off the scheduler thread
    assert side.stats.totals["truncations"] == 1 and side.stats.totals["invalidated_entries"] == 2
    present = dict(zip(keys, (s.is_ok for s in store.exists(keys)), strict=True))
    gone = {k for k, ok in present.items() if not ok}
    # The corrupt block, on every rank (a block restores only from every rank). The entries after it
    # are good: this request's retry cannot use them (cap 64), a later request can.
    expected = {scheme.key(0, r, hashes[96 // HASH - 1]) for r in (0, 1)}
    assert gone == expected, gone
    # vLLM restarts from 0 (policy "recompute") and frees the blocks; the retry is capped at 64.
    assert sched.requests[rid].num_computed_tokens == 0
    return sched, side, store, hashes, sink


def test_rank_failure_truncates_invalidates_and_retries_an_earlier_boundary(
    vllm_objs: dict[str, Any],
) -> None:
    sched, side, _store, _hashes, sink = _truncate_on_rank1(vllm_objs, "c", first=2000)
    out = sched.schedule()
    (job,) = out.kv_connector_metadata.loads
    assert (job.req_id, job.boundary) == ("c", 64)  # the state at 64 and full blocks 0, 1
    plan = sorted((b.group_index, b.index, b.key_boundary) for b in job.blocks)
    assert plan == [(0, 0, 32), (0, 1, 64), (1, 1, 64)], plan
    assert "c" not in out.num_scheduled_tokens
    lc = side.lifecycle("c")
    assert lc is not None and lc.state == "LOADING" and side.loaded_boundary("c") == 0
    sched.update_from_output(out, model_output(out, _load_results(job, set()), {"c"}, set()))
    assert lc.state == "VERIFIED" and side.loaded_boundary("c") == 64
    out = sched.schedule()
    assert [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [("c", 64)]
    assert out.kv_connector_metadata.loads == []
    # Saves skip the loaded prefix: full-attention blocks from 64 on, Mamba hand-offs past 64.
    saved = sorted((b.group_index, b.key_boundary) for j in out.kv_connector_metadata.saves for b in j.blocks)
    assert saved and all(end > 64 for _, end in saved), saved
    trail = _trail(sink, "c")
    assert trail == [
        ("NEW", "LOOKUP"),
        ("LOOKUP", "PARTIAL_HIT"),
        ("PARTIAL_HIT", "LOADING"),
        ("LOADING", "TRUNCATED"),
        ("TRUNCATED", "LOOKUP"),
        ("LOOKUP", "PARTIAL_HIT"),
        ("PARTIAL_HIT", "LOADING"),
        ("LOADING", "VERIFIED"),
    ], trail
    truncated = next(rec for rec in sink.records if rec["request_id"] == "c" and rec["dst"] == "TRUNCATED")
    assert truncated["boundary"] == 64 and truncated["detail"]["retry_cap"] == 64


def test_a_failed_retry_is_the_last_one(vllm_objs: dict[str, Any]) -> None:
    sched, side, store, hashes, sink = _truncate_on_rank1(vllm_objs, "e", first=2500)
    out = sched.schedule()
    (job,) = out.kv_connector_metadata.loads
    assert job.boundary == 64
    # The retry's Mamba state at 64 fails on rank 1 too: truncated again, the state is removed.
    sched.update_from_output(out, model_output(out, _load_results(job, {(1, 1, 1)}), {"e"}, {"e"}))
    lc = side.lifecycle("e")
    assert lc.state == "TRUNCATED" and lc.max_boundary == 32 and side.stats.totals["truncations"] == 2
    assert side.wait_maintenance(10)
    assert not store.exists([side.scheme.key(1, 1, hashes[64 // HASH - 1])])[0].is_ok
    # Retries exhausted: REFUSED (no store call), the prompt recomputes from 0, and no loop.
    out = sched.schedule()
    assert out.kv_connector_metadata.loads == []
    assert [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [("e", 0)]
    assert lc.state == "REFUSED" and lc.num_retries == 1
    assert _trail(sink, "e")[-2:] == [("LOADING", "TRUNCATED"), ("TRUNCATED", "REFUSED")]


def test_saves_pin_blocks_until_every_rank_reports_and_events_follow_stores(
    vllm_objs: dict[str, Any],
) -> None:
    from hybridkv.connector.metadata import HybridStoreWorkerMetadata
    from hybridkv_dev.devkit.cluster import model_runner_output
    from vllm.distributed.kv_events import NullEventPublisher
    from vllm.v1.outputs import KVConnectorOutput

    class Recorder(NullEventPublisher):
        """vLLM's null publisher, keeping what the scheduler publishes."""

        def __init__(self) -> None:
            self.events: list[Any] = []

        def publish(self, events: Any) -> None:
            self.events.extend(events.events)

    sched = make_scheduler(vllm_objs["vc"])
    sched.kv_event_publisher = recorder = Recorder()
    side = sched.connector.scheduler_side
    pool = sched.kv_cache_manager.block_pool
    req = make_request("s", 100, first=300)  # a prompt no other test stored
    sched.add_request(req)
    out = sched.schedule()
    assert out.kv_connector_metadata.loads == []
    saves = out.kv_connector_metadata.saves
    assert len(saves) == 1
    blocks = saves[0].blocks
    full = sorted((b.index, b.key_boundary) for b in blocks if b.group_index == 0)
    mamba = sorted((b.index, b.key_boundary) for b in blocks if b.group_index == 1)
    assert full == [(0, 32), (1, 64), (2, 96)], full  # prompt blocks completed by this 96-token chunk
    # Mamba: only the exact hand-off vLLM gives (the state at the chunk end), in block cdiv(96, 32) - 1.
    assert mamba == [(2, 96)], mamba
    offloaded = next(b for b in blocks if b.group_index == 1)
    assert offloaded.block_id != 0
    table = sched.kv_cache_manager.get_block_ids("s")
    for b in blocks:
        if b.group_index == 0:
            assert table[0][b.index] == b.block_id
        assert pool.blocks[b.block_id].ref_cnt >= 2, "a save source block must be pinned"

    def report(ranks: tuple[int, ...]) -> None:
        res = [SaveResult(b.entry(r), SaveOutcome.OK) for r in ranks for b in blocks]
        wm = HybridStoreWorkerMetadata(
            saves={saves[0].job_id: res}, saves_done={saves[0].job_id: list(ranks)}
        )
        mro = model_runner_output(
            ["s"],
            sampled_token_ids=[[]],
            kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=wm),
        )
        sched.update_from_output(out, mro)

    refs_before = {b.block_id: pool.blocks[b.block_id].ref_cnt for b in blocks}
    report((0,))
    stored = [e for e in recorder.events if type(e).__name__ == "BlockStored"]
    assert stored == [] and side.has_pending_push_work()
    assert {b.block_id: pool.blocks[b.block_id].ref_cnt for b in blocks} == refs_before
    report((1,))
    events = [e for e in recorder.events if type(e).__name__ == "BlockStored"]
    assert all(e.medium == "STORAGE" for e in events)
    assert sorted((e.group_idx, e.block_size) for e in events) == sorted(
        (b.vllm_group_index, 32) for b in blocks
    )
    assert not side.has_pending_push_work()
    for b in blocks:
        assert pool.blocks[b.block_id].ref_cnt == refs_before[b.block_id] - 1, (
            "pins are released exactly once"
        )


def test_reset_cache_removes_only_this_namespace(vllm_objs: dict[str, Any]) -> None:
    sched = make_scheduler(vllm_objs["vc"])
    side = sched.connector.scheduler_side
    store = open_store(vllm_objs["store_url"])
    mine = side.scheme.key(0, 0, b"\x07" * 32)
    other = "hkv1/another-namespace/abc/g0/tp0/dcp0/07"
    assert all(s.is_ok for s in store.put([mine, other], [b"m", b"o"]))
    assert sched.connector.reset_cache() is True
    assert [s.is_ok for s in store.exists([mine, other])] == [False, True]


@pytest.mark.parametrize(
    ("role", "saves", "loads"), [("kv_producer", True, False), ("kv_consumer", False, True)]
)
def test_kv_role_limits_saves_and_loads(
    vllm_objs: dict[str, Any], role: str, saves: bool, loads: bool
) -> None:
    tc = vllm_objs["vc"].kv_transfer_config
    saved_role = tc.kv_role
    tc.kv_role = role
    try:
        sched = make_scheduler(vllm_objs["vc"])
    finally:
        tc.kv_role = saved_role
    side = sched.connector.scheduler_side
    assert (side.can_save, side.can_load) == (saves, loads)
    store = open_store(vllm_objs["store_url"])
    req = make_request(f"role-{role}", 100, first=1100 if saves else 1300)
    hashes = list(req.block_hashes)
    fill_store(side.scheme, store, hashes, [(0, 32), (0, 64), (0, 96), (1, 96)], (0, 1))
    sched.add_request(req)
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert bool(meta.loads) == loads
    # A producer finds nothing to load, computes the prompt and saves it; a consumer only loads.
    assert bool(meta.saves) == saves


def test_a_wave_no_rank_admitted_is_dropped_and_publishes_nothing(vllm_objs: dict[str, Any]) -> None:
    """Backpressure on every rank: the wave ends DROPPED, its pins are released, no BlockStored."""
    from hybridkv.connector.metadata import HybridStoreWorkerMetadata
    from hybridkv.lifecycle import State
    from hybridkv_dev.devkit.cluster import model_runner_output
    from vllm.v1.outputs import KVConnectorOutput

    sched = make_scheduler(vllm_objs["vc"])
    side = sched.connector.scheduler_side
    pool = sched.kv_cache_manager.block_pool
    req = make_request("d", 100, first=700)  # a prompt no other test stored
    sched.add_request(req)
    out = sched.schedule()
    (save,) = out.kv_connector_metadata.saves
    wave = side.saves.wave(save.job_id)
    assert wave is not None
    refs_before = {b.block_id: pool.blocks[b.block_id].ref_cnt for b in save.blocks}
    results = [SaveResult(b.entry(r), SaveOutcome.DROPPED) for r in (0, 1) for b in save.blocks]
    wm = HybridStoreWorkerMetadata(saves={save.job_id: results}, saves_done={save.job_id: [0, 1]})
    sched.update_from_output(
        out,
        model_runner_output(
            ["d"],
            sampled_token_ids=[[]],
            kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=wm),
        ),
    )
    assert wave.current is State.DROPPED, wave.current
    assert list(sched.connector.take_events()) == []
    assert not side.has_pending_push_work()
    for b in save.blocks:
        assert pool.blocks[b.block_id].ref_cnt == refs_before[b.block_id] - 1, (
            "pins are released exactly once"
        )
