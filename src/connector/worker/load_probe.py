"""The load profile a benchmark hangs into a worker: where async load jobs spend their time.

Production installs none: the worker's load path then times nothing for it (no clock reads, no lock, no
dict update). ``hybridkv bench ttft`` installs one through ``WorkerSide.install_load_probe`` and reads
:meth:`LoadProbe.totals` around each counted hit (see ``hybridkv_dev.bench.ttft``).
"""

from __future__ import annotations

import threading
import time

#: The phases of :meth:`LoadProbe.totals` (seconds, summed over load jobs), in time order.
LOAD_PHASES = ("queue_s", "targets_s", "store_s", "commit_s", "report_s")
#: The engine thread's side of :meth:`LoadProbe.totals` while loads are in flight.
ENGINE_PHASES = ("engine_steps", "engine_busy_s")


class LoadProbe:
    """Where async load jobs spend their time, summed over jobs since the probe was installed.

    :meth:`totals` keys: ``jobs``; ``queue_s`` from ``start_load`` to the load thread taking the job;
    ``targets_s`` building the destinations; ``store_s`` inside the store's ``get_into`` (read + verify);
    ``commit_s`` moving staged bytes into the pages; ``report_s`` from the job's end to the engine thread
    taking it in ``transfer_results``; ``engine_steps`` the engine's calls of ``transfer_results`` while
    loads were in flight, ``engine_busy_s`` its time between them (the engine thread's own step work, which
    holds the GIL the load threads need between system calls).

    Called from the load thread, its reader threads and the engine thread; thread-safe. Timestamps are
    ``time.perf_counter()`` values.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, float] = dict.fromkeys(("jobs", *LOAD_PHASES, *ENGINE_PHASES), 0.0)
        # request id -> when its load finished, until ``transfer_results`` reports it
        self._finished_at: dict[str, float] = {}
        # when ``transfer_results`` last returned with loads in flight, else None
        self._engine_back_at: float | None = None

    def totals(self) -> dict[str, float]:
        """A copy of the sums so far (see the class docstring)."""
        with self._lock:
            return dict(self._totals)

    def add(self, phase: str, seconds: float) -> None:
        """``seconds`` more in ``phase`` (one of :data:`LOAD_PHASES`, or ``jobs`` with a count)."""
        assert phase in self._totals, f"LoadProbe.add: unknown phase {phase!r}"
        with self._lock:
            self._totals[phase] += seconds

    def load_finished(self, req_id: str) -> None:
        """The load thread finished ``req_id``'s job: its ``report_s`` starts now."""
        now = time.perf_counter()
        with self._lock:
            self._finished_at[req_id] = now

    def engine_step_began(self) -> None:
        """``transfer_results`` was entered: the engine's time since its last return counts as busy."""
        now = time.perf_counter()
        with self._lock:
            if self._engine_back_at is not None:
                self._totals["engine_steps"] += 1
                self._totals["engine_busy_s"] += now - self._engine_back_at

    def engine_step_ended(self, reported: set[str], *, loads_in_flight: bool) -> None:
        """``transfer_results`` returns, handing ``reported`` over to vLLM."""
        now = time.perf_counter()
        with self._lock:
            for req_id in reported:
                at = self._finished_at.pop(req_id, None)
                if at is not None:
                    self._totals["report_s"] += now - at
            self._engine_back_at = now if loads_in_flight else None
