"""Fixtures for connector tests (helpers live in ``hybridkv.devkit.cluster``)."""

from __future__ import annotations

import uuid
from pathlib import Path
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


@pytest.fixture
def objs(vllm_objs: dict[str, Any], request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """``vllm_objs`` with a store of its own (so entries other tests wrote or removed do not interfere):
    ``vc``, its ``store_url``, and ``extra`` (the connector's extra config, restored afterwards).

    Parametrized ``"process"`` (``support.scheduler.both_lookup_modes``): the store is a ``file://`` directory (no query,
    so a test may append one) and the lookups run in a lookup process."""
    extra = vllm_objs["vc"].kv_transfer_config.kv_connector_extra_config
    saved = dict(extra)
    if getattr(request, "param", "thread") == "process":
        url = f"file://{tmp_path / 'store'}"
        extra["lookup_process"] = True
    else:
        url = f"memory://own-{uuid.uuid4().hex[:8]}"
    extra["store"] = url
    try:
        yield {"vc": vllm_objs["vc"], "store_url": url, "extra": extra}
    finally:
        extra.clear()
        extra.update(saved)
