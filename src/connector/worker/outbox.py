"""What a worker rank still owes the scheduler: load verdicts and per-entry results, finished save jobs."""

from __future__ import annotations

import threading

from hybridkv.connector.metadata import HybridStoreWorkerMetadata, LoadResult, SaveResult


class Outbox:
    """What this rank still has to report to the scheduler: finished loads (for ``finished_recving`` /
    ``failed_recving``) and the per-entry results and finished save jobs (for the worker metadata).

    Filled by the transfer threads, emptied by the engine thread; thread-safe. A load's results go out in
    the worker metadata of the step that reported the load finished, never before: the scheduler judges a
    load only once vLLM knows it finished.

    It also counts the async loads owed (queued, not yet finished), under the same lock as the finished
    ones, so that :meth:`take_finished_loads` never sees a load neither owed nor finished.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Signalled when a load finishes; ``take_finished_loads`` waits on it briefly.
        self._load_finished = threading.Condition(self._lock)
        #: async loads queued and not finished yet
        self._num_loads_owed = 0
        #: request id -> whether its load succeeded, for loads not yet reported as finished
        self._finished_loads: dict[str, bool] = {}
        #: the results of those loads, held back until they are reported
        self._held_load_results: dict[str, list[LoadResult]] = {}
        self._load_results: dict[str, list[LoadResult]] = {}
        self._save_results: dict[int, list[SaveResult]] = {}
        self._finished_saves: list[int] = []

    @property
    def num_loads_owed(self) -> int:
        """Async loads queued and not finished yet."""
        with self._lock:
            return self._num_loads_owed

    def loads_queued(self, num_loads: int) -> None:
        """``num_loads`` async loads were queued: each is owed a :meth:`load_finished` with ``owed=True``."""
        with self._lock:
            self._num_loads_owed += num_loads

    def load_finished(self, req_id: str, ok: bool, results: list[LoadResult], *, owed: bool) -> None:
        """The load of ``req_id`` is over; ``owed``: it was counted by :meth:`loads_queued` (False: failed
        before it was queued)."""
        with self._lock:
            self._finished_loads[req_id] = ok
            self._held_load_results[req_id] = results
            if owed:
                assert self._num_loads_owed > 0, f"load of {req_id!r} finished, but no load was owed"
                self._num_loads_owed -= 1
            self._load_finished.notify_all()

    def load_judged(self, results: dict[str, list[LoadResult]]) -> None:
        """Layer-wise loads: vLLM learns their fate in this step's output, so their results go out now."""
        with self._lock:
            for req_id, load_results in results.items():
                self._load_results.setdefault(req_id, []).extend(load_results)

    def save_finished(self, job_id: int, results: list[SaveResult]) -> None:
        with self._lock:
            self._save_results.setdefault(job_id, []).extend(results)
            self._finished_saves.append(job_id)

    def take_finished_loads(self, wait_s: float) -> tuple[set[str], set[str], int]:
        """(finished, failed, loads still owed) since the last call; their results join the next metadata.

        While loads are owed and none has finished, first waits up to ``wait_s`` seconds for one."""
        with self._lock:
            if self._num_loads_owed and not self._finished_loads:
                self._load_finished.wait(wait_s)
            done, self._finished_loads = self._finished_loads, {}
            for req_id, results in self._held_load_results.items():
                self._load_results.setdefault(req_id, []).extend(results)
            self._held_load_results = {}
            return set(done), {req_id for req_id, ok in done.items() if not ok}, self._num_loads_owed

    def take_metadata(self, tp_rank: int) -> HybridStoreWorkerMetadata | None:
        """Everything reportable since the last call, or None when there is nothing."""
        with self._lock:
            meta = HybridStoreWorkerMetadata(
                loads=self._load_results,
                saves=self._save_results,
                saves_done={job_id: [tp_rank] for job_id in self._finished_saves},
            )
            self._load_results, self._save_results, self._finished_saves = {}, {}, []
        return None if meta.is_empty() else meta
