"""The engine's lifecycle at run time: the namespace gate, reset epochs and the weights tag.

``EngineLifecycle`` runs the engine's table (``ENGINE_TRANSITIONS`` in ``hybridkv.lifecycle.table``) on a
``transitions.Machine`` of its own and writes its records to the same sink as the requests' (the
``LifecycleMachine``'s, read at each record). Every engine record carries ``machine: "engine"``, the reset
epoch and the fingerprint in force after the transition. An illegal trigger raises ``IllegalTransition``,
a refused guard ``GuardRejected``, as the requests' machine does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from hybridkv.lifecycle.errors import GuardRejected, IllegalTransition
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.table import (
    ENGINE_DETAIL_FIELDS,
    ENGINE_INDEX,
    ENGINE_INITIAL,
    ENGINE_RECORD,
    ENGINE_TRANSITIONS,
    EngineState,
    EngineTrigger,
)
from transitions import EventData, Machine

if TYPE_CHECKING:
    from hybridkv.lifecycle.machine import LifecycleMachine

__all__ = ["EngineLifecycle"]


class EngineLifecycle:
    """The engine's state (``ENGINE_TRANSITIONS``): the namespace gate, reset epochs and the weights tag.

    Created ``STARTING`` and started at once (``engine_started``, with ``weights_source``: ``"checkpoint"``
    or ``"declared"``). Not thread-safe on its own (this package starts no threads and takes no locks): its
    owner serializes the calls (``hybridkv.connector.scheduler.namespace_gate.NamespaceGate`` holds one lock
    around each); the reset epoch is the ``LifecycleMachine``'s (``begin_epoch``), the fingerprint its
    ``scheme``'s.
    """

    def __init__(self, lifecycle: LifecycleMachine, *, weights_source: str) -> None:
        self._lifecycle = lifecycle
        self.state = ENGINE_INITIAL.name
        #: reset removals not returned yet (resets may overlap: the gate opens when the last returns)
        self.num_pending = 0
        self.detail: dict[str, Any] | None = None
        self._num_transitions = 0
        self._machine = Machine(
            model=None,
            states=[s.name for s in EngineState],
            transitions=[t.as_transitions_dict() for t in ENGINE_TRANSITIONS],
            initial=ENGINE_INITIAL.name,
            auto_transitions=False,
            send_event=True,
            queued=True,
            finalize_event=self._finalize,
        )
        self._fire(EngineTrigger.START, weights_source=weights_source)

    @property
    def current(self) -> EngineState:
        return EngineState[self.state]

    # Guards named in ENGINE_TRANSITIONS.
    def removals_pending(self, _event: EventData) -> bool:
        return self.num_pending > 0

    def no_removal_pending(self, _event: EventData) -> bool:
        return self.num_pending == 0

    def begin_reset(self) -> int:
        """A reset starts: a new epoch (answers learnt before it are stale) and the gate closes. Returns
        the new epoch."""
        epoch = self._lifecycle.begin_epoch()
        self.num_pending += 1
        self._fire(EngineTrigger.BEGIN_RESET, num_pending=self.num_pending)
        return epoch

    def rotate_weights(self, scheme: KeyScheme, *, weights_source: str, reason: str) -> None:
        """The keys from now on use ``scheme`` (a reset's weights tag; the same fingerprint when the
        weights are known unchanged). Only while a reset runs."""
        previous = self._lifecycle.scheme.fingerprint
        self._lifecycle.scheme = scheme
        self._fire(
            EngineTrigger.ROTATE_WEIGHTS,
            weights_source=weights_source,
            previous_fingerprint=previous,
            reason=reason,
        )

    def end_reset(self, *, ok: bool) -> None:
        """A reset's removal returned (``ok``) or raised / could not be queued. The gate opens (or fails)
        when the last pending removal returned, by the last one's outcome."""
        assert self.num_pending > 0, "EngineLifecycle.end_reset without a reset in progress"
        self.num_pending -= 1
        if self.num_pending:
            self._fire(EngineTrigger.REMOVAL_RETURNED, ok=ok, num_pending=self.num_pending)
        else:
            self._fire(EngineTrigger.REOPEN if ok else EngineTrigger.FAIL)

    def _fire(self, trigger: EngineTrigger, **detail: Any) -> None:
        """Run ``trigger``; raise when the table does not allow it."""
        src = self.state
        spec = ENGINE_INDEX.get((trigger, EngineState[src]))
        if spec is None:
            raise IllegalTransition("<engine>", trigger, src, ())
        assert detail.keys() == ENGINE_DETAIL_FIELDS[trigger], (
            f"engine {trigger!r} carries detail fields {sorted(detail)}, ENGINE_TRIGGERS declares "
            f"{sorted(ENGINE_DETAIL_FIELDS[trigger])}"
        )
        self.detail = detail or None
        before = self._num_transitions  # a queued machine's trigger() is True either way: count instead
        self._machine.events[trigger].trigger(self)
        if self._num_transitions == before:
            raise GuardRejected("<engine>", trigger, src, spec.dest.name, spec.conditions)

    def _finalize(self, event_data: EventData) -> None:
        # The engine's single audit choke point: one record per engine transition that happened.
        if not event_data.result:
            return
        self._num_transitions += 1
        sink = self._lifecycle.sink
        if sink is None:
            return
        transition = event_data.transition
        assert transition is not None, "a successful trigger always has a transition"
        trigger = event_data.event.name
        spec = ENGINE_INDEX[(trigger, EngineState[transition.source])]
        scheme = self._lifecycle.scheme
        sink.emit(
            spec.event,
            machine=ENGINE_RECORD,
            request_id=None,
            wave=None,
            src=transition.source,
            dst=transition.dest,
            trigger=trigger,
            epoch=self._lifecycle.epoch,
            fingerprint=scheme.fingerprint,
            weights_tag=scheme.weights_tag,
            detail=self.detail,
            monotonic=time.monotonic(),
        )
