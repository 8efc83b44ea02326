"""Lookups in a process of their own (``lookup_process: true``): off the engine's interpreter.

:class:`~hybridkv.connector.scheduler.lookup_service.LookupService` runs every search on a thread of the engine's own
process, so its Python work and the store binding's (Mooncake converts thousands of keys while it holds the
GIL) compete with vLLM's scheduler thread for one interpreter lock: a scheduler step that wants the GIL
back may wait up to the interpreter's switch interval (docs/performance.md, "Lookups and vLLM's
scheduler"). :class:`ProcessLookupService` answers to the same calls, and runs the same ``LookupService``
in a child process (``python -m hybridkv.connector.scheduler.lookup_process``) over its own client of the same store:
``file://`` and ``mooncake://`` are shared across processes (the child's Mooncake client mounts no segment;
``memory://`` cannot be, and the configuration refuses it). This module is the parent's side (and the
child's entry point); the child's side is :mod:`hybridkv.connector.scheduler.lookup_child`.

What crosses the socket between the two (pickled messages):

- to the child: a search (the request's block hashes, token counts, retry cap and confirm rounds, its facts
  epoch and the facts the scheduler holds: the keys a truncated load proved bad), the key scheme once per
  scheme, a cancellation, a finished request (its facts are dropped), ``None`` to stop;
- to the parent: ``ready`` once its store is open, a search done (its result as plain integers, :func:`~hybridkv.lifecycle.lookup.
  portable_result`, or its error, its round trips, keys and store time), each store call's start and end
  (``stalled()``), each round's breaker outcome (replayed on the scheduler's lookup breaker), ``alive``
  while its worker computes and sends nothing else (at most every quarter budget).

Contracts (the thread service's, plus):

- ``submit`` never blocks and never waits on the child: it puts the task on a queue that a sender thread
  writes to the socket. A receiver thread reads the answers, rebuilds each result (in slices, handing the
  GIL over between them) and sets the task's ``done`` last, as the thread service does.
- The existence facts of a request's searches live in the child (``local_facts`` is false: the scheduler
  never answers from facts itself), per request and facts epoch; a new epoch (``RequestState.drop_facts``:
  a reset, an unavailable store) drops them, and ``forget`` drops a finished request's.
- A child that exits (killed, crashed) fails its searches in flight with ``error`` (the scheduler answers
  "miss"), counts a failure on the lookup breaker, and is started again at once (or, within the backoff,
  for the next search), at most once per ``RESTART_BACKOFF_S``; meanwhile searches fail at once. The engine
  never waits for a child.
- A child that owes an answer (a search in flight) and sends nothing for longer than the lookup budget
  (stopped, its worker thread dead, stuck in a call) is silent: ``stalled()`` is true, so new lookups miss
  at once and those waiting miss at their next ask; each search it leaves unanswered past the budget counts
  one failure on the lookup breaker; silent for ``WEDGED_BUDGETS`` budgets (at least ``MIN_WEDGED_S``), or
  not ready ``START_LIMIT_S`` after its start, it is killed (a watchdog thread of the parent's) and then
  replaced as a child that exits. Silence counts only once the child has opened its store.
- A child never outlives the thread that started it (on Linux: ``PR_SET_PDEATHSIG``), even a stopped or
  stuck one: an engine killed with ``SIGKILL`` leaves no lookup process behind. Elsewhere a child ends when
  its parent's end of the socket closes.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import structlog
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.scheduler.lookup_child import child_main
from hybridkv.connector.scheduler.lookup_service import GIL_HANDOFF_S, LookupTask
from hybridkv.lifecycle.lookup import LookupSearch, result_from_portable
from hybridkv.store.breaker import CircuitBreaker

if TYPE_CHECKING:
    from hybridkv.lifecycle.keys import KeyScheme

log = structlog.get_logger(__name__)

__all__ = [
    "MAX_RESTART_BACKOFF_S",
    "MIN_WEDGED_S",
    "RESTART_BACKOFF_S",
    "START_LIMIT_S",
    "WEDGED_BUDGETS",
    "ProcessLookupService",
    "child_main",
]

#: The shortest time between two starts of the lookup process (a child that dies at once is not restarted
#: in a loop); searches submitted meanwhile fail at once (a miss).
RESTART_BACKOFF_S = 1.0
#: The backoff doubles with each child that exits before answering a search, up to this.
MAX_RESTART_BACKOFF_S = 30.0
#: How long ``close`` waits for the child to exit before killing it.
_CLOSE_WAIT_S = 1.0
#: A ready child silent this many lookup budgets (at least ``MIN_WEDGED_S``) while it owes an answer is
#: killed and replaced. Far above the budget: a store call that is only slow keeps its child (lookups miss
#: meanwhile); one that never returns, a stopped child or a dead worker thread does not.
WEDGED_BUDGETS = 20
MIN_WEDGED_S = 2.0
#: A child that has not opened its store this long after its start (a store call hung at connect) is
#: killed and replaced; generous: a cold start imports the package and may connect to a remote store.
START_LIMIT_S = 60.0


@dataclass(eq=False)
class _Sent:
    """A search sent to a child and not answered yet."""

    task: LookupTask
    generation: int  # the child it was sent to
    sent_s: float  # ``time.monotonic()`` when it was sent
    counted: bool = False  # left unanswered past the budget: counted on the breaker (once)


class ProcessLookupService:
    """The lookup service's calls (``submit``, ``stalled``, ``wait_idle``, ``wait_for_progress``,
    ``forget``, ``close``) over a child process running ``LookupService`` on its own store client."""

    local_facts = False
    #: Also here: without the wait vLLM's engine loop spins through empty steps on a core the child needs
    #: (on 2 cores it lost a third of the hits to the lookup budget, docs/performance.md).
    idle_step_wait_s = 0.002

    def __init__(
        self,
        store_url: str,
        *,
        breaker: CircuitBreaker,
        budget_s: float,
        breaker_failures: int,
        breaker_reset_s: float,
    ) -> None:
        self.store_url = store_url
        self.breaker = breaker
        self.budget_s = budget_s
        self._breaker_args = (breaker_failures, breaker_reset_s)
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._num_submitted = 0  # the scheduler thread's
        self._num_retired = 0  # under ``_idle``
        self._next_seq = 0
        #: seq -> the search sent; written by the sender and the receiver
        self._in_flight: dict[int, _Sent] = {}
        self._in_flight_lock = threading.Lock()
        self._call_started_s: float | None = None
        #: Since when the current child, ready, owes a message: the send of its oldest unanswered search,
        #: moved on by every message it sends; None while it owes none (or has not opened its store yet).
        #: Written under ``_in_flight_lock``; read without it (``stalled``).
        self._owed_since: float | None = None
        self._ready_generation = 0  # the last child that opened its store
        self._closed = False
        self._ready = threading.Event()  # set once a child has opened its store
        #: a silent child's answer is this late when it is killed (``WEDGED_BUDGETS``)
        self.wedged_after_s = max(WEDGED_BUDGETS * budget_s, MIN_WEDGED_S)
        #: children killed for silence, and why (generation -> reason; the receiver logs it at the exit)
        self.num_wedged = 0
        self._kill_reasons: dict[int, str] = {}
        self.num_exists_calls = 0
        self.num_keys_checked = 0
        self.num_searches = 0
        self.num_process_starts = 0
        self.recent_costs: deque[tuple[int, int]] = deque(maxlen=4096)
        # The sender's (it starts children): the current child, its generation, when it was started.
        self._child: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._generation = 0
        self._dead_generations: set[int] = set()
        self._started_s = -MAX_RESTART_BACKOFF_S
        #: children that exited (or did not start) since one last answered a search
        self._num_failed_starts = 0
        self._schemes_sent: dict[int, KeyScheme] = {}  # id -> scheme (kept, so the id is not reused)
        self._sender = threading.Thread(target=self._send_loop, name="hybridkv-lookup-send", daemon=True)
        self._sender.start()
        self._outbox.put(("start",))  # start the child now: engine start-up hides its import time
        # Its own thread: the sender may be blocked writing to a stopped child whose socket buffer is full.
        self._wake = threading.Event()  # set when a search is sent or the child became ready, and at close
        self._watch_interval_s = max(budget_s / 4.0, 0.005)
        self._watchdog = threading.Thread(target=self._watch_loop, name="hybridkv-lookup-watch", daemon=True)
        self._watchdog.start()

    # -- the scheduler's calls --------------------------------------------------------------------------

    def submit(self, task: LookupTask) -> None:
        """Queue ``task`` for the child without waiting."""
        assert not self._closed, "ProcessLookupService.submit after close"
        self._num_submitted += 1
        self._outbox.put(("search", task))

    def stalled(self, now: float | None = None) -> bool:
        """Whether the child's store call in flight has been running longer than the budget, or the child
        has owed an answer that long without sending anything (silent: stopped, stuck)."""
        now = time.monotonic() if now is None else now
        started = self._call_started_s
        owed = self._owed_since
        return (started is not None and now - started > self.budget_s) or (
            owed is not None and now - owed > self.budget_s
        )

    def wait_idle(self, timeout_s: float) -> bool:
        target = self._num_submitted
        with self._idle:
            return self._idle.wait_for(lambda: self._num_retired >= target, timeout_s)

    def wait_for_progress(self, timeout_s: float) -> None:
        with self._idle:
            retired = self._num_retired
            if retired >= self._num_submitted:
                return
            self._idle.wait_for(lambda: self._num_retired != retired, timeout_s)

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until a child has opened its store (benches: measure lookups, not the child's start)."""
        return self._ready.wait(timeout_s)

    def forget(self, request_id: str) -> None:
        """The request finished: the child drops its facts."""
        if not self._closed:
            self._outbox.put(("forget", request_id))

    def close(self) -> None:
        """Stop the child (at most ``_CLOSE_WAIT_S``, then killed); searches in flight stay not done."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._outbox.put(None)
        self._sender.join(_CLOSE_WAIT_S + 1.0)
        child = self._child
        if child is not None and child.poll() is None:  # the sender is stuck writing to it
            child.kill()

    @property
    def child_pid(self) -> int | None:
        """The running child's process id (tests: kill it), or None."""
        child = self._child
        return child.pid if child is not None and child.poll() is None else None

    # -- sender thread ----------------------------------------------------------------------------------

    def _retire(self, task: LookupTask, error: str | None) -> None:
        task.error = error
        task.done = True
        with self._idle:
            self._num_retired += 1
            self._idle.notify_all()

    def _start_child(self) -> bool:
        """Start a child unless one runs or the backoff has not passed; False: none runs."""
        if self._child is not None and self._generation not in self._dead_generations:
            return True
        now = time.monotonic()
        # A child that keeps dying (a store it cannot open) is started less and less often.
        backoff_s = min(MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S * 2 ** max(self._num_failed_starts - 1, 0))
        if now - self._started_s < backoff_s:
            return False
        self._started_s = now
        if self._conn is not None:
            self._conn.close()  # the dead child's (its receiver thread has seen the end)
            self._conn = None
        parent_sock, child_sock = socket.socketpair()
        try:
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hybridkv.connector.scheduler.lookup_process",
                    str(child_sock.fileno()),
                    self.store_url,
                    repr(self.budget_s),
                    str(self._breaker_args[0]),
                    repr(self._breaker_args[1]),
                    str(os.getpid()),
                ],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            parent_sock.close()
            self._num_failed_starts += 1
            log.warning(ConnectorLogEvent.LOOKUP_PROCESS_EXITED, error=repr(exc), restarting=True)
            return False
        finally:
            child_sock.close()
        self._generation += 1
        self._child = child
        self._conn = Connection(parent_sock.detach())
        self._schemes_sent = {}
        self.num_process_starts += 1
        threading.Thread(
            target=self._receive_loop,
            args=(self._conn, self._generation, child),
            name=f"hybridkv-lookup-recv-{self._generation}",
            daemon=True,
        ).start()
        return True

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                self._stop_child()
                return
            kind = item[0]
            if kind == "start":
                self._start_child()
                continue
            if kind == "forget":
                if self._child is not None and self._generation not in self._dead_generations:
                    self._send(item)
                continue
            task: LookupTask = item[1]
            if task.cancelled:
                self._retire(task, "cancelled")
                continue
            if not self._start_child():
                self.breaker.on_failure()
                self._retire(task, "lookup process not running (restarting)")
                continue
            search: LookupSearch = task.search
            scheme_id = id(search.scheme)
            if scheme_id not in self._schemes_sent:
                self._schemes_sent[scheme_id] = search.scheme
                self._send(("scheme", scheme_id, search.scheme))
            seq = self._next_seq
            self._next_seq += 1
            now = time.monotonic()
            with self._in_flight_lock:
                self._in_flight[seq] = _Sent(task, self._generation, now)
                if self._owed_since is None and self._ready_generation == self._generation:
                    self._owed_since = now
            self._wake.set()
            facts = {key: present for key, present in search.known.items()}  # a truncation's bad keys
            self._send(
                (
                    "search",
                    seq,
                    task.request_id,
                    task.facts_epoch,
                    scheme_id,
                    search.block_hashes,
                    search.num_tokens,
                    search.num_computed_tokens,
                    search.max_boundary,
                    search.max_confirm_rounds,
                    facts,
                )
            )
            if self._generation in self._dead_generations:
                # The child died around the send; its receiver may have failed its searches before this
                # one was registered: fail it here unless the receiver already has.
                with self._in_flight_lock:
                    lost = self._in_flight.pop(seq, None)
                if lost is not None:
                    self._retire(task, "lookup process exited")

    def _send(self, message: tuple[Any, ...] | None) -> None:
        conn = self._conn
        if conn is None:
            return
        with contextlib.suppress(OSError):  # the child is gone: its receiver fails what was sent to it
            conn.send(message)

    def _stop_child(self) -> None:
        child, conn = self._child, self._conn
        if child is None or conn is None:
            return
        self._send(None)
        try:
            child.wait(_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(_CLOSE_WAIT_S)
        conn.close()

    # -- receiver threads (one per child) ---------------------------------------------------------------

    def _receive_loop(self, conn: Connection, generation: int, child: subprocess.Popen[bytes]) -> None:
        try:
            while True:
                message = conn.recv()
                self._on_message(message, generation)
        except (EOFError, OSError):
            pass
        finally:
            self._child_exited(generation, child)

    def _on_message(self, message: tuple[Any, ...], generation: int) -> None:
        now = time.monotonic()
        kind = message[0]
        if kind == "ready":
            self._ready_generation = generation
            self._ready.set()
            self._wake.set()  # searches sent before it was ready are owed from now
        elif kind == "call":
            _, started_s, num_keys = message
            self._call_started_s = started_s
            if started_s is None:
                self.num_exists_calls += 1
                self.num_keys_checked += num_keys
        elif kind == "breaker":
            if message[1]:
                self.breaker.on_success()
            else:
                self.breaker.on_failure()
        elif kind == "done":
            _, seq, error, portable, num_round_trips, num_keys, store_s = message
            with self._in_flight_lock:
                entry = self._in_flight.pop(seq, None)
                self._heard(generation, now)
            if entry is None:
                return
            self._num_failed_starts = 0
            task = entry.task
            search = task.search
            search.num_round_trips, search.num_keys = num_round_trips, num_keys
            task.store_s = store_s
            if error is None:
                search.result = result_from_portable(portable, search.scheme, search.block_hashes, _hand_off)
                self.num_searches += 1
                self.recent_costs.append((num_round_trips, num_keys))
            self._retire(task, error)
            return
        with self._in_flight_lock:
            self._heard(generation, now)

    def _heard(self, generation: int, now: float) -> None:
        """Under ``_in_flight_lock``: child ``generation`` sent a message at ``now``; the silence clock
        starts again (or stops: it owes nothing)."""
        if generation == self._generation:
            owes = self._ready_generation == generation and any(
                sent.generation == generation for sent in self._in_flight.values()
            )
            self._owed_since = now if owes else None

    def _child_exited(self, generation: int, child: subprocess.Popen[bytes]) -> None:
        self._dead_generations.add(generation)
        self._num_failed_starts += 1
        self._call_started_s = None
        with self._in_flight_lock:
            self._owed_since = None
        try:
            code: int | None = child.wait(_CLOSE_WAIT_S)  # reaped here: its socket closes as it exits
        except subprocess.TimeoutExpired:  # its end closed, yet it runs: it exits on its own or at close
            code = None
        with self._in_flight_lock:
            lost = [seq for seq, sent in self._in_flight.items() if sent.generation == generation]
            tasks = [self._in_flight.pop(seq).task for seq in lost]
        if self._closed:
            return
        self.breaker.on_failure()
        log.warning(
            ConnectorLogEvent.LOOKUP_PROCESS_EXITED,
            exit_code=code,
            killed=self._kill_reasons.pop(generation, None),
            num_lookups_failed=len(tasks),
            restarting=True,
        )
        for task in tasks:
            self._retire(task, f"lookup process exited (code {code})")
        self._outbox.put(("start",))  # replace it now (backoff permitting), not at the next search

    # -- watchdog thread --------------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        while not self._closed:
            # Asleep while no search is in flight; woken by the sender as one is sent.
            self._wake.wait(self._watch_interval_s if self._in_flight else None)
            self._wake.clear()
            if not self._closed:
                self._watch(time.monotonic())

    def _watch(self, now: float) -> None:
        """Count the searches a silent child leaves unanswered past the budget; kill a wedged child."""
        child, generation = self._child, self._generation
        if child is None or generation in self._dead_generations:
            return
        if self._ready_generation != generation:
            if self._in_flight and now - self._started_s > START_LIMIT_S:
                self._kill(child, generation, f"did not open its store in {START_LIMIT_S:.0f} s")
            return
        owed = self._owed_since
        if owed is None or now - owed <= self.budget_s:
            return
        with self._in_flight_lock:
            late = [
                sent
                for sent in self._in_flight.values()
                if sent.generation == generation and not sent.counted and now - sent.sent_s > self.budget_s
            ]
            for sent in late:
                sent.counted = True
        for _ in late:
            self.breaker.on_failure()
        if now - owed > self.wedged_after_s:
            self._kill(child, generation, f"answered nothing for {now - owed:.1f} s")

    def _kill(self, child: subprocess.Popen[bytes], generation: int, reason: str) -> None:
        """Kill a wedged child; its receiver sees the exit (fails its searches, starts another)."""
        if generation in self._kill_reasons:
            return
        self._kill_reasons[generation] = reason
        self.num_wedged += 1
        child.kill()  # SIGKILL: a stopped child dies too


def _hand_off() -> None:
    """Between slices of a result's rebuild: let a waiting scheduler thread have the GIL."""
    time.sleep(GIL_HANDOFF_S)


if __name__ == "__main__":
    sys.exit(
        child_main(
            int(sys.argv[1]),
            sys.argv[2],
            float(sys.argv[3]),
            int(sys.argv[4]),
            float(sys.argv[5]),
            int(sys.argv[6]),
        )
    )
