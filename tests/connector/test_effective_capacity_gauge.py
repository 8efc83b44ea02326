"""The workers' ``store_effective_capacity_bytes`` gauge (issue 37, item 2): a ``file://`` store's effective
capacity, sent with every step's stats; tests/store/test_full_disk.py shows it drop to a full disk's size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.worker import make_worker

pytestmark = pytest.mark.vllm


def test_a_worker_on_a_file_store_sends_its_effective_capacity(
    vllm_objs: dict[str, Any], tmp_path: Path
) -> None:
    ws, _, _ = make_worker(vllm_objs, f"file://{tmp_path}/store?capacity=64MiB")
    try:
        assert ws.gauges()["store_effective_capacity_bytes"] == 64 << 20
    finally:
        ws.shutdown()
