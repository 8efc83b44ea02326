"""Lookups off vLLM's scheduler thread: one worker thread drives every search in flight.

A search (``hybridkv.lifecycle.lookup.LookupSearch``) needs a few rounds of existence checks. The worker
runs rounds; each round asks the store ONE batched ``exists`` with the keys of every search in flight (the
lookups of all requests queued in one step share the call, and a request queued later joins the next
round). The scheduler thread never waits on the store: it submits a ``LookupTask`` and polls ``done``.

Contracts:

- A task's search (and its ``known`` facts) is written only by the worker while the task is in flight;
  the scheduler reads it only once ``done`` is set (under the service's lock), or after abandoning it.
- A store error, or a round slower than the budget, is a failure for the circuit breaker; while the breaker
  rejects calls, tasks finish with ``error`` at once (the scheduler answers "miss").
- ``stalled()``: a store call has been in flight longer than the budget (a hung store). The scheduler then
  answers "miss" for new lookups without queueing them behind it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
from hybridkv.lifecycle.lookup import LookupSearch
from hybridkv.store.breaker import Admission, CircuitBreaker

if TYPE_CHECKING:
    from hybridkv.store.base import Store

log = structlog.get_logger(__name__)

__all__ = ["MAX_KEYS_PER_ROUND", "LookupService", "LookupTask"]

#: Keys of one batched ``exists``; searches beyond it wait for the next round (one search may exceed it).
MAX_KEYS_PER_ROUND = 16384


@dataclass(eq=False)
class LookupTask:
    """One search in flight for one request. ``done`` is set once: then ``search.result`` or ``error``."""

    request_id: str
    search: LookupSearch
    #: (num_tokens, num_computed_tokens, max_boundary) the search answers for.
    inputs: tuple[int, int, int | None]
    submitted_s: float = field(default_factory=time.monotonic)
    #: seconds of store calls this search has waited for (its CPU work and queueing do not count)
    store_s: float = 0.0
    done: bool = False
    cancelled: bool = False
    error: str | None = None


class LookupService:
    """A daemon worker thread batching the existence checks of every lookup in flight."""

    def __init__(self, store: Store, *, breaker: CircuitBreaker, budget_s: float) -> None:
        self.store = store
        self.breaker = breaker
        self.budget_s = budget_s
        self._cond = threading.Condition()
        self._queue: list[LookupTask] = []
        self._active: list[LookupTask] = []
        self._call_started_s: float | None = None
        self._closed = False
        self.num_exists_calls = 0
        self.num_keys_checked = 0
        self.num_searches = 0
        #: (round trips, keys) of recently finished searches: what one lookup costs the store.
        self.recent_costs: deque[tuple[int, int]] = deque(maxlen=4096)
        self._thread = threading.Thread(target=self._run, name="hybridkv-lookup", daemon=True)
        self._thread.start()

    def submit(self, task: LookupTask) -> None:
        with self._cond:
            assert not self._closed, "LookupService.submit after close"
            self._queue.append(task)
            self._cond.notify()

    def stalled(self, now: float | None = None) -> bool:
        """Whether the store call in flight has been running longer than the budget (a hung store)."""
        started = self._call_started_s
        return started is not None and (time.monotonic() if now is None else now) - started > self.budget_s

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no search is queued or in flight (tests, benches); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for task in self._queue:
                task.cancelled = True
            self._cond.notify_all()

    # -- worker -----------------------------------------------------------------------------------------

    def _finish(self, task: LookupTask, error: str | None = None) -> None:
        task.error = error
        if error is None:
            self.num_searches += 1
            self.recent_costs.append((task.search.num_round_trips, task.search.num_keys))
        task.done = True

    def _run(self) -> None:
        while True:
            with self._cond:
                self._active = [t for t in self._active if not t.done]
                if not self._active:
                    self._cond.notify_all()  # idle: wake wait_idle
                while not self._queue and not self._active and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                self._active.extend(self._queue)
                self._queue.clear()
                active = list(self._active)
            self._round(active)

    def _round(self, active: list[LookupTask]) -> None:
        # The searches' CPU work runs outside the lock (a task is the worker's alone while in flight), so
        # ``submit`` from the scheduler thread never waits for it; ``sleep(0)`` hands the GIL back to the
        # scheduler thread between searches.
        batch: list[tuple[LookupTask, tuple[str, ...]]] = []
        union: dict[str, None] = {}
        finished: list[tuple[LookupTask, str | None]] = []
        for task in active:
            if task.cancelled:
                finished.append((task, "cancelled"))
                continue
            task_keys = task.search.next_keys()
            time.sleep(0)
            if task_keys is None:
                finished.append((task, None))
            elif batch and len(union) + len(task_keys) > MAX_KEYS_PER_ROUND:
                continue  # next round: one call stays short, so it is not mistaken for a hung store
            else:
                batch.append((task, task_keys))
                union.update(dict.fromkeys(task_keys))
        if batch and self.breaker.before_call() is Admission.REJECT:
            finished.extend((task, "circuit open") for task, _ in batch)
            batch = []
        if finished:
            with self._cond:
                for task, error in finished:
                    self._finish(task, error)
        if not batch:
            return
        keys = list(union)
        started = time.monotonic()
        self._call_started_s = started
        try:
            statuses = self.store.exists(keys)
            assert len(statuses) == len(keys), (
                f"exists() returned {len(statuses)} results for {len(keys)} keys"
            )
        except Exception as exc:  # noqa: BLE001 -- a store error is a miss for these lookups, never a crash
            self.breaker.on_failure()
            log.warning("hybridkv lookup round failed", error=repr(exc), num_keys=len(keys))
            with self._cond:
                for task, _ in batch:
                    self._finish(task, f"store error: {exc!r}")
            return
        finally:
            self._call_started_s = None
        elapsed = time.monotonic() - started
        if elapsed > self.budget_s:
            self.breaker.on_failure()  # slow: a few in a row open the circuit
        else:
            self.breaker.on_success()
        present = {key: status.is_ok for key, status in zip(keys, statuses)}
        self.num_exists_calls += 1
        self.num_keys_checked += len(keys)
        for task, task_keys in batch:
            task.store_s += elapsed
            if not task.cancelled:
                task.search.feed(task_keys, [present[key] for key in task_keys])
