"""A lookup process that answers nothing, at vLLM's real ``Scheduler`` (``lookup_process: true``): requests
that arrive while it is stopped miss within a few engine steps (not the 5 s wall-clock limit of a lookup),
its unanswered searches open the lookup breaker, and it is killed and replaced: later lookups hit again."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Any

import pytest
from hybridkv.store import open_store
from support.scheduler import fill_store, make_request, make_scheduler

pytestmark = pytest.mark.vllm

RANKS = (0, 1)
#: One engine step: ``schedule()`` then this sleep. A lookup's wall-clock limit is 5 s: 500 steps.
STEP_S = 0.01
#: The most steps a step loop runs (far past the 5 s limit, so a request waiting that long is seen).
MAX_STEPS = 1500
#: A hit's lifecycle once answered: its load is planned in the step that answers it.
HIT = ("PARTIAL_HIT", "LOADING")


def _steps_to_answer(sched: Any, rids: list[str]) -> dict[str, int]:
    """Engine steps until each of ``rids`` has its lookup's answer (its lifecycle left ``LOOKUP``)."""
    side = sched.connector.scheduler_side
    steps: dict[str, int] = {}
    for step in range(1, MAX_STEPS + 1):
        sched.schedule()
        for rid in rids:
            lc = side.lifecycle(rid)
            if rid not in steps and lc is not None and lc.state not in ("NEW", "LOOKUP"):
                steps[rid] = step
        if len(steps) == len(rids):
            break
        time.sleep(STEP_S)
    return steps


def _stored_request(sched: Any, store: Any, rid: str, first: int) -> Any:
    """A 130-token request whose prefix of 128 is in the store (full attention and Mamba, both ranks).
    Each request its own prompt: one scheduled earlier has the same prompt in vLLM's own prefix cache."""
    request = make_request(rid, 130, first=first)
    fill_store(
        sched.connector.scheduler_side.scheme,
        store,
        list(request.block_hashes),
        [(0, 32), (0, 64), (0, 96), (0, 128), (1, 64), (1, 128)],
        RANKS,
    )
    return request


def _ask(sched: Any, store: Any, rid: str, first: int) -> tuple[str, int]:
    """Add request ``rid`` (its prefix stored); its lookup's outcome and the steps it took."""
    sched.add_request(_stored_request(sched, store, rid, first))
    steps = _steps_to_answer(sched, [rid])
    lc = sched.connector.scheduler_side.lifecycle(rid)
    return lc.state, steps.get(rid, MAX_STEPS)


def _ask_until_hit(sched: Any, store: Any, prefix: str, first: int, attempts: int) -> list[tuple[str, int]]:
    """Ask with new requests until one hits (at most ``attempts``); each that missed is aborted, so the
    requests that pile up while the store is unusable never fill the batch (nothing runs their forward)."""
    from vllm.v1.request import RequestStatus

    outcomes: list[tuple[str, int]] = []
    for attempt in range(attempts):
        rid = f"{prefix}{attempt}"
        state, num_steps = _ask(sched, store, rid, first + 1000 * attempt)
        outcomes.append((state, num_steps))
        if state in HIT:
            break
        sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        time.sleep(0.25)
    return outcomes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP")
@pytest.mark.parametrize("objs", ["process"], indirect=True)
def test_a_stopped_lookup_process_costs_requests_a_few_steps_and_is_replaced(objs: dict[str, Any]) -> None:
    objs["extra"]["lookup_budget_ms"] = 100
    sched = make_scheduler(objs["vc"])
    side = sched.connector.scheduler_side
    lookups = side.lookups
    assert lookups.wait_ready(60.0), "the lookup process never opened its store"
    store = open_store(objs["store_url"])
    # A loaded host may take longer than the 100 ms budget for one lookup: the child must answer one of a few.
    warm = _ask_until_hit(sched, store, "warm", 50_000, attempts=5)
    assert warm[-1][0] in HIT, f"the stored prefix must hit while the child answers: {warm}"
    pid = lookups.child_pid
    assert pid is not None
    try:
        os.kill(pid, signal.SIGSTOP)
        # Three requests arrive together: their searches go to the stopped child.
        for n, rid in enumerate(("w1", "w2", "w3"), start=1):
            sched.add_request(_stored_request(sched, store, rid, 5000 + 1000 * n))
        steps = _steps_to_answer(sched, ["w1", "w2", "w3"])
        states = {rid: side.lifecycle(rid).state for rid in steps}
        assert states == {"w1": "MISS", "w2": "MISS", "w3": "MISS"}, (states, steps)
        # 0.1 s of silence is about 10 steps; 5 s (what each waited before) about 500.
        assert max(steps.values()) <= 50, f"steps from arrival to the answer: {steps}"
        # One arriving while the child is silent: a miss at its first ask, no search sent.
        state, num_steps = _ask(sched, store, "w4", 9000)
        assert (state, num_steps) == ("MISS", 1)
        # The silent child is killed and a new one started.
        deadline = time.monotonic() + 60.0  # generous: it is killed after 2 s of silence
        while lookups.child_pid in (None, pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lookups.num_wedged == 1 and lookups.num_process_starts == 2
        assert lookups.child_pid not in (None, pid)
        # Its three unanswered searches counted on the lookup breaker and opened it (3 failures open it).
        breaker = side.lookup_breaker
        assert breaker.num_opens >= 1 and breaker.num_failures >= 3, breaker.snapshot()
        assert side.stats.totals["lookup_errors"] >= 3
        # Later lookups hit again (once the breaker half-opens and the new child has opened its store).
        outcomes = _ask_until_hit(sched, store, "again", 10_000, attempts=20)
        assert outcomes[-1][0] in HIT, outcomes
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
