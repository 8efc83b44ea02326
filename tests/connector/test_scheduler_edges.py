"""The scheduler half at the edges, inside vLLM's real ``Scheduler`` (TP = DCP = 2, full attention + Mamba).

- Only definite faults (missing, corrupt) remove store entries; a timeout keeps a good entry loadable.
- No store call on the scheduler thread without a deadline: invalidation and reset with a hung store.
- A vLLM allocation that does not match the plan declines the hit (never an assert on the engine path).
- The KV event stream, replayed, equals the namespace's content in the store.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from hybridkv.connector.identity import MANIFEST_NAME
from hybridkv.connector.metadata import HybridStoreWorkerMetadata, LoadResult, SaveOutcome, SaveResult
from hybridkv.lifecycle import LoadOutcome
from hybridkv.lifecycle.sink import MemoryAuditSink
from hybridkv.store import open_store
from hybridkv_dev.devkit.cluster import HASH
from support.scheduler import both_lookup_modes, fill_store, make_request, make_scheduler, model_output

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

RANKS = (0, 1)


def _results(job: Any, outcome_of: dict[tuple[int, int, int], LoadOutcome]) -> HybridStoreWorkerMetadata:
    """Both ranks' per-block results for ``job``; (rank, group_index, index) -> outcome, else ``OK``."""
    return HybridStoreWorkerMetadata(
        loads={
            job.req_id: [
                LoadResult(b.entry(rank), outcome_of.get((rank, b.group_index, b.index), LoadOutcome.OK))
                for rank in RANKS
                for b in job.blocks
            ]
        }
    )


def _planned_load(objs: dict[str, Any], rid: str, first: int) -> tuple[Any, Any, Any, Any, list[str]]:
    """A fresh engine over a store with full attention at 32..128 and Mamba at 64 and 128 on both ranks;
    a 130-token prompt plans a load of 128."""
    sched = make_scheduler(objs["vc"])
    side = sched.connector.scheduler_side
    store = open_store(objs["store_url"])
    req = make_request(rid, 130, first=first)
    keys = fill_store(
        side.scheme,
        store,
        list(req.block_hashes),
        [(0, 32), (0, 64), (0, 96), (0, 128), (1, 64), (1, 128)],
        RANKS,
    )
    sched.add_request(req)
    out = sched.schedule()
    (job,) = out.kv_connector_metadata.loads
    assert job.boundary == 128
    return sched, side, store, out, keys


def _present(store: Any, keys: list[str]) -> set[str]:
    return {k for k, st in zip(keys, store.exists(keys), strict=True) if st.is_ok}


# ------------------------------------------------------------------------------------------------- item 4
@both_lookup_modes
def test_a_timeout_keeps_good_entries_and_the_next_request_loads_them(objs: dict[str, Any]) -> None:
    sched, side, store, out, keys = _planned_load(objs, "t1", first=3000)
    (job,) = out.kv_connector_metadata.loads
    # Rank 1 timed out on full-attention block 2 and never attempted the Mamba state at 128.
    wm = _results(job, {(1, 0, 2): LoadOutcome.TIMEOUT, (1, 1, 3): LoadOutcome.NOT_ATTEMPTED})
    sched.update_from_output(out, model_output(out, wm, {"t1"}, {"t1"}))
    lc = side.lifecycle("t1")
    assert lc.state == "TRUNCATED" and lc.max_boundary == 64  # this request may not use block 2
    assert side.wait_maintenance(10)
    assert _present(store, keys) == set(keys), "a timeout says nothing about the entry: nothing removed"
    assert side.stats.totals["load_transient_faults"] == 1
    assert side.stats.totals.get("invalidated_entries", 0) == 0

    # The next engine asking for the same prompt loads the whole 128 again.
    sched2 = make_scheduler(objs["vc"])
    sched2.add_request(make_request("t2", 130, first=3000))
    out2 = sched2.schedule()
    assert [(j.req_id, j.boundary) for j in out2.kv_connector_metadata.loads] == [("t2", 128)]


@both_lookup_modes
def test_a_corrupt_block_is_removed_on_every_rank_and_nothing_else(objs: dict[str, Any]) -> None:
    sched, side, store, out, keys = _planned_load(objs, "c1", first=3200)
    (job,) = out.kv_connector_metadata.loads
    hashes = list(sched.requests["c1"].block_hashes)
    sched.update_from_output(
        out, model_output(out, _results(job, {(1, 0, 2): LoadOutcome.CORRUPT}), {"c1"}, {"c1"})
    )
    assert side.wait_maintenance(10)
    bad = {side.scheme.key(0, r, hashes[96 // HASH - 1]) for r in RANKS}
    assert set(keys) - _present(store, keys) == bad
    assert side.stats.totals["invalidated_entries"] == 2
    assert side.stats.totals.get("load_transient_faults", 0) == 0


# ------------------------------------------------------------------------------------------------- item 3
@both_lookup_modes
def test_a_hung_store_never_stalls_the_scheduler(objs: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared

    sched, side, store, out, keys = _planned_load(objs, "h1", first=3400)
    (job,) = out.kv_connector_metadata.loads
    side.store = open_store(f"faulty+{objs['store_url']}?delay_ms=1500")  # every call now hangs 1.5 s
    side.reset_wait_s = 0.1
    t0 = time.monotonic()
    sched.update_from_output(
        out, model_output(out, _results(job, {(0, 0, 1): LoadOutcome.CORRUPT}), {"h1"}, {"h1"})
    )
    assert time.monotonic() - t0 < 0.5, "the invalidation removal must not run on the scheduler thread"
    t0 = time.monotonic()
    assert side.reset_cache() is True  # in effect: nothing from before it is served any more
    assert time.monotonic() - t0 < 0.5, "reset_cache must answer within its bound"
    assert side.stats.totals["reset_timeouts"] == 1
    # While the removal runs: lookups miss without a store call, and nothing is saved.
    sched.add_request(make_request("h2", 130, first=3400))
    t0 = time.monotonic()
    out = sched.schedule()
    assert time.monotonic() - t0 < 0.5
    assert side.lifecycle("h2").state == "MISS"
    assert out.kv_connector_metadata.loads == [] and out.kv_connector_metadata.saves == []
    assert side.wait_maintenance(10)
    assert _present(store, keys) == set() and not side.namespace_closed
    assert any(isinstance(e, AllBlocksCleared) for e in side.take_events())


# ------------------------------------------------------------------------------------------------- item 5
def _audited(objs: dict[str, Any]) -> tuple[Any, Any, Any, MemoryAuditSink, Any]:
    """A fresh engine whose lifecycle records go to a memory sink: (scheduler, connector, its scheduler
    side, the sink, the test's store)."""
    sched = make_scheduler(objs["vc"])
    conn = sched.connector
    side = conn.scheduler_side
    side.machine.sink = sink = MemoryAuditSink()
    return sched, conn, side, sink, open_store(objs["store_url"])


@both_lookup_modes
def test_an_allocation_that_does_not_match_the_plan_declines_the_hit(objs: dict[str, Any]) -> None:
    sched, conn, side, sink, store = _audited(objs)
    req = make_request("m1", 130, first=3600)
    fill_store(side.scheme, store, list(req.block_hashes), [(0, 32), (0, 64), (0, 96), (1, 96)], RANKS)
    lookup = side.lookup

    def trimmed(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        # A vLLM that trims the external tokens it takes (e.g. a replay window): 64 of the 96 found.
        ext, is_async = lookup(request, num_computed_tokens)
        return (ext - 32 if ext else ext), is_async

    conn.get_num_new_matched_tokens = trimmed  # type: ignore[method-assign]
    sched.add_request(req)
    out = sched.schedule()  # before: AssertionError inside vLLM's schedule()
    (job,) = out.kv_connector_metadata.loads
    assert (job.req_id, job.boundary, job.blocks) == ("m1", 0, ())  # nothing is written into vLLM's blocks
    assert "m1" not in out.num_scheduled_tokens  # vLLM waits for the (declined) load
    assert side.stats.totals["hit_declined"] == 1 and side.stats.totals.get("hit_tokens", 0) == 0
    declined = [r for r in sink.records if r["event"] == "hit_refused"]
    assert (
        len(declined) == 1
        and "allocated 64 external tokens, the plan has 96" in declined[0]["detail"]["reason"]
    )

    # Every worker reports the empty job failed at once; vLLM restarts the request from 0 and recomputes.
    from support.worker import make_worker, wait_loads

    ws, _, _ = make_worker({"vc": objs["vc"]}, objs["store_url"])
    try:
        ws.start_load(out.kv_connector_metadata)
        assert wait_loads(ws) == ({"m1"}, {"m1"})
    finally:
        ws.shutdown()
    sched.update_from_output(out, model_output(out, None, {"m1"}, {"m1"}))
    out = sched.schedule()
    assert [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [("m1", 0)]
    assert out.kv_connector_metadata.loads == []  # no second hit for this incarnation
    assert side.lifecycle("m1").state == "REFUSED"


@both_lookup_modes
def test_a_planned_block_on_the_null_block_declines_the_hit(objs: dict[str, Any]) -> None:
    sched, conn, side, sink, store = _audited(objs)
    req = make_request("n1", 130, first=3700)
    fill_store(
        side.scheme, store, list(req.block_hashes), [(0, 32), (0, 64), (0, 96), (0, 128), (1, 128)], RANKS
    )
    real_after_alloc = conn.update_state_after_alloc
    null_block = sched.kv_cache_manager.block_pool.null_block

    def with_null_block(request: Any, blocks: Any, num_external_tokens: int) -> None:
        # A vLLM whose allocation leaves a planned full-attention block on the null block.
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        groups = [list(group) for group in blocks.blocks]
        full = side.geo.groups[0].vllm_group_index
        groups[full][1] = null_block
        real_after_alloc(request, KVCacheBlocks(tuple(groups)), num_external_tokens)

    conn.update_state_after_alloc = with_null_block  # type: ignore[method-assign]
    sched.add_request(req)
    out = sched.schedule()
    (job,) = out.kv_connector_metadata.loads
    assert (job.req_id, job.boundary, tuple(job.blocks)) == ("n1", 0, ())
    declined = [r for r in sink.records if r["event"] == "hit_refused"]
    assert len(declined) == 1 and "block 1 is not allocated (null block)" in declined[0]["detail"]["reason"]


@both_lookup_modes
def test_a_bound_plan_names_the_allocated_blocks_and_pickles_compactly(objs: dict[str, Any]) -> None:
    import pickle

    sched, side, _, out, _ = _planned_load(objs, "b1", 3800)
    (job,) = out.kv_connector_metadata.loads
    table = sched.kv_cache_manager.get_blocks("b1").get_block_ids()
    assert len(job.blocks) > 0
    for ref in job.blocks:
        assert ref.vllm_group_index == side.geo.groups[ref.group_index].vllm_group_index
        assert ref.block_id == table[ref.vllm_group_index][ref.index] != 0, ref
    # The workers receive the plan's blocks and ids, not the expanded references.
    size_before = len(pickle.dumps(job))
    copy = pickle.loads(pickle.dumps(job))
    assert tuple(copy.blocks) == tuple(job.blocks)
    assert len(pickle.dumps(job)) == size_before, "the expanded references were pickled"


# ------------------------------------------------------------------------------------------------- item 6
class _Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def _replay(events: list[Any]) -> set[tuple[int, bytes]]:
    """Apply the connector's events to a set of (vLLM group, block hash)."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    blocks: set[tuple[int, bytes]] = set()
    for e in events:
        if isinstance(e, AllBlocksCleared):
            blocks.clear()
        elif isinstance(e, (BlockStored, BlockRemoved)) and e.medium == "STORAGE":
            for h in e.block_hashes:
                if isinstance(e, BlockStored):
                    blocks.add((e.group_idx, h))
                else:
                    blocks.discard((e.group_idx, h))
    return blocks


def _stored_blocks(side: Any, store: Any) -> set[tuple[int, bytes]]:
    """(vLLM group, block hash) of the namespace's entries present on every rank."""
    ranks: dict[tuple[int, bytes], set[int]] = {}
    for key in store.iter_keys(side.scheme.prefix):
        if key.endswith(MANIFEST_NAME):
            continue  # the deployment's manifest: not a block
        group, tp, _dcp, digest = key.removeprefix(side.scheme.geometry_prefix).split("/")
        group_index = int(group.removeprefix("g"))
        ranks.setdefault((side.geo.groups[group_index].vllm_group_index, bytes.fromhex(digest)), set()).add(
            int(tp[2:])
        )
    return {block for block, on in ranks.items() if on >= set(RANKS)}


@both_lookup_modes
def test_replayed_events_equal_the_store(objs: dict[str, Any]) -> None:
    from hybridkv_dev.devkit.cluster import model_runner_output
    from vllm.v1.outputs import KVConnectorOutput

    store = open_store(objs["store_url"])
    recorder = _Recorder()
    # Engine 1 computes and saves a prompt; "workers" write what the save jobs name, then report.
    sched = make_scheduler(objs["vc"])
    sched.kv_event_publisher = recorder
    side = sched.connector.scheduler_side
    sched.add_request(make_request("e1", 100, first=3800))
    out = sched.schedule()
    (save,) = out.kv_connector_metadata.saves
    scheme = out.kv_connector_metadata.scheme
    keys = [scheme.key(b.group_index, r, b.block_hash) for r in RANKS for b in save.blocks]
    assert all(st.is_ok for st in store.put(keys, [b"x"] * len(keys)))
    results = [SaveResult(b.entry(r), SaveOutcome.OK) for r in RANKS for b in save.blocks]
    wm = HybridStoreWorkerMetadata(saves={save.job_id: results}, saves_done={save.job_id: list(RANKS)})
    sched.update_from_output(
        out,
        model_runner_output(
            ["e1"],
            sampled_token_ids=[[]],
            kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=wm),
        ),
    )
    assert _replay(recorder.events) == _stored_blocks(side, store) != set()

    # Engine 2 loads it; rank 1 finds full-attention block 1 corrupt: invalidated, BlockRemoved.
    sched2 = make_scheduler(objs["vc"])
    sched2.kv_event_publisher = recorder
    side2 = sched2.connector.scheduler_side
    sched2.add_request(make_request("e2", 100, first=3800))
    out2 = sched2.schedule()
    (job,) = out2.kv_connector_metadata.loads
    sched2.update_from_output(
        out2, model_output(out2, _results(job, {(1, 0, 1): LoadOutcome.CORRUPT}), {"e2"}, {"e2"})
    )
    assert side2.wait_maintenance(10)
    recorder.events.extend(side2.take_events())
    assert _replay(recorder.events) == _stored_blocks(side2, store)

    # A namespace reset: AllBlocksCleared, and another namespace's entry is untouched.
    other = "hkv1/another-namespace/abc/g0/tp0/dcp0/07"
    assert store.put([other], [b"o"])[0].is_ok
    assert side2.reset_cache() is True
    recorder.events.extend(side2.take_events())
    assert _replay(recorder.events) == _stored_blocks(side2, store) == set()
    assert store.exists([other])[0].is_ok


@both_lookup_modes
def test_a_tail_save_event_covers_the_block_start_to_its_boundary(objs: dict[str, Any]) -> None:
    sched = make_scheduler(objs["vc"])
    side = sched.connector.scheduler_side
    req = make_request("tail", 100, first=4000)
    # A full-attention entry of block 2 ([64, 96)) stored under boundary 80 (a prompt tail).
    event = side.saves.stored_event(0, 80, b"\x05" * 32, req)
    assert event.token_ids == list(req.all_token_ids[64:80]) and event.block_size == 32
