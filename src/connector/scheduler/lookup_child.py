"""The lookup process's side (``python -m hybridkv.connector.scheduler.lookup_process``): its store, the
``LookupService`` that runs the searches the parent sends, and its answers back.

The parent's side, the messages that cross the socket and the contracts both keep are in
:mod:`hybridkv.connector.scheduler.lookup_process`. Here:

- ``child_main`` ties the process's life to the parent's thread that started it (``PR_SET_PDEATHSIG`` on
  Linux; elsewhere the socket's end), opens its own client of the store, says ``ready`` and serves until
  ``None`` or the socket closes;
- the existence facts of each request's searches live here, per request and facts epoch (a new epoch
  drops them; ``forget`` drops a finished request's);
- every round's breaker outcome, each store call's start and end, and ``alive`` while the worker computes
  and sends nothing else (at most every quarter budget) go to the parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from hybridkv.connector.scheduler.lookup_service import LookupService, LookupTask
from hybridkv.lifecycle.lookup import LookupSearch, portable_result
from hybridkv.store.breaker import CircuitBreaker

if TYPE_CHECKING:
    from hybridkv.lifecycle.keys import KeyScheme
    from hybridkv.store.base import Store

__all__ = ["child_main"]

#: Linux ``prctl`` option: the signal the kernel sends a process when the thread that started it ends.
_PR_SET_PDEATHSIG = 1


class _ReportingBreaker(CircuitBreaker):
    """The child's lookup breaker: every outcome also goes to the parent's (``breaker`` messages)."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None], *, num_failures_to_open: int, reset_s: float):
        super().__init__(num_failures_to_open=num_failures_to_open, reset_s=reset_s)
        self._send = send

    def on_success(self) -> None:
        super().on_success()
        self._send(("breaker", True))

    def on_failure(self) -> None:
        super().on_failure()
        self._send(("breaker", False))


class _LookupChild:
    """The lookup process's state: its store, its ``LookupService``, the schemes and facts it was sent."""

    def __init__(self, conn: Connection, store: Store, budget_s: float, breaker: tuple[int, float]) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()
        self._alive_every_s = budget_s / 4.0
        self._alive_sent_s = time.monotonic()
        self.store = store
        self.schemes: dict[int, KeyScheme] = {}
        #: request_id -> (facts epoch, key -> present)
        self.facts: dict[str, tuple[int, dict[str, bool]]] = {}
        #: request_id -> its search in flight; id(task) -> the parent's sequence number for it
        self._task_of: dict[str, LookupTask] = {}
        self._seq_of: dict[int, int] = {}
        self._tasks_lock = threading.Lock()  # the worker finishes tasks while the main thread submits them
        self.service = LookupService(
            store,
            breaker=_ReportingBreaker(self.send, num_failures_to_open=breaker[0], reset_s=breaker[1]),
            budget_s=budget_s,
            on_finish=self._on_finish,
            on_store_call=lambda started_s, num_keys: self.send(("call", started_s, num_keys)),
            on_progress=self._progress,
        )

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock, contextlib.suppress(OSError):  # the parent gone: ``serve`` ends too
            self.conn.send(message)

    def _progress(self) -> None:
        """The worker computes: tell the parent it is alive (it owes an answer and hears nothing else)."""
        now = time.monotonic()
        if now - self._alive_sent_s >= self._alive_every_s:
            self._alive_sent_s = now
            self.send(("alive",))

    def _on_finish(self, task: LookupTask) -> None:
        with self._tasks_lock:
            seq = self._seq_of.pop(id(task))
            if self._task_of.get(task.request_id) is task:
                del self._task_of[task.request_id]
        search = task.search
        if task.error is None and search.result is not None:
            error, portable = None, portable_result(search.result)
        else:
            error, portable = task.error or "the search ended without a result", None
        self.send(("done", seq, error, portable, search.num_round_trips, search.num_keys, task.store_s))

    def search(self, message: tuple[Any, ...]) -> None:
        (_, seq, request_id, epoch, scheme_id, block_hashes, num_tokens, num_computed, max_boundary,
         max_confirm_rounds, known_by_parent) = message  # fmt: skip
        held = self.facts.get(request_id)
        if held is None or held[0] != epoch:
            held = self.facts[request_id] = (epoch, {})
        known = held[1]
        known.update(known_by_parent)
        search = LookupSearch(
            self.schemes[scheme_id],
            block_hashes,
            num_tokens,
            num_computed,
            max_boundary=max_boundary,
            known=known,
            max_confirm_rounds=max_confirm_rounds,
        )
        task = LookupTask(request_id, search, (num_tokens, num_computed, max_boundary), facts_epoch=epoch)
        with self._tasks_lock:
            previous = self._task_of.get(request_id)
            if previous is not None:
                previous.cancelled = True  # the parent asked anew: it ignores the old answer
            self._task_of[request_id] = task
            self._seq_of[id(task)] = seq
        self.service.submit(task)

    def serve(self) -> None:
        """Take the parent's messages until ``None`` or its end of the socket closes."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            if message is None:
                return
            kind = message[0]
            if kind == "scheme":
                self.schemes[message[1]] = message[2]
            elif kind == "forget":
                self.facts.pop(message[1], None)
            elif kind == "search":
                self.search(message)


def _die_with_parent(parent_pid: int) -> bool:
    """Have the kernel kill this process when the thread that started it ends (Linux), even if it is
    stopped or stuck in a call then; False if that parent is already gone (it ended before this call)."""
    if sys.platform.startswith("linux"):
        # The thread that started it is the parent's sender, which stops the child itself before ending.
        # Should the call fail, the socket stays the only tie: a child that is not wedged ends at its EOF.
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # Reparented already: the parent died between the start and the prctl, so no signal will come.
    return os.getppid() == parent_pid


def child_main(
    fd: int, store_url: str, budget_s: float, breaker_failures: int, breaker_reset_s: float, parent_pid: int
) -> int:
    """The lookup process: searches from the parent (process ``parent_pid``) over socket ``fd``, answers
    back; ends with its parent."""
    if not _die_with_parent(parent_pid):
        return 0
    from hybridkv.store import open_store  # here: the parent never opens the child's client

    child = _LookupChild(Connection(fd), open_store(store_url), budget_s, (breaker_failures, breaker_reset_s))
    child.send(("ready",))
    try:
        child.serve()
    finally:
        child.service.close()
        child.store.close()
    return 0
