"""The scheduler half's breaker on layer-wise hits (``load_mode: layerwise``): one missed load deadline
withholds layer-wise hits for a cool-down, so a slow store stalls at most one step per cool-down. The loads
themselves, and why a missed deadline stalls a step, are :mod:`hybridkv.connector.worker.layerwise`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from hybridkv.connector.metadata import LoadResult
from hybridkv.connector.stats import StatsBox
from hybridkv.lifecycle.load import LoadOutcome
from hybridkv.store.breaker import BreakerState

#: After a layer-wise load missed its deadline, no layer-wise hit is offered for this long; each further
#: miss right after a cool-down doubles it, up to ``LAYERWISE_MAX_COOL_DOWN_S``; a verified load resets it.
LAYERWISE_COOL_DOWN_S = 10.0
LAYERWISE_MAX_COOL_DOWN_S = 320.0
#: The audit reason of a hit withheld while the breaker is open (``hit_declined``).
LAYERWISE_PAUSED = "layer-wise hits paused: a load missed its deadline"


class LayerwiseBreaker:
    """The scheduler half's breaker on layer-wise hits, fed by the layer-wise loads' outcomes (scheduler
    thread only).

    ``CLOSED``: hits are offered. One load with an entry answered ``TIMEOUT`` (the step missed
    ``LAYERWISE_WAIT_S`` and was abandoned, or the store's own deadline passed) opens it: ``OPEN``, hits
    are withheld for the cool-down. Then ``HALF_OPEN``: hits are offered again; a verified load closes it
    (and resets the cool-down), another miss opens it for twice as long (up to
    ``LAYERWISE_MAX_COOL_DOWN_S``). No probe slot is held, so none can leak: a half-open breaker whose hit
    never loads (declined, aborted) stays half-open. Outcomes other than ``TIMEOUT`` and ``OK`` (a missing or
    corrupt entry, a transport error) say nothing about the store's speed and change nothing.
    """

    def __init__(self, stats: StatsBox, clock: Callable[[], float] = time.monotonic) -> None:
        self._stats = stats
        #: monotonic seconds; tests pass their own
        self.clock = clock
        self._state = BreakerState.CLOSED
        self._cool_down_s = LAYERWISE_COOL_DOWN_S
        self._open_until = 0.0

    @property
    def state(self) -> BreakerState:
        """``OPEN`` until the cool-down has passed, then ``HALF_OPEN`` until the next outcome."""
        if self._state is BreakerState.OPEN and self.clock() >= self._open_until:
            return BreakerState.HALF_OPEN
        return self._state

    def may_offer(self) -> bool:
        """Whether a layer-wise hit may be offered now (closed or half-open)."""
        return self.state is not BreakerState.OPEN

    def on_load_results(self, loads: Iterable[Sequence[LoadResult]]) -> None:
        """One step's load results (each job's entries, any ranks): a deadline missed opens the breaker,
        else a verified load closes it."""
        missed = loaded = False
        for results in loads:
            if any(r.outcome is LoadOutcome.TIMEOUT for r in results):
                missed = True
            elif results and all(r.outcome is LoadOutcome.OK for r in results):
                loaded = True
        if missed:
            self._open()
        elif loaded:
            self._state, self._cool_down_s = BreakerState.CLOSED, LAYERWISE_COOL_DOWN_S

    def _open(self) -> None:
        state = self.state
        if state is BreakerState.OPEN:
            return  # results of hits offered before it opened: the cool-down stands
        if state is BreakerState.HALF_OPEN:
            self._cool_down_s = min(2.0 * self._cool_down_s, LAYERWISE_MAX_COOL_DOWN_S)
        self._state, self._open_until = BreakerState.OPEN, self.clock() + self._cool_down_s
        self._stats.add("layerwise_breaker_opens")  # the workers logged the miss (``LAYERWISE_OVER_BUDGET``)
