"""The per-request lifecycle at run time: one shared ``transitions`` machine that runs the table.

The table itself (states, triggers, transitions, per-trigger audit fields) is data in
``hybridkv.lifecycle.table``, the one place transitions are written; this module only runs it.

Contracts:

- One ``transitions.Machine`` (``auto_transitions=False``, ``send_event=True``, ``queued=True``) serves
  every model: models are never added to it (``add_model`` is O(models) per call); each trigger is
  dispatched through the machine's own ``Event`` objects, which run conditions, the state change and
  ``finalize_event``.
- An illegal trigger raises ``IllegalTransition`` naming the request, the trigger, the current state
  and the states the trigger leads to; a refused guard raises ``GuardRejected``.
- ``finalize_event`` is the single audit hook: exactly one record per transition that happened.
- Not thread-safe: drive it from the scheduler thread (the connector's scheduler half).
- The engine's own table (the namespace gate, reset epochs, the weights tag) runs in
  ``hybridkv.lifecycle.engine: EngineLifecycle``; the errors both raise are in ``hybridkv.lifecycle.errors``.
  This module re-exports them, where their readers import them from.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hybridkv.lifecycle.engine import EngineLifecycle
from hybridkv.lifecycle.errors import GuardRejected, IllegalTransition
from hybridkv.lifecycle.keys import EntryId, KeyScheme, PlannedBlock
from hybridkv.lifecycle.load import LoadOutcome, LoadResolution
from hybridkv.lifecycle.lookup import LookupResult, LookupSearch
from hybridkv.lifecycle.save import SavePlan
from hybridkv.lifecycle.table import (
    DETAIL_FIELD_SETS,
    DETAIL_FIELDS,
    DETAIL_REQUIRED,
    INDEX,
    LOAD_INITIAL,
    MAX_LOAD_RETRIES,
    SAVE_INITIAL,
    STATE_OF_NAME,
    TRANSITIONS,
    TRIGGER_TO_DESTS,
    State,
)
from transitions import EventData, Machine

if TYPE_CHECKING:
    from hybridkv.lifecycle.sink import AuditSink

__all__ = [
    "EngineLifecycle",
    "GuardRejected",
    "IllegalTransition",
    "LifecycleMachine",
    "RequestLifecycle",
    "SaveWave",
]


class LifecycleMachine:
    """The shared driver: one ``transitions.Machine`` for every request and save wave.

    Args:
        scheme: the deployment's key scheme (geometry, namespace, fingerprint).
        sink: where audit records go (None: nowhere; the transition still runs through the hook).
        max_load_retries: reloads a truncated request gets before it is a MISS.
    """

    def __init__(
        self, scheme: KeyScheme, *, sink: AuditSink | None = None, max_load_retries: int = MAX_LOAD_RETRIES
    ) -> None:
        self.scheme = scheme
        self.sink = sink
        self.max_load_retries = max_load_retries
        self._machine = Machine(
            model=None,
            states=[s.name for s in State],
            transitions=[t.as_transitions_dict() for t in TRANSITIONS],
            initial=LOAD_INITIAL.name,
            auto_transitions=False,
            send_event=True,
            queued=True,
            finalize_event=self._finalize,
        )
        # Dispatch through the machine's own Event objects: no per-model trigger binding.
        self._events = self._machine.events
        self.num_transitions = 0
        #: namespace resets so far: a lookup's answer carries the epoch it was learnt in
        self.epoch = 0

    # -- models ------------------------------------------------------------------------------------

    def new_request(self, request_id: str, session: Mapping[str, Any] | None = None) -> RequestLifecycle:
        """A fresh load-side lifecycle in ``NEW`` (cheap: no machine graph is built); ``session``: the
        request's session hint for its ``start_lookup`` records."""
        return RequestLifecycle(self, request_id, session)

    def new_save_wave(self, request_id: str, wave: int, plan: SavePlan) -> SaveWave:
        """A fresh save wave in ``QUEUED`` for the entries of ``plan``."""
        return SaveWave(self, request_id, wave, plan)

    # -- dispatch ----------------------------------------------------------------------------------

    def fire(self, model: _Model, trigger: str, **detail: Any) -> None:
        """Run ``trigger`` on ``model`` through the transitions machine; raise if it did not happen
        (``IllegalTransition`` from a state the table does not allow, ``GuardRejected`` when a condition
        of its row refused)."""
        if not self.try_fire(model, trigger, **detail):
            spec = INDEX[(trigger, State[model.state])]
            raise GuardRejected(model.request_id, trigger, model.state, spec.dest.name, spec.conditions)

    def try_fire(self, model: _Model, trigger: str, **detail: Any) -> bool:
        """Run ``trigger`` on ``model``: True when the transition happened, False when a condition of its
        row refused it (the guards are the only check: callers ask the table, never the model's fields).
        A trigger illegal in the current state raises ``IllegalTransition``."""
        src = model.state
        spec = INDEX.get((trigger, STATE_OF_NAME[src]))
        if spec is None:
            raise IllegalTransition(model.request_id, trigger, src, TRIGGER_TO_DESTS.get(trigger, ()))
        assert (not detail and trigger not in DETAIL_REQUIRED) or detail.keys() == DETAIL_FIELD_SETS.get(
            trigger
        ), (
            f"request {model.request_id!r}: {trigger!r} carries detail fields {sorted(detail)}, "
            f"TRIGGERS declares {DETAIL_FIELDS.get(trigger, ())}"
        )
        model.detail = detail or None
        # A self-loop (``reask``) leaves the state as it was: count transitions instead of comparing states.
        before = self.num_transitions
        self._events[trigger].trigger(model)
        return self.num_transitions != before

    def begin_epoch(self) -> int:
        """A namespace reset: answers learnt before it are stale from now on (``answer_current`` refuses
        their loads). Returns the new epoch."""
        self.epoch += 1
        return self.epoch

    def _finalize(self, event_data: EventData) -> None:
        # The single audit choke point: runs after every trigger, successful or not.
        if not event_data.result:
            return
        self.num_transitions += 1
        sink = self.sink
        if sink is None:
            return
        model: _Model = event_data.model  # type: ignore[assignment]
        transition = event_data.transition
        assert transition is not None, "a successful trigger always has a transition"
        trigger = event_data.event.name
        spec = INDEX[(trigger, State[transition.source])]
        sink.emit(
            spec.event,
            request_id=model.request_id,
            wave=model.wave,
            src=transition.source,
            dst=transition.dest,
            trigger=trigger,
            boundary=model.boundary,
            num_computed_tokens=model.num_computed_tokens,
            groups=model.group_detail,
            detail=model.detail,
            monotonic=time.monotonic(),
        )


class _Model:
    """Fields every audited model has (read by the audit hook)."""

    __slots__ = (
        "_machine",
        "boundary",
        "detail",
        "group_detail",
        "num_computed_tokens",
        "request_id",
        "state",
        "wave",
    )

    def __init__(self, machine: LifecycleMachine, request_id: str, wave: int | None, initial: State) -> None:
        self._machine = machine
        self.state = initial.name
        self.request_id = request_id
        self.wave = wave
        self.boundary = 0
        self.num_computed_tokens = 0
        self.group_detail: list[dict[str, int]] | None = None
        self.detail: dict[str, Any] | None = None

    @property
    def current(self) -> State:
        return STATE_OF_NAME[self.state]


class RequestLifecycle(_Model):
    """The load side of one request incarnation. Methods map onto the connector's scheduler hooks:

    - ``get_num_new_matched_tokens``: ``start_search`` (a few batched ``store.exists`` rounds, run off
      the scheduler thread while the state is ``LOOKUP``; asked again with other inputs meanwhile:
      ``lookup_reasked``), then ``finish_search`` (or ``lookup_unavailable`` when the store is down or
      too slow): the one lookup API, driven per ask by ``hybridkv.lifecycle.ask.decide_ask``. The full scan (every candidate key in one call,
      ``hybridkv.lifecycle.lookup.plan_lookup``) is the oracle the search is tested against, outside this
      class. ``may_hit`` is False once this incarnation is ``REFUSED``: every later ask answers 0 without
      the store.
    - ``update_state_after_alloc``: ``start_load`` when vLLM took the external tokens, else ``decline``;
      ``refuse`` when the connector cannot load what vLLM allocated (final for the incarnation).
    - a namespace reset: ``revoke`` (a ``PARTIAL_HIT`` answered before it never loads after it).
    - ``update_connector_output`` (all ranks reported): ``finish_load``.
    - request finished / aborted / preempted: ``evict``.
    """

    __slots__ = (
        "epoch",
        "fingerprint",
        "lookup",
        "max_boundary",
        "num_retries",
        "resolution",
        "session",
    )

    def __init__(
        self, machine: LifecycleMachine, request_id: str, session: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(machine, request_id, None, LOAD_INITIAL)
        #: the request's session hint, as ``start_lookup``'s record detail (``session``, ``session_ttl_s``,
        #: ``session_end``); None: the request names no session
        self.session = session
        self.lookup: LookupResult | None = None
        self.resolution: LoadResolution | None = None
        self.num_retries = 0
        #: After a truncation: the retry cap, the most a later lookup of this incarnation may return.
        self.max_boundary: int | None = None
        #: The reset epoch the current lookup started in (its facts and answer belong to it).
        self.epoch = machine.epoch
        #: The fingerprint the current lookup searched (its answer names entries under it).
        self.fingerprint = machine.scheme.fingerprint

    # Guards named in TRANSITIONS.
    def has_retry_budget(self, _event: EventData) -> bool:
        return self.num_retries < self._machine.max_load_retries

    def retries_spent(self, _event: EventData) -> bool:
        return not self.has_retry_budget(_event)

    def answer_current(self, _event: EventData) -> bool:
        """The hit was answered in the current reset epoch (no namespace reset since its lookup)."""
        return not self.is_stale

    @property
    def may_hit(self) -> bool:
        """Whether a later lookup of this incarnation may still report external tokens."""
        return self.current is not State.REFUSED

    @property
    def is_stale(self) -> bool:
        """The lookup's answer (or the search in flight) predates the latest namespace reset."""
        return self.epoch != self._machine.epoch

    # -- scheduler hooks ---------------------------------------------------------------------------

    def _begin_lookup(self, num_tokens: int, num_computed_tokens: int) -> bool:
        """Enter ``LOOKUP`` (asked again with other inputs while a lookup is in flight: ``reask``).

        False when this incarnation may not hit any more (``REFUSED``: retries exhausted, or refused)."""
        state = self.current
        if state is not State.REFUSED:
            self.group_detail = None  # the records of a new lookup carry its own answer, not the last one's
        if state is State.TRUNCATED:
            if self._machine.try_fire(self, "retry", max_boundary=self.max_boundary):
                self.num_retries += 1
            else:
                self._machine.fire(self, "give_up")
                return False
        elif state is State.REFUSED:
            return False
        elif state is State.LOOKUP:
            self._machine.fire(self, "reask", num_tokens=num_tokens, num_computed_tokens=num_computed_tokens)
        else:
            self._machine.fire(self, "start_lookup", **(self.session or {}))
        self.num_computed_tokens = num_computed_tokens
        self.epoch = self._machine.epoch
        self.fingerprint = self._machine.scheme.fingerprint
        return True

    def start_search(
        self,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        num_computed_tokens: int,
        *,
        known: dict[str, bool] | None = None,
        block_hex: list[str] | None = None,
    ) -> LookupSearch | None:
        """Enter ``LOOKUP`` and start the probing search (``LookupSearch``: a few batched rounds instead
        of one call with every candidate key, ``hybridkv.lifecycle.lookup.plan_lookup``, which stays the
        tests' oracle), capped at the retry cap; None when this incarnation may not hit any more
        (``REFUSED``: retries exhausted, or refused). ``known``: existence facts of earlier searches of
        this request to build on. Finish with ``finish_search(search.result)``."""
        if not self._begin_lookup(num_tokens, num_computed_tokens):
            return None
        return LookupSearch(
            self._machine.scheme,
            tuple(block_hashes),
            num_tokens,
            num_computed_tokens,
            max_boundary=self.max_boundary,
            known={} if known is None else known,
            block_hex=block_hex,
        )

    def finish_search(self, result: LookupResult) -> LookupResult:
        """Record a lookup's answer (a search's ``result``): ``PARTIAL_HIT`` with a plan, or ``MISS``."""
        assert self.current is State.LOOKUP, (
            f"request {self.request_id!r}: a lookup answer in state {self.state} (no lookup in flight)"
        )
        self.lookup = result
        self.boundary = result.boundary
        if self._machine.sink is not None:  # audit detail: not worth computing when nobody records it
            plan_blocks = (
                result.plan.group_num_blocks() if result.plan else (0,) * len(result.group_hit_tokens)
            )
            self.group_detail = [
                {"group": g, "hit_tokens": hit, "blocks": blocks}
                for g, (hit, blocks) in enumerate(zip(result.group_hit_tokens, plan_blocks, strict=True))
            ]
        self._machine.fire(self, "lookup_hit" if result.is_hit else "lookup_miss")
        return result

    def lookup_unavailable(self, reason: str) -> None:
        """The store could not answer in time (circuit open, timeout, a namespace reset unfinished):
        ``MISS``."""
        if self.current is not State.LOOKUP:
            self.group_detail = None
            self._machine.fire(self, "start_lookup")
            self.epoch = self._machine.epoch
            self.fingerprint = self._machine.scheme.fingerprint
        self.boundary = 0
        self._machine.fire(self, "lookup_miss", reason=reason)

    def start_load(self) -> bool:
        """vLLM allocated the external tokens: the async load is in flight on every rank. False (no
        transition) when the guard ``answer_current`` refused: the hit was answered before a namespace
        reset, so the caller must refuse it instead. The ``load_started`` record carries the epoch and the
        fingerprint the answer was found in (what ``hybridkv audit`` checks against the engine's records)."""
        return self._machine.try_fire(self, "start_load", epoch=self.epoch, fingerprint=self.fingerprint)

    def decline(self, reason: str | None = None) -> None:
        """vLLM did not take the hit's external tokens (e.g. its local hit won): ``MISS``; a later ask
        with other inputs may look up again."""
        if reason is None:
            self._machine.fire(self, "decline")
        else:
            self._machine.fire(self, "decline", reason=reason)

    def refuse(self, reason: str) -> None:
        """The connector refuses what vLLM allocated (no plan, a plan that does not match, an answer
        from before a reset): ``REFUSED``, final for this incarnation (the request recomputes). The
        audit record carries ``reason``."""
        self._machine.fire(self, "refuse", reason=reason)
        self.lookup = None

    def revoke(self, reason: str) -> None:
        """A ``PARTIAL_HIT`` whose answer went stale (a namespace reset since its lookup): ``MISS``; the
        next ask looks up again in the new epoch."""
        self._machine.fire(self, "revoke", reason=reason, epoch=self.epoch)
        self.lookup = None
        self.boundary = 0

    def finish_load(self, outcomes: Mapping[EntryId, LoadOutcome]) -> LoadResolution:
        """Every rank reported: ``VERIFIED`` or ``TRUNCATED`` (with the retry cap and keys to remove).

        A truncated request must be reported through ``failed_recving`` on hybrid models; vLLM then
        restarts it from 0 computed tokens. Its next lookup is the one retry: an ordinary lookup capped
        at ``resolution.retry_cap`` (the largest boundary no failed entry stands in the way of; see
        ``LoadResolution``), which may hit an earlier boundary the store still serves (e.g. a Mamba
        state saved at an earlier hand-off) and load it. After a second truncation: ``MISS``.
        The ``load_truncated`` audit record carries the cap as ``boundary`` and ``detail.retry_cap``.
        """
        assert self.lookup is not None and self.lookup.plan is not None, (
            f"request {self.request_id!r}: finish_load without a planned hit"
        )
        resolution = self.lookup.plan.resolve_outcomes(outcomes)
        self.resolution = resolution
        if resolution.verified:
            self._machine.fire(self, "load_verified")
        else:
            cap = resolution.retry_cap
            if self.max_boundary is not None:
                cap = min(cap, self.max_boundary)
            self.boundary = cap
            self.max_boundary = cap
            self._machine.fire(
                self,
                "load_failed",
                planned_boundary=resolution.planned_boundary,
                retry_cap=cap,
                num_failed_entries=len(resolution.failed_entries),
                num_invalid_keys=len(resolution.invalid_keys),
                num_transient_faults=resolution.num_transient_faults,
                failed_groups=sorted({e.group_index for e in resolution.failed_entries}),
            )
        return resolution

    def evict(self, reason: str = "finished") -> None:
        """Terminal: finished, aborted or preempted. Pins and plans are released."""
        self._machine.fire(self, "evict", reason=reason)
        self.lookup = None

    @property
    def num_external_tokens(self) -> int:
        """What ``get_num_new_matched_tokens`` reports in the current state."""
        if self.current is State.PARTIAL_HIT and self.lookup is not None:
            return int(self.lookup.num_external_tokens)
        return 0


class SaveWave(_Model):
    """One save wave of one request (all ranks): ``QUEUED -> PUTTING -> STORED | FAILED``, or dropped."""

    __slots__ = ("plan", "stored")

    def __init__(self, machine: LifecycleMachine, request_id: str, wave: int, plan: SavePlan) -> None:
        super().__init__(machine, request_id, wave, SAVE_INITIAL)
        self.plan = plan
        self.stored: tuple[PlannedBlock, ...] = ()
        self.boundary = max((b.key_boundary for b in plan.blocks), default=0)
        counts: dict[int, int] = {}
        for block in plan.blocks:
            counts[block.group_index] = counts.get(block.group_index, 0) + 1
        self.group_detail = [{"group": g, "blocks": n} for g, n in sorted(counts.items())]

    def start_put(self) -> None:
        self._machine.fire(self, "start_put")

    def finish_put(
        self, outcomes: Mapping[EntryId, bool], reasons: Sequence[str] = ()
    ) -> tuple[PlannedBlock, ...]:
        """Every rank reported. Returns the blocks to publish ``BlockStored`` for: all blocks if the
        whole wave is stored on every rank (``STORED``), otherwise none (``FAILED``, its record's ``reasons``:
        ``reasons``, the outcomes of the entries that failed, e.g. ``no_space``)."""
        stored = self.plan.stored_blocks(outcomes)
        if len(stored) == len(self.plan.blocks):
            self.stored = stored
            self._machine.fire(self, "put_stored")
            return tuple(stored)
        self._machine.fire(
            self,
            "put_failed",
            num_stored_blocks=len(stored),
            num_blocks=len(self.plan.blocks),
            reasons=sorted(set(reasons)),
        )
        return ()

    def drop(self, reason: str = "backpressure") -> None:
        self._machine.fire(self, "drop", reason=reason)
