"""Connector tests without an engine: real vLLM config objects and a simulated TP x DCP cluster.

Config builders: ``make_vllm_objs`` (a ``VllmConfig`` with TP = DCP = 2), ``kv_cache_config`` (a full +
Mamba cache layout), ``hybrid_config`` (one geometry of the scheduler matrix, sizes resolved by vLLM's own
code), ``make_request`` (a real ``vllm.v1.request.Request`` with vLLM's block hasher). ``Cluster`` steps vLLM's
real ``Scheduler`` with the connector's scheduler half and one worker half per TP rank over one store, and
checks every loaded slot against what a recompute writes. Needs vLLM and torch.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from hybridkv.demo import vllm_harness
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model

HASH = 32  # full attention: 16 per rank x dcp 2; Mamba: 32


def model_runner_output(req_ids: Sequence[str], **fields: Any) -> Any:
    """vLLM's ``ModelRunnerOutput`` for ``req_ids`` on any supported release: 0.32 and 0.33 also take
    ``req_id_to_index`` (the index of each request id), which 0.34 dropped (it reads ``req_ids`` only)."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=list(req_ids), **fields)


def make_vllm_objs() -> dict[str, Any]:
    """A ``VllmConfig`` with TP = DCP = 2 and the connector on a fresh ``memory://`` store."""
    # 1 KV head, 8 query heads: TP = DCP = 2 passes vLLM's validation.
    model = build_tiny_model("llama", DEFAULT_MODELS_DIR, num_key_value_heads=1, num_attention_heads=8)
    store_url = f"memory://dcp-{uuid.uuid4().hex[:8]}"
    vc = vllm_harness.connector_vllm_config(
        model,
        {"store": store_url, "lookup_budget_ms": 5000},
        block_size=16,
        num_blocks=64,
        tp=2,
        dcp=2,
        mamba_align=True,
    )
    return {"vc": vc, "store_url": store_url}


def two_group_cache_config(num_blocks: int, block_stride: int, *groups: tuple[str, Any]) -> Any:
    """A ``KVCacheConfig`` of one layer per group, ``(layer name, spec)``, sharing one tensor."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * block_stride,
                layers=[name for name, _ in groups],
                layer_stride=0,
                block_stride=block_stride,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec([name], spec) for name, spec in groups],
    )


def kv_cache_config(num_blocks: int = 64) -> Any:
    """Full attention (block 16) + Mamba align (block 32), hashed at 32 tokens."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=32, shapes=((2, 64),), dtypes=(torch.bfloat16,), mamba_cache_mode="align")
    cfg = two_group_cache_config(num_blocks, 2048, ("attn.0", full), ("mamba.0", mamba))
    cfg.hash_block_size = HASH
    cfg.cache_hit_alignment_tokens = HASH
    return cfg


# ---------------------------------------------------------------------------------------------------------
# A simulated cluster: vLLM's real ``Scheduler`` (with the connector's scheduler half) and one connector
# worker half per TP rank, over one shared store. The "forward" writes, per rank, a value into every
# rank-local KV slot (DCP slot mapping, interleave 1) and a Mamba state at every step end, each a function
# of the token prefix, the rank and the group; so a load can be checked slot by slot against what a
# recompute would have written.
# ---------------------------------------------------------------------------------------------------------

_MOD = 32749


def _prefix_values(tokens: list[int]) -> list[int]:
    out, h = [], 17
    for t in tokens:
        h = (h * 1000003 + t + 1) % 2147483647
        out.append(h)
    return out


def kv_value(prefix: list[int], p: int, rank: int, group_index: int) -> int:
    """What slot ``p`` of group ``group_index`` holds on ``rank`` after a forward (any request, same prefix)."""
    return (prefix[p] + 7919 * rank + 104729 * group_index) % _MOD + 1


def state_value(prefix: list[int], end: int, rank: int, group_index: int) -> int:
    """The Mamba state after ``end`` tokens on ``rank``."""
    return (prefix[end - 1] * 3 + 11 * rank + 13 * group_index) % _MOD + 1


def hybrid_config(
    kind: str, *, dcp: int, tp: int, num_blocks: int = 256, store: str | None = None
) -> tuple[Any, Any]:
    """(VllmConfig, scheduler KVCacheConfig) for one matrix geometry, sizes resolved by vLLM's own code.

    ``full_mamba``: full attention block 16 + Mamba align block 64 (fine-grained: hits at any 16).
    ``full_swa``: full attention block 16 + sliding window block 32, window 48 (hits at 32).
    ``mla_mamba``: MLA block 16 per rank (span 16 x dcp) + Mamba align block 16 (fine-grained at 16, so
    full-attention prompt tails inside a virtual block matter).
    ``mla_mamba96``: the same with Mamba block 96: sub-block Mamba tails (CoW / finish-time hand-offs)
    that also need a full-attention tail.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    model = build_tiny_model("llama", DEFAULT_MODELS_DIR, num_key_value_heads=1, num_attention_heads=8)
    url = store or f"memory://matrix-{uuid.uuid4().hex[:8]}"
    mamba_block = {"full_mamba": 64, "mla_mamba": 16, "mla_mamba96": 96}.get(kind)
    vc = vllm_harness.connector_vllm_config(
        model,
        {"store": url, "lookup_budget_ms": 5000, "namespace": "matrix"},
        # the scheduler splits prefills at Mamba block ends
        block_size=mamba_block or 16,
        num_blocks=num_blocks,
        tp=tp,
        dcp=dcp,
        mamba_align=mamba_block is not None,
    )
    if kind == "full_mamba":
        attn: Any = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
        other: Any = MambaSpec(
            block_size=64, shapes=((4,), (8,)), dtypes=(torch.int16, torch.int32), mamba_cache_mode="align"
        )
    elif kind == "full_swa":
        attn = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
        other = SlidingWindowSpec(
            block_size=32, num_kv_heads=1, head_size=8, dtype=torch.bfloat16, sliding_window=48
        )
    elif kind in ("mla_mamba", "mla_mamba96"):
        assert mamba_block is not None
        attn = MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16, cache_dtype_str="auto"
        )
        other = MambaSpec(
            block_size=mamba_block,
            shapes=((4,), (8,)),
            dtypes=(torch.int16, torch.int32),
            mamba_cache_mode="align",
        )
    else:
        raise AssertionError(kind)
    cfg = two_group_cache_config(num_blocks, 4096, ("attn.0", attn), ("other.0", other))
    vllm_harness.resolve_cache_block_sizes(cfg, vc)
    return vc, cfg


def make_request(
    rid: str, tokens: list[int], hash_unit: int, max_tokens: int = 4, *, hash_lookahead: int = 0
) -> Any:
    return vllm_harness.block_hashed_request(
        rid, tokens, hash_unit, max_tokens, hash_lookahead=hash_lookahead
    )


class RankFaults:
    """A worker rank's view of the shared store that fails ``get_into`` for chosen keys (one rank only)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fail_keys: set[str] = set()
        self.fail_all = False
        self.gate = threading.Event()  # cleared: loads wait (a load still in flight across steps)
        self.gate.set()

    def get_into(self, keys: Any, dests: Any) -> Any:
        from hybridkv.store.base import Status

        assert self.gate.wait(30), "gate never opened"
        statuses = self.inner.get_into(keys, dests)
        return [
            Status.TRANSFER_FAILED if (self.fail_all or k in self.fail_keys) else s
            for k, s in zip(keys, statuses, strict=True)
        ]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Cluster:
    """One real ``Scheduler`` plus ``tp`` worker halves, stepped together like an executor would."""

    def __init__(self, vc: Any, kv_cache_config: Any) -> None:
        from hybridkv.connector.config import ConnectorConfig
        from hybridkv.connector.connector import HybridStoreConnector
        from hybridkv.connector.worker.side import WorkerSide
        from hybridkv.lifecycle.sink import MemoryAuditSink
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vc)
        self.sched = Scheduler(
            vc, kv_cache_config, StructuredOutputManager(vc), block_size=sched_bs, hash_block_size=hash_bs
        )
        connector = self.sched.connector
        assert isinstance(connector, HybridStoreConnector), (
            f"scheduler connector is {type(connector).__name__}"
        )
        self.side = connector.scheduler_side
        self.audit = MemoryAuditSink()
        self.side.machine.sink = self.audit
        self.pool = self.sched.kv_cache_manager.block_pool
        self.hash_unit = hash_bs
        self.geo = self.side.geo
        par = vc.parallel_config
        self.tp, self.dcp = int(par.tensor_parallel_size), int(par.decode_context_parallel_size)
        cfg = ConnectorConfig.from_extra_config(
            vc.kv_transfer_config.kv_connector_extra_config, model=str(vc.model_config.model)
        )
        n = kv_cache_config.num_blocks
        self.workers: list[Any] = []
        self.caches: list[dict[str, Any]] = []
        self.faults: list[RankFaults] = []
        for rank in range(self.tp):
            ws = WorkerSide(vc, kv_cache_config, cfg)
            caches: dict[str, Any] = {}
            for g in self.geo.groups:
                spec = kv_cache_config.kv_cache_groups[g.vllm_group_index].kv_cache_spec
                name = g.layer_names[0]
                if g.kind.value == "mamba":
                    caches[name] = [
                        torch.zeros(n, 4, dtype=torch.int16),
                        torch.zeros(n, 8, dtype=torch.int32),
                    ]
                else:
                    caches[name] = torch.zeros(n, spec.block_size, dtype=torch.int32)
            ws.register_kv_caches(caches)
            ws.tp_rank, ws.dcp_rank = rank, rank % self.dcp
            fault = RankFaults(ws.store)
            ws.store = fault
            self.workers.append(ws)
            self.caches.append(caches)
            self.faults.append(fault)
        self._recv_counts: dict[str, int] = {}
        self._failed: set[str] = set()
        self.prefixes: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.loads_checked: dict[str, int] = {}
        self.steps = 0
        #: vLLM's re-prefillable tokens (``num_prefill_lookahead - 1``: a multi-module MTP drafter's), modelled
        #: under lookahead hashes: the last ones of every step are provisional until the next step rewrites
        #: them (vLLM caches only the others). 0: none, and in the legacy regime, where vLLM has the same rule
        #: but the connector's saves do not follow it yet (a known gap: draft KV only, so acceptance, never
        #: a token; see the 0.34 lookahead notes in docs/lifecycle.md).
        self.unfinal_tokens = 0
        if getattr(self.sched, "num_hash_lookahead_tokens", 0):
            self.unfinal_tokens = int(self.sched.kv_cache_manager.coordinator.num_reprefillable_tokens)

    # -- requests ---------------------------------------------------------------------------------------
    def add(self, rid: str, tokens: list[int], max_tokens: int = 4) -> Any:
        # The engine's hasher: with vLLM 0.34's lookahead hashes when its scheduler keeps them on.
        lookahead = int(getattr(self.sched, "num_hash_lookahead_tokens", 0))
        req = make_request(rid, tokens, self.hash_unit, max_tokens, hash_lookahead=lookahead)
        self.prefixes[rid] = _prefix_values(tokens + [900 + i for i in range(max_tokens + 1)])
        self.sched.add_request(req)
        return req

    # -- one engine step ----------------------------------------------------------------------------------
    def step(self, *, wait_loads: bool = True, before_load: Any = None) -> Any:
        """schedule -> every rank: loads, CoW copies, forward, saves -> aggregated output -> update.

        ``wait_loads=False``: only loads already finished are reported (gated loads stay in flight).
        ``before_load(out)``: runs after ``schedule()``, before any rank starts loading (fault injection).
        """
        from hybridkv.connector.metadata import HybridStoreMetadata, HybridStoreWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        self.steps += 1
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, HybridStoreMetadata), f"connector metadata is {type(meta).__name__}"
        if before_load is not None:
            before_load(out)
        expected_loads = {job.req_id for job in meta.loads} if wait_loads else set()
        tables = {rid: self.sched.kv_cache_manager.get_block_ids(rid) for rid in out.num_scheduled_tokens}
        starts = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
        cr = out.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            starts[rid] = cr.num_computed_tokens[i]
        wms = []
        finished: set[str] = set()
        for rank, ws in enumerate(self.workers):
            ws.start_load(meta)
            for copy in out.kv_cache_block_copies or ():
                for t in self._tensors(rank):
                    t[copy.dst_block_id] = t[copy.src_block_id]
            for rid, n in out.num_scheduled_tokens.items():
                self._forward(rank, rid, tables[rid], starts[rid], starts[rid] + n)
            ws.enqueue_saves(meta)
            assert ws.flush(), "saves never finished"
            done = self._wait_loads(ws, expected_loads, settle=not wait_loads)
            for rid, ok in done.items():
                self._recv_counts[rid] = self._recv_counts.get(rid, 0) + 1
                if not ok:
                    self._failed.add(rid)
            wm = ws.worker_meta()
            if wm is not None:
                wms.append(wm)
        # KVOutputAggregator: finished once every rank reported; failed kept until then.
        for rid, count in list(self._recv_counts.items()):
            if count == self.tp:
                finished.add(rid)
                del self._recv_counts[rid]
        failed = self._failed & finished
        self._failed -= failed
        for rid in finished - failed:
            self._check_loaded(rid)
        agg = None
        for wm in wms:
            agg = wm if agg is None else agg.aggregate(wm)
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            req_ids.append(rid)
            done_prefill = starts[rid] + n >= req.num_tokens
            tok = [900 + len(req.output_token_ids)] if done_prefill else []
            sampled.append(tok)
            if tok:
                self.outputs.setdefault(rid, []).append(tok[0])
        mro = model_runner_output(
            req_ids,
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=finished,
                failed_recving=failed,
                kv_connector_worker_meta=agg if agg is not None else HybridStoreWorkerMetadata(),
            ),
        )
        self.sched.update_from_output(out, mro)
        return out

    def run(self, max_steps: int = 200) -> None:
        """Step until every request finished and every save was reported (pins released)."""
        for _ in range(max_steps):
            if not self.sched.requests and not self.side.has_pending_push_work():
                return
            self.step()
        raise AssertionError(f"not drained after {max_steps} steps: {list(self.sched.requests)}")

    def _tensors(self, rank: int) -> list[Any]:
        out = []
        for t in self.caches[rank].values():
            out.extend(t if isinstance(t, list) else [t])
        return out

    def _forward(self, rank: int, rid: str, table: Any, start: int, end: int) -> None:
        prefix = self.prefixes[rid]
        for g in self.geo.groups:
            cache = self.caches[rank][g.layer_names[0]]
            ids = table[g.vllm_group_index]
            if g.kind.value == "mamba":
                idx = -(-end // g.span) - 1
                if idx < len(ids) and ids[idx]:
                    v = state_value(prefix, end, rank, g.group_index)
                    cache[0][ids[idx]] = v
                    cache[1][ids[idx]] = v
                continue
            shards = self.dcp if g.span != cache.shape[1] else 1
            # The drafter's re-prefilled tail: this step rewrites the previous step's last slots, and leaves
            # its own last ones provisional (a value no recompute writes) until the next step rewrites them.
            rewrite_from = max(0, start - self.unfinal_tokens)
            for p in range(rewrite_from, end):
                off = p % g.span
                if off % shards != rank % shards:
                    continue
                bid = ids[p // g.span] if p // g.span < len(ids) else 0
                if bid:
                    value = kv_value(prefix, p, rank, g.group_index)
                    cache[bid, off // shards] = -value if p >= end - self.unfinal_tokens else value

    def _wait_loads(
        self, ws: Any, expected: set[str], timeout: float = 10.0, *, settle: bool = False
    ) -> dict[str, bool]:
        import time

        got: dict[str, bool] = {}
        deadline = time.monotonic() + timeout
        while True:
            if settle:
                time.sleep(0.05)  # let ungated loads finish
            done, failed = ws.transfer_results()
            got.update({rid: rid not in failed for rid in done})
            if expected <= set(got):
                return got
            assert time.monotonic() < deadline, (
                f"rank {ws.tp_rank}: loads {expected - set(got)} never finished"
            )
            time.sleep(0.002)

    def _check_loaded(self, rid: str) -> None:
        """Every loaded slot / state equals what a recompute writes (checked when all ranks finished)."""
        req = self.sched.requests.get(rid)
        if req is None or req.is_finished():
            return  # aborted while loading
        boundary = req.num_computed_tokens
        table = self.sched.kv_cache_manager.get_block_ids(rid)
        prefix = self.prefixes[rid]
        for rank in range(self.tp):
            for g in self.geo.groups:
                self._check_group_loaded(rid, rank, g, table[g.vllm_group_index], boundary, prefix)
        self.loads_checked[rid] = boundary

    def _check_group_loaded(
        self, rid: str, rank: int, g: Any, ids: Sequence[int], boundary: int, prefix: list[int]
    ) -> None:
        """``_check_loaded`` for one group on one rank (``ids``: the request's blocks of the group); a cluster
        with other caches overrides this alone."""
        cache = self.caches[rank][g.layer_names[0]]
        if g.kind.value == "mamba":
            bid = ids[-(-boundary // g.span) - 1]
            want = state_value(prefix, boundary, rank, g.group_index)
            assert bool((cache[0][bid] == want).all() and (cache[1][bid] == want).all()), (
                f"{rid}: rank {rank} Mamba state at {boundary} not restored"
            )
            return
        shards = self.dcp if g.span != cache.shape[1] else 1
        first = 0
        if g.kind.value == "swa":  # only the window's blocks are restored (48 tokens)
            first = max(0, (boundary // g.span - max(1, -(-47 // g.span))) * g.span)
        for p in range(first, boundary):
            off = p % g.span
            if off % shards != rank % shards:
                continue
            bid = ids[p // g.span]
            assert bid, f"{rid}: group {g.vllm_group_index} position {p} has no block"
            got = int(cache[bid, off // shards])
            assert got == kv_value(prefix, p, rank, g.group_index), (
                f"{rid}: rank {rank} group {g.vllm_group_index} slot {p} = {got}, not the recomputed value"
            )

    # -- leak check -----------------------------------------------------------------------------------------
    def assert_empty(self) -> None:
        """vLLM's ``assert_scheduler_empty`` plus the connector's own state: nothing pinned, nothing live."""
        import json

        from hybridkv.audit.replay import replay_records

        s = self.sched
        assert not s.requests and not s.running and len(s.waiting) == 0, "requests left in the scheduler"
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
        mgr = s.kv_cache_manager
        for m in mgr.coordinator.single_type_managers:
            assert not m.req_to_blocks, f"blocks still held for {list(m.req_to_blocks)}"
        leaked = [b.block_id for b in self.pool.blocks if b.ref_cnt != 0 and not b.is_null]
        assert not leaked, f"blocks still referenced (pins leaked?): {leaked[:10]}"
        assert self.pool.get_num_free_blocks() == len(self.pool.blocks) - 1
        side = self.side
        assert side.is_idle(), f"connector holds jobs or live lifecycles: {side.tracked_request_ids()}"
        report = replay_records(json.dumps(r, default=str) for r in self.audit.records)
        assert report.ok, report.to_dict()["violations"]
        assert report.num_terminated == report.num_lifecycles, report.to_dict()

    def shutdown(self) -> None:
        for ws in self.workers:
            ws.shutdown()
