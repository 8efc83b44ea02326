"""A circuit breaker and a deadline runner: how a dead or hung store costs one budget, not one per call.

A dead Mooncake master makes every call block ~4.3 s; a hung one 30 s (or ``MC_RPC_TIMEOUT_MS``). The
scheduler must not wait that long per lookup (hard rule 8). ``DeadlineRunner`` bounds one call's wait;
``CircuitBreaker`` turns repeated failures into instant failures until a probe succeeds.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

T = TypeVar("T")


class BreakerState(enum.Enum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls fail fast until the reset interval has passed
    HALF_OPEN = "half_open"  # one probe call goes through; its outcome closes or reopens the breaker


class Admission(enum.Enum):
    """What ``CircuitBreaker.before_call`` lets a caller do."""

    CALL = "call"  # closed: call the store
    PROBE = "probe"  # half-open: this caller is the one probe
    REJECT = "reject"  # open (or a probe is in flight): fail fast without calling the store


class CircuitBreaker:
    """Counts consecutive failures; ``num_failures_to_open`` of them open it for ``reset_s`` seconds.

    Usage per call: ``admission = breaker.before_call()``; on ``REJECT`` fail fast without touching the
    store; otherwise make the call and report ``on_success()`` or ``on_failure()``. While half-open
    exactly one caller (the probe) is allowed through; the others fail fast until it reports.
    """

    def __init__(self, *, num_failures_to_open: int, reset_s: float) -> None:
        assert num_failures_to_open >= 1, f"num_failures_to_open must be >= 1, got {num_failures_to_open}"
        self.num_failures_to_open = num_failures_to_open
        self.reset_s = reset_s
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._num_consecutive_failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False
        self.num_failures = 0
        self.num_fast_failures = 0
        self.num_opens = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._state is BreakerState.OPEN and time.monotonic() - self._opened_at >= self.reset_s:
                return BreakerState.HALF_OPEN
            return self._state

    def before_call(self) -> Admission:
        """Whether the caller may call the store now, and whether as the half-open probe."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return Admission.CALL
            if self._state is BreakerState.OPEN and time.monotonic() - self._opened_at >= self.reset_s:
                self._state = BreakerState.HALF_OPEN
            if self._state is BreakerState.HALF_OPEN and not self._probe_in_flight:
                self._probe_in_flight = True
                return Admission.PROBE
            self.num_fast_failures += 1
            return Admission.REJECT

    def on_success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._num_consecutive_failures = 0
            self._probe_in_flight = False

    def on_failure(self) -> None:
        with self._lock:
            self.num_failures += 1
            self._num_consecutive_failures += 1
            was_probe = self._state is BreakerState.HALF_OPEN
            self._probe_in_flight = False
            if was_probe or self._num_consecutive_failures >= self.num_failures_to_open:
                if self._state is not BreakerState.OPEN:
                    self.num_opens += 1
                self._state = BreakerState.OPEN
                self._opened_at = time.monotonic()

    def snapshot(self) -> dict[str, object]:
        state = self.state
        with self._lock:
            return {
                "breaker_state": state.value,
                "breaker_consecutive_failures": self._num_consecutive_failures,
                "breaker_failures": self.num_failures,
                "breaker_fast_failures": self.num_fast_failures,
                "breaker_opens": self.num_opens,
            }


class DeadlineExceeded(Exception):
    """The call did not finish within its deadline; it keeps running in a worker thread.

    ``done`` resolves when the call really returns: until then it may still use the buffers it was given.
    """

    def __init__(self, message: str, done: Future[object]) -> None:
        super().__init__(message)
        self.done = done


class DeadlineRunner:
    """Runs blocking calls on daemon worker threads and waits at most a deadline for each.

    A call that misses its deadline cannot be cancelled (it is blocked in C); its worker stays busy until
    the call returns, and new workers are started (up to ``max_workers``) so callers are not queued behind
    it. Daemon threads: a hung call never blocks interpreter exit.
    """

    def __init__(self, *, name: str, max_workers: int = 8) -> None:
        self._name = name
        self._max_workers = max_workers
        self._jobs: queue.SimpleQueue[tuple[Future[object], Callable[[], object]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._num_workers = 0
        self._num_idle = 0
        self.num_abandoned = 0

    def run(self, call: Callable[[], T], timeout_s: float) -> T:
        """Return ``call()``'s result, re-raise what ``call()`` raised, or raise ``DeadlineExceeded`` after
        ``timeout_s`` seconds. Only an expired wait is a missed deadline (counted in ``num_abandoned``): a
        call that itself raises ``TimeoutError`` (on Python 3.11+ the class ``concurrent.futures`` raises
        at a timeout) has failed, and that ``TimeoutError`` is re-raised like any other exception."""
        future: Future[object] = Future()
        with self._lock:
            if self._num_idle == 0 and self._num_workers < self._max_workers:
                self._num_workers += 1
                self._num_idle += 1
                threading.Thread(
                    target=self._work, name=f"{self._name}-{self._num_workers}", daemon=True
                ).start()
            self._num_idle -= 1  # reserve an idle worker (possibly negative: the job waits in the queue)
        self._jobs.put((future, call))
        try:
            # ``exception()`` raises only for the wait; the call's own exceptions come back as values, so a
            # call raising TimeoutError is not mistaken for an expired deadline (``result()`` raises both).
            error = future.exception(timeout=timeout_s)
        except FutureTimeout:
            with self._lock:
                self.num_abandoned += 1
            raise DeadlineExceeded(f"call did not finish within {timeout_s:.3f} s", future) from None
        if error is not None:
            raise error
        return future.result()  # type: ignore[return-value]

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, call = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as error:  # noqa: BLE001 -- delivered to the caller, who re-raises it
                    future.set_exception(error)
            with self._lock:
                self._num_idle += 1

    def shutdown(self) -> None:
        """Ask idle workers to exit (busy ones exit after their call)."""
        with self._lock:
            num_workers = self._num_workers
            self._num_workers = 0
        for _ in range(num_workers):
            self._jobs.put(None)
