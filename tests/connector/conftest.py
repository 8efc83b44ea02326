"""Fixtures for connector tests (helpers live in ``hybridkv.devkit.cluster``)."""

from __future__ import annotations

from typing import Any

import pytest
from hybridkv.devkit.cluster import make_vllm_objs


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
