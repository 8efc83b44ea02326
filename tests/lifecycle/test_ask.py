"""One ask decided by the lifecycle (``decide_ask``): pure, the time passed in as a number.

The connector's tests (``tests/connector/test_async_lookup.py``, ``test_hit_never_allocated.py``, ...) drive
it through vLLM's scheduler; these pin the decisions themselves: the first ask starts a search and asks for
a store round, the wait is bounded from the first ask, a round's answer is taken once, and an answered hit
vLLM never allocates is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme
from hybridkv.lifecycle.ask import (
    Answered,
    AskLimits,
    FixedStoreView,
    LookupInputs,
    OverBudget,
    Searching,
    decide_ask,
)
from hybridkv.lifecycle.lookup import LookupSearch
from hybridkv.lifecycle.machine import LifecycleMachine, RequestLifecycle
from hybridkv.lifecycle.sink import MemoryAuditSink
from hybridkv.lifecycle.table import State

_SCHEME = KeyScheme(namespace="t", model="m", geometry=Geometry(groups=(GroupSpec.full(16),)))
_HASHES = [b"\x01" * 8] * 4
_STORE = FixedStoreView(gate_closed=False, usable=True, stalled=False, local_facts=True)
_LIMITS = AskLimits(budget_s=0.05, max_wait_s=5.0, max_unallocated_asks=2)


@dataclass
class _Round:
    """A store round as the connector's lookup worker reports it (``StoreRound``)."""

    search: LookupSearch
    inputs: LookupInputs
    store_s: float = 0.0
    done: bool = False
    error: str | None = None


def _lifecycle() -> tuple[RequestLifecycle, MemoryAuditSink]:
    sink = MemoryAuditSink()
    return LifecycleMachine(_SCHEME, sink=sink).new_request("r"), sink


def test_the_first_ask_starts_a_search_and_asks_for_a_round_then_the_round_answers() -> None:
    lc, sink = _lifecycle()
    first = decide_ask(
        lc,
        None,
        _HASHES,
        70,
        0,
        known={},
        block_hex=None,
        store_round=None,
        store=_STORE,
        limits=_LIMITS,
        now=1.0,
    )
    assert first.num_external is None and first.submit is not None and not first.fresh
    assert isinstance(first.ask, Searching) and first.ask.waiting_since == 1.0
    assert lc.current is State.LOOKUP
    store_round = _Round(first.submit, first.inputs)
    first.submit.run(lambda keys: [True] * len(keys))
    store_round.done = True
    second = decide_ask(
        lc, first.ask, _HASHES, 70, 0, known={}, block_hex=None, store_round=store_round, store=_STORE,
        limits=_LIMITS, now=1.01,
    )  # fmt: skip
    assert second.took_round and second.fresh and second.submit is None and second.num_external == 64
    assert second.ask == Answered((70, 0, None), 64)
    assert [r["event"] for r in sink.records][-1] == "hit_found"


def test_a_search_waiting_past_the_bound_is_a_miss_over_budget() -> None:
    lc, _ = _lifecycle()
    first = decide_ask(
        lc,
        None,
        _HASHES,
        70,
        0,
        known={},
        block_hex=None,
        store_round=None,
        store=_STORE,
        limits=_LIMITS,
        now=1.0,
    )
    assert first.submit is not None
    in_flight = _Round(first.submit, first.inputs, store_s=0.01)
    again = decide_ask(
        lc, first.ask, _HASHES, 70, 0, known={}, block_hex=None, store_round=in_flight, store=_STORE,
        limits=_LIMITS, now=2.0,
    )  # fmt: skip
    assert again.num_external is None and again.ask is first.ask and not again.took_round
    late = decide_ask(
        lc, first.ask, _HASHES, 70, 0, known={}, block_hex=None, store_round=in_flight, store=_STORE,
        limits=_LIMITS, now=6.5,
    )  # fmt: skip
    assert late.missed == "over lookup budget" and late.failure == OverBudget(0.01, 5.5, False)
    assert late.num_external == 0 and late.ask == Answered((70, 0, None), 0) and late.fresh
    assert lc.current is State.MISS


def test_a_hit_vllm_never_allocates_is_refused_after_the_limit() -> None:
    lc, sink = _lifecycle()
    search = lc.start_search(_HASHES, 70, 0)
    assert search is not None
    lc.finish_search(search.run(lambda keys: [True] * len(keys)))
    ask = Answered((70, 0, None), 64)
    for _ in range(_LIMITS.max_unallocated_asks):
        repeat = decide_ask(
            lc, ask, _HASHES, 70, 0, known={}, block_hex=None, store_round=None, store=_STORE, limits=_LIMITS,
            now=1.0,
        )  # fmt: skip
        assert repeat.num_external == 64 and repeat.ask is ask and not repeat.fresh
    refused = decide_ask(
        lc,
        ask,
        _HASHES,
        70,
        0,
        known={},
        block_hex=None,
        store_round=None,
        store=_STORE,
        limits=_LIMITS,
        now=1.0,
    )
    assert refused.declined == "vLLM did not allocate the hit in 2 asks" and refused.ask is None
    assert refused.num_external == 0 and lc.current is State.REFUSED
    assert sink.records[-1]["event"] == "hit_refused"
