"""The lifecycle's transition table, as data: the one place its transitions are written.

Everything else is built from it: ``LifecycleMachine`` (``hybridkv.lifecycle.machine``) runs it, the audit
replay (``hybridkv audit``) checks records against it, and the diagrams under ``docs/diagrams`` are
generated from it by ``hybridkv diagram`` (``tests/audit/test_diagram.py`` fails when they are stale).

Load side (one per request incarnation; a preempted request that comes back starts again at ``NEW``)::

    NEW -> LOOKUP -> MISS | PARTIAL_HIT -> LOADING -> VERIFIED | TRUNCATED -(one retry)-> LOOKUP ... -> EVICTED
                                PARTIAL_HIT -> MISS (declined by vLLM, or revoked by a namespace reset)
                         any live state -> REFUSED (the connector refused what vLLM allocated; no later hit)

A truncation records a retry cap (``LoadResolution.retry_cap``: the largest boundary no failed entry
stands in the way of); the retry is an ordinary lookup bounded by it, which may hit and load an earlier
boundary; a second truncation ends in ``REFUSED``. Every fact a lookup answers from carries the reset
epoch it was learnt in (``RequestLifecycle.epoch``): a hit answered before a namespace reset is revoked,
never loaded after it.

Save side (one per request and save wave)::

    QUEUED -> PUTTING -> STORED | FAILED        QUEUED | PUTTING -> DROPPED (backpressure: no rank wrote)

The engine (one per connector scheduler half): the namespace gate, reset epochs and the weights tag the keys
carry (``ENGINE_TRANSITIONS``, run by ``hybridkv.lifecycle.machine.EngineLifecycle``)::

    STARTING -> OPEN -> RESETTING (-> RESETTING: weights_rotated, a reset's removal returned, another reset)
                              RESETTING -> OPEN | FAILED        FAILED -> RESETTING (a later reset)

The fingerprint changes only in ``RESETTING`` (``rotate_weights``), and every engine record carries the reset
epoch and the fingerprint in force after it, so the replay can tell which fingerprint a load used.

Contracts:

- ``TRANSITIONS`` is the only place transitions are declared; ``TRIGGERS`` holds one row per trigger (its
  audit ``detail`` fields, trace counterpart and replay counts). Import-time assertions check that the two
  name the same triggers and that no (trigger, source) pair has two rows.
- The indexes below (``INDEX``, ``TRIGGER_TO_DESTS``, ``DETAIL_FIELD_SETS``, ``DETAIL_REQUIRED``,
  ``STATE_OF_NAME``) are derived from the table once, at import; nothing writes them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = [
    "DETAIL_FIELDS",
    "DETAIL_FIELD_SETS",
    "DETAIL_REQUIRED",
    "ENGINE_DETAIL_FIELDS",
    "ENGINE_INDEX",
    "ENGINE_INITIAL",
    "ENGINE_RECORD",
    "ENGINE_TRANSITIONS",
    "ENGINE_TRIGGERS",
    "INDEX",
    "LOAD_INITIAL",
    "LOAD_TERMINAL",
    "MAX_LOAD_RETRIES",
    "SAVE_INITIAL",
    "SAVE_TERMINAL",
    "STATE_OF_NAME",
    "TRANSITIONS",
    "TRIGGERS",
    "TRIGGER_TO_DESTS",
    "EngineState",
    "EngineTransitionSpec",
    "EngineTrigger",
    "EngineTriggerRow",
    "ReplayCount",
    "State",
    "TransitionSpec",
    "Trigger",
    "TriggerRow",
    "engine_transition_index",
    "transition_index",
]


class State(enum.Enum):
    """Every lifecycle state (load side, then save side)."""

    NEW = "NEW"
    LOOKUP = "LOOKUP"
    MISS = "MISS"
    PARTIAL_HIT = "PARTIAL_HIT"
    LOADING = "LOADING"
    VERIFIED = "VERIFIED"
    TRUNCATED = "TRUNCATED"
    REFUSED = "REFUSED"
    EVICTED = "EVICTED"
    QUEUED = "QUEUED"
    PUTTING = "PUTTING"
    STORED = "STORED"
    FAILED = "FAILED"
    DROPPED = "DROPPED"


class Trigger(enum.StrEnum):
    """Every trigger of the table (a ``str``: audit records carry the value)."""

    START_LOOKUP = "start_lookup"
    REASK = "reask"
    LOOKUP_HIT = "lookup_hit"
    LOOKUP_MISS = "lookup_miss"
    REVOKE = "revoke"
    START_LOAD = "start_load"
    DECLINE = "decline"
    REFUSE = "refuse"
    LOAD_VERIFIED = "load_verified"
    LOAD_FAILED = "load_failed"
    RETRY = "retry"
    GIVE_UP = "give_up"
    EVICT = "evict"
    START_PUT = "start_put"
    PUT_STORED = "put_stored"
    PUT_FAILED = "put_failed"
    DROP = "drop"


class ReplayCount(enum.Enum):
    """What ``hybridkv audit``'s replay counts for a trigger's record (besides its per-trigger count)."""

    #: per group: a hit or a miss (``hit_tokens`` beyond the local hit or not)
    GROUP_HIT_OR_MISS = "group_hit_or_miss"
    #: per group with blocks: a verified load
    GROUP_VERIFIED = "group_verified"
    #: a truncation (and per failed group); lowers the lifecycle's retry cap
    TRUNCATION = "truncation"
    #: a retry (more than ``MAX_LOAD_RETRIES`` in one incarnation is a loop)
    RETRY = "retry"
    #: no later load of this incarnation (a ``load_started`` after it is a loop)
    ENDS_LOADS = "ends_loads"


@dataclass(frozen=True)
class TriggerRow:
    """Everything about one trigger besides where it leads (that is ``TRANSITIONS``)."""

    trigger: Trigger
    #: the fields of its audit record's ``detail``: a record carries all of them or (``detail_optional``)
    #: none; ``fire`` refuses anything else
    detail: tuple[str, ...] = ()
    detail_optional: bool = False
    #: vLLM's proposed lifecycle-trace counterpart: (event, role, transfer mode); None: none
    trace: tuple[str, str, str] | None = None
    replay: frozenset[ReplayCount] = frozenset()


_StateT = TypeVar("_StateT", bound=enum.Enum)
_TriggerT = TypeVar("_TriggerT", bound=enum.StrEnum)


@dataclass(frozen=True)
class TransitionSpec(Generic[_StateT, _TriggerT]):
    """One row of a table (the requests' ``TRANSITIONS``, the engine's ``ENGINE_TRANSITIONS``): ``trigger``
    moves ``sources`` to ``dest`` if every condition holds."""

    trigger: _TriggerT
    sources: tuple[_StateT, ...]
    dest: _StateT
    #: The audit record's ``event`` (past-tense verb).
    event: str
    #: Names of predicate methods on the model (all must be true).
    conditions: tuple[str, ...] = ()

    def as_transitions_dict(self) -> dict[str, Any]:
        return {
            "trigger": self.trigger,
            "source": [s.name for s in self.sources],
            "dest": self.dest.name,
            "conditions": list(self.conditions),
        }


_S = State
_T = Trigger
STATE_OF_NAME: dict[str, State] = {state.name: state for state in State}  # ``State[name]`` is slower
#: Retries of a truncated load (then MISS for the rest of the incarnation).
MAX_LOAD_RETRIES = 1
LOAD_INITIAL = State.NEW
SAVE_INITIAL = State.QUEUED
LOAD_TERMINAL = frozenset({State.EVICTED})
SAVE_TERMINAL = frozenset({State.STORED, State.FAILED, State.DROPPED})
_LOAD_LIVE = (_S.NEW, _S.LOOKUP, _S.MISS, _S.PARTIAL_HIT, _S.LOADING, _S.VERIFIED, _S.TRUNCATED, _S.REFUSED)
#: States a refusal can come from: every live one but ``REFUSED`` itself.
_REFUSABLE = tuple(s for s in _LOAD_LIVE if s is not _S.REFUSED)

# fmt: off
TRANSITIONS: tuple[TransitionSpec[State, Trigger], ...] = (
    # -- load side ---------------------------------------------------------------------------------
    TransitionSpec(_T.START_LOOKUP,  (_S.NEW,),                    _S.LOOKUP,      "lookup_started"),
    TransitionSpec(_T.START_LOOKUP,  (_S.MISS, _S.PARTIAL_HIT),    _S.LOOKUP,      "lookup_restarted"),
    TransitionSpec(_T.REASK,         (_S.LOOKUP,),                 _S.LOOKUP,      "lookup_reasked"),
    TransitionSpec(_T.LOOKUP_HIT,    (_S.LOOKUP,),                 _S.PARTIAL_HIT, "hit_found"),
    TransitionSpec(_T.LOOKUP_MISS,   (_S.LOOKUP,),                 _S.MISS,        "miss_reported"),
    TransitionSpec(_T.REVOKE,        (_S.PARTIAL_HIT,),            _S.MISS,        "hit_revoked"),
    TransitionSpec(_T.START_LOAD,    (_S.PARTIAL_HIT,),            _S.LOADING,     "load_started", ("answer_current",)),
    TransitionSpec(_T.DECLINE,       (_S.PARTIAL_HIT,),            _S.MISS,        "hit_declined"),
    TransitionSpec(_T.REFUSE,        _REFUSABLE,                   _S.REFUSED,     "hit_refused"),
    TransitionSpec(_T.LOAD_VERIFIED, (_S.LOADING,),                _S.VERIFIED,    "load_verified"),
    TransitionSpec(_T.LOAD_FAILED,   (_S.LOADING,),                _S.TRUNCATED,   "load_truncated"),
    TransitionSpec(_T.RETRY,         (_S.TRUNCATED,),              _S.LOOKUP,      "retry_started", ("has_retry_budget",)),
    TransitionSpec(_T.GIVE_UP,       (_S.TRUNCATED,),              _S.REFUSED,     "retries_exhausted", ("retries_spent",)),
    TransitionSpec(_T.EVICT,         _LOAD_LIVE,                   _S.EVICTED,     "request_evicted"),
    # -- save side (per wave) ----------------------------------------------------------------------
    TransitionSpec(_T.START_PUT,     (_S.QUEUED,),                 _S.PUTTING,     "put_started"),
    TransitionSpec(_T.PUT_STORED,    (_S.PUTTING,),                _S.STORED,      "put_stored"),
    TransitionSpec(_T.PUT_FAILED,    (_S.PUTTING,),                _S.FAILED,      "put_failed"),
    TransitionSpec(_T.DROP,          (_S.QUEUED, _S.PUTTING),      _S.DROPPED,     "save_dropped"),
)
# fmt: on


_LOAD, _TRUNC = frozenset({ReplayCount.GROUP_HIT_OR_MISS}), frozenset({ReplayCount.TRUNCATION})
_CONSUMER, _PRODUCER = ("consumer", "pull"), ("producer", "push")
# fmt: off
#: One row per trigger: its ``detail`` fields, trace counterpart and replay counts.
TRIGGERS: Mapping[Trigger, TriggerRow] = {row.trigger: row for row in (
    TriggerRow(_T.START_LOOKUP,  ("session", "session_ttl_s", "session_end"), detail_optional=True),
    TriggerRow(_T.REASK,         ("num_tokens", "num_computed_tokens")),
    TriggerRow(_T.LOOKUP_HIT,    trace=("blocks_matched", *_CONSUMER), replay=_LOAD),
    TriggerRow(_T.LOOKUP_MISS,   ("reason",), detail_optional=True, trace=("blocks_matched", *_CONSUMER), replay=_LOAD),
    TriggerRow(_T.REVOKE,        ("reason", "epoch")),
    TriggerRow(_T.START_LOAD,    ("epoch", "fingerprint"), trace=("transfer_started", *_CONSUMER)),
    TriggerRow(_T.DECLINE,       ("reason",), detail_optional=True),
    TriggerRow(_T.REFUSE,        ("reason",), replay=frozenset({ReplayCount.ENDS_LOADS})),
    TriggerRow(_T.LOAD_VERIFIED, trace=("transfer_completed", *_CONSUMER), replay=frozenset({ReplayCount.GROUP_VERIFIED})),
    TriggerRow(_T.LOAD_FAILED,   ("planned_boundary", "retry_cap", "num_failed_entries", "num_invalid_keys",
                                  "num_transient_faults", "failed_groups"),
               trace=("transfer_failed", *_CONSUMER), replay=_TRUNC),
    TriggerRow(_T.RETRY,         ("max_boundary",), replay=frozenset({ReplayCount.RETRY})),
    TriggerRow(_T.GIVE_UP,       replay=frozenset({ReplayCount.ENDS_LOADS})),
    TriggerRow(_T.EVICT,         ("reason",), detail_optional=True),
    TriggerRow(_T.START_PUT,     trace=("transfer_started", *_PRODUCER)),
    TriggerRow(_T.PUT_STORED,    trace=("transfer_completed", *_PRODUCER)),
    TriggerRow(_T.PUT_FAILED,    ("num_stored_blocks", "num_blocks", "reasons"), trace=("transfer_failed", *_PRODUCER)),
    TriggerRow(_T.DROP,          ("reason",), detail_optional=True, trace=("transfer_failed", *_PRODUCER)),
)}
# fmt: on
assert set(TRIGGERS) == set(Trigger) == {spec.trigger for spec in TRANSITIONS}, (
    f"TRIGGERS, Trigger and TRANSITIONS name different triggers: rows {sorted(set(Trigger) - set(TRIGGERS))} "
    f"missing, table {sorted(set(Trigger) - {spec.trigger for spec in TRANSITIONS})} unused"
)
#: trigger -> the fields of its audit record's ``detail`` (triggers not listed carry none): ``TRIGGERS``'s.
DETAIL_FIELDS: Mapping[str, tuple[str, ...]] = {
    t.value: row.detail for t, row in TRIGGERS.items() if row.detail
}
#: ``DETAIL_FIELDS`` as sets (what ``LifecycleMachine.try_fire`` checks a record's ``detail`` against)
DETAIL_FIELD_SETS = {trigger: frozenset(fields) for trigger, fields in DETAIL_FIELDS.items()}
#: triggers whose record must carry its ``detail`` (not optional)
DETAIL_REQUIRED = frozenset(t.value for t, row in TRIGGERS.items() if row.detail and not row.detail_optional)


def transition_index() -> dict[tuple[str, State], TransitionSpec[State, Trigger]]:
    """``(trigger, source) -> row``; the table never has two rows for one pair."""
    index: dict[tuple[str, State], TransitionSpec[State, Trigger]] = {}
    for spec in TRANSITIONS:
        for source in spec.sources:
            assert (spec.trigger, source) not in index, (
                f"TRANSITIONS has two rows for trigger {spec.trigger!r} from {source.name}"
            )
            index[(spec.trigger, source)] = spec
    return index


#: ``transition_index()``, built once: the row a trigger runs from a state.
INDEX = transition_index()
#: trigger -> the states it leads to, in table order (named by ``IllegalTransition``).
TRIGGER_TO_DESTS: dict[str, tuple[str, ...]] = {}
for _spec in TRANSITIONS:
    TRIGGER_TO_DESTS.setdefault(_spec.trigger, ())
    if _spec.dest.name not in TRIGGER_TO_DESTS[_spec.trigger]:
        TRIGGER_TO_DESTS[_spec.trigger] += (_spec.dest.name,)


# -- the engine ---------------------------------------------------------------------------------------


class EngineState(enum.Enum):
    """The engine's states: whether what this engine's namespace holds may be served (the namespace gate)."""

    #: before the scheduler half finished starting (no record has this as its ``dst``)
    STARTING = "STARTING"
    #: lookups may ask the store and saves run, under the fingerprint of the latest record
    OPEN = "OPEN"
    #: a reset's removal runs: lookups miss, nothing is saved, the weights tag may rotate
    RESETTING = "RESETTING"
    #: the last removal raised (entries from before the reset may remain): closed until a reset succeeds
    FAILED = "FAILED"


class EngineTrigger(enum.StrEnum):
    """Every trigger of the engine's table (a ``str``: audit records carry the value)."""

    START = "start"
    BEGIN_RESET = "begin_reset"
    ROTATE_WEIGHTS = "rotate_weights"
    REMOVAL_RETURNED = "removal_returned"
    REOPEN = "reopen"
    FAIL = "fail"


#: One row of the engine's table (the same row type as the requests' table).
EngineTransitionSpec = TransitionSpec[EngineState, EngineTrigger]


@dataclass(frozen=True)
class EngineTriggerRow:
    """An engine trigger's audit ``detail`` fields (every record of it carries exactly these)."""

    trigger: EngineTrigger
    detail: tuple[str, ...] = ()


_E = EngineState
_ET = EngineTrigger
ENGINE_INITIAL = EngineState.STARTING
#: ``machine`` of every engine record (request and save records carry no ``machine`` field).
ENGINE_RECORD = "engine"
# fmt: off
ENGINE_TRANSITIONS: tuple[EngineTransitionSpec, ...] = (
    EngineTransitionSpec(_ET.START,            (_E.STARTING,),                     _E.OPEN,      "engine_started"),
    EngineTransitionSpec(_ET.BEGIN_RESET,      (_E.OPEN, _E.FAILED, _E.RESETTING), _E.RESETTING, "reset_started"),
    EngineTransitionSpec(_ET.ROTATE_WEIGHTS,   (_E.RESETTING,),                    _E.RESETTING, "weights_rotated"),
    EngineTransitionSpec(_ET.REMOVAL_RETURNED, (_E.RESETTING,),                    _E.RESETTING, "removal_returned",
                         ("removals_pending",)),
    EngineTransitionSpec(_ET.REOPEN,           (_E.RESETTING,),                    _E.OPEN,      "gate_opened",
                         ("no_removal_pending",)),
    EngineTransitionSpec(_ET.FAIL,             (_E.RESETTING,),                    _E.FAILED,    "gate_failed",
                         ("no_removal_pending",)),
)
#: One row per engine trigger: its ``detail`` fields.
ENGINE_TRIGGERS: Mapping[EngineTrigger, EngineTriggerRow] = {row.trigger: row for row in (
    EngineTriggerRow(_ET.START,            ("weights_source",)),
    EngineTriggerRow(_ET.BEGIN_RESET,      ("num_pending",)),
    EngineTriggerRow(_ET.ROTATE_WEIGHTS,   ("weights_source", "previous_fingerprint", "reason")),
    EngineTriggerRow(_ET.REMOVAL_RETURNED, ("ok", "num_pending")),
    EngineTriggerRow(_ET.REOPEN,           ()),
    EngineTriggerRow(_ET.FAIL,             ()),
)}
# fmt: on
assert set(ENGINE_TRIGGERS) == set(EngineTrigger) == {spec.trigger for spec in ENGINE_TRANSITIONS}, (
    "ENGINE_TRIGGERS, EngineTrigger and ENGINE_TRANSITIONS name different triggers"
)
#: engine trigger -> the fields of its audit record's ``detail``
ENGINE_DETAIL_FIELDS: Mapping[str, frozenset[str]] = {
    t.value: frozenset(row.detail) for t, row in ENGINE_TRIGGERS.items()
}


def engine_transition_index() -> dict[tuple[str, EngineState], EngineTransitionSpec]:
    """``(trigger, source) -> row`` of the engine's table; never two rows for one pair."""
    index: dict[tuple[str, EngineState], EngineTransitionSpec] = {}
    for spec in ENGINE_TRANSITIONS:
        for source in spec.sources:
            assert (spec.trigger, source) not in index, (
                f"ENGINE_TRANSITIONS has two rows for trigger {spec.trigger!r} from {source.name}"
            )
            index[(spec.trigger, source)] = spec
    return index


#: ``engine_transition_index()``, built once.
ENGINE_INDEX = engine_transition_index()
