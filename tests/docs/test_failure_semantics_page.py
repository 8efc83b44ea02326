"""docs/failure-semantics.md: the failed-load row names every field of the log line the scheduler writes."""

from __future__ import annotations

import random
from typing import Any

import pytest
from support.docs import DOCS, names, table_rows

MESSAGE = "hybridkv load failed; request recomputes"


def failed_load_log_lines() -> list[dict[str, Any]]:
    """The scheduler's log lines for ``MESSAGE`` in a real failed load: vLLM's ``Scheduler`` with the connector
    and two simulated TP ranks; a prompt stored by a first engine, then loaded by a second whose rank 1 fails
    every read (the request is truncated, retried and recomputed)."""
    from hybridkv_dev.devkit.cluster import Cluster, hybrid_config
    from structlog.testing import capture_logs

    vc, kvc = hybrid_config("full_mamba", dcp=1, tp=2)
    rng = random.Random(9)
    prompt = [rng.randrange(3, 30000) for _ in range(100)]
    cold = Cluster(vc, kvc)
    try:
        cold.add("stored", prompt)
        cold.run()
    finally:
        cold.shutdown()
    warm = Cluster(vc, kvc)
    try:
        warm.faults[1].fail_all = True
        with capture_logs() as logs:
            warm.add("failed", prompt)
            warm.run()
    finally:
        warm.shutdown()
    return [line for line in logs if line["event"] == MESSAGE]


@pytest.mark.vllm
def test_failed_load_log_fields_are_documented() -> None:
    """The failed-load row of docs/failure-semantics.md names every field of the log line the scheduler writes."""
    pytest.importorskip("vllm")
    lines = failed_load_log_lines()
    assert lines, f"no {MESSAGE!r} log line in a failed load"
    fields = set(lines[0]) - {"event", "log_level", "request_id"}
    assert {"boundary", "retry_cap"} <= fields, f"the log line lacks its documented core: {sorted(fields)}"
    rows = [row for row in table_rows(DOCS / "failure-semantics.md", "event") if MESSAGE in " ".join(row)]
    assert len(rows) == 1, f"docs/failure-semantics.md: no single summary row naming `{MESSAGE}`"
    documented = set(names(rows[0][-1]))
    assert fields <= documented, (
        f"failure-semantics.md: log fields {sorted(fields - documented)} not documented"
    )
