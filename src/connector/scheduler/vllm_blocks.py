"""What the scheduler half does with vLLM's blocks: bind a load plan to the blocks vLLM allocated, find a
declined hit's external blocks, and keep a layer-wise load's blocks out of vLLM's prefix cache.

Contract: nothing here changes a request's lifecycle; ``bind`` only answers whether vLLM's allocation
fits the plan (and why not), and the prefix-cache calls only touch vLLM's block pool and manager.
"""

from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING

from hybridkv.connector.metadata import PlannedRefs
from hybridkv.connector.vllm_geometry import ConnectorGeometry
from hybridkv.lifecycle.machine import RequestLifecycle
from hybridkv.lifecycle.table import State

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request


def bind_plan(
    geo: ConnectorGeometry, lc: RequestLifecycle, blocks: KVCacheBlocks, num_external_tokens: int
) -> tuple[PlannedRefs | None, str | None]:
    """The plan's blocks on the request's real block table, or why vLLM's allocation does not fit
    (the token count differs, or a planned block is the null block)."""
    if lc.current is not State.PARTIAL_HIT or lc.lookup is None or lc.lookup.plan is None:
        return None, f"{num_external_tokens} external tokens allocated in state {lc.state} without a plan"
    plan = lc.lookup.plan
    planned = plan.boundary - plan.num_computed_tokens
    if planned != num_external_tokens:
        return None, (
            f"vLLM allocated {num_external_tokens} external tokens, the plan has {planned} "
            f"(boundary {plan.boundary}, local {plan.num_computed_tokens})"
        )
    table = blocks.get_block_ids()
    block_ids: list[int] = []
    # One slice lookup per group (the plan keeps each group's block-table positions, computed on the
    # lookup thread): a 128K-token hit has thousands of planned blocks.
    for group_index, indexes in enumerate(plan.block_indexes_by_group):
        if not indexes:
            continue
        info = geo.groups[group_index]
        row = table[info.vllm_group_index] if info.vllm_group_index < len(table) else []
        if indexes[-1] < len(row):
            ids = itemgetter(*indexes)(row) if len(indexes) > 1 else (row[indexes[0]],)
            if 0 not in ids:
                block_ids.extend(ids)
                continue
        bad = next(i for i in indexes if i >= len(row) or row[i] == 0)
        return None, (
            f"group {info.vllm_group_index} ({info.kind.value}) block {bad} is not allocated "
            f"(null block) in the load plan for boundary {plan.boundary}"
        )
    return PlannedRefs(plan.loads, block_ids, geo.group_to_vllm_group), None


def external_block_ids(
    geo: ConnectorGeometry, blocks: KVCacheBlocks, num_local_tokens: int, num_external_tokens: int
) -> tuple[int, ...]:
    """The block ids vLLM allocated for a hit's external tokens in the first (layer-wise: the only) group,
    from ``num_local_tokens`` (the local hit the lookup was asked with; 0 when unknown: then the local
    blocks too, which only costs their recompute)."""
    span = geo.groups[0].span
    row = blocks.get_block_ids()[0]
    first, end = num_local_tokens // span, -(-(num_local_tokens + num_external_tokens) // span)
    return tuple(bid for bid in row[first:end] if bid != 0)


class PrefixCacheGuard:
    """Layer-wise mode: keeps blocks whose pages a load has not yet proven out of vLLM's prefix cache."""

    def __init__(self, geo: ConnectorGeometry) -> None:
        self._geo = geo
        self.block_pool: BlockPool | None = None  # vLLM's block pool (``bind_block_pool``)
        self.kv_cache_manager: KVCacheManager | None = None  # (``bind_kv_cache_manager``)

    def cache_after_verdict(self, request: Request, block_ids: set[int], first_block: int) -> None:
        """Keep a load's blocks out of vLLM's prefix cache until its verdict is in.

        vLLM caches a synchronous load's blocks when it allocates them (the external tokens count as
        computed), so a request scheduled later in the same step could take them as a local hit and, if the
        load then fails and its recompute spans steps, attend over pages not yet rewritten. Their hashes go
        now, and the request's cached-block count of the attention group goes back to ``first_block`` (its
        local hit): vLLM caches them again at the request's next allocation, which comes after the step's
        verdict (layer-wise needs async scheduling off) -- once verified, or as the recompute rewrites them.
        Where vLLM's manager does not have that count, the blocks simply stay uncached (correct, fewer local
        hits)."""
        managers = getattr(getattr(self.kv_cache_manager, "coordinator", None), "single_type_managers", ())
        vllm_group_index = self._geo.groups[0].vllm_group_index
        manager = managers[vllm_group_index] if vllm_group_index < len(managers) else None
        counts = getattr(manager, "num_cached_block", None)
        rows = getattr(manager, "req_to_blocks", None)
        rid = request.request_id
        if isinstance(counts, dict) and isinstance(rows, dict) and rid in counts and rid in rows:
            # Every block this allocation cached past the local hit (the loaded ones and those this step
            # computes), so that vLLM's next caching pass starts from the local hit with none still hashed.
            num_cached = counts[rid]
            block_ids = block_ids | {
                blk.block_id for blk in rows[rid][first_block:num_cached] if not blk.is_null
            }
            counts[rid] = min(num_cached, first_block)
        self.uncache(block_ids)

    def uncache(self, block_ids: set[int]) -> None:
        """Take blocks whose load failed (or was declined) out of vLLM's prefix cache.

        vLLM caches a synchronous load's blocks when it allocates them, and on a load error under
        ``recompute`` it keeps them cached for the request that recomputes them. Until then their pages
        hold whatever the failed load left, so no other request may find them: once their hashes are gone,
        later requests recompute or load those tokens instead. (The blocks stay the request's own.)"""
        if self.block_pool is not None and block_ids:
            self.block_pool.evict_blocks(block_ids)
