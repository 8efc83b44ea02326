"""Where a step's time goes: vLLM's ``schedule()``, the connector's own hooks on the scheduler thread, and its
waits."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def _percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Step:
    """One step: ``schedule()``'s wall time, whether it scheduled tokens, and the connector's share."""

    total_s: float
    busy: bool
    in_schedule_s: float = 0.0  # the connector's own calls inside schedule()
    in_schedule_wait_s: float = 0.0  # its idle-step wait inside schedule() (hybridkv)
    connector_s: float = 0.0  # all its own calls of the step (schedule(), finish, output)
    wait_s: float = 0.0

    def total(self) -> float:
        return self.total_s

    def in_schedule(self) -> float:
        return self.in_schedule_s

    def vllm(self) -> float:
        return self.total_s - self.in_schedule_s - self.in_schedule_wait_s

    def connector(self) -> float:
        return self.connector_s

    def connector_with_wait(self) -> float:
        return self.connector_s + self.wait_s


def percentile_99(samples: Sequence[float]) -> float:
    return _percentile(samples, 0.99)


def ms_of(
    stat: Callable[[list[float]], float], steps: Sequence[Step], value: Callable[[Step], float]
) -> float:
    return stat([value(s) for s in steps]) * 1e3


class ConnectorClock:
    """Times the connector's scheduler-side calls of one step (``own_s``, ``wait_s``; ``reset`` by the caller).

    Every hook vLLM's scheduler calls on the connector object (``HOOKS``, those it has), timed at the outermost
    call only (a hook calling another, e.g. ``request_finished`` -> ``request_finished_all_groups``, counts
    once). hybridkv's wait of a step that scheduled nothing (``LookupService.wait_for_progress``) is counted
    apart (``wait_s``) and left out of ``own_s``: it is the connector handing the interpreter to its lookup
    thread, not work on the step's path. ``calls``: per hook, (wall s, this thread's CPU s) of every call
    (the wait left out of both), for the breakdown: wall well above CPU is the scheduler thread waiting (for
    the GIL, a lock or a reply)."""

    HOOKS = (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",
        "request_finished_all_groups",
        "register_finished_partial_tail",
        "update_connector_output",
        "has_pending_block_frees",
        "has_pending_push_work",
        "get_loaded_kv_cache_group_ids",
        "get_external_cache_hit_sources",
        "on_new_request",
    )

    def __init__(self, connector: Any) -> None:
        self.own_s = 0.0
        self.wait_s = 0.0
        self.calls: dict[str, list[tuple[float, float]]] = {}
        self._depth = 0
        self._waited_in_call_s = 0.0
        for name in self.HOOKS:
            if callable(getattr(connector, name, None)):
                setattr(connector, name, self._timed_hook(name, getattr(connector, name)))
        side = getattr(connector, "scheduler_side", None)
        if side is not None:
            side.lookups.wait_for_progress = self._timed_wait(side.lookups.wait_for_progress)

    def reset(self) -> None:
        self.own_s = self.wait_s = 0.0

    def _timed_hook(self, name: str, call: Any) -> Any:
        samples = self.calls.setdefault(name, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return call(*args, **kwargs)  # inside another hook, which is timed
            self._depth = 1
            self._waited_in_call_s = 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                wall = time.perf_counter() - t0 - self._waited_in_call_s
                cpu = time.thread_time() - c0
                self._depth = 0
                self.own_s += wall
                samples.append((wall, cpu))

        return timed

    def _timed_wait(self, call: Any) -> Any:
        samples = self.calls.setdefault("(idle-step wait_for_progress)", [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                waited = time.perf_counter() - t0
                samples.append((waited, time.thread_time() - c0))
                self.wait_s += waited
                self._waited_in_call_s += waited  # inside a hook: not the hook's own time

        return timed

    def breakdown(self) -> dict[str, dict[str, float]]:
        """Per hook called: calls, total ms, p99 / max ms of a call (wall), p99 ms of its thread CPU."""
        return {
            name: {
                "calls": len(samples),
                "total_ms": sum(w for w, _ in samples) * 1e3,
                "p99_ms": percentile_99([w for w, _ in samples]) * 1e3,
                "max_ms": max(w for w, _ in samples) * 1e3,
                "cpu_p99_ms": percentile_99([c for _, c in samples]) * 1e3,
            }
            for name, samples in self.calls.items()
            if samples
        }
