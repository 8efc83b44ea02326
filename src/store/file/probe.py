"""The read profile a benchmark hangs into a file store: where its reads spend their time.

Production installs none: ``FileBackend``'s read path then times nothing (no clock reads, no lock, no dict
update). ``hybridkv bench ttft`` installs one through ``FileBackend.install_read_probe`` and reads
:meth:`ReadProbe.totals` around each counted hit (see ``hybridkv_dev.bench.ttft``), next to the worker's
``hybridkv.connector.worker.load_probe.LoadProbe``.
"""

from __future__ import annotations

import threading

#: The keys of :meth:`ReadProbe.totals`: a count, the phases of one key's read in time order, then the CPU
#: time of the two phases that move bytes.
READ_PHASES = ("keys", "open_s", "read_s", "verify_s", "close_s", "read_cpu_s", "verify_cpu_s")


class ReadProbe:
    """Where a file store's reads spend their time, summed over keys since the probe was installed.

    :meth:`totals` keys: ``keys`` the keys asked for; ``open_s`` open + shared lock + the name check;
    ``read_s`` the readv into the caller's buffers; ``verify_s`` the frame check; ``close_s`` the mtime
    touch and close. Seconds of ``time.perf_counter()``, summed over reader threads (thread time: with
    several readers at once they add up to more than the wall time). ``read_cpu_s`` / ``verify_cpu_s``: the
    same two phases in the reading thread's CPU time (``time.thread_time()``); a phase's wall time above its
    CPU time is time the thread was runnable but not running (another thread had the core or the
    interpreter lock) or waited on the disk. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, float] = dict.fromkeys(READ_PHASES, 0.0)

    def totals(self) -> dict[str, float]:
        """A copy of the sums so far (see the class docstring)."""
        with self._lock:
            return dict(self._totals)

    def add_reads(
        self,
        num_keys: int,
        *,
        open_s: float,
        read_s: float,
        verify_s: float,
        close_s: float,
        read_cpu_s: float,
        verify_cpu_s: float,
    ) -> None:
        """One get call's keys and phase times."""
        with self._lock:
            totals = self._totals
            totals["keys"] += num_keys
            totals["open_s"] += open_s
            totals["read_s"] += read_s
            totals["verify_s"] += verify_s
            totals["close_s"] += close_s
            totals["read_cpu_s"] += read_cpu_s
            totals["verify_cpu_s"] += verify_cpu_s
