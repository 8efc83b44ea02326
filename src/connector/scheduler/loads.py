"""A hit's load on the scheduler side: bound to the blocks vLLM allocated, then judged once every rank reported.

- ``after_alloc`` (``update_state_after_alloc``): the request's load plan on its real block table
  (``vllm_blocks.bind_plan``); a fit queues a load job and the lifecycle enters ``LOADING``; vLLM's
  allocation that does not fit (or an answer from before a reset) refuses the hit with an empty load job
  the workers report failed, so vLLM recomputes the request. Never an assert on vLLM's numbers.
- ``judge`` (every rank reported): ``VERIFIED`` (the loaded boundary, the session's retention renewed,
  per-group counts) or ``TRUNCATED`` (the saves restart, the definitely bad entries are invalidated).
- ``take_pending``: the load jobs queued since the last step, each sent once (``build_meta``).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import structlog
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.metadata import LoadJob
from hybridkv.connector.scheduler.request_state import RequestState
from hybridkv.connector.scheduler.sessions import SessionRetention
from hybridkv.connector.scheduler.store_upkeep import StoreUpkeep
from hybridkv.connector.scheduler.vllm_blocks import PrefixCacheGuard, bind_plan, external_block_ids
from hybridkv.connector.stats import PER_GROUP_LOADED_BLOCKS, StatsBox
from hybridkv.connector.vllm_geometry import ConnectorGeometry
from hybridkv.lifecycle.machine import LifecycleMachine
from hybridkv.lifecycle.table import State

if TYPE_CHECKING:
    from hybridkv.store.base import Store
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

__all__ = ["SchedulerLoads"]

log = structlog.get_logger(__name__)


class SchedulerLoads:
    """The load jobs of one scheduler half (scheduler thread only)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        geo: ConnectorGeometry,
        machine: LifecycleMachine,
        store: Store,
        *,
        prefix_cache: PrefixCacheGuard,
        sessions: SessionRetention,
        upkeep: StoreUpkeep,
        stats: StatsBox,
    ) -> None:
        self.cfg = cfg
        self.geo = geo
        self.machine = machine
        self.store = store
        self.prefix_cache = prefix_cache
        self.sessions = sessions
        self.upkeep = upkeep
        self.stats = stats
        #: load jobs queued since the last step (each is sent exactly once)
        self.pending: list[LoadJob] = []

    def take_pending(self) -> list[LoadJob]:
        """The load jobs queued since the last call (the next step's)."""
        jobs, self.pending = self.pending, []
        return jobs

    def after_alloc(
        self, request: Request, r: RequestState | None, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """``update_state_after_alloc`` for ``request`` (``r``: its state, None when not tracked).

        ``num_external_tokens == 0``: a planned hit vLLM did not take is declined (no load). Otherwise the
        plan must match vLLM's allocation exactly (token count, no plan block on the null block); then a
        load job is queued for the next ``build_meta`` and the lifecycle enters ``LOADING``. A mismatch
        never raises: the hit is declined with an empty load job the workers report failed, so vLLM
        recomputes the request.
        """
        if r is None or num_external_tokens == 0:
            if r is not None and r.lc.current is State.PARTIAL_HIT:
                r.lc.decline()
            elif r is None and num_external_tokens:
                self._decline_allocated(
                    request,
                    None,
                    "request not tracked",
                    self._external_block_ids(r, blocks, num_external_tokens),
                )
            return
        lc = r.lc
        refs, reason = bind_plan(self.geo, lc, blocks, num_external_tokens)
        if refs is None:
            assert reason is not None, f"request {request.request_id}: bind_plan refused without a reason"
            self._decline_allocated(
                request, r, reason, self._external_block_ids(r, blocks, num_external_tokens)
            )
            return
        assert lc.lookup is not None and lc.lookup.plan is not None  # bind_plan checked it
        boundary = lc.lookup.plan.boundary
        if not lc.start_load():  # the guard ``answer_current``: a reset since the lookup
            self._decline_allocated(
                request,
                r,
                "the hit was answered before a namespace reset",
                self._external_block_ids(r, blocks, num_external_tokens),
            )
            return
        job = LoadJob(request.request_id, boundary, refs)
        r.begin_load(job)
        self.pending.append(job)
        if self.cfg.layerwise:
            # No other request may take these blocks as a local hit before the load's verdict.
            self.prefix_cache.cache_after_verdict(
                request, set(refs.block_ids), lc.lookup.plan.num_computed_tokens // self.geo.groups[0].span
            )
        self.stats.add("hit_tokens", num_external_tokens)

    def _external_block_ids(
        self, r: RequestState | None, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> tuple[int, ...]:
        """Layer-wise mode: the block ids of a declined hit's external tokens (``external_block_ids``).
        Empty in async mode, where a declined hit fails request-level."""
        if not self.cfg.layerwise:
            return ()
        answered = r.answered if r is not None else None
        num_local = answered.inputs[1] if answered is not None else 0
        return external_block_ids(self.geo, blocks, num_local, num_external_tokens)

    def _decline_allocated(
        self, request: Request, r: RequestState | None, reason: str, declined_block_ids: tuple[int, ...] = ()
    ) -> None:
        """Refuse a hit vLLM already allocated. Async mode: vLLM waits for the load to finish, so an empty
        load job goes to the workers, which report it failed at once (``finished_recving`` +
        ``failed_recving``): vLLM restarts the request from 0 and recomputes it. Layer-wise mode: the empty
        job carries ``declined_block_ids``, which the workers report as load errors after the step, so
        vLLM discards the step for the request and recomputes those blocks. No later lookup of this
        incarnation hits."""
        self.pending.append(LoadJob(request.request_id, 0, (), declined_block_ids))
        self.prefix_cache.uncache(set(declined_block_ids))
        self.stats.add("hit_declined")
        log.warning(ConnectorLogEvent.HIT_DECLINED, request_id=request.request_id, reason=reason)
        if r is None:
            return
        r.load = None
        r.forget_ask()
        if r.lc.may_hit:
            r.lc.refuse(reason)

    def judge(self, r: RequestState) -> None:
        """Every rank reported ``r``'s load: the lifecycle's verdict (``finish_load``), and what follows."""
        outcomes = {res.entry: res.outcome for res in r.load_results}
        self.stats.add("load_calls")
        resolution = r.lc.finish_load(outcomes)
        job = r.end_load()
        if resolution.verified:
            r.saves.loaded_boundary = job.boundary
            if r.saves.session is not None:  # a hit renews the session's retention
                self.sessions.retain(
                    r.saves.session,
                    self.machine.scheme,
                    [(ref.group_index, ref.block_hash) for ref in job.blocks],
                )
            for group_index, num_blocks in Counter(ref.group_index for ref in job.blocks).items():
                self.stats.add(f"{PER_GROUP_LOADED_BLOCKS}{group_index}", num_blocks)
            return
        # vLLM discards what this load wrote and restarts the request from 0 computed tokens (layer-wise
        # mode: from its first loaded block, the local hit): nothing came from the store, and positional
        # saves restart at the request's next first scheduled position (the retry's loaded boundary, or
        # the local hit), so invalidated entries get re-saved.
        r.saves.restart()
        if self.cfg.layerwise:
            self.prefix_cache.uncache({ref.block_id for ref in job.blocks})
        self.stats.add("truncations")
        self.stats.add("load_transient_faults", resolution.num_transient_faults)
        if resolution.invalid_keys:
            hash_of = {(ref.group_index, ref.index, ref.key_boundary): ref.block_hash for ref in job.blocks}
            bad = {
                (e.group_index, hash_of[(e.group_index, e.block_index, e.key_boundary)])
                for e in resolution.invalid_entries
            }
            self.upkeep.invalidate(self.store, list(resolution.invalid_keys), sorted(bad))
        log.warning(
            ConnectorLogEvent.LOAD_FAILED,
            request_id=r.request.request_id,
            boundary=job.boundary,
            retry_cap=resolution.retry_cap,
            failed=len(resolution.failed_entries),
            transient=resolution.num_transient_faults,
            invalidated=len(resolution.invalid_keys),
        )
