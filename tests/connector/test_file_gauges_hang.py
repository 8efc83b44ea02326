"""The worker's per-step gauges on a ``file://`` store whose file system hangs (issue 34, item 3): vLLM's
thread reads the tenant counters there, so the read must not wait past the store's deadline."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hybridkv.store.base import Status
from hybridkv.store.file.tenants import FileTenants
from hybridkv.store.quotas import write_quotas
from support.worker import make_worker

pytestmark = pytest.mark.vllm

#: How long the modelled hang lasts before a timer ends it; the deadline is 200 ms.
HANG_S = 10.0


def test_gauges_on_a_hung_file_system_answer_the_last_values_within_the_deadline(
    vllm_objs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws, _, _ = make_worker(vllm_objs, f"file://{tmp_path}/store?capacity=64MiB&timeout_ms=200")
    try:
        write_quotas(tmp_path / "store", {"ns": 1 << 20})
        assert ws._ctx.store.put(["hkv1/ns/x"], [np.ones(4096, dtype=np.uint8)]) == [Status.OK]
        metrics = ws._tenant_metrics
        metrics._next_read = float("-inf")
        before = ws.gauges()
        assert before["tenant_usage_bytes.ns"] >= 4096
        release = threading.Event()
        real = FileTenants.current

        def hung(self: FileTenants) -> dict[str, int]:  # every file-system call of the read starts here
            release.wait()
            return real(self)

        timer = threading.Timer(HANG_S, release.set)  # the hang ends by itself: code without a deadline
        timer.daemon = True  # returns, late, and fails the assertion below
        timer.start()

        monkeypatch.setattr(FileTenants, "current", hung)
        for _ in range(
            3
        ):  # each step reads (the interval forced): the first waits the deadline, the rest not
            metrics._next_read = float("-inf")
            during = ws.gauges()
            assert during["tenant_usage_bytes.ns"] == before["tenant_usage_bytes.ns"]
        assert not release.is_set(), "WorkerSide.gauges() waited for the hung file system"
        release.set()
    finally:
        ws.shutdown()
