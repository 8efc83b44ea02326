"""One request's state on the scheduler side: its lifecycle and what the connector holds for it.

The lifecycle (``RequestLifecycle``) is the request's state; every other field belongs to exactly one of
its states and is cleared when the lifecycle leaves it:

==========================  =====================================================================
field                       meaningful while the lifecycle is
==========================  =====================================================================
``task``                    ``NEW`` (the prefetch) or ``LOOKUP`` (the store round in flight on the
                            lookup worker)
``ask``                     :class:`Searching` in ``LOOKUP`` (the ask a search answers; vLLM was told
                            to ask again); :class:`Answered` in ``PARTIAL_HIT`` / ``MISS`` (the answer
                            repeated asks reuse, of the current reset epoch only); else None
``load``, ``load_results``, ``load_ranks``        ``LOADING`` (waiting for every rank's report)
``known``, ``block_hex``,   any live state: existence facts of this incarnation's searches, of the
``facts_epoch``             current reset epoch only (a reset drops them: ``forget_facts``; the epoch
                            counts the drops, for a lookup process that keeps the facts itself)
==========================  =====================================================================

Nothing here changes the lifecycle's state except through its methods (the table's triggers). The ask
sub-state's types (``Searching``, ``Answered``) are the lifecycle's (``hybridkv.lifecycle.ask``), which
decides each ask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridkv.connector.metadata import LoadJob, LoadResult
from hybridkv.connector.scheduler.lookup_service import LookupTask
from hybridkv.connector.scheduler.save_planner import RequestSaves
from hybridkv.lifecycle.ask import Answered, Ask, LookupInputs, Searching
from hybridkv.lifecycle.machine import RequestLifecycle
from hybridkv.lifecycle.table import State

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["Answered", "LookupInputs", "RequestState", "Searching"]


@dataclass
class RequestState:
    request: Request
    lc: RequestLifecycle
    saves: RequestSaves
    #: where vLLM's current ask stands: searching, answered, or none (asks repeat while vLLM waits)
    ask: Ask = None
    #: existence facts (key -> present) gathered by this incarnation's searches
    known: dict[str, bool] = field(default_factory=dict)
    #: bumped each time ``known`` is dropped (``drop_facts``): a lookup process keeps the facts of the
    #: current epoch only
    facts_epoch: int = 0
    #: the store round in flight on the lookup worker (the prefetch, or the search of ``ask``)
    task: LookupTask | None = None
    #: the request's block hashes in hex (key suffixes), shared by its searches
    block_hex: list[str] | None = None
    load: LoadJob | None = None
    load_results: list[LoadResult] = field(default_factory=list)
    load_ranks: set[int] = field(default_factory=set)

    @property
    def searching(self) -> Searching | None:
        """The ask in flight, if any."""
        return self.ask if isinstance(self.ask, Searching) else None

    @property
    def answered(self) -> Answered | None:
        """The answered ask, if any."""
        return self.ask if isinstance(self.ask, Answered) else None

    @property
    def loading_boundary(self) -> int:
        """The boundary of the load in flight (0: none)."""
        return self.load.boundary if self.load is not None else 0

    def abandon_search(self) -> None:
        """Stop the search in flight (a queued one never runs; a running one's answer is ignored); an
        answer stays. The facts stay, but not shared with a task still running: it writes its answers into
        the old dict from the lookup thread, and a search on the scheduler thread must not see facts change
        under it."""
        if self.task is not None:
            self.task.cancelled = True
            self.known = dict(self.known)  # whether or not it has finished: a copy costs little
        self.task = None
        if isinstance(self.ask, Searching):
            self.ask = None

    def forget_ask(self) -> None:
        """No ask at all: the search in flight stops (``abandon_search``) and the answer is dropped."""
        self.abandon_search()
        self.ask = None

    def drop_facts(self) -> None:
        """Start over with no existence facts (a new dict: an abandoned task may still write to the old
        one), in a new epoch (a lookup process drops its copy of the old ones)."""
        self.known = {}
        self.facts_epoch += 1

    def forget_facts(self, reason: str) -> None:
        """Drop everything the request learnt about the store (a namespace reset): its search in flight,
        its existence facts, its memo; a hit answered from them is revoked (``hit_revoked``) and a lookup
        in flight ends as a miss, so nothing from before the reset is ever loaded after it."""
        self.forget_ask()
        self.drop_facts()
        if self.lc.current is State.PARTIAL_HIT:
            self.lc.revoke(reason)
        elif self.lc.current is State.LOOKUP:
            self.lc.lookup_unavailable(reason)

    def begin_load(self, job: LoadJob) -> None:
        """The lifecycle entered ``LOADING`` for ``job``: collect every rank's results from now on."""
        self.load, self.load_results, self.load_ranks = job, [], set()

    def collect(self, results: list[LoadResult], all_ranks: frozenset[int]) -> bool:
        """Take one step's load results; True once every rank of ``all_ranks`` reported."""
        assert self.load is not None, f"request {self.request.request_id}: load results without a load"
        self.load_results.extend(results)
        self.load_ranks.update(res.entry.tp_rank for res in results)
        return self.load_ranks >= all_ranks

    def end_load(self) -> LoadJob:
        """The load was judged (or abandoned): nothing more is collected for it."""
        job = self.load
        assert job is not None, f"request {self.request.request_id}: end_load without a load"
        self.load = None
        if isinstance(self.ask, Answered):
            self.ask = None
        return job
