"""One ask of vLLM's (``get_num_new_matched_tokens``) decided: the ask sub-state and what answers it.

vLLM asks a waiting request again every step. The connector keeps, per request, the ask sub-state
(:data:`Ask`: a search in flight, an answer, or none) and the store round in flight on its lookup worker;
``decide_ask`` takes them, the ask's numbers, what the store round reported and what the connector knows
of its store now, takes the request lifecycle's transitions (``start_search``, ``finish_search``,
``lookup_unavailable``, ``refuse``) and returns ONE :class:`AskDecision`: what vLLM is answered and what
the connector does about it (drop the round it read, submit a store round, abandon the round and the facts,
log and count). Pure: the time is passed in as a number; no threads, no store, no logging.

The rules (the connector's module ``lookup_answers`` says why the limits are what they are):

- the first ask of a lookup starts its search (``lookup_started`` / ``lookup_restarted``; asked with other
  inputs while one is in flight: ``lookup_reasked``) and answers "ask again" until the search's result is
  in; then ``hit_found`` or ``miss_reported``;
- the wait is bounded (:class:`AskLimits`): past ``budget_s`` of store time, a store call hung past it, or
  ``max_wait_s`` of wall time since the first ask, the lookup is a miss ("over lookup budget"); while the
  store is unusable (circuit open, a call hung) or the namespace gate is closed (a reset), at once;
- repeated asks with unchanged inputs reuse the answer (no store call, no record); a hit answered more than
  ``max_unallocated_asks`` times without vLLM allocating it is refused (``REFUSED``: the request computes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from hybridkv.lifecycle.lookup import LookupSearch
from hybridkv.lifecycle.machine import RequestLifecycle
from hybridkv.lifecycle.table import State

__all__ = [
    "Answered",
    "Ask",
    "AskDecision",
    "AskLimits",
    "FixedStoreView",
    "LookupInputs",
    "OverBudget",
    "Searching",
    "StoreFailed",
    "StoreRound",
    "StoreView",
    "decide_ask",
]

#: What an answer depends on: (num_tokens, num_computed_tokens, retry cap)
LookupInputs = tuple[int, int, int | None]


@dataclass
class Searching:
    """vLLM's current ask, not answered yet (the lifecycle in ``LOOKUP``): the search that answers it, the
    inputs it answers, and when vLLM was first told to ask again (None until then; the wait is bounded
    from there)."""

    search: LookupSearch
    inputs: LookupInputs
    waiting_since: float | None = None


@dataclass
class Answered:
    """The answer vLLM's asks with ``inputs`` get again without a store call (the lifecycle in
    ``PARTIAL_HIT`` / ``MISS``): the agreed ``boundary``, and how many asks it answered with a hit vLLM
    has not allocated (the watchdog's count)."""

    inputs: LookupInputs
    boundary: int
    num_unallocated_asks: int = 0


#: The ask sub-state: no ask, a search in flight, or an answer.
Ask = Searching | Answered | None


class StoreRound(Protocol):
    """The store round in flight for one request, as the connector's lookup worker reports it: its
    ``search`` (and ``error``) is read only once ``done``; ``store_s`` (store time so far) at any time."""

    search: LookupSearch
    inputs: LookupInputs
    store_s: float
    done: bool
    error: str | None


class StoreView(Protocol):
    """What the connector knows of its store at the ask. ``decide_ask`` reads a fact only on the branch that
    needs it, so a view may compute its facts when read: an ask answered from ``Answered`` (every waiting
    request, every step) then reads nothing but ``gate_closed``."""

    @property
    def gate_closed(self) -> bool:
        """A namespace reset is unfinished: facts learnt before it may name removed entries."""

    @property
    def usable(self) -> bool:
        """Lookups may ask the store: circuit not open, no call hung, gate open."""

    @property
    def stalled(self) -> bool:
        """A store call has been in flight longer than the budget."""

    @property
    def local_facts(self) -> bool:
        """The searches' existence facts live in this process (the ask may be answered from them)."""


@dataclass(frozen=True)
class FixedStoreView:
    """A :class:`StoreView` of facts known up front."""

    gate_closed: bool
    usable: bool
    stalled: bool
    local_facts: bool


@dataclass(frozen=True)
class AskLimits:
    """How long an ask may wait, and how often a hit may go unallocated."""

    #: store time a search may take (``lookup_budget_ms``)
    budget_s: float
    #: wall time since the first ask a search may take (its CPU work and queueing included)
    max_wait_s: float
    #: asks of one answered hit vLLM may leave unallocated before the hit is refused
    max_unallocated_asks: int


@dataclass(frozen=True)
class StoreFailed:
    """The store round of the search failed (``lookup_errors``, logged): the lookup is a miss."""

    error: str


@dataclass(frozen=True)
class OverBudget:
    """The search in flight ran out of time (``lookup_errors``, logged with these figures): a miss."""

    store_s: float
    waited_s: float
    store_call_hung: bool


@dataclass(frozen=True)
class AskDecision:
    """What one ask gets, and what the connector does about it, in this order (the lifecycle's
    transitions are taken already):

    1. ``took_round``: the round in flight was done and is read: the connector lets go of it (keeping
       the block hex its search made);
    2. ``submit``: start a store round for this search (with ``inputs``);
    3. ``missed``: the lookup ended as a miss without the store's answer, for this reason: the connector
       abandons the round in flight and drops the facts; ``failure`` (if any) is counted and logged;
    4. ``declined``: the watchdog refused a hit vLLM did not allocate, for this reason: counted, logged,
       the ask forgotten;
    5. ``ask``: the ask sub-state from now on;
    6. ``fresh``: a new answer (counted as a lookup, and as a lookup hit when the lifecycle hit);
       ``num_inconsistent_guesses``: probes the facts contradicted (counted).

    ``num_external``: what vLLM is answered, the external tokens (None: "ask again")."""

    num_external: int | None
    ask: Ask
    inputs: LookupInputs
    took_round: bool = False
    submit: LookupSearch | None = None
    missed: str | None = None
    failure: StoreFailed | OverBudget | None = None
    declined: str | None = None
    fresh: bool = False
    num_inconsistent_guesses: int = 0


def decide_ask(
    lc: RequestLifecycle,
    ask: Ask,
    block_hashes: Sequence[bytes],
    num_tokens: int,
    num_computed_tokens: int,
    *,
    known: dict[str, bool],
    block_hex: list[str] | None,
    store_round: StoreRound | None,
    store: StoreView,
    limits: AskLimits,
    now: float,
) -> AskDecision:
    """Decide vLLM's ask of ``lc``'s request (``num_tokens`` of ``block_hashes``, ``num_computed_tokens``
    of them local) and take its transitions. ``ask``: the ask sub-state (a ``Searching`` waiting here
    starts its wait, an ``Answered`` hit counts an unallocated ask); ``known``: the request's existence
    facts (a truncation's invalid keys are marked absent there; a new search builds on them);
    ``store_round``: the round in flight (the prefetch, or ``ask``'s search), if any; ``now``: monotonic
    seconds. The lifecycle may not be ``REFUSED``, ``VERIFIED`` or ``LOADING`` (the connector starts a new
    incarnation first)."""
    inputs: LookupInputs = (num_tokens, num_computed_tokens, lc.max_boundary)
    if (
        isinstance(ask, Searching)
        and ask.inputs == inputs
        and ask.waiting_since is not None  # the first ask starts the wait (below)
        and store_round is not None
        and not store_round.done
        and lc.current is State.LOOKUP
        and not store.gate_closed
        and not _expired(ask, store_round.store_s, store, limits, now)
    ):
        # vLLM asks every waiting request again every step: while its search is in flight the answer is
        # "ask again", given before any other work (the search's path below reaches the same).
        return AskDecision(None, ask, inputs)
    if (
        isinstance(ask, Answered)
        and ask.inputs == inputs
        and lc.current in (State.PARTIAL_HIT, State.MISS)
        and not store.gate_closed
    ):
        if lc.current is State.PARTIAL_HIT and ask.boundary > num_computed_tokens:
            ask.num_unallocated_asks += 1
            if ask.num_unallocated_asks > limits.max_unallocated_asks:
                reason = f"vLLM did not allocate the hit in {limits.max_unallocated_asks} asks"
                lc.refuse(reason)
                return AskDecision(0, None, inputs, declined=reason)
        return AskDecision(_external(lc, ask.boundary, num_computed_tokens), ask, inputs)
    return _search(
        lc,
        ask,
        inputs,
        block_hashes=block_hashes,
        known=known,
        block_hex=block_hex,
        store_round=store_round,
        store=store,
        limits=limits,
        now=now,
    )


def _search(
    lc: RequestLifecycle,
    ask: Ask,
    inputs: LookupInputs,
    *,
    block_hashes: Sequence[bytes],
    known: dict[str, bool],
    block_hex: list[str] | None,
    store_round: StoreRound | None,
    store: StoreView,
    limits: AskLimits,
    now: float,
) -> AskDecision:
    """The ask that repeats no answer: the search's answer, "ask again" while it is in flight, or a miss."""
    searching = ask if isinstance(ask, Searching) else None
    if lc.current is not State.LOOKUP or searching is None or searching.inputs != inputs:
        if lc.current is State.TRUNCATED and lc.resolution is not None:
            # The truncation removed these from the store; the rest of the facts still stand.
            known.update(dict.fromkeys(lc.resolution.invalid_keys, False))
        # A store round still in flight stays: its facts serve any search.
        started = lc.start_search(block_hashes, inputs[0], inputs[1], known=known, block_hex=block_hex)
        if started is None:
            return _answer(lc, inputs, 0)  # retries exhausted: REFUSED for the rest of this incarnation
        searching = Searching(started, inputs)
    assert lc.current is State.LOOKUP, f"request {lc.request_id}: a search outside LOOKUP"
    search = searching.search
    if store.gate_closed:
        # Facts learnt before the reset may name removed entries: no answer until it has finished.
        return _unavailable(lc, inputs, "namespace reset in progress")
    took_round = False
    if store_round is not None and store_round.done:
        took_round = True
        if store_round.error is not None and store_round.search is search:
            return _unavailable(
                lc, inputs, store_round.error, StoreFailed(store_round.error), took_round=True
            )
        if (
            store_round.error is None
            and store_round.inputs == inputs
            and store_round.search.result is not None
        ):
            # The prefetch answered exactly this ask: nothing to compute on the scheduler thread.
            return _answer(lc, inputs, lc.finish_search(store_round.search.result).boundary, took_round=True)
        store_round = None
    submit: LookupSearch | None = None
    store_s = store_round.store_s if store_round is not None else 0.0
    if store_round is None:
        # No store call in flight for this request: its facts may already answer (the prefetch). With
        # no facts, the keys are made on the lookup thread: at 128K tokens they cost milliseconds.
        if store.local_facts and known and search.next_keys() is None:
            assert search.result is not None, f"request {lc.request_id}: a finished search without a result"
            return _answer(
                lc,
                inputs,
                lc.finish_search(search.result).boundary,
                took_round=took_round,
                num_inconsistent_guesses=search.num_inconsistent_guesses,
            )
        if not store.usable:
            return _unavailable(
                lc, inputs, "store unavailable (circuit open or a store call hung)", took_round=took_round
            )
        submit = search  # a round just submitted has waited for no store call yet
    if searching.waiting_since is None:
        searching.waiting_since = now
    elif _expired(searching, store_s, store, limits, now):
        failure = OverBudget(store_s, now - searching.waiting_since, store.stalled)
        return _unavailable(lc, inputs, "over lookup budget", failure, took_round=took_round, submit=submit)
    return AskDecision(None, searching, inputs, took_round=took_round, submit=submit)


def _expired(searching: Searching, store_s: float, store: StoreView, limits: AskLimits, now: float) -> bool:
    """Whether a search in flight must end as a miss: its round's store time (``store_s``) is over the
    budget, a store call hangs, or the ask has waited (since ``searching.waiting_since``) longer than any
    may."""
    assert searching.waiting_since is not None, f"search {searching.inputs}: its ask's wait has not started"
    return store_s > limits.budget_s or store.stalled or now - searching.waiting_since > limits.max_wait_s


def _answer(
    lc: RequestLifecycle,
    inputs: LookupInputs,
    boundary: int,
    *,
    took_round: bool = False,
    num_inconsistent_guesses: int = 0,
) -> AskDecision:
    """A new answer, ``boundary`` (repeated asks with ``inputs`` reuse it)."""
    return AskDecision(
        _external(lc, boundary, inputs[1]),
        Answered(inputs, boundary),
        inputs,
        took_round=took_round,
        fresh=True,
        num_inconsistent_guesses=num_inconsistent_guesses,
    )


def _unavailable(
    lc: RequestLifecycle,
    inputs: LookupInputs,
    reason: str,
    failure: StoreFailed | OverBudget | None = None,
    *,
    took_round: bool = False,
    submit: LookupSearch | None = None,
) -> AskDecision:
    """The lookup is a miss without the store's answer (``lookup_unavailable``); the answer, 0, is reused."""
    lc.lookup_unavailable(reason)
    return replace(
        _answer(lc, inputs, 0, took_round=took_round), submit=submit, missed=reason, failure=failure
    )


def _external(lc: RequestLifecycle, boundary: int, num_computed_tokens: int) -> int:
    """The external tokens an answer of ``boundary`` reports: beyond the local hit, of a hit only."""
    ext = boundary - num_computed_tokens
    return ext if ext > 0 and lc.current is State.PARTIAL_HIT else 0
