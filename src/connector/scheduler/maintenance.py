"""Store calls nobody on the scheduler thread waits for: invalidation removes, namespace resets, the manifest.

Contracts:

- One thread, at most ``queue_size`` calls queued or running: when full, ``submit`` returns None (the
  caller counts it and goes on), so a stuck store never grows the queue without bound.
- ``on_done`` runs on the maintenance thread with the call's future, unless the call was cancelled at
  shutdown (nothing happened, nothing to report).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["MAINTENANCE_QUEUE", "Maintenance"]

#: Store maintenance calls queued or running at most.
MAINTENANCE_QUEUE = 64


class Maintenance:
    """A bounded, single-threaded queue of store calls that may take long."""

    def __init__(self, queue_size: int = MAINTENANCE_QUEUE) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybridkv-maintenance")
        self._slots = threading.BoundedSemaphore(queue_size)

    def submit(
        self, fn: Callable[[], Any], on_done: Callable[[concurrent.futures.Future[Any]], None]
    ) -> concurrent.futures.Future[Any] | None:
        """Run ``fn``, then ``on_done`` with its future; None when the queue is full or shut down."""
        if not self._slots.acquire(blocking=False):
            return None

        def done(fut: concurrent.futures.Future[Any]) -> None:
            try:
                if not fut.cancelled():
                    on_done(fut)
            finally:
                self._slots.release()

        try:
            fut = self._executor.submit(fn)
        except RuntimeError:  # shut down
            self._slots.release()
            return None
        fut.add_done_callback(done)
        return fut

    def wait(self, timeout: float) -> bool:
        """Wait until every call queued so far returned; False after ``timeout`` s or once shut down."""
        try:
            self._executor.submit(lambda: None).result(timeout=timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            return False
        return True

    def shutdown(self) -> None:
        """Cancel what has not started; never waits for a running call."""
        self._executor.shutdown(wait=False, cancel_futures=True)
