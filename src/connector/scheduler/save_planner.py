"""The save path of the scheduler half: which blocks to save when, save jobs and their pins, and the
``BlockStored`` events of the waves every rank stored.

:class:`SavePlanner` is owned by :class:`~hybridkv.connector.scheduler.side.SchedulerSide`, which decides
*whether* a request may save now (role, namespace state) and hands the planner the step's inputs. The
planner decides *what* to save:

- full attention and SWA positionally, as prompt blocks complete (``step_job``);
- Mamba only from ``boundary_state_offloads`` (per step) and ``register_finished_partial_tail`` (at
  finish), at boundaries a later lookup can ask for and that did not come from this store;
- for every Mamba state at a boundary inside a full-attention block, that block's prompt tail under the
  same boundary, so a lookup can reach the state.

Each job's source blocks are pinned (``touch``) until every rank reported it, then freed exactly once.
A job every rank dropped is a dropped wave; otherwise the lifecycle's ``SaveWave`` judges the results
and the stored blocks are published through the owner (:class:`StoredPublisher`), which withholds them
when a namespace reset or an invalidation may have removed them since.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from hybridkv.connector.metadata import (
    HybridStoreWorkerMetadata,
    PlannedRefs,
    SaveJob,
    SaveOutcome,
    SaveResult,
)
from hybridkv.connector.scheduler.sessions import RequestSession
from hybridkv.connector.stats import StatsBox
from hybridkv.connector.vllm_geometry import ConnectorGeometry
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.kinds import KIND_RULES, cdiv
from hybridkv.lifecycle.machine import LifecycleMachine, SaveWave
from hybridkv.lifecycle.save import plan_save

if TYPE_CHECKING:
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import KVConnectorBlockState
    from vllm.v1.request import Request

#: (group_index, block index or key boundary, block id): one block to save, before it becomes a ``BlockRef``
SaveItem = tuple[int, int, int]


class StoredPublisher(Protocol):
    """Where the planner publishes the blocks of waves every rank stored (the scheduler half)."""

    @property
    def reset_epoch(self) -> int:
        """The number of namespace resets requested so far."""
        ...

    def publish_stored(
        self, epoch: int, stored: list[tuple[int, bytes, BlockStored]], session: RequestSession | None
    ) -> None:
        """Publish ``(group_index, block hash, BlockStored)`` for a wave created in reset epoch ``epoch`` by
        a request of ``session`` (None: none)."""
        ...


@dataclass
class RequestSaves:
    """One request's save progress (lives as long as the scheduler tracks the request)."""

    request: Request
    #: next block index to save, per store group (full / SWA); set on the first scheduled step
    saved_upto: dict[int, int] | None = None
    #: tokens restored from this store, so saves skip them
    loaded_boundary: int = 0
    #: (group_index, key boundary) of full-attention prompt tails already saved (forgotten by ``restart``)
    tails_saved: set[tuple[int, int]] = field(default_factory=set)
    #: EAGLE: (group_index, key boundary) of tails one margin past a saved state, not computed yet
    deferred_tails: set[tuple[int, int]] = field(default_factory=set)
    #: the request's session hint (``hybridkv.connector.scheduler.sessions``): what its waves store is retained
    session: RequestSession | None = None

    def restart(self) -> None:
        """A load failed: vLLM recomputes from 0 (layer-wise: from the local hit), so nothing came from the
        store, and what this request saved may be gone: the truncation removes the entries it found bad,
        prompt tails among them. Positional saves restart at the request's next first scheduled position,
        and the saved tails are forgotten, so that each is planned again when the recompute hands its Mamba
        state off again (a tail still stored costs one insert-if-absent put); kept, a removed tail would
        never be saved again and its state would stay unreachable. ``deferred_tails`` stays: those were
        never saved, so no truncation removed them, and each is still saved once the recompute reaches it,
        also one whose state is not handed off again (at or below the retry's loaded boundary)."""
        self.loaded_boundary = 0
        self.saved_upto = None
        self.tails_saved.clear()


@dataclass
class _Job:
    job: SaveJob
    wave: SaveWave
    pinned: list[KVCacheBlock]
    request: Request
    #: the namespace reset epoch the job was created in; a reset since then may have removed its entries
    epoch: int
    #: the request's session (its stored entries are retained), or None
    session: RequestSession | None
    ranks_done: set[int] = field(default_factory=set)
    results: list[SaveResult] = field(default_factory=list)


class BlockTables(Protocol):
    """Where positional saves read a request's block table: vLLM's ``KVConnectorBlockState`` of a step, or
    a finished request's table (``_FinishedTable``)."""

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        """The request's block ids by vLLM group, or None when it has none here."""
        ...


@dataclass(frozen=True)
class _FinishedTable:
    """A finished request's block table (as vLLM hands it to ``request_finished``) as ``BlockTables``."""

    request_id: str
    block_ids: tuple[list[int], ...]

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        return self.block_ids if req_id == self.request_id else None


class SavePlanner:
    """Save jobs of one engine core; driven from the scheduler thread only."""

    def __init__(
        self,
        geo: ConnectorGeometry,
        machine: LifecycleMachine,
        stats: StatsBox,
        publisher: StoredPublisher,
        ranks: frozenset[int],
    ) -> None:
        self.geo = geo
        self.machine = machine
        self.stats = stats
        self._publisher = publisher
        self._all_ranks = ranks
        self._by_vllm_group = {g.vllm_group_index: g for g in geo.groups}
        self._jobs: dict[int, _Job] = {}
        #: jobs created between steps (finish-time tails), sent with the next step's metadata
        self._unsent: list[SaveJob] = []
        self._next_job = 1
        self._pool: BlockPool | None = None

    def bind_block_pool(self, pool: BlockPool) -> None:
        """vLLM's block pool: source blocks are pinned through it while their job is in flight."""
        self._pool = pool

    # ------------------------------------------------------------------ planning
    def step_job(
        self,
        saves: RequestSaves,
        num_done_tokens: int,
        block_state: KVConnectorBlockState,
        state_offloads: list[tuple[int, int, int]],
        loading_boundary: int,
    ) -> SaveJob | None:
        """The save job for one request's scheduled step, or None when it completes nothing to save.

        ``num_done_tokens``: the request's computed tokens at the end of this step. ``block_state``:
        the step's ``kv_connector_block_state`` (the request's block table). ``state_offloads``: its
        ``boundary_state_offloads`` (vllm_group_index, block id, boundary). ``loading_boundary``: the boundary of the
        load in flight for the request (0: none); boundaries up to it come from this store.
        """
        # Under lookahead hashes the last L - 1 computed tokens are re-prefilled by the next chunk: their
        # KV is not final yet (0 otherwise).
        num_final_tokens = self.scheme.geometry.num_final_tokens(num_done_tokens)
        items = self._positional_saves(saves, num_final_tokens, block_state)
        if saves.deferred_tails:
            items += self._due_tails(
                saves, num_final_tokens, block_state.get_block_ids(saves.request.request_id)
            )
        states = self._boundary_saves(saves, state_offloads, loading_boundary)
        if states:
            items += states + self._tail_saves(
                saves, states, block_state.get_block_ids(saves.request.request_id), num_final_tokens
            )
        return self._new_job(saves, items) if items else None

    def finished_lookahead_save(
        self, saves: RequestSaves, block_ids: tuple[list[int], ...], num_final_tokens: int
    ) -> None:
        """Under lookahead hashes, at request finish: the prompt blocks (and deferred tails) that became
        savable after the request's last step -- their block hashes needed tokens the last step sampled --
        as a job sent with the next step's metadata (its blocks pinned now, before vLLM frees them).

        ``block_ids``: the request's block table, by vLLM group. ``num_final_tokens``: tokens whose KV the
        workers have written and will not rewrite (computed, not in flight). Nothing for a request never
        scheduled (no position saved yet) or without lookahead hashes."""
        if not self.scheme.geometry.hash_lookahead or saves.saved_upto is None:
            return
        table = _FinishedTable(saves.request.request_id, block_ids)
        items = self._positional_saves(saves, num_final_tokens, table)
        if saves.deferred_tails:
            items += self._due_tails(saves, num_final_tokens, block_ids)
        if items:
            self._unsent.append(self._new_job(saves, items))

    def finished_partial_tail(
        self,
        saves: RequestSaves,
        tails: list[tuple[int, int, int]],
        block_ids: tuple[list[int], ...] | None,
        loading_boundary: int,
    ) -> None:
        """A finish-time Mamba tail hand-off (and, from ``block_ids``, the full-attention tail it needs):
        a job sent with the next step's metadata."""
        items = self._boundary_saves(saves, tails, loading_boundary)
        if items:
            num_final_tokens = self.scheme.geometry.num_final_tokens(saves.request.num_computed_tokens)
            items += self._tail_saves(saves, items, block_ids, num_final_tokens)
            self._unsent.append(self._new_job(saves, items))

    def take_unsent(self) -> list[SaveJob]:
        """Jobs created since the last step, for this step's metadata."""
        jobs, self._unsent = self._unsent, []
        return jobs

    def drop_unsent(self, reason: str) -> None:
        """Drop the jobs not sent yet (a namespace reset: their KV predates it, and sent after it they
        would be written under the new keys): their waves are ``DROPPED``, their pins freed."""
        for job in self.take_unsent():
            j = self._jobs.pop(job.job_id, None)
            if j is None:
                continue
            if self._pool is not None and j.pinned:
                self._pool.free_blocks(list(reversed(j.pinned)))
            j.wave.drop(reason)

    @property
    def scheme(self) -> KeyScheme:
        """The engine's key scheme now (the lifecycle machine's: a reset rotates its weights tag there)."""
        return self.machine.scheme

    def _saveable_tokens(self, request: Request) -> int:
        """The prompt positions a save may key: prompt tokens the block hashes cover."""
        return min(request.num_prompt_tokens, len(request.block_hashes) * self.scheme.geometry.hash_unit)

    def _positional_saves(self, saves: RequestSaves, done: int, bs: BlockTables) -> list[SaveItem]:
        """(group_index, block index, block id) of full/SWA prompt blocks completed by the end of this step."""
        req = saves.request
        upto = min(done, self._saveable_tokens(req))
        if saves.saved_upto is None:
            # Blocks before the first scheduled position came from the device cache or from this store.
            first = max(req.num_computed_tokens, saves.loaded_boundary)
            saves.saved_upto = {g.group_index: first // g.span for g in self.geo.groups}
        table = None
        out: list[SaveItem] = []
        for g in self.geo.groups:
            if not KIND_RULES[g.kind].positional_saves:
                continue
            start, stop = saves.saved_upto[g.group_index], upto // g.span
            if stop <= start:
                continue
            if table is None:
                table = bs.get_block_ids(req.request_id)
                if table is None:
                    return out
            for idx in range(start, stop):
                bid = table[g.vllm_group_index][idx] if idx < len(table[g.vllm_group_index]) else 0
                if bid != 0:  # SWA: 0 = already slid out of the window and freed
                    out.append((g.group_index, (idx + 1) * g.span, bid))
            saves.saved_upto[g.group_index] = stop
        return out

    def _boundary_saves(
        self, saves: RequestSaves, offloads: list[tuple[int, int, int]], loading_boundary: int
    ) -> list[SaveItem]:
        """(group_index, boundary, block id) of the Mamba hand-offs a later lookup can ask for."""
        req = saves.request
        geometry = self.scheme.geometry
        limit = self._saveable_tokens(req)
        out = []
        for vllm_group_index, bid, boundary in offloads:
            g = self._by_vllm_group.get(vllm_group_index)
            if g is None or KIND_RULES[g.kind].positional_saves or bid == 0:
                continue
            if boundary % geometry.hit_alignment or boundary > limit:
                continue  # no lookup can ask for it
            if boundary <= max(saves.loaded_boundary, loading_boundary):
                continue  # came from this store
            out.append((g.group_index, boundary, bid))
        return out

    def _tail_saves(
        self,
        saves: RequestSaves,
        states: list[SaveItem],
        table: tuple[list[int], ...] | None,
        num_done_tokens: int,
    ) -> list[SaveItem]:
        """(group_index, boundary, block id) of the full-attention prompt tails the saved Mamba states need.

        A Mamba state at a boundary ``b`` inside a full-attention block (fine-grained geometries: Mamba
        block > hash unit, or full attention widened by DCP) is only reachable if that block is stored
        under ``b``'s hash too: a lookup probes the interior hash boundaries of the first missing block
        (vLLM's ``FullAttentionManager`` caches the same partial tail locally). Whole blocks before it
        are positional saves. The block may hold tokens past ``b`` (decode, or a later chunk): a loader
        recomputes from ``b`` and overwrites them.

        Under lookahead hashes a tail whose last positions are not final yet (``num_done_tokens``: the final
        tokens, vLLM re-prefills the last L - 1 of a chunk) is deferred like the EAGLE tails below.

        With EAGLE (``Geometry.group_drops``) a lookup verifies an attention group one EAGLE margin past the
        boundary it reports (``eagle_margin``), so the tail under ``b + margin`` is stored too, when the
        request has computed that far (``num_done_tokens``; else in the first later step that has:
        ``deferred_tails``) and it is a prompt position.
        """
        if table is None:
            return []
        geometry = self.scheme.geometry
        limit = self._saveable_tokens(saves.request)
        out: list[SaveItem] = []
        for _, state_boundary, _ in states:
            for g in self.geo.groups:
                rules = KIND_RULES[g.kind]
                if not rules.stores_partial_tails:
                    continue
                boundaries = [state_boundary]
                if geometry.hash_lookahead and state_boundary > num_done_tokens:
                    # Lookahead hashes: the tail's last positions are still re-prefilled (KV not final);
                    # saved once final.
                    boundaries = []
                    if state_boundary % g.span:
                        saves.deferred_tails.add((g.group_index, state_boundary))
                if geometry.group_drops(g.group_index):
                    past = state_boundary + rules.eagle_margin(geometry, (g.group_index,))
                    if past <= min(limit, num_done_tokens):
                        boundaries.append(past)
                    elif past <= limit and past % g.span:
                        saves.deferred_tails.add((g.group_index, past))
                out.extend(
                    item
                    for boundary in boundaries
                    if boundary % g.span and (item := self._tail_item(saves, g.group_index, boundary, table))
                )
        return out

    def _tail_item(
        self, saves: RequestSaves, group_index: int, boundary: int, table: tuple[list[int], ...]
    ) -> SaveItem | None:
        """The save of ``group_index``'s prompt tail under ``boundary`` (recorded as saved), or None when it
        was saved already or its block is not in the table."""
        if (group_index, boundary) in saves.tails_saved:
            return None
        g = self.geo.groups[group_index]
        blocks = table[g.vllm_group_index]
        idx = boundary // g.span
        bid = blocks[idx] if idx < len(blocks) else 0
        if bid == 0:
            return None
        saves.tails_saved.add((group_index, boundary))
        return (group_index, boundary, bid)

    def _due_tails(
        self, saves: RequestSaves, num_done_tokens: int, table: tuple[list[int], ...] | None
    ) -> list[SaveItem]:
        """The deferred EAGLE tails (``_tail_saves``) the request has now computed."""
        due = sorted(t for t in saves.deferred_tails if t[1] <= num_done_tokens)
        if not due or table is None:
            return []
        saves.deferred_tails.difference_update(due)
        return [item for g, b in due if (item := self._tail_item(saves, g, b, table))]

    def _new_job(self, saves: RequestSaves, items: list[SaveItem]) -> SaveJob:
        """A save job for ``items``: its lifecycle wave started, its source blocks pinned."""
        request = saves.request
        by_group: dict[int, list[int]] = {}
        for group_index, boundary, _ in items:
            by_group.setdefault(group_index, []).append(boundary)
        plan = plan_save(self.scheme, list(request.block_hashes), by_group)
        bid_of = {(group_index, boundary): bid for group_index, boundary, bid in items}
        block_ids = [bid_of[(b.group_index, b.key_boundary)] for b in plan.blocks]
        job = SaveJob(
            self._next_job,
            request.request_id,
            PlannedRefs(plan.blocks, block_ids, self.geo.group_to_vllm_group),
        )
        self._next_job += 1
        wave = self.machine.new_save_wave(request.request_id, job.job_id, plan)
        pinned: list[KVCacheBlock] = []
        if self._pool is not None:
            # One pin per physical block (a DCP-sharded block is several planned entries).
            pinned = [self._pool.blocks[bid] for bid in dict.fromkeys(block_ids)]
            self._pool.touch(pinned)
        self._jobs[job.job_id] = _Job(job, wave, pinned, request, self._publisher.reset_epoch, saves.session)
        wave.start_put()
        return job

    # ------------------------------------------------------------------ results
    def on_results(self, wm: HybridStoreWorkerMetadata) -> None:
        """Record the ranks' save results; a job every rank finished is finished: its pins are freed and
        its wave judged (dropped, stored and published, or failed). Unknown job ids are ignored (a job
        released at shutdown)."""
        for job_id, save_results in wm.saves.items():
            if (j := self._jobs.get(job_id)) is not None:
                j.results.extend(save_results)
        for job_id, done_ranks in wm.saves_done.items():
            if (j := self._jobs.get(job_id)) is not None:
                j.ranks_done.update(done_ranks)
                if j.ranks_done >= self._all_ranks:
                    self._finish_job(j)

    def _finish_job(self, j: _Job) -> None:
        del self._jobs[j.job.job_id]
        if self._pool is not None and j.pinned:
            self._pool.free_blocks(list(reversed(j.pinned)))
        if j.results and all(res.outcome is SaveOutcome.DROPPED for res in j.results):
            # Backpressure on every rank: nothing was written, so nothing can be published.
            j.wave.drop("backpressure")
            return
        outcomes = {res.entry: res.outcome is SaveOutcome.OK for res in j.results}
        failed = [res.outcome.value for res in j.results if res.outcome is not SaveOutcome.OK]
        stored = j.wave.finish_put(outcomes, failed)
        self._publisher.publish_stored(
            j.epoch,
            [
                (
                    block.group_index,
                    block.block_hash,
                    self.stored_event(block.group_index, block.key_boundary, block.block_hash, j.request),
                )
                for block in stored
            ],
            j.session,
        )

    def stored_event(self, group_index: int, end: int, block_hash: bytes, request: Request) -> BlockStored:
        """vLLM's ``BlockStored`` for the entry of group ``group_index`` stored under key boundary ``end``."""
        from vllm.distributed.kv_events import BlockStored

        g = self.geo.groups[group_index]
        # The block's tokens up to the key boundary: [block start, end) (a prompt tail or Mamba state at
        # a boundary inside a block covers less than a span).
        start = (cdiv(end, g.span) - 1) * g.span
        tokens = list(request.all_token_ids[start:end])
        lookahead = self.scheme.geometry.hash_lookahead
        # vLLM 0.34 under lookahead hashes: the tokens past the block its hash covers, as its own events
        # carry them (the field exists only there, and L > 0 only there).
        extra: dict[str, Any] = {}
        if lookahead:
            extra["lookahead_token_ids"] = [list(request.all_token_ids[end : end + lookahead])]
        return BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=None,
            token_ids=tokens,
            block_size=g.span,
            lora_id=None,
            medium="STORAGE",
            lora_name=None,
            group_idx=g.vllm_group_index,
            **extra,
        )

    # ------------------------------------------------------------------ inspection and lifetime
    def has_work(self) -> bool:
        """Whether a job is unsent or not yet finished by every rank (its pins are held)."""
        return bool(self._jobs) or bool(self._unsent)

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks pinned by the jobs not yet finished by every rank (unsent ones included)."""
        return sum(len(j.pinned) for j in self._jobs.values())

    def wave(self, job_id: int) -> SaveWave | None:
        """The lifecycle wave of an unfinished job (inspection)."""
        j = self._jobs.get(job_id)
        return j.wave if j is not None else None

    def release_all(self) -> None:
        """Shutdown: free every pin; later results for these jobs are ignored."""
        if self._pool is not None:
            for j in self._jobs.values():
                self._pool.free_blocks(list(reversed(j.pinned)))
        self._jobs.clear()
