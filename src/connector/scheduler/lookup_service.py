"""Lookups off vLLM's scheduler thread: one worker thread drives every search in flight.

A search (``hybridkv.lifecycle.lookup.LookupSearch``) needs a few rounds of existence checks. The worker
runs rounds; each round asks the store ONE batched ``exists`` with the keys of every search in flight (the
lookups of all requests queued in one step share the call, and a request queued later joins the next
round). The scheduler thread never waits on the store: it submits a ``LookupTask`` and polls ``done``.

Contracts:

- A task's search (and its ``known`` facts) is written only by the worker while the task is in flight;
  the scheduler reads it only once ``done`` is set (``_finish`` writes the outcome before ``done``), or
  after abandoning it. ``submit`` never blocks: the scheduler thread never waits for the worker.
- A store error, or a round slower than the budget, is a failure for the circuit breaker; while the breaker
  rejects calls, tasks finish with ``error`` at once (the scheduler answers "miss").
- ``stalled()``: a store call has been in flight longer than the budget (a hung store). The scheduler then
  answers "miss" for new lookups without queueing them behind it.
"""

from __future__ import annotations

import itertools
import operator
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import structlog
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.lifecycle.lookup import LookupSearch
from hybridkv.store.base import Status
from hybridkv.store.breaker import Admission, CircuitBreaker

if TYPE_CHECKING:
    from hybridkv.store.base import Store

log = structlog.get_logger(__name__)

__all__ = ["MAX_KEYS_PER_ROUND", "LookupRunner", "LookupService", "LookupTask"]

#: Keys of one batched ``exists``; searches beyond it wait for the next round (one search may exceed it).
MAX_KEYS_PER_ROUND = 16384

#: How long the worker sleeps between pieces of its CPU work. CPython hands the GIL to a waiting thread
#: only when the holder releases it or after the switch interval (5 ms by default): a search's key work
#: (a few ms at 128K tokens) would otherwise stall vLLM's scheduler thread for up to a whole interval.
#: ``sleep(0)`` does not reliably hand it over (the sleeper takes it back before the waiter wakes up).
GIL_HANDOFF_S = 0.0001
#: CPU work the worker does between two hand-offs. Short lookups never hand off: each hand-off costs up
#: to a switch interval when the engine thread is busy, and a lookup of a few thousand tokens is done in
#: well under this.
SLICE_S = 0.0005


@dataclass(eq=False)
class LookupTask:
    """One search in flight for one request. ``done`` is set once: then ``search.result`` or ``error``."""

    request_id: str
    search: LookupSearch
    #: (num_tokens, num_computed_tokens, max_boundary) the search answers for.
    inputs: tuple[int, int, int | None]
    #: which of the request's fact sets the search builds on (``RequestState.facts_epoch``): a lookup
    #: process keeps each request's facts itself and drops them when this changes
    facts_epoch: int = 0
    submitted_s: float = field(default_factory=time.monotonic)
    #: seconds of store calls this search has waited for (its CPU work and queueing do not count)
    store_s: float = 0.0
    done: bool = False
    cancelled: bool = False
    error: str | None = None


class LookupRunner(Protocol):
    """What the scheduler half calls on its lookups: ``LookupService`` (a thread of this process) or
    ``hybridkv.connector.scheduler.lookup_process.ProcessLookupService`` (a process of its own)."""

    #: Whether the searches' facts live in this process (the scheduler may answer from them).
    local_facts: bool
    #: The longest an engine step that scheduled nothing waits for a lookup in flight (``wait_for_progress``).
    idle_step_wait_s: float
    num_exists_calls: int
    num_keys_checked: int
    num_searches: int
    recent_costs: deque[tuple[int, int]]

    def submit(self, task: LookupTask) -> None: ...

    def stalled(self, now: float | None = None) -> bool: ...

    def wait_idle(self, timeout_s: float) -> bool: ...

    def wait_for_progress(self, timeout_s: float) -> None: ...

    def wait_ready(self, timeout_s: float) -> bool: ...

    def forget(self, request_id: str) -> None: ...

    def close(self) -> None: ...


class LookupService:
    """A daemon worker thread batching the existence checks of every lookup in flight."""

    #: The searches' existence facts live in this process (``RequestState.known``): the scheduler may
    #: answer from them without a store call. A lookup process keeps them in its own.
    local_facts = True
    #: An idle engine step waits up to this for a lookup in flight: vLLM's engine loop would otherwise spin
    #: through empty steps, taking the GIL back from the worker for a switch interval each time it lets it
    #: go (docs/performance.md, "Lookups and vLLM's scheduler").
    idle_step_wait_s = 0.002

    def __init__(
        self,
        store: Store,
        *,
        breaker: CircuitBreaker,
        budget_s: float,
        on_finish: Callable[[LookupTask], None] | None = None,
        on_store_call: Callable[[float | None, int], None] | None = None,
        on_progress: Callable[[], None] | None = None,
    ) -> None:
        """``on_finish(task)``: called on the worker right after a task is done (a lookup process answers
        its parent from there). ``on_store_call(started_s, num_keys)``: before each ``exists``
        (``time.monotonic()`` start) and after it (``None``). ``on_progress()``: on the worker, at every
        hand-off of the GIL in its CPU work (at least every ``SLICE_S`` of it): a lookup process tells its
        parent from there that it is alive while it computes and sends nothing else."""
        self.store = store
        self._on_finish = on_finish
        self._on_store_call = on_store_call
        self._on_progress = on_progress
        self.breaker = breaker
        self.budget_s = budget_s
        # The scheduler thread only ever puts here: ``SimpleQueue.put`` never blocks and never gives up
        # the GIL, so a submit cannot wait for the worker (a lock shared with the worker could, for as
        # long as the OS keeps the worker off a core while it holds it).
        self._inbox: queue.SimpleQueue[LookupTask | None] = queue.SimpleQueue()
        self._idle = threading.Condition()  # notified by the worker as tasks finish (``wait_idle``)
        self._num_submitted = 0  # written by the submitting (scheduler) thread only
        self._num_retired = 0  # finished or cancelled tasks; written by the worker only
        self._call_started_s: float | None = None
        self._slice_started_s = time.perf_counter()  # the worker's, since its last wait or hand-off
        self._closed = False
        self.num_exists_calls = 0
        self.num_keys_checked = 0
        self.num_searches = 0
        #: (round trips, keys) of recently finished searches: what one lookup costs the store.
        self.recent_costs: deque[tuple[int, int]] = deque(maxlen=4096)
        self._thread = threading.Thread(target=self._run, name="hybridkv-lookup", daemon=True)
        self._thread.start()

    def submit(self, task: LookupTask) -> None:
        """Queue ``task`` without waiting; its search's CPU work then runs on the worker, in slices
        (``LookupSearch.pause``)."""
        assert not self._closed, "LookupService.submit after close"
        task.search.pause = self._pause
        self._num_submitted += 1
        self._inbox.put(task)

    def stalled(self, now: float | None = None) -> bool:
        """Whether the store call in flight has been running longer than the budget (a hung store)."""
        started = self._call_started_s
        return started is not None and (time.monotonic() if now is None else now) - started > self.budget_s

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until every task submitted before the call has finished (tests, benches); False on
        timeout."""
        target = self._num_submitted
        with self._idle:
            return self._idle.wait_for(lambda: self._num_retired >= target, timeout_s)

    def wait_for_progress(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` until a submitted task finishes; at once when none is in flight.

        For an engine step that scheduled nothing: vLLM's engine loop then spins through empty steps
        while requests wait for their lookups, and the spinning thread takes the GIL back for a whole
        switch interval each time the worker gives it up (for a store call, a hand-off). Waiting here
        releases it, so the lookups run at full speed while the engine has nothing else to do.
        """
        with self._idle:
            retired = self._num_retired
            if retired >= self._num_submitted:
                return
            self._idle.wait_for(lambda: self._num_retired != retired, timeout_s)

    def wait_ready(self, timeout_s: float) -> bool:
        """Always ready: the worker thread runs from construction on."""
        return True

    def forget(self, request_id: str) -> None:
        """The request finished: nothing to drop here (its facts live in its ``RequestState``)."""

    def close(self) -> None:
        """Stop the worker; tasks not taken yet are cancelled (their ``done`` stays False)."""
        self._closed = True
        self._inbox.put(None)

    # -- worker -----------------------------------------------------------------------------------------

    def _pause(self) -> None:
        """Hand the GIL over if this thread has run ``SLICE_S`` since it last waited or handed it over."""
        if time.perf_counter() - self._slice_started_s >= SLICE_S:
            time.sleep(GIL_HANDOFF_S)
            self._slice_started_s = time.perf_counter()
            if self._on_progress is not None:
                self._on_progress()

    def _finish(self, task: LookupTask, error: str | None = None) -> None:
        task.error = error
        if error is None:
            self.num_searches += 1
            self.recent_costs.append((task.search.num_round_trips, task.search.num_keys))
        task.done = True
        if self._on_finish is not None:
            self._on_finish(task)

    def _take(self, active: list[LookupTask], *, block: bool) -> bool:
        """Move submitted tasks into ``active`` (waiting for one when ``block``); False once closed."""
        try:
            item = self._inbox.get(block=block)
            if block:
                self._slice_started_s = time.perf_counter()
            while True:
                if item is None:
                    return False
                active.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _run(self) -> None:
        active: list[LookupTask] = []
        while True:
            if not self._take(active, block=not active) or self._closed:
                while True:  # cancel what is left: nobody will drive it
                    try:
                        leftover = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if leftover is not None:
                        leftover.cancelled = True
                for task in active:
                    task.cancelled = True
                return
            try:
                self._round(active)
            except Exception as exc:  # a bug in one round must not end every later lookup
                log.exception(ConnectorLogEvent.LOOKUP_ROUND_FAILED, error=repr(exc), num_tasks=len(active))
                for task in active:
                    if not task.done:
                        self._finish(task, f"lookup worker error: {exc!r}")
            num_before = len(active)
            active[:] = [task for task in active if not task.done]
            if len(active) != num_before:
                with self._idle:
                    self._num_retired += num_before - len(active)
                    self._idle.notify_all()

    def _exists(self, keys: list[str], started: float) -> list[Status]:
        """One batched ``exists``, visible to ``stalled()`` (and ``on_store_call``) while in flight."""
        self._call_started_s = started
        if self._on_store_call is not None:
            self._on_store_call(started, len(keys))
        try:
            statuses = self.store.exists(keys)
            assert len(statuses) == len(keys), (
                f"exists() returned {len(statuses)} results for {len(keys)} keys"
            )
            return statuses
        finally:
            self._call_started_s = None
            if self._on_store_call is not None:
                self._on_store_call(None, len(keys))

    def _round(self, active: list[LookupTask]) -> None:
        # The searches' CPU work runs outside the lock (a task is the worker's alone while in flight), so
        # ``submit`` from the scheduler thread never waits for it; a short sleep after each piece of it
        # hands the GIL to the scheduler thread if it is waiting (``GIL_HANDOFF_S``).
        batch: list[tuple[LookupTask, tuple[str, ...]]] = []
        union: dict[str, None] = {}
        finished: list[tuple[LookupTask, str | None]] = []
        for task in active:
            if task.cancelled:
                finished.append((task, "cancelled"))
                continue
            task_keys = task.search.next_keys()
            self._pause()
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
        for task, error in finished:
            self._finish(task, error)
        if not batch:
            return
        keys = list(union)
        started = time.monotonic()
        try:
            statuses = self._exists(keys, started)
        except Exception as exc:  # noqa: BLE001 -- a store error is a miss for these lookups, never a crash
            self.breaker.on_failure()
            log.warning(ConnectorLogEvent.LOOKUP_ROUND_FAILED, error=repr(exc), num_keys=len(keys))
            for task, _ in batch:
                self._finish(task, f"store error: {exc!r}")
            return
        elapsed = time.monotonic() - started
        if elapsed > self.budget_s:
            self.breaker.on_failure()  # slow: a few in a row open the circuit
        else:
            self.breaker.on_success()
        self._slice_started_s = time.perf_counter()  # it waited for the store (the GIL was free most of it)
        # C-level maps (thousands of keys): a Python loop here would hold the GIL without a pause.
        present = dict(zip(keys, map(operator.is_, statuses, itertools.repeat(Status.OK)), strict=True))
        self.num_exists_calls += 1
        self.num_keys_checked += len(keys)
        for task, task_keys in batch:
            task.store_s += elapsed
            if not task.cancelled:
                task.search.feed(task_keys, list(map(present.__getitem__, task_keys)))
                self._pause()
