"""``get_num_new_matched_tokens`` for one request: answers from the lifecycle, never waiting on the store.

The search runs on the lookup thread (:class:`~hybridkv.connector.scheduler.lookup_service.LookupService`) or
process; what an ask gets, and the lifecycle's transitions, are decided in the lifecycle
(:func:`hybridkv.lifecycle.ask.decide_ask`, with the rules), from the request's ask sub-state, the store
round in flight and what this half knows of its store now. This module gathers those, acts on the decision
(drops the round it read, submits a store round, abandons it and the facts on a miss, logs and counts) and
sets the limits:

- the wait is bounded: past ``lookup_budget_ms`` of store time, a store call hung past it, or
  ``_MAX_WAIT_BUDGETS`` budgets (at least ``_MIN_WAIT_S``) of wall time since the first ask, the lookup
  is a miss ("over lookup budget");
- a hit vLLM leaves unallocated for ``MAX_UNALLOCATED_ASKS`` asks is refused;
- a preempted request (``VERIFIED``) or one whose load vLLM abandoned (``LOADING``) starts a new
  incarnation here; a reset has already dropped the answers (``RequestState.forget_facts``, at the reset).
"""

from __future__ import annotations

import functools
import time

import structlog
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.scheduler.lookup_service import LookupRunner, LookupTask
from hybridkv.connector.scheduler.namespace_gate import NamespaceGate
from hybridkv.connector.scheduler.request_state import RequestState
from hybridkv.connector.stats import StatsBox
from hybridkv.lifecycle.ask import AskDecision, AskLimits, OverBudget, StoreFailed, StoreView, decide_ask
from hybridkv.lifecycle.lookup import LookupSearch
from hybridkv.lifecycle.machine import LifecycleMachine
from hybridkv.lifecycle.table import State
from hybridkv.store.breaker import BreakerState, CircuitBreaker

__all__ = ["LookupAnswers"]

log = structlog.get_logger(__name__)

#: A lookup is a miss once the store took ``lookup_budget_ms`` to answer its rounds, or a call of the
#: store is hung past it; the search's own CPU work and its queueing behind other searches (a busy host)
#: count only against this many budgets of wall time since the request's first ask, and never less than
#: ``_MIN_WAIT_S``: a lookup queued behind a busy host's own CPU work is not the store's fault, and waiting
#: costs only this request (other requests are scheduled meanwhile).
_MAX_WAIT_BUDGETS = 20
_MIN_WAIT_S = 5.0
#: Asks of one answered hit that vLLM may leave unallocated before the connector refuses it (``REFUSED``:
#: the request then computes its prefix). vLLM asks a waiting request again every step; a hit it cannot
#: allocate for that long may never fit: vLLM 0.32 keeps a request whose async load failed among its
#: in-flight prefills, so the retry's load must fit beside that request's own phantom reservation, which a
#: small KV cache never frees. Under load a hit waits tens of steps at most before it fits.
MAX_UNALLOCATED_ASKS = 256


class LookupAnswers:
    """Answers vLLM's asks for every request of one scheduler half (scheduler thread only)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        machine: LifecycleMachine,
        lookups: LookupRunner,
        breaker: CircuitBreaker,
        gate: NamespaceGate,
        stats: StatsBox,
    ) -> None:
        self.cfg = cfg
        self.machine = machine
        self.lookups = lookups
        self.breaker = breaker
        self.gate = gate
        self.stats = stats
        budget_s = cfg.lookup_budget_ms / 1000.0
        self.limits = AskLimits(
            budget_s=budget_s,
            max_wait_s=max(_MAX_WAIT_BUDGETS * budget_s, _MIN_WAIT_S),
            max_unallocated_asks=MAX_UNALLOCATED_ASKS,
        )

    def store_usable(self) -> bool:
        """Lookups may ask the store: circuit closed, no call hung, namespace gate open."""
        return self.store_view(time.monotonic()).usable

    def store_view(self, now: float) -> StoreView:
        """What this half knows of its store at ``now`` (monotonic seconds), as the lifecycle reads it."""
        return _StoreAtAsk(self, now)

    def prefetch(self, r: RequestState) -> None:
        """Start a new request's search at once (``on_new_request``), so the answer is usually in when
        vLLM first asks. The local hit is not known yet: it searches from 0 (its facts serve any)."""
        if r.task is None and r.lc.current is State.NEW and self.store_usable():
            request = r.request
            search = LookupSearch(
                self.machine.scheme, tuple(request.block_hashes), request.num_tokens, 0, known=r.known
            )
            r.task = LookupTask(
                request.request_id, search, (request.num_tokens, 0, None), facts_epoch=r.facts_epoch
            )
            self.lookups.submit(r.task)

    def answer(self, r: RequestState, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens`` for ``r``: ``(None, False)`` ("ask again") while its search is in
        flight, else the external tokens and whether they load asynchronously. The lifecycle decides
        (``decide_ask``); this acts on its decision."""
        request = r.request
        if getattr(request, "skip_reading_prefix_cache", False):
            # Prompt logprobs, pooling: vLLM reads no cached prefix for this request, so neither do we.
            return 0, False
        if not r.lc.may_hit:
            return 0, False  # REFUSED: this incarnation recomputes; no store call, no record
        if r.lc.current in (State.VERIFIED, State.LOADING):
            # VERIFIED: the request was preempted after its load and is back. LOADING: vLLM gave up on the
            # load before every rank reported (nothing to judge). Either way: a new incarnation.
            if r.lc.current is State.LOADING:
                log.warning(ConnectorLogEvent.LOOKUP_WHILE_LOADING, request_id=request.request_id)
            r.lc.evict("preempted" if r.lc.current is State.VERIFIED else "load abandoned")
            r.lc = self.machine.new_request(request.request_id, r.lc.session)
            r.load = None
            # Its facts stay: the new incarnation answers from them without a round trip when they
            # suffice (confirmed entries are as good as a fresh check: every load is verified anyway).
            r.forget_ask()
        now = time.monotonic()
        decision = decide_ask(
            r.lc,
            r.ask,
            request.block_hashes,
            request.num_tokens,
            num_computed_tokens,
            known=r.known,
            block_hex=r.block_hex,
            store_round=r.task,
            store=self.store_view(now),
            limits=self.limits,
            now=now,
        )
        self._act(r, decision)
        if decision.num_external is None:
            return None, False
        if decision.num_external == 0:
            return 0, False
        return decision.num_external, not self.cfg.layerwise

    def _act(self, r: RequestState, decision: AskDecision) -> None:
        """Do what ``decision`` says, in its order (``AskDecision``)."""
        request_id = r.request.request_id
        if decision.took_round:
            task = r.task
            assert task is not None, f"request {request_id}: a store round read that was not in flight"
            r.task = None
            r.block_hex = r.block_hex or task.search.block_hex  # made on the lookup thread; shared
        if decision.submit is not None:
            r.task = LookupTask(request_id, decision.submit, decision.inputs, facts_epoch=r.facts_epoch)
            self.lookups.submit(r.task)
        if decision.missed is not None:
            failure = decision.failure
            if isinstance(failure, StoreFailed):
                self.stats.add("lookup_errors")
                log.warning(ConnectorLogEvent.LOOKUP_FAILED, request_id=request_id, error=failure.error)
            elif isinstance(failure, OverBudget):
                self.stats.add("lookup_errors")
                log.warning(
                    ConnectorLogEvent.LOOKUP_OVER_BUDGET,
                    request_id=request_id,
                    budget_ms=self.cfg.lookup_budget_ms,
                    store_ms=round(failure.store_s * 1000.0, 1),
                    waited_ms=round(failure.waited_s * 1000.0, 1),
                    store_call_hung=failure.store_call_hung,
                )
            r.abandon_search()
            r.drop_facts()
        if decision.declined is not None:
            self.stats.add("hit_declined")
            log.warning(ConnectorLogEvent.HIT_DECLINED, request_id=request_id, reason=decision.declined)
            r.forget_ask()
        if decision.num_inconsistent_guesses:
            self.stats.add("lookup_inconsistent_facts", decision.num_inconsistent_guesses)
        r.ask = decision.ask
        if decision.fresh:
            self.stats.add("lookups")
            if r.lc.current is State.PARTIAL_HIT:
                self.stats.add("lookup_hits")


class _StoreAtAsk:
    """The store as one ask sees it (a :class:`StoreView`). The breaker's state and the hung-call check each
    take a lock: they are read only when the decision reaches them, at most once per ask, so an ask answered
    from its ``Answered`` sub-state (every waiting request, every step) takes neither."""

    def __init__(self, answers: LookupAnswers, now: float) -> None:
        self._answers = answers
        self._now = now

    @property
    def gate_closed(self) -> bool:
        return self._answers.gate.closed

    @functools.cached_property
    def stalled(self) -> bool:
        return self._answers.lookups.stalled(self._now)

    @functools.cached_property
    def usable(self) -> bool:
        return (
            not self.gate_closed and self._answers.breaker.state is not BreakerState.OPEN and not self.stalled
        )

    @property
    def local_facts(self) -> bool:
        return self._answers.lookups.local_facts
