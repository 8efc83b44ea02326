"""Fixtures for connector tests (helpers live in ``hybridkv_dev.devkit.cluster``)."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hybridkv.connector.scheduler.lookup_process import ProcessLookupService
from hybridkv_dev.devkit.cluster import make_vllm_objs


def lookup_children() -> list[int]:
    """The lookup processes (``python -m hybridkv.connector.scheduler.lookup_process``) this process started and
    that still run (not zombies). Linux only (``/proc``); elsewhere none are seen."""
    found: list[int] = []
    if not sys.platform.startswith("linux"):
        return found
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # it exited meanwhile
            continue
        # After the command name in parentheses: state, ppid.
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if (
            int(ppid) == me
            and state not in ("Z", "X")
            and b"hybridkv.connector.scheduler.lookup_process" in cmdline
        ):
            found.append(int(entry))
    return found


@pytest.fixture(scope="session", autouse=True)
def no_stray_lookup_processes() -> Iterator[None]:
    """At the end of the session no lookup process of the tests' still runs: every test that starts a
    connector with ``lookup_process`` closes it (``objs`` closes those its tests start)."""
    yield
    deadline = time.monotonic() + 5.0  # a close in the last test may still be reaping its child
    stray = lookup_children()
    while stray and time.monotonic() < deadline:
        time.sleep(0.05)
        stray = lookup_children()
    for pid in stray:
        os.kill(pid, signal.SIGKILL)
    assert not stray, f"lookup processes left running by the connector tests: {stray}"


@pytest.fixture(scope="session")
def vllm_objs() -> dict[str, Any]:
    return make_vllm_objs()


@pytest.fixture
def lookups_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``Scheduler.schedule()`` first lets the connector's background lookups finish.

    Lookups run off the scheduler thread and answer "ask again" until their result is in; a real engine
    simply asks again next step. Tests that script single steps use this to make "the result is in by
    the next step" deterministic (``test_async_lookup`` covers the asking-again path itself).
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule

    def settled_schedule(self: Any) -> Any:
        if self.connector is not None:
            lookups = self.connector.scheduler_side.lookups
            assert lookups.wait_idle(30.0), "background lookups did not finish in 30 s"
        return schedule(self)

    monkeypatch.setattr(Scheduler, "schedule", settled_schedule)


@pytest.fixture
def objs(
    vllm_objs: dict[str, Any], request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Any:
    """``vllm_objs`` with a store of its own (so entries other tests wrote or removed do not interfere):
    ``vc``, its ``store_url``, and ``extra`` (the connector's extra config, restored afterwards).

    Parametrized ``"process"`` (``support.scheduler.both_lookup_modes``): the store is a ``file://`` directory (no query,
    so a test may append one) and the lookups run in a lookup process; every lookup process the test
    starts is stopped afterwards (its schedulers are never shut down)."""
    extra = vllm_objs["vc"].kv_transfer_config.kv_connector_extra_config
    saved = dict(extra)
    started: list[ProcessLookupService] = []
    if getattr(request, "param", "thread") == "process":
        url = f"file://{tmp_path / 'store'}"
        extra["lookup_process"] = True
        init = ProcessLookupService.__init__

        def tracked_init(self: ProcessLookupService, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            started.append(self)

        monkeypatch.setattr(ProcessLookupService, "__init__", tracked_init)
    else:
        url = f"memory://own-{uuid.uuid4().hex[:8]}"
    extra["store"] = url
    try:
        yield {"vc": vllm_objs["vc"], "store_url": url, "extra": extra}
    finally:
        extra.clear()
        extra.update(saved)
        for lookups in started:
            lookups.close()
