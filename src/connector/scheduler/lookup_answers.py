"""``get_num_new_matched_tokens`` for one request: answers from the lifecycle, never waiting on the store.

The search runs on the lookup thread (:class:`~hybridkv.connector.scheduler.lookup_service.LookupService`); this module
turns vLLM's repeated asks into the lifecycle's transitions:

- the first ask of a lookup starts its search (``lookup_started`` / ``lookup_restarted``; asked with other
  inputs while one is in flight: ``lookup_reasked``) and answers ``(None, False)`` ("ask again") until
  the search's result is in; then ``hit_found`` or ``miss_reported``;
- the wait is bounded: past ``lookup_budget_ms`` of store time, a store call hung past it, or
  ``_MAX_WAIT_BUDGETS`` budgets (at least ``_MIN_WAIT_S``) of wall time since the first ask, the lookup
  is a miss ("over lookup budget"); while the store is unusable (circuit open, a call hung) or the
  namespace gate is closed (a reset), at once;
- repeated asks with unchanged inputs reuse the answer (no store call, no record); a reset between them
  has already dropped it (``RequestState.forget_facts``, at the reset) and the request looks up again.
"""

from __future__ import annotations

import time

import structlog
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.scheduler.lookup_service import LookupRunner, LookupTask
from hybridkv.connector.scheduler.namespace_gate import NamespaceGate
from hybridkv.connector.scheduler.request_state import Answered, LookupInputs, RequestState, Searching
from hybridkv.connector.stats import StatsBox
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
        self.budget_s = cfg.lookup_budget_ms / 1000.0

    def store_usable(self) -> bool:
        """Lookups may ask the store: circuit closed, no call hung, namespace gate open."""
        return (
            self.breaker.state is not BreakerState.OPEN
            and not self.lookups.stalled()
            and not self.gate.closed
        )

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
        flight, else the external tokens and whether they load asynchronously."""
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
        lc = r.lc
        inputs: LookupInputs = (request.num_tokens, num_computed_tokens, lc.max_boundary)
        task, searching = r.task, r.searching
        if (
            task is not None
            and not task.done
            and searching is not None
            and searching.inputs == inputs
            and searching.waiting_since is not None  # the first ask starts the wait (``_answer``)
            and lc.current is State.LOOKUP
            and not self.gate.closed
            and not self._expired(searching, task, time.monotonic())
        ):
            # vLLM asks every waiting request again every step: while its search is in flight the answer
            # is "ask again", given before any other work (``_answer`` reaches the same).
            return None, False
        answered = r.answered
        if (
            answered is not None
            and answered.inputs == inputs
            and lc.current in (State.PARTIAL_HIT, State.MISS)
            and not self.gate.closed
        ):
            boundary = answered.boundary
            if lc.current is State.PARTIAL_HIT and boundary > num_computed_tokens:
                answered.num_unallocated_asks += 1
                if answered.num_unallocated_asks > MAX_UNALLOCATED_ASKS:
                    reason = f"vLLM did not allocate the hit in {MAX_UNALLOCATED_ASKS} asks"
                    self.stats.add("hit_declined")
                    log.warning(ConnectorLogEvent.HIT_DECLINED, request_id=request.request_id, reason=reason)
                    r.forget_ask()
                    lc.refuse(reason)
                    return 0, False
        else:
            answer = self._answer(r, inputs)
            if answer is None:
                return None, False
            boundary = answer
            self.stats.add("lookups")
            r.ask = Answered(inputs, boundary)
            if lc.current is State.PARTIAL_HIT:
                self.stats.add("lookup_hits")
        ext = boundary - num_computed_tokens
        if ext <= 0 or lc.current is not State.PARTIAL_HIT:
            return 0, False
        return ext, not self.cfg.layerwise

    def _answer(self, r: RequestState, inputs: LookupInputs) -> int | None:
        """The agreed boundary for ``inputs``, or None while the search is in flight."""
        lc = r.lc
        request = r.request
        now = time.monotonic()
        searching = r.searching
        if lc.current is not State.LOOKUP or searching is None or searching.inputs != inputs:
            if lc.current is State.TRUNCATED and lc.resolution is not None:
                # The truncation removed these from the store; the rest of the facts still stand.
                r.known.update(dict.fromkeys(lc.resolution.invalid_keys, False))
            r.ask = None  # a store round still in flight (``r.task``) stays: its facts serve any search
            started = lc.start_search(
                request.block_hashes, request.num_tokens, inputs[1], known=r.known, block_hex=r.block_hex
            )
            if started is None:
                return 0  # retries exhausted: REFUSED for the rest of this incarnation
            r.ask = searching = Searching(started, inputs)
        assert lc.current is State.LOOKUP, f"request {request.request_id}: a search outside LOOKUP"
        search = searching.search
        if self.gate.closed:
            # Facts learnt before the reset may name removed entries: no answer until it has finished.
            return self._unavailable(r, "namespace reset in progress")
        task = r.task
        if task is not None and task.done:
            r.task = None
            r.block_hex = r.block_hex or task.search.block_hex  # made on the lookup thread; shared
            if task.error is not None and task.search is search:
                self.stats.add("lookup_errors")
                log.warning(ConnectorLogEvent.LOOKUP_FAILED, request_id=request.request_id, error=task.error)
                return self._unavailable(r, task.error)
            if task.error is None and task.inputs == inputs and task.search.result is not None:
                # The prefetch answered exactly this ask: nothing to compute on the scheduler thread.
                return lc.finish_search(task.search.result).boundary
            task = None
        if task is None:
            # No store call in flight for this request: its facts may already answer (the prefetch). With
            # no facts, the keys are made on the lookup thread: at 128K tokens they cost milliseconds.
            if self.lookups.local_facts and r.known and search.next_keys() is None:
                assert search.result is not None
                if search.num_inconsistent_guesses:
                    self.stats.add("lookup_inconsistent_facts", search.num_inconsistent_guesses)
                return lc.finish_search(search.result).boundary
            if not self.store_usable():
                return self._unavailable(r, "store unavailable (circuit open or a store call hung)")
            r.task = task = LookupTask(request.request_id, search, inputs, facts_epoch=r.facts_epoch)
            self.lookups.submit(task)
        if searching.waiting_since is None:
            searching.waiting_since = now
        elif self._expired(searching, task, now):
            self.stats.add("lookup_errors")
            log.warning(
                ConnectorLogEvent.LOOKUP_OVER_BUDGET,
                request_id=request.request_id,
                budget_ms=self.cfg.lookup_budget_ms,
                store_ms=round(task.store_s * 1000.0, 1),
                waited_ms=round((now - searching.waiting_since) * 1000.0, 1),
                store_call_hung=self.lookups.stalled(now),
            )
            return self._unavailable(r, "over lookup budget")
        return None

    def _expired(self, searching: Searching, task: LookupTask, now: float) -> bool:
        """Whether a search in flight must end as a miss: its store time is over ``lookup_budget_ms``, a
        store call hangs, or the ask has waited (since ``searching.waiting_since``) longer than any may."""
        assert searching.waiting_since is not None, f"task {task.request_id}: its ask's wait has not started"
        return (
            task.store_s > self.budget_s
            or self.lookups.stalled(now)
            or now - searching.waiting_since > max(_MAX_WAIT_BUDGETS * self.budget_s, _MIN_WAIT_S)
        )

    def _unavailable(self, r: RequestState, reason: str) -> int:
        r.abandon_search()
        r.drop_facts()
        r.lc.lookup_unavailable(reason)
        return 0
