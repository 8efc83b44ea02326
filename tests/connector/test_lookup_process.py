"""``ProcessLookupService`` (``lookup_process: true``): the same answers as the thread service from a child
process over its own client of the store; a child killed mid-call is a miss and a restart, never a stall;
a child that answers nothing is noticed, counted on the breaker, killed and replaced; no child outlives
its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.scheduler.lookup_process import RESTART_BACKOFF_S, ProcessLookupService
from hybridkv.connector.scheduler.lookup_service import LookupService, LookupTask
from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme, Topology
from hybridkv.lifecycle.lookup import LookupResult, LookupSearch, portable_result, result_from_portable
from hybridkv.lifecycle.save import plan_save
from hybridkv.store import open_store
from hybridkv.store.breaker import CircuitBreaker
from hybridkv.store.url import lookup_client_url
from hybridkv.testing.lifecycle_fuzz import family_hashes

UNIT = 64
DCP = 4


def _scheme() -> KeyScheme:
    geometry = Geometry(
        groups=(GroupSpec.full(UNIT, layout="mla"), GroupSpec.mamba(UNIT)),
        topology=Topology(tp_size=DCP, dcp_size=DCP),
        prefix_match_unit=UNIT,
    )
    return KeyScheme(namespace="proc", model="m", geometry=geometry)


def _store_prefix(
    url: str, scheme: KeyScheme, hashes: tuple[bytes, ...], num_blocks: int, *, states: list[int]
) -> None:
    """Every rank's attention blocks up to ``num_blocks`` hash units (whole attention blocks: a DCP-sharded
    block spans ``DCP`` units) and a Mamba state at each of ``states``."""
    span = UNIT * DCP
    plan = plan_save(
        scheme,
        hashes,
        {0: [b for b in range(span, num_blocks * UNIT + 1, span)], 1: [b * UNIT for b in states]},
    )
    store = open_store(url)
    try:
        keys = [key for _, key in plan.entries]
        store.put(keys, [b"kv"] * len(keys))
    finally:
        store.close()


def _breaker() -> CircuitBreaker:
    return CircuitBreaker(num_failures_to_open=3, reset_s=1.0)


def _answer(service: LookupService | ProcessLookupService, task: LookupTask) -> LookupTask:
    service.submit(task)
    assert service.wait_idle(30.0), f"lookup of {task.request_id} did not finish"
    assert task.done
    return task


def _same(a: LookupResult, b: LookupResult) -> None:
    assert (a.boundary, a.num_tokens, a.num_computed_tokens) == (
        b.boundary,
        b.num_tokens,
        b.num_computed_tokens,
    )
    assert a.group_hit_tokens == b.group_hit_tokens
    assert (a.plan is None) == (b.plan is None)
    if a.plan is not None and b.plan is not None:
        assert a.plan.loads == b.plan.loads
        assert a.plan.block_indexes_by_group == b.plan.block_indexes_by_group
        assert a.plan.entries == b.plan.entries


def test_portable_result_round_trips_a_plan() -> None:
    scheme = _scheme()
    hashes = tuple(family_hashes(3, 40))
    known: dict[str, bool] = {}
    search = LookupSearch(scheme, hashes, 40 * UNIT + 1, 0, known=known)
    # Present: attention up to unit 32 on every rank, states at 8 and 32.
    plan = plan_save(
        scheme, hashes, {0: list(range(DCP * UNIT, 32 * UNIT + 1, DCP * UNIT)), 1: [8 * UNIT, 32 * UNIT]}
    )
    present = {key for _, key in plan.entries}
    result = search.run(lambda keys: [key in present for key in keys])
    assert result.boundary == 32 * UNIT and result.plan is not None and result.plan.loads
    _same(result, result_from_portable(portable_result(result), scheme, hashes))


def test_the_process_answers_as_the_thread_service(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}?capacity=64MiB"
    scheme = _scheme()
    families = {f: tuple(family_hashes(f, 48)) for f in range(4)}
    _store_prefix(url, scheme, families[0], 40, states=[8, 24, 40])
    _store_prefix(url, scheme, families[1], 20, states=[20])
    _store_prefix(url, scheme, families[2], 12, states=[16])  # a state past its attention prefix
    # A hole on one rank: the block ending at unit 16 of family 1 (no state below it: a miss).
    hole = [key for _, key in plan_save(scheme, families[1], {0: [16 * UNIT]}).entries][3]
    store = open_store(url)
    store.remove([hole])
    store.close()
    asks = [
        (f, n, c) for f in families for n, c in ((48 * UNIT, 0), (30 * UNIT + 5, 0), (48 * UNIT, 8 * UNIT))
    ]
    thread = LookupService(open_store(url), breaker=_breaker(), budget_s=5.0)
    process = ProcessLookupService(
        url, breaker=_breaker(), budget_s=5.0, breaker_failures=3, breaker_reset_s=1.0
    )
    boundaries: list[int] = []
    try:
        for family, num_tokens, num_computed in asks:
            hashes = families[family]
            tasks = [
                LookupTask(
                    f"r{family}",
                    LookupSearch(scheme, hashes, num_tokens, num_computed),
                    (num_tokens, num_computed, None),
                )
                for _ in range(2)
            ]
            by_thread = _answer(thread, tasks[0])
            by_process = _answer(process, tasks[1])
            assert by_thread.error is None and by_process.error is None, (by_thread.error, by_process.error)
            assert by_thread.search.result is not None and by_process.search.result is not None
            _same(by_thread.search.result, by_process.search.result)
            boundaries.append(by_process.search.result.boundary // UNIT)
        # Family 0 hits its deepest state under each cap; family 1's hole at block 17 leaves no state
        # below it; family 2's state at 16 stands past its 12 attention blocks; family 3 has nothing.
        assert boundaries == [40, 24, 40, 0, 0, 0, 0, 0, 0, 0, 0, 0], boundaries
        assert process.num_searches == len(asks) and process.num_exists_calls > 0
    finally:
        thread.close()
        process.close()


def test_facts_stay_in_the_child_per_epoch(tmp_path: Path) -> None:
    """A second search of one request in one facts epoch answers from the child's facts (no store call);
    a new epoch asks the store again."""
    url = f"file://{tmp_path / 'store'}?capacity=64MiB"
    scheme = _scheme()
    hashes = tuple(family_hashes(5, 32))
    _store_prefix(url, scheme, hashes, 32, states=[16, 32])
    process = ProcessLookupService(
        url, breaker=_breaker(), budget_s=5.0, breaker_failures=3, breaker_reset_s=1.0
    )
    try:
        first = _answer(
            process, LookupTask("r", LookupSearch(scheme, hashes, 32 * UNIT + 1, 0), (32 * UNIT + 1, 0, None))
        )
        assert first.search.result is not None and first.search.result.boundary == 32 * UNIT
        calls = process.num_exists_calls
        again = _answer(
            process,
            LookupTask(
                "r", LookupSearch(scheme, hashes, 32 * UNIT + 1, 16 * UNIT), (32 * UNIT + 1, 16 * UNIT, None)
            ),
        )
        assert again.search.result is not None and again.search.result.boundary == 32 * UNIT
        assert process.num_exists_calls == calls, "the second search of the epoch asked the store"
        fresh = _answer(
            process,
            LookupTask(
                "r", LookupSearch(scheme, hashes, 32 * UNIT + 1, 0), (32 * UNIT + 1, 0, None), facts_epoch=1
            ),
        )
        assert fresh.search.result is not None and fresh.search.result.boundary == 32 * UNIT
        assert process.num_exists_calls > calls, "a new facts epoch answered from the old facts"
    finally:
        process.close()


def test_a_killed_lookup_process_is_a_miss_and_a_restart(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    scheme = _scheme()
    hashes = tuple(family_hashes(6, 16))
    _store_prefix(f"file://{directory}?capacity=64MiB", scheme, hashes, 16, states=[16])
    # Every exists of the child's client sleeps 2 s: long enough to kill the child inside one.
    breaker = _breaker()
    process = ProcessLookupService(
        f"faulty+file://{directory}?capacity=64MiB&delay_ms=2000",
        breaker=breaker,
        budget_s=0.5,
        breaker_failures=3,
        breaker_reset_s=1.0,
    )
    try:
        task = LookupTask("r", LookupSearch(scheme, hashes, 16 * UNIT + 1, 0), (16 * UNIT + 1, 0, None))
        process.submit(task)
        deadline = time.monotonic() + 30.0
        while not process.stalled() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert process.stalled(), "the child's 2 s store call never showed as stalled past the 0.5 s budget"
        pid = process.child_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert process.wait_idle(10.0), "the killed child's lookup never finished"
        assert task.error is not None and "lookup process exited" in task.error, task.error
        assert not process.stalled(), "a dead child's call still counts as in flight"
        # The next searches start a new child (after the backoff): one answers, with the hit.
        time.sleep(RESTART_BACKOFF_S)
        answered = None
        for attempt in range(10):
            again = _answer(
                process,
                LookupTask(
                    f"r{attempt}", LookupSearch(scheme, hashes, 16 * UNIT + 1, 0), (16 * UNIT + 1, 0, None)
                ),
            )
            if again.error is None:
                answered = again
                break
            time.sleep(RESTART_BACKOFF_S)
        assert answered is not None and answered.search.result is not None
        assert answered.search.result.boundary == 16 * UNIT
        assert process.num_process_starts == 2
        assert process.child_pid not in (None, pid)
    finally:
        process.close()


def test_lookup_process_needs_a_store_other_processes_open(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\['lookup_process'\].*memory://"):
        ConnectorConfig.from_extra_config({"store": "memory://x", "lookup_process": True}, model="m")
    with pytest.raises(ValueError, match=r"\['lookup_process'\]: expected true or false"):
        ConnectorConfig.from_extra_config({"store": f"file://{tmp_path}", "lookup_process": "yes"}, model="m")
    cfg = ConnectorConfig.from_extra_config(
        {"store": f"file://{tmp_path}", "lookup_process": True}, model="m"
    )
    assert cfg.lookup_process


def test_a_mooncake_lookup_client_mounts_no_segment() -> None:
    assert lookup_client_url("mooncake://127.0.0.1:5000?segment=1GiB&timeout_ms=500") == (
        "mooncake://127.0.0.1:5000?timeout_ms=500&segment=0"
    )
    assert lookup_client_url("file:///tmp/s?capacity=1GiB") == "file:///tmp/s?capacity=1GiB"


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux: ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _hit_again(process: ProcessLookupService, scheme: KeyScheme, hashes: tuple[bytes, ...]) -> LookupTask:
    """Search ``hashes`` until one answers (a replaced child may still be starting, or backing off)."""
    for attempt in range(20):
        task = _answer(
            process,
            LookupTask(
                f"again{attempt}", LookupSearch(scheme, hashes, 16 * UNIT + 1, 0), (16 * UNIT + 1, 0, None)
            ),
        )
        if task.error is None:
            return task
        time.sleep(RESTART_BACKOFF_S)
    raise AssertionError(f"no search answered after the child was replaced: {task.error}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_silent_lookup_process_is_stalled_counted_killed_and_replaced(tmp_path: Path) -> None:
    """A stopped child (it answers nothing, yet does not exit): past the budget the service is ``stalled``
    (the scheduler misses new lookups at once), each unanswered search counts a failure on the breaker, and
    past ``wedged_after_s`` the child is killed, its searches end as errors and a new child answers."""
    url = f"file://{tmp_path / 'store'}?capacity=64MiB"
    scheme = _scheme()
    hashes = tuple(family_hashes(7, 16))
    _store_prefix(url, scheme, hashes, 16, states=[16])
    breaker = _breaker()
    process = ProcessLookupService(
        url, breaker=breaker, budget_s=0.1, breaker_failures=3, breaker_reset_s=1.0
    )
    pid = None
    try:
        assert process.wait_ready(60.0)
        first = _hit_again(process, scheme, hashes)
        assert first.search.result is not None and first.search.result.boundary == 16 * UNIT
        pid = process.child_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        tasks = [
            LookupTask(f"s{i}", LookupSearch(scheme, hashes, 16 * UNIT + 1, 0), (16 * UNIT + 1, 0, None))
            for i in range(3)
        ]
        for task in tasks:
            process.submit(task)
        deadline = time.monotonic() + 30.0  # generous: the budget is 0.1 s
        while not process.stalled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process.stalled(), "a stopped child that owes three answers never showed as stalled"
        assert not any(task.done for task in tasks)
        # Killed past ``wedged_after_s`` (2 s here): its searches end as errors, each counted once on the
        # breaker (unanswered past the budget) and the exit once more.
        assert process.wait_idle(30.0), "the stopped child's searches never ended"
        assert all(task.error is not None and "lookup process exited" in task.error for task in tasks)
        assert process.num_wedged == 1
        assert breaker.num_failures == 4 and breaker.num_opens == 1, breaker.snapshot()
        assert not _running(pid), "the stopped child still runs"
        assert not process.stalled()
        # Replaced: a new child answers with the hit.
        again = _hit_again(process, scheme, hashes)
        assert again.search.result is not None and again.search.result.boundary == 16 * UNIT
        assert process.num_process_starts == 2 and process.child_pid not in (None, pid)
    finally:
        process.close()
        if pid is not None and _running(pid):
            os.kill(pid, signal.SIGKILL)


#: A stand-in for an engine: starts the lookup process as the connector does, prints its pid, waits.
_ENGINE = """
import sys, time
from hybridkv.connector.scheduler.lookup_process import ProcessLookupService
from hybridkv.store.breaker import CircuitBreaker

lookups = ProcessLookupService(
    sys.argv[1],
    breaker=CircuitBreaker(num_failures_to_open=3, reset_s=1.0),
    budget_s=0.2,
    breaker_failures=3,
    breaker_reset_s=1.0,
)
assert lookups.wait_ready(60.0), "the lookup process never opened its store"
print(lookups.child_pid, flush=True)
time.sleep(600.0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG")
@pytest.mark.parametrize("wedged", [False, True], ids=["idle", "stopped"])
def test_an_engine_killed_with_sigkill_leaves_no_lookup_process(tmp_path: Path, wedged: bool) -> None:
    """``stopped``: a child that cannot even see its parent's end of the socket close (stopped, or stuck in
    a call) must end with its parent too."""
    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE, f"file://{tmp_path / 'store'}"], stdout=subprocess.PIPE, text=True
    )
    child_pid = None
    try:
        assert engine.stdout is not None
        child_pid = int(engine.stdout.readline())
        assert _running(child_pid)
        if wedged:
            os.kill(child_pid, signal.SIGSTOP)
        engine.kill()  # SIGKILL: nothing of the engine's runs to stop its child
        engine.wait()
        deadline = time.monotonic() + 30.0  # generous: the kernel kills it at once
        while _running(child_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _running(child_pid), f"lookup process {child_pid} outlived its engine"
    finally:
        engine.kill()
        engine.wait()
        if child_pid is not None and _running(child_pid):
            os.kill(child_pid, signal.SIGKILL)
